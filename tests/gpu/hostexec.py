"""Run the reduction kernels' CUDA C on the CPU: the generated source, compiled by the host C++
compiler with a few definitions for CUDA's built-ins, and launched as the GPU would run it, every
(block, thread) of the grid in turn.

This checks what the kernels compute (index arithmetic, the vector and scalar paths, head and
tail peeling, grid-stride loops, in-place safety, every dtype's load, combine and rounding) on any
machine with g++, against the same references as the device tests. It does not check what only a
GPU can: the inline PTX of float16 (here ``_Float16``; ptxas checks the PTX in
``test_kernels_compile.py``), memory ordering, or speed.

Each thread runs to completion before the next starts. That is one legal schedule of the kernel:
no thread reads an element another thread writes (the kernels' contract), so every schedule gives
the same result.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

from rtxnet.collectives.gpu import kernels
from rtxnet.collectives.reduce_ops import ReduceOp

_SHIM = r"""
#include <cstring>
struct uint4 { unsigned int x, y, z, w; };
struct rtx_dim3 { unsigned int x; };
static rtx_dim3 blockIdx, blockDim, threadIdx, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
"""
# float16 through the host's _Float16 instead of PTX's cvt (both IEEE, round to nearest even)
_HALF_LD = "_Float16 h; std::memcpy(&h, &x, 2); return (float)h;"
_HALF_ST = "_Float16 h = (_Float16)a; T t; std::memcpy(&t, &h, 2); return t;"
_MACROS = ("V", "FINISH", "VLOAD", "VFOLD", "VSTORE", "SLOAD", "SFOLD", "SSTORE")
_P = kernels.MAX_POINTERS


def cxx() -> str | None:
    """The host C++ compiler (g++ or c++ on PATH), or None."""
    return shutil.which("g++") or shutil.which("c++")


def _driver(name: str) -> str:
    srcs = ", ".join(f"(const char*)p[{k}]" for k in range(_P))
    dsts = ", ".join(f"(char*)p[{_P + k}]" for k in range(_P))
    return (f'extern "C" void run_{name}(const unsigned long long* p, int nsrc, int ndst, '
            f"long long head, long long nvec, long long count, double avg_n, unsigned grid) {{\n"
            f"  gridDim.x = grid; blockDim.x = {kernels.BLOCK};\n"
            f"  for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < {kernels.BLOCK}; ++t)"
            f" {{\n    blockIdx.x = b; threadIdx.x = t;\n"
            f"    {name}({srcs}, {dsts}, nsrc, ndst, head, nvec, count, avg_n);\n  }}\n}}\n")


def translation_unit(keys: list[tuple[np.dtype, ReduceOp, int]], *, host: bool) -> str:
    """One translation unit holding the kernels for ``keys`` (dtype, op, source bucket), each in
    a namespace of its own. ``host``: C++ for the host compiler (the shim for CUDA's built-ins,
    float16 through ``_Float16``, and an ``extern "C" run_<kernel name>`` driver per kernel);
    otherwise the kernels as NVRTC gets them, for nvcc."""
    parts = [_SHIM] if host else []
    half_ld, half_st = kernels._TYPES["float16"][3:5]
    for i, (dtype, rop, bucket) in enumerate(keys):
        src = kernels.kernel_source(dtype, rop, bucket)
        if host:
            src = src.replace(half_ld, _HALF_LD).replace(half_st, _HALF_ST)
            src += _driver(kernels.kernel_name(dtype, rop, bucket))
        parts.append(f"namespace k{i} {{\n{src}\n}}\n" + "".join(f"#undef {m}\n" for m in _MACROS))
    return "\n".join(parts)


class HostKernels:
    """The kernels for ``keys``, compiled into one shared library under ``workdir``.

    Raises:
        subprocess.CalledProcessError: the compiler rejected the source (its output attached).
    """

    def __init__(self, keys: list[tuple[np.dtype, ReduceOp, int]], workdir: Path):
        src = translation_unit(keys, host=True)
        tag = hashlib.sha256(src.encode()).hexdigest()[:16]
        cpp, lib = workdir / f"kernels_{tag}.cpp", workdir / f"kernels_{tag}.so"
        if not lib.exists():
            cpp.write_text(src)
            subprocess.run([cxx(), "-std=c++17", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing",
                            "-ffp-contract=off", "-Wno-unknown-pragmas", "-o", str(lib), str(cpp)],
                           check=True, capture_output=True, text=True, timeout=300)
        self._lib = ctypes.CDLL(str(lib))

    def launch(self, srcs, dsts, count: int, dtype, rop: ReduceOp, *, avg_n: int = 1,
               sms: int = 2) -> None:
        """Run what ``kernels.launch_reduce`` would enqueue (its own :func:`kernels.plan_reduce`
        and :func:`kernels.grid_blocks`) on host addresses, for a device of ``sms`` SMs (few, so
        large counts exercise the grid-stride loops)."""
        plan = kernels.plan_reduce(srcs, dsts, count, dtype, rop, avg_n=avg_n)
        if plan is None:
            return
        name = kernels.kernel_name(np.dtype(dtype), ReduceOp(rop), plan.max_srcs)
        fn = getattr(self._lib, f"run_{name}")
        ptrs = (ctypes.c_ulonglong * (2 * _P))(*[int(a) for a in plan.args[:2 * _P]])
        nsrc, ndst, head, nvec, cnt, avg = plan.args[2 * _P:]
        fn(ptrs, ctypes.c_int(int(nsrc)), ctypes.c_int(int(ndst)), ctypes.c_longlong(int(head)),
           ctypes.c_longlong(int(nvec)), ctypes.c_longlong(int(cnt)), ctypes.c_double(float(avg)),
           ctypes.c_uint(kernels.grid_blocks(plan.work, sms)))
