"""Fault plans: the parser behind ``rtxnet-run --faults`` and ``RTXNET_FAULTS``, without processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import procs
import pytest

from rtxnet import faults
from rtxnet.faults import Injector, parse_plan

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("plan, text", [
    ("pause:rank=1:step=20:seconds=inf", "seconds='inf' must be a finite number of seconds above 0 and at most 3600"),
    ("pause:rank=1:step=20:seconds=-inf", "seconds='-inf' must be a finite number of seconds above 0"),
    ("pause:rank=1:step=20:seconds=nan", "seconds='nan' must be a finite number of seconds above 0"),
    ("pause:rank=1:step=20:seconds=0", "seconds='0' must be a finite number of seconds above 0"),
    ("pause:rank=1:step=20:seconds=-3", "seconds='-3' must be a finite number of seconds above 0"),
    ("pause:rank=1:step=20:seconds=3601", "seconds='3601' must be a finite number of seconds above 0 and at most 3600"),
    ("partition:rank=2:step=4:seconds=NaNs", "seconds='NaNs' must be a finite number"),
    ("drop-heartbeats:rank=3:after=1:seconds=inf", "seconds='inf' must be a finite number"),
    ("delay:rank=0:ms=nan", "ms='nan' must be a finite number of milliseconds above 0 and at most 3600000"),
    ("delay:rank=0:ms=inf", "ms='inf' must be a finite number of milliseconds"),
    ("delay:rank=0:ms=0", "ms='0' must be a finite number of milliseconds above 0"),
    ("delay:rank=0:ms=1e20", "ms='1e20' must be a finite number of milliseconds above 0 and at most 3600000"),
    ("drop-heartbeats:rank=3:after=nan", "after='nan' must be a finite number of seconds in 0..3600"),
    ("drop-heartbeats:rank=3:after=-1s", "after='-1s' must be a finite number of seconds in 0..3600"),
    ("drop-heartbeats:rank=3:after=inf", "after='inf' must be a finite number of seconds in 0..3600"),
    ("pause:rank=1:step=2:seconds=soon", "seconds='soon' is not a number"),
    ("kill:rank=1:at=collective:collective=0", "collective='0' must be >= 1 (the first collective is 1)"),
])
def test_a_duration_must_be_finite_and_in_range(plan, text):
    with pytest.raises(ValueError) as info:
        parse_plan(plan)
    assert str(info.value).startswith(f"{plan!r}: {text}"), info.value


@pytest.mark.parametrize(("plan", "says"), [
    ("kill:rank=1:step=5:step=6", r"'kill:rank=1:step=5:step=6': field 'step' is given twice \(step='5' and step='6'\)"),
    ("pause:rank=1:step=5:seconds=1:rank=2", r"field 'rank' is given twice"),
    ("seed=1; kill:rank=any:step=3; seed=2", r"'seed=2': seed is given twice \(first 'seed=1'\)"),
    ("kill:rank=2:step=30; kill:step=30:rank=2",
     r"'kill:step=30:rank=2': the same fault as 'kill:rank=2:step=30', given twice"),
    ("pause:rank=1:step=5:seconds=2; pause:rank=1:step=5:seconds=2000ms",
     r"'pause:rank=1:step=5:seconds=2000ms': the same fault as 'pause:rank=1:step=5:seconds=2'"),
], ids=["field", "rank", "seed", "fault", "fault-in-other-units"])
def test_a_field_seed_or_fault_given_twice_is_named(plan, says):
    with pytest.raises(ValueError, match=says):
        parse_plan(plan)



@pytest.mark.parametrize(("plan", "says"), [
    # a breaker's plans, each taken before and run as another plan than it said
    ("kill:rank=1:step=20:collective=3", "step='20' and collective='3' name two points"),
    ("kill:rank=1:step=2:seconds=5", "kill takes no seconds (its fields: rank, at, step, collective)"),
    ("kill:rank=1:step=2:ms=5", "kill takes no ms"),
    ("kill-coordinator:step=3:seconds=9", "kill-coordinator takes no seconds"),
    ("lose-message:rank=1:step=3:seconds=1", "lose-message takes no seconds"),
    ("lose-message:rank=1", "lose-message needs step=N"),
    ("pause:rank=1:step=2:seconds=1:ms=5", "pause takes no ms (its fields: rank, at, step, collective, seconds)"),
    ("delay:rank=0:ms=5:seconds=2", "delay takes no seconds"),
    ("drop-heartbeats:rank=1:after=1:step=4:seconds=3", "after='1' makes drop-heartbeats time-based"),
    ("drop-heartbeats:rank=1:after=1:at=sync", "after='1' makes drop-heartbeats time-based"),
    ("kill:rank=1:at=rendezvous:step=2", "at=rendezvous fires before the rank joins"),
    ("kill:rank=1:at=checkpoint:collective=2", "collective='2' needs at=collective (not at=checkpoint)"),
    ("kill:rank=1:step=99999999999999999999999", "step='99999999999999999999999' is above 2**63-1"),
    ("kill:rank=\u0661:step=2", "rank='\u0661' is not an integer or 'any'"),
    ("kill:rank=-1:step=2", "rank='-1' must not be negative"),
    ("kill:rank=1:step=+2", "step='+2' is not an integer"),
], ids=["step-and-collective", "kill-seconds", "kill-ms", "coordinator-seconds", "lose-seconds", "lose-without-step",
        "pause-ms", "delay-seconds",
        "after-and-step", "after-and-at", "rendezvous-step", "collective-without-at", "huge", "non-ascii",
        "negative", "plus"])
def test_a_field_the_fault_would_ignore_is_refused(plan, says):
    with pytest.raises(ValueError) as info:
        parse_plan(plan)
    assert str(info.value).startswith(f"{plan!r}: {says}"), info.value


def test_a_delay_with_a_step_delays_that_step_alone():
    # (it delayed every step: its step= was ignored)
    inj = Injector("delay:rank=0:ms=1:step=5; delay:rank=1:ms=1")
    fired = {r: [s for s in range(10) if inj.due("step", rank=r, world_size=2, step=s)] for r in (0, 1)}
    assert fired == {0: [5], 1: list(range(10))}


@pytest.mark.parametrize("plan", [";;", " ; ", "seed=3", "seed=3;"])
def test_a_plan_that_names_no_fault_is_refused_but_the_empty_plan_is_taken(plan):
    # (a shell variable left empty inside --faults "$A;$B" would otherwise run with no fault)
    with pytest.raises(ValueError, match=rf"^{plan!r}: no fault in the plan \(no faults at all is the empty plan, ''\)$"):
        parse_plan(plan)
    assert parse_plan("") == [] and parse_plan("   ") == []
    assert len(parse_plan("kill:rank=1:step=5;")) == 1

def test_faults_alike_but_not_the_same_are_taken():
    # another step, rank, length; rank=any twice may pick two ranks
    assert len(parse_plan("kill:rank=2:step=30; kill:rank=2:step=31; kill:rank=1:step=30")) == 3
    assert len(parse_plan("pause:rank=1:step=5:seconds=2; pause:rank=1:step=5:seconds=3")) == 2
    assert len(parse_plan("kill:rank=any:step=3; kill:rank=any:step=3", world_size=4)) == 2


def test_units_of_durations():
    plan = parse_plan("drop-heartbeats:rank=3:after=500ms; drop-heartbeats:rank=2:after=10s; "
                      "drop-heartbeats:rank=1:after=0; pause:rank=1:step=5:seconds=2s; "
                      "partition:rank=0:step=1:seconds=250ms; delay:rank=0:ms=200ms; delay:rank=1:ms=30")
    assert [f.after for f in plan[:3]] == [0.5, 10.0, 0.0]
    assert plan[3].seconds == 2.0 and plan[4].seconds == 0.25
    assert plan[5].ms == 200.0 and plan[6].ms == 30.0
    with pytest.raises(ValueError, match=r"ms='2s' is not a number"):
        parse_plan("delay:rank=0:ms=2s")


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "no-pidfd"])
def test_the_pause_helper_waits_on_a_pidfd_else_sleeps_in_fixed_point(monkeypatch, pidfd):
    """With pidfds the helper waits on one of this process (its fd passed on) until the pause's
    end; without, it is ``sleep S; kill -CONT pid`` with S finite, bounded and written without
    an exponent (some ``sleep`` programs refuse ``1e-05``)."""
    started, sent = [], []
    monkeypatch.setattr(faults.subprocess, "Popen", lambda cmd, **kw: started.append((cmd, kw)))
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    if not pidfd:
        monkeypatch.delattr(faults.os, "pidfd_open")
    inj = Injector("pause:rank=0:step=1:seconds=0.00001")
    (f,) = inj.due("step", rank=0, world_size=1, step=1)
    t0 = time.monotonic()
    inj.act(f)
    (cmd, kw), = started
    if pidfd:
        assert cmd[0] == sys.executable and "pidfd_send_signal" in cmd[4], cmd
        assert len(kw["pass_fds"]) == 1 and cmd[5] == str(kw["pass_fds"][0])
        assert t0 < float(cmd[6]) < time.monotonic() + 0.00001      # the pause's end
    else:
        assert cmd[:2] == ["/bin/sh", "-c"] and cmd[2].startswith("sleep 0.000010; kill -CONT ")
    assert kw["start_new_session"] is True
    assert sent == [(faults.os.getpid(), signal.SIGSTOP)]


def test_unreached_faults_are_named_once_with_the_reason():
    plan = "kill:rank=1:step=5; kill-coordinator:step=9; kill:rank=0:at=checkpoint:step=4"
    inj = Injector(plan)
    for s in range(3):
        inj.due("step", rank=0, world_size=2, step=s)
    assert inj.unreached(rank=0, world_size=2) == [
        "fault 'kill-coordinator:step=9' was not injected: this process's last FaultTolerance step was 2",
        "fault 'kill:rank=0:at=checkpoint:step=4' was not injected: this process wrote no "
        "checkpoint of step 4 through rtxnet.checkpoint.save (0 written)",
    ]
    # a fault of no rank is named by rank 0 only; rank 1 names its own
    assert Injector(plan).unreached(rank=1, world_size=2) == [
        "fault 'kill:rank=1:step=5' was not injected: no rtxnet.FaultTolerance step ran in this "
        "process (at=step faults fire at the start of its steps; a script without it can use "
        "at=collective)"]
    assert Injector(plan, restart_count=1).unreached(rank=1, world_size=2) == []   # a replacement
    assert inj.due("step", rank=0, world_size=2, step=9)    # came due: no longer named
    assert len(inj.unreached(rank=0, world_size=2)) == 1


def test_unreached_names_a_repeated_fault_by_its_place_in_the_plan():
    # (two rank=any faults may look alike: the same fault twice is refused, see below)
    inj = Injector("kill:rank=any:step=5; kill:rank=any:step=5; delay:rank=0:ms=1")
    assert inj.due("step", rank=0, world_size=1, step=1)          # the delay fires every step
    assert inj.unreached(rank=0, world_size=1) == [
        f"fault 'kill:rank=any:step=5' (#{n} in the plan) was not injected: this process's last "
        f"FaultTolerance step was 1" for n in (1, 2)]


def test_a_bad_plan_in_the_environment_is_a_config_error_naming_it(monkeypatch):
    from rtxnet import ConfigError
    from rtxnet.faults import Injector

    monkeypatch.setenv("RTXNET_FAULTS", "zzz")
    with pytest.raises(ConfigError, match=r"RTXNET_FAULTS='zzz': 'zzz': unknown fault kind 'zzz'"):
        Injector.from_env()
    monkeypatch.setenv("RTXNET_FAULTS", "kill:rank=0:step=1")
    monkeypatch.setenv("RTXNET_RESTART_COUNT", "x")
    with pytest.raises(ConfigError, match="RTXNET_FAULTS="):
        Injector.from_env()



def test_a_sync_fault_fires_at_the_sync_before_its_step_and_is_named_when_it_never_came():
    inj = Injector("kill:rank=0:at=sync:step=6")
    assert inj.due("sync", rank=0, world_size=3, step=0) == []      # the first sync: not step 6
    assert inj.unreached(rank=0, world_size=3) == [
        "fault 'kill:rank=0:at=sync:step=6' was not injected: no rtxnet.FaultTolerance sync "
        "before step 6 ran in this process (at=sync fires in the state's sync after a "
        "membership change)"]
    (f,) = inj.due("sync", rank=0, world_size=3, step=6)
    assert f.at == "sync" and f.step == 6
    assert inj.due("sync", rank=0, world_size=3, step=6) == []      # once


_PAUSED = """
import os, signal, sys, time
from rtxnet.faults import _start_resumer
helper = _start_resumer(float(sys.argv[1]))
print(helper.pid, flush=True)
t0 = time.monotonic()
os.kill(os.getpid(), signal.SIGSTOP)
print(f"{time.monotonic() - t0:.3f}", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_pause_resumes_its_rank_after_its_seconds():
    import subprocess

    p = subprocess.run([sys.executable, "-c", _PAUSED, "0.5"], capture_output=True, text=True,
                       timeout=30, env=procs.env())
    assert p.returncode == 0, p.stderr
    paused = float(p.stdout.split()[1])
    assert 0.4 < paused < 15, paused     # (the helper that resumes it is a process: 5 s was too few on loaded cores)


@pytest.mark.timeout(60)
def test_a_pause_helper_ends_with_a_rank_killed_while_paused():
    # A fresh user's find: the `sleep; kill -CONT pid` helper of a paused rank that was killed
    # meanwhile ran on for the whole pause, then signalled whatever process had that pid
    import signal
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", _PAUSED, "60"], stdout=subprocess.PIPE, text=True,
                         env=procs.env())
    helper = -1
    try:
        helper = int(p.stdout.readline())
        deadline = time.monotonic() + 20
        while open(f"/proc/{p.pid}/stat").read().split(")")[1].split()[0] != "T":   # stopped
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert procs.alive(helper)
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        while procs.alive(helper) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not procs.alive(helper), "the resume helper outlived its rank"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if helper > 0 and procs.alive(helper):
            os.kill(helper, signal.SIGKILL)


def test_drop_heartbeats_at_a_point_fires_there_not_at_start():
    # it was made time-based (after=0) whatever its at=, so it fired at the rank's start
    (f,) = parse_plan("drop-heartbeats:rank=1:at=collective:collective=2")
    assert f.after is None and f.at == "collective"
    inj = Injector("drop-heartbeats:rank=1:at=collective:collective=2")
    assert inj.timed(rank=1, world_size=2) == []
    assert [bool(inj.due("collective", rank=1, world_size=2)) for _ in range(3)] == [False, True, False]
    (g,) = parse_plan("drop-heartbeats:rank=1")          # no point: from the start, as before
    assert g.after == 0.0


@pytest.mark.parametrize(("plan", "says"), [
    ("seed=-3;kill:rank=any:step=3", "'seed=-3': seed='-3' must not be negative"),
    ("seed=\u0661;kill:rank=any:step=3", "'seed=\u0661': seed='\u0661' is not an integer"),
    ("seed=99999999999999999999;kill:rank=any:step=3", "'seed=99999999999999999999': seed='99999999999999999999' is above 2**63-1"),
    ("kill:rank=1:step=3:seed=4", "'kill:rank=1:step=3:seed=4': seed belongs to the plan, not to a fault: give it apart "
                                  "('seed=4; kill:rank=1:step=3')"),
], ids=["negative", "non-ascii", "huge", "in-a-fault"])
def test_a_bad_seed_is_refused_naming_it(plan, says):
    # a re-verifier's finds: these were taken (the last raised TypeError from Fault())
    with pytest.raises(ValueError) as info:
        parse_plan(plan)
    assert str(info.value).startswith(says), info.value


def test_a_seed_after_a_space_picks_the_same_rank_on_every_rank():
    # a re-verifier's find: with "; seed=7" every rank's first process raised ValueError for "=7"
    picks = [[r for r in range(4) if Injector("kill:rank=any:step=30; seed=7").due("step", rank=r, world_size=4,
                                                                                  step=30)]]
    picks.append([r for r in range(4) if Injector("kill:rank=any:step=30;seed=7").due("step", rank=r, world_size=4,
                                                                                     step=30)])
    assert picks[0] == picks[1] and len(picks[0]) == 1, picks
