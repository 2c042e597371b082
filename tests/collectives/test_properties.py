"""Property-based shapes (Hypothesis): any shape, dtype, op, layout gives the NumPy result."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .harness import run_world
from .reference import DTYPES, ops_for, run_cases

pytestmark = pytest.mark.timeout(300)

ALGOS = [None, "direct", "recursive_doubling", "ring", "shm"]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=0, max_size=3)))
    if draw(st.booleans()) and int(np.prod(shape)) <= 40:
        shape = shape + (draw(st.sampled_from([1, 3, 5000])),)  # above the shm/ring thresholds
    op = draw(st.sampled_from(ops_for(dtype)))
    strided = draw(st.booleans())
    algo = draw(st.sampled_from(ALGOS))
    return dtype, shape, op.name, strided, algo


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(cases(), min_size=1, max_size=12), st.integers(2, 4))
def test_all_reduce_any_shape(case_list, n):
    for r, fails in enumerate(run_world(n, run_cases, case_list)):
        assert not fails, f"rank {r}: {fails}"
