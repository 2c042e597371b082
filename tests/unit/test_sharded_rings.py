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


def _ring_rows(hosts, step=5, epoch=0):
    """Every rank's ring row after a commit in a world on ``hosts``: its own state and its
    predecessor's (FaultTolerance._ring_neighbours)."""
    rows = []
    for q in range(len(hosts)):
        _, prv = FaultTolerance._ring_neighbours(q, hosts)
        rows.append(([1, step, epoch, len(hosts), q, prv], NONE))
    return rows


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "a", "b", "b", "b"],
                                   ["a", "b", "a", "b"], ["a", "a", "b", "b", "c", "c"]])
def test_a_lost_host_leaves_every_rank_state_on_a_live_rank(hosts):
    # rtxnet-run --nnodes 2 --nproc 2 numbers a host's ranks consecutively; with the successor
    # rank + 1 the state of rank 2 lived on ranks 2 and 3, one host, and losing that host ended
    # the job ("the committed state of ranks [2] ... is gone": a tester's find). The ring order
    # now alternates hosts: each successor is on another host, so any one host may go.
    order = FaultTolerance._ring_order(hosts)
    assert sorted(order) == list(range(len(hosts)))
    for q in range(len(hosts)):
        nxt, _ = FaultTolerance._ring_neighbours(q, hosts)
        assert hosts[nxt] != hosts[q], (q, nxt, order)
    rows = _ring_rows(hosts)
    for gone in sorted(set(hosts)):
        live = [r for q, r in enumerate(rows) if hosts[q] != gone]
        best, world, holders, complete, _ = FaultTolerance._choose_ring(_rows(*live))
        assert (best, world, complete) == (5, len(hosts), True), (gone, holders)


def test_one_host_keeps_the_ring_of_rank_plus_one():
    assert FaultTolerance._ring_order(["h"] * 5) == [0, 1, 2, 3, 4]
    assert FaultTolerance._ring_neighbours(0, ["h"] * 5) == (1, 4)
    assert FaultTolerance._ring_order(["a", "a", "a", "b"]) == [0, 3, 1, 2]   # as even as it gets


@pytest.mark.parametrize("old_world, hosts", [(4, ["h"] * 4), (4, ["h"] * 3), (5, ["a", "a", "b"]),
                                              (2, ["h"] * 4), (3, ["h"] * 1), (8, ["a", "b"])])
def test_each_state_a_sync_took_stays_on_two_ranks_of_the_new_world(old_world, hosts):
    w = len(hosts)
    kept = {r: FaultTolerance._kept_after_sync(old_world, hosts, r) for r in range(w)}
    for k in range(old_world):
        on = [r for r in range(w) if k in kept[r]]
        assert len(on) == min(2, w), (k, kept)
        if len(set(hosts)) > 1 and all(hosts.count(h) == hosts.count(hosts[0]) for h in hosts):
            assert len({hosts[r] for r in on}) == 2, (k, on)     # hosts alike: on two of them
    # bounded: about two old states per new rank, never the whole model on every rank
    assert max(map(len, kept.values())) <= 2 * -(-old_world // w)


def test_a_second_loss_before_the_new_ring_copy_takes_the_states_the_sync_kept():
    # World 0 of 4 committed step 19 (ring 0 -> 1 -> 2 -> 3). Rank 0 died; the new world of 4
    # (a replacement: it became rank 3, the survivors are ranks 0..2 = old 1..3) took every
    # state by broadcast, old rank 0's from old rank 1 (now 0). Then that rank died at the sync,
    # before the new world's ring copy: old rank 0's state lived only on it. Before, every rank
    # dropped the states it had loaded and the job ended ("the committed state of ranks [0, 1]
    # ... is gone": a tester's find). Each rank now keeps the ones _kept_after_sync gives it.
    hosts = ["h"] * 4
    kept = {r: FaultTolerance._kept_after_sync(4, hosts, r) for r in range(4)}
    old_ring = {0: [1, 0], 1: [2, 1], 2: [3, 2], 3: None}      # new rank -> (own, pred) of epoch 0
    live = [1, 2, 3]                                           # new rank 0 died
    both, more = [], []
    for r in live:
        ring = [1, 19, 0, 4, *old_ring[r]] if old_ring[r] else [0, 19, -1, 4, 3, -1]  # replacement: as built
        held = kept[r]
        both.append(ring + [1, 19, 0, 4, held[0], held[1] if len(held) > 1 else -1])
        more.append(held[2:])
    n = max(map(len, more))
    extra = np.array([m + [-1] * (n - len(m)) for m in more], dtype=np.int64).reshape(len(live), n) if n else None
    best, world, holders, complete, _ = FaultTolerance._choose_ring(np.array(both, dtype=np.int64), extra)
    assert (best, world, complete) == (19, 4, True), holders
    assert set(holders) == {0, 1, 2, 3}
    # without the kept states: old rank 0's is gone (as before)
    bare = np.array([b[:6] + NONE for b in both], dtype=np.int64)
    assert FaultTolerance._choose_ring(bare)[3] is False


def test_a_kept_ring_of_more_than_two_states_is_read_past_its_row():
    # 4 ranks shrank: a kept ring may hold more than two states; the third and on come in extra
    a = ([1, 9, 3, 3, 0, 2], [1, 9, 2, 4, 0, 3])      # its ring of epoch 3 lacks rank 1
    b = ([0, -1, -1, 0, -1, -1], [1, 9, 2, 4, 1, 0])
    extra = np.array([[2], [-1]], dtype=np.int64)
    best, world, holders, complete, _ = FaultTolerance._choose_ring(_rows(a, b), extra)
    assert (best, world, complete) == (9, 4, True) and holders[2] == (0, 1)
    assert FaultTolerance._choose_ring(_rows(a, b))[3] is False
