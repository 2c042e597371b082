"""How a recovery that spans several losses is recorded and reported (FaultTolerance's events)."""

from __future__ import annotations

import asyncio

import pytest

from rtxnet.agent import Membership
from rtxnet.elastic import FaultTolerance

pytestmark = pytest.mark.timeout(10)


def _membership(epoch: int, lost: tuple[int, ...]) -> Membership:
    return Membership(job="j", epoch=epoch, rank=0, world_size=2, members={}, lost=lost, added=(),
                      reason="lost", committed_step=5)


def test_every_loss_while_a_failure_is_open_is_recorded_and_reported():
    ft = FaultTolerance.__new__(FaultTolerance)
    ft.events, ft._epoch_seen, ft._epoch_lost = [], {}, {}
    ft.step, ft.committed_step, ft.launch_rank = 6, 5, 0
    ft.injector = None
    ft._on_epoch(_membership(1, ()), "formed")           # before the failure: not counted
    ft._open_failure = {"step": 6, "error": "PeerLostError", "lost": [0, 2], "epoch": 1,
                        "t_detected": 0.0}
    ft._on_epoch(_membership(2, (0, 2)), "lost")          # ranks 0 and 2 together
    ft._on_epoch(_membership(3, (1,)), "lost")            # then rank 1 (of epoch 2's numbering)

    class Store:
        async def get(self, key):
            return None

    class PG:
        epoch, world_size, store = 3, 1, Store()

    ft.pg = PG()

    async def no_injection(t):
        return None

    ft._injection_time = no_injection
    asyncio.run(ft._close_failure())
    rec = ft.events[-1]
    assert rec["lost"] == [0, 2, 1]
    assert rec["losses"] == [{"epoch": 2, "ranks": [0, 2]}, {"epoch": 3, "ranks": [1]}]

    async def report():
        return await ft.areport()

    lines = asyncio.run(report())
    assert "lost ranks [0, 2] (epoch 2) then [1] (epoch 3)" in lines[-1], lines
