"""Every op x dtype against a NumPy reference, in real processes, at world sizes 1, 2 and 3 (every
algorithm, two sizes) and 5 (ring and recursive doubling, the large size).

One world per size runs every case in a loop and returns its failures, so process start-up is
paid once per world, not thousands of times.
"""

from __future__ import annotations

import numpy as np
import pytest

from .harness import run_world
from .reference import DTYPES, close, make, np_dtype, ops_for, reduce_ref

pytestmark = pytest.mark.timeout(240)

# (numel) small enough for "direct", large enough for ring / shm blocks and uneven chunks
SIZES = [7, 70_001]


async def every_case(engine, sizes, algorithms):
    g = engine.world
    n, r = g.size, g.rank
    fails: list[str] = []
    digests: dict[str, bytes] = {}

    def check(name, got, want, dtype, atol=None):
        if not close(np.asarray(got), want, dtype, atol):
            fails.append(f"{name}: got {np.asarray(got).ravel()[:6]} want {want.ravel()[:6]}")

    for dtype in DTYPES:
        dt = np_dtype(dtype)
        for N in sizes:
            shape = (N,) if N < 100 else (N // 7, 7)
            for op in ops_for(dtype):
                for algo in algorithms:
                    case = f"ar|{op.name}|{algo}"
                    xs = [make(k, case, shape, dtype, op) for k in range(n)]
                    x = xs[r].copy()
                    await g.all_reduce(x, op, algorithm=algo)
                    # (hierarchical float16 AVG divided first and needed 0.0176 of tolerance;
                    # CPU float16 now goes through the stages as float32)
                    check(f"all_reduce {dtype} {N} {op.name} {algo}", x, reduce_ref(xs, op, dtype), dtype)
                    digests[f"{case}|{dtype}|{N}"] = x.tobytes()[:4096]
            # broadcast from every root
            for src in range(n):
                xs = [make(k, f"bc{src}", shape, dtype) for k in range(n)]
                x = xs[r].copy()
                await g.broadcast(x, src)
                check(f"broadcast {dtype} {N} src={src}", x, xs[src], dtype)
            # reduce to the last rank
            op = ops_for(dtype)[0]
            xs = [make(k, "red", shape, dtype) for k in range(n)]
            x = xs[r].copy()
            await g.reduce(x, n - 1, op)
            check(f"reduce {dtype} {N}", x, reduce_ref(xs, op, dtype) if r == n - 1 else xs[r],
                  dtype)
            # all_gather and reduce_scatter, list and flat, by each of their algorithms asked for
            for algo in [a for a in algorithms if a in (None, "direct", "ring", "shm")]:
                xs = [make(k, f"ag{algo}", shape, dtype) for k in range(n)]
                outs = [np.zeros(shape, dt) for _ in range(n)]
                await g.all_gather(outs, xs[r], algorithm=algo)
                for k in range(n):
                    check(f"all_gather list {dtype} {N} {algo} [{k}]", outs[k], xs[k], dtype)
                flat = np.zeros((n,) + shape, dt)
                await g.all_gather(flat, xs[r], algorithm=algo)
                check(f"all_gather flat {dtype} {N} {algo}", flat, np.stack(xs), dtype)
                for op in ops_for(dtype)[:2]:
                    ins = [[make(k, f"rs{j}|{op.name}{algo}", shape, dtype, op) for j in range(n)]
                           for k in range(n)]
                    out = np.zeros(shape, dt)
                    await g.reduce_scatter(out, ins[r], op, algorithm=algo)
                    want = reduce_ref([ins[k][r] for k in range(n)], op, dtype)
                    check(f"reduce_scatter list {dtype} {N} {op.name} {algo}", out, want, dtype)
                    out2 = np.zeros(shape, dt)
                    await g.reduce_scatter(out2, np.concatenate([a.ravel() for a in ins[r]]), op,
                                           algorithm=algo)
                    check(f"reduce_scatter flat {dtype} {N} {op.name} {algo}", out2, want, dtype)
            # gather / scatter
            xs = [make(k, "ga", shape, dtype) for k in range(n)]
            gl = [np.zeros(shape, dt) for _ in range(n)] if r == 0 else None
            await g.gather(xs[r], gl, 0)
            if r == 0:
                for k in range(n):
                    check(f"gather {dtype} {N} [{k}]", gl[k], xs[k], dtype)
            src = n - 1
            sl = [make(j, "sc", shape, dtype) for j in range(n)]
            out = np.zeros(shape, dt)
            await g.scatter(out, sl if r == src else None, src)
            check(f"scatter {dtype} {N}", out, sl[r], dtype)
            # all_to_all, flat (even) and lists (uneven sizes)
            ins = [make(k, "a2a", (n * 3,), dtype) for k in range(n)]
            out = np.zeros(n * 3, dt)
            await g.all_to_all(out, ins[r])
            want = np.concatenate([ins[k][3 * r:3 * r + 3] for k in range(n)])
            check(f"all_to_all flat {dtype}", out, want, dtype)
            ins_l = [[make(k, f"a2al{j}", (k + j + 1,), dtype) for j in range(n)]
                     for k in range(n)]
            outs = [np.zeros((k + r + 1,), dt) for k in range(n)]
            await g.all_to_all(outs, ins_l[r])
            for k in range(n):
                check(f"all_to_all list {dtype} [{k}]", outs[k], ins_l[k][r], dtype)
    await g.barrier()
    return fails, digests


@pytest.mark.parametrize("n", [1, 2, 3, 5])   # 2: a power of two for recursive doubling; 3, 5 not
def test_every_op_dtype(n):
    algos = [None, "direct", "recursive_doubling", "ring", "shm"]
    if n == 5:   # five processes on the test machine's two cores: the large size, fewer paths
        results = run_world(n, every_case, SIZES[1:], ["recursive_doubling", "ring"], timeout_s=200)
    else:
        results = run_world(n, every_case, SIZES, algos, timeout_s=200)
    for r, (fails, _) in enumerate(results):
        assert not fails, f"rank {r}: {len(fails)} failures, first: {fails[:5]}"
    # all_reduce results are bit-identical on every rank, whatever the algorithm
    d0 = results[0][1]
    for r in range(1, n):
        bad = [k for k, v in results[r][1].items() if d0[k] != v]
        assert not bad, f"rank {r} differs from rank 0 in {bad[:5]}"


def test_tcp_only_across_hosts():
    """Ranks on different hosts (as the view says) never use shared memory."""
    hosts = {0: "host-a", 1: "host-a", 2: "host-b"}
    results = run_world(3, every_case, SIZES, [None, "ring"], hosts=hosts, timeout_s=200)
    for r, (fails, _) in enumerate(results):
        assert not fails, f"rank {r}: {fails[:5]}"


def test_shm_disabled():
    results = run_world(2, every_case, [70_001], [None], shm=False, timeout_s=200)
    for r, (fails, _) in enumerate(results):
        assert not fails, f"rank {r}: {fails[:5]}"
