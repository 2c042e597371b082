"""GPU collectives over CUDA IPC with 1, 2 and 4 ranks sharing one GPU, against CuPy references.

Every rank regenerates every rank's input from the same seeds (small integers, exact in float16
and bfloat16 for these sums and means), so each rank checks its own result without shipping
arrays back. float16 and float32 are CuPy arrays; bfloat16 is a torch CUDA tensor (CuPy has no
bfloat16), which also covers the torch path.
"""

from __future__ import annotations

import zlib

import pytest

from tests.collectives.harness import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

DTYPES = ("float16", "bfloat16", "float32")
SIZES = (0, 1, 7, 1000, 1 << 20)
BIG = 64 << 20          # float32 elements: a 256 MiB all_reduce


def _inputs(g: int, n: int, seed: int):
    import cupy

    rng = cupy.random.default_rng(seed * 1000 + g)
    return rng.integers(-4, 5, n).astype(cupy.float32)


def _as(x32, dtype: str):
    """``x32`` (CuPy float32) as the array type the test uses for ``dtype``."""
    import cupy

    if dtype == "bfloat16":
        import torch

        return torch.from_dlpack(x32.copy()).to(torch.bfloat16)
    return x32.astype(cupy.dtype(dtype))


def _f32(a):
    import cupy

    if type(a).__module__.startswith("torch"):
        return cupy.from_dlpack(a.float().contiguous())
    return a.astype(cupy.float32)


def _check(name, got, want, errors):
    import cupy

    got = _f32(got)
    if got.shape != want.shape or not bool(cupy.all(got == want)):
        bad = int(cupy.count_nonzero(got != want)) if got.shape == want.shape else -1
        errors.append(f"{name}: {bad} elements differ")


async def ipc_ops(engine, dtypes, sizes, big):
    import cupy

    from rtxnet.collectives import ReduceOp

    cupy.cuda.Device(0).use()
    w = engine.world
    n, r = w.size, w.rank
    errors: list[str] = []
    for dtype in dtypes:
        for N in sizes:
            seed = zlib.crc32(f"{dtype}/{N}".encode()) % 10_000   # same on every rank
            xs = [_inputs(g, N, seed) for g in range(n)]
            total = sum(xs[1:], xs[0].copy())
            tag = f"{dtype}[{N}]"
            x = _as(xs[r], dtype)
            await w.all_reduce(x)
            _check(f"all_reduce sum {tag}", x, total, errors)
            x = _as(xs[r], dtype)
            await w.all_reduce(x, ReduceOp.MAX)
            _check(f"all_reduce max {tag}", x, cupy.max(cupy.stack(xs), axis=0), errors)
            x = _as(xs[r], dtype)
            await w.all_reduce(x, ReduceOp.AVG)
            _check(f"all_reduce avg {tag}", x, total / n, errors)
            x = _as(xs[r], dtype)
            await w.broadcast(x, src=n - 1)
            _check(f"broadcast {tag}", x, xs[n - 1], errors)
            x = _as(xs[r], dtype)
            await w.reduce(x, dst=0)
            _check(f"reduce {tag}", x, total if r == 0 else xs[r], errors)
            out = _as(cupy.zeros(n * N, cupy.float32), dtype)
            await w.all_gather(out, _as(xs[r], dtype))
            _check(f"all_gather {tag}", out, cupy.concatenate(xs), errors)
            big_in = [_inputs(g + 100, n * N, seed) for g in range(n)]
            out = _as(cupy.zeros(N, cupy.float32), dtype)
            await w.reduce_scatter(out, _as(big_in[r], dtype))
            want = sum(b[r * N:(r + 1) * N] for b in big_in)
            _check(f"reduce_scatter {tag}", out, want if N else cupy.zeros(0, cupy.float32),
                   errors)
    # list forms, gather, scatter, all_to_all, a non-contiguous view: float32, 1000 elements
    N = 1000
    xs = [_inputs(g, N, 7) for g in range(n)]
    outs = [cupy.zeros(N, cupy.float32) for _ in range(n)]
    await w.all_gather(outs, xs[r].copy())
    for k in range(n):
        _check(f"all_gather list[{k}]", outs[k], xs[k], errors)
    gl = [cupy.zeros(N, cupy.float32) for _ in range(n)] if r == 0 else None
    await w.gather(xs[r].copy(), gl, dst=0)
    if r == 0:
        for k in range(n):
            _check(f"gather[{k}]", gl[k], xs[k], errors)
    sl = [xs[k] * 3 for k in range(n)] if r == n - 1 else None
    y = cupy.zeros(N, cupy.float32)
    await w.scatter(y, sl, src=n - 1)
    _check("scatter", y, xs[r] * 3, errors)
    a2a_in = cupy.concatenate([xs[r][:N // n] + 10 * k for k in range(n)])
    a2a_out = cupy.zeros(n * (N // n), cupy.float32)
    await w.all_to_all(a2a_out, a2a_in)
    _check("all_to_all", a2a_out,
           cupy.concatenate([xs[k][:N // n] + 10 * r for k in range(n)]), errors)
    base = cupy.stack([_inputs(g, 2 * N, 9) for g in range(n)])
    m = base[r].copy().reshape(N, 2)
    await w.all_reduce(m[:, 1])                          # a strided view, written back in place
    _check("non-contiguous all_reduce", m[:, 1], base.reshape(n, N, 2)[:, :, 1].sum(axis=0),
           errors)
    _check("non-contiguous untouched", m[:, 0], base[r].reshape(N, 2)[:, 0], errors)
    if big:
        xb = [_inputs(g, big, 3) for g in range(n)]
        x = xb[r].copy()
        await w.all_reduce(x)
        _check("all_reduce 256 MiB", x, sum(xb[1:], xb[0].copy()), errors)
    # the handle cache: the same buffer again opens nothing new
    ipc = w._gpu_state._ipc
    opened = 0 if ipc is None else len(ipc._opened)
    x = xs[r].copy()
    for _ in range(3):
        await w.all_reduce(x)
    again = 0 if ipc is None else len(ipc._opened)
    if n > 1 and again > opened + (n - 1):
        errors.append(f"handle cache grew from {opened} to {again} over 3 reuses of one buffer")
    return errors


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_ipc_collectives_match_cupy(nranks):
    big = BIG if nranks in (2, 4) else 0
    res = run_world(nranks, ipc_ops, DTYPES, SIZES, big, timeout_s=90, default_timeout_s=30)
    for rank, errors in enumerate(res):
        assert errors == [], f"rank {rank}: {errors}"


async def ipc_mismatches(engine):
    import cupy
    import numpy as np

    from transport.errors import CollectiveMismatchError

    cupy.cuda.Device(0).use()
    w = engine.world
    out = []
    for x in (cupy.ones(10 + w.rank, cupy.float32),                                 # numel
              cupy.ones(10, cupy.float32) if w.rank == 0 else np.ones(10, np.float32)):  # CPU+GPU
        try:
            await w.all_reduce(x, timeout=20)
            out.append("no error")
        except CollectiveMismatchError as exc:
            out.append(exc.field)
    y = cupy.full(10, w.rank + 1, cupy.float32)      # the group is still usable afterwards
    await w.all_reduce(y)
    out.append(float(y[0]))
    return out


def test_mismatches_are_reported_on_every_rank_and_the_group_stays_usable():
    """Ranks disagreeing on the element count, and a CPU array meeting a GPU array, get the same
    CollectiveMismatchError on every rank (never a hang), and the next all_reduce is right."""
    assert run_world(2, ipc_mismatches, timeout_s=60) == [["numel", "algorithm", 3.0]] * 2
