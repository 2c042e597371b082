"""The NCCL backend through the Group API: a world of one rank with ``algorithm="nccl"`` (every
collective against CuPy), and two ranks sharing the one GPU, which NCCL refuses: both ranks get
the same NcclUnavailableError, naming them and pointing at "ipc", before NCCL is touched."""

from __future__ import annotations

import pytest

from tests.collectives.harness import run_world

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


async def nccl_world_of_one(engine):
    import cupy

    from rtxnet.collectives import ReduceOp

    cupy.cuda.Device(0).use()
    w = engine.world
    w.algorithm = "nccl"
    errors = []
    x = cupy.arange(1000, dtype=cupy.float32)
    want = x.copy()
    await w.all_reduce(x)
    await w.all_reduce(x, ReduceOp.MAX)
    await w.broadcast(x, 0)
    if not bool(cupy.all(x == want)):
        errors.append("all_reduce/broadcast changed a world of one")
    out = cupy.zeros(1000, cupy.float32)
    await w.all_gather(out, x)
    if not bool(cupy.all(out == want)):
        errors.append("all_gather")
    out[...] = 0
    await w.reduce_scatter(out, x)
    if not bool(cupy.all(out == want)):
        errors.append("reduce_scatter")
    return errors, w._gpu_state._nccl is not None


def test_nccl_world_of_one_through_the_group():
    [(errors, used_nccl)] = run_world(1, nccl_world_of_one, timeout_s=90)
    assert errors == [] and used_nccl


async def nccl_shared_gpu(engine):
    import cupy

    from rtxnet.collectives.gpu.nccl import NcclUnavailableError

    cupy.cuda.Device(0).use()
    w = engine.world
    x = cupy.ones(10, cupy.float32)
    try:
        await w.all_reduce(x, algorithm="nccl", timeout=30)
    except NcclUnavailableError as exc:
        msg = str(exc)
        ok = ("ipc" in msg and "Duplicate GPU" in msg and exc.ranks == [0, 1])
        y = cupy.full(10, w.rank + 1, cupy.float32)
        await w.all_reduce(y)                               # IPC still serves them
        return ok, float(y[0])
    return "no error", None


def test_two_ranks_on_one_gpu_get_the_same_clear_nccl_refusal():
    assert run_world(2, nccl_shared_gpu, timeout_s=90) == [(True, 3.0), (True, 3.0)]
