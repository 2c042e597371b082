"""Hierarchical collectives on CPU arrays, ranks on simulated hosts (``WorldView.hosts``).

all_reduce: reduce within each host, all_reduce among the hosts' first ranks, broadcast back;
results equal the flat all_reduce's for every op, with uneven ranks per host, and a rank killed
mid-way is reported. all_gather / reduce_scatter: by rails and within hosts (equal hosts) or
through each host's first rank (unequal ones), equal to the flat ones for every output form; the
default takes them when fewer bytes cross hosts than the ring's. Groups whose rank order is not
the world's (a split by key) included."""

from __future__ import annotations

import asyncio
import os
import signal
import time

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
        # (5 s: a survivor that rank 3's last messages never reached waits this long, and a
        # timeout is an accepted outcome; rank 3 itself only needs to finish it)
        await w.all_reduce(x, algorithm="hierarchical", timeout=5)
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


# -- all_gather and reduce_scatter --------------------------------------------------------------

async def gather_scatter(engine, cases, hosts_order_split=False):
    """Every case's hierarchical result and the flat one (direct), on the world group or on a
    split of it whose ranks are in reverse order (``hosts_order_split``)."""
    w = engine.world
    if hosts_order_split:
        w = await w.split(0, key=-w.rank)     # group rank order: world ranks descending
    n, r = w.size, w.rank
    out = []
    for dtype, op, N, form in cases:
        rng = np.random.default_rng(r * 11 + N)
        x = (rng.integers(1, 5, N) if op is not ReduceOp.AVG else rng.random(N)).astype(dtype)
        # all_gather: one output array, a list of parts, or in place (this rank's slice is x)
        ref = np.zeros(n * N, dtype)
        await w.all_gather(ref, x, algorithm="direct")
        if form == "list":
            parts = [np.full(N, -1, dtype) for _ in range(n)]
            await w.all_gather(parts, x, algorithm="hierarchical")
            got = np.concatenate(parts)
        elif form == "inplace":
            got = np.full(n * N, -1, dtype)
            got[r * N:(r + 1) * N] = x
            await w.all_gather(got, got[r * N:(r + 1) * N], algorithm="hierarchical")
        else:   # a non-contiguous output: every other element of a larger array
            big = np.full(2 * n * N, -1, dtype)
            await w.all_gather(big[::2], x, algorithm="hierarchical")
            got = big[::2]
        ag_ok = bool(np.array_equal(got, ref))
        # reduce_scatter of W parts of N (an input of W*N elements)
        y = (rng.integers(1, 5, n * N) if op is not ReduceOp.AVG else rng.random(n * N)).astype(dtype)
        keep = y.copy()
        want = np.zeros(N, dtype)
        await w.reduce_scatter(want, y, op, algorithm="direct")
        mine = np.full(N, -1, dtype)
        await w.reduce_scatter(mine, y if form != "list" else [y[k * N:(k + 1) * N] for k in range(n)],
                               op, algorithm="hierarchical")
        rs_diff = float(np.max(np.abs(mine.astype(np.float64) - want), initial=0.0))
        out.append((ag_ok, rs_diff, bool(np.array_equal(y, keep))))
    return out


GS_CASES = [(np.float32, ReduceOp.SUM, 1000, "array"), (np.int64, ReduceOp.MAX, 17, "list"),
            (np.float64, ReduceOp.AVG, 5, "inplace"), (np.int32, ReduceOp.PROD, 3, "strided"),
            (np.float32, ReduceOp.SUM, 0, "array"), (ml_dtypes.bfloat16, ReduceOp.SUM, 64, "list"),
            (np.float32, ReduceOp.MIN, 300_000, "inplace")]
# from 8 MiB in all, equal hosts pipeline chunks of about 4 MiB (uneven splits here)
PIPELINED = [(np.float32, ReduceOp.SUM, 700_001, "strided"), (np.int64, ReduceOp.MAX, 400_003, "list")]


@pytest.mark.parametrize("hosts,split,cases", [
    # equal hosts: rails (across hosts) then within each host
    ({0: "a", 1: "b", 2: "b", 3: "a"}, False, GS_CASES + PIPELINED),  # interleaved; rail 1: b, a
    ({0: "a", 1: "a", 2: "b", 3: "b"}, True, GS_CASES),              # group in descending order
    # unequal hosts: through each host's first rank, a block of 2 padded to 3, and the group
    # in descending order
    (HOSTS, True, GS_CASES),
], ids=["rails-crossed", "rails-split-descending", "uneven-split-descending"])
def test_hierarchical_all_gather_and_reduce_scatter_equal_flat(hosts, split, cases):
    res = run_world(len(hosts), gather_scatter, cases, split, hosts=hosts)
    for r, rows in enumerate(res):
        for (ag_ok, rs_diff, input_kept), (dtype, op, N, form) in zip(rows, cases, strict=True):
            tol = 0.5 if dtype is ml_dtypes.bfloat16 else 1e-9 * max(N, 1)
            assert ag_ok, (r, dtype, op, N, form)
            assert rs_diff <= tol, (r, dtype, op, N, form, rs_diff)
            assert input_kept, (r, dtype, op, N, form)   # reduce_scatter's input is read only


async def split_all_reduce(engine):
    """Hierarchical all_reduce on a group whose order is not the world's: the rank that reduces
    within a host must be the one the hosts' group holds."""
    w = await engine.world.split(0, key=-engine.world.rank)
    x = np.full(10, engine.world.rank + 1.0, np.float32)
    await w.all_reduce(x, algorithm="hierarchical")
    return float(x[0])


def test_hierarchical_all_reduce_on_a_group_in_descending_order():
    res = run_world(5, split_all_reduce, hosts=HOSTS)
    assert res == [15.0] * 5, res


async def default_gather_choice(engine):
    """Which all_gathers / reduce_scatters of the default choice went hierarchical."""
    w = engine.world
    n, seen = w.size, []
    for N in (1000, 300_000):                 # W*N*4 bytes: under 1 MiB, then over
        x, out = np.full(N, w.rank + 1.0, np.float32), np.zeros(n * N, np.float32)
        await w.all_gather(out, x)
        seen.append((w._host_groups_cache is not None, float(out.sum() / N)))
        await w.reduce_scatter(x, out)
        seen.append((w._host_groups_cache is not None, float(x[0])))
    return seen


@pytest.mark.parametrize("hosts,hier", [
    ({0: "a", 1: "a", 2: "b", 3: "b"}, True),      # (H-1)*P = 2 parts across, the ring 3
    ({0: "a", 1: "b", 2: "c", 3: "c"}, False),     # 2*2 = 4 against 3: the ring
    ({0: "a", 1: "b", 2: "c"}, False),             # one rank a host: the ring
], ids=["2x2", "1-1-2", "1-1-1"])
def test_default_gather_and_scatter_go_hierarchical_when_fewer_bytes_cross(hosts, hier):
    n = len(hosts)
    total = n * (n + 1) / 2
    res = run_world(n, default_gather_choice, hosts=hosts)
    for r in range(n):
        # reduce_scatter of the gathered output: part r holds r+1 on every rank
        assert res[r] == [(False, total), (False, n * (r + 1)), (hier, total), (hier, n * (r + 1))], (r, res[r])


async def gather_scatter_kill(engine, opname):
    w = engine.world
    n, N = w.size, 1000
    x, out = np.ones(N, np.float32), np.zeros(n * N, np.float32)

    def call(timeout):
        if opname == "all_gather":
            return w.all_gather(out, x, algorithm="hierarchical", timeout=timeout)
        return w.reduce_scatter(x, out, algorithm="hierarchical", timeout=timeout)

    try:
        await call(5)   # see hier_kill
        if w.rank == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        await call(3)
    except (CollectiveTimeout, PeerLostError) as exc:
        return type(exc).__name__
    return "completed"


@pytest.mark.parametrize("opname,hosts", [("all_gather", {0: "a", 1: "a", 2: "b", 3: "b"}),
                                          ("reduce_scatter", HOSTS)], ids=["rails", "uneven"])
def test_hierarchical_gather_and_scatter_report_a_killed_rank(opname, hosts):
    """Rank 3 SIGKILLed between two calls: every survivor gets a timeout or an abort naming it,
    whether it waits on rank 3 itself (its host, its rail) or on a rank that waits on it."""
    res = run_world(len(hosts), gather_scatter_kill, opname, hosts=hosts, timeout_s=60,
                    return_exceptions=True)
    assert isinstance(res[3], RankError)
    for r in set(range(len(hosts))) - {3}:
        assert res[r] in ("CollectiveTimeout", "PeerLostError"), (r, res[r])


async def f16_means(engine):
    """AVG of float16 values whose per-host sums overflow float16 (65504) though the mean fits."""
    w = engine.world
    out = []
    for N in (1000, 4_200_001):   # one stage, and a pipeline of chunks (from 8 MiB)
        x = np.full(N, 40000, np.float16)
        await w.all_reduce(x, ReduceOp.AVG, algorithm="hierarchical")
        out.append(sorted({float(v) for v in np.unique(x)}))
    y = np.full(w.size * 1000, 40000, np.float16)
    mine = np.zeros(1000, np.float16)
    await w.reduce_scatter(mine, y, ReduceOp.AVG, algorithm="hierarchical")
    out.append(sorted({float(v) for v in np.unique(mine)}))
    out.append(bool((y == 40000).all()))    # the input is read only
    return out


@pytest.mark.parametrize("hosts", [{0: "a", 1: "a", 2: "b", 3: "b"}, HOSTS], ids=["equal", "uneven"])
def test_float16_mean_does_not_overflow_where_the_flat_one_does_not(hosts):
    # a tester's find: 4 ranks of 40000 on 2 hosts gave inf (each host's float16 sum, 80000,
    # overflowed before the division); the flat algorithms accumulate in float32 and gave 40000
    for r, rows in enumerate(run_world(len(hosts), f16_means, hosts=hosts)):
        assert rows == [[40000.0], [40000.0], [40000.0], True], (r, rows)


async def f16_sums(engine):
    """SUM of float16 values whose host sums overflow float16 (65504) though the whole sum is 0:
    40000 on the first host's ranks, -40000 on the next two, 0 on a fifth."""
    w = engine.world
    v = [40000, 40000, -40000, -40000, 0][w.rank]
    out = []
    for N in (1000, 4_200_001):   # one stage, and a pipeline of chunks (from 8 MiB)
        x = np.full(N, v, np.float16)
        await w.all_reduce(x, ReduceOp.SUM, algorithm="hierarchical")
        out.append(sorted({float(e) for e in np.unique(x)}))
    for N in (1000, 1_100_000):   # one chunk, and several
        y = np.full(w.size * N, v, np.float16)
        mine = np.ones(N, np.float16)
        await w.reduce_scatter(mine, y, ReduceOp.SUM, algorithm="hierarchical")
        out.append(sorted({float(e) for e in np.unique(mine)}))
    b = np.full(1000, 1 + w.rank / 128, ml_dtypes.bfloat16)   # exact in bfloat16, not its sum
    flat = b.copy()
    await w.all_reduce(b, ReduceOp.SUM, algorithm="hierarchical")
    await w.all_reduce(flat, ReduceOp.SUM, algorithm="direct")
    out.append(bool((b == flat).all()))
    return out


@pytest.mark.parametrize("hosts", [{0: "a", 1: "a", 2: "b", 3: "b"}, HOSTS], ids=["equal", "uneven"])
def test_float16_sums_round_once_as_the_flat_algorithms_do(hosts):
    # a tester's find: ranks of 40000 and -40000 on two hosts summed to inf where the flat
    # algorithms gave 0 (each host's float16 partial sum, 80000, overflowed between the stages);
    # the stages now carry float32, as the ring does, and bfloat16 sums equal the flat ones
    for r, rows in enumerate(run_world(len(hosts), f16_sums, hosts=hosts)):
        assert rows == [[0.0], [0.0], [0.0], [0.0], True], (r, rows)


async def refused_and_mismatched(engine, opname):
    """Rank 1 refuses a hierarchical call (a bad op, an output of the wrong size), then rank 0
    passes one element more; after each the ranks make a right call. Returns per call: the
    error class (or the result) and the seconds it took."""
    import time
    w = engine.world
    r, n, N = w.rank, w.size, 30_000     # hierarchical by default (400 KB > 64 KiB), or forced
    res = []

    async def call(size, bad):
        t0 = time.monotonic()
        try:
            if opname == "all_reduce":
                x = np.full(size, 10.0 * (r + 1), np.float32)
                await w.all_reduce(x, op="bogus" if bad else ReduceOp.SUM, timeout=20)
                got = float(x[0])
            elif opname == "all_gather":
                out = np.zeros(n * size - bad, np.float32)
                await w.all_gather(out, np.full(size, r + 1.0, np.float32), timeout=20,
                                   algorithm="hierarchical")
                got = out[::size].tolist()
            else:
                out = np.zeros(size, np.float32)
                await w.reduce_scatter(out, np.full(n * size - bad, r + 1.0, np.float32), timeout=20,
                                       algorithm="hierarchical")
                got = float(out[0])
            res.append((got, time.monotonic() - t0))
        except Exception as exc:   # noqa: BLE001 (the class is the result)
            res.append((type(exc).__name__, time.monotonic() - t0))

    await call(N, r == 1)            # refused on rank 1
    await call(N, False)             # right: the refusing rank's call must not be matched here
    await call(N + (r == 0), False)  # mismatch
    await call(N, False)             # still in step
    return res


@pytest.mark.parametrize("opname,hosts", [
    ("all_reduce", HOSTS), ("all_gather", HOSTS), ("reduce_scatter", HOSTS),
    ("all_gather", {0: "a", 1: "a", 2: "b", 3: "b"}), ("reduce_scatter", {0: "a", 1: "a", 2: "b", 3: "b"}),
], ids=["all_reduce", "all_gather-uneven", "reduce_scatter-uneven", "all_gather-rails", "reduce_scatter-rails"])
def test_a_hierarchical_call_refused_or_mismatched_fails_on_every_rank_at_once_and_stays_in_step(opname, hosts):
    # a breaker's find: the refusal's abort reached an operation no rank waited on, and the
    # others took the refusing rank's next call's data in the host groups (22 where 60 was
    # due); a mismatch failed one host at once and left the other waiting out the deadline
    n = len(hosts)
    res = run_world(n, refused_and_mismatched, opname, hosts=hosts)
    right = {"all_reduce": 10.0 * n * (n + 1) / 2, "all_gather": [float(k + 1) for k in range(n)],
             "reduce_scatter": n * (n + 1) / 2}[opname]
    for r, calls in enumerate(res):
        (first, t1), (second, _), (third, t3), (fourth, _) = calls
        assert first == ("ValueError" if r == 1 else "CollectiveRefusedError") and t1 < 10, (r, calls)
        assert second == right and fourth == right, (r, calls)
        assert third == "CollectiveMismatchError" and t3 < 10, (r, calls)


async def user_group_beside_host_groups(engine):
    """Rank 0 makes its own group of host a's ranks before the first hierarchical all_reduce
    makes the host groups, rank 1 after: the same group on both (its id counted per rank set
    was shared with the host groups, and they swapped ids)."""
    w = engine.world
    x = np.full(100_000, w.rank + 1.0, np.float32)
    g = w.new_group([0, 1]) if w.rank == 0 else None
    await w.all_reduce(x, algorithm="hierarchical")
    if w.rank == 1:
        g = w.new_group([0, 1])
    elif w.rank > 1:
        w.new_group([0, 1])
    y = np.full(10, 100.0 * (w.rank + 1), np.float32)
    if g is not None:
        await g.all_reduce(y, timeout=10)
    return float(x[0]), float(y[0]), None if g is None else g.gid


def test_the_host_groups_take_no_id_from_the_users_new_group():
    res = run_world(5, user_group_beside_host_groups, hosts=HOSTS)
    assert [r[0] for r in res] == [15.0] * 5, res
    assert [r[1:] for r in res[:2]] == [(300.0, "0,1#0")] * 2, res


async def cancelled_while_a_leader_waits(engine, opname):
    """Round 1: host b's first rank (2) is slow to enter the hosts' leader stage, and rank 0
    (host a's first rank) is cancelled while it waits there: it never makes its host's last
    stage, which rank 1 has begun. Then two calls every rank makes: they must be right."""
    w = engine.world
    n, r = w.size, w.rank
    if opname == "all_reduce":
        intra, leaders = w._host_groups()
        slowed = leaders
    else:
        intra, rail, _ = w._rails()
        slowed = rail
    if r == 2:
        inner_call = getattr(slowed, opname)

        async def slow(*args, **kwargs):
            await asyncio.sleep(0.6)
            return await inner_call(*args, **kwargs)

        setattr(slowed, opname, slow)

    async def call(value: float, timeout: float):
        N = 50_000
        if opname == "all_reduce":
            x = np.full(N, value, np.float32)
            await w.all_reduce(x, algorithm="hierarchical", timeout=timeout)
            return float(x[0]), float(x[-1])
        if opname == "all_gather":
            out = np.zeros(n * N, np.float32)
            await w.all_gather(out, np.full(N, value, np.float32), algorithm="hierarchical", timeout=timeout)
            return float(out[0]), float(out[-1])
        out = np.zeros(N, np.float32)
        await w.reduce_scatter(out, np.full(n * N, value, np.float32), algorithm="hierarchical",
                               timeout=timeout)
        return float(out[0]), float(out[-1])

    t0 = time.monotonic()
    task = asyncio.ensure_future(call(1.0, 8))
    if r == 0:
        await asyncio.sleep(0.3)
        task.cancel()
    try:
        first = await task
    except asyncio.CancelledError:
        first = "cancelled"
    except Exception as exc:   # noqa: BLE001 (the class is the result)
        first = type(exc).__name__
    took = time.monotonic() - t0
    if r == 2:
        setattr(slowed, opname, inner_call)
    after = []
    for value in (r + 1.0, 10.0 * (r + 1)):
        try:
            after.append(await call(value, 8))
        except Exception as exc:   # noqa: BLE001
            after.append(type(exc).__name__)
    return first, took, after


@pytest.mark.parametrize("opname", ["all_reduce", "all_gather", "reduce_scatter"])
def test_a_hierarchical_call_cancelled_in_its_leader_stage_leaves_the_host_groups_in_step(opname):
    # a breaker's find: a rank cancelled part-way never made its host group's later stages,
    # which its host-mates had begun; they waited out the whole deadline there, and every later
    # hierarchical call paired one rank's host-group operation with another's next one
    # (reduce against broadcast: timeouts, or waits for nobody) for good
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    res = run_world(4, cancelled_while_a_leader_waits, opname, hosts=hosts, timeout_s=90)
    for r, (first, took, after) in enumerate(res):
        if r == 0:
            assert first == "cancelled", res
        else:   # failed at once by rank 0's abort, or done before it
            assert first != "cancelled" and took < 5, (r, res)
        if opname == "all_reduce":
            want = [(10.0, 10.0), (100.0, 100.0)]
        elif opname == "all_gather":
            want = [(1.0, 4.0), (10.0, 40.0)]
        else:
            want = [(10.0, 10.0), (100.0, 100.0)]
        assert after == want, (r, res)
