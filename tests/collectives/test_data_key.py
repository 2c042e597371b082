"""A job token guards the ranks' data ports too (transport.peer.data_key): a client that knows
a rank's data port but not the token can deliver nothing to it, over ZeroMQ or a bulk stream.
Without a token the ports admit any client (the control below shows a forged message landing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import procs
import pytest
import zmq

from transport import bulk
from transport.peer import DataHeader, Kind, PeerMesh, data_key, encode_header

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _header(step: int) -> bytes:
    return encode_header(DataHeader("job", 0, "w", 0, 0, Kind.DATA, step, None))


async def _settle(got: list, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def test_data_key_is_per_job_and_none_without_a_token():
    assert data_key("a", "") is None
    k = data_key("a", "s3cret")
    assert len(k) == 64 and k == data_key("a", "s3cret")
    assert k != data_key("b", "s3cret") and k != data_key("a", "other")


async def test_a_mesh_with_a_key_admits_only_peers_that_prove_it():
    key = data_key("job", "s3cret")
    got: list[int] = []
    recv = PeerMesh("127.0.0.1", lambda h, p, f: got.append(h.step), key)
    recv.start()
    good = PeerMesh("127.0.0.1", lambda *a: None, key)
    wrong = PeerMesh("127.0.0.1", lambda *a: None, data_key("job", "guess"))
    none = PeerMesh("127.0.0.1", lambda *a: None)
    raw = zmq.Context.instance().socket(zmq.DEALER)   # a plain client, no mechanism at all
    raw.setsockopt(zmq.LINGER, 0)
    try:
        wrong.send(recv.endpoint, _header(2))
        none.send(recv.endpoint, _header(3))
        raw.connect(recv.endpoint)
        # (refused, the client may have no link left to queue on: it would block)
        with contextlib.suppress(zmq.Again):
            raw.send_multipart([_header(4), b"x" * (8 << 20)], zmq.NOBLOCK)
        good.send(recv.endpoint, _header(1))
        await _settle(got, 2, 2.0)
        assert got == [1]
        good.send(recv.endpoint, _header(5))
        await _settle(got, 2, 5.0)
        assert got == [1, 5]
    finally:
        raw.close(linger=0)
        for m in (good, wrong, none, recv):
            m.close()


async def test_a_mesh_without_a_key_admits_any_client():
    # the control: the same plain client is delivered where no token was set
    got: list[int] = []
    recv = PeerMesh("127.0.0.1", lambda h, p, f: got.append(h.step))
    recv.start()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(recv.endpoint)
        raw.send_multipart([_header(4)])
        await _settle(got, 1, 5.0)
        assert got == [4]
    finally:
        raw.close(linger=0)
        recv.close()


@pytest.mark.skipif(not bulk.AVAILABLE, reason="bulk streams are Linux only")
@pytest.mark.parametrize("sent", ["right", "wrong", "zeros"])
async def test_a_bulk_stream_without_the_key_is_closed_before_it_is_used(sent):
    key = data_key("job", "s3cret")
    links = bulk.BulkLinks("127.0.0.1", key)
    links.start()
    links.set_epoch("job", 3, 0)
    proof = {"right": bytes.fromhex(key), "wrong": bytes.fromhex(data_key("job", "guess")),
             "zeros": bytes(32)}[sent]
    loop = asyncio.get_running_loop()
    s = socket.create_connection(("127.0.0.1", links.port))
    s.setblocking(False)
    try:
        hs = bulk._HANDSHAKE.pack(bulk._MAGIC, 3, 1, 3, 1, proof) + b"job" + b"w"
        await loop.sock_sendall(s, hs)
        if sent == "right":
            link = await asyncio.wait_for(links.recv_link("w", 1), 5)
            assert not link.dead
        else:
            # the receiver closes the stream (a reset: the names were left unread), and no
            # link was made
            try:
                assert await asyncio.wait_for(loop.sock_recv(s, 1), 5) == b""
            except ConnectionResetError:
                pass
            assert not links._recv
    finally:
        s.close()
        links.close()


_RANK = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import rtxnet

    out = sys.argv[1]
    pg = rtxnet.init()
    if pg.rank == 1:   # (whole or not at all: renamed into place)
        with open(f"{out}/target.tmp", "w") as f:
            json.dump({"endpoint": pg.engine.endpoint.split("?")[0], "job": pg.engine.view.job,
                       "epoch": pg.engine.view.epoch}, f)
        os.replace(f"{out}/target.tmp", f"{out}/target.json")
    while not os.path.exists(f"{out}/attacked"):   # the test's forged messages went out
        time.sleep(0.05)
    time.sleep(0.5)   # their way over loopback (unobservable where the token keeps them out)
    pg.barrier(timeout=30)
    wrong = []
    for i in range(1, 11):
        if pg.rank == 0:
            pg.send(np.full(4, float(i), np.float32), dst=1, tag=7)
        else:
            x = np.zeros(4, np.float32)
            pg.recv(x, src=0, tag=7, timeout=30)
            if x[0] != i:
                wrong.append(float(x[0]))
    # the ring's blocks over the bulk streams (shared memory off), which carry the key too
    y = np.ones(4 << 20, np.float32)
    pg.all_reduce(y, algorithm="ring", timeout=30)
    bulk_used = len(pg.engine._bulk._send) > 0
    if pg.rank == 1:
        with open(f"{out}/result.json", "w") as f:
            json.dump({"wrong": wrong, "sum": float(y.min()), "bulk": bulk_used}, f)
    pg.barrier(timeout=30)
    pg.close()
""")


@pytest.mark.parametrize("token", ["s3cret", ""], ids=["token", "no-token"])
def test_forged_point_to_point_messages_reach_no_rank_of_a_job_with_a_token(tmp_path, token):
    # A tester's find: a plain ZeroMQ client sent rank 1 a point-to-point message claiming to
    # come from rank 0 (tag 7, float32[4] of 666); rank 1's recv took it as rank 0's data, and
    # every later recv got the message before its own, with RTXNET_TOKEN set as without it.
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=procs.env(RTXNET_TOKEN=token, RTXNET_SHM="0"))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        target = tmp_path / "target.json"
        procs.wait_until(lambda: target.exists() or proc.poll() is not None, 60, "rank 1's endpoint")
        assert target.exists(), proc.communicate(timeout=30)[0][-4000:]
        t = json.loads(target.read_text())
        sock.connect(t["endpoint"])
        forged = encode_header(DataHeader(t["job"], t["epoch"], "w", 0, 0, Kind.P2P, 7,
                                          ["float32", [4]]))
        for _ in range(3):   # (refused, the client may have no link to queue on)
            with contextlib.suppress(zmq.Again):
                sock.send_multipart([forged, np.full(4, 666.0, np.float32).tobytes()], zmq.NOBLOCK)
        (tmp_path / "attacked").touch()
        out, _ = proc.communicate(timeout=90)
    finally:
        sock.close(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["sum"] == 2.0 and res["bulk"], res
    wrong = res["wrong"]
    if token:
        assert wrong == [], wrong
    else:   # the control: without a token the port admits the forged messages
        assert wrong and wrong[0] == 666.0, wrong
