"""Garbage on a rank's data ports, in process, over real sockets: what a client that reaches the
ports (no token: nothing else keeps it out) can make the rank hold or log is bounded.
A breaker's finds (repro/peer_port_dos.py): every bulk handshake of another job with a future
epoch kept its socket for good (20,500 killed the job with EMFILE); every ZeroMQ message of a
future epoch kept its payload (50 x 20 MiB: +1 GB); every garbage message wrote a log line."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
import zmq

from transport.logbudget import LogBudget
from transport.peer import PeerMesh

pytestmark = pytest.mark.timeout(30)


async def _until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_garbage_on_the_mesh_logs_within_a_budget():
    mesh = PeerMesh("127.0.0.1", lambda *a: None)
    now = [100.0]
    mesh._drop_log = LogBudget(per_window=20, window_s=1.0, clock=lambda: now[0])
    mesh.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(mesh.endpoint)
        with structlog.testing.capture_logs() as logs:
            for _ in range(500):
                raw.send(b"x")
            await _until(lambda: mesh.dropped == 500, 10, "500 drops")
            lines = [e for e in logs if e["event"] == "data_message_dropped"]
            assert len(lines) == 20, len(lines)
            now[0] += 2.0   # a quiet spell: the next line says how many were left out
            raw.send(b"x")
            await _until(lambda: mesh.dropped == 501, 10, "the 501st drop")
            lines = [e for e in logs if e["event"] == "data_message_dropped"]
            assert len(lines) == 21 and lines[-1]["suppressed_before"] == 480, lines[-1]
    finally:
        raw.close(linger=0)
        mesh.close()
