"""``launch_reduce`` against the CPU path's arithmetic (``reduce_ops.combine`` and ``finish``),
on two executors: a real device ("cuda", marked ``gpu``) and the host ("host": the same generated
CUDA C compiled by g++ and run thread by thread, :mod:`hostexec`, so the kernels' arithmetic and
indexing are checked on machines without a GPU too); plus the argument checks, which need neither.

Buffers are raw bytes with guard bytes around the data, so every dtype (bfloat16 included) goes
through without CuPy knowing it, and a write past either end is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from rtxnet.collectives.gpu import kernels
from rtxnet.collectives.reduce_ops import (
    BFLOAT16,
    SUPPORTED_DTYPES,
    ReduceOp,
    acc_dtype,
    accepted_pairs,
    combine,
    finish,
)

from . import hostexec

GUARD = 0xAB
PAIRS = accepted_pairs()
PAIR_IDS = [f"{n}-{o.value}" for n, o in PAIRS]


@pytest.fixture
def cp():
    return pytest.importorskip("cupy")


class DevBuf:
    """``host`` copied to the device at ``offset`` elements into a guarded byte buffer."""

    def __init__(self, cp, host: np.ndarray, offset: int = 0):
        self.cp, self.dtype, self.n = cp, host.dtype, host.size
        self.lo = offset * host.dtype.itemsize + 64
        self.raw = cp.full(host.nbytes + self.lo + 64, GUARD, dtype=cp.uint8)
        self.raw[self.lo:self.lo + host.nbytes] = cp.asarray(host.view(np.uint8))
        self.ptr = self.raw.data.ptr + self.lo

    def get(self) -> np.ndarray:
        return _unguard(self.cp.asnumpy(self.raw), self.lo, self.n, self.dtype)


class HostBuf:
    """``host`` copied into a guarded host byte buffer at ``offset`` elements past a 64-byte
    boundary, so pointer alignments mod 16 are those a :class:`DevBuf` has."""

    def __init__(self, host: np.ndarray, offset: int = 0):
        self.dtype, self.n = host.dtype, host.size
        self.lo = offset * host.dtype.itemsize + 64
        self._mem = np.full(host.nbytes + self.lo + 64 + 64, GUARD, dtype=np.uint8)
        skip = -self._mem.ctypes.data % 64
        self.raw = self._mem[skip:skip + host.nbytes + self.lo + 64]
        self.raw[self.lo:self.lo + host.nbytes] = host.view(np.uint8)
        self.ptr = self.raw.ctypes.data + self.lo

    def get(self) -> np.ndarray:
        return _unguard(self.raw.copy(), self.lo, self.n, self.dtype)


def _unguard(raw: np.ndarray, lo: int, n: int, dtype: np.dtype) -> np.ndarray:
    hi = lo + n * dtype.itemsize
    assert (raw[:lo] == GUARD).all() and (raw[hi:] == GUARD).all(), "write out of bounds"
    return raw[lo:hi].view(dtype)


class CudaExec:
    def __init__(self, cp):
        self.cp = cp

    def buf(self, host: np.ndarray, offset: int = 0) -> DevBuf:
        return DevBuf(self.cp, host, offset)

    def reduce(self, srcs, dsts, count, dtype, op, avg_n) -> None:
        self.cp.cuda.Device().synchronize()  # inputs were written on the legacy stream
        stream = self.cp.cuda.Stream(non_blocking=True)
        kernels.launch_reduce(srcs, dsts, count, dtype, op, avg_n=avg_n, stream=stream.ptr,
                              device=self.cp.cuda.Device().id)
        stream.synchronize()


class HostExec:
    def __init__(self, lib: hostexec.HostKernels):
        self.lib = lib

    def buf(self, host: np.ndarray, offset: int = 0) -> HostBuf:
        return HostBuf(host, offset)

    def reduce(self, srcs, dsts, count, dtype, op, avg_n) -> None:
        self.lib.launch(srcs, dsts, count, dtype, op, avg_n=avg_n)


@pytest.fixture(scope="session")
def host_kernels(tmp_path_factory):
    if hostexec.cxx() is None:
        pytest.skip("no host C++ compiler (g++) to run the kernels on the CPU")
    keys = [(SUPPORTED_DTYPES[n], op, b) for n, op in PAIRS for b in kernels.SRC_BUCKETS]
    return hostexec.HostKernels(keys, tmp_path_factory.mktemp("host_kernels"))


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "host"])
def ex(request):
    if request.param == "cuda":
        return CudaExec(pytest.importorskip("cupy"))
    return HostExec(request.getfixturevalue("host_kernels"))


def _random(dtype: np.dtype, n: int, rng) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)  # sums wrap
    x = (rng.standard_normal(n) * 3).astype(np.float32).astype(dtype)
    if n > 5:
        x[rng.integers(0, n, 3)] = np.nan  # MIN/MAX must propagate it like np.minimum
    return x


def _reference(srcs: list[np.ndarray], dtype: np.dtype, op: ReduceOp, avg_n: int) -> np.ndarray:
    acc = srcs[0].astype(acc_dtype(dtype))
    for x in srcs[1:]:
        combine(op, acc, x)
    finish(op, acc, avg_n)
    return acc.astype(dtype)


def _assert_equal(got: np.ndarray, want: np.ndarray) -> None:
    if want.dtype.kind == "f" or want.dtype == BFLOAT16:  # NaN == NaN, -0 == 0, else exact
        got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(got, want)


def _run(ex, dtype, op, count, nsrc, ndst, *, offsets=None, in_place=False, seed=0):
    """Reduce ``nsrc`` random arrays into ``ndst`` on executor ``ex`` and compare every
    destination (and that the sources are untouched)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    hosts = [_random(dtype, count, rng) for _ in range(nsrc)]
    offsets = offsets or [0] * (nsrc + ndst)
    srcs = [ex.buf(h, offsets[k]) for k, h in enumerate(hosts)]
    if in_place:
        dsts = srcs[:ndst]
    else:
        dsts = [ex.buf(np.zeros(count, dtype), offsets[nsrc + j]) for j in range(ndst)]
    ex.reduce([b.ptr for b in srcs], [b.ptr for b in dsts], count, dtype, op, nsrc)
    want = _reference(hosts, dtype, op, nsrc)
    for b in dsts:
        _assert_equal(b.get(), want)
    if not in_place:
        for b, h in zip(srcs, hosts, strict=True):
            np.testing.assert_array_equal(b.get().view(np.uint8), h.view(np.uint8))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [0, 1, 7, 1000003])
@pytest.mark.parametrize(("name", "op"), PAIRS, ids=PAIR_IDS)
def test_every_dtype_and_op(ex, name, op, count):
    _run(ex, SUPPORTED_DTYPES[name], op, count, nsrc=3, ndst=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ndst", [1, 2, 3, 4])
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4])
@pytest.mark.parametrize(("name", "op"), [("float32", ReduceOp.SUM), ("bfloat16", ReduceOp.AVG),
                                          ("int8", ReduceOp.MAX)])
def test_source_and_destination_counts(ex, name, op, nsrc, ndst):
    _run(ex, SUPPORTED_DTYPES[name], op, 4099, nsrc, ndst)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nsrc", [5, 8, 9, 16])
@pytest.mark.parametrize(("name", "op"), [("float16", ReduceOp.SUM), ("bool", ReduceOp.MIN),
                                          ("float64", ReduceOp.AVG)])
def test_many_pointers(ex, name, op, nsrc):
    _run(ex, SUPPORTED_DTYPES[name], op, 40_009, nsrc, kernels.MAX_POINTERS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("count", [1, 5, 17, 1000003])
@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "int8", "bool"])
def test_pointers_offset_by_one_element(ex, name, count):
    """All pointers share one misalignment: head elements peeled, then the vector path."""
    _run(ex, SUPPORTED_DTYPES[name], ReduceOp.SUM, count, 3, 2, offsets=[1] * 5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["float16", "float32", "int64", "uint8"])
def test_pointers_misaligned_differently(ex, name):
    """One source off by one element: every element one per thread."""
    _run(ex, SUPPORTED_DTYPES[name], ReduceOp.MAX, 100_003, 3, 2, offsets=[1, 0, 0, 0, 0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize(("name", "op"), [("float32", ReduceOp.SUM), ("bfloat16", ReduceOp.AVG),
                                          ("float16", ReduceOp.MIN), ("int32", ReduceOp.PROD)])
def test_in_place(ex, name, op, offset):
    """dsts[k] is srcs[k], as an in-place all-reduce passes them."""
    _run(ex, SUPPORTED_DTYPES[name], op, 1000003, 4, 4, offsets=[offset] * 8, in_place=True)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [0, 1, 4097, 1 << 20])
def test_copy(cp, nbytes):
    rng = np.random.default_rng(2)
    src = DevBuf(cp, rng.integers(0, 256, nbytes, dtype=np.uint8), offset=3)
    dst = DevBuf(cp, np.zeros(nbytes, np.uint8))
    cp.cuda.Device().synchronize()  # inputs were written on the legacy stream
    stream = cp.cuda.Stream(non_blocking=True)
    kernels.copy(dst.ptr, src.ptr, nbytes, stream=stream.ptr)
    stream.synchronize()
    np.testing.assert_array_equal(dst.get(), src.get())


# --- argument checks: raised before CuPy is imported, so they run everywhere ---

@pytest.mark.timeout(10)
def test_more_than_max_pointers_is_rejected():
    with pytest.raises(ValueError, match="17"):
        kernels.launch_reduce([256] * 17, [256], 8, np.float32, ReduceOp.SUM, stream=0, device=0)
    with pytest.raises(ValueError, match="17"):
        kernels.launch_reduce([256], [256] * 17, 8, np.float32, ReduceOp.SUM, stream=0, device=0)
    with pytest.raises(ValueError, match="0 pointers"):
        kernels.launch_reduce([], [256], 8, np.float32, ReduceOp.SUM, stream=0, device=0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("dtype", "op"), [(np.bool_, ReduceOp.PROD), (np.bool_, ReduceOp.AVG),
                                           (np.int32, ReduceOp.AVG), (np.complex64, ReduceOp.SUM)])
def test_meaningless_op_or_dtype_is_rejected(dtype, op):
    with pytest.raises(ValueError):
        kernels.launch_reduce([256], [256], 8, dtype, op, stream=0, device=0)


@pytest.mark.timeout(10)
def test_bad_pointer_or_count_is_rejected():
    with pytest.raises(ValueError, match="itemsize"):
        kernels.launch_reduce([258], [256], 8, np.float32, ReduceOp.SUM, stream=0, device=0)
    with pytest.raises(ValueError, match="null"):
        kernels.launch_reduce([256], [0], 8, np.float32, ReduceOp.SUM, stream=0, device=0)
    with pytest.raises(ValueError, match="count"):
        kernels.launch_reduce([256], [256], -1, np.float32, ReduceOp.SUM, stream=0, device=0)
    with pytest.raises(ValueError, match="nbytes"):
        kernels.copy(256, 512, -1, stream=0)


@pytest.mark.timeout(10)
def test_nothing_to_do_needs_no_device():
    kernels.launch_reduce([0, 0], [0], 0, np.float16, ReduceOp.SUM, stream=0, device=0)
    kernels.copy(0, 0, 0, stream=0)


@pytest.mark.timeout(10)
def test_vector_split():
    assert kernels.vector_split([4096, 8192], 100, 4) == (0, 25)      # aligned: 25 vectors
    assert kernels.vector_split([4100, 8196], 100, 4) == (3, 24)      # 3 to the boundary, 1 tail
    assert kernels.vector_split([4100, 8196], 2, 4) == (2, 0)         # all before the boundary
    assert kernels.vector_split([4098, 8194], 37, 2) == (7, 3)        # 7 + 3 * 8 + 6
    assert kernels.vector_split([4096, 8196], 100, 4) == (0, 0)       # differ mod 16: scalar
    assert kernels.vector_split([4097], 40, 1) == (15, 1)
