"""Two hosts as network namespaces (``ip netns``) joined by a veth pair, each running
``rtxnet-run --nnodes 2 --node-rank K``; the coordinator runs on the first. The workload
(tools/ft_workload.py) has one right answer whatever the world size, so a run that lost a node
must still end with it. The partition is real: the second host's link is set down, so neither
its heartbeats nor its peers' data get through (unlike the ``partition`` fault, simulated inside
the rank).

Needs root and iproute2; skipped, with the reason, elsewhere. The namespaces, their veth pair and
the 10.201.0.0/24 addresses exist only inside them and are removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest

sys.path.insert(0, str(procs.ROOT / "tools"))
import ft_workload  # noqa: E402
import netns  # noqa: E402
from netns import ADDRS  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# fast failure detection; the op timeout bounds how long the cut-off side waits on its peers
TIMEOUTS = {"RTXNET_HEARTBEAT_INTERVAL": "0.1", "RTXNET_HEARTBEAT_TIMEOUT": "1", "RTXNET_OP_TIMEOUT": "4",
            "RTXNET_COORDINATOR_TIMEOUT": "3", "RTXNET_RENDEZVOUS_TIMEOUT": "60"}


@pytest.fixture
def hosts():
    """Two hosts (tools/netns.py): namespaces joined by a veth pair, removed at the end."""
    try:
        with netns.two_hosts() as h:
            yield h
    except netns.Unavailable as exc:
        pytest.skip(str(exc))


def _launch(hosts, node: int, address: str, job: str, out: Path, steps: int, *extra: str,
            nproc: int = 2, **timeouts: str) -> subprocess.Popen:
    """Host ``node``'s launcher of ``nproc`` ranks of ft_workload (in its namespace; ``hosts``
    None: on this machine's loopback, told apart by ``RTXNET_HOST`` only)."""
    env = procs.env(RTXNET_HOST=f"node{node}", **{**TIMEOUTS, **timeouts})
    argv = [sys.executable, "-m", "rtxnet.launcher", "--nnodes", "2", "--node-rank", str(node), "--nproc", str(nproc),
            "--coordinator", address, "--job", job, *extra, "tools/ft_workload.py", "--steps", str(steps),
            "--step-sleep", "0.01", "--out", str(out)]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=procs.ROOT)
    return subprocess.Popen(argv, **kw) if hosts is None else hosts.popen(node, argv, **kw)


def _stop(launchers: list[subprocess.Popen], coord: procs.Coordinator) -> None:
    """SIGKILL the launchers still running (their ranks get SIGTERM with them) and the daemon."""
    for p in launchers:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    coord.kill()


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)     # the ranks get SIGTERM with it (PR_SET_PDEATHSIG)
        out, err = p.communicate(timeout=20)
        raise AssertionError(f"launcher {p.args[3:]} still running after {timeout} s:\n{err[-4000:]}") from None
    return p.returncode, out, err


def _results(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("final-*.json"))]


def _committed(hosts, address: str, job: str) -> int:
    r = subprocess.run([*hosts.prefix(0), sys.executable, "-m", "rtxnet.cli", "status", "--json",
                        "--coordinator", address], capture_output=True, text=True, timeout=30,
                       env=procs.env(), cwd=procs.ROOT)
    jobs = json.loads(r.stdout) if r.returncode == 0 else []
    return max([j["committed_step"] for j in jobs if j["job"] == job] or [-1])


def test_two_nodes_train_to_the_one_right_answer(hosts, tmp_path):
    coord = procs.Coordinator(tmp_path / "journal", host=ADDRS[0], prefix=hosts.prefix(0))
    launchers = []
    try:
        launchers = [_launch(hosts, k, coord.address, "two-nodes", tmp_path / "out", 40) for k in (0, 1)]
        done = [_finish(p, 90) for p in launchers]
    finally:
        _stop(launchers, coord)
    for rc, _, err in done:
        assert rc == 0, err[-4000:]
    # each node's ranks listen on its own address, and the ranks are numbered across the nodes
    assert f"node 0 of 2: starting ranks 0..1 of 4 of tools/ft_workload.py (data sockets on {ADDRS[0]})" in done[0][2]
    assert f"node 1 of 2: starting ranks 2..3 of 4 of tools/ft_workload.py (data sockets on {ADDRS[1]})" in done[1][2]
    res = _results(tmp_path / "out")
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3] and {r["world_size"] for r in res} == {4}, res
    assert {r["sha256"] for r in res} == {ft_workload.reference(40, 1024)}, res


def test_a_node_cut_off_by_the_network_is_dropped_and_the_other_finishes(hosts, tmp_path):
    coord = procs.Coordinator(tmp_path / "journal", host=ADDRS[0], prefix=hosts.prefix(0))
    launchers = []
    steps = 400
    try:
        launchers = [_launch(hosts, k, coord.address, "cut", tmp_path / "out", steps, "--min-ranks", "2")
                     for k in (0, 1)]
        procs.wait_until(lambda: _committed(hosts, coord.address, "cut") >= 20 or any(
            p.poll() is not None for p in launchers), 60, "training under way on all 4")
        assert all(p.poll() is None for p in launchers), \
            [p.communicate(timeout=20)[1][-3000:] for p in launchers if p.poll() is not None]
        hosts.link(1, up=False)
        cut = time.monotonic()
        rc_b, _, err_b = _finish(launchers[1], 60)
        b_gone_s = time.monotonic() - cut
        rc_a, _, err_a = _finish(launchers[0], 90)
    finally:
        _stop(launchers, coord)
    # the coordinator's side lost the other node's two ranks, went on as a world of 2 (>= --min-ranks)
    # and ended with the right answer, one step redone
    assert rc_a == 0, err_a[-4000:]
    res = _results(tmp_path / "out")
    assert sorted(r["rank"] for r in res) == [0, 1] and {r["world_size"] for r in res} == {2}, res
    assert {r["sha256"] for r in res} == {ft_workload.reference(steps, 1024)}, res
    for r in res:   # (a commit_stall event may come too: a slow vote on a loaded machine)
        failure, recovered = [e for e in r["events"] if e["event"] in ("failure", "recovered")]
        # the two are declared lost together or one heartbeat check apart (two epochs; ranks are
        # renumbered at each, so the second may be "2" again): one recovery either way. (Numbered
        # in their epoch: after an earlier eviction and rejoin, under load, they were [0, 1] in
        # a CI run; the launch ranks below are the stable names.)
        assert failure["lost"] and len(recovered["lost"]) == 2, r["events"]
        assert recovered["lost_launch"] == [2, 3], r["events"]   # named as launched: stable
        assert recovered["steps_lost"] == 1, r["events"]
    # the cut-off side cannot reach the coordinator: each of its ranks stops with one clear error
    # within the op timeout plus a little, instead of retrying the step into a wall
    assert rc_b != 0 and b_gone_s < 30, (rc_b, b_gone_s, err_b[-3000:])
    for r in (2, 3):   # from its failed step, or from its vote if the cut came during one
        assert f"[rank{r}] transport.errors.CoordinatorLostError: " in err_b, err_b[-3000:]
    assert "this rank is cut off from it (a network partition" in err_b, err_b[-3000:]


def test_hosts_cut_from_each_other_but_not_from_the_coordinator_train_on_one_side(hosts, tmp_path):
    # A netns tester's find: each side evicted the other and rejoined at once, for good (about a
    # step per 20 s), and the side readmitted without the last commits evicted their holders: the
    # job went back to its older state (committed steps 120, 121 rewound to 119). Each host's rank
    # binds its data ports to a second address, which the other host cannot reach (static ARP to
    # a dead MAC); both reach the coordinator on the first. The cut heals once the evicted side
    # has found the other's data port silent.
    data = ("10.201.0.11", "10.201.0.12")
    for k in (0, 1):
        hosts.add_addr(k, data[k])
    coord = procs.Coordinator(tmp_path / "journal", host=ADDRS[0], prefix=hosts.prefix(0))
    launchers, errs = [], [tmp_path / f"launcher{k}.err" for k in (0, 1)]
    steps = 1500
    try:
        for k in (0, 1):
            with open(errs[k], "w") as err:
                launchers.append(hosts.popen(
                    k, [sys.executable, "-m", "rtxnet.launcher", "--nnodes", "2", "--node-rank", str(k),
                        "--nproc", "1", "--coordinator", coord.address, "--job", "split", "--min-ranks", "1",
                        "--bind-host", data[k], "tools/ft_workload.py", "--steps", str(steps),
                        "--step-sleep", "0.01", "--out", str(tmp_path / "out")],
                    stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=procs.ROOT,
                    env=procs.env(RTXNET_HOST=f"node{k}", **{**TIMEOUTS, "RTXNET_OP_TIMEOUT": "2"})))
        procs.wait_until(lambda: _committed(hosts, coord.address, "split") >= 20 or any(
            p.poll() is not None for p in launchers), 60, "training under way on both hosts")
        assert all(p.poll() is None for p in launchers), [e.read_text()[-3000:] for e in errs]
        hosts.blackhole(0, data[1])
        hosts.blackhole(1, data[0])
        # the evicted side finds the other's data port silent and does not rejoin while the cut
        # lasts: the trainers pay for the cut once (before: one sync timeout per rejoin)
        procs.wait_until(lambda: any("rejoin_deferred" in e.read_text() for e in errs), 60,
                         "the evicted side deferring its rejoin")
        hosts.unblackhole(0, data[1])
        hosts.unblackhole(1, data[0])
        rcs = []
        for p in launchers:
            try:
                rcs.append(p.wait(timeout=100))
            except subprocess.TimeoutExpired:
                rcs.append(None)
    finally:
        _stop(launchers, coord)
    err = errs[0].read_text() + errs[1].read_text()
    assert rcs == [0, 0], err[-6000:]
    assert re.search(r"rejoin_deferred .*unreachable=\['tcp://10\.201\.0\.1[12]:\d+\?bulk=\d+'\]", err), err[-6000:]
    # no committed step given up: the readmitted side cannot evict the ranks holding them
    assert "job_rewound" not in err and "committed_state_lost" not in err, err[-6000:]
    # healed, the evicted side is readmitted and both train to the one right answer; its
    # readmission fails no step. (After a cut of 20 s its first sync timed out on its links from
    # before the cut, stuck in TCP retransmission backoff, and it was evicted again: a
    # re-verifier's find, now fresh links; this cut of ~6 s is too short to show that.)
    res = _results(tmp_path / "out")
    assert len(res) == 2 and {r["world_size"] for r in res} == {2}, res
    assert {r["sha256"] for r in res} == {ft_workload.reference(steps, 1024)}, res
    # (the evicted side may count the cut's step twice, its retry before it was evicted: a CI
    # run; what must not happen is a failure at a later step, its readmission's)
    cut_steps = {e["step"] for r in res for e in r["events"] if e["event"] == "failure"}
    assert len(cut_steps) == 1, [r["events"] for r in res]
    assert len(re.findall(r"\] rejoining +reason=", err)) == 1 and "eviction_refused" not in err, err[-6000:]


def test_a_host_that_dies_and_comes_back_rejoins_at_a_step_boundary(tmp_path):
    """Host 1's launcher is SIGKILLed (its ranks die with it: a host lost), the other host goes
    on as a world of 2; host 1 is started again with the same command and its two new ranks
    join at a step decision: at most one step redone for the loss (none when host 0's ranks
    found it between steps), the exact answer on all four. On loopback (RTXNET_HOST tells the
    hosts apart), so it runs without root too."""
    coord = procs.Coordinator(tmp_path / "journal")
    steps, launchers = 500, []

    def launch(node: int) -> subprocess.Popen:
        return _launch(None, node, coord.address, "host-back", tmp_path / "out", steps, "--min-ranks", "2")

    def committed() -> int:
        return max([j["committed_step"] for j in procs.coordinator_jobs(coord.address) if j["job"] == "host-back"]
                   or [-1])

    try:
        launchers = [launch(0), launch(1)]
        procs.wait_until(lambda: committed() >= 20, 60, "20 committed steps")
        os.kill(launchers[1].pid, signal.SIGKILL)
        launchers[1].communicate(timeout=20)
        at = committed()
        procs.wait_until(lambda: committed() >= at + 20, 60, "20 more steps on host 0 alone")
        launchers.append(launch(1))
        done = [_finish(launchers[0], 90), _finish(launchers[2], 90)]
    finally:
        _stop(launchers, coord)
    for rc, _, err in done:
        assert rc == 0, err[-4000:]
    res = _results(tmp_path / "out")
    assert sorted(r["rank"] for r in res) == [0, 1, 2, 3] and {r["world_size"] for r in res} == {4}, res
    assert {r["sha256"] for r in res} == {ft_workload.reference(steps, 1024)}, res
    for r in res:
        kinds = [e["event"] for e in r["events"] if e["event"] != "commit_stall"]
        # host 0's ranks: the loss, then the comeback's joins at step boundaries (no ClosedError;
        # its two ranks may join in one epoch or two); the new ranks: nothing failed for them
        if r["rank"] < 2:
            # on loaded cores host 1's first ranks may join after host 0's began (--min-ranks 2):
            # joins before the loss (a CI run under load). The rest is read from the loss on.
            evs = [e for e in r["events"] if e["event"] != "commit_stall"]
            first = next(i for i, e in enumerate(evs) if e["event"] in ("failure", "lost_between_steps"))
            assert {e["event"] for e in evs[:first]} <= {"joined"}, r["events"]
            evs = evs[first:]
            kinds = [e["event"] for e in evs]
            # (the host's two ranks may be lost in two epochs: one just after a step committed,
            # a loss between steps, the other failing the next step)
            between = [e for e in evs if e["event"] == "lost_between_steps"]
            events = [e for e in evs if e["event"] != "lost_between_steps"]
            if kinds[0] == "lost_between_steps":
                kinds = kinds[1:]
            if kinds[:2] == ["failure", "recovered"]:
                kinds, events = kinds[2:], events[2:]
            else:   # both lost between steps, no step failed (a CI run's timing)
                assert len(between) == 1 and len(between[0]["lost"]) == 2, r["events"]
            if kinds[0] == "failure":
                # on loaded cores a step outlasted the coordinator's wait for a step decision
                # (3 mean step periods): the joins then opened their epoch in the step, which
                # failed (ClosedError: the membership changed) and was redone (a fresh user's run)
                # (its recovery follows the joins it synced with)
                assert events[0]["error"] == "ClosedError" and kinds[1] == "joined", r["events"]
                assert kinds.count("recovered") == 1, r["events"]
                kinds = [k for k in kinds[1:] if k != "recovered"]
            assert set(kinds) == {"joined"}, r["events"]
            assert sorted(x for e in evs if e["event"] == "joined" for x in e["added_launch"]) \
                == [2, 3], r["events"]
        else:   # (one may see the other join after it)
            assert set(kinds) <= {"joined"}, r["events"]
        # Each recovery lost no committed step (it resumed at the step that failed) and redid
        # that step only if the failure came in it: a failure in the sync before it (the host's
        # first rank found lost between steps, its second lost during the sync of that loss;
        # or a join's epoch opening during a sync) began no step, and lost none (steps_lost 0,
        # elastic.py's _close_failure; a tester's run under load 2-12 had 0 where 1 was asked).
        failure = None
        for e in r["events"]:
            if e["event"] == "failure":
                failure = e
            elif e["event"] == "recovered":
                assert failure is not None and e["failed_step"] == failure["step"], r["events"]
                assert e["resumed_step"] == e["failed_step"], r["events"]
                assert e["steps_lost"] == (1 if failure["in_step"] else 0), r["events"]
                failure = None


def test_a_node_stops_its_ranks_when_another_nodes_failures_leave_the_job_below_min_ranks(tmp_path):
    """Both of host 1's ranks fail for good (--max-restarts 0; rank 2 killed, its launcher then
    stops rank 3): the job of 4 cannot go on. Host 0's launcher learns it through the job's store
    and stops its ranks within seconds, instead of letting them wait out their rendezvous window
    (60 s here). On loopback."""
    coord = procs.Coordinator(tmp_path / "journal")
    launchers = []
    try:
        launchers = [_launch(None, k, coord.address, "below-min", tmp_path / "out", 100000,
                             "--faults", "kill:rank=2:step=10") for k in (0, 1)]
        t0 = time.monotonic()
        done = [_finish(p, 40) for p in launchers]
        took = time.monotonic() - t0
    finally:
        _stop(launchers, coord)
    (rc0, _, err0), (rc1, _, err1) = done
    assert rc1 == 137, err1[-3000:]
    assert ("rank 2 failed for good (--max-restarts 0): 3 ranks left, fewer than --min-ranks 4; "
            "stopping rank 3") in err1, err1[-3000:]
    assert rc0 != 0, err0[-3000:]
    # node 1's launcher writes each failure as it happens: node 0 may read rank 2's alone (a CI
    # run) or both, and either leaves the job below --min-ranks
    assert re.search(r"(rank 2|ranks 2, 3) failed for good on node 1 \(its launcher said so through "
                     r"the job's store\): [32] ranks left, fewer than --min-ranks 4; stopping ranks 0, 1",
                     err0), err0[-3000:]
    assert took < 30, (took, err0[-3000:])
