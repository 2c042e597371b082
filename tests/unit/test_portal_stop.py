"""``Portal.stop`` right after a call was interrupted (Ctrl-C during ``rtxnet.init``'s rendezvous:
``wait_for`` cancels the coroutine, ``init`` stops the portal): the cancelled coroutine ends its
cancellation before the loop stops. Stopped half-way, its tasks were destroyed pending: each rank
printed ``Task was destroyed but it is pending!`` four times after its ``KeyboardInterrupt``
traceback, and the coroutine's own cleanup never ran."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import asyncio, gc, time
from rtxnet.portal import Portal

async def child():
    try:
        await asyncio.sleep(100)
    except asyncio.CancelledError:
        await asyncio.sleep(0.05)   # a cleanup that takes a moment (closing sockets)
        print("cleanup ran", flush=True)
        raise

async def main():
    await asyncio.ensure_future(child())

p = Portal()
f = p.submit(main)
time.sleep(0.2)
f.cancel()   # what wait_for does on Ctrl-C
p.stop()     # what init does right after
del f, p
gc.collect()
"""


def test_stop_after_a_cancelled_call_lets_its_tasks_end():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "Task was destroyed" not in out.stderr, out.stderr
    assert "cleanup ran" in out.stdout
