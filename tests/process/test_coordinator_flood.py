"""A client flooding the coordinator with malformed messages: the daemon keeps serving and its log
stays bounded (at most ``LogBudget.per_window`` protocol_error lines a second, then one line that
counts what was suppressed)."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import msgpack
import procs
import pytest

from transport import wire
from transport.channel import LogBudget
from transport.codec import decode, encode

pytestmark = pytest.mark.timeout(60)


def test_log_budget_counts_what_it_suppresses():
    now = [100.0]
    b = LogBudget(per_window=3, window_s=0.2, clock=lambda: now[0])
    assert [b.allow() for _ in range(5)] == [(True, 0)] * 3 + [(False, 0)] * 2
    now[0] += 0.25
    assert b.allow() == (True, 2)
    assert b.allow() == (True, 0)


def test_a_flood_of_garbage_leaves_the_daemon_serving_with_a_bounded_log(coordinator):
    with procs.dealer(coordinator.address, timeout_s=10) as d:
        t0 = time.monotonic()
        for _ in range(3000):
            d.send(b"\xc1\xc1\xc1")          # not msgpack: logged (within budget), dropped
        d.send(encode(wire.make("status", rid=1)))
        assert decode(d.recv())["rid"] == 1   # served after the whole flood
        time.sleep(LogBudget().window_s + 0.1)   # the budget's own window, which must pass
        d.send(b"\xc1")                       # the first line after the flood says how many
        d.send(encode(wire.make("status", rid=2)))
        assert decode(d.recv())["rid"] == 2
        elapsed = time.monotonic() - t0

    def counted():
        return [line for line in coordinator.log.splitlines() if "protocol_error" in line]

    def accounted() -> tuple[int, int]:
        lines = counted()
        return len(lines), sum(int(m) for ln in lines for m in re.findall(r"suppressed_before=(\d+)", ln))

    # every one of the 3001 logged or counted: the daemon's log reaches this process through a
    # pipe, and on loaded cores its last lines came after the first counting one (a fresh user's
    # run read (40, 2313): 648 not yet read, not lost)
    with contextlib.suppress(AssertionError):
        procs.wait_until(lambda: sum(accounted()) == 3001, 10, "every garbage message logged or counted")
    n_lines, suppressed = accounted()
    budget = LogBudget().per_window
    assert n_lines <= budget * (int(elapsed / LogBudget().window_s) + 2), n_lines
    assert n_lines + suppressed == 3001, (n_lines, suppressed)
    assert coordinator.proc.poll() is None


def test_a_flood_of_oversize_messages_leaves_the_daemon_running_on_time(coordinator):
    # Each oversize message was copied whole to find its request id (46 ms for 60 MB), and frames
    # up to 4x the limit were taken in: four clients sending 60 MB frames stalled the daemon 4-11 s
    # (a fresh user's find). Now the id is read from the message's first bytes, and a frame above
    # 2x the limit drops its connection before it is read.
    over = 24 << 20                       # above the 17 MiB limit: answered, naming the limit
    big = msgpack.packb(wire.make("kv_set", rid=5, job="j", key="k", value=b"x" * over), use_bin_type=True)
    with procs.dealer(coordinator.address, timeout_s=20) as d:
        for _ in range(30):
            d.send(big, copy=False)
        for _ in range(30):
            r = decode(d.recv())
            assert r["rid"] == 5 and "exceeds the limit" in r["message"], r
    with procs.dealer(coordinator.address, timeout_s=5) as d:
        d.send(b"\x00" * (40 << 20))          # above 2x the limit: the connection is dropped
        with procs.dealer(coordinator.address, timeout_s=10) as ok:
            ok.send(encode(wire.make("status", rid=1)))
            assert decode(ok.recv())["rid"] == 1
    # (a stall of 0.4 s was logged once at a load of 13-16 on 2 cores, the daemon merely not
    # scheduled: the copies stalled it seconds)
    stalls = [float(s) for s in re.findall(r"coordinator_stalled\s+seconds=([\d.]+)", coordinator.log)]
    assert all(s < 2.0 for s in stalls), coordinator.log[-2000:]
    assert coordinator.proc.poll() is None


_FLOODER = """
import sys, time, uuid, zmq
address, seconds = sys.argv[1], float(sys.argv[2])
ctx = zmq.Context()
end = time.monotonic() + seconds
status = bytes.fromhex(sys.argv[3])
while time.monotonic() < end:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, f"flood/{uuid.uuid4().hex}".encode())
    s.connect(address)
    s.send(status)          # one request, then close: its descriptor is free for the next one
    time.sleep(0.001)
    s.close()
ctx.term()
"""


@pytest.mark.timeout(120)
@pytest.mark.exclusive   # two processes opening ~1,000 connections a second take both cores
def test_a_flood_of_short_connections_never_costs_a_live_agent_its_membership(coordinator):
    # A disconnect notice named the agent by its connection's file descriptor, which the kernel
    # reuses at once: a notice read after another client's frame had given the descriptor to a
    # live agent named that agent, and the daemon fenced it (a tester's find: 6 to 8 of 60
    # one-rank jobs under two such flooders, with no disconnect on the agent's side).
    import subprocess
    import sys

    seconds = 12.0   # ~40 one-rank jobs: the old fault hit 6 to 8 of 60
    flooders = [subprocess.Popen([sys.executable, "-c", _FLOODER, coordinator.address, str(seconds),
                                  encode(wire.make("status", rid=1)).hex()], env=procs.env())
                for _ in range(2)]
    standings: dict[str, list] = {}
    try:
        end = time.monotonic() + seconds - 2
        k = 0
        while time.monotonic() < end:
            ident, job = f"victim/{k}", f"victim-{k}"
            k += 1
            with procs.dealer(coordinator.address, timeout_s=15, routing_id=ident.encode()) as d:
                d.send(encode(wire.make("join", rid=1, job=job, identity=ident, token="", rank=None,
                                        min_ranks=1, max_ranks=1, last_call_s=0.0,
                                        heartbeat_timeout_s=60.0, endpoint="tcp://127.0.0.1:1",
                                        host="h", pid=1, info={})))
                assert decode(d.recv())["rid"] == 1
                got = standings.setdefault(job, [])
                for rid in range(2, 8):
                    time.sleep(0.03)
                    d.send(encode(wire.make("heartbeat", rid=rid, job=job, epoch=0, identity=ident)))
                    while (r := decode(d.recv()))["rid"] != rid:   # pushes (the epoch) come between
                        pass
                    got.append(r["body"].get("state"))
    finally:
        for f in flooders:
            f.wait(seconds + 10)
    assert len(standings) >= 10, standings
    lost = {job: s for job, s in standings.items() if set(s) != {"member"}}
    assert not lost, f"{len(lost)} of {len(standings)} live agents lost their place: {lost}"
    assert coordinator.proc.poll() is None


def _answer(d, rid: int) -> dict:
    """The answer to request ``rid`` (pushes, rid 0, may come between)."""
    while (r := decode(d.recv()))["rid"] != rid:
        pass
    return r


def _one_rank_job(d, ident: str, job: str) -> None:
    d.send(encode(wire.make("join", rid=1, job=job, identity=ident, token="", rank=None, min_ranks=1,
                            max_ranks=1, last_call_s=0.0, heartbeat_timeout_s=60.0,
                            endpoint="tcp://127.0.0.1:1", host="h", pid=1, info={})))
    _answer(d, 1)


def test_a_client_sending_thousands_of_requests_at_once_gets_every_answer(coordinator):
    # With a plain limit of 1000 queued replies per client, 1003 of 3000 were dropped silently (a
    # tester's find); the replies past ZeroMQ's queue now wait in the server's backlog.
    with procs.dealer(coordinator.address, timeout_s=30, routing_id=b"burst") as d:
        d.setsockopt(__import__("zmq").RCVHWM, 1)     # the answers wait on the daemon's side
        _one_rank_job(d, "burst", "burst")
        d.send(encode(wire.make("kv_set", rid=2, job="burst", key="k", value=b"v" * 10_000)))
        _answer(d, 2)
        n = 3000
        for rid in range(10, 10 + n):
            d.send(encode(wire.make("kv_get", rid=rid, job="burst", key="k")))
        got = set()
        while len(got) < n:
            r = decode(d.recv())
            if r["t"] == "reply":
                got.add(r["rid"])
        assert got == set(range(10, 10 + n))


@pytest.mark.timeout(90)
def test_a_client_that_never_reads_its_answers_holds_a_bounded_part_of_the_daemons_memory(coordinator):
    # A client asking for a large value again and again without reading held the daemon's memory
    # with every answer (a tester's find: 3 GB after 210 kv_gets of a 15 MiB value). Now ZeroMQ
    # queues 16 answers and the server's backlog 64 MiB; the rest are dropped, logged.
    import psutil

    from transport.channel import BACKLOG_MAX_NBYTES, SEND_PIPE_MESSAGES

    value = b"x" * (4 << 20)
    daemon = psutil.Process(coordinator.proc.pid)
    with procs.dealer(coordinator.address, timeout_s=30, routing_id=b"slow") as d:
        d.setsockopt(__import__("zmq").RCVHWM, 1)     # take in as little as ZeroMQ allows
        _one_rank_job(d, "slow", "slow")
        d.send(encode(wire.make("kv_set", rid=2, job="slow", key="big", value=value)))
        _answer(d, 2)
        before = daemon.memory_info().rss
        for rid in range(10, 210):                    # 800 MiB of answers, none read
            d.send(encode(wire.make("kv_get", rid=rid, job="slow", key="big")))
        procs.wait_until(lambda: "reply_dropped" in coordinator.log, 30, "answers dropped")
        grew = daemon.memory_info().rss - before
        bound = SEND_PIPE_MESSAGES * len(value) + BACKLOG_MAX_NBYTES + (64 << 20)   # + sockets
        assert grew < bound, (grew, bound)
        with procs.dealer(coordinator.address, timeout_s=10) as other:     # others are served
            other.send(encode(wire.make("status", rid=1)))
            assert decode(other.recv())["rid"] == 1
    assert coordinator.proc.poll() is None


@pytest.mark.timeout(150)
def test_clients_asking_for_status_without_reading_neither_stall_the_daemon_nor_fill_its_memory(coordinator):
    # A breaker's find: with 300 jobs (a status answer of 111 KB) one client sending 4,000 status
    # requests it never read stalled the daemon 24-35 s (longer than the ranks' 30 s coordinator
    # timeout) and took 0.9 GB; 16 such clients, 221 s and 6.6 GB. Each answer was computed and
    # encoded anew and held until the batch was sent. Now status is answered after each batch of
    # events, each distinct question once, the answer shared and encoded once; answers are
    # dropped unencoded when the client's backlog is full, and all backlogs together hold at
    # most BACKLOG_TOTAL_MAX_NBYTES.
    import psutil
    import zmq

    from transport.channel import BACKLOG_TOTAL_MAX_NBYTES, SEND_PIPE_MESSAGES

    daemon = psutil.Process(coordinator.proc.pid)
    ctx = zmq.Context()
    socks = []
    try:
        for i in range(300):            # jobs forming (2 ranks asked for, 1 came), long names
            ident = f"n{i}-" + "x" * 200
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTING_ID, ident.encode())
            s.connect(coordinator.address)
            s.send(encode(wire.make("join", rid=1, job=f"job{i}-" + "y" * 200, identity=ident, token="",
                                    rank=0, min_ranks=2, max_ranks=2, last_call_s=0.0, heartbeat_timeout_s=120.0,
                                    endpoint="tcp://127.0.0.1:9", host="h" * 128, pid=1,
                                    info={f"k{j}": "v" * 100 for j in range(60)})))
            socks.append(s)
        # every join read (on 300 connections, a status may come first: a CI run measured 38 KB)
        procs.wait_until(lambda: len(procs.coordinator_jobs(coordinator.address, timeout_s=30)) >= 300,
                         30, "the 300 jobs forming")
        with procs.dealer(coordinator.address, timeout_s=30) as d:
            d.send(encode(wire.make("status", rid=1)))
            size = len(_answer_raw(d))
            assert size > 50_000, size
            before = daemon.memory_info().rss
            floods = []
            for _ in range(6):
                f = ctx.socket(zmq.DEALER)
                f.setsockopt(zmq.LINGER, 0)
                f.setsockopt(zmq.RCVHWM, 1)
                f.setsockopt(zmq.SNDHWM, 0)
                f.connect(coordinator.address)
                floods.append(f)
            socks += floods
            req = encode(wire.make("status", rid=2))
            # a cheap request between each two (answered with an error: no job, no token), which
            # defeated an answer shared until the next event (a re-verifier's find)
            cheap = encode(wire.make("kv_get", rid=3, job="nope", key="k"))
            for _ in range(1000):
                for f in floods:
                    f.send(req)
                    f.send(cheap)
            t0 = time.monotonic()
            d.send(encode(wire.make("status", rid=3)))
            assert decode(_answer_raw(d, 3))["rid"] == 3
            took = time.monotonic() - t0
            procs.wait_until(lambda: "reply_dropped" in coordinator.log, 60, "answers dropped")
            # the whole flood handled: the daemon idle for a second
            cpu = [sum(daemon.cpu_times()[:2])]

            def idle() -> bool:
                time.sleep(1.0)
                cpu.append(sum(daemon.cpu_times()[:2]))
                return cpu[-1] - cpu[-2] < 0.1

            procs.wait_until(idle, 90, "the daemon idle after the flood")
            grew = daemon.memory_info().rss - before
            d.send(encode(wire.make("status", rid=4)))
            assert decode(_answer_raw(d, 4))["rid"] == 4
        bound = BACKLOG_TOTAL_MAX_NBYTES + 6 * SEND_PIPE_MESSAGES * size + (96 << 20)   # + sockets
        assert grew < bound, (grew >> 20, bound >> 20)     # before: 1.3 GB
        assert took < 15, took                             # before: 36 s
        stalls = [float(x) for x in re.findall(r"coordinator_stalled\s+seconds=([0-9.]+)", coordinator.log)]
        assert max(stalls, default=0) < 10, stalls
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    assert coordinator.proc.poll() is None


@pytest.mark.timeout(120)
def test_joins_from_connections_closed_at_once_leave_no_job_behind(coordinator):
    # A breaker's find: of 4,000 joins each sent on a connection closed 2 ms later, 115 left their
    # job forming for the joiner's whole heartbeat timeout (an hour here): the daemon read the
    # close before the join and could not tell whose it was. The answer to the join finding the
    # connection gone now counts as its disconnect.
    import zmq

    ctx = zmq.Context()
    try:
        for i in range(1500):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            ident = f"gone-{i}"
            s.setsockopt(zmq.ROUTING_ID, ident.encode())
            s.connect(coordinator.address)
            s.send(encode(wire.make("join", rid=1, job=f"gone-job-{i}", identity=ident, token="", rank=0,
                                    min_ranks=2, max_ranks=2, last_call_s=0.0, heartbeat_timeout_s=3600.0,
                                    endpoint="tcp://127.0.0.1:9", host="h", pid=1)))
            time.sleep(0.002)
            s.close(0)
    finally:
        ctx.term()

    def left() -> list:
        return [j["job"] for j in procs.coordinator_jobs(coordinator.address, timeout_s=10)]

    # (before: 35 of 1,500 stayed, in one run here). A few may still stay: a close the monitor
    # read before the join while the answer still found the connection (2 of 1,500 in one loaded
    # CI run, 2 of ~8,600 in a re-verifier's): bounded here, not yet closed
    with contextlib.suppress(AssertionError):
        procs.wait_until(lambda: not left(), 15, "every forming job dropped")
    assert len(left()) <= 10, left()


def _answer_raw(d, rid: int = 1) -> bytes:
    """The raw bytes of the answer to request ``rid``."""
    while True:
        raw = d.recv()
        if decode(raw)["rid"] == rid:
            return raw


def test_a_wait_sent_again_on_a_new_connection_under_the_same_id_is_answered(coordinator):
    # A client that closed and reconnected at once under the same routing id (as an agent does
    # after a drop) parked its wait again; the old connection's close, seen after it, dropped the
    # new wait: 6 to 11 of 60 got neither an answer nor a timeout (a tester's find).
    import zmq

    ctx = zmq.Context()        # one context: the close and the new connect race in its I/O thread

    def waiter(ident: bytes):
        w = ctx.socket(zmq.DEALER)
        w.setsockopt(zmq.LINGER, 0)
        w.setsockopt(zmq.RCVTIMEO, 10_000)
        w.setsockopt(zmq.ROUTING_ID, ident)
        w.connect(coordinator.address)
        return w

    kept = []
    try:
        with procs.dealer(coordinator.address, timeout_s=10, routing_id=b"setter") as s:
            _one_rank_job(s, "setter", "reuse")
            n = 60
            for i in range(n):
                ident = f"waiter/{i}".encode()
                w = waiter(ident)
                w.send(encode(wire.make("kv_wait", rid=1, job="reuse", keys=[f"k{i}"], timeout_s=30.0)))
                time.sleep(0.05)   # parked
                w.close()
                w = waiter(ident)
                w.send(encode(wire.make("kv_wait", rid=2, job="reuse", keys=[f"k{i}"], timeout_s=30.0)))
                kept.append(w)
            time.sleep(0.5)
            for i in range(n):
                s.send(encode(wire.make("kv_set", rid=3 + i, job="reuse", key=f"k{i}", value=b"1")))
                _answer(s, 3 + i)
            lost = []
            for i, w in enumerate(kept):
                try:
                    # (the first wait may be answered too, to the same id: its connection's close
                    # came after the new one's wait, so the id was never gone)
                    while (r := decode(w.recv()))["rid"] != 2:
                        assert r["rid"] == 1, (i, r)
                except zmq.Again:
                    lost.append(i)
                    continue
                assert r["body"]["values"] == {f"k{i}": b"1"}, (i, r)
            assert not lost, f"{len(lost)} of {n} waits sent again got no answer: {lost}"
    finally:
        for w in kept:
            w.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_the_daemon_raises_its_open_files_limit_so_idle_connections_do_not_keep_clients_out(tmp_path):
    # At a soft limit of 1024 open files (a common default), 1,100 idle client connections held
    # every descriptor: new ranks and `rtxnet status` got no answer and snapshots failed with
    # EMFILE (a tester's find). The daemon now takes its hard limit; 1,100 connections are then
    # held and a new client is still answered.
    import socket

    soft, hard = 1 << 10, 1 << 13      # open-files limits (the daemon's port is chosen at run time)
    c = procs.Coordinator(tmp_path / "journal", prefix=["prlimit", f"--nofile={soft}:{hard}"])
    held: list[socket.socket] = []
    try:
        limits = Path(f"/proc/{c.proc.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert line.split()[3:5] == [str(hard), str(hard)], line
        # and says so, with the figures (logged before its address: the log reader may lag)
        said = procs.wait_until(lambda: re.search(r"open_files_limit .*", c.log), 10, "open_files_limit")
        assert all(f in said[0] for f in (f"soft={hard}", f"soft_was={soft}", f"hard={hard}")), said[0]
        for _ in range(1100):
            held.append(socket.create_connection(("127.0.0.1", c.port), timeout=5))
        with procs.dealer(c.address, timeout_s=10, routing_id=b"after-the-flood") as d:
            d.send(encode(wire.make("status", rid=1)))
            assert decode(d.recv())["rid"] == 1
    finally:
        for s in held:
            s.close()
        c.stop()


@pytest.mark.timeout(60)
def test_at_its_open_files_limit_the_daemon_warns_and_closes_connections_that_never_greet(tmp_path):
    # With a hard limit it cannot raise (`ulimit -n 1024` sets both), ~1,100 connections that
    # never spoke held every descriptor for ZeroMQ's default handshake time, 30 s: a new client
    # got no answer, and the daemon logged nothing (a breaker's find). It now warns that the
    # limit is low and that it is near it, and closes such connections after HANDSHAKE_IVL_MS.
    import socket

    from transport.channel import HANDSHAKE_IVL_MS

    limit, silent = 128, 150       # more connections than descriptors: the daemon is at its limit
    c = procs.Coordinator(tmp_path / "journal", prefix=["prlimit", f"--nofile={limit}:{limit}"])
    held: list[socket.socket] = []
    try:
        procs.wait_until(lambda: "open_files_limit_low" in c.log, 10, "open_files_limit_low")
        for _ in range(silent):
            held.append(socket.create_connection(("127.0.0.1", c.port), timeout=5))
        said = procs.wait_until(lambda: re.search(r"open_files_near_limit .*", c.log), 5,
                                "open_files_near_limit")
        assert f"limit={limit}" in said[0], said[0]
        # answered once the silent ones are closed (and the rest waiting to be accepted), not
        # after ZeroMQ's default 30 s
        wait_s = HANDSHAKE_IVL_MS / 1000 + 5
        with procs.dealer(c.address, timeout_s=wait_s, routing_id=b"after-the-silence") as d:
            d.send(encode(wire.make("status", rid=1)))
            assert d.poll(wait_s * 1000), f"no answer within {wait_s:g} s"
            assert decode(d.recv())["rid"] == 1
    finally:
        for s in held:
            s.close()
        c.stop()
    assert c.proc.returncode == 0, c.log[-2000:]


def _flood_then_ask(coordinator, sockets: int, per_socket: int, blob: bytes) -> float:
    """Queue ``per_socket`` copies of ``blob`` on each of ``sockets`` connections (never reading
    an answer), then, once the daemon is busy with them, time a fresh client's status request;
    the floods are closed (their unsent part dropped) at the end."""
    import psutil
    import zmq

    address = coordinator.address
    daemon = psutil.Process(coordinator.proc.pid)
    cpu_before = sum(daemon.cpu_times()[:2])
    ctx = zmq.Context()
    floods = []
    try:
        for _ in range(sockets):
            f = ctx.socket(zmq.DEALER)
            f.setsockopt(zmq.LINGER, 0)
            f.setsockopt(zmq.SNDHWM, 0)           # all of it queued at once, on this side if need be
            f.setsockopt(zmq.RCVHWM, 1)
            f.connect(address)
            floods.append(f)
        for _ in range(per_socket):
            for f in floods:
                f.send(blob)
        procs.wait_until(lambda: sum(daemon.cpu_times()[:2]) - cpu_before > 0.2, 30,
                         "the daemon busy with the flood")
        with procs.dealer(address, timeout_s=60) as d:
            t0 = time.monotonic()
            d.send(encode(wire.make("status", rid=7)))
            assert decode(_answer_raw(d, 7))["rid"] == 7
            return time.monotonic() - t0
    finally:
        for f in floods:
            f.close(0)
        ctx.term()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["status", "garbage"])
def test_a_client_flooding_the_daemon_does_not_hold_up_the_others(coordinator, what):
    # A breaker's finds: 20 sockets sending status requests for 5 s (answers never read) left the
    # daemon answering nobody for 435 s and took 4.3 GB, and a real job beside it died of
    # unanswered heartbeats; 3 s of 3-byte garbage on one socket, 12.8 s. Every valid request
    # waited in one queue behind all that came before, and the reader never let the daemon run
    # while messages kept coming. Now each client's requests wait in a queue of their own (at
    # most MAX_WAITING_REQUESTS), the clients take turns, and the reader lets others run.
    import psutil

    daemon = psutil.Process(coordinator.proc.pid)
    before = daemon.memory_info().rss
    if what == "status":
        took = _flood_then_ask(coordinator, 10, 20_000, encode(wire.make("status", rid=1)))
    else:
        took = _flood_then_ask(coordinator, 1, 300_000, b"\xc1\xc1\xc1")
    grew = daemon.memory_info().rss - before
    # the fresh client's turn came at once: 10 ms here, where the whole flood came first before
    # (7.3 s for the status flood, 9.3 s for the garbage, on idle cores)
    assert took < 3, took
    assert grew < 512 << 20, grew >> 20
    assert coordinator.proc.poll() is None


async def test_members_take_their_turns_first_but_never_hold_the_others_off():
    # members of formed jobs go first (a flood over 6,000 connections made a job's heartbeats
    # wait past their timeout), yet a member sending without pause cannot starve the others (a
    # re-verifier's reading): every 8 turns of members, one of another client
    from transport.channel import ControlServer, Inbound

    srv = ControlServer("tcp://127.0.0.1:0")
    try:
        srv.prefer = lambda identity: identity.startswith("member")
        for i in range(20):
            srv._put(b"member", Inbound("member", {"i": i}))
        for i in range(3):
            srv._put(b"other", Inbound("other", {"i": i}))
        order = []
        while (item := srv.next_nowait()) is not None:
            order.append("M" if item.identity == "member" else "o")
        assert "".join(order) == "MMMMMMMMoMMMMMMMMoMMMMo"
    finally:
        await srv.aclose()
