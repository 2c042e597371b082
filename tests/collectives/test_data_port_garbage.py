"""Garbage on a rank's data ports, in process, over real sockets: what a client that reaches the
ports (no token: nothing else keeps it out) can make the rank hold or log is bounded.
A breaker's finds (repro/peer_port_dos.py): every bulk handshake of another job with a future
epoch kept its socket for good (20,500 killed the job with EMFILE); every ZeroMQ message of a
future epoch kept its payload (50 x 20 MiB: +1 GB); every garbage message wrote a log line."""

from __future__ import annotations

import asyncio
import errno
import socket
import time

import numpy as np
import pytest
import structlog
import zmq

from transport import bulk
from transport.logbudget import LogBudget
from transport.peer import DataHeader, Kind, PeerMesh, encode_header

pytestmark = pytest.mark.timeout(30)
needs_bulk = pytest.mark.skipif(not bulk.AVAILABLE, reason="bulk streams are Linux only")


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


def _handshake(epoch: int, job: bytes, gid: bytes = b"w", src: int = 1) -> bytes:
    return bulk._HANDSHAKE.pack(bulk._MAGIC, epoch, src, len(job), len(gid), bytes(32)) + job + gid


async def _closed_by_the_rank(loop, s: socket.socket) -> bool:
    try:
        return await asyncio.wait_for(loop.sock_recv(s, 1), 5) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
async def links():
    lk = bulk.BulkLinks("127.0.0.1")
    lk.start()
    lk.set_epoch("job", 3, 0)
    yield lk
    lk.close()


@needs_bulk
async def test_a_bulk_handshake_of_another_job_is_refused_whatever_its_epoch(links):
    loop = asyncio.get_running_loop()
    # the breaker's bytes: job "other", epoch 2**40, no key, the client closing at once
    for i in range(100):
        with socket.create_connection(("127.0.0.1", links.port)) as c:
            c.sendall(_handshake(2**40, b"other", src=i))
    s = socket.create_connection(("127.0.0.1", links.port))   # and one that stays
    s.setblocking(False)
    try:
        await loop.sock_sendall(s, _handshake(4, b"other"))
        assert await _closed_by_the_rank(loop, s)
        await _until(lambda: not links._handshaking, 5, "the handshakes")
        assert not links._recv and links.open_fds() == 1, (len(links._recv), links.open_fds())
    finally:
        s.close()


@needs_bulk
async def test_bulk_streams_of_a_later_epoch_are_bounded_and_closed_when_their_peer_goes(
        links, monkeypatch):
    monkeypatch.setattr(bulk, "MAX_FUTURE_STREAMS", 8, raising=False)
    loop = asyncio.get_running_loop()
    held = []
    try:
        for i in range(8):   # this job, a far epoch, peers that stay: kept up to the bound
            s = socket.create_connection(("127.0.0.1", links.port))
            s.setblocking(False)
            held.append(s)
            await loop.sock_sendall(s, _handshake(2**40, b"job", src=i))
        await _until(lambda: len(links._recv) == 8, 5, "8 kept streams")
        extra = socket.create_connection(("127.0.0.1", links.port))
        extra.setblocking(False)
        held.append(extra)
        await loop.sock_sendall(extra, _handshake(2**40, b"job", src=99))
        assert await _closed_by_the_rank(loop, extra)
        assert len(links._recv) == 8
        for s in held[:8]:   # their peers go: so do the streams, before anyone reads them
            s.close()
        await _until(lambda: not links._recv, 5, "the closed streams to go")
        assert links.open_fds() == 1
        # the legitimate case still works: a peer in epoch 4 first sends a block ahead of us
        peer = socket.create_connection(("127.0.0.1", links.port))
        peer.setblocking(False)
        held.append(peer)
        payload = np.arange(16, dtype=np.float32)
        await loop.sock_sendall(peer, _handshake(4, b"job", src=1)
                                + bulk._BLOCK.pack(bulk._MAGIC, 4, 0, 0, payload.nbytes)
                                + payload.tobytes())
        peer.shutdown(socket.SHUT_WR)   # it leaves after its block: the block is still read
        await _until(lambda: len(links._recv) == 1, 5, "the epoch-4 stream")
        await asyncio.sleep(0.1)
        links.set_epoch("job", 4, 0)
        out = np.zeros(16, np.float32)
        await asyncio.wait_for(links.recv_into("w", 1, 0, 0, memoryview(out).cast("B")), 5)
        assert (out == payload).all()
    finally:
        for s in held:
            s.close()


class _NoDescriptorsLeft:
    """The listener of a process out of descriptors: readable, and every accept fails."""

    def __init__(self, real: socket.socket):
        self.real, self.accepts = real, 0

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self):
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self.real.close()


@needs_bulk
async def test_bulk_accept_out_of_descriptors_backs_off_and_logs_within_a_budget(links):
    fake = links._listener = _NoDescriptorsLeft(links._listener)
    with structlog.testing.capture_logs() as logs, \
            socket.create_connection(("127.0.0.1", links.port)):
        await asyncio.sleep(1.0)
    # (it spun: 45,972 lines for the breaker's run)
    assert 3 <= fake.accepts <= 1.0 / getattr(bulk, "ACCEPT_PAUSE_S", 0.1) + 3, fake.accepts
    lines = [e for e in logs if e["event"] == "bulk_accept_failed"]
    assert 1 <= len(lines) <= 20, len(lines)


def _kept(engine) -> list:
    """(header, payload) of the messages of later epochs ``engine`` keeps."""
    fm = engine._future_msgs
    return [m for q in fm.values() for m in q] if isinstance(fm, dict) else list(fm)


async def test_messages_of_later_epochs_are_bounded_and_another_jobs_are_dropped(monkeypatch):
    from rtxnet.collectives import Engine, WorldView
    from rtxnet.collectives import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_MAX_FUTURE_NBYTES", 8 << 20, raising=False)
    e0 = await Engine.create(shm=False, bulk=False)
    e1 = await Engine.create(shm=False, bulk=False)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        eps = {0: e0.endpoint, 1: e1.endpoint}
        for e, r in ((e0, 0), (e1, 1)):
            e.set_view(WorldView("job", 0, r, 2, eps, {0: "h0", 1: "h1"}))
        raw.connect(e1.endpoint)
        blob = b"\0" * (1 << 20)

        def header(job, epoch, group="w"):
            return encode_header(DataHeader(job, epoch, group, 0, 0, Kind.DATA, 0, None))

        # the breaker's message (no job, epoch 2**62), then this job's, all with 1 MiB each
        for _ in range(20):
            raw.send_multipart([header("", 2**62), blob])
        for _ in range(20):
            raw.send_multipart([header("job", 2**62), blob])
        raw.send_multipart([header("job", 2, "marker")])   # (same connection: comes last)
        await _until(lambda: any(h.group == "marker" for h, _ in _kept(e1)), 10, "the marker")
        kept = _kept(e1)
        assert all(h.job == "job" for h, _ in kept), sum(h.job != "job" for h, _ in kept)
        assert sum(p.nbytes for _, p in kept if p is not None) <= 8 << 20, len(kept)
        # the legitimate case: rank 0 entered epoch 1 first and sends before rank 1 enters it;
        # what it sends displaces garbage of the far epoch
        e0.set_view(WorldView("job", 1, 0, 2, eps, {0: "h0", 1: "h1"}))
        x = np.arange(1 << 18, dtype=np.float32)   # 1 MiB
        await e0.world.send(x, dst=1, tag=7, timeout=5)
        await _until(lambda: any(h.epoch == 1 for h, _ in _kept(e1)), 10, "rank 0's send")
        assert sum(p.nbytes for _, p in _kept(e1) if p is not None) <= 8 << 20
        e1.set_view(WorldView("job", 1, 1, 2, eps, {0: "h0", 1: "h1"}))
        y = np.zeros_like(x)
        await e1.world.recv(y, src=0, tag=7, timeout=5)
        assert (y == x).all()
    finally:
        raw.close(linger=0)
        await e0.aclose()
        await e1.aclose()
