"""Fault-injection runner: run a training script under a fault plan and report recovery metrics.

    python tools/faultrun.py --plan "kill:rank=2:step=30" --nproc 4 [--min-ranks 3] \\
        [--max-restarts 1] [--json PATH] -- examples/train_digits.py --out out/digits

It runs ``rtxnet-run`` with ``--faults PLAN`` and ``RTXNET_METRICS_DIR`` pointing at a temporary
folder where every rank's :class:`rtxnet.FaultTolerance` appends its failure and recovery events,
shows the run's output as it comes and then prints, per failure: how long until the survivors
detected it (detection latency), how long until training ran again (time to recover) and how many
steps were redone (steps lost). A coordinator kill shows as a commit stall: training waited for the
restarted coordinator and lost nothing. From the output it also lists every rank exit the launcher
reported (with its restart), every coordinator restart, every failure no rank recovered from, every
restore from a checkpoint and every loss of committed state (``committed_state_lost``: no live rank
and no checkpoint held the job's last committed step, so training started again from an older one).

Exit code: the launcher's; when that is 0 but committed steps were lost, 1 (lost progress fails the
check even though the job finished); when that is 0 but a fault of the plan is known not to have
fired, 4 (the run did not test it: a step past the script's last, a rank killed before its turn;
a fault no rank said anything about, as with ``RTXNET_LOG_LEVEL=error``, does not count). 2 for arguments faultrun or the launcher refuses (one line
naming the value; no run, no summary). When the run takes longer than ``--timeout`` seconds it is
stopped (SIGTERM to the launcher, which stops its ranks, then SIGKILL if it is still there after
``STOP_GRACE_S``), one line says so and the exit code is 124. SIGTERM (or Ctrl-C) to faultrun stops
the run the same way, removes the temporary folder and exits 143 (130). Missing folders of
``--json`` are made before the run (one that cannot be: 2); a ``--json`` file that could not be
written at the end turns an exit code 0 into 1.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rtxnet.config import output_file, positive_seconds

ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 20.0   # the launcher gives its ranks 10 s (its --grace) after SIGTERM, then kills them
LAUNCHER_USAGE_ERROR = 2   # rtxnet-run's exit code for arguments it refused before starting anything
NOT_INJECTED = 4   # the launcher exited 0, but a fault of the plan never fired (or none was felt)
# kinds of fault that some rank must see as a failure once fired (a pause, a partition or a delay
# shorter than the timeouts, a coordinator killed and restarted, may rightly go unseen)
FELT_KINDS = ("kill", "drop-heartbeats")


class Terminated(Exception):
    """faultrun got SIGTERM (raised by the handler :func:`main` installs, so that the run is
    stopped and the temporary folder removed on the way out)."""


def read_events(folder: Path) -> list[dict]:
    events = []
    for f in sorted(folder.glob("events-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


# errors a failure causes on the ranks that did not meet it first, and how far from the cause
_ECHOES = {"CollectiveError": 1, "PeerLostError": 1, "ClosedError": 2}


def _echo_rank(e: dict) -> int:
    """0 for a failure's cause, more for its echoes on other ranks: ClosedError (the epoch the
    cause's re-form opened), CollectiveError (a peer's failure passed on) and a PeerLostError
    that lost nobody ("step N was not committed": on ft_workload a lost message read so, a
    re-verifier's find); a PeerLostError naming lost ranks is a cause."""
    if e["error"] == "PeerLostError" and (e.get("lost") or e.get("lost_launch")):
        return 0
    return _ECHOES.get(e["error"], 0)


def summarize(events: list[dict], output: str = "", plan: str | None = None,
              world_size: int | None = None) -> dict:
    """The run in numbers, from the ranks' events and (when given) the run's output.

    Returns:
        ``recoveries``: per failure (grouped by the epoch it opened), the first rank's detection
        latency (a rank frozen by ``pause`` detects its own fencing only when it wakes: the
        worst would be the pause, not the job's detection), the worst time to recover and steps
        lost over the ranks. ``stalls``: per step whose vote waited, the
        longest wait, longest first. ``joins``: per epoch that admitted ranks, who (launch ranks
        when known), at which step, and the world size then. ``lost_between_steps``: per epoch, ranks
        lost after a step committed and before the next began (no step failed). ``unrecovered``: failures a process recorded but never recovered
        from (it crashed or was killed first). Then, from ``output`` (see :func:`scan_output`):
        ``rank_exits``, ``coordinator_exits``, ``restores``, ``state_lost`` and ``below_min_ranks``;
        with ``plan``, ``faults``: per fault of the plan (see :func:`fault_status`).
    """
    recovered = [e for e in events if e["event"] == "recovered"]
    stalls = [e for e in events if e["event"] == "commit_stall"]
    out: dict = {"recoveries": [], "stalls": [], "unrecovered": []}
    by_epoch: dict[int, list[dict]] = {}
    for e in recovered:
        by_epoch.setdefault(e["epoch"], []).append(e)
    for epoch, es in sorted(by_epoch.items()):
        det = [e["detection_latency_s"] for e in es if e["detection_latency_s"] is not None]
        # what was lost, as a survivor saw it: a rank that was itself declared lost (frozen, cut
        # off) and rejoined reports losing no one, and its event may come first
        survivors = [e for e in es if not e.get("fenced")] or es
        # with nobody lost, the cause rather than its echoes: the others' ClosedError (the epoch
        # its rank's re-form opened) and CollectiveError (a peer's failure passed on) came first
        # as often as not (a lost message read "ClosedError" in a fresh user's run)
        survivors = sorted(survivors, key=_echo_rank)
        seen = next((e for e in survivors if e["lost"] or e.get("lost_launch")), survivors[0])
        out["recoveries"].append({
            "epoch": epoch,
            "error": seen["error"],
            "lost": seen["lost"],
            "losses": seen.get("losses") or [],
            "lost_launch": seen.get("lost_launch"),
            # a CollectiveTimeout's ranks: they did not contribute in time (not lost)
            "late": seen.get("late") or [],
            "late_launch": seen.get("late_launch"),
            # launch ranks that were declared lost themselves (frozen, cut off) and rejoined
            "fenced": sorted(e.get("launch_rank") for e in es if e.get("fenced")),
            "ranks_reporting": len(es),
            "detection_latency_s": min(det) if det else None,
            "time_to_recover_s": max(e["time_to_recover_s"] for e in es),
            "steps_lost": max(e["steps_lost"] for e in es),
        })
    by_step: dict[int, dict] = {}
    for e in stalls:
        if e["step"] not in by_step or e["seconds"] > by_step[e["step"]]["seconds"]:
            by_step[e["step"]] = e
    out["joins"] = _one_per_epoch(events, "joined", ("epoch", "added", "added_launch", "world_size", "step"))
    out["lost_between_steps"] = _one_per_epoch(events, "lost_between_steps",
                                               ("epoch", "step", "lost", "lost_launch", "world_size"))
    out["stalls"] = [{"step": e["step"], "seconds": e["seconds"], "time_to_recover_s": e["time_to_recover_s"]}
                     for e in sorted(by_step.values(), key=lambda e: -e["seconds"])]
    # A process's events come in order: each "failure" is closed by the next "recovered".
    open_by_pid: dict[int, dict] = {}
    for e in events:
        pid = e.get("pid")
        if e["event"] == "failure":
            open_by_pid[pid] = e
        elif e["event"] == "recovered":
            open_by_pid.pop(pid, None)
    ended = list(open_by_pid.values())
    groups: dict[tuple, list[dict]] = {}
    for e in ended:
        groups.setdefault((e.get("epoch"), e["step"], e["error"]), []).append(e)
    for (epoch, step, error), es in sorted(groups.items(), key=lambda kv: (kv[0][1], str(kv[0][2]))):
        out["unrecovered"].append({"epoch": epoch, "step": step, "error": error,
                                   "launch_ranks": sorted({e.get("launch_rank") for e in es}),
                                   "message": es[0].get("message")})
    out.update(scan_output(output))
    if plan is not None:
        out["faults"] = fault_status(plan, output, world_size)
    return out


def fault_status(plan: str, output: str, world_size: int | None = None) -> list[dict]:
    """What became of each fault of ``plan``, from the run's output. ``world_size`` (the run's
    ranks) names the rank a ``rank=any`` fault was meant for, picked from the plan's seed as the
    ranks pick it (while the world has not shrunk).

    Returns:
        One record per fault, in the plan's order: ``fault`` (its text), ``injected`` (a rank
        logged ``fault_injected`` for it), ``ranks`` (the launch ranks that injected it, or that
        said why not), ``known`` (injected, or a rank said why not, or an earlier kill of its
        rank's first process explains it: not a guess from silence) and ``reason`` (why it was not injected: the rank's own line at exit, a
        ``fault_skipped`` reason, or, when no rank said, that the rank it was meant for never
        exited normally: a process killed, by a fault or from outside, says nothing at exit).
    """
    from rtxnet.faults import label, parse_plan

    def blank() -> dict:
        return {"injected": False, "ranks": set(), "reason": None}

    faults = parse_plan(plan)
    picked = ({g.index: g.rank for g in parse_plan(plan, world_size=world_size)}
              if world_size else {})
    first = {}                               # text -> index of its first fault in the plan
    for f in faults:
        first.setdefault(f.text, f.index)

    def index_of(text: object, index: object) -> int | None:
        # lines name a fault by its text and, for one whose text is repeated, its place
        if isinstance(index, int) and 0 <= index < len(faults) and faults[index].text == text:
            return index
        return first.get(text) if isinstance(text, str) else None

    seen: dict[int, dict] = {}
    for line in output.splitlines():
        m = _RANK_PREFIX.match(line)
        if m2 := _NOT_INJECTED.search(line):
            try:
                text = ast.literal_eval(m2.group(1))
            except (ValueError, SyntaxError):
                continue
            i = index_of(text, int(m2.group(2)) - 1 if m2.group(2) else None)
            if i is None:
                continue
            rec = seen.setdefault(i, blank())
            rec["reason"] = rec["reason"] or m2.group(3).strip()
        elif "fault_injected" in line or "fault_skipped" in line:
            f = _log_fields(line)
            i = index_of(f.get("fault"), f.get("index"))
            if i is None:
                continue
            rec = seen.setdefault(i, blank())
            if "fault_injected" in line:
                rec["injected"] = True
            else:
                rec["reason"] = f"skipped: {f.get('reason')}"
        else:
            continue
        if m:
            rec["ranks"].add(int(m.group(1)))
    out = []
    for f in faults:
        rec = seen.get(f.index) or blank()
        reason = None if rec["injected"] else rec["reason"]
        known = reason is not None      # a rank said why (at its exit, or fault_skipped)
        if not rec["injected"] and reason is None:
            # faults fire only in a rank's first process: one that an earlier kill ended
            rank = picked.get(f.index, f.rank)
            killer = next((k for k in faults if k.kind == "kill" and k is not f
                           and picked.get(k.index, k.rank) == rank and rank is not None and rank >= 0
                           and seen.get(k.index, {}).get("injected")), None)
            if killer is not None:
                known = True
                reason = (f"{label(killer, faults)} killed launch rank {rank}'s first process first, and "
                          f"faults fire only in a rank's first process (a replacement runs none)")
            else:
                who = "rank 0" if f.kind == "kill-coordinator" and rank is None else (
                    "the ranks" if rank is None else "the rank picked (rank=any)" if rank == -1
                    else f"launch rank {rank}" + (" (picked by the seed: rank=any)" if f.rank == -1 else ""))
                reason = (f"no rank said why; {who} it was meant for did not exit normally (a "
                          f"process killed, by a fault or from outside, says nothing at exit)")
        out.append({"fault": f.text, "kind": f.kind, "index": f.index, "label": label(f, faults),
                    "injected": rec["injected"], "ranks": sorted(rec["ranks"]), "reason": reason,
                    "known": rec["injected"] or known})
    return out


def _one_per_epoch(events: list[dict], kind: str, keys: tuple[str, ...]) -> list[dict]:
    """One record of ``kind`` per epoch (every member of the epoch writes one), epochs in order."""
    first: dict[int, dict] = {}
    for e in events:
        if e["event"] == kind:
            first.setdefault(e["epoch"], {k: e.get(k) for k in keys})
    return [first[k] for k in sorted(first)]


# (the exception in parentheses: what the rank's error file said; see rtxnet.errorfile)
# (a restart after a pause: "; restart k/K in P s (its process lived ...)")
_RANK_EXIT = re.compile(r"\[rtxnet-run\] rank (\d+) exited with code (-?\d+)(?: \(.*?\))?"
                        r"(?:; restart (\d+)/(\d+)(?: in [\d.]+ s \(its process lived .*\))?)?\s*$")
# a paused restart that rtxnet-run did not make after all (it was stopping)
_RESTART_DROPPED = re.compile(r"\[rtxnet-run\] rank (\d+)'s restart was not made")
_COORD_EXIT = re.compile(r"\[rtxnet-run\] coordinator exited with code (-?\d+)")
_COORD_LOST = re.compile(r"\[rtxnet-run\] (could not restart the coordinator|coordinator exited .*not restarting it again)")
_BELOW_MIN = re.compile(r"\[rtxnet-run\] (ranks? [\d, ]+ failed for good .*); stopping")
_PREFIX = re.compile(r"^\[[\w-]+\] ")
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\] ")
_NOT_INJECTED = re.compile(r"rtxnet: fault ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(?: \(#(\d+) in the plan\))? "
                           r"was not injected: (.*)$")
_KV = re.compile(r"(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S+)")


def _log_fields(line: str) -> dict:
    """The fields of one structlog line, console (``key=value``) or JSON (``RTXNET_LOG_JSON``)."""
    body = _PREFIX.sub("", line, count=1).strip()
    if body.startswith("{"):
        try:
            return json.loads(body)
        except ValueError:
            pass
    fields = {}
    for key, raw in _KV.findall(body):
        try:
            fields[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            fields[key] = raw
    return fields


def scan_output(text: str) -> dict:
    """What the launcher and the ranks said about failures, from the run's output.

    Returns:
        ``rank_exits``: every non-zero exit of a rank process, in order: ``rank`` (launch rank),
        ``code``, ``restart`` (``"k/K"``, or None when none was made). ``coordinator_exits``: codes
        of the coordinator's deaths, ``coordinator_lost``: whether it could not be restarted.
        ``restores``: checkpoint restores after every live copy of the state was gone (``step``,
        ``job_committed_step``, ``steps_redone``). ``state_lost``: each ``committed_state_lost``
        (``job_committed_step``, ``best_live_step``, ``steps_lost``, ``reason``, ``ranks_reporting``).
        ``below_min_ranks``: the launcher's reason for stopping the job, when ranks failed for good
        left fewer than ``--min-ranks`` (else None).
    """
    res: dict = {"rank_exits": [], "coordinator_exits": [], "coordinator_lost": False,
                 "restores": [], "state_lost": [], "below_min_ranks": None}
    lost: dict[tuple, dict] = {}
    restores: dict[tuple, dict] = {}
    for line in text.splitlines():
        if m := _RANK_EXIT.search(line):
            rank, code, k, n = m.groups()
            res["rank_exits"].append({"rank": int(rank), "code": int(code),
                                      "restart": f"{k}/{n}" if k is not None else None})
        elif m := _RESTART_DROPPED.search(line):
            for e in reversed(res["rank_exits"]):
                if e["rank"] == int(m.group(1)):
                    e["restart"] = None
                    break
        elif m := _COORD_EXIT.search(line):
            res["coordinator_exits"].append(int(m.group(1)))
            if _COORD_LOST.search(line):     # it died once more, and was given up on
                res["coordinator_lost"] = True
        elif _COORD_LOST.search(line):
            res["coordinator_lost"] = True
        elif m := _BELOW_MIN.search(line):
            res["below_min_ranks"] = m.group(1)
        elif "committed_state_lost" in line:
            f = _log_fields(line)
            if "job_committed_step" not in f:
                continue
            job, best = int(f["job_committed_step"]), int(f.get("best_live_step", -1))
            rec = lost.setdefault((job, best), {"job_committed_step": job, "best_live_step": best,
                                                "steps_lost": job - best, "reason": f.get("reason"),
                                                "ranks_reporting": 0})
            rec["ranks_reporting"] += 1
        elif "restored_from_checkpoint" in line:
            f = _log_fields(line)
            if "step" not in f or "job_committed_step" not in f:
                continue
            step, job = int(f["step"]), int(f["job_committed_step"])
            held = int(f.get("committed_step", step - 1))   # checkpoint N holds steps 0..N-1
            restores.setdefault((step, job), {"step": step, "job_committed_step": job,
                                              "steps_redone": max(0, job - held)})
    res["state_lost"] = list(lost.values())
    res["restores"] = list(restores.values())
    return res


def _tee(stream, sink, keep: list[str]) -> None:
    for line in stream:
        keep.append(line)
        if sink is not None:
            sink.write(line)
            sink.flush()


def _stop(proc: subprocess.Popen) -> None:
    """Stop the launcher and wait for it: SIGTERM first (it forwards it to its ranks and removes
    its coordinator's journal), SIGKILL after ``STOP_GRACE_S`` (its ranks then get SIGTERM from
    the kernel, ``PR_SET_PDEATHSIG``)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_plan(plan: str, script_and_args: list[str], *, nproc: int = 4, min_ranks: int | None = None,
             max_restarts: int = 0, env: dict | None = None, timeout: float = 600,
             quiet: bool = True) -> dict:
    """Run one job under ``plan``.

    Returns:
        ``{"returncode", "events", "summary", "stdout", "stderr"}``: the launcher's exit code, the
        ranks' events, :func:`summarize` of both, and the run's output (shown as it comes unless
        ``quiet``).

    Raises:
        subprocess.TimeoutExpired: the run took longer than ``timeout`` seconds (it was stopped).

    Whatever ends the wait (the timeout, :class:`Terminated`, ``KeyboardInterrupt``), the launcher is
    stopped (:func:`_stop`) and the temporary folder removed before the exception goes on.
    """
    from rtxnet.launcher import FAULTRUN_DIR_PREFIX, _die_with_parent

    # (named after this pid: the launcher removes the folder of a faultrun killed by SIGKILL)
    with tempfile.TemporaryDirectory(prefix=f"{FAULTRUN_DIR_PREFIX}{os.getpid()}-",
                                     ignore_cleanup_errors=True) as tmp:
        e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 RTXNET_METRICS_DIR=tmp, **(env or {}))
        cmd = [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc), "--max-restarts", str(max_restarts),
               "--faults", plan]
        if min_ranks is not None:
            cmd += ["--min-ranks", str(min_ranks)]
        cmd += script_and_args
        out_lines: list[str] = []
        err_lines: list[str] = []
        # in the caller's folder: the script and its relative paths are the caller's
        # the launcher gets SIGTERM when this process dies, even by SIGKILL (it ran on with its
        # ranks to the end: a tester's find), and stops its ranks and coordinator (_die_with_parent)
        proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", preexec_fn=_die_with_parent)
        pumps = [threading.Thread(target=_tee, args=(proc.stdout, None if quiet else sys.stdout, out_lines)),
                 threading.Thread(target=_tee, args=(proc.stderr, None if quiet else sys.stderr, err_lines))]
        for t in pumps:
            t.start()
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            _stop(proc)
            raise
        finally:
            for t in pumps:
                t.join(timeout=10)
        events = read_events(Path(tmp))
    stdout, stderr = "".join(out_lines), "".join(err_lines)
    return {"returncode": proc.returncode, "events": events, "summary": summarize(events, stdout + stderr, plan, nproc),
            "stdout": stdout, "stderr": stderr}


def report(summary: dict) -> list[str]:
    """The summary as lines for people; a line starting with ``FAILED`` fails the check."""
    from rtxnet.elastic import describe_join, describe_loss_between_steps, event_ranks, name_ranks
    from rtxnet.launcher import signal_suffix

    by_epoch = []   # (epoch, line): recoveries and joins in the order they happened
    for r in summary["recoveries"]:
        if r.get("lost_launch"):
            lost = "lost " + name_ranks(r["lost_launch"], launch=True)
        elif r.get("fenced") and r["ranks_reporting"] == len(r["fenced"]):
            lost = f"{name_ranks(r['fenced'], launch=True)} declared lost (frozen or cut off), rejoined"
        elif len(r.get("losses") or []) > 1:
            # ranks are renumbered at every epoch: "[1, 1]" would read as one rank twice
            lost = "lost " + ", then ".join(
                f"rank{'s' if len(x['ranks']) > 1 else ''} {', '.join(map(str, x['ranks']))} "
                f"(numbered as of epoch {x['epoch'] - 1})" for x in r["losses"])
        else:
            lost = f"lost ranks {r['lost']}" if r["lost"] else "no rank lost"
        if r.get("late"):
            lost += f"; {event_ranks(r, 'late')} did not contribute in time"
        det = ("" if r["detection_latency_s"] is None
               else f"detected after {r['detection_latency_s'] * 1000:.0f} ms, ")
        by_epoch.append((r["epoch"], f"epoch {r['epoch']}: {r['error']} ({lost}): {det}recovered after "
                                     f"{r['time_to_recover_s'] * 1000:.0f} ms, steps lost {r['steps_lost']}"))
    by_epoch += [(j["epoch"], describe_join(j)) for j in summary.get("joins", [])]
    by_epoch += [(x["epoch"], describe_loss_between_steps(x)) for x in summary.get("lost_between_steps", [])]
    lines = [line for _, line in sorted(by_epoch, key=lambda x: x[0])]
    for s in summary["stalls"]:
        lines.append(f"a step's vote waited {s['seconds']:.2f} s at step {s['step']} (the coordinator away, "
                     f"or a peer late); no step lost")
    for u in summary["unrecovered"]:
        ranks = ", ".join(str(r) for r in u["launch_ranks"])
        lines.append(f"failure at step {u['step']} ({u['error']}) on launch rank(s) {ranks}: not recovered "
                     f"by that process (it ended first)")
    for x in summary.get("rank_exits", []):
        then = f"restarted ({x['restart']})" if x["restart"] else "not restarted"
        lines.append(f"rank {x['rank']} exited with code {x['code']}{signal_suffix(x['code'])}; {then}")
    for code in summary.get("coordinator_exits", []):
        lines.append(f"the coordinator exited with code {code}{signal_suffix(code)}")
    if summary.get("coordinator_lost"):
        lines.append("the coordinator could not be restarted, or kept dying and was given up on")
    if summary.get("below_min_ranks"):
        lines.append(f"the job could not go on: {summary['below_min_ranks']}; the launcher stopped the "
                     f"other ranks")
    for r in summary.get("restores", []):
        lines.append(f"no live rank held the last committed step {r['job_committed_step']}: restored the "
                     f"checkpoint of step {r['step']}, {r['steps_redone']} committed steps redone")
    for x in summary.get("state_lost", []):
        why = f" ({x['reason']})" if x.get("reason") else ""
        left = ("no live rank held any committed state" if x["best_live_step"] < 0
                else f"the newest state a live rank held was step {x['best_live_step']}")
        lines.append(f"FAILED: committed state lost{why}: the job had committed step {x['job_committed_step']}, "
                     f"{left}: {x['steps_lost']} committed steps lost, training started again from step "
                     f"{x['best_live_step'] + 1}")
    if not lines:
        lines.append("no failure was observed by the ranks")
    for f in summary.get("faults", []):
        if not f["injected"]:
            lines.append(f"fault {f['label']} was not injected: {f['reason']}")
    return lines


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the launcher would refuse, refused here first with faultrun's own line (the same
    ranges as ``rtxnet-run``, the plan parsed by the same :func:`rtxnet.faults.parse_plan`)."""
    from rtxnet.faults import parse_plan
    from rtxnet.launcher import MAX_NPROC

    if not 1 <= args.nproc <= MAX_NPROC:
        ap.error(f"--nproc must be in 1..{MAX_NPROC}, got {args.nproc}")
    if args.min_ranks is not None and not 1 <= args.min_ranks <= args.nproc:
        ap.error(f"--min-ranks must be in 1..nproc({args.nproc}), got {args.min_ranks}")
    if args.max_restarts < 0:
        ap.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    try:
        faults = parse_plan(args.plan)
    except ValueError as exc:
        ap.error(f"--plan: {exc}")
    if not faults:
        ap.error(f"--plan {args.plan!r} has no fault: faultrun is for running a script under faults "
                 f"(without faults, launch the script directly)")
    for f in faults:
        if f.rank is not None and f.rank >= args.nproc:
            ap.error(f"--plan: {f.text!r} names rank {f.rank}, but --nproc is {args.nproc}")
    if args.json is not None:
        # output_file leaves missing folders to the tool: made now, so that one that cannot be
        # made is refused here and not after the whole run (a fresh user's find: the run ended
        # in "could not write --json" and exit code 0)
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"argument --json: cannot write {str(args.json)!r}: its folder "
                     f"{str(args.json.parent)!r} cannot be made ({exc.strerror})")


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: the clean-up itself is bounded
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="fault plan, e.g. 'kill:rank=2:step=30' (see README)")
    ap.add_argument("--nproc", type=int, default=4,
                    help="ranks rtxnet-run starts (its --nproc), 1..1024 (default 4)")
    ap.add_argument("--min-ranks", type=int, default=None,
                    help="smallest world the job may shrink to (rtxnet-run's --min-ranks), "
                         "1..nproc (default nproc)")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="restarts of each crashed rank (rtxnet-run's --max-restarts), >= 0 "
                         "(default 0)")
    ap.add_argument("--timeout", type=positive_seconds, default=600.0,
                    help="seconds before the run is stopped, finite and > 0 (default 600)")
    ap.add_argument("--json", default=None, type=output_file, help="write events and summary here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the script to run after --")
    _check_args(ap, args)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        res = run_plan(args.plan, script, nproc=args.nproc, min_ranks=args.min_ranks,
                       max_restarts=args.max_restarts, timeout=args.timeout, quiet=False)
    except subprocess.TimeoutExpired:
        print(f"faultrun: the run exceeded {args.timeout:g} s and was stopped (SIGTERM to "
              f"rtxnet-run, SIGKILL {STOP_GRACE_S:g} s later if still running)", file=sys.stderr)
        return 124
    except Terminated:
        print("faultrun: terminated (SIGTERM); the run was stopped", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("faultrun: interrupted; the run was stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    json_failed = False
    if args.json:
        try:   # checked when parsed; a disk filled meanwhile still leaves the summary below
            Path(args.json).write_text(json.dumps(res, indent=2))
        except OSError as exc:
            print(f"faultrun: could not write --json {args.json}: {exc.strerror}", file=sys.stderr)
            json_failed = True
    out = res["stdout"] + res["stderr"]
    if (res["returncode"] == LAUNCHER_USAGE_ERROR and not res["events"]
            and not re.search(r"\[rtxnet-run\] job .*: starting", out)):
        print(f"faultrun: the launcher refused the arguments (exit code {LAUNCHER_USAGE_ERROR}, its message "
              f"above); nothing ran", file=sys.stderr)
        return LAUNCHER_USAGE_ERROR
    print(f"\nfault plan: {args.plan}")
    level = os.environ.get("RTXNET_LOG_LEVEL", "").lower()
    if level in ("error", "critical"):
        print(f"  (RTXNET_LOG_LEVEL={level} hides the ranks' fault_injected warnings: a fault that "
              f"fired reads as 'no rank said why' below)")
    lines = report(res["summary"])
    for line in lines:
        print(f"  {line}")
    lost = sum(x["steps_lost"] for x in res["summary"]["state_lost"])
    # only faults known not to have fired: with RTXNET_LOG_LEVEL above warning the ranks'
    # fault_injected lines are not written, and a fault that fired reads as "no rank said why"
    # (a re-verifier's find: exit 4 for a kill the launcher had reported)
    missed = [f["fault"] for f in res["summary"].get("faults", []) if not f["injected"] and f["known"]]
    rc = res["returncode"]
    why = f"the launcher's ({rc})"
    if lost and rc == 0:
        rc, why = 1, f"{lost} committed steps were lost, though the launcher exited 0"
    elif missed and rc == 0:
        # a check that tested nothing passes nothing (a fresh user's find: a kill planned past
        # the script's last step printed "was not injected" and exit code 0)
        rc, why = NOT_INJECTED, (f"{len(missed)} fault(s) of the plan were not injected (why: "
                                 f"above), though the launcher exited 0: the run did not test them")
    elif rc == 0 and "no failure was observed by the ranks" in lines and (unfelt := [
            f["label"] for f in res["summary"].get("faults", [])
            if f["injected"] and f.get("kind") in FELT_KINDS]):
        # a fault that fired but that no rank felt tested nothing either (a fresh user's find:
        # drop-heartbeats that fired at step 224 of 300, the run over before the heartbeat
        # timeout, passed with "no failure was observed")
        rc, why = NOT_INJECTED, (f"{', '.join(unfelt)} fired but no rank saw a failure, though the "
                                 f"launcher exited 0: the run did not test recovery (drop-heartbeats "
                                 f"takes effect after the heartbeat timeout: the script may have "
                                 f"ended first)")
    if json_failed and rc == 0:
        # a caller that reads the file must not take the run for a pass without it
        rc, why = 1, f"--json {args.json} could not be written (above), though the launcher exited 0"
    print(f"exit code {rc}: {why}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
