"""How a recovery that spans several losses is recorded and reported (FaultTolerance's events)."""

from __future__ import annotations

import asyncio

import pytest

from rtxnet.agent import Membership
from rtxnet.elastic import FaultTolerance

pytestmark = pytest.mark.timeout(10)


def _membership(epoch: int, lost: tuple[int, ...], launch: list[int | None] = (), added=(),
                reason="lost") -> Membership:
    members = {r: {"info": {} if x is None else {"launch_rank": x}} for r, x in enumerate(launch)}
    return Membership(job="j", epoch=epoch, rank=0, world_size=len(members), members=members,
                      lost=lost, added=added, reason=reason, committed_step=5)


def _ft() -> FaultTolerance:
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.events, ft._epoch_seen, ft._epoch_lost = [], {}, {}
    ft._open_failure = None          # as __init__ sets it before any listener runs
    ft._epoch_lost_launch, ft._launch_of, ft._pending_joins = {}, {}, []
    ft._epoch_same = set()
    ft.step, ft.committed_step, ft.launch_rank = 6, 5, 0
    ft.injector = None
    ft.state = None
    ft._synced_epoch, ft._noted_through = 2, -1
    return ft


def _close(ft: FaultTolerance, world_size: int) -> dict:
    """Close ``ft``'s open failure in epoch 3 (no injection time known); returns its record."""
    class Store:
        async def get(self, key):
            return None

    class PG:
        epoch, store = 3, Store()

    ft.pg = PG()
    ft.pg.world_size = world_size

    async def no_injection(t, lost_launch=None):
        return None

    ft._injection_time = no_injection
    asyncio.run(ft._close_failure())
    return ft.events[-1]


def test_every_loss_while_a_failure_is_open_is_recorded_and_reported():
    ft = _ft()
    ft._on_epoch(_membership(1, (), [None, 1, 2, 3]), "formed")   # before the failure: not counted
    ft._open_failure = {"step": 6, "error": "PeerLostError", "lost": [0, 2], "epoch": 1,
                        "t_detected": 0.0}
    ft._on_epoch(_membership(2, (0, 2), [1, 3]), "lost")          # ranks 0 and 2 together
    ft._on_epoch(_membership(3, (1,), [1]), "lost")               # then rank 1 (of epoch 2's numbering)
    rec = _close(ft, 1)
    assert rec["lost"] == [0, 2, 1]
    assert rec["losses"] == [{"epoch": 2, "ranks": [0, 2]}, {"epoch": 3, "ranks": [1]}]
    assert rec["lost_launch"] is None      # epoch 1's rank 0 was started by hand: no launch rank

    lines = asyncio.run(ft.areport())
    assert "lost ranks [0, 2] (epoch 2) then [1] (epoch 3)" in lines[-1], lines


def test_lost_and_joined_ranks_are_named_by_launch_rank():
    # Launch ranks 2 then 3 lost in two epochs: both are "rank 2" in their epoch's numbering.
    ft = _ft()
    ft._on_epoch(_membership(1, (), [0, 1, 2, 3]), "formed")
    ft._open_failure = {"step": 6, "error": "PeerLostError", "lost": [2], "epoch": 1, "t_detected": 0.0}
    ft._on_epoch(_membership(2, (2,), [0, 1, 3]), "lost")
    ft._on_epoch(_membership(3, (2,), [0, 1]), "lost")
    rec = _close(ft, 2)
    assert rec["lost"] == [2, 2] and rec["lost_launch"] == [2, 3]
    ft._on_epoch(_membership(4, (), [0, 1, 3], added=(2,), reason="joined"), "joined")
    assert ft.events[-1]["event"] != "joined"     # reported at the sync, with its step
    ft._synced(5, 4, 0, 3, 0)
    joined = ft.events[-1]
    assert joined["event"] == "joined" and joined["added"] == [2] and joined["added_launch"] == [3]
    assert joined["world_size"] == 3 and joined["step"] == 6
    lines = asyncio.run(ft.areport())
    assert "(PeerLostError, lost launch ranks 2, 3)" in lines[0], lines
    assert lines[1] == "epoch 4: launch rank 3 joined at step 6; world of 3", lines


def test_a_step_across_two_losses_names_each_lost_process_once_by_launch_rank():
    # A fresh user's find: launch ranks 2 and 3 lost one after the other during a step read
    # "ranks [2, 2] lost" (each numbered in its own epoch, joined)
    ft = _ft()
    ft._on_epoch(_membership(1, (), [0, 1, 2, 3]), "formed")
    ft._on_epoch(_membership(2, (2,), [0, 1, 3]), "lost")
    ft._on_epoch(_membership(3, (2,), [0, 1]), "lost")
    ft._step_epoch, ft.sharded_state, got = 1, False, []

    async def recover(exc, step, **kw):
        got.append((exc, step))

    ft._recover = recover
    ft.pg = type("PG", (), {"membership": _membership(3, (2,), [0, 1]), "_pinned_world": None})()
    asyncio.run(ft._end(6))
    ((exc, step),) = got
    assert str(exc) == "membership changed during step 6 (epoch 1 -> 3): launch ranks 2, 3 lost"
    assert step == 6 and exc.ranks == [2, 2] and exc.epoch == 3   # (ranks: as a collective's name them)
    # a launch rank unknown (ranks started by hand): each epoch's numbers, said to be so
    from rtxnet.elastic import describe_lost

    assert describe_lost({2: [2], 3: [2]}, {2: [2], 3: None}, 1, 3) == "rank 2 of epoch 1, rank 2 of epoch 2"
    assert describe_lost({2: [0, 2]}, {2: [0, 3]}, 1, 3) == "launch ranks 0, 3"


def test_a_loss_between_two_steps_is_reported_though_no_step_failed():
    ft = _ft()
    ft._on_epoch(_membership(1, (), [0, 1, 2]), "formed")
    ft._synced_epoch = 1
    ft._on_epoch(_membership(2, (1,), [0, 2]), "lost")   # after step 5 committed, before step 6
    ft.pg = type("PG", (), {"epoch": 2, "world_size": 2, "store": None})()
    ft._note_loss_between_steps()
    e = ft.events[-1]
    assert e["event"] == "lost_between_steps" and e["lost"] == [1] and e["lost_launch"] == [1]
    assert e["step"] == 6 and e["world_size"] == 2
    assert asyncio.run(ft.areport()) == [
        "epoch 2: launch rank 1 lost between steps (before step 6): no step failed; world of 2"]


def test_a_process_not_yet_in_sync_does_not_report_a_join_at_its_own_step_0():
    # a restarted process sees another restarted one join before its first sync: its step (0)
    # is not the job's, so it reports no join (it printed "joined at step 0" at step 44)
    ft = _ft()
    ft.step, ft._synced_epoch = 0, -1
    ft._on_epoch(_membership(6, (), [1, 2, 0], added=(2,), reason="joined"), "joined")
    assert [e["event"] for e in ft.events] == []
    ft._synced_epoch = 6
    ft.step = 44
    ft._on_epoch(_membership(7, (), [1, 2, 0, 3], added=(3,), reason="joined"), "joined")
    ft._synced(43, 7, 0, 4, 0)
    assert [(e["event"], e["step"]) for e in ft.events] == [("joined", 44)]


def test_a_join_is_reported_at_the_step_the_grown_world_trains_first():
    # a fresh user's recheck: the join came while step 671 was in flight, which then committed
    # in the old world; training went on at 672 with the rank back, but the summary said
    # "joined at step 671"
    ft = _ft()
    ft._on_epoch(_membership(1, (), [0, 1]), "formed")
    ft.step = 671
    ft._on_epoch(_membership(2, (), [0, 1], added=(1,), reason="joined"), "joined")
    ft._synced(671, 2, 0, 2, 0)     # step 671 committed: the new world starts at 672
    assert [(e["event"], e["step"]) for e in ft.events] == [("joined", 672)]


def test_committed_state_nobody_holds_is_reported_as_steps_lost():
    ft = _ft()
    ft._open_failure = {"step": 6, "error": "PeerLostError", "lost": [0], "epoch": 1, "t_detected": 0.0}
    _close(ft, 2)   # (gives it a process group stand-in whose store answers)
    ft.events.clear()
    ft._event({"event": "state_lost", "epoch": 1, "world_size": 2, "job_committed_step": 9,
               "resumed_step": 0, "steps_lost": 10, "why": "save checkpoints with rtxnet.checkpoint.save"})
    lines = asyncio.run(ft.areport())
    assert lines == ["the job had committed step 9, but no live rank held it and no checkpoint stood in "
                     "(save checkpoints with rtxnet.checkpoint.save): training went on with 2 ranks at "
                     "step 0; steps lost: 10"], lines


def test_evictions_in_one_step_are_bounded_by_max_step_retries():
    # a multi-host tester's find: hosts that reach the coordinator but not each other evicted and
    # readmitted each other's ranks for ever, each side in turn, the step never committed; each
    # eviction was a membership change, so no failure counted toward max_step_retries
    from rtxnet import CollectiveTimeout, RtxError

    ft = _ft()
    ft.max_step_retries, ft._evictions = 3, {}
    ft._launch_of = {2: {1: 3}}
    exc = CollectiveTimeout("all_reduce timed out after 60 s waiting for ranks [1]", ranks=[1])
    for _ in range(3):
        ft._count_eviction(exc, 6, [1])
    with pytest.raises(RtxError, match=r"step 6: ranks were evicted 3 times for not taking part in time "
                                       r"and came back each time \(now launch ranks \[3\] again; "
                                       r"max_step_retries=3\): if they run on other hosts"):
        ft._count_eviction(exc, 6, [1])
    ft._count_eviction(exc, 7, [1])   # counted per step: another step starts afresh
    assert ft._evictions == {6: 4, 7: 1}
