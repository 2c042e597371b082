"""Hierarchical all_reduce on CPU arrays: ranks on simulated hosts (``WorldView.hosts``), reduce
within each host, all_reduce among the hosts' first ranks, broadcast back; results equal the flat
all_reduce's for every op, with uneven ranks per host, and a rank killed mid-way is reported."""

from __future__ import annotations

import os
import signal

import ml_dtypes
import numpy as np
import pytest

from rtxnet.collectives import ReduceOp
from transport.errors import CollectiveTimeout, PeerLostError

from .harness import RankError, run_world

pytestmark = pytest.mark.timeout(120)

HOSTS = {0: "a", 1: "a", 2: "b", 3: "b", 4: "b"}   # uneven: 2 ranks on a, 3 on b


async def hier(engine, cases):
    w = engine.world
    out = []
    for dtype, op, n in cases:
        rng = np.random.default_rng(w.rank * 7 + n)
        x = (rng.integers(1, 5, n) if op is not ReduceOp.AVG else rng.random(n)).astype(dtype)
        ref = x.copy()
        await w.all_reduce(ref, op, algorithm="direct" if n <= 1000 else "ring")
        await w.all_reduce(x, op, algorithm="hierarchical")
        if n > 1_000_000:   # large: the worst relative difference, and a digest for rank equality
            d = np.abs(x.astype(np.float64) - ref) / np.maximum(np.abs(ref.astype(np.float64)), 1e-30)
            out.append(([hash(x.tobytes())], [float(d.max())]))
        else:
            out.append((x.astype(np.float64).tolist(), ref.astype(np.float64).tolist()))
    intra, leaders = w._host_groups()
    return out, (intra.ranks, None if leaders is None else leaders.ranks)


def test_hierarchical_equals_flat():
    cases = [(np.float32, ReduceOp.SUM, 1000), (np.int64, ReduceOp.MAX, 17),
             (np.float64, ReduceOp.AVG, 5), (np.int32, ReduceOp.PROD, 3),
             (np.float32, ReduceOp.SUM, 0), (np.float32, ReduceOp.MIN, 300_000),
             (ml_dtypes.bfloat16, ReduceOp.SUM, 64),
             # from 8 MiB: a pipeline of chunks (2 and 5 here, uneven splits)
             (np.float32, ReduceOp.SUM, 2_500_001), (np.float64, ReduceOp.AVG, 2_700_000)]
    res = run_world(5, hier, cases, hosts=HOSTS)
    for r in range(5):
        res[r], groups = res[r]
        assert groups == (([0, 1] if r < 2 else [2, 3, 4]), ([0, 2] if r in (0, 2) else None))
        for (got, ref), (dtype, op, n) in zip(res[r], cases, strict=True):
            if n > 1_000_000:
                assert ref[0] <= 1e-6, (r, dtype, op, n, ref)
                continue
            np.testing.assert_allclose(got, ref, rtol=1e-2 if n == 64 else 1e-6,
                                       err_msg=f"rank {r} {dtype} {op} {n}")
        assert [c[0] for c in res[r]] == [c[0] for c in res[0]]


async def default_choice(engine):
    """Which all_reduces of the default choice went hierarchical (its host groups appear)."""
    w = engine.world
    seen = []
    for n in (1000, 100_000):                   # 4 KB, and 400 KB > 64 KiB
        x = np.full(n, w.rank + 1.0, np.float32)
        await w.all_reduce(x)
        seen.append((w._host_groups_cache is not None, float(x[0])))
    return seen


def test_several_hosts_sharing_ranks_default_to_hierarchical_above_64_kib():
    # small arrays: one round; larger ones: hierarchical (fewer bytes across hosts than a ring)
    res = run_world(5, default_choice, hosts=HOSTS)
    for r in range(5):
        assert res[r] == [(False, 15.0), (True, 15.0)], (r, res[r])
    # one rank per host: hierarchical would be the flat ring, so it is not chosen
    res = run_world(3, default_choice, hosts={0: "a", 1: "b", 2: "c"})
    for r in range(3):
        assert res[r] == [(False, 6.0), (False, 6.0)], (r, res[r])


async def hier_kill(engine, n=10):
    w = engine.world
    x = np.ones(n, np.float32)
    try:
        # rank 3 returning from the first all_reduce does not mean the others have finished it
        # (its last messages may die with it): a survivor may fail there already
        await w.all_reduce(x, algorithm="hierarchical", timeout=10)
        if w.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        await w.all_reduce(x, algorithm="hierarchical", timeout=3)
    except (CollectiveTimeout, PeerLostError) as exc:
        return type(exc).__name__
    return "completed"


@pytest.mark.parametrize("n", [10, 3_000_000], ids=["one-piece", "pipelined"])
def test_hierarchical_reports_a_killed_rank(n):
    """Without a coordinator nobody declares rank 3 lost, so every survivor must get a timeout
    (or an abort naming it) instead of hanging; the host-mates of rank 3 wait on it directly.
    Pipelined (12 MB: chunks in flight in two groups at once), the same."""
    res = run_world(5, hier_kill, n, hosts=HOSTS, timeout_s=60, return_exceptions=True)
    assert isinstance(res[3], RankError)
    for r in (0, 1, 2, 4):
        assert res[r] in ("CollectiveTimeout", "PeerLostError"), (r, res[r])
