"""FaultTolerance(sharded_state=True): which committed ring a sync takes (``_choose_ring``)."""

from __future__ import annotations

import numpy as np
import pytest

from rtxnet.elastic import FaultTolerance

pytestmark = pytest.mark.timeout(30)

NONE = [0, -1, -1, 0, -1, -1]


def _rows(*ranks):
    return np.array([a + b for a, b in ranks], dtype=np.int64)


def test_a_ring_copy_cut_short_by_a_loss_leaves_the_kept_ring_to_take():
    # World 0 of 4 ranks (a, b, c, d) committed step 5; c died; the world of 3 (a, b, d) took
    # the state from that ring (epoch 0) and began its own ring copy (epoch 1); a died in it
    # after sending to b, so b's copy completed ({b, a} of epoch 1) and d's did not (it holds
    # its epoch-0 ring {d, c}). Now b and d: epoch 1's ring lacks d's state, and without the
    # ring b kept, epoch 0's lacks a's and b's. Before, b dropped epoch 0's ring at its copy,
    # the sync found no complete ring and ended the job (a breaker's find).
    b = ([1, 5, 1, 3, 1, 0], [1, 5, 0, 4, 1, 0])      # its ring, and the one it kept
    d = ([1, 5, 0, 4, 3, 2], NONE)
    best, world, holders, complete, at = FaultTolerance._choose_ring(_rows(b, d))
    assert (best, world, complete) == (5, 4, True)
    assert holders == {1: (0, 1), 3: (1, 0), 0: (0, 1), 2: (1, 0)}    # (rank now, slot)
    assert at == [0, 1]
    # without the kept ring: nothing complete, the newest epoch's named
    best, world, holders, complete, _ = FaultTolerance._choose_ring(_rows((b[0], NONE), d))
    assert (best, world, complete) == (5, 3, False) and holders == {1: (0, 0), 0: (0, 0)}


def test_the_newest_complete_ring_wins_and_an_older_step_never_does():
    # both rings of every rank complete: the newer epoch's, each rank its own state in place
    r0 = ([1, 7, 2, 2, 0, 1], [1, 7, 1, 3, 0, 2])
    r1 = ([1, 7, 2, 2, 1, 0], [1, 7, 1, 3, 1, 0])
    best, world, holders, complete, _ = FaultTolerance._choose_ring(_rows(r0, r1))
    assert (best, world, complete) == (7, 2, True) and holders == {0: (0, 0), 1: (1, 0)}
    # a complete ring of an older step loses to an incomplete one of the newest step (the
    # checkpoint, if any, stands in then: steps are not silently lost)
    old = ([1, 6, 0, 1, 0, -1], NONE)
    new = ([1, 7, 1, 2, 1, 0], NONE)
    best, world, _, complete, _ = FaultTolerance._choose_ring(_rows(old, new))
    assert (best, world, complete) == (7, 2, True)
    new_half = ([1, 7, 1, 3, 1, 0], NONE)
    best, _, _, complete, _ = FaultTolerance._choose_ring(_rows(old, new_half))
    assert (best, complete) == (7, False)
