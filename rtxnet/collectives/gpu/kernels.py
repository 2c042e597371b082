"""Reduction and copy kernels of the CUDA IPC collectives: CUDA C compiled by NVRTC, no headers.

Legend: ``count`` is in elements, ``nbytes`` in bytes; a pointer is a device address (``int``)
usable on ``device``: its own memory or a peer's, mapped through CUDA IPC.

One kernel per (dtype, op, source bucket), generated from one template by a few typedefs and three
device functions:

- ``T``: the storage type (float16 and bfloat16 as their 16 bits, bool as a byte);
- ``ACC``: the accumulation type, as :func:`rtxnet.collectives.reduce_ops.acc_dtype` (float32 for
  the half types), and ``WT``, the type sums and products are done in (unsigned for integers, so
  that overflow wraps as in NumPy, without C++'s undefined signed overflow);
- ``ld`` (``T`` to ``ACC``; float16 through ``cvt.f32.f16``, bfloat16 by a 16-bit shift),
  ``combine`` (one op; MIN/MAX as NumPy's scalar ``np.minimum``/``np.maximum``: ``a`` if
  ``a < b`` or ``a`` is NaN, else ``b``, so NaN propagates) and ``st`` (``ACC`` to ``T``, rounded to
  nearest even once: ``cvt.rn.f16.f32``, or the bfloat16 routine below).

Every thread reads element i of all sources before it writes element i of any destination, and
no two threads touch the same element, so a destination may be one of the sources (in-place
all-reduce); ranges that overlap in any other way are not supported.

When every pointer has the same address modulo 16, the elements before the first 16-byte boundary
(``head``) and after the last whole 16-byte vector are done one per thread, and the rest as 16-byte
``uint4`` loads and stores of V = 16 / itemsize elements, all sources loaded before any is combined
so their loads are in flight together (:func:`vector_split`); otherwise every element is done one
per thread. Loops are grid-stride, ``BLOCK`` threads a block, ``BLOCKS_PER_SM`` blocks per SM at
most. Registers are sized for the most sources a kernel reads, so each (dtype, op) has a kernel per
bucket of :data:`SRC_BUCKETS` (2 sources: about 40 registers a thread, 16: about 90 to 128, from
``ptxas -v`` for sm_90), compiled on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from rtxnet.collectives.gpu.stream import foreign_stream
from rtxnet.collectives.reduce_ops import ReduceOp, check_op_dtype, dtype_name

__all__ = ["MAX_POINTERS", "SRC_BUCKETS", "LaunchPlan", "launch_reduce", "plan_reduce", "grid_blocks",
           "copy", "kernel_source", "kernel_name", "vector_split"]

MAX_POINTERS = 16       # per side: srcs and dsts are kernel parameters, 8 bytes each
BLOCK = 512             # threads per block
BLOCKS_PER_SM = 4       # grid = SM count x this, capped by the work (grid-stride loops)
VEC_NBYTES = 16         # one uint4
SRC_BUCKETS = (2, 4, 8, 16)  # kernels compiled per most sources read (registers per thread)
_COMPILE_OPTIONS = ("--fmad=false",)  # no contraction: results equal the CPU path's bit for bit

_IDENT_LD, _IDENT_ST = "return (ACC)x;", "return (T)a;"
# bfloat16 from float32, round to nearest even; NaN becomes the quiet NaN 0x7fc0 with the input's
# sign, as ml_dtypes converts (tests/gpu/test_kernels_compile.py mirrors this bit for bit).
_BF16_ST = ("unsigned int u = __float_as_uint(a); "
            "if ((u & 0x7fffffffu) > 0x7f800000u) return (T)(((u >> 16) & 0x8000u) | 0x7fc0u); "
            "return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);")
# dtype name: (T, ACC, WT, body of ld(T x), body of st(ACC a))
_TYPES: dict[str, tuple[str, str, str, str, str]] = {
    "float16": ("unsigned short", "float", "float",
                'float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;',
                'T h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(a)); return h;'),
    "bfloat16": ("unsigned short", "float", "float",
                 "return __uint_as_float(((unsigned int)x) << 16);", _BF16_ST),
    "float32": ("float", "float", "float", _IDENT_LD, _IDENT_ST),
    "float64": ("double", "double", "double", _IDENT_LD, _IDENT_ST),
    "int8": ("signed char", "signed char", "unsigned int", _IDENT_LD, _IDENT_ST),
    "int16": ("short", "short", "unsigned int", _IDENT_LD, _IDENT_ST),
    "int32": ("int", "int", "unsigned int", _IDENT_LD, _IDENT_ST),
    "int64": ("long long", "long long", "unsigned long long", _IDENT_LD, _IDENT_ST),
    "uint8": ("unsigned char", "unsigned char", "unsigned int", _IDENT_LD, _IDENT_ST),
    # bool: raw bytes combined as unsigned MIN/MAX (nonzero iff all/any is), made 0/1 once on
    # store; normalising every load instead costs registers (spills at 8 and 16 sources)
    "bool": ("unsigned char", "unsigned char", "unsigned int", _IDENT_LD, "return (T)(a != 0);"),
}
_ADD = "return (ACC)((WT)a + (WT)b);"
_MIN = "return (a < b || a != a) ? a : b;"
_MAX = "return (a > b || a != a) ? a : b;"
_COMBINE = {ReduceOp.SUM: _ADD, ReduceOp.AVG: _ADD, ReduceOp.PROD: "return (ACC)((WT)a * (WT)b);",
            ReduceOp.MIN: _MIN, ReduceOp.MAX: _MAX}

_TEMPLATE = r"""// rtxnet @NAME@: generated by rtxnet.collectives.gpu.kernels (no headers needed)
typedef @T@ T;
typedef @ACC@ ACC;
typedef @WT@ WT;
#define V @V@
#define FINISH(a) @FINISH@
union Pack { uint4 u; T e[V]; };
static __device__ __forceinline__ ACC ld(T x) { @LD@ }
static __device__ __forceinline__ T st(ACC a) { @ST@ }
static __device__ __forceinline__ ACC combine(ACC a, ACC b) { @COMBINE@ }

#define VLOAD(k) Pack p##k; if (nsrc > k) p##k.u = ((const uint4*)s##k)[v]
#define VFOLD(k) if (nsrc > k) { _Pragma("unroll") for (int e = 0; e < V; ++e) \
                                   a[e] = combine(a[e], ld(p##k.e[e])); }
#define VSTORE(k) if (ndst > k) ((uint4*)d##k)[v] = out.u
#define SLOAD(k) T x##k; if (nsrc > k) x##k = ((const T*)s##k)[i]
#define SFOLD(k) if (nsrc > k) a = combine(a, ld(x##k))
#define SSTORE(k) if (ndst > k) ((T*)d##k)[i] = r

extern "C" __global__ void __launch_bounds__(@BLOCK@) @NAME@(
    @PARAMS@,
    const int nsrc, const int ndst, const long long head, const long long nvec,
    const long long count, const double avg_n)
{
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long nthreads = (long long)gridDim.x * blockDim.x;
  for (long long v = tid; v < nvec; v += nthreads) {
    @VLOAD@;
    ACC a[V];
    _Pragma("unroll") for (int e = 0; e < V; ++e) a[e] = ld(p0.e[e]);
    @VFOLD@;
    Pack out;
    _Pragma("unroll") for (int e = 0; e < V; ++e) out.e[e] = st(FINISH(a[e]));
    @VSTORE@;
  }
  const long long nscalar = count - nvec * V;
  for (long long j = tid; j < nscalar; j += nthreads) {
    const long long i = (j < head ? j : j + nvec * V) - head;  // from element head
    @SLOAD@;
    ACC a = ld(x0);
    @SFOLD@;
    const T r = st(FINISH(a));
    @SSTORE@;
  }
}
"""


def kernel_name(dtype: np.dtype, rop: ReduceOp, max_srcs: int = MAX_POINTERS) -> str:
    """The ``extern "C"`` name of a kernel, e.g. ``rtx_reduce_bfloat16_sum_s8``."""
    return f"rtx_reduce_{dtype_name(dtype)}_{ReduceOp(rop).value}_s{max_srcs}"


def kernel_source(dtype: np.dtype, rop: ReduceOp, max_srcs: int = MAX_POINTERS) -> str:
    """The CUDA C source of the reduction kernel for ``(dtype, rop)`` (compiles without headers).

    Args:
        max_srcs: the most sources the kernel reads (one of :data:`SRC_BUCKETS`); its parameters
            are always ``MAX_POINTERS`` sources and destinations, but registers are sized for
            ``max_srcs`` loads in flight, so fewer sources get more threads per SM.

    Raises:
        ValueError: unsupported dtype, an op the dtype has no meaning for
            (:func:`rtxnet.collectives.reduce_ops.check_op_dtype`), or ``max_srcs`` not a bucket.
    """
    dtype = np.dtype(dtype)
    rop = check_op_dtype(rop, dtype)
    if max_srcs not in SRC_BUCKETS:
        raise ValueError(f"max_srcs({max_srcs}) must be one of {SRC_BUCKETS}")
    name = dtype_name(dtype)
    t, acc, wt, ld, st = _TYPES[name]
    combine = _MAX if name == "bool" and rop is ReduceOp.SUM else _COMBINE[rop]  # or = max of 0/1
    ks, ss = range(MAX_POINTERS), range(max_srcs)
    subs = {
        "NAME": kernel_name(dtype, rop, max_srcs), "T": t, "ACC": acc, "WT": wt, "LD": ld, "ST": st,
        "V": str(VEC_NBYTES // dtype.itemsize), "COMBINE": combine, "BLOCK": str(BLOCK),
        "FINISH": "((a) / (ACC)avg_n)" if rop is ReduceOp.AVG else "(a)",
        "PARAMS": ", ".join([f"const char* const s{k}" for k in ks]
                            + [f"char* const d{k}" for k in ks]),
        "VLOAD": "; ".join(f"VLOAD({k})" for k in ss),
        "VFOLD": "; ".join(f"VFOLD({k})" for k in ss[1:]) or "(void)0",
        "VSTORE": "; ".join(f"VSTORE({k})" for k in ks),
        "SLOAD": "; ".join(f"SLOAD({k})" for k in ss),
        "SFOLD": "; ".join(f"SFOLD({k})" for k in ss[1:]) or "(void)0",
        "SSTORE": "; ".join(f"SSTORE({k})" for k in ks),
    }
    src = _TEMPLATE
    for key, val in subs.items():
        src = src.replace(f"@{key}@", val)
    return src


def vector_split(ptrs: Sequence[int], count: int, itemsize: int) -> tuple[int, int]:
    """``(head, nvec)``: the elements done one per thread before the first 16-byte boundary, and
    the whole 16-byte vectors after them; ``(0, 0)`` (all one per thread) when the pointers differ
    modulo 16. The elements after the vectors are done one per thread too."""
    offset = ptrs[0] % VEC_NBYTES
    if any(p % VEC_NBYTES != offset for p in ptrs):
        return 0, 0
    head = min(count, (VEC_NBYTES - offset) % VEC_NBYTES // itemsize)
    return head, (count - head) // (VEC_NBYTES // itemsize)


def _check_pointers(side: str, ptrs: Sequence[int]) -> list[int]:
    ptrs = [int(p) for p in ptrs]
    if not 1 <= len(ptrs) <= MAX_POINTERS:
        raise ValueError(f"{side} has {len(ptrs)} pointers; 1 to {MAX_POINTERS} are supported")
    return ptrs


def _check_aligned(side: str, ptrs: list[int], itemsize: int) -> None:
    for k, p in enumerate(ptrs):
        if p <= 0 or p % itemsize:
            raise ValueError(f"{side}[{k}] = {p:#x} is null or not a multiple of the itemsize "
                             f"({itemsize} bytes)")


_kernels: dict[tuple[np.dtype, ReduceOp, int], Any] = {}  # cupy.RawKernel
_sm_counts: dict[int, int] = {}


class LaunchPlan(NamedTuple):
    """What :func:`launch_reduce` hands the kernel, computed without a device.

    Attributes:
        max_srcs: the source bucket (:data:`SRC_BUCKETS`) whose kernel runs.
        args: the kernel's arguments in order: ``MAX_POINTERS`` source and ``MAX_POINTERS``
            destination addresses (``uint64``, unused ones 0, each advanced by ``head``
            elements), then ``nsrc``, ``ndst`` (``int32``), ``head``, ``nvec``, ``count``
            (``int64``) and ``avg_n`` (``float64``).
        work: loop iterations the widest of the kernel's two loops has (grid sizing).
    """

    max_srcs: int
    args: tuple
    work: int


def plan_reduce(srcs: Sequence[int], dsts: Sequence[int], count: int, dtype: np.dtype,
                rop: ReduceOp, *, avg_n: int = 1) -> LaunchPlan | None:
    """Check :func:`launch_reduce`'s arguments and compute its launch; None when ``count`` is 0
    (nothing to enqueue). Needs no CuPy and no device.

    Raises:
        ValueError: as :func:`launch_reduce`.
    """
    dtype = np.dtype(dtype)
    rop = check_op_dtype(rop, dtype)
    srcs, dsts = _check_pointers("srcs", srcs), _check_pointers("dsts", dsts)
    if count < 0 or avg_n < 1:
        raise ValueError(f"count({count}) must be >= 0 and avg_n({avg_n}) >= 1")
    if count == 0:  # empty arrays may have null pointers
        return None
    _check_aligned("srcs", srcs, dtype.itemsize)
    _check_aligned("dsts", dsts, dtype.itemsize)
    head, nvec = vector_split(srcs + dsts, count, dtype.itemsize)
    work = max(nvec, count - nvec * (VEC_NBYTES // dtype.itemsize))
    max_srcs = next(b for b in SRC_BUCKETS if b >= len(srcs))
    # The kernel addresses elements from element ``head`` (16-byte aligned on the vector path),
    # so its vector loop indexes the pointers directly; head elements are at negative indices.
    hb, pad = head * dtype.itemsize, [0] * MAX_POINTERS
    args: list[np.generic] = [np.uint64(p + hb if p else 0)
                              for p in (srcs + pad)[:MAX_POINTERS] + (dsts + pad)[:MAX_POINTERS]]
    args += [np.int32(len(srcs)), np.int32(len(dsts)), np.int64(head), np.int64(nvec),
             np.int64(count), np.float64(avg_n)]
    return LaunchPlan(max_srcs, tuple(args), work)


def grid_blocks(work: int, sms: int) -> int:
    """Blocks of :data:`BLOCK` threads for ``work`` loop iterations on a device with ``sms``
    multiprocessors: one iteration a thread where that fits in ``BLOCKS_PER_SM`` blocks per SM,
    else that many blocks, whose threads then loop (grid-stride)."""
    return max(1, min(sms * BLOCKS_PER_SM, -(-work // BLOCK)))


def launch_reduce(srcs: Sequence[int], dsts: Sequence[int], count: int, dtype: np.dtype,
                  rop: ReduceOp, *, avg_n: int = 1, stream: int, device: int) -> None:
    """Enqueue ``dsts[j][i] = srcs[0][i] (op) srcs[1][i] (op) ...`` for every j and i < count.

    Args:
        srcs: 1 to :data:`MAX_POINTERS` device addresses, each of ``count`` contiguous elements of
            ``dtype``, combined in this order in ``acc_dtype(dtype)`` (integers wrap).
        dsts: 1 to :data:`MAX_POINTERS` device addresses of ``count`` elements of ``dtype``; each
            gets the result, rounded once to ``dtype`` (nearest even; NaN stays NaN). A
            destination may be a source (in place); other overlaps are not supported.
        count: elements; 0 enqueues nothing.
        dtype: one of ``reduce_ops.SUPPORTED_DTYPES`` (bfloat16 as ``ml_dtypes.bfloat16``).
        rop: SUM (bool: or), PROD, MIN (bool: and), MAX (bool: or), or AVG (floating only:
            the sum divided by ``avg_n`` in the accumulation dtype).
        avg_n: the AVG divisor (number of ranks); ignored by the other ops.
        stream: ``cudaStream_t`` (int) on ``device`` to enqueue on; nothing is synchronized.
        device: CUDA device ordinal the kernel runs on; every pointer must be usable there.

    Raises:
        ValueError: unsupported dtype or op/dtype pair, no or more than :data:`MAX_POINTERS`
            pointers on a side, a null or not itemsize-aligned pointer, ``count < 0`` or
            ``avg_n < 1``. Validation needs no CuPy; the launch does.
    """
    plan = plan_reduce(srcs, dsts, count, dtype, rop, avg_n=avg_n)
    if plan is None:
        return
    import cupy

    dtype, rop = np.dtype(dtype), ReduceOp(rop)
    key = (dtype, rop, plan.max_srcs)
    with cupy.cuda.Device(device):
        kernel = _kernels.get(key)
        if kernel is None:  # cupy.RawKernel compiles on first launch, per device
            kernel = _kernels[key] = cupy.RawKernel(
                kernel_source(dtype, rop, plan.max_srcs), kernel_name(dtype, rop, plan.max_srcs),
                options=_COMPILE_OPTIONS)
        sms = _sm_counts.get(device)
        if sms is None:
            sms = _sm_counts[device] = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
        with foreign_stream(int(stream), device):
            kernel((grid_blocks(plan.work, sms),), (BLOCK,), plan.args)


def copy(dst: int, src: int, nbytes: int, *, stream: int) -> None:
    """Enqueue a device-to-device copy of ``nbytes`` bytes from ``src`` to ``dst`` on ``stream``
    (``cudaMemcpyAsync``; either address may be peer memory mapped through CUDA IPC). Unlike a
    kernel launch, a copy may be issued to a stream of a device that is not current (CUDA
    Programming Guide, "Stream and Event Behavior"). ``nbytes == 0`` enqueues nothing.

    Raises:
        ValueError: ``nbytes < 0``.
        cupy.cuda.runtime.CUDARuntimeError: the runtime refused the copy.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes({nbytes}) must be >= 0")
    if nbytes == 0:
        return
    import cupy

    rt = cupy.cuda.runtime
    rt.memcpyAsync(int(dst), int(src), int(nbytes), rt.memcpyDeviceToDevice, int(stream))
