"""ZeroMQ socket monitors made while signals arrive (``transport.channel.monitor_socket``).

rtxnet-run once ended in ``zmq.error.InterruptedSystemCall`` from ``get_monitor_socket`` inside a
``ControlClient`` made while its ranks exited (SIGCHLD): libzmq's ``zmq_socket_monitor`` fails with
EINTR and pyzmq does not retry it. Here a child process sends this one SIGUSR1 (which has a Python
handler, so system calls are interrupted) every 50 us while monitors are made.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from transport.channel import monitor_socket

pytestmark = pytest.mark.timeout(60)


def _under_signals(make, n: int, *, enough: int | None = None, budget_s: float = 15.0) -> tuple[int, int]:
    """Make and close up to ``n`` monitored sockets while SIGUSR1 rains (stopping early once
    ``enough`` raised, or after ``budget_s``); returns ``(tries, how many raised
    InterruptedSystemCall)``."""
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    storm = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, time\n"
        f"while True:\n    os.kill({os.getpid()}, signal.SIGUSR1)\n    time.sleep(0.00005)\n")])
    ctx = zmq.Context()
    interrupted = tries = 0
    end = time.monotonic() + budget_s
    try:
        time.sleep(0.2)   # the storm has started
        while tries < n and time.monotonic() < end and (enough is None or interrupted < enough):
            tries += 1
            s = ctx.socket(zmq.DEALER)
            try:
                m = make(s)
                s.disable_monitor()
                m.close(0)
            except zmq.error.InterruptedSystemCall:
                interrupted += 1
            s.close(0)
            if tries % 200 == 0:
                time.sleep(0.1)   # closed sockets are reaped (libzmq caps a context at 1023)
    finally:
        storm.kill()
        storm.wait()
        signal.signal(signal.SIGUSR1, previous)
        ctx.term()
    return tries, interrupted


def test_a_monitor_is_made_though_signals_interrupt_it():
    # the control: the plain call is interrupted here (else this machine cannot show the fault);
    # on loaded cores the storm is slower, so it goes on until 3 were (or 15 s); then the retrying
    # form as many times (2000 to 5000), and not one may raise
    tries, raw = _under_signals(lambda s: s.get_monitor_socket(zmq.EVENT_DISCONNECTED), 10**6,
                                enough=3)
    if raw == 0:
        pytest.skip(f"no get_monitor_socket was interrupted in {tries} tries (pyzmq retries it now?)")
    tries, interrupted = _under_signals(lambda s: monitor_socket(s, zmq.EVENT_DISCONNECTED),
                                        min(max(2000, tries), 5000))
    assert interrupted == 0 and tries >= 1000, (tries, interrupted)
