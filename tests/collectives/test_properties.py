"""Property-based shapes (Hypothesis): any shape, dtype, op, layout gives the NumPy result."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import run_world
from .reference import DTYPES, close, make, np_dtype, ops_for, reduce_ref

pytestmark = pytest.mark.timeout(300)

ALGOS = [None, "direct", "recursive_doubling", "ring", "shm"]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    if draw(st.booleans()):
        shape = shape + (draw(st.sampled_from([1, 3, 5000])),)
    op = draw(st.sampled_from(ops_for(dtype)))
    strided = draw(st.booleans())
    algo = draw(st.sampled_from(ALGOS))
    return dtype, shape, op.name, strided, algo


async def run_cases(engine, case_list):
    from rtxnet.collectives import ReduceOp

    g = engine.world
    n, r = g.size, g.rank
    fails = []
    for i, (dtype, shape, opname, strided, algo) in enumerate(case_list):
        op = ReduceOp[opname]
        xs = [make(k, f"h{i}", shape, dtype, op) for k in range(n)]
        if strided:
            base = np.zeros(shape + (2,), np_dtype(dtype))
            base[..., 1] = xs[r]
            x = base[..., 1]
        else:
            x = xs[r].copy()
        await g.all_reduce(x, op, algorithm=algo)
        if not close(x, reduce_ref(xs, op, dtype), dtype):
            fails.append((dtype, shape, opname, strided, algo))
        if strided and np.any(base[..., 0]):
            fails.append(("clobbered", dtype, shape))
        out = np.zeros((n,) + shape, np_dtype(dtype))
        await g.all_gather(out, xs[r])
        if not close(out, np.stack(xs), dtype):
            fails.append(("all_gather", dtype, shape))
    return fails


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(cases(), min_size=1, max_size=12), st.integers(2, 4))
def test_all_reduce_any_shape(case_list, n):
    for r, fails in enumerate(run_world(n, run_cases, case_list)):
        assert not fails, f"rank {r}: {fails}"
