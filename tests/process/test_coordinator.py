"""The real coordinator daemon with real agent processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import msgpack
import procs
import pytest
from procs import coordinator_jobs, wait_until

from transport import wire
from transport.codec import decode, encode

pytestmark = pytest.mark.timeout(90)

def wait_pending(address: str, job: str, n: int, timeout_s: float = 20.0) -> None:
    """Poll the coordinator's status until ``job`` has ``n`` pending joiners."""
    wait_until(lambda: any(j["job"] == job and j["pending"] >= n for j in coordinator_jobs(address)),
               timeout_s, f"job {job!r} with {n} pending joiner(s)")


ROOT = procs.ROOT
FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0, "op_s": 5.0, "rendezvous_s": 30.0}


def joined(probes, address: str, job: str, n: int, **cfg) -> list:
    """``n`` probes asking for ranks ``0..n-1`` of ``job`` (fast timeouts unless given), once all
    have joined."""
    cfg.setdefault("timeouts", FAST)
    cfg.setdefault("world_size", None if "min_ranks" in cfg else n)
    ps = [probes(address, job=job, rank=r, **cfg) for r in range(n)]
    for p in ps:
        p.expect("joined")
    return ps


def test_four_agents_rendezvous_share_kv_and_show_in_status(coordinator, probes):
    ps = [probes(coordinator.address, job="four", rank=r, world_size=4) for r in range(4)]
    joined = [p.expect("joined") for p in ps]
    assert sorted(j["rank"] for j in joined) == [0, 1, 2, 3]
    assert {j["epoch"] for j in joined} == {0} and {j["world_size"] for j in joined} == {4}
    assert ps[2].cmd("kv_set", key="hello", value="from-2")["ok"]
    for p in ps:
        assert p.cmd("kv_wait", keys=["hello"])["values"] == {"hello": "from-2"}
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "job four: running, epoch 0, world size 4" in out.stdout
    for p in ps:
        assert f"pid {p.pid}" in out.stdout


def test_a_rank_alone_says_who_is_missing_then_times_out_naming_the_bounds(coordinator, probes):
    p = probes(coordinator.address, job="alone", world_size=3,
               timeouts={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5, "op_s": 1.0,
                         "rendezvous_s": 4.0})
    wait_pending(coordinator.address, "alone", 1)
    # a rank started with another world size is refused, and the waiting one hears of it
    other = probes(coordinator.address, job="alone", world_size=4).expect("join_failed", timeout=10)
    assert other["error"] == "ConfigError", other
    failed = p.expect("join_failed", timeout=15)
    assert failed["error"] == "RendezvousTimeout", failed
    assert "did not form within 4 s (min_ranks=3, max_ranks=3" in failed["message"], failed
    # reported every second (a quarter of the timeout) while it waited, with the count
    assert "rendezvous_waiting" in p.log and "missing=2" in p.log and "joined=1" in p.log, p.log
    assert "asking for min_ranks(4) max_ranks(4) was refused" in p.log, p.log


def test_a_rank_that_asked_for_its_place_names_the_places_still_missing(coordinator, probes):
    # rtxnet-run gives every rank its launch rank: the waiting line then says which never came
    p = probes(coordinator.address, job="named", rank=1, world_size=3,
               timeouts={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5, "op_s": 1.0,
                         "rendezvous_s": 4.0})
    wait_pending(coordinator.address, "named", 1)
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                         capture_output=True, text=True, timeout=30)
    assert "job named: rendezvous" in out.stdout and "1 joined and waiting for the next epoch (missing ranks 0, 2)," in out.stdout, out
    failed = p.expect("join_failed", timeout=15)
    assert failed["error"] == "RendezvousTimeout", failed
    assert "rendezvous_waiting" in p.log and "missing_ranks=[0, 2]" in p.log, p.log
    assert failed["message"].endswith("; 1 rank joined, ranks 0, 2 never did"), failed


def test_duplicate_rank_claim_is_refused_at_once(coordinator, probes):
    a = probes(coordinator.address, job="dup", rank=0, world_size=2)
    wait_pending(coordinator.address, "dup", 1)
    b = probes(coordinator.address, job="dup", rank=0, world_size=2)
    failed = b.expect("join_failed", timeout=10)
    assert failed["error"] == "RendezvousError" and "rank 0" in failed["message"] and str(a.pid) in failed["message"]
    c = probes(coordinator.address, job="dup", rank=1, world_size=2)
    assert a.expect("joined")["world_size"] == 2 and c.expect("joined")["rank"] == 1
    d = probes(coordinator.address, job="dup", world_size=2)
    assert "full" in d.expect("join_failed", timeout=10)["message"]
    # a rank started with other bounds (RTXNET_WORLD_SIZE=3) is refused at once, naming both
    e = probes(coordinator.address, job="dup", world_size=3).expect("join_failed", timeout=10)
    assert e["error"] == "ConfigError" and "has min_ranks(2) max_ranks(2)" in e["message"], e
    assert "asks for min_ranks(3) max_ranks(3)" in e["message"], e


def test_two_jobs_one_ends_without_touching_the_other(coordinator, probes):
    a = [probes(coordinator.address, job="A", world_size=2) for _ in range(2)]
    b = [probes(coordinator.address, job="B", world_size=2) for _ in range(2)]
    for p in a + b:
        p.expect("joined")
    b[0].cmd("kv_set", key="k", value="b")
    a[0].cmd("kv_set", key="k", value="a")
    for p in a:
        assert p.cmd("leave")["ok"]
    jobs = b[1].cmd("status")["jobs"]
    assert [j["job"] for j in jobs] == ["B"]
    assert jobs[0]["epoch"] == 0 and jobs[0]["world_size"] == 2
    assert b[1].cmd("kv_get", key="k")["value"] == "b"
    for p in b:
        assert not [e for e in p.seen if e["event"] == "epoch"]


def test_killed_rank_is_reported_to_every_survivor(coordinator, probes):
    ps = joined(probes, coordinator.address, "k", 4)
    ps[2].signal(signal.SIGKILL)
    for p in (ps[0], ps[1], ps[3]):
        e = p.expect("epoch", timeout=10)
        assert e["lost"] == [2] and e["reason"] == "lost" and e["world_size"] == 3 and e["epoch"] == 1
    # status names the lost process by host and pid (rtxnet-run ends one still running after
    # the job: a frozen rank)
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                         capture_output=True, text=True, timeout=30)
    assert re.search(rf"  processes declared lost, not readmitted \(a replacement has a new pid\): pid {ps[2].pid} on \S+ \(exited\)$", out.stdout, re.M), out.stdout
    # a frozen one is still there: not marked
    ps[1].signal(signal.SIGSTOP)
    for p in (ps[0], ps[3]):
        assert p.expect("epoch", timeout=10)["lost"] == [1]
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                         capture_output=True, text=True, timeout=30)
    ps[1].signal(signal.SIGKILL)
    assert re.search(rf"pid {ps[1].pid} on \S+(,|$)", out.stdout, re.M), out.stdout
    assert re.search(rf"pid {ps[2].pid} on \S+ \(exited\)", out.stdout), out.stdout


def test_collectives_run_in_a_smaller_world_only_down_to_min_ranks(coordinator, probes):
    ps = joined(probes, coordinator.address, "m", 3, min_ranks=2, max_ranks=3, last_call_s=30)
    ps[2].signal(signal.SIGKILL)
    for p in ps[:2]:
        assert p.expect("epoch", timeout=10)["world_size"] == 2
        p.submit("all_reduce", value=p is ps[1] and 2 or 1)
    for p in ps[:2]:   # 2 ranks >= min_ranks(2): the job allows this world
        r = p.expect("result", cmd="all_reduce")
        assert r["ok"] and r["sum"] == 3.0 and r["epoch"] == 1, r
    ps[1].signal(signal.SIGKILL)
    assert ps[0].expect("epoch", timeout=10)["world_size"] == 1
    r = ps[0].cmd("all_reduce", value=1)   # below min_ranks: refused, not a "sum" of one rank
    assert not r["ok"] and r["error"] == "PeerLostError", r
    assert "the world of epoch 2 has 1 rank(s), fewer than min_ranks(2) (ranks [1]" in r["message"], r


def test_a_heartbeat_answer_read_after_the_rejoin_epoch_does_not_fence_the_rank_again(coordinator, probes):
    # The coordinator, held by SIGSTOP, answers a heartbeat the fenced rank sent before its join
    # ("fenced") and then the join (a new epoch push); the rank, held too, reads all of it at
    # once: the epoch is applied before the heartbeat's coroutine sees its old answer, which
    # must not fence the rank again (it did: the readmitted rank lost its new epoch).
    ps = joined(probes, coordinator.address, "stale", 2)
    ps[1].signal(signal.SIGSTOP)
    try:
        assert ps[0].expect("epoch", timeout=10)["lost"] == [1]
    finally:
        ps[1].signal(signal.SIGCONT)
    ps[1].expect("fenced", timeout=10)
    coordinator.signal(signal.SIGSTOP)
    try:
        time.sleep(0.3)               # a heartbeat (interval 0.1 s) waits in the coordinator's socket
        ps[1].submit("rejoin")        # and the join after it
        time.sleep(0.3)
        ps[1].signal(signal.SIGSTOP)  # the answers to both and the epoch push reach the rank
        coordinator.signal(signal.SIGCONT)   # together, so it reads them in one go
        time.sleep(0.3)
    finally:
        coordinator.signal(signal.SIGCONT)
        ps[1].signal(signal.SIGCONT)
    r = ps[1].expect("result", cmd="rejoin", timeout=10)
    assert r["ok"] and r["epoch"] == 2, r
    time.sleep(0.5)                   # five more heartbeats
    assert not any(e.get("event") == "fenced" for e in ps[1].seen), (ps[1].seen, ps[1].log)
    assert ps[0].expect("epoch", timeout=10)["added"] == [1]
    for p, v in zip(ps, (1, 2), strict=True):
        p.submit("all_reduce", value=v)
    for p in ps:
        r = p.expect("result", cmd="all_reduce")
        assert r["ok"] and r["sum"] == 3.0 and r["epoch"] == 2, (r, p.log)


def test_a_rank_muted_for_good_is_refused_when_it_would_rejoin(coordinator, probes):
    # (drop-heartbeats without seconds=): rejoining would only be fenced again, over and over
    ps = joined(probes, coordinator.address, "mute", 2)
    assert ps[1].cmd("mute", seconds=None)["ok"]
    assert ps[0].expect("epoch", timeout=10)["lost"] == [1]
    ps[1].expect("fenced", timeout=10)   # (under load it learned so after rank 0: ConfigError)
    r = ps[1].cmd("rejoin")
    assert not r["ok"] and r["error"] == "RendezvousError", r
    assert "heartbeats are stopped for good by fault injection" in r["message"], r


def test_frozen_rank_is_declared_lost_then_fenced_when_it_wakes(coordinator, probes):
    ps = joined(probes, coordinator.address, "s", 3)
    ps[1].signal(signal.SIGSTOP)
    try:
        e = ps[0].expect("epoch", timeout=10)
        assert e["lost"] == [1] and e["reason"] == "lost"
    finally:
        ps[1].signal(signal.SIGCONT)
    ps[1].expect("fenced", timeout=10)
    r = ps[1].cmd("all_reduce", value=1)    # its collectives say what to do
    assert r["error"] == "PeerLostError" and "call pg.rejoin() before any other collective" in r["message"], r
    assert "fenced out of epoch 0 (declared lost" in r["message"], r   # why, from the fence
    # It may join again: a new epoch adds it back.
    r = ps[1].cmd("rejoin")
    assert r["ok"] and r["epoch"] == 2
    assert ps[0].expect("epoch", timeout=10)["added"] == [2]
    r = ps[1].cmd("rejoin")
    assert r["error"] == "ConfigError" and "this rank was not declared lost (it is rank 2 of epoch 2)" in r["message"], r


def test_coordinator_sigkill_and_restart_resumes_the_job(coordinator, probes):
    ps = joined(probes, coordinator.address, "r", 3)
    ps[0].cmd("kv_set", key="before", value="crash")
    coordinator.kill(signal.SIGKILL)
    coordinator.start()  # same port, same journal
    wait_until(lambda: "journal_replayed" in coordinator.log, 10, "the journal replayed")
    # Agents reconnect by themselves; state came back from the journal.
    for p in ps:
        assert p.cmd("kv_get", key="before", timeout=20)["value"] == "crash"
    assert ps[1].cmd("kv_set", key="after", value="restart")["ok"]
    jobs = ps[2].cmd("status")["jobs"]
    assert jobs[0]["epoch"] == 0 and jobs[0]["world_size"] == 3
    assert sorted(m["pid"] for m in jobs[0]["members"]) == sorted(p.pid for p in ps)
    # Heartbeats keep them members past the heartbeat timeout: no new rendezvous, no new epoch.
    time.sleep(FAST["heartbeat_timeout_s"] * 2)
    for p in ps:
        assert not [e for e in p.seen if e["event"] in ("epoch", "fenced")]
    assert ps[0].cmd("status")["jobs"][0]["epoch"] == 0


def test_a_rank_started_afresh_after_a_restart_takes_the_place_of_one_killed_unseen(coordinator, probes):
    # a tester's find: rank 1 (a node's launcher and its ranks) SIGKILLed while the coordinator
    # was down; the restarted coordinator replays it as a member until its heartbeats are
    # missed, and a fresh rank started at once (not a replacement: a new launch) was refused
    # with JobFullError "another launch may use this job id", for good
    ps = joined(probes, coordinator.address, "unseen", 2)
    coordinator.kill(signal.SIGKILL)
    ps[1].signal(signal.SIGKILL)
    ps[1].proc.wait(10)
    # the fresh rank is started and asking before the daemon is back: started after the replay,
    # on two loaded cores it came later than the replayed member's 1 s heartbeat timeout (CI
    # log: it joined at once, never refused), and the case went untried
    fresh = probes(coordinator.address, job="unseen", world_size=2, timeouts=FAST)
    fresh.expect("joining", timeout=30)
    coordinator.start()  # same port, same journal
    wait_until(lambda: "journal_replayed" in coordinator.log, 10, "the journal replayed")
    got = fresh.expect("joined", timeout=15)
    assert got["world_size"] == 2 and got["epoch"] >= 1, got
    # its stderr is read by another thread than its events
    wait_until(lambda: "join_retry_job_full" in fresh.log, 5, "join_retry_job_full in the fresh rank's log")


def test_a_frozen_coordinator_does_not_blame_the_ranks_for_its_own_silence(coordinator, tmp_path):
    """A 3-rank job commits steps; the daemon is SIGSTOPped for 4 s (past the 1 s heartbeat
    timeout) and woken. The ranks' heartbeats of that time are still unread when it wakes: it
    must not declare them lost (it did, fencing the whole job into a new rendezvous)."""
    job = "frozen-coordinator"
    env = procs.env(RTXNET_HEARTBEAT_INTERVAL="0.1", RTXNET_HEARTBEAT_TIMEOUT="1.0")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", "3", "--coordinator", coordinator.address,
         "--job", job, "tools/ft_workload.py", "--steps", "40", "--step-sleep", "0.05",
         "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def status():
        return next((j for j in coordinator_jobs(coordinator.address) if j["job"] == job), None)

    try:
        wait_until(lambda: (j := status()) and j["committed_step"] >= 5, 60, "5 committed steps")
        coordinator.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(4.0)
        finally:
            coordinator.proc.send_signal(signal.SIGCONT)
        _, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err[-3000:]
    assert "fenced" not in err and "recovered" not in err, err[-3000:]
    # the only epochs after 0 are the ranks leaving at the end
    opened = [line for line in coordinator.log.splitlines() if "epoch_opened" in line and job in line]
    assert [int(x.split("world_size=")[1].split()[0]) for x in opened] == [3, 2, 1, 0], opened
    assert "coordinator_stalled" in coordinator.log


def test_a_request_in_flight_when_the_coordinator_dies_is_answered_by_its_restart(coordinator, probes):
    """Rank 0 waits on a key; the daemon is SIGKILLed (its kv_wait dies with it) and restarted;
    rank 1 sets the key. The request goes again over the new connection and is answered at once,
    not after its own deadline (30 s here)."""
    ps = joined(probes, coordinator.address, "inflight", 2)
    ps[0].submit("kv_wait", keys=["late"], timeout=30)
    time.sleep(0.5)                          # the wait is parked in the daemon
    coordinator.kill(signal.SIGKILL)
    coordinator.start()
    t0 = time.monotonic()
    assert ps[1].cmd("kv_set", key="late", value="here", timeout=20)["ok"]
    res = ps[0].expect("result", cmd="kv_wait", timeout=20)
    assert res["ok"] and res["values"] == {"late": "here"}, res
    assert time.monotonic() - t0 < 10


def test_a_process_rejoining_a_crashed_job_waits_for_min_ranks(coordinator, probes):
    """Both ranks of a 2-rank job crash; one process comes back: init(world_size=2) must not
    return a world of 1 (it did, and its all_reduce silently summed only itself). It returns
    when the second is back, both in a world of 2."""
    first = [probes(coordinator.address, job="crashed", rank=r, world_size=2, timeouts=FAST) for r in range(2)]
    for p in first:
        p.expect("joined")
    for p in first:
        p.signal(signal.SIGKILL)
    wait_until(lambda: (j := coordinator_jobs(coordinator.address)) and j[0]["world_size"] == 0, 20,
               "both ranks lost")
    a = probes(coordinator.address, job="crashed", rank=1, world_size=2, timeouts=FAST)
    wait_until(lambda: coordinator_jobs(coordinator.address)[0]["world_size"] == 1, 20, "the first back admitted")
    with pytest.raises(AssertionError, match="no joined"):
        a.expect("joined", timeout=1.0)       # still waiting for a second rank
    b = probes(coordinator.address, job="crashed", rank=0, world_size=2, timeouts=FAST)
    ja, jb = a.expect("joined", timeout=20), b.expect("joined", timeout=20)
    assert ja["world_size"] == jb["world_size"] == 2 and {ja["rank"], jb["rank"]} == {0, 1}


def test_a_joiner_still_pending_when_the_job_finishes_gets_job_finished_at_once(coordinator, probes):
    """A rank (e.g. one fenced by a partition) rejoins a job whose members commit steps: it waits
    for the next step decision, but the members end and leave instead. Its join must fail with
    JobFinishedError at its next heartbeat; it used to send the refused join again every
    heartbeat until its rendezvous timeout (forever under FaultTolerance)."""
    # the joiner stays deferred for at least the heartbeat timeout: 12 s, so that a loaded
    # machine still sees it pending, and the members leave while it is (with 4 s, a fresh
    # user's suite run on a machine loaded by other work saw it admitted first)
    # min_ranks 1: the first member leaving leaves the job at its minimum, so the joiner stays
    # deferred (below it, the next tick admitted the joiner before the second leave came, when a
    # loaded machine let one fall between the two)
    cfg = dict(min_ranks=1, max_ranks=3, timeouts={**FAST, "heartbeat_timeout_s": 12.0, "op_s": 20.0,
                                                   "rendezvous_s": 60.0})
    a, b = joined(probes, coordinator.address, "fin", 2, **cfg)
    for p in (a, b):
        p.submit("commit", step=0)
    for p in (a, b):
        assert p.expect("result", cmd="commit")["committed"] is True
    c = probes(coordinator.address, job="fin", **cfg)
    wait_pending(coordinator.address, "fin", 1)           # deferred to the next step decision
    for p in (a, b):
        p.submit("leave")
    for p in (a, b):
        assert p.expect("result", cmd="leave")["ok"]
    t0 = time.monotonic()
    e = c.expect("join_failed", timeout=15)
    assert e["error"] == "JobFinishedError" and "has finished" in e["message"], e
    assert time.monotonic() - t0 < 10


def test_pending_joiner_survives_coordinator_restart(coordinator, probes):
    a = probes(coordinator.address, job="p", world_size=2, timeouts=FAST)
    wait_pending(coordinator.address, "p", 1)
    coordinator.kill(signal.SIGKILL)
    coordinator.start()
    b = probes(coordinator.address, job="p", world_size=2, timeouts=FAST)
    assert a.expect("joined", timeout=15)["world_size"] == 2
    assert b.expect("joined", timeout=15)["world_size"] == 2


def test_garbage_and_oversize_messages_do_not_hurt_other_clients(coordinator, probes):
    ps = [probes(coordinator.address, job="g", world_size=2) for _ in range(2)]
    for p in ps:
        p.expect("joined")
    # Raw garbage on the TCP port (not even ZMTP).
    for payload in (b"\x00" * 64, os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as s:
            s.sendall(payload)
    with procs.dealer(coordinator.address) as d:

        def ask(frames):
            d.send_multipart(frames)
            return decode(d.recv())

        # Not msgpack at all: no request id to answer, dropped; then a good request still works.
        d.send(b"\xc1\xc1\xc1")
        r = ask([encode(wire.make("status", rid=7))])
        assert r["t"] == "reply" and r["rid"] == 7
        # Wrong version, unknown type, missing fields, an int beyond 64 bits in raw msgpack.
        r = ask([encode({**wire.make("status", rid=8), "v": 99})])
        assert r["t"] == "error" and r["error"] == "ProtocolError" and "version 99" in r["message"]
        r = ask([encode(wire.make("launch_missiles", rid=9))])
        assert r["error"] == "ProtocolError" and "launch_missiles" in r["message"]
        r = ask([encode(wire.make("kv_set", rid=10, job="g"))])
        assert r["error"] == "ProtocolError" and "kv_set.key" in r["message"]
        r = ask([encode(wire.make("epoch", rid=11))])
        assert r["error"] == "ProtocolError"
        # Oversize: 20 MiB of bin, above the 17 MiB message limit.
        big = msgpack.packb(wire.make("kv_set", rid=12, job="g", key="big", value=b"x" * (20 * 2**20)), use_bin_type=True)
        r = ask([big])
        assert r["t"] == "error" and r["rid"] == 12 and "exceeds the limit" in r["message"]
        r = ask([encode(wire.make("status", rid=13)), b"extra"])
        assert r["error"] == "ProtocolError" and "frame" in r["message"]
        # An integer above 64 bits cannot even be msgpack; a uint64 max in a rank field is refused by type rules.
        r = ask([encode(wire.make("kv_get", rid=14, job="g", key=2**64 - 1))])
        assert r["error"] == "ProtocolError" and "kv_get.key" in r["message"]
    assert coordinator.proc.poll() is None
    assert ps[0].cmd("kv_set", key="still", value="alive")["ok"]
    assert ps[1].cmd("kv_get", key="still")["value"] == "alive"


def test_corrupt_journal_stops_the_daemon_naming_file_and_offset(tmp_path, probes):
    from procs import Coordinator

    c = Coordinator(tmp_path / "j")
    ps = [probes(c.address, job="c", world_size=1) for _ in range(1)]
    ps[0].expect("joined")
    for i in range(5):
        ps[0].cmd("kv_set", key=f"k{i}", value="x" * 50)
    ps[0].close()
    c.stop()
    seg = sorted((tmp_path / "j").glob("journal-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[40] ^= 0xFF  # inside an early record, with records after it
    seg.write_bytes(bytes(data))
    out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--journal", str(tmp_path / "j")],
                         capture_output=True, text=True, timeout=30, cwd=c.journal.parent)
    assert out.returncode == 3
    assert str(seg) in out.stderr and "offset" in out.stderr


@pytest.mark.parametrize("record", [
    {"k": "future_kind", "job": "c"},          # a newer version's record
    {"k": "commit", "job": "c"},               # a field missing
    {"k": "commit", "job": "never-made", "step": 3},
    ["not", "a", "map"],
], ids=["unknown-kind", "field-missing", "unknown-job", "not-a-map"])
def test_a_journal_record_that_does_not_apply_stops_the_daemon_naming_it(tmp_path, probes, record):
    # a tester's find: records that pass their CRC and decode but do not fit (another version's,
    # another journal's) crashed the replay with a KeyError/TypeError traceback and exit 1
    from procs import Coordinator

    from coordinator.journal import encode_frame

    c = Coordinator(tmp_path / "j")
    p = probes(c.address, job="c", world_size=1)
    p.expect("joined")
    p.close()
    c.stop()
    seg = sorted((tmp_path / "j").glob("journal-*.log"))[-1]
    with open(seg, "ab") as f:
        f.write(encode_frame(msgpack.packb(record)))
    out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0",
                          "--journal", str(tmp_path / "j")],
                         capture_output=True, text=True, timeout=30, cwd=c.journal.parent)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert str(tmp_path / "j") in out.stderr and "does not apply" in out.stderr, out.stderr[-2000:]


def test_bound_to_every_interface_it_prints_an_address_others_can_connect_to(tmp_path):
    c = procs.Coordinator(tmp_path / "journal", host="0.0.0.0")
    try:
        assert "0.0.0.0" not in c.address, c.address
        assert coordinator_jobs(c.address) == []       # answers there
    finally:
        c.stop()


def test_a_job_token_guards_every_request_not_only_the_join(coordinator, probes):
    p = probes(coordinator.address, job="tok", world_size=1, token="s3cret")
    p.expect("joined")
    assert p.cmd("kv_set", key="k", value="mine")["ok"]      # the agent sends its token each time
    with procs.dealer(coordinator.address) as d:
        for rid, mtype, fields in ((1, "kv_set", {"key": "k", "value": b"theirs"}), (2, "kv_get", {"key": "k"})):
            d.send(encode(wire.make(mtype, rid=rid, job="tok", epoch=0, **fields)))
            r = decode(d.recv())
            assert r["t"] == "error" and r["message"] == f"{mtype}: wrong token for job 'tok'", r
    assert p.cmd("kv_get", key="k")["value"] == "mine"


def test_a_timeout_that_is_not_a_deadline_gets_an_error_answer_naming_it(coordinator, probes):
    """kv_wait and commit with a NaN, infinite or negative ``timeout_s`` would park a waiter that is
    never answered: each gets a ConfigError naming the field and value, and the daemon serves on."""
    p = probes(coordinator.address, job="t", world_size=1)
    member = p.expect("joined")
    with procs.dealer(coordinator.address) as d:
        rid = 0
        for value in (float("nan"), float("inf"), float("-inf"), -2.5):
            for mtype, fields in (("kv_wait", {"keys": ["never"]}),
                                  ("commit", {"identity": "someone", "step": 1, "ok": True})):
                rid += 1
                d.send(encode(wire.make(mtype, rid=rid, job="t", epoch=member["epoch"], timeout_s=value, **fields)))
                r = decode(d.recv())
                assert r["t"] == "error" and r["rid"] == rid and r["error"] == "ConfigError", r
                assert r["message"] == f"{mtype}.timeout_s({value!r}) must be a finite number of seconds >= 0"
        d.send(encode(wire.make("status", rid=99)))
        r = decode(d.recv())
        assert r["t"] == "reply" and r["rid"] == 99 and r["body"]["jobs"][0]["job"] == "t"
    # the store's own wait refuses them first, naming the value (it said "cannot convert float NaN
    # to integer", or "can only concatenate str", or waited 1 s for True)
    for value in (float("nan"), "1", True, 0, -1):
        p.submit("kv_wait", keys=["never"], timeout=value)
        r = p.expect("result", cmd="kv_wait")
        assert r["error"] == "ConfigError" and r["message"] == (
            f"store.wait: timeout must be a finite number of seconds > 0, got {value!r}"), r
    assert coordinator.proc.poll() is None
    assert p.cmd("kv_set", key="still", value="serving")["ok"]
    assert p.cmd("kv_wait", keys=["still"])["values"] == {"still": "serving"}


@pytest.mark.parametrize("args, text", [
    (["--log-level", "BOGUS"], "argument --log-level: 'BOGUS' is not one of debug, info, warning, error"),
    (["--tick", "nan"], "argument --tick: 'nan' is not a number of seconds in 0.001..1"),
    (["--tick", "inf"], "argument --tick: 'inf' is not a number of seconds in 0.001..1"),
    (["--tick", "1e-9"], "argument --tick: '1e-9' is not a number of seconds in 0.001..1"),
    (["--tick", "0"], "argument --tick: '0' is not a number of seconds in 0.001..1"),
    (["--snapshot-every", "0"], "argument --snapshot-every: '0' must be >= 1"),
    (["--snapshot-every", "-1"], "argument --snapshot-every: '-1' must be >= 1"),
    (["--dead-job-ttl", "nan"], "argument --dead-job-ttl: 'nan' is not a finite, positive number of seconds"),
    (["--dead-job-ttl", "-5"], "argument --dead-job-ttl: '-5' is not a finite, positive number of seconds"),
    (["--bind", "tcp://127.0.0.1:70000"], "argument --bind: 'tcp://127.0.0.1:70000': port '70000' is not in 0..65535"),
    (["--journal", ""], "argument --journal: '' is not a folder name (empty)"),
    # was exit 4 with ZeroMQ's "No such device", after the journal was made (a fresh user's find)
    (["--bind", "tcp://nosuchhost.invalid:0"], "argument --bind: cannot bind 'tcp://nosuchhost.invalid:0': "
     "host 'nosuchhost.invalid' is neither an IP address, '*', an interface of this machine nor a name that resolves"),
    (["--journal-owner", "1"], "argument --journal-owner: only applies with --remove-journal-on-stop"),
])
def test_daemon_arguments_are_argparse_errors_naming_the_value(tmp_path, args, text):
    argv = ["--bind", "tcp://127.0.0.1:0", "--journal", str(tmp_path / "j"), *args]
    out = subprocess.run([sys.executable, "-m", "coordinator", *argv], capture_output=True, text=True,
                         timeout=30, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("usage: rtxnet-coordinator")
    assert out.stderr.strip().splitlines()[-1] == f"rtxnet-coordinator: error: {text}"
    assert "Traceback" not in out.stderr and not out.stdout and not (tmp_path / "j").exists()


def test_daemon_names_a_bad_log_level_from_the_environment(tmp_path):
    from procs import env

    out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--journal",
                          str(tmp_path / "j")], capture_output=True, text=True, timeout=30, cwd=tmp_path,
                         env=env(RTXNET_LOG_LEVEL="loud"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("rtxnet-coordinator: error: RTXNET_LOG_LEVEL='loud'")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e308"])
def test_status_timeout_must_be_finite_and_positive(value):
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", "tcp://127.0.0.1:1",
                          f"--timeout={value}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"rtxnet status: error: argument --timeout: {value!r} is not a number of seconds in (0, 3600]")


def _tcp_established(pid: int) -> set:
    """The (local, remote) addresses of ``pid``'s established TCP connections."""
    import psutil

    return {(c.laddr, c.raddr) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED}


def _has_result(p, cmd: str) -> bool:
    """Whether probe ``p`` has already printed the result of ``cmd`` (it is kept for expect)."""
    try:
        p.seen.append(p.expect("result", timeout=0.01, cmd=cmd))
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_rank_killed_mid_ring_over_bulk_streams_is_a_peer_lost_error_naming_it(coordinator, probes, op):
    # the ring's TCP streams break at once (reset, broken pipe); the survivors wait for the
    # coordinator's verdict and raise the PeerLostError naming the rank, as the direct form does,
    # not a CollectiveError saying a stream broke
    # a heartbeat timeout of 6 s, not 2: four ranks filling 128 MiB each on 2 busy cores were
    # declared lost (fenced) before their streams opened, under a loaded test run
    ps = joined(probes, coordinator.address, f"ring-{op}", 4,
                timeouts={"heartbeat_interval_s": 0.3, "heartbeat_timeout_s": 6.0, "op_s": 30.0,
                          "rendezvous_s": 60.0})
    numel = 32 * 2**20   # 128 MiB per rank
    before = _tcp_established(ps[2].pid)
    survivors = (ps[0], ps[1], ps[3])
    for _ in range(4):
        for p in ps:
            p.submit("big", op=op, numel=numel, algorithm="ring", timeout=30)
        ps[2].expect("started")
        # frozen mid-ring (both its bulk streams open, data flowing): the others cannot finish.
        # Two connections that were not there before, not a count: one that closed meanwhile
        # (a fresh user's loaded run waited 40 s for a count). Rank 2's result ends the wait too:
        # an operation that failed shows its error below, not a timeout here.
        wait_until(lambda: len(_tcp_established(ps[2].pid) - before) >= 2 or _has_result(ps[2], "big"),
                   40, "rank 2's bulk streams")
        if ps[2].seen and ps[2].seen[-1].get("cmd") == "big" and not ps[2].seen[-1]["ok"]:
            pytest.fail(f"rank 2's {op} failed before it could be frozen: {ps[2].seen[-1]}")
        ps[2].signal(signal.SIGSTOP)
        time.sleep(0.3)
        if not any(_has_result(p, "big") for p in survivors):
            break
        # on a fast host rank 2 had sent its last chunk before the freeze (the CI's reduce_scatter
        # once finished everywhere): let it finish, and freeze the next operation earlier
        ps[2].signal(signal.SIGCONT)
        for p in ps:
            assert p.expect("result", cmd="big", timeout=30)["ok"]
    else:
        pytest.fail(f"four {op}s of 128 MiB finished before rank 2 could be frozen mid-ring")
    # a coordinator slower to decide than the streams are to break (far away, busy): here
    # frozen while rank 2 dies, so the streams break well before the new epoch comes
    os.kill(coordinator.proc.pid, signal.SIGSTOP)
    try:
        ps[2].signal(signal.SIGKILL)   # its streams are reset (unread data) or closed
        t0 = time.monotonic()
        time.sleep(0.8)
    finally:
        os.kill(coordinator.proc.pid, signal.SIGCONT)
    for p in survivors:
        r = p.expect("result", cmd="big", timeout=30)
        assert not r["ok"] and r["error"] == "PeerLostError" and r["ranks"] == [2], (r, p.log[-3000:])
        assert r["t"] - t0 < 10, r


def _join_msg(rid: int, ident: str, job: str, **over) -> dict:
    msg = wire.make("join", rid=rid, job=job, identity=ident, token="", rank=None, min_ranks=1,
                    max_ranks=1, last_call_s=0.0, heartbeat_timeout_s=5.0,
                    endpoint="tcp://127.0.0.1:1", host="h", pid=1, info={})
    msg.update(over)
    return msg


def test_hostile_joins_and_store_floods_are_refused_and_the_journal_stays_replayable(coordinator, probes):
    """What one client without any token could do to the daemon (a fresh user's trial): a join
    whose info nests 1021 or 1022 maps deep (msgpack decodes it, but the epoch record would nest
    past what can be encoded or decoded again: the daemon died, or wrote a journal no restart could
    replay), a 1 MiB host name (in every epoch push and status answer), a store filled past what a
    snapshot holds. Each gets an error naming the value; the daemon serves on and replays."""
    with procs.dealer(coordinator.address, routing_id=b"hostile") as d:
        for rid, depth in ((1, 1021), (2, 1022), (3, 33)):
            packed = encode(_join_msg(rid, "hostile", f"deep{depth}", info={"x": "PLACEHOLDER"}))
            nested = b"\x81\xa1a" * depth + b"\x80"
            d.send(packed.replace(b"\xabPLACEHOLDER", nested))
            r = decode(d.recv())
            assert r["t"] == "error" and r["rid"] == rid and r["error"] == "ProtocolError", r
            assert "nested deeper than 32 levels" in r["message"], r
        d.send(encode(_join_msg(4, "hostile", "bighost", host="h" * 2**20)))
        r = decode(d.recv())
        assert r["error"] == "ConfigError" and r["message"] == (
            f"join.host {'h' * 40!r}... is 1048576 bytes of UTF-8; it must be 1 to 128"), r
        # what a user speaking the raw protocol found accepted: an empty endpoint or host, port 0,
        # a 100,000-character token
        for rid, over, text in (
                (5, {"endpoint": ""}, "endpoint '' is not tcp://HOST:PORT[?bulk=PORT]"),
                (6, {"endpoint": "tcp://127.0.0.1:0"}, "endpoint 'tcp://127.0.0.1:0': port 0 is not in 1..65535"),
                (7, {"host": ""}, "join.host '' is 0 bytes of UTF-8; it must be 1 to 128"),
                (8, {"token": "t" * 100_000},
                 "join.token is 100000 characters, more than the 256 a job token may have")):
            d.send(encode(_join_msg(rid, "hostile", "badjoin", **over)))
            r = decode(d.recv())
            assert (r["rid"], r["error"], r["message"]) == (rid, "ConfigError", text), r
    p = probes(coordinator.address, job="flood", world_size=1)
    p.expect("joined")
    # status tells no identities: an identity is its agent's routing id, enough to take over its
    # connection (ROUTER_HANDOVER)
    jobs = coordinator_jobs(coordinator.address)
    assert [j["members"][0].get("identity") for j in jobs if j["job"] == "flood"] == [None], jobs
    value = "x" * (6 * 2**20)
    assert p.cmd("kv_set", key="a", value=value)["ok"] and p.cmd("kv_set", key="b", value=value)["ok"]
    r = p.cmd("kv_set", key="c", value=value)
    assert r["error"] == "ConfigError" and "store of job 'flood': key 'c' would bring it to 18874371 bytes, " \
        "more than the 16777216 a job's store may hold" in r["message"], r
    assert p.cmd("kv_set", key="a", value="small")["ok"]    # a smaller value still goes in
    assert coordinator.proc.poll() is None
    coordinator.kill(signal.SIGKILL)
    coordinator.start()                                      # the same journal replays
    assert {j["job"]: j["kv_keys"] for j in coordinator_jobs(coordinator.address)} == {"flood": 2}


def test_a_journal_that_cannot_be_written_stops_the_daemon_with_exit_code_3(tmp_path, probes):
    """A write that fails while running (here a file-size limit, as a full disk would): the daemon
    says so and exits 3, as for any unusable journal, instead of a traceback and exit 1; what it
    acknowledged replays on restart."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, 512 * 1024))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # a write past it fails with EFBIG

    journal = tmp_path / "j"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--journal",
                             str(journal)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=procs.env(), cwd=procs.ROOT, preexec_fn=small_files)
    try:
        address = proc.stdout.readline().strip().split("=", 1)[1]
        # the write that fails is never answered: its kv_set fails at the request deadline
        p = probes(address, job="full", world_size=1, timeouts={**FAST, "rendezvous_s": 30.0, "request_s": 2.0})
        p.expect("joined")
        acked = 0
        for i in range(20):
            r = p.cmd("kv_set", key=f"k{i}", value="x" * 100_000, timeout=30)
            if not r["ok"]:
                break
            acked += 1
        assert 1 <= acked < 10, acked
        assert proc.wait(20) == 3
        err = proc.stderr.read()
        assert "journal_failed" in err and "restart with the same --journal" in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    c = procs.Coordinator(journal)
    try:
        assert [j["kv_keys"] for j in coordinator_jobs(c.address) if j["job"] == "full"] == [acked]
    finally:
        c.stop()


def test_sighup_stops_the_daemon_cleanly_and_removes_a_temporary_journal(tmp_path):
    # (the kernel sends it to an orphaned process group with a stopped member: the launcher
    # SIGKILLed while one of its ranks was SIGSTOPped left the journal folder behind)
    c = procs.Coordinator(tmp_path / "tmpj", extra=["--remove-journal-on-stop"])
    assert (tmp_path / "tmpj").is_dir()
    os.kill(c.proc.pid, signal.SIGHUP)
    assert c.proc.wait(10) == 0
    assert not (tmp_path / "tmpj").exists()


def test_removing_the_journal_on_stop_leaves_what_is_not_the_journals(tmp_path):
    # a fresh user's trial: --remove-journal-on-stop on a folder of their own deleted it whole,
    # their files and a subfolder with it
    folder = tmp_path / "mydata"
    (folder / "sub").mkdir(parents=True)
    (folder / "thesis.txt").write_text("precious")
    c = procs.Coordinator(folder, extra=["--remove-journal-on-stop"])
    assert any(p.name.startswith("journal-") for p in folder.iterdir())
    c.kill(signal.SIGTERM)
    assert c.proc.wait(10) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["sub", "thesis.txt"]
    assert (folder / "thesis.txt").read_text() == "precious"
    wait_until(lambda: "coordinator_stopped" in c.log, 5, "the daemon's last log line read")
    assert "journal_folder_kept" in c.log and "thesis.txt" in c.log, c.log[-2000:]


def test_the_coordinator_binds_and_serves_over_ipv6(tmp_path, probes):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    c = procs.Coordinator(tmp_path / "j6", host="[::1]")   # was: exit 4, "No such device"
    try:
        assert c.address.startswith("tcp://[::1]:"), c.address
        p = probes(c.address, job="v6", world_size=1)
        p.expect("joined")
        assert p.cmd("kv_set", key="k", value="v")["ok"] and p.cmd("kv_get", key="k")["value"] == "v"
    finally:
        c.stop()


@pytest.mark.parametrize("timeout, says", [
    # the request's own deadline comes first
    ("1", "status to {addr}: no answer within 1 s ({why})"),
    # a 60 s timeout is not waited out: two refused connects, 1 s apart, end it (subprocess: 30 s)
    ("60", "no answer from {addr} ({why})"),
])
def test_status_of_a_port_where_nothing_listens_says_so(timeout, says):
    with socket.socket() as s:      # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", addr,
                          "--timeout", timeout], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr
    why = f"nothing is listening on 127.0.0.1 port {port}: is the coordinator running there?"
    assert out.stderr.strip() == "rtxnet status: " + says.format(addr=addr, why=why), out.stderr


@pytest.mark.timeout(60)
def test_a_listener_that_is_no_coordinator_is_named_at_once(coordinator):
    """A rank or ``rtxnet status`` pointed at another program's port (here Python's HTTP server)
    waited out coordinator_s (30 s) or the whole --timeout before: that listener's answer to
    ZeroMQ's signature now says it is no coordinator. A coordinator, running or stopped, is
    never taken for one."""
    from transport.channel import nobody_there

    http = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                            stdout=subprocess.PIPE, text=True, cwd=procs.ROOT)
    try:
        port = int(re.search(r"port (\d+)", http.stdout.readline()).group(1))
        addr = f"tcp://127.0.0.1:{port}"
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", addr,
                              "--timeout", "30"], capture_output=True, text=True, timeout=40, env=procs.env())
        took = time.monotonic() - t0
        assert out.returncode == 1, out
        assert (f"no answer from {addr} (something listens on 127.0.0.1 port {port} but it does not speak "
                f"ZeroMQ (it answered b'") in out.stderr, out.stderr
        assert took < 20, took     # two checks 1 s apart, not the 30 s
        rank = subprocess.run([sys.executable, "-c", f"import rtxnet; rtxnet.init({addr!r}, job='j', world_size=1)"],
                              capture_output=True, text=True, timeout=40,
                              env=procs.env(RTXNET_REQUEST_TIMEOUT="2"))
        assert rank.returncode == 1 and (
            f"RtxTimeoutError: join to {addr}: no answer within 2 s; something listens on 127.0.0.1 port "
            f"{port} but it does not speak ZeroMQ") in rank.stderr, rank.stderr[-2000:]
    finally:
        http.kill()
        http.wait(10)
    assert nobody_there(coordinator.address) is None
    coordinator.signal(signal.SIGSTOP)
    try:
        assert nobody_there(coordinator.address) is None    # silent: stopped, not another program
    finally:
        coordinator.signal(signal.SIGCONT)
    assert coordinator_jobs(coordinator.address) == []     # and it serves on


def test_a_request_cancelled_as_its_answer_comes_is_cancelled(coordinator):
    """The task of a request cancelled in the loop turn its answer comes in ends cancelled. With
    asyncio.wait_for (Python 3.11) it returned the answer and the cancellation was lost: an
    agent's heartbeat loop, cancelled by asyncio.run() at exit, ran on, and the rank process
    never exited (a tester's find: 5 of 26 runs of a script that did not close its group)."""
    import asyncio

    from transport.channel import ControlClient

    async def main():
        client = ControlClient(coordinator.address, "cancelled-as-answered")
        try:
            for _ in range(3):
                task = asyncio.ensure_future(client.request("status", job="", epoch=-1, deadline_s=10))
                while not client._pending:
                    await asyncio.sleep(0)
                (rid, answer), = client._pending.items()
                # the answer comes (as the channel's reader sets it) and, in the same turn, the
                # task is cancelled (the daemon's own answer, later, finds the request gone)
                answer.set_result({"t": "reply", "rid": rid, "body": {"jobs": []}})
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert "jobs" in await client.request("status", job="", epoch=-1, deadline_s=10)
        finally:
            await client.aclose()

    asyncio.run(main())


def test_status_at_the_default_address_says_where_rtxnet_run_prints_its_coordinator():
    # a fresh user's find: a bare `rtxnet status` never finds the coordinator rtxnet-run started
    # (a free port), and said only that nothing listens at 29600
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 29600)) == 0:
            pytest.skip("something listens on 127.0.0.1:29600, rtxnet status's default address")
    env = {k: v for k, v in os.environ.items() if k != "RTXNET_COORDINATOR"}
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--timeout", "3"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("rtxnet status: no answer from tcp://127.0.0.1:29600 (nothing is listening"), \
        out.stderr
    assert out.stderr.rstrip().endswith("prints in its line '[rtxnet-run] coordinator tcp://...': pass that "
                                        "with --coordinator"), out.stderr


def test_status_writes_control_characters_of_ids_and_hosts_as_escapes(coordinator):
    # any client names hosts: they must not clear the screen or forge lines; a job id with a
    # control character is refused (status escapes those too, as a journal may hold one)
    with procs.dealer(coordinator.address, routing_id=b"esc") as d:
        d.send(encode(_join_msg(1, "esc", "ansi\x1b[2Jjob\nFAKE")))
        r = decode(d.recv())
        assert r["error"] == "ConfigError" and "holds a control character" in r["message"], r
        d.send(encode(_join_msg(2, "esc", "esc-job", host="evil\n\x1b[31mjob-x")))
        r = decode(d.recv())
        assert r["t"] != "error", r
        out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                             capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\njob-x" not in out.stdout, out.stdout
    assert "evil\\n\\x1b[31mjob-x  pid" in out.stdout, out.stdout


def test_a_coordinator_whose_log_reader_is_gone_still_stops_cleanly(tmp_path):
    """rtxnet-run SIGKILLed: the daemon's stderr is a pipe nobody reads; its stop on SIGTERM
    (its parent-death signal) must not die of BrokenPipeError before removing the temporary
    journal (it did: exit 1, the journal left behind)."""
    journal = tmp_path / "journal"
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0", "--journal",
                          str(journal), "--remove-journal-on-stop"], stdout=subprocess.PIPE, stderr=w,
                         cwd=ROOT, env=procs.env())
    try:
        os.close(w)
        assert p.stdout.readline().startswith(b"RTXNET_COORDINATOR=")
        assert journal.exists()
        os.close(r)
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
        assert not journal.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.timeout(60)
def test_a_port_in_use_exits_4_and_leaves_no_journal_it_made(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for journal, existed in ((tmp_path / "new", False), (tmp_path / "old", True)):
            if existed:
                journal.mkdir()
                (journal / "keep").write_text("x")
            out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", f"tcp://127.0.0.1:{port}",
                                  "--journal", str(journal)], capture_output=True, text=True, timeout=30,
                                 cwd=ROOT, env=procs.env())
            assert out.returncode == 4 and "bind_failed" in out.stderr, out.stderr
            assert journal.exists() == existed, (journal, out.stderr)
            if existed:    # the user's file stays, and nothing the failed start made
                assert [p.name for p in journal.iterdir()] == ["keep"], list(journal.iterdir())
                assert (journal / "keep").read_text() == "x"


def test_an_ipc_coordinator_serves_and_leaves_no_socket_file(tmp_path):
    # a fresh user's trial: --bind ipc://PATH crashed with a traceback (the reachable address
    # assumed host:port) and left the socket file and the journal behind
    sock = tmp_path / "coord.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--bind", f"ipc://{sock}", "--journal",
                             str(tmp_path / "j"), "--remove-journal-on-stop"], cwd=ROOT, env=procs.env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"RTXNET_COORDINATOR=ipc://{sock}"
        out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", f"ipc://{sock}"],
                             capture_output=True, text=True, timeout=30, cwd=ROOT, env=procs.env())
        assert out.returncode == 0 and out.stdout.strip() == "no jobs", out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.stderr.read()[-2000:]
        assert not sock.exists() and not (tmp_path / "j").exists(), list(tmp_path.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_coordinator_on_an_ipc_address_in_use_is_refused(tmp_path):
    # a fresh user's trial: ZeroMQ let a second daemon bind the same ipc:// path (it replaces
    # the socket file), and the first one ran on where nobody could reach it; tcp:// says
    # "Address already in use" (exit 4), and so does ipc:// now
    sock = tmp_path / "coord.sock"
    first = procs.Coordinator(tmp_path / "j1", bind=f"ipc://{sock}")
    try:
        out = subprocess.run([sys.executable, "-m", "coordinator", "--bind", f"ipc://{sock}", "--journal",
                              str(tmp_path / "j2")], capture_output=True, text=True, timeout=30, cwd=ROOT,
                             env=procs.env())
        assert out.returncode == 4 and "a process already listens on" in out.stderr, out.stderr[-2000:]
        assert not (tmp_path / "j2").exists()
        status = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", f"ipc://{sock}"],
                                capture_output=True, text=True, timeout=30, cwd=ROOT, env=procs.env())
        assert status.returncode == 0, status.stderr      # the first one still serves
    finally:
        first.kill(signal.SIGTERM)
    # a socket file nobody listens on any more (its daemon SIGKILLed) is taken over
    stale = procs.Coordinator(tmp_path / "j3", bind=f"ipc://{sock}")
    stale.kill()
    assert sock.exists()
    again = procs.Coordinator(tmp_path / "j4", bind=f"ipc://{sock}")
    again.kill(signal.SIGTERM)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("frozen_s,joins", [(3.0, True), (6.0, False)], ids=["resumes-in-time", "frozen-too-long"])
def test_a_join_waits_for_a_frozen_coordinator_up_to_coordinator_s(coordinator, tmp_path, frozen_s, joins):
    """The coordinator is SIGSTOPped while a rank calls init: a join waits for it as long as
    members wait for its heartbeats (coordinator_s, 4 s here), not one request's deadline (1.5 s
    here; a fresh user's rank raised RtxTimeoutError 10 s into a 15 s freeze and the job ended)."""
    script = tmp_path / "join.py"
    script.write_text(textwrap.dedent("""
        import sys, time, rtxnet
        print("init", flush=True)
        t0 = time.monotonic()
        try:
            pg = rtxnet.init(job="frozen-join", world_size=1)
        except rtxnet.RtxTimeoutError as exc:
            print(f"timeout after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
            sys.exit(3)
        print(f"joined after {time.monotonic() - t0:.1f} s", flush=True)
        pg.close()
    """))
    env = procs.env(RTXNET_COORDINATOR=coordinator.address, RTXNET_REQUEST_TIMEOUT="1.5",
                    RTXNET_COORDINATOR_TIMEOUT="4", RTXNET_HEARTBEAT_TIMEOUT="1", RTXNET_HEARTBEAT_INTERVAL="0.2")
    coordinator.proc.send_signal(signal.SIGSTOP)
    try:
        rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=ROOT, env=env)
        # the freeze counts from the join (a loaded machine may take seconds to import rtxnet)
        first = rank.stdout.readline()
        time.sleep(frozen_s)
    finally:
        coordinator.proc.send_signal(signal.SIGCONT)
    try:
        out, err = rank.communicate(timeout=40)
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert first == "init\n", first + out + err[-3000:]
    if joins:
        assert rank.returncode == 0 and out.startswith("joined after"), out + err[-3000:]
    else:
        assert rank.returncode == 3, out + err[-3000:]
        assert f"join to {coordinator.address}: no answer within 4 s" in out, out + err[-3000:]


@pytest.mark.timeout(60)
def test_init_returns_when_its_world_formed_even_if_a_peer_left_at_once(coordinator, tmp_path):
    """Rank 0 is held (SIGSTOP) between its join and the world forming; rank 1 joins, gets its
    world of 2 and closes at once. When rank 0 runs again it sees the world of 2 and then the
    world of 1 together: its init must return (it was in a world of min_ranks), not wait for a
    replacement until the rendezvous timeout (a fresh user's suite run hung so, 3 runs in 25
    under load, on `init(); close()` with 2 ranks)."""
    script = tmp_path / "quick.py"
    script.write_text(textwrap.dedent("""
        import sys, time, rtxnet
        t0 = time.monotonic()
        pg = rtxnet.init(job="quick-leave", world_size=2)
        print(f"init after {time.monotonic() - t0:.1f} s world {pg.world_size}", flush=True)
        pg.close()
    """))
    env = procs.env(RTXNET_COORDINATOR=coordinator.address, RTXNET_HEARTBEAT_TIMEOUT="10",
                    RTXNET_OP_TIMEOUT="20", RTXNET_RENDEZVOUS_TIMEOUT="25")
    started = []
    try:
        r0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=dict(env, RTXNET_RANK="0"))
        started.append(r0)
        wait_pending(coordinator.address, "quick-leave", 1)
        r0.send_signal(signal.SIGSTOP)
        try:
            r1 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, env=dict(env, RTXNET_RANK="1"))
            started.append(r1)
            out1, err1 = r1.communicate(timeout=30)
            assert r1.returncode == 0 and "world 2" in out1, out1 + err1[-2000:]
        finally:
            r0.send_signal(signal.SIGCONT)
        out0, err0 = r0.communicate(timeout=20)
        assert r0.returncode == 0, out0 + err0[-3000:]
        assert "world 1" in out0 or "world 2" in out0, out0 + err0[-3000:]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_journal_is_compacted_by_its_bytes_and_a_failed_snapshot_leaves_the_daemon_serving(tmp_path, probes):
    """Compaction came only every --snapshot-every records (10,000): one store key rewritten with
    4 MiB values 60 times made a 240 MiB journal for one key (a tester's find). It now also
    comes once the records since the last snapshot hold 64 MiB (or 4x the snapshot). A snapshot
    that cannot be written (a read-only folder, a full disk) was exit 3; the journal is still usable then,
    so the daemon says so and serves on."""
    journal = tmp_path / "j"
    c = procs.Coordinator(journal, restartable=True)   # (restarted below)
    try:
        p = probes(c.address, job="big", world_size=1)
        p.expect("joined")
        value = "x" * (4 << 20)
        for i in range(20):            # 80 MiB of records: one compaction, at about 64 MiB
            assert p.cmd("kv_set", key="k", value=f"{i}" + value[1:], timeout=30)["ok"]
        procs.wait_until(lambda: "journal_compacted" in c.log, 10, "a compaction")
        size = sum(f.stat().st_size for f in journal.iterdir() if f.is_file())
        assert size < 40 << 20, (size, sorted(f.name for f in journal.iterdir()))
        # a folder where the snapshot's temporary file goes: its open fails, for root too
        (journal / "snapshot.bin.tmp").mkdir()
        for i in range(20):
            assert p.cmd("kv_set", key="k", value=f"{i}" + value[1:], timeout=30)["ok"]
        procs.wait_until(lambda: "journal_snapshot_skipped" in c.log, 10, "a skipped snapshot")
        assert c.proc.poll() is None
        assert p.cmd("kv_get", key="k", timeout=30)["value"][:2] == "19"
        (journal / "snapshot.bin.tmp").rmdir()
        c.kill(signal.SIGKILL)
        c.start()
        assert p.cmd("kv_get", key="k", timeout=30)["value"][:2] == "19"
    finally:
        c.stop()


@pytest.mark.parametrize("what", ["folder", "segment"])
def test_a_journal_removed_under_the_daemon_is_written_again_from_its_state(tmp_path, probes, what):
    """``rm -rf`` of the journal's folder while the daemon ran went unseen: it acknowledged every
    later write into a file no restart could read, and a restart on the path replayed nothing
    (a breaker's find). The next write now finds its files unlinked and writes the state there
    again (a snapshot and a new segment), before it is acknowledged; so after the snapshot alone
    removed (a restart refused the journal without it: a re-verifier's find); and an idle daemon
    looks each second, so a second daemon finds the path held (it started on it before)."""
    journal = tmp_path / "j"
    c = procs.Coordinator(journal, restartable=True)   # (restarted below)
    try:
        p = probes(c.address, job="gone", world_size=1)
        p.expect("joined")
        assert p.cmd("kv_set", key="before", value="1", timeout=30)["ok"]
        if what == "folder":
            shutil.rmtree(journal)
        else:
            for f in journal.glob("journal-*.log"):
                f.unlink()
        assert p.cmd("kv_set", key="after", value="2", timeout=30)["ok"]
        # (the log is read by a thread of the test: it may lag the answer by a moment)
        procs.wait_until(lambda: c.log.count("journal_recreated") == 1, 10, "the first journal_recreated")
        assert (journal / "snapshot.bin").is_file() and list(journal.glob("journal-*.log")), list(journal.iterdir())
        (journal / "snapshot.bin").unlink()
        assert p.cmd("kv_set", key="later", value="3", timeout=30)["ok"]
        procs.wait_until(lambda: c.log.count("journal_recreated") == 2, 10, "the second journal_recreated")
        shutil.rmtree(journal)     # and nothing written after it
        procs.wait_until(lambda: c.log.count("journal_recreated") == 3, 10, "the idle daemon's look")
        second = subprocess.run([sys.executable, "-m", "coordinator", "--bind", "tcp://127.0.0.1:0",
                                 "--journal", str(journal)], capture_output=True, text=True, timeout=30,
                                env=procs.env())
        assert second.returncode == 3 and "in use by another process" in second.stderr, second.stderr[-2000:]
        c.kill(signal.SIGKILL)
        c.start()
        for key, value in (("before", "1"), ("after", "2"), ("later", "3")):
            assert p.cmd("kv_get", key=key, timeout=30)["value"] == value, key
    finally:
        c.stop()


def test_a_journal_that_cannot_be_written_again_stops_the_daemon_before_it_acknowledges(tmp_path, probes):
    """The folder replaced by a file: the state cannot be made durable there, so the daemon exits
    3 (as after a failed write) instead of acknowledging writes no disk holds (it logged and went
    on: a re-verifier's find)."""
    journal = tmp_path / "j"
    c = procs.Coordinator(journal)
    try:
        p = probes(c.address, job="gone", world_size=1, timeouts={"request_s": 3.0})
        p.expect("joined")
        assert p.cmd("kv_set", key="before", value="1", timeout=30)["ok"]
        shutil.rmtree(journal)
        journal.write_text("not a folder")
        r = p.cmd("kv_set", key="after", value="2", timeout=30)
        assert not r["ok"], r
        assert c.proc.wait(timeout=30) == 3, c.log[-3000:]
        procs.wait_until(lambda: "journal_failed" in c.log and "cannot be written again" in c.log, 10,
                         "the daemon's journal_failed line")
    finally:
        c.stop()


def test_status_shows_members_whose_info_has_an_unexpected_shape(coordinator):
    """A member's info is whatever its agent published: `rtxnet status` printed a traceback for a
    "topology" that was a string or held a number of GPUs instead of a list (a tester's find)."""
    with contextlib.ExitStack() as held:   # each member's connection stays open
        for k, info in enumerate(({"topology": "x"}, {"topology": {"gpus": 3}},
                                  {"topology": {"gpus": [{"uuid": "GPU-1"}]}})):
            d = held.enter_context(procs.dealer(coordinator.address, routing_id=f"odd{k}".encode()))
            d.send(encode(_join_msg(1, f"odd{k}", f"odd{k}", info=info, heartbeat_timeout_s=60.0)))
            assert decode(d.recv())["rid"] == 1
        _check_status_of_odd_info(coordinator)


def _check_status_of_odd_info(coordinator) -> None:
    for extra in ([], ["--json"]):
        out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address,
                              *extra], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", coordinator.address],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.count(" GPU(s)") == 1 and "  1 GPU(s)" in out.stdout, out.stdout


def test_status_refuses_an_ipv6_address_without_its_closing_bracket():
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", "tcp://[::1:5"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "host '[::1' is not an IPv6 address in brackets" in out.stderr, out.stderr


@pytest.mark.exclusive   # measures how long a wait takes
def test_a_store_wait_keeps_its_deadline_across_a_coordinator_restart_and_a_frozen_coordinator(coordinator, probes):
    """A wait sent again after a coordinator restart asked for its whole timeout again
    (wait(timeout=4) ended after 8.8 s), and on a frozen coordinator the agent waited the timeout
    plus the 10 s request deadline (wait(timeout=2) ended after 12 s): a tester's finds."""
    p = probes(coordinator.address, job="w", world_size=1, timeouts={**FAST, "request_s": 10.0})
    p.expect("joined")
    t0 = time.monotonic()
    p.submit("kv_wait", keys=["never"], timeout=4.0)
    time.sleep(2.5)
    coordinator.kill(signal.SIGKILL)
    coordinator.start()                      # same port, same journal: the wait is sent again
    r = p.expect("result", timeout=20, cmd="kv_wait")
    took = time.monotonic() - t0
    assert r["error"] == "RtxTimeoutError", r
    assert 3.9 < took < 5.5, took            # before: 2.5 s + 4 s again
    coordinator.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        p.submit("kv_wait", keys=["never"], timeout=2.0)
        r = p.expect("result", timeout=20, cmd="kv_wait")
        took = time.monotonic() - t0
    finally:
        coordinator.proc.send_signal(signal.SIGCONT)
    assert r["error"] == "RtxTimeoutError" and "no answer within 4 s" in r["message"], r
    assert took < 4.9, took                  # before: 2 s + the 10 s request deadline
    # and why, as far as the rank can tell (it was a bare timeout: a tester's find)
    assert "the coordinator has answered none of this rank's heartbeats either for" in r["message"], r
    assert "it is down, frozen or restarting" in r["message"], r


def test_compare_set_and_delete_across_a_coordinator_restart_are_answered_once_and_rightly(coordinator, probes):
    """A compare_set or delete in flight when the coordinator died was not sent again (it would
    find its own write and answer "not swapped"): it failed after the 10 s request deadline (a
    breaker's note: a job's first checkpoint save stalled 10 s). Now it is sent again at once, and
    the coordinator answers a repeat of one that wrote as it did the first time, from the journal."""
    import zmq

    p = probes(coordinator.address, job="cas", world_size=1, timeouts={**FAST, "request_s": 10.0})
    p.expect("joined")
    p.cmd("kv_set", key="gone", value="1")
    for cmd, args, want in (("kv_cas", {"key": "leader", "expected": None, "value": "me"}, {"swapped": True, "value": "me"}),
                            ("kv_del", {"key": "gone"}, {"deleted": True})):
        coordinator.signal(signal.SIGSTOP)   # the request reaches a daemon that dies before it reads it
        try:
            p.submit(cmd, **args)
            time.sleep(0.5)
        finally:
            coordinator.kill(signal.SIGKILL)
        t0 = time.monotonic()
        coordinator.start()                  # same port, same journal
        r = p.expect("result", timeout=20, cmd=cmd)
        assert r["ok"] and {k: r[k] for k in want} == want, r
        assert time.monotonic() - t0 < 6, time.monotonic() - t0   # (before: RtxTimeoutError at 10 s)
    # the repeat of a request that wrote, from the same routing id, after another restart: the
    # first answer (replayed from the journal), where a new request is evaluated afresh
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"raw-client")
    try:
        dealer.connect(coordinator.address)

        def ask(rid, **fields):
            dealer.send(encode(wire.make("kv_cas", rid=rid, job="cas", epoch=0, token="", **fields)))
            assert dealer.poll(10_000), "no answer"
            reply = decode(dealer.recv())
            assert reply["t"] == "reply", reply
            return reply["body"]

        assert ask(7, key="k", expected=None, value=b"1") == {"swapped": True, "value": b"1"}
        coordinator.kill(signal.SIGKILL)
        coordinator.start()
        assert ask(7, key="k", expected=None, value=b"1") == {"swapped": True, "value": b"1"}
        assert ask(8, key="k", expected=None, value=b"1") == {"swapped": False, "value": b"1"}
    finally:
        dealer.close(0)
        ctx.term()


def test_status_of_an_ipc_address_nothing_listens_at_says_so_at_once(tmp_path):
    # it waited out the whole timeout and said only "no answer" (a tester's find)
    sock = tmp_path / "none.sock"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", f"ipc://{sock}",
                          "--timeout", "20"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=procs.env())
    assert out.returncode == 1 and f"nothing is listening at {sock} (no socket file)" in out.stderr, out
    assert time.monotonic() - t0 < 10, out.stderr
    # a directory or a plain file there is named as such (a directory was "a stale socket file")
    from transport.channel import nobody_there

    (tmp_path / "plain").write_text("")
    assert nobody_there(f"ipc://{tmp_path}").endswith(f"at {tmp_path} (a directory, not a socket file): "
                                                      f"is the coordinator running there?")
    assert "(a file that is not a socket)" in nobody_there(f"ipc://{tmp_path / 'plain'}")


@pytest.mark.parametrize("body", [{}, {"jobs": "nope"}, {"jobs": [{"job": "j", "members": "x"}], "finished": 3}],
                         ids=["empty", "jobs-a-str", "ill-typed"])
def test_status_from_a_server_answering_another_shape_is_one_line(body):
    # A tester's find: a server that answers status with another shape (another version's
    # coordinator, or none of rtxnet's) ended `rtxnet status` in a traceback (KeyError: 'jobs').
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer():
        if router.poll(20_000):
            ident, raw = router.recv_multipart()[:2]
            req = decode(raw)
            router.send_multipart([ident, encode({"v": wire.PROTOCOL_VERSION, "t": "reply", "rid": req["rid"],
                                                  "job": "", "epoch": 0, "ok": True, "body": body})])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        addr = f"tcp://127.0.0.1:{port}"
        out = subprocess.run([sys.executable, "-m", "rtxnet.cli", "status", "--coordinator", addr,
                              "--timeout", "10"], capture_output=True, text=True, timeout=30)
    finally:
        t.join(25)
        router.close(0)
        ctx.term()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"rtxnet status: the answer of {addr} is not a status this rtxnet can read"), out.stderr


def test_a_leave_in_flight_when_the_coordinator_dies_is_answered_by_its_restart(coordinator, probes):
    """A rank closes its group while the daemon is frozen, and the daemon is SIGKILLed with the
    leave unread. The leave goes again to the restarted daemon: the job finishes at once, not
    "leave_failed ... no answer within 10 s" with the job left crashed (its id not refused, kept an
    hour for ranks that would never come: a breaker's find)."""
    (p,) = joined(probes, coordinator.address, "leaveinflight", 1)
    coordinator.signal(signal.SIGSTOP)
    p.submit("leave")
    time.sleep(0.5)                          # the leave sits unread in the frozen daemon's socket
    coordinator.kill(signal.SIGKILL)
    coordinator.start()
    t0 = time.monotonic()
    assert p.expect("result", cmd="leave", timeout=20)["ok"]
    assert time.monotonic() - t0 < 5, p.log[-2000:]
    assert "leave_failed" not in p.log, p.log[-2000:]
    assert not any(j["job"] == "leaveinflight" for j in coordinator_jobs(coordinator.address))


def test_a_rewind_in_flight_when_the_coordinator_dies_is_answered_by_its_restart(coordinator, probes):
    """As a leave: a rewind (every rank lost, training goes on from an older step) unread by a
    daemon that is SIGKILLed is sent again to its restart, and the job's committed step moves
    back; before, the rank waited out its 10 s request deadline in the middle of its recovery."""
    (p,) = joined(probes, coordinator.address, "rewindinflight", 1)
    p.submit("commit", step=3)
    assert p.expect("result", cmd="commit", timeout=20)["ok"]
    coordinator.signal(signal.SIGSTOP)
    p.submit("rewind", step=1)
    time.sleep(0.5)                          # the rewind sits unread in the frozen daemon's socket
    coordinator.kill(signal.SIGKILL)
    coordinator.start()
    t0 = time.monotonic()
    got = p.expect("result", cmd="rewind", timeout=20)
    assert got["ok"], got
    assert time.monotonic() - t0 < 5, p.log[-2000:]
    assert got["committed_step"] == 1, got
    (job,) = [j for j in coordinator_jobs(coordinator.address) if j["job"] == "rewindinflight"]
    assert job["committed_step"] == 1, job
