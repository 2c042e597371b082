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


async def ipc_ops(engine, dtypes, sizes, big, board=True):
    import os

    import cupy

    from rtxnet.collectives import ReduceOp

    os.environ["RTXNET_IPC_BOARD"] = "1" if board else "0"   # read by the group's first GPU op
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
    # every hello after the first went through the boards, unless they are turned off (all_to_all
    # and offers of new buffers excepted: those also send messages, counted as fast or full)
    if ipc is not None:
        st = ipc.stats
        if board and not (st["fast"] >= 2 and st["fast"] + st["offers"] > st["full"] > 0):
            errors.append(f"with boards: hellos {st}")
        if not board and (st["fast"] or st["offers"] or ipc.handshake.board is not None):
            errors.append(f"RTXNET_IPC_BOARD=0: hellos {st}")
    return errors


@pytest.mark.parametrize(("nranks", "board"),
                         [(1, False), (2, False), (4, False), (2, True), (4, True)],
                         ids=["1", "2", "4", "2-boards", "4-boards"])
def test_ipc_collectives_match_cupy(nranks, board):
    """Every op, dtype and size against CuPy; "-boards": the hellos and "done"s through signal
    boards (RTXNET_IPC_BOARD=1) instead of control messages."""
    big = BIG if nranks in (2, 4) else 0
    res = run_world(nranks, ipc_ops, DTYPES, SIZES, big, board, timeout_s=90,
                    default_timeout_s=30)
    for rank, errors in enumerate(res):
        assert errors == [], f"rank {rank}: {errors}"


async def ipc_fresh_allocations(engine):
    """Buffers freed and allocated again (cudaMalloc may hand out the same address for a new
    allocation, with a new IPC handle): every all_reduce is right, and reused buffers are named
    by their offer id."""
    import os

    import cupy

    os.environ["RTXNET_IPC_BOARD"] = "1"
    cupy.cuda.Device(0).use()
    w = engine.world
    n, r = w.size, w.rank
    pool = cupy.get_default_memory_pool()
    errors = []
    for it in range(6):
        pool.free_all_blocks()
        size = (1 << 20) + (it % 2) * 4096
        x = cupy.full(size, r + it, cupy.float32)
        for rep in range(3):
            await w.all_reduce(x)
            want = sum(g + it for g in range(n)) * n ** rep
            if not bool((x == want).all()):
                errors.append(f"iteration {it} repeat {rep}: wrong result")
        x = None
    return errors, dict(w._gpu_state._ipc.stats)


def test_fresh_allocations_at_old_addresses_are_offered_again():
    res = run_world(2, ipc_fresh_allocations, timeout_s=60, default_timeout_s=20)
    for rank, (errors, stats) in enumerate(res):
        assert errors == [], f"rank {rank}: {errors}"
        # the first operation as messages, each later buffer's first offered by message, its
        # two repeats through the boards alone
        assert stats == {"fast": 12, "offers": 5, "full": 1}, f"rank {rank}: {stats}"


async def ipc_skipped(engine):
    """Rank 1 begins an all_reduce rank 0 has not issued: rank 0's engine reports it as skipped
    (rtxnet.FaultTolerance asks this while a step's vote is pending) though no message came."""
    import asyncio
    import os

    import cupy

    os.environ["RTXNET_IPC_BOARD"] = "1"
    cupy.cuda.Device(0).use()
    w = engine.world
    x = cupy.ones(1000, cupy.float32)
    await w.all_reduce(x)                       # the group is warm: hellos through the boards
    await w.barrier()
    if w.rank == 1:
        await w.all_reduce(x, timeout=30)
        return None
    seen = []
    for _ in range(50):   # polled, as FaultTolerance does: a post counts from when it was seen
        await asyncio.sleep(0.1)
        seen = [(s, senders) for g, s, senders in engine.skipped(1.0) if g is w]
        if seen:
            break
    await w.all_reduce(x)
    return seen, float(x[0])


def test_a_gpu_collective_begun_on_the_boards_only_is_seen_as_skipped():
    res = run_world(2, ipc_skipped, timeout_s=60, default_timeout_s=20)
    seen, value = res[0]
    assert value == 4.0
    assert len(seen) == 1 and seen[0][1] == [1], seen


async def ipc_mismatches(engine, warm, board):
    import os

    import cupy
    import numpy as np

    from transport.errors import CollectiveMismatchError

    os.environ["RTXNET_IPC_BOARD"] = "1" if board else "0"
    cupy.cuda.Device(0).use()
    w = engine.world
    out = []
    if warm:   # hellos then go through the boards: a mismatch is found from the hashes
        for _ in range(2):
            await w.all_reduce(cupy.ones(10, cupy.float32))
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


@pytest.mark.parametrize(("warm", "board"), [(False, True), (True, True), (True, False)],
                         ids=["first-ops", "warm-group", "warm-messages"])
def test_mismatches_are_reported_on_every_rank_and_the_group_stays_usable(warm, board):
    """Ranks disagreeing on the element count, and a CPU array meeting a GPU array, get the same
    CollectiveMismatchError on every rank (never a hang), and the next all_reduce is right; in a
    group's first operations (hellos as messages), in a warm one (through the boards), and
    without boards."""
    assert run_world(2, ipc_mismatches, warm, board, timeout_s=60) == \
        [["numel", "algorithm", 3.0]] * 2
