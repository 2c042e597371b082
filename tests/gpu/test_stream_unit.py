"""Host-side waiting for GPU work (``stream.await_event`` and ``poll_delay``) with stand-in events
(objects with ``done``), under both event loops a user may run: no CUDA needed."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from rtxnet.collectives.gpu import stream

pytestmark = pytest.mark.timeout(30)


class Flag:
    done = False


def test_poll_delay_is_a_bare_yield_first_then_a_millisecond():
    assert stream.poll_delay(0.0) == 0.0
    assert stream.poll_delay(stream.BUSY_POLL_S * 0.99) == 0.0
    assert stream.poll_delay(stream.BUSY_POLL_S) == 1e-3
    assert stream.poll_delay(60.0) == 1e-3


@pytest.mark.parametrize("runner", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_await_event_lets_the_loop_run_and_returns_on_completion(runner):
    """The wait yields to the loop between polls (the task that completes the event runs; a
    wait that held the loop would never return) and ends once the event completes."""

    async def main():
        ev, turns = Flag(), 0

        async def other():
            nonlocal turns
            for _ in range(200):
                turns += 1
                await asyncio.sleep(0)
            ev.done = True

        task = asyncio.create_task(other())
        await stream.await_event(ev, timeout_s=10)
        await task
        return turns

    assert runner(main()) == 200


def test_await_event_gives_up_after_its_timeout():
    async def main():
        await stream.await_event(Flag(), timeout_s=0.05)

    with pytest.raises(Exception, match="not complete after 0.05 s"):
        asyncio.run(main())


def test_await_event_raises_the_ops_error_once_set():
    class Op:
        error = None

    async def main():
        op = Op()
        asyncio.get_running_loop().call_later(0.02, setattr, op, "error", KeyError("lost"))
        await stream.await_event(Flag(), op)

    with pytest.raises(KeyError, match="lost"):
        asyncio.run(main())
