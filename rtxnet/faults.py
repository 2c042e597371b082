"""Fault injection: a deterministic, seeded plan of failures fired at named points of a run.

A plan is a ``;``-separated list of faults; each is a kind followed by ``:key=value`` fields::

    kill:rank=2:step=30                  SIGKILL the rank at the start of step 30
    pause:rank=1:step=50:seconds=3       SIGSTOP the rank for 3 s (a helper process sends SIGCONT)
    drop-heartbeats:rank=3:after=10s     stop heartbeats 10 s after start (for seconds=S, or for good)
    delay:rank=0:ms=200                  add 200 ms before every step of the rank (a slow rank;
                                         with step=N before step N alone)
    partition:rank=2:step=40:seconds=5   cut the rank off (no heartbeats; peer data held until the cut ends) for 5 s
    kill-coordinator:step=60             SIGKILL the coordinator at step 60 (rtxnet-run restarts it)
    lose-message:rank=1:step=20          the rank loses the next message a peer sends it, of a
                                         collective or a send (as a TCP connection reset under
                                         ZeroMQ loses what it held)
    seed=7                               seeds the choice of rank=any (default 0)

Durations are finite numbers: ``seconds`` (``S``, ``Ss`` or ``Nms``) above 0 and at most 3600,
``ms`` (``N`` or ``Nms``) above 0 and at most 3 600 000, ``after`` (seconds from the rank's start,
written like ``seconds``) in 0..3600. The hour's bound keeps a pause's resume helper, which sleeps
for the pause where pidfds are missing, from outliving a rank that died while paused by more
than that (with pidfds it ends with the rank). Each field may be
given once per fault, each fault once per plan (two ``rank=any`` faults may pick different
ranks, so they may look alike), and ``seed`` once per plan.

Where a fault fires (``at=``): ``step`` (default; at the start of step N), ``collective`` (before
the N-th collective of the rank, with ``collective=N``), ``checkpoint`` (while a checkpoint is
written, with ``step=N`` for the checkpoint of step N or the first one), ``sync`` (in
``FaultTolerance``'s sync of the state after a membership change, once the state is synced and
before the new world's ring copy of ``sharded_state``, with ``step=N`` for the sync before step N
or the first one: a second failure during a recovery), ``rendezvous`` (before the rank joins). ``rank=any`` picks one rank from the seed; a fault without ``rank`` fires on rank 0
(for ``kill-coordinator``), otherwise once, on the first rank that reaches it (each fault is
claimed once per job in the store). Faults fire only in a rank's first
process, so a restarted replacement does not fail again at the same step.

A fault of a rank's first process that never came due there (a step fault in a script without
``FaultTolerance``, a collective number the rank never reached) is named on the rank's stderr
when the process exits, with the reason: a plan that does nothing is not silent.

Every fault that fires is written to the job's key-value store (``faults/<index>``, JSON with the
kind, rank, step and ``time.monotonic()`` of the injection: one clock for all processes of a host
on Linux) just before it acts, so survivors can measure detection latency and recovery time.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from transport.errors import ConfigError, RtxError

__all__ = ["Fault", "parse_plan", "Injector"]

log = structlog.get_logger(__name__)

KINDS = ("kill", "pause", "drop-heartbeats", "delay", "partition", "kill-coordinator", "lose-message")
POINTS = ("step", "collective", "checkpoint", "sync", "rendezvous")
_INT_FIELDS = {"step", "collective", "seed"}
_FLOAT_FIELDS = {"seconds", "ms", "after"}
_MAX_INT = 2**63 - 1   # (a step or count beyond int64 could never come)
# names the file rtxnet-run keeps the running coordinator's "pid create_time" in (_running_coordinator)
COORDINATOR_PIDFILE_ENV = "RTXNET_COORDINATOR_PIDFILE"
# the fields each kind takes (beyond rank, at, step and collective, which every kind takes): a
# field a kind ignored was taken silently, and the run tested another plan than it said (a
# breaker's find: delay:...:step=5 delayed every step)
_KIND_FIELDS = {"kill": set(), "kill-coordinator": set(), "pause": {"seconds"}, "partition": {"seconds"},
                "delay": {"ms"}, "drop-heartbeats": {"after", "seconds"}, "lose-message": set()}


@dataclass(frozen=True)
class Fault:
    """One fault of a plan. ``index`` is its position in the plan (its key in the store)."""

    index: int
    kind: str
    rank: int | None = None  # None: the first rank to reach it (rank 0 for kill-coordinator)
    at: str = "step"
    step: int | None = None
    collective: int | None = None
    seconds: float | None = None
    ms: float | None = None
    after: float | None = None
    text: str = field(default="", compare=False)


MAX_FAULT_S = 3600.0   # the longest duration a fault may last (see the module docstring)


def _number(key: str, raw: str, part: str) -> float:
    """The value of a float field, in the field's unit (seconds; milliseconds for ``ms``).

    ``seconds`` and ``after`` take a plain number or one with an ``s`` or ``ms`` suffix; ``ms`` a
    plain number or one with an ``ms`` suffix.

    Raises:
        ValueError: not a number, not finite, or outside the field's range; names the value.
    """
    txt, scale = raw, 1.0
    if txt.endswith("ms"):
        txt, scale = txt[:-2], (1.0 if key == "ms" else 1e-3)
    elif txt.endswith("s") and key != "ms":
        txt = txt[:-1]
    try:
        v = float(txt) * scale
    except ValueError:
        raise ValueError(f"{part!r}: {key}={raw!r} is not a number") from None
    if key == "after":
        ok, allowed = 0 <= v <= MAX_FAULT_S, f"of seconds in 0..{MAX_FAULT_S:g}"
    elif key == "ms":
        ok, allowed = 0 < v <= MAX_FAULT_S * 1000, f"of milliseconds above 0 and at most {MAX_FAULT_S * 1000:.0f}"
    else:
        ok, allowed = 0 < v <= MAX_FAULT_S, f"of seconds above 0 and at most {MAX_FAULT_S:g}"
    if not ok:   # NaN compares false, so it lands here too
        raise ValueError(f"{part!r}: {key}={raw!r} must be a finite number {allowed}")
    return v


def _integer(key: str, raw: str, part: str, what: str) -> int:
    """The value of an integer field: ASCII digits (``int()`` took ``"١"``, an Arabic-Indic
    one), 0..2**63-1.

    Raises:
        ValueError: not such an integer; names the value."""
    if not (raw.isascii() and raw.isdigit()):
        if raw.isascii() and raw.startswith("-") and raw[1:].isdigit():
            raise ValueError(f"{part!r}: {key}={raw!r} must not be negative")
        raise ValueError(f"{part!r}: {key}={raw!r} is not {what}")
    v = int(raw)
    if v > _MAX_INT:
        raise ValueError(f"{part!r}: {key}={raw!r} is above 2**63-1")
    return v


def parse_plan(text: str, *, world_size: int | None = None) -> list[Fault]:
    """Parse a plan (grammar in the module docstring).

    Raises:
        ValueError: names the bad fault and field: an unknown kind or key, a field given twice
            (or ``seed`` twice), the same fault twice (``rank=any`` excepted: two of those may
            pick different ranks), a bad number (not a number, negative, not finite, a duration out
            of range), a missing ``step``, ``collective``, ``seconds`` or ``ms``; a text that is
            not empty but names no fault (``";;"``, a ``seed`` alone).
    """
    faults: list[Fault] = []
    seed = 0
    seed_part: str | None = None
    pending: list[tuple[str, dict[str, str]]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        if part.startswith("seed="):
            if seed_part is not None:
                raise ValueError(f"{part!r}: seed is given twice (first {seed_part!r})")
            seed_part = part
            seed = _integer("seed", part[5:], part, "an integer")
            continue
        kind, *fields_ = part.split(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"{part!r}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
        kv: dict[str, str] = {}
        for f in fields_:
            if "=" not in f:
                raise ValueError(f"{part!r}: field {f!r} is not key=value")
            k, v = f.split("=", 1)
            k = k.strip()
            if k in kv:
                raise ValueError(f"{part!r}: field {k!r} is given twice ({k}={kv[k]!r} and {k}={v.strip()!r})")
            kv[k] = v.strip()
        pending.append((part, kv | {"__kind": kind}))
    if not pending and text.strip():
        # ";;" or a seed alone: most likely a plan lost on its way (a shell variable left empty)
        raise ValueError(f"{text!r}: no fault in the plan (no faults at all is the empty plan, '')")
    rng = random.Random(seed)
    seen: dict[Fault, str] = {}   # faults already given (index and text not compared), by text
    for index, (part, kv) in enumerate(pending):
        kind = kv.pop("__kind")
        args: dict[str, Any] = {}
        for k, v in kv.items():
            if k == "rank":
                if v == "any":
                    if world_size is None:
                        args["rank"] = -1  # resolved when the world size is known
                    else:
                        args["rank"] = rng.randrange(world_size)
                    continue
                args["rank"] = _integer(k, v, part, "an integer or 'any'")
            elif k == "at":
                if v not in POINTS:
                    raise ValueError(f"{part!r}: at={v!r} is not one of {', '.join(POINTS)}")
                args["at"] = v
            elif k == "seed":
                # (a TypeError from Fault() before: a traceback)
                raise ValueError(f"{part!r}: seed belongs to the plan, not to a fault: give it "
                                 f"apart ('seed={v}; {part.replace(f':seed={v}', '')}')")
            elif k in _INT_FIELDS:
                args[k] = _integer(k, v, part, "an integer")
                if k == "collective" and args[k] == 0:   # counted from 1: the first is collective=1
                    raise ValueError(f"{part!r}: collective={v!r} must be >= 1 (the first collective is 1)")
            elif k in _FLOAT_FIELDS:
                args[k] = _number(k, v, part)
            else:
                raise ValueError(f"{part!r}: unknown field {k!r}")
        if "collective" in args and "at" not in args:
            args["at"] = "collective"
        at = args.get("at", "step")
        extra = sorted(set(args) & set(_FLOAT_FIELDS) - _KIND_FIELDS[kind])
        if extra:
            takes = sorted(_KIND_FIELDS[kind])
            raise ValueError(f"{part!r}: {kind} takes no {'/'.join(extra)} (its fields: rank, at, step, "
                             f"collective{''.join(', ' + t for t in takes)})")
        if at == "collective" and "step" in args:
            raise ValueError(f"{part!r}: step={kv['step']!r} and collective={kv.get('collective')!r} name two "
                             f"points: at=collective fires before the N-th collective of the rank, "
                             f"whatever its step; give one of them")
        if at == "rendezvous" and ("step" in args or "collective" in args):
            raise ValueError(f"{part!r}: at=rendezvous fires before the rank joins, at no step or "
                             f"collective: drop step=/collective=")
        if at != "collective" and "collective" in args:
            raise ValueError(f"{part!r}: collective={kv['collective']!r} needs at=collective (not at={at})")
        if "after" in args and ("step" in args or at != "step"):
            raise ValueError(f"{part!r}: after={kv['after']!r} makes drop-heartbeats time-based "
                             f"(seconds from the rank's start); step=/at= make it fire at a point: "
                             f"give one of them")
        if kind in ("kill", "pause", "partition", "kill-coordinator", "lose-message") and at == "step" and "step" not in args:
            raise ValueError(f"{part!r}: {kind} needs step=N (or at=collective/checkpoint/sync/rendezvous)")
        if at == "collective" and "collective" not in args:
            raise ValueError(f"{part!r}: at=collective needs collective=N")
        if kind in ("pause", "partition") and "seconds" not in args:
            raise ValueError(f"{part!r}: {kind} needs seconds=S")
        if kind == "delay" and "ms" not in args:
            raise ValueError(f"{part!r}: delay needs ms=N")
        if kind == "drop-heartbeats" and "after" not in args and "step" not in args and at == "step":
            args["after"] = 0.0
        if kind == "kill-coordinator" and "rank" not in args:
            args["rank"] = 0
        fault = Fault(index=index, kind=kind, text=part, **args)
        key = replace(fault, index=0)
        if kv.get("rank") != "any":
            if key in seen:
                raise ValueError(f"{part!r}: the same fault as {seen[key]!r}, given twice (the "
                                 f"second could never fire where the first did: give it once)")
            seen[key] = part
        faults.append(fault)
    return faults


class Injector:
    """Fires the faults of a plan for one rank process.

    Args:
        plan: the plan text (``RTXNET_FAULTS`` when created by :meth:`from_env`).
        restart_count: this rank slot's restarts; faults fire only when it is 0.
    """

    def __init__(self, plan: str, *, restart_count: int = 0, coordinator_pid: int | None = None):
        self.plan = plan
        self.faults = parse_plan(plan)
        # the plan's seed of rank=any, read once (parse_plan checked it; re-read from the text at
        # every fault check, "...; seed=7" made every rank's first process raise ValueError)
        self.seed = next((int(p[5:]) for p in map(str.strip, plan.split(";")) if p.startswith("seed=")), 0)
        self.active = restart_count == 0
        self.coordinator_pid = coordinator_pid
        self.fired: set[int] = set()
        self.reached: set[int] = set()   # faults that came due here (fired, or claimed elsewhere)
        self.collectives = 0
        self.last_step: int | None = None
        self.checkpoints: list[int | None] = []
        self.started_at = time.monotonic()
        self._seed_rng = None

    @classmethod
    def from_env(cls) -> Injector | None:
        """The injector ``RTXNET_FAULTS`` asks for (None when unset or empty).

        Raises:
            ConfigError: the plan does not parse (the message names the bad part), or
                ``RTXNET_RESTART_COUNT`` / ``RTXNET_COORDINATOR_PID`` is not an integer.
        """
        plan = os.environ.get("RTXNET_FAULTS")
        if not plan:
            return None
        try:
            pid = os.environ.get("RTXNET_COORDINATOR_PID")
            return cls(plan, restart_count=int(os.environ.get("RTXNET_RESTART_COUNT", "0")),
                       coordinator_pid=int(pid) if pid else None)
        except ValueError as exc:
            raise ConfigError(f"RTXNET_FAULTS={plan!r}: {exc}") from None

    def _mine(self, f: Fault, rank: int, world_size: int) -> bool:
        if f.rank is None:
            return True
        if f.rank == -1:
            rng = random.Random(self.seed)
            for g in self.faults:
                if g.rank == -1:
                    pick = rng.randrange(world_size)
                    if g.index == f.index:
                        return pick == rank
            return False
        return f.rank == rank

    def due(self, at: str, *, rank: int, world_size: int, step: int | None = None) -> list[Fault]:
        """Faults of point ``at`` that should fire now on ``rank`` (each fires once)."""
        if not self.active:
            return []
        if at == "collective":
            self.collectives += 1
        elif at == "step":
            self.last_step = step
        elif at == "checkpoint":
            self.checkpoints.append(step)
        out = []
        for f in self.faults:
            if f.index in self.fired or f.at != at or not self._mine(f, rank, world_size):
                continue
            if f.kind == "delay" and at == "step" and f.step is None:
                out.append(f)  # every step
                continue
            if f.kind == "drop-heartbeats" and f.after is not None:
                continue  # time-based, see timed()
            if at == "step" and f.step is not None and step != f.step:
                continue
            if at in ("checkpoint", "sync") and f.step is not None and step != f.step:
                continue
            if at == "collective" and f.collective != self.collectives:
                continue
            self.fired.add(f.index)
            out.append(f)
        self.reached.update(f.index for f in out)
        return out

    def timed(self, *, rank: int, world_size: int) -> list[Fault]:
        """Time-based faults (``drop-heartbeats:after=S``) whose time has come."""
        if not self.active:
            return []
        now = time.monotonic() - self.started_at
        out = []
        for f in self.faults:
            if (f.kind == "drop-heartbeats" and f.after is not None and f.index not in self.fired
                    and self._mine(f, rank, world_size) and now >= (f.after or 0.0)):
                self.fired.add(f.index)
                self.reached.add(f.index)
                out.append(f)
        return out

    def unreached(self, *, rank: int, world_size: int) -> list[str]:
        """One line per fault of the plan meant for launch rank ``rank`` that never came due in
        this process, with the reason (faults of no rank are reported by rank 0 only). Empty in
        a restarted process: faults fire only in a rank's first one."""
        if not self.active:
            return []
        lines = []
        for f in self.faults:
            if f.index in self.reached or (f.rank is None and rank != 0):
                continue
            if not self._mine(f, rank, world_size):
                continue
            lines.append(f"fault {label(f, self.faults)} was not injected: {self._why(f)}")
        return lines

    def _why(self, f: Fault) -> str:
        if f.kind == "drop-heartbeats" and f.after is not None:
            ran = time.monotonic() - self.started_at
            if ran < (f.after or 0.0):
                return (f"the process ended {ran:.1f} s after its fault clock started (in rtxnet.init), "
                        f"before after={f.after:g}s")
            return (f"no rtxnet.FaultTolerance step began after {f.after or 0:g} s (time-based "
                    f"faults are checked at the start of its steps)")
        if f.at == "collective":
            return (f"this process ran {self.collectives} counted collective(s), not "
                    f"{f.collective} (at=collective counts the process group's collectives; "
                    f"send/recv and subgroups' are not counted)")
        if f.at == "checkpoint":
            which = "" if f.step is None else f" of step {f.step}"
            return (f"this process wrote no checkpoint{which} through rtxnet.checkpoint.save "
                    f"({len(self.checkpoints)} written)")
        if f.at == "rendezvous":
            return "this process never reached the rendezvous"
        if f.at == "sync":
            which = "" if f.step is None else f" before step {f.step}"
            return (f"no rtxnet.FaultTolerance sync{which} ran in this process (at=sync fires in "
                    f"the state's sync after a membership change)")
        if self.last_step is None:
            return ("no rtxnet.FaultTolerance step ran in this process (at=step faults fire at "
                    "the start of its steps; a script without it can use at=collective)")
        return f"this process's last FaultTolerance step was {self.last_step}"

    @staticmethod
    def record(f: Fault, *, rank: int, step: int | None) -> dict[str, Any]:
        rec = {"index": f.index, "kind": f.kind, "rank": rank, "step": step, "fault": f.text,
               "t": time.monotonic(), "wall": time.time()}
        return rec

    def act(self, f: Fault, *, agent: Any = None, engine: Any = None) -> None:
        """Carry out ``f`` in this process (after it was recorded)."""
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "pause":
            # A separate process wakes us: a stopped process cannot.
            _start_resumer(f.seconds)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "delay":
            time.sleep((f.ms or 0) / 1000)
        elif f.kind == "drop-heartbeats":
            if agent is not None:
                agent.mute_heartbeats(f.seconds)
        elif f.kind == "partition":
            if agent is not None:
                agent.mute_heartbeats(f.seconds)
            if engine is not None and hasattr(engine, "partition"):
                engine.partition(f.seconds)
        elif f.kind == "lose-message":
            if engine is not None and hasattr(engine, "lose_next_message"):
                engine.lose_next_message()
        elif f.kind == "kill-coordinator":
            if self.coordinator_pid is None:
                log.error("fault_skipped", fault=f.text, index=f.index, reason="RTXNET_COORDINATOR_PID is not set (use rtxnet-run)")
                return
            pid = _running_coordinator(self.coordinator_pid)
            try:
                if pid is None:
                    raise ProcessLookupError
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                log.warning("fault_skipped", fault=f.text, index=f.index, reason="coordinator already gone")


def _running_coordinator(started_with: int) -> int | None:
    """The pid of rtxnet-run's coordinator now: the one its pid file names
    (``RTXNET_COORDINATOR_PIDFILE``: "pid create_time", rewritten at each restart) when a process
    of that pid and start time runs, else None (gone, or being restarted); ``started_with``
    (``RTXNET_COORDINATOR_PID``, the one of this rank's start) where no pid file is given."""
    path = os.environ.get(COORDINATOR_PIDFILE_ENV)
    if not path:
        return started_with
    import psutil

    try:
        with open(path) as fh:
            pid_text, started = fh.read().split()
        pid = int(pid_text)
        # (within 1 s: psutil adds the boot time to the start, and the boot time it reads moves
        # with the wall clock's adjustments; a process taking the pid so soon is not a concern)
        return pid if abs(psutil.Process(pid).create_time() - float(started)) < 1.0 else None
    except (OSError, ValueError, psutil.Error):
        return None


# The resume helper of a pause: waits on a pidfd of the paused rank until the pause's end (a
# CLOCK_MONOTONIC time, shared by every process of the host), then sends it SIGCONT through that
# pidfd; ends at once when the rank exits first. A pid-based `sleep; kill -CONT pid` outlived a
# rank killed while paused, then signalled whatever process had its pid by then (a fresh user's
# find: helpers left running after the run).
_RESUMER = ("import os, select, signal, sys, time\n"
            "fd, end = int(sys.argv[1]), float(sys.argv[2])\n"
            "while True:\n"
            "    left = end - time.monotonic()\n"
            "    if select.select([fd], [], [], max(0.0, left))[0]:\n"
            "        sys.exit(0)\n"          # the rank exited: nothing to resume
            "    if left <= 0:\n"
            "        break\n"
            "try:\n"
            "    signal.pidfd_send_signal(fd, signal.SIGCONT)\n"
            "except ProcessLookupError:\n"
            "    pass\n")


def _start_resumer(seconds: float) -> subprocess.Popen:
    """Start the process that sends this process SIGCONT ``seconds`` from now (or ends with it).
    Where pidfds are missing (not Linux 5.3+), a shell's ``sleep; kill -CONT``: ``seconds`` is
    finite and at most MAX_FAULT_S (parse_plan), so it ends within that time even when this rank
    dies meanwhile (fixed-point, as some sleeps take no exponent)."""
    end = time.monotonic() + seconds
    quiet = dict(start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    try:
        fd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):
        return subprocess.Popen(["/bin/sh", "-c", f"sleep {seconds:.6f}; kill -CONT {os.getpid()}"],
                                **quiet)
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", _RESUMER, str(fd), repr(end)],
                         pass_fds=(fd,), **quiet)
    finally:
        os.close(fd)


def label(f: Fault, faults: list[Fault]) -> str:
    """``f``'s text, quoted, and ``(#N in the plan)`` when another fault of ``faults`` (its plan)
    has the same text, as the at-exit lines and faultrun's summary name it."""
    if sum(g.text == f.text for g in faults) > 1:
        return f"{f.text!r} (#{f.index + 1} in the plan)"
    return repr(f.text)


def dump(rec: dict[str, Any]) -> bytes:
    return json.dumps(rec).encode()


# ------------------------------------------------------------------------------------------------
# Named fault points outside the training loop (collective, checkpoint, sync, rendezvous).

_CURRENT: list[Injector | None] = []
# Records of faults that fired where no store existed yet (``at=rendezvous``, before the join);
# :func:`store_unrecorded` writes them once the process has a group.
_UNRECORDED: list[dict[str, Any]] = []
# event loop -> the future of the fault point firing in it now (see apoint)
_FIRING: dict[Any, Any] = {}


def current() -> Injector | None:
    """This process's injector, made once from ``RTXNET_FAULTS`` (None when no plan is set)."""
    if not _CURRENT:
        inj = Injector.from_env()
        _CURRENT.append(inj)
        if inj is not None:
            atexit.register(_report_unreached, inj)
    return _CURRENT[0]


def _report_unreached(inj: Injector) -> None:
    """At exit: name the faults meant for this process that never came due (stderr)."""
    try:
        world = int(os.environ.get("RTXNET_WORLD_SIZE") or 1)
        for line in inj.unreached(rank=_launch_rank(None), world_size=world):
            print(f"rtxnet: {line}", file=sys.stderr, flush=True)
    except Exception:   # noqa: BLE001 - never turn a clean exit into a traceback
        pass


def _launch_rank(pg: Any) -> int:
    raw = os.environ.get("RTXNET_RANK")
    if raw:
        return int(raw)
    return pg.rank if pg is not None else 0


async def apoint(at: str, *, pg: Any = None, step: int | None = None) -> None:
    """Fire the faults of point ``at`` due now, from the process group's event loop.

    ``pg`` is the async :class:`rtxnet.ProcessGroup` (or None before a world exists, as during
    rendezvous). Each fault is claimed in the job's store first (``faults/<i>``, once per job).
    """
    inj = current()
    if inj is None:
        return
    if pg is not None and _UNRECORDED:   # the first point after the join (its first collective)
        try:
            await store_unrecorded(pg.store)
        except RtxError as exc:
            log.warning("fault_record_failed", error=str(exc))
    loop = asyncio.get_running_loop()
    while (busy := _FIRING.get(loop)) is not None:
        # another point of this process is firing (its record on its way to the store): wait,
        # so that nothing runs past this point before that fault acts. Before, DDP's next
        # bucket (its own task) passed its collective point meanwhile and posted its all_reduce
        # ahead of the one the fault was for: the peers saw a dtype mismatch, not a kill (a
        # breaker's find, 4 of 4 with at=collective under DDP).
        await asyncio.shield(busy)
    world = pg.world_size if pg is not None else 1
    due = inj.due(at, rank=_launch_rank(pg), world_size=world, step=step)
    if not due:
        return
    _FIRING[loop] = done = loop.create_future()
    try:
        for f in due:
            rec = inj.record(f, rank=_launch_rank(pg), step=step)
            if pg is not None:
                swapped, _ = await pg.store.compare_set(f"faults/{f.index}", None, json.dumps(rec))
                if not swapped:
                    continue
            else:
                _UNRECORDED.append(rec)
            log.warning("fault_injected", fault=f.text, index=f.index, rank=rec["rank"], at=at,
                        **({} if step is None else {"step": step}))
            inj.act(f, agent=pg.agent if pg is not None else None,
                    engine=pg.engine if pg is not None else None)
    finally:
        del _FIRING[loop]
        done.set_result(None)


async def store_unrecorded(store: Any) -> None:
    """Write the records of faults this process fired before it had a store (at rendezvous) to
    ``faults/<index>`` of ``store`` (the async group's), so reports and latency measurements find
    them. A fault that killed its process there leaves no record.

    Raises:
        RtxError: the store did not answer; the records not yet written stay for a later call.
    """
    while _UNRECORDED:
        rec = _UNRECORDED[0]
        await store.compare_set(f"faults/{rec['index']}", None, json.dumps(rec))
        _UNRECORDED.pop(0)


def point(at: str, *, pg: Any = None, step: int | None = None) -> None:
    """Blocking form of :func:`apoint`; ``pg`` is a :class:`rtxnet.BlockingProcessGroup` or None."""
    inj = current()
    if inj is None:
        return
    if pg is None:
        import asyncio

        asyncio.run(apoint(at, pg=None, step=step))
        return
    pg._portal.call(apoint, at, pg=pg.async_pg, step=step)
