"""``rtxnet-run``: start a coordinator (if none is given) and N rank processes of a script.

    rtxnet-run --nproc 4 [--coordinator ADDR] [--job ID] [--max-restarts K] script.py [args...]

Several hosts (nodes), as torchrun's ``--nnodes``/``--node-rank``: run ``rtxnet-coordinator`` on
one host, then on each of the N hosts ``rtxnet-run --nnodes N --node-rank K --nproc P
--coordinator ADDR --job ID script.py`` (the same ADDR and ID everywhere). Node K starts launch
ranks ``K*P .. K*P+P-1`` of a world of ``N*P``; each rank's data sockets listen on
``--bind-host`` (default: this host's address on the route to the coordinator).

Each rank gets the ``RTXNET_*`` variables :func:`rtxnet.init` reads, plus ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun sets them, and, as torchrun
does with more than one rank, ``OMP_NUM_THREADS=1`` unless it is set already. Every line a rank
prints is prefixed with ``[rankN]``. SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to the ranks
(as torchrun does), to each rank's process group (every rank runs in a session of its own, as
torchrun's workers do, so what it started gets them too), each followed by SIGCONT (as systemd
does) so that a rank frozen by SIGSTOP handles it instead of holding it pending; what a rank
left running in its group when it ended gets SIGTERM, then SIGKILL after ``--grace``; ranks still running ``--grace`` seconds later, or at a
second such signal, are killed (SIGKILL); the same signal again within 0.5 s is the first delivered twice (coreutils
``timeout`` signals rtxnet-run, then its process group), not a second one. A rank that
exits non-zero is restarted up to K times; the restarted process rejoins the running job (it gets
``RTXNET_REJOIN=1`` and ``RTXNET_RESTART_COUNT``). A rank whose process lived less than 10 s is
restarted after a pause, 0.1 s doubling with each such exit in a row up to 5 s (as the
coordinator's restarts below), so a script that crashes at once does not restart dozens of times
a second; one that ran longer is restarted at once. Unlike torchrun, the other ranks are left
running: the job re-forms around the loss. When the ranks that failed for good (restarts spent)
leave fewer than ``--min-ranks`` (default: all of them), the job cannot go on: the launcher says so
and stops the others at once (SIGTERM, SIGKILL after ``--grace``) instead of letting them wait out
their rejoin window (with ``--nnodes``, counting every node's: the launchers share theirs through
the job's store). A rank that exits 0 while the job still needs it counts as failed for good
here, since it will not come back: while its job's rendezvous is open (it will not join), or
during training (before ``FaultTolerance.finish()``) once the ranks left wait for the world to
grow, as the coordinator's status shows. The exit code is 0 when every rank's last process exited 0, else
the code of the first rank whose last process failed (128+N for signal N); a replacement that
failed after the job had finished (every member left in order, as the coordinator says), or a
rank declared lost that woke after it and raised ``JobFinishedError``, or a rank whose paused
restart was not made because training finished meanwhile, counts as exited 0. A rank declared
lost whose process still runs, or one that never reached ``rtxnet.init`` (stuck before it), is
killed (137) 5 s after every other rank ended once the job finished without it, unless it used
CPU in those 5 s (working, not frozen: it is left to end by itself). A
``--journal`` the coordinator cannot use (exit code 3: held by another, corrupt) exits 2.

With no ``--coordinator``, a coordinator daemon is started on a free local port
(``python -m coordinator``), with its journal in a temporary folder unless ``--journal`` is given,
restarted on that journal when it dies or stops answering (SIGSTOPped, hung: killed after a third
of the ranks' coordinator timeout), and stopped at the end. With ``--coordinator ADDR``, that coordinator must answer a ``status``
request within a few seconds before any rank starts (else exit code 1, naming ADDR). A ``--job``
that has finished on the coordinator (or in the ``--journal`` given) is refused before any rank
starts, exit code 2: a job id is not reused.

With ``--preload`` (default ``auto``: torch and rtxnet's dependencies for a script that imports
torch) each rank process is forked from a server that imported those modules once
(``rtxnet/_zygote.py``), instead of importing them itself.

Before anything starts, the arguments and what every rank would read from the environment
(``RTXNET_FAULTS``, the ``RTXNET_*`` timeouts, ``RTXNET_LAST_CALL``) are checked: each problem is
one line naming the bad value, and the exit code is 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from transport.shm import remove_segments
from transport.wire import CLAIM_STALE_S, MAX_JOB_ID, MAX_TOKEN, last_committed

from . import _zygote, errorfile
from .faults import COORDINATOR_PIDFILE_ENV

__all__ = ["main", "start_coordinator"]

MAX_NPROC = 1024
# What rtxnet-run forwards to the ranks (torchrun's set); a second one kills them at once.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# The same signal again within this many seconds is the first one delivered twice, not a second
# Ctrl-C: coreutils `timeout` signals its child, then the child's whole process group.
_SAME_SIGNAL_S = 0.5
_PROBE_S = 3.0   # how long a --coordinator has to answer before any rank starts
_FINISHED_PROBE_S = 1.0   # how long the coordinator has to say whether training finished
# A launcher's claim on its node of a job id at the coordinator (coordinator.state._claim): it
# lasts _CLAIM_TTL_S and is renewed every _CLAIM_RENEW_S while the launcher runs, and given back
# at its end; one whose launcher was killed lapses within _CLAIM_TTL_S.
_CLAIM_TTL_S = 10.0
_CLAIM_RENEW_S = 2.0
# after a job ended, how long a rank its coordinator declared lost may still run, once every
# other rank has exited, before rtxnet-run kills it (_end_fenced_leftovers)
FENCED_GRACE_S = 5.0
# how long a rank declared lost may stay so, its process running, while the others wait for the
# world to grow or it has restarts left, before rtxnet-run kills it (_watch_frozen); longer than
# a pause a rank wakes from by itself and rejoins (fault-injected pauses, a long GC)
FROZEN_GRACE_S = 10.0
# A rank that is already ending when rtxnet-run stops the job (declared lost by the coordinator:
# it closed its connection at exit) gets this long to end by itself before SIGTERM
# (_stop_ranks): the ranks release their group at exit within 5 s (AT_EXIT_RELEASE_S).
ENDING_GRACE_S = 5.0


@dataclass
class _Slot:
    rank: int
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    returncode: int | None = None
    # exited 0 while others ran: the job's committed step when the launcher first saw it gone,
    # and whether the launcher said the others trained on without it (_watch_exits_0)
    exit_step: int | None = None
    noted_mid_training: bool = False
    pumps: list = field(default_factory=list)
    moved: list = field(default_factory=lambda: [0])   # bytes its pumps read (_pump)
    last_err: list = field(default_factory=lambda: [b""])   # its last line on stderr (_pump)
    # exited 0 while the job still needed it, and will not come back (exit 0 is not restarted):
    # "before the job formed" or "during training" (see _watch_exits_0); "" otherwise
    left_early: str = ""
    # rtxnet-run sent it SIGTERM to stop the job (_stop_if_below_min_ranks): a 143 or 137 after
    # that is the launcher's doing, not a failure of its own (_outcome), unless it raised before
    stopped: bool = False
    error_path: str | None = None    # its process's RTXNET_ERROR_FILE (rtxnet.errorfile)
    error: dict | None = None        # what its last process wrote there, if it failed
    failed_at: float | None = None   # when it failed for good: its error's time, else its exit's
    started_at: float = 0.0          # when its process started (time.monotonic())
    pause: float = 0.0               # the pause before its last restart (0: none; _restart_pause)
    exited_at: float = 0.0           # when the exit that a paused restart follows was taken
    ended_at: float = 0.0            # when its process was seen to end (before its last output was read)
    # why its paused restart was not made (rtxnet-run stopping, training over): its exit, queued
    # again, then counts as final ("": not dropped)
    restart_dropped: str = ""
    # its process exited and its restart is under way (in its pause, or starting): it is neither
    # running nor ended, and counts among the ranks that can still come (_stop_if_below_min_ranks)
    restarting: bool = False

    @property
    def killed_after_stop(self) -> bool:
        """It ended as rtxnet-run's stop does (143 or 137) after that stop was sent."""
        return self.stopped and self.returncode in (143, 137)


def _proc_state(pid: int) -> str:
    """``ps``'s word for process ``pid``: "stopped" (SIGSTOP), "running", "sleeping", ..."""
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


def _preload_modules(preload: str, script: str | None) -> list[str]:
    """``--preload``'s modules: ``auto`` (see ``_zygote.auto_preload``), ``none`` or empty for
    none, else the comma-separated names."""
    if preload == "auto":
        return _zygote.auto_preload(script) if script else []
    if preload in ("", "none"):
        return []
    return [m.strip() for m in preload.split(",") if m.strip()]


def _preload_errors(preload: str, script: str | None) -> list[str]:
    """What ``--preload`` names that cannot be imported: a name that is no module name, or one
    whose top-level package is neither installed nor in ``script``'s folder (where the rank, and
    the fork server, look first); found without importing anything."""
    import importlib.machinery
    import importlib.util

    folder = [os.path.dirname(os.path.realpath(script))] if script else []
    errors = []
    for name in _preload_modules(preload, None):
        top = name.split(".")[0]
        if not all(part.isidentifier() for part in name.split(".")):
            errors.append(f"--preload: {name!r} is not a module name (give them comma-separated, "
                          f"or 'auto' or 'none')")
        else:
            try:
                found = (importlib.util.find_spec(top) is not None
                         or importlib.machinery.PathFinder.find_spec(top, folder) is not None)
            except (ImportError, ValueError) as e:   # ("__main__": its __spec__ is None)
                errors.append(f"--preload: {name!r} cannot be imported ({e})")
                continue
            if not found:
                errors.append(f"--preload: no module named {top!r} is installed or in the script's folder")
    return errors


def _is_zip(path: str) -> bool:
    """A zip application (``python -m zipapp``): run by its ``__main__.py``, not as a source file."""
    import zipfile

    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


# variables rtxnet-run sets for its ranks, from its own options (an exported one is not read;
# the first lines say so) -> the option that sets it
_OWN_VARIABLES = {"RTXNET_COORDINATOR": "--coordinator", "RTXNET_JOB": "--job",
                  "RTXNET_WORLD_SIZE": "--nproc and --nnodes", "RTXNET_MIN_RANKS": "--min-ranks",
                  "RTXNET_MAX_RANKS": "--nproc and --nnodes", "RTXNET_RANK": "--node-rank"}
# variables rtxnet-run sets differently for each rank process (kept out of the fork server's)
_PER_RANK_VARIABLES = ("RTXNET_RANK", "RANK", "LOCAL_RANK", "RTXNET_RESTART_COUNT", "RTXNET_REJOIN",
                       errorfile.ENV)
_LAST_LINE = 300   # bytes of a rank's last line on stderr kept to name a failure (_last_words)
_DRAIN_S = 2.0   # after a rank exits, how long its output is still read without progress
_DRAIN_ALONE_S = 10.0   # the same when it left no process in its group (see _watch)
_NODES_POLL_S = 1.0   # --nnodes > 1: how often the nodes' failed-for-good ranks are compared
# --nnodes > 1: how long a node whose ranks have all ended, some with exit code 0, keeps asking
# the coordinator whether the job still needed them (the others waiting for the world to grow
# show that within a second or two of the loss; a job that ends in order finishes at once)
_NODE_LAST_LOOK_S = 10.0
# A coordinator this launcher restarted that dies again within _COORD_STABLE_S of its start is
# failing (its journal cannot be written or read: exit code 3): it is restarted after a pause
# doubling from _COORD_PAUSE_S to _COORD_PAUSE_MAX_S, and no more once it has been failing for
# the ranks' coordinator_s (RTXNET_COORDINATOR_TIMEOUT, 30 s): the ranks then raise
# CoordinatorLostError, instead of one daemon after another answering them for a moment.
_COORD_STABLE_S = 10.0
# A coordinator this launcher started that lives but answers nothing (SIGSTOPped, hung) for this
# fraction of the ranks' coordinator_s, or of their request_s if less, is killed and restarted
# from its journal, well before the ranks would give up on it (30 s by default), and before a
# store request caught by the freeze runs out its deadline (10 s by default: killed after 5 s;
# killed after 10 s, the restart came as the request failed and the step was lost: a breaker's
# find).
_COORD_HUNG_FRACTION = 1 / 3
_REQUEST_HUNG_FRACTION = 1 / 2
_COORD_PAUSE_S = 0.1
_COORD_PAUSE_MAX_S = 5.0
# A rank whose process lived less than _RANK_STABLE_S is restarted after a pause doubling from
# _RANK_PAUSE_S to _RANK_PAUSE_MAX_S with each such exit in a row (a fresh user's find: a script
# that raised at once was restarted 24 times a second); one that lived longer, at once.
_RANK_STABLE_S = 10.0
_RANK_PAUSE_S = 0.1
_RANK_PAUSE_MAX_S = 5.0
_FAILED_KEY = "rtxnet-run/failed-for-good/node{}"   # in the job's store: JSON list of launch ranks
# why a paused restart was not made, when the job finished training during the pause
_FINISHED_MEANWHILE = "the job finished training during its pause"


def _restart_pause(lived: float, last: float) -> float:
    """Seconds to wait before restarting a rank whose process lived ``lived`` seconds, when the
    pause before its previous restart was ``last`` (0: none): 0 after a process that lived
    ``_RANK_STABLE_S`` or more, else ``_RANK_PAUSE_S`` doubling with each such exit in a row,
    up to ``_RANK_PAUSE_MAX_S``."""
    if lived >= _RANK_STABLE_S:
        return 0.0
    return min(2 * last, _RANK_PAUSE_MAX_S) if last else _RANK_PAUSE_S


def _die_with_parent() -> None:
    """In a child before exec: get SIGTERM when rtxnet-run dies, even by SIGKILL (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so no rank or coordinator outlives its launcher. Elsewhere a
    no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group of the rank whose process id is ``pid``: the rank and
    every process it started that did not leave its group (a DataLoader worker, a
    ``subprocess``), since each rank runs in a session of its own, as torchrun's workers do
    (``start_new_session``; torch.distributed.elastic's SubprocessHandler). Returns False when
    no process is left in that group."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_members(pgid: int) -> list[str]:
    """``"PID NAME"`` of each process of process group ``pgid`` that still runs (a zombie, dead
    and not yet reaped, is not counted). An empty group costs one ``killpg(pgid, 0)``, not a
    scan of the host's processes (a rank's exit is usually that case)."""
    if not _signal_group(pgid, 0):
        return []
    import psutil

    found = []
    for p in psutil.process_iter(["status", "name"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {p.info['name']}")
        except (OSError, psutil.Error):   # gone meanwhile
            continue
    return found


def _stop(proc, sig: int) -> None:
    """Send ``sig`` to a rank's process group, then SIGCONT (as systemd does after SIGTERM): a
    rank frozen by SIGSTOP would otherwise hold the signal pending until --grace ran out and it
    was killed, and its handler (a last checkpoint, an error file) would never run. A rank
    already gone is skipped."""
    if proc.returncode is None and _signal_group(proc.pid, sig):
        _signal_group(proc.pid, signal.SIGCONT)


# CPU seconds a rank declared lost must use during FENCED_GRACE_S to count as working
_WORKING_CPU_S = 0.25


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds process ``pid`` has used (psutil); None when it cannot be
    read (gone). A stopped process counts as using none."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
            return 0.0
        t = p.cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


def _kill(proc) -> None:
    """SIGKILL a rank's process group (the rank and what it started); a rank gone is skipped."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGKILL)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports it picks itself (an outgoing connection's, a
    ``bind`` to port 0), both ends included (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return low, high


def port_outside_ephemeral(host: str = "127.0.0.1", tries: int = 200) -> int | None:
    """A TCP port of ``host``, free now (a ``bind`` to it succeeds), drawn at random from
    10000-65535 outside the kernel's ephemeral range (:func:`_ephemeral_range`); None when that
    range leaves none, or no draw of ``tries`` was free.

    For a daemon restarted on the same address (the coordinator rtxnet-run restarts, whose
    ranks reconnect to it): a port the kernel chose is in its ephemeral range, and once the
    daemon died any process's outgoing connection or ``bind`` to port 0 could be given it before
    the restart ("Address already in use"; seen in the tests beside other suites). Outside that
    range only a process naming the port itself takes it."""
    import random
    import socket

    low, high = _ephemeral_range()
    ranges = [r for r in (range(10000, min(low, 65536)), range(max(high + 1, 10000), 65536)) if len(r)]
    if not ranges:
        return None
    rng = random.SystemRandom()
    for _ in range(tries):
        port = rng.choice(rng.choices(ranges, weights=[len(r) for r in ranges])[0])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    return None


class BindRefused(RuntimeError):
    """The coordinator exited 4: it could not bind its address (in use, or not this host's)."""


async def start_coordinator(journal: str, *, bind: str = "tcp://127.0.0.1:0",
                            extra: list[str] | None = None) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``python -m coordinator`` and return ``(process, address)`` once it listens.

    Raises:
        BindRefused: the daemon could not bind ``bind`` (exit code 4).
        JournalRefused: the daemon cannot use ``journal`` (exit code 3).
        RuntimeError: the daemon exited otherwise or did not report its address within 30 s.
    """
    with _zygote.spawning():   # (waited for here, not reaped as an orphan: _zygote.own)
        proc = _zygote.own(await asyncio.create_subprocess_exec(
            # -P: not the working folder first on sys.path, which -m puts there (a json.py in
            # the folder rtxnet-run was started from broke the daemon's imports: a fresh user's
            # find)
            sys.executable, "-P", "-m", "coordinator", "--bind", bind, "--journal", journal,
            *(extra or []), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            # a session of its own: a signal to rtxnet-run's process group (Ctrl-C in a
            # terminal, coreutils timeout) reaches rtxnet-run, which forwards it to the ranks
            # and stops the coordinator only once they ended; it stopped at once with the group
            # before, and ranks finishing on the signal (a last commit, a barrier) hung until
            # their coordinator timeout (a fresh user's find). It still dies with rtxnet-run
            # (PR_SET_PDEATHSIG).
            start_new_session=True,
            preexec_fn=_die_with_parent,
        ))
    asyncio.ensure_future(_pump(proc.stderr, b"[coordinator] ", sys.stderr))
    try:
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
    except TimeoutError:
        proc.kill()
        raise RuntimeError("the coordinator did not start within 30 s") from None
    text = line.decode().strip()
    if not text.startswith("RTXNET_COORDINATOR="):
        await proc.wait()
        if proc.returncode == 3:   # the daemon's code for a journal it cannot use
            raise JournalRefused(journal)
        if proc.returncode == 4:   # and for an address it cannot bind
            raise BindRefused(f"the coordinator could not bind {bind} (exit code 4); see its log above")
        raise RuntimeError(f"the coordinator failed to start (exit code {proc.returncode}); see its log above")
    return proc, text.split("=", 1)[1]


class RankStartError(RuntimeError):
    """A rank's process could not be started (``OSError`` from ``fork``, ``pipe``: a ``ulimit``
    reached); ``main`` says it in one line, exit code 1."""

    def __init__(self, rank: int, why: str):
        self.rank, self.why = rank, why
        super().__init__(f"rank {rank} could not be started: {why}")


class JournalRefused(RuntimeError):
    """The coordinator exited 3: the journal folder it was given is in use, corrupt or cannot be
    written (rtxnet-run exits 2 for a ``--journal`` so refused, as for any bad argument)."""

    def __init__(self, journal: str):
        self.journal = journal
        super().__init__(f"journal {journal!r}: the coordinator cannot use it (exit code 3: held "
                         f"by another coordinator, corrupt or unwritable; its log above says which)")


async def _pump(stream: asyncio.StreamReader, prefix: bytes, out, moved: list[int] | None = None,
                last: list[bytes] | None = None) -> None:
    """Copy ``stream`` to ``out`` line by line with ``prefix``; lines of any length (read in chunks,
    so a huge line never stalls the child on a full pipe). Counts the bytes read in ``moved[0]``
    when given, and keeps the last line that is not blank (its first ``_LAST_LINE`` bytes) in
    ``last[0]``."""
    pending = b""

    def keep(lines: list[bytes]) -> None:
        if last is not None:
            for line in reversed(lines):
                if line.strip():
                    last[0] = line.strip()[:_LAST_LINE]
                    return

    while True:
        chunk = await stream.read(1 << 16)
        if moved is not None:
            moved[0] += len(chunk)
        if not chunk:
            if pending:
                keep([pending])
                _write_all(out, prefix + pending + b"\n")
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > (1 << 20):  # a line over 1 MiB is written in pieces
            lines.append(pending)
            pending = b""
        if lines:
            keep(lines)
            _write_all(out, b"".join(prefix + line + b"\n" for line in lines))


def _write_all(out, data: bytes) -> None:
    """Write all of ``data`` to text stream ``out``'s binary layer and flush it. Unbuffered
    (``python -u``, ``PYTHONUNBUFFERED``) that layer is the raw file, whose ``write`` is one
    ``write(2)``: interrupted by a signal (SIGCHLD, a rank exiting) once part of a long line is in
    the pipe, it returns that part, and the rest was lost (a 200 KB line cut at 128 KiB, its next
    line gone, 1 run in 16 under load)."""
    view = memoryview(data)
    try:
        while view:
            n = out.buffer.write(view)
            if n is None:    # a non-blocking file that takes nothing now: wait until it does
                select.select([], [out.buffer], [], 1.0)
                continue
            view = view[n:]
        out.buffer.flush()
    except BrokenPipeError:
        _reader_gone(out)


def _reader_gone(out) -> None:
    """``out``'s reader has gone (``rtxnet-run ... | head``): what is written there from now on
    is dropped (``/dev/null`` on its descriptor) while the job goes on, said once on the other
    stream. Before, the task copying a rank's output died on ``BrokenPipeError``, nobody read
    that rank's pipe any more, and the rank blocked for good on its next write once the pipe
    was full: the job hung. (A training job is not ended by a closed log reader; stop it with
    Ctrl-C or SIGTERM.)"""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, out.fileno())
    finally:
        os.close(null)
    which = "standard output" if out is sys.stdout else "standard error"
    other = sys.stderr if out is sys.stdout else sys.stdout
    with contextlib.suppress(OSError, ValueError):
        print(f"[rtxnet-run] {which} was closed by its reader: what goes there is dropped from now "
              f"on; the job goes on (Ctrl-C or SIGTERM stops it)", file=other, flush=True)


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.total = args.nnodes * args.nproc       # ranks of the job, every node's
        first = args.node_rank * args.nproc
        self.slots = [_Slot(first + r) for r in range(args.nproc)]
        # the data sockets' address: loopback on one node, else routable from the other nodes
        self.bind_host = args.bind_host or (
            _route_address(args.coordinator) if args.nnodes > 1 else None)
        self.coordinator_proc: asyncio.subprocess.Process | None = None
        # why the coordinator it started kept exiting, while it did (the last line says it)
        self.coordinator_trouble = ""
        self.address = args.coordinator
        self.job = args.job or f"job-{uuid.uuid4().hex[:8]}"
        self._stop_event = asyncio.Event()   # set once stopping (see the property)
        self.training_finished = False   # the coordinator said so (see _training_finished)
        self._answered_at = -math.inf    # when the coordinator last answered a status request
        self.tmp_journal: str | None = None
        self.first_failure: tuple[float, int] | None = None
        # a rank SIGKILLed after a forwarded signal (it ignored it past --grace, or a second
        # signal came): the run's exit code is 137 then, whichever rank ended first
        self.killed_after_signal = False
        self.error_dir: str | None = None        # the ranks' error files (rtxnet.errorfile)
        self._claimed: str | None = None          # the job id this launcher claimed (_probe)
        self._bounds: tuple[int, int] | None = None  # the (min_ranks, max_ranks) it claimed for
        self._stopped_at: float | None = None    # time.time() of _stop_if_below_min_ranks
        self.stop_signal: str | None = None   # SIGINT/SIGTERM the launcher got and forwarded
        self._stop_signal_at = 0.0             # when (time.monotonic())
        # torchrun's default: N ranks each running a thread per core would oversubscribe the
        # cores (OpenMP threads spin while they wait); a value set by the user is kept
        self.omp_one = args.nproc > 1 and "OMP_NUM_THREADS" not in os.environ
        self.done = False
        self._exited: asyncio.Queue = asyncio.Queue()
        # --nnodes > 1: the other nodes' ranks that failed for good, by node (their launchers
        # write them to the job's store; see _share_failures)
        self.others_failed: dict[int, list[int]] = {}
        self._exited_0: list[_Slot] = []     # ranks that exited 0 while others still ran
        self._exits_0_watch: asyncio.Future | None = None
        self._respawns: set[asyncio.Future] = set()   # restarts waiting out their pause
        self._stops: set[asyncio.Future] = set()      # _stop_ranks of a stop under way
        # process groups of ended ranks with processes left in them: their SIGKILL (_end_leftovers)
        self._leftovers: dict[int, asyncio.TimerHandle] = {}
        # told each rank's process group, ends them if this launcher dies (rtxnet/_groupguard.py)
        self._guard: subprocess.Popen | None = None
        # --preload: the modules the rank fork server imports ([]: none, ranks start fresh)
        self.modules = _preload_modules(args.preload, args.script)
        self.fork_server: _zygote.ForkServer | None = None
        # the parent of the orphans below it (PR_SET_CHILD_SUBREAPER, with the fork server, whose
        # ranks become this process's children): their zombies are reaped by _reap_orphans
        self.subreaper = False

    def _coordinator_args(self) -> list[str]:
        # A journal this command made up: removed by this command at the end, or by the daemon
        # when it stops after this command died (SIGKILLed: the daemon gets SIGTERM); a daemon
        # stopped by someone else meanwhile keeps it, and is restarted on it.
        return (["--remove-journal-on-stop", "--journal-owner", str(os.getpid())]
                if self.tmp_journal else [])

    def _env(self, slot: _Slot) -> dict[str, str]:
        a = self.args
        env = dict(os.environ)
        env.update({
            "RTXNET_COORDINATOR": self.address,
            "RTXNET_JOB": self.job,
            "RTXNET_RANK": str(slot.rank),
            "RTXNET_WORLD_SIZE": str(self.total),
            "RTXNET_MIN_RANKS": str(a.min_ranks or self.total),
            "RTXNET_MAX_RANKS": str(self.total),
            "RTXNET_RESTART_COUNT": str(slot.restarts),
            "RTXNET_REJOIN": "1" if slot.restarts else "0",
            "RANK": str(slot.rank),
            "WORLD_SIZE": str(self.total),
            "LOCAL_RANK": str(slot.rank - a.node_rank * a.nproc),
            "LOCAL_WORLD_SIZE": str(a.nproc),
            "GROUP_RANK": str(a.node_rank),
            "PYTHONUNBUFFERED": "1",
        })
        if self.omp_one:
            env["OMP_NUM_THREADS"] = "1"
        if self.bind_host is not None:
            env["RTXNET_BIND_HOST"] = self.bind_host
        if a.faults:
            env["RTXNET_FAULTS"] = a.faults
        elif a.faults is not None:   # --faults "": no fault, whatever RTXNET_FAULTS says
            env.pop("RTXNET_FAULTS", None)
        if self.coordinator_proc is not None:
            env["RTXNET_COORDINATOR_PID"] = str(self.coordinator_proc.pid)
            if self.error_dir is not None:
                env[COORDINATOR_PIDFILE_ENV] = os.path.join(self.error_dir, COORDINATOR_PIDFILE)
        env.pop(errorfile.ENV, None)
        slot.error_path = None
        if self.error_dir is not None:
            slot.error_path = self._error_path(slot.rank, slot.restarts)
            env[errorfile.ENV] = slot.error_path
        return env

    def _error_path(self, rank: int, restarts: int) -> str | None:
        """The error file of launch rank ``rank``'s process after ``restarts`` restarts (0: its
        first, the only one faults fire in); None without an error folder."""
        return None if self.error_dir is None else os.path.join(self.error_dir, f"rank{rank}-{restarts}.json")

    async def _start_fork_server(self) -> None:
        """Start the rank fork server (``rtxnet/_zygote.py``) when ``--preload`` names modules
        (``auto``: torch and rtxnet's dependencies, for a script that imports torch), the script
        is a file and Linux gives ``pidfd_open``; its imports go on meanwhile."""
        a = self.args
        if not (self.modules and os.path.isfile(a.script) and hasattr(os, "P_PIDFD")) or _is_zip(a.script):
            return
        # (the coordinator's address, not known yet, comes with each rank's own environment)
        env = {k: v for k, v in self._env(self.slots[0]).items()
               if v is not None and k not in _PER_RANK_VARIABLES}
        try:
            _zygote.become_subreaper()
            self.subreaper = True
            self.fork_server = await _zygote.ForkServer.start(self.modules, env, a.script, _die_with_parent, _say)
        except OSError as e:
            _say(f"--preload: the rank fork server could not start ({e}); each rank starts as a "
                 f"fresh interpreter")

    async def _start_rank(self, slot: _Slot):
        """The rank's process: forked by the fork server, or else a fresh ``python -u``; None
        when rtxnet-run got its stop signal meanwhile (waiting for the server's imports: a
        rank started then would only be stopped).

        Raises:
            RankStartError: the process could not be started (no descriptors, processes or
                memory left: ``ulimit``), one line saying so; was a traceback."""
        env = self._env(slot)
        server = self.fork_server
        try:
            if server is not None:
                proc = await server.spawn([self.args.script, *self.args.script_args], env, os.getcwd())
                if proc is not None or self.stop_signal is not None:
                    return proc
            with _zygote.spawning():
                return _zygote.own(await asyncio.create_subprocess_exec(
                    sys.executable, "-u", self.args.script, *self.args.script_args, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    preexec_fn=_die_with_parent, start_new_session=True,
                ))
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
            if e.errno in (errno.EMFILE, errno.ENFILE):
                why += f" (ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
            raise RankStartError(slot.rank, why) from e

    async def _spawn(self, slot: _Slot) -> bool:
        """Start ``slot``'s process and what reads its output; False when none was started
        (rtxnet-run is stopping: see :meth:`_start_rank`).

        Raises:
            RankStartError: see :meth:`_start_rank`."""
        proc = await self._start_rank(slot)
        if proc is None:
            return False
        slot.proc = proc
        slot.started_at = time.monotonic()   # (after: not the fork server's imports)
        if self.stop_signal is not None:
            # started after the signal was forwarded (while the fork server still imported)
            _stop(slot.proc, signal.Signals[self.stop_signal])
        elif self.stopping:
            # a restart started while the job was stopped for too few ranks left
            slot.stopped = True
            _stop(slot.proc, signal.SIGTERM)
        self._tell_guard(f"+{slot.proc.pid}")
        prefix = f"[rank{slot.rank}] ".encode()
        slot.moved = [0]
        slot.last_err = [b""]
        slot.pumps = [
            asyncio.ensure_future(_pump(slot.proc.stdout, prefix, sys.stdout, slot.moved)),
            asyncio.ensure_future(_pump(slot.proc.stderr, prefix, sys.stderr, slot.moved, slot.last_err)),
        ]
        asyncio.ensure_future(self._watch(slot, slot.proc))
        return True

    async def _watch(self, slot: _Slot, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if proc is slot.proc:
            slot.ended_at = time.monotonic()
        left = self._end_leftovers(slot, proc.pid, rc)
        if not left:
            self._tell_guard(f"-{proc.pid}")
        # the rank's last lines, but not forever: a child it left behind may hold its pipes open
        # (given up once nothing came for _DRAIN_S: a long output still moving is read to its end).
        # With nothing left in its process group the pipes end once read: up to _DRAIN_ALONE_S
        # without progress is allowed then (on loaded cores this loop was seen to give up on
        # output still in the pipe after _DRAIN_S; only a process that left the group, setsid,
        # could still hold them)
        patience = _DRAIN_S if left else _DRAIN_ALONE_S
        while True:
            before = slot.moved[0]
            _, pending = await asyncio.wait(slot.pumps, timeout=patience)
            if not pending or slot.moved[0] == before:
                break
        for t in pending:
            t.cancel()
        if hasattr(proc, "close_pipes"):   # (a forked rank's: asyncio's own close with their process)
            proc.close_pipes()
        await self._exited.put((slot, proc, rc))

    def _end_leftovers(self, slot: _Slot, pgid: int, rc: int) -> bool:
        """The rank's process has ended: what it started in its process group and left running
        (a DataLoader worker, a subprocess: orphans now) gets SIGTERM and SIGCONT, and SIGKILL
        --grace seconds later (or at the launcher's end, if sooner), as torchrun's workers' groups
        do at its end; said in one line. Returns whether any was left."""
        left = _group_members(pgid)
        if not left or not _signal_group(pgid, signal.SIGTERM):
            return False
        _signal_group(pgid, signal.SIGCONT)
        _say(f"rank {slot.rank} (pid {pgid}) exited {_code(rc)} and left {len(left)} process"
             f"{'es' if len(left) > 1 else ''} running in its process group ({', '.join(left[:5])}"
             f"{', ...' if len(left) > 5 else ''}): SIGTERM, SIGKILL after {self.args.grace:g} s")
        self._leftovers[pgid] = asyncio.get_running_loop().call_later(
            self.args.grace, self._kill_leftovers, pgid)
        return True

    def _kill_leftovers(self, pgid: int) -> None:
        self._leftovers.pop(pgid, None)
        _signal_group(pgid, signal.SIGKILL)
        self._tell_guard(f"-{pgid}")

    def _tell_guard(self, line: str) -> None:
        """Tell the guard of the ranks' process groups (``rtxnet/_groupguard.py``, started on
        first use) of a rank's new process group (``+PGID``), of one that ended (``-PGID``), or
        that this launcher ends in order (``done``). A guard that is gone (killed by someone) is
        said once and not restarted: the ranks still get SIGTERM if this launcher dies."""
        if self._guard is None:
            if line == "done":
                return
            self._guard = _zygote.own(subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.join(os.path.dirname(__file__), "_groupguard.py"),
                 f"{self.args.grace:g}", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True))
        if self._guard.stdin is None or self._guard.stdin.closed:
            return
        try:
            self._guard.stdin.write(f"{line}\n".encode())
            self._guard.stdin.flush()
        except (BrokenPipeError, OSError):
            _say(f"the guard of the ranks' process groups (pid {self._guard.pid}) is gone: if "
                 f"this launcher dies, what the ranks started may outlive it")
            with contextlib.suppress(OSError):
                self._guard.stdin.close()

    def _signal(self, sig: int) -> None:
        first = not self.stopping
        now = time.monotonic()
        if self.stop_signal is not None:
            if (sig == signal.Signals[self.stop_signal]
                    and now - self._stop_signal_at < _SAME_SIGNAL_S):
                return   # one signal delivered twice (coreutils timeout: to us, then our group)
            # A second signal (a second Ctrl-C): the user will not wait out --grace.
            _say(f"second {signal.Signals(sig).name}: killing the ranks now (SIGKILL)")
            self._kill_all(said=True)
            return
        self.stopping = True   # (the property: wakes restarts waiting out their pause)
        self.stop_signal = signal.Signals(sig).name
        self._stop_signal_at = now
        if self.fork_server is not None:
            self.fork_server.cancel()   # (a spawn waiting for its imports starts nothing)
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                _stop(slot.proc, sig)
        if first:
            # Ranks get a grace period to finish in order; then they are killed.
            asyncio.get_running_loop().call_later(self.args.grace, self._kill_all)

    def _stop_if_below_min_ranks(self) -> None:
        """Stop the job when the ranks that failed for good (or exited 0 while the job still
        needed them, ``_watch_exits_0``) leave fewer than --min-ranks: the others could only
        wait out their rejoin window or rendezvous timeout (and be restarted to wait again)."""
        if self.stopping:
            return
        a = self.args
        # a rank whose process has ended while its exit waits in the queue (its last output
        # still read) is no longer running: with no restart left it has failed for good too.
        # Before, one that a fault plan killed with the others was counted as left and then
        # named "stopped by rtxnet-run" (a fresh user's find: "2 ranks left" when none was)
        # (one whose restart is under way is not: it counts among the ranks left)
        queued = [s for s in self.slots if s.proc is not None and s.returncode is None
                  and s.proc.returncode is not None and not s.restarting]
        lost = [s.rank for s in self.slots if s.returncode not in (0, None)
                or (s in queued and s.proc.returncode != 0 and s.restarts >= a.max_restarts)]
        early = [s for s in self.slots if s.left_early]
        others = sorted(r for ranks in self.others_failed.values() for r in ranks)
        left = self.total - len(lost) - len(early) - len(others)
        min_ranks = a.min_ranks or self.total
        if left >= min_ranks:
            return
        running = [s for s in self.slots if s.proc is not None and s.returncode is None
                   and s not in queued and not s.restarting]
        if not running and not any(s.restarting for s in self.slots):
            return
        # (ranks whose restart is under way are not restarted: the stop wakes their pause and
        # their restart is dropped. Before, a stop with no rank running but restarts under way
        # was not made, and the restarted ranks waited out their rendezvous timeout: 60 s more
        # in a test that ranks ending together sometimes took there, 2 runs in 6)
        why = []
        if lost:
            why.append(f"{_ranks(lost)} failed for good (--max-restarts {a.max_restarts})")
        for when in sorted({s.left_early for s in early}):
            why.append(f"{_ranks([s.rank for s in early if s.left_early == when])} exited 0 {when}")
        for node, ranks in sorted(self.others_failed.items()):
            if ranks:
                why.append(f"{_ranks(ranks)} failed for good on node {node} (its launcher said "
                           f"so through the job's store)")
        head = (f"{'; '.join(why)}: {left} rank{'' if left == 1 else 's'} left, fewer "
                f"than --min-ranks {min_ranks}")
        self.stopping = True   # (the property: wakes restarts waiting out their pause)
        self._stopped_at = time.time()
        task = asyncio.ensure_future(self._stop_ranks(running, head))
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)
        asyncio.get_running_loop().call_later(a.grace, self._kill_all)

    async def _stop_ranks(self, slots: list[_Slot], head: str) -> None:
        """Say why (``head``) and whom rtxnet-run stops, then SIGTERM (and SIGCONT) ``slots``'
        process groups, for a stop (``_stop_if_below_min_ranks``). A rank already ending by
        itself is spared: one the coordinator declared lost (its connection closed, as a process
        that returned or called ``sys.exit`` closes it at exit, before it ends) whose process is
        not frozen (SIGSTOP) gets up to ``ENDING_GRACE_S`` (at most half of --grace) to end
        first, and its own exit code stands; SIGTERM only if it still runs then (hung). Before, such a rank (``sys.exit(0)``
        mid-training) was sometimes SIGTERMed while it ended, by the stop its own leaving caused
        (the others' ``PeerLostError``), and reported as "stopped by rtxnet-run (143/137)", at
        other times as "exited 0" (a tester's find): its exit and the others' raced to the
        launcher. The coordinator declares it lost before the others fail (they fail because of
        it), so the answer does not depend on that race."""
        pids: set[int] = set()
        if any(s.proc.returncode is None for s in slots):
            _, pids = await self._fenced_pids()
        ending = [s for s in slots if s.proc.returncode is None and s.proc.pid in pids
                  and _proc_state(s.proc.pid) not in ("stopped", "tracing-stop")]
        # a rank that has exited by itself but whose exit is still queued is not named as stopped
        named = [s.rank for s in slots if s.proc.returncode is None and s not in ending]
        stopping = (f"stopping {_ranks(named)} (SIGTERM, SIGKILL after {self.args.grace:g} s)"
                    if named else "stopping the job")
        # SIGTERM to a hung one still comes well before --grace's SIGKILL
        wait_s = min(ENDING_GRACE_S, self.args.grace / 2)
        if ending:
            # (it said "(declared lost: connection closed)", which read as if the survivors had
            # failed: a fresh user's find)
            one = len(ending) == 1
            stopping += (f"; {_ranks([s.rank for s in ending])} {'is' if one else 'are'} already "
                         f"exiting ({'its connection' if one else 'their connections'} to the "
                         f"coordinator closed) and get{'s' if one else ''} up to {wait_s:g} s to "
                         f"end before SIGTERM")
        _say(f"{head}; {stopping}")
        # a rank counts as stopped by rtxnet-run (its 143 or 137 not a failure of its own) only
        # once signalled: one that ended by itself meanwhile, or is ending, keeps its exit code
        # (ranks a fault plan killed together were named "stopped by rtxnet-run": marked when
        # the stop was decided, while their exits waited in the queue; a fresh user's find)
        for s in slots:
            if s not in ending and s.proc.returncode is None:
                s.stopped = True
                _stop(s.proc, signal.SIGTERM)
        if not ending:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.gather(*(s.proc.wait() for s in ending))
        for s in ending:
            if s.proc.returncode is None:   # declared lost but alive: hung, not ending
                s.stopped = True
                _stop(s.proc, signal.SIGTERM)

    async def _share_failures(self) -> None:
        """--nnodes > 1: every ``_NODES_POLL_S``, write this node's ranks that failed for good to
        the job's store (``_FAILED_KEY``) and read the other nodes', then stop this node's ranks
        if together they leave fewer than --min-ranks (each launcher sees only its own ranks'
        exits; without this, the ranks of the nodes that lost none would wait out their
        rendezvous window). A store that does not answer (the job not formed yet, the coordinator
        restarting) is asked again at the next poll."""
        import json

        from transport.channel import ControlClient
        from transport.errors import RtxError

        a = self.args
        token = os.environ.get("RTXNET_TOKEN", "")
        client = ControlClient(self.address, f"rtxnet-run/{a.node_rank}/{os.getpid()}/{uuid.uuid4().hex[:8]}")

        async def ask(mtype: str, **fields):
            return await client.request(mtype, job=self.job, epoch=-1, deadline_s=_NODES_POLL_S * 2,
                                        token=token, **fields)

        published = None

        async def publish() -> None:
            nonlocal published
            mine = [s.rank for s in self.slots if s.returncode not in (0, None) or s.left_early]
            if mine != published:
                await ask("kv_set", key=_FAILED_KEY.format(a.node_rank), value=json.dumps(mine).encode())
                published = mine

        try:
            while True:
                await asyncio.sleep(_NODES_POLL_S)
                try:
                    await publish()
                    if self.stopping:
                        continue
                    for node in range(a.nnodes):
                        if node != a.node_rank:
                            raw = (await ask("kv_get", key=_FAILED_KEY.format(node)))["value"]
                            if raw is not None:
                                self.others_failed[node] = [int(r) for r in json.loads(raw)]
                except (RtxError, ValueError, TypeError):
                    continue
                self._stop_if_below_min_ranks()
        except asyncio.CancelledError:
            # this node's ranks have all ended: the others still need its last word
            try:
                await publish()
            except RtxError:
                pass
            raise
        finally:
            await client.aclose()

    def _kill_all(self, said: bool = False) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                if not said:
                    _say(f"rank {slot.rank} (pid {slot.proc.pid}) still running {self.args.grace:g} s "
                         "after the signal: killing it")
                _kill(slot.proc)
                self.killed_after_signal = True

    async def _probe(self, job: str | None) -> None:
        """_probe_coordinator with what this launch's ranks will ask for, then claim this node
        of ``job`` at the coordinator (kept by _keep_claim): the probe sees another launch only
        once one of its ranks has joined, the claim from that launch's start."""
        from transport.errors import RendezvousError, RtxError, RtxTimeoutError

        from .cli import _shown
        from .topology import gone_from_this_host

        a = self.args
        bounds = (a.min_ranks or self.total, self.total)
        await _probe_coordinator(self.address, job, alone=a.nnodes == 1, bounds=bounds,
                                 ranks=[s.rank for s in self.slots])
        if not job:
            return
        try:
            body = await _claim(self.address, job, a.node_rank, _CLAIM_TTL_S, bounds=bounds)
            by = body.get("by") or {}
            if not body.get("held") and not body.get("conflict") and gone_from_this_host(by):
                # its launcher was killed: taken over once it has gone unrenewed for
                # CLAIM_STALE_S (a pid gone from this /proc may still run in another PID
                # namespace of this host name, renewing)
                await asyncio.sleep(max(0.0, CLAIM_STALE_S + 0.2 - float(by.get("renewed_s") or 0)))
                body = await _claim(self.address, job, a.node_rank, _CLAIM_TTL_S, replaces=by["pid"],
                                    bounds=bounds)
                if body.get("held"):
                    _say(f"job {job!r}: took over the claim of rtxnet-run pid {by['pid']}, which is gone")
        except RtxTimeoutError:   # it answered the probe: frozen or starved since; two launches
            # that both went on unclaimed would fight for the job's places
            raise RuntimeError(f"the coordinator at {self.address} did not answer this launcher's "
                               f"claim on job {job!r} within {_PROBE_S:g} s (frozen or overloaded?); "
                               f"no rank was started") from None
        except RendezvousError as exc:   # another token than the job's (or its other nodes')
            raise JobIdTaken(f"the coordinator at {self.address} refused this launch's claim on job "
                             f"{job!r} ({exc}): RTXNET_TOKEN must be the job's on every node; no "
                             f"rank was started") from None
        except RtxError as exc:   # refused (a coordinator without claims): said, and gone on
            _say(f"could not claim job {job!r} at the coordinator ({exc}); going on without")
            return
        if not body.get("held") and body.get("conflict"):
            c = body["conflict"]
            who = ("was begun" if c.get("node") == -1 else
                   f"is being launched on node {c.get('node')} by rtxnet-run pid {c.get('pid')} on "
                   f"{_shown(str(c.get('host')))}")
            raise JobIdTaken(
                f"job {job!r} on the coordinator at {self.address} {who} for "
                f"{_bounds_text(int(c['min_ranks']), int(c['max_ranks']))}; this launch asks for "
                f"{_bounds_text(*bounds)}: every host of a job needs the same --nnodes, --nproc "
                f"and --min-ranks (or give a new --job); no rank was started")
        if not body.get("held"):
            by = body.get("by") or {}
            node = f" (node {a.node_rank})" if a.nnodes > 1 else ""
            raise JobIdTaken(
                f"job {job!r}{node} on the coordinator at {self.address} is being launched by "
                f"rtxnet-run pid {by.get('pid')} on {_shown(str(by.get('host')))}: one rtxnet-run per "
                f"job id (several hosts: --nnodes/--node-rank on each); give a new --job (a "
                f"launcher that died gives its claim up within {_CLAIM_TTL_S:g} s); no rank was started")
        self._claimed, self._bounds = job, bounds

    async def _keep_claim(self) -> None:
        """Renew this launcher's claim (see _probe) every ``_CLAIM_RENEW_S`` while it runs; a
        coordinator that does not answer (restarting) is asked again at the next renewal."""
        from transport.errors import RtxError

        from .cli import _shown

        told = False
        while True:
            await asyncio.sleep(_CLAIM_RENEW_S)
            try:
                body = await _claim(self.address, self._claimed, self.args.node_rank, _CLAIM_TTL_S,
                                    timeout_s=_CLAIM_RENEW_S, bounds=self._bounds)
            except RtxError:
                continue
            if not body.get("held") and not body.get("conflict") and not told:   # it lapsed (this launcher was frozen) and went
                by = body.get("by") or {}
                _say(f"job {self._claimed!r}: this launcher's claim lapsed and rtxnet-run pid "
                     f"{by.get('pid')} on {_shown(str(by.get('host')))} holds it now (was this "
                     f"launcher stopped for over {_CLAIM_TTL_S:g} s?); two launches of one job id "
                     f"fight for its places")
                told = True

    async def run(self) -> int:
        a = self.args
        loop = asyncio.get_running_loop()
        for sig in FORWARDED_SIGNALS:
            loop.add_signal_handler(sig, self._signal, sig)
        await self._start_fork_server()   # (its imports overlap the coordinator's start)
        if self.address:
            # (a fresh id: asks about that job only)
            await self._probe(self.job)
        else:
            journal = a.journal
            if journal is None:
                self.tmp_journal = journal = tempfile.mkdtemp(prefix=f"{JOURNAL_DIR_PREFIX}{os.getpid()}-")
            try:
                # a port outside the kernel's ephemeral range, which nothing else takes while
                # the coordinator is restarted on it (port_outside_ephemeral); drawn again if
                # taken since it was found free
                for draw in range(20):
                    port = port_outside_ephemeral()
                    try:
                        self.coordinator_proc, self.address = await start_coordinator(
                            journal, bind=f"tcp://127.0.0.1:{port or 0}", extra=self._coordinator_args())
                        break
                    except BindRefused:
                        if port is None or draw == 19:
                            raise
            except RuntimeError:
                if self.tmp_journal:
                    shutil.rmtree(self.tmp_journal, ignore_errors=True)
                raise
            if a.job and a.journal:   # a journal of earlier runs may hold the id as finished
                try:
                    await self._probe(a.job)
                except RuntimeError:
                    await self._shutdown()
                    raise
            _say(f"coordinator {self.address} (journal {journal}, pid {self.coordinator_proc.pid})")
            self._supervisor = asyncio.ensure_future(self._supervise_coordinator(journal))
            self._hang_watch = asyncio.ensure_future(self._watch_coordinator_answers())
        if a.nnodes > 1:
            _say(f"job {self.job}: node {a.node_rank} of {a.nnodes}: starting ranks "
                 f"{self.slots[0].rank}..{self.slots[-1].rank} of {self.total} of {a.script} "
                 f"(data sockets on {self.bind_host})")
        else:
            _say(f"job {self.job}: starting {a.nproc} rank{'s' if a.nproc > 1 else ''} of {a.script}")
        if self.omp_one:
            _say("OMP_NUM_THREADS=1 for each rank, as torchrun sets it (not set here); set it to "
                 "tune the threads of each rank's math libraries")
        overridden = [f"{k}={os.environ[k]!r} (use {flag})" for k, flag in _OWN_VARIABLES.items()
                      if os.environ.get(k)]
        if overridden:
            # a fresh user exported RTXNET_COORDINATOR (which rtxnet status reads) and got a
            # coordinator of rtxnet-run's own, without a word
            _say(f"not read from this environment, set for each rank by rtxnet-run: "
                 f"{'; '.join(overridden)}")
        if elsewhere := _faults_for_other_nodes(a):
            # a tester's find: such a fault never fired and nothing said so (both nodes exit 0)
            _say(f"{elsewhere}: this node runs launch ranks {a.node_rank * a.nproc}.."
                 f"{(a.node_rank + 1) * a.nproc - 1}; such a fault fires only on the node whose "
                 f"rtxnet-run is given it too")
        if short := _short_heartbeat_drops(a):
            _say(short)
        _sweep_left_behind()   # what SIGKILLed launchers left
        self.error_dir = _error_dir()
        self._note_coordinator_pid()
        sharing = asyncio.ensure_future(self._share_failures()) if a.nnodes > 1 else None
        frozen = asyncio.ensure_future(self._watch_frozen())
        orphans = asyncio.ensure_future(self._reap_orphans()) if self.subreaper else None
        claim = asyncio.ensure_future(self._keep_claim()) if self._claimed else None
        try:
            for slot in self.slots:
                if self.stopping:
                    break
                await self._spawn(slot)
            running = sum(1 for slot in self.slots if slot.proc is not None)
            while running:
                slot, proc, rc = await self._exited.get()
                gone = remove_segments(proc.pid)   # what a rank killed mid-operation left
                if gone:
                    _say(f"removed {len(gone)} shared-memory segment{'s' if len(gone) > 1 else ''} "
                         f"that rank {slot.rank} (pid {proc.pid}) left in /dev/shm")
                if proc is not slot.proc:
                    continue
                code = _code(rc)
                err = errorfile.read(slot.error_path, proc.pid) if code != 0 else None
                raised = f" ({errorfile.summary(err)})" if err else _last_words(slot, code)
                dropped, slot.restart_dropped = slot.restart_dropped, ""
                restartable = (code != 0 and not dropped and not self.stopping
                               and slot.restarts < a.max_restarts)
                # after FaultTolerance.finish() a replacement would only be turned away
                if restartable and not await self._training_finished():
                    slot.restarts += 1
                    lived = time.monotonic() - slot.started_at
                    slot.pause = _restart_pause(lived, slot.pause)
                    why = (f"; a rank that exits within {_RANK_STABLE_S:g} s of its start is "
                           f"restarted after a pause, doubling up to {_RANK_PAUSE_MAX_S:g} s"
                           if slot.pause == _RANK_PAUSE_S else "")
                    _say(f"rank {slot.rank} exited with code {code}{raised}; restart "
                         f"{slot.restarts}/{a.max_restarts}" + (
                             f" in {slot.pause:g} s (its process lived {lived:.1f} s{why})"
                             if slot.pause else ""))
                    slot.restarting = True
                    if slot.pause:
                        slot.exited_at = time.monotonic()
                        task = asyncio.ensure_future(self._respawn_after_pause(slot, proc, rc))
                        self._respawns.add(task)
                        task.add_done_callback(self._respawns.discard)
                    else:
                        await self._restart(slot, proc, rc, "rtxnet-run is stopping")
                    continue
                if dropped == _FINISHED_MEANWHILE:
                    # the replacement would only have been turned away (JobFinishedError), which
                    # counts as exited 0: so does the restart not made (before, the exit code
                    # stood, or not, by whether the survivors finished within the restart's pause)
                    _say(f"rank {slot.rank}'s restart was not made ({dropped}): it counts as exited "
                         f"0, as a replacement turned away would (its process exited {code})")
                    slot.returncode = 0
                    running -= 1
                    continue
                slot.returncode = code
                running -= 1
                # (several nodes: the others may still need this node's ranks when its last
                # one exits; _watch_exits_0 takes a last look then, see _NODE_LAST_LOOK_S)
                if code == 0 and (running or a.nnodes > 1) and not self.stopping:
                    self._exited_0.append(slot)
                    if self._exits_0_watch is None:
                        self._exits_0_watch = asyncio.ensure_future(self._watch_exits_0())
                if code != 0:
                    slot.error, slot.failed_at = err, err["time"] if err else time.time()
                    if dropped:
                        _say(f"rank {slot.rank}'s restart was not made ({dropped}); its exit code "
                             f"{code} stands")
                    else:
                        _say(f"rank {slot.rank} exited with code {code}{raised}" + (
                            f" after job {self.job} finished training or ended: not restarted (the "
                            f"job admits no new ranks); its exit code stands" if restartable else ""))
                    # a restart not made counts from its exit, before what stopped it (a SIGTERM
                    # during the pause gave exit code 143 or 1 depending on which exit the loop
                    # took first; a fresh user's find)
                    # and a failure counts from its process's end, not from when its last output
                    # was read (a child it left held its stdout for _DRAIN_S: a SIGTERM meanwhile
                    # made the rank that ignored it and was killed the first failing one, 137)
                    when = slot.exited_at if dropped else slot.ended_at
                    if self.first_failure is None or when < self.first_failure[0]:
                        self.first_failure = (when, code)
                    if not await self._training_finished():
                        # (after training, the others may still finish what runs after it: an
                        # evaluation, writing results; nobody waits for replacements any more)
                        self._stop_if_below_min_ranks()
            if a.nnodes > 1 and self._exits_0_watch is not None:
                # this node's ranks have all ended, some with 0: whether the job still needed
                # them is for the watch to tell (published by _share_failures as this node's
                # last word); before, a node whose only rank returned before rtxnet.init ended
                # with 0 and said nothing, and the other nodes waited out their rendezvous (a
                # fresh user's find)
                with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(self._exits_0_watch), _NODE_LAST_LOOK_S + 2)
            if self.stop_signal is None:
                await self._last_look_at_exits_0()
            if self.first_failure is not None and self.stop_signal is None:
                await self._forgive_failures_after_the_end()
        finally:
            for task in (sharing, frozen, orphans, claim, self._exits_0_watch, *self._respawns,
                         *self._stops):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if self._claimed:   # given back: a relaunch under this id need not wait for it to lapse
                from transport.errors import RtxError

                with contextlib.suppress(RtxError):
                    await _claim(self.address, self._claimed, a.node_rank, 0, timeout_s=1.0)
            await self._shutdown()
            if self.stop_signal is None and _checked_plan(a) and (line := _faults_no_rank_reported(
                    a, self.total, {s.rank: errorfile.reached_init(self._error_path(s.rank, 0))
                                    for s in self.slots if s.proc is not None})):
                _say(line)
            shutil.rmtree(self.error_dir, ignore_errors=True)
        if self.stop_signal is not None:
            unstarted = [s.rank for s in self.slots if s.proc is None]
            if self.first_failure is None and unstarted:
                # stopped before every rank ran: the job did not finish, whatever the others did
                self.first_failure = (time.monotonic(), 128 + signal.Signals[self.stop_signal].value)
                _say(f"stopped by {self.stop_signal} before {_ranks(unstarted)} started; exit "
                     f"code {self.first_failure[1]}")
            else:
                if (self.killed_after_signal and any(s.returncode == 137 for s in self.slots)
                        and self.first_failure is not None
                        and self.first_failure[0] >= self._stop_signal_at):
                    # a rank that ended by the signal first (143) hid one that ignored it and
                    # was killed (a fresh user's find: README promises 137 then); a rank that
                    # failed before the signal stays the first failing one (its code stands)
                    self.first_failure = (time.monotonic(), 128 + signal.SIGKILL.value)
                _say(f"stopped by {self.stop_signal}, forwarded to the ranks; exit code "
                     f"{self.first_failure[1] if self.first_failure else 0}")
        elif self.first_failure is not None:
            root, code = _root_cause(self.slots, self._stopped_at)
            if root is not None:
                self.first_failure = (self.first_failure[0], code)
            _say(_outcome(self.slots, a.max_restarts, self.first_failure[1], root, self._stopped_at,
                          self.coordinator_trouble))
        return self.first_failure[1] if self.first_failure else 0

    @property
    def stopping(self) -> bool:
        """Whether rtxnet-run is stopping the job (a signal, too few ranks left)."""
        return self._stop_event.is_set()

    @stopping.setter
    def stopping(self, value: bool) -> None:
        """Only ever set to True: a stop is not taken back."""
        if value:
            self._stop_event.set()

    async def _respawn_after_pause(self, slot: _Slot, proc, rc: int) -> None:
        """Restart ``slot`` after its pause (``slot.pause``), unless rtxnet-run stops or training
        finishes meanwhile: then its exit is queued again (``restart_dropped``), to count as
        final. A restart that cannot start its process counts the same way."""
        with contextlib.suppress(TimeoutError):
            # (not asyncio.wait_for, which on Python 3.11 may lose a cancellation that comes as
            # the event is set: this restart would then be made by a task already cancelled)
            async with asyncio.timeout(slot.pause):
                await self._stop_event.wait()
        if self.stopping:
            await self._drop_restart(slot, proc, rc, "rtxnet-run is stopping")
        elif await self._training_finished():
            await self._drop_restart(slot, proc, rc, _FINISHED_MEANWHILE)
        else:
            await self._restart(slot, proc, rc, "rtxnet-run is stopping")

    async def _restart(self, slot: _Slot, proc, rc: int, unstarted: str) -> None:
        """Start ``slot``'s next process; if none starts (rtxnet-run stopping: ``unstarted``
        says why; or its process could not be started), its last exit is queued again to count
        as final."""
        try:
            if await self._spawn(slot):
                slot.restarting = False
                return
            why = unstarted
        except RankStartError as exc:
            why = f"its process could not be started: {exc.why}"
        await self._drop_restart(slot, proc, rc, why)

    async def _drop_restart(self, slot: _Slot, proc, rc: int, why: str) -> None:
        slot.restarting = False
        slot.restarts -= 1
        slot.restart_dropped = why
        await self._exited.put((slot, proc, rc))

    async def _watch_exits_0(self) -> None:
        """Ranks that exited 0 while others ran are not restarted, so they will not come back;
        that matters while the job still needs them: its rendezvous is open (a script that
        returned before ``rtxnet.init``), or it is training and its members wait for the world
        to grow (a rank that returned mid-training, before ``FaultTolerance.finish()``: the
        others roll back and wait for a replacement). Then say so, count those ranks as failed
        for good, and stop the job when the ranks that can still come are fewer than
        --min-ranks, instead of letting the others wait out their rendezvous timeout (300 s by
        default) or rejoin window (60 s), then be restarted to wait again. Asked of the
        coordinator every second while other ranks run; ends when the job has finished or
        finished training (ranks exiting 0 then are ending in order). A rank that left a
        fault-tolerant job mid-training (``finish()`` not called) while the others trained on
        without it (a world still at --min-ranks: the job's committed step moved past the one
        seen when it was gone) is named once, without changing the exit code (when the others
        trained on for less than the launcher took to look, it cannot tell, and says nothing).
        With other nodes (--nnodes), it goes on for up to ``_NODE_LAST_LOOK_S`` after this
        node's last rank ended, and what it found is this node's last word in the job's store
        (:meth:`_share_failures`), which the other nodes' launchers read. Left alone: a
        script that never calls ``rtxnet.init`` (its job never appears), one without
        ``FaultTolerance`` (no step is committed) and one whose ranks all end after the last
        step without ``finish()`` (no step is committed after the first one left)."""
        from transport.errors import RtxError

        last_look = math.inf
        while not self.stopping:
            if not any(s.proc is not None and s.returncode is None for s in self.slots):
                # none of this node's ranks runs: with other nodes, look for a while longer (their
                # ranks may wait for these), else stop looking
                if self.args.nnodes == 1:
                    return
                last_look = min(last_look, time.monotonic() + _NODE_LAST_LOOK_S)
                if time.monotonic() > last_look:
                    return
            try:
                st = await self._job_status(_FINISHED_PROBE_S)
            except RtxError:
                st = {"jobs": [], "finished": {}}   # no answer: ask again
            job = _job_entry(st, self.job)
            if self.job in st["finished"] or job is not None and job.get("finished_training"):
                self._note_trained_on_without(_committed_step(st, self.job))
                return
            new = [s for s in self._exited_0 if not s.left_early]
            they = "they" if len(new) > 1 else "it"
            when = said = None
            if job is None or not new:
                pass                             # no rank has joined yet; nothing new
            elif job["state"] == "rendezvous":
                when, said = "before the job formed", f"before job {self.job} formed: {they} will not join"
            elif any(m.get("waiting_for") for m in job["members"]):
                when, said = "during training", (
                    f"during the training of job {self.job}, before FaultTolerance.finish(), and "
                    f"the ranks left wait for the world to grow: {they} will not come back")
            if when is not None:
                for slot in new:
                    slot.left_early = when
                _say(f"{_ranks([s.rank for s in new])} exited with code 0 {said} (a rank that "
                     f"exits 0 is not restarted)")
                self._stop_if_below_min_ranks()
            elif job is not None and job["state"] == "running":
                for slot in new:
                    if slot.exit_step is None:
                        slot.exit_step = job["committed_step"]
                self._note_trained_on_without(job["committed_step"], job["world_size"])
            if last_look < math.inf and all(s.left_early for s in self._exited_0):
                return      # (this node's last word is said: nothing more to look for)
            await asyncio.sleep(1.0)

    async def _fenced_pids(self) -> tuple[dict | None, set[int]]:
        """``(the coordinator's status answer about this job, or None without one, the pids of
        this host's processes it declared lost and which are not back)``."""
        from transport.errors import RtxError

        from .topology import host_id

        try:
            st = await self._job_status(_FINISHED_PROBE_S)
        except RtxError:
            return None, set()
        host = host_id()[:64]    # as the agents' identities carry it
        job = _job_entry(st, self.job)
        fenced = (job or {}).get("fenced") or (st.get("fenced_at_end") or {}).get(self.job) or []
        return st, {f.get("pid") for f in fenced if f.get("host") == host}

    async def _reap_orphans(self) -> None:
        """As a subreaper (the fork server's ranks are this process's children), orphans below
        it come here too (what a rank started and left running when it ended: SIGTERMed with
        its process group, then zombies): reaped every second (``_zygote.reap_orphans``)."""
        while True:
            await asyncio.sleep(1.0)
            _zygote.reap_orphans()

    async def _watch_frozen(self) -> None:
        """A rank its coordinator declared lost (heartbeats stopped: SIGSTOPped, hung, cut off)
        whose process still runs is not restarted, since it did not exit: while the others wait
        for the world to grow (below ``min_ranks``), they wait out their rejoin window (60 s) and
        fail, and with restarts left it never comes back as a replacement. Once such a rank has
        stayed lost for --lost-grace seconds (``FROZEN_GRACE_S``) while the others wait, or
        while it has restarts left,
        kill it (SIGKILL: a stopped process takes no other signal), saying why; it is then
        restarted (restarts left) or counts as failed for good, which stops the job at once when
        fewer than --min-ranks can still come. One that wakes and rejoins within the grace (a
        fault-injected pause) is left alone. Asked of the coordinator every second (the one watcher
        of fenced ranks); after training, the end is _end_fenced_leftovers'."""
        since: dict[int, float] = {}    # pid -> when first seen lost
        joined: dict[int, int] = {}     # launch rank -> pid seen in the open rendezvous
        while not self.stopping:
            await asyncio.sleep(1.0)
            alive = [s for s in self.slots if s.proc is not None and s.proc.returncode is None]
            if not alive:
                # none started yet (the fork server still importing: torch takes seconds) or all
                # in their restart pause: look again (it returned for good here, and with
                # --preload's default no frozen rank was ever killed: a fresh user's find)
                continue
            st, pids = await self._fenced_pids()
            job = _job_entry(st, self.job) if st is not None else None
            if job is None or job.get("finished_training"):
                if st is not None and (self.job in st["finished"] or job is not None):
                    # the job ended or training did: nobody waits for a replacement, but a
                    # frozen rank would keep rtxnet-run waiting once the others have ended
                    await self._end_fenced_leftovers()
                    return
                continue
            waiting = any(m.get("waiting_for") for m in job["members"])
            dropped = set()
            if job["state"] == "rendezvous" and job.get("missing_ranks") is not None:
                # a rank that joined the rendezvous, then went missing with its process running,
                # was dropped for its heartbeats (a tester's SIGSTOP during the rendezvous: the
                # others would have waited out their 300 s rendezvous timeout)
                waiting = True
                for slot in alive:
                    if slot.rank >= job["min_ranks"]:
                        continue        # missing_ranks covers the places below min_ranks
                    if slot.rank not in job["missing_ranks"]:
                        joined[slot.rank] = slot.proc.pid
                    elif joined.get(slot.rank) == slot.proc.pid:
                        dropped.add(slot.proc.pid)
            now = time.monotonic()
            since = {pid: since.get(pid, now) for pid in pids | dropped}
            for slot in alive:
                pid = slot.proc.pid
                if pid not in since or now - since[pid] < self.args.lost_grace:
                    continue
                if not waiting and slot.restarts >= self.args.max_restarts:
                    continue    # the others train on; it may still wake and rejoin by itself
                why = ("the others wait for the world to grow" if waiting else
                       "a restart can replace it")
                what = ("dropped from the rendezvous" if pid in dropped else
                        "declared lost by the coordinator")
                _say(f"rank {slot.rank} (pid {pid}) was {what} {now - since[pid]:.1f} s ago (its "
                     f"heartbeats stopped: frozen or cut off) and has not come back; {why}: "
                     f"killing it (SIGKILL)")
                _kill(slot.proc)
                since.pop(pid)

    async def _end_fenced_leftovers(self) -> None:
        """Once the job has finished or finished training: a rank its coordinator declared lost
        (heartbeats stopped: SIGSTOPped, hung, cut off) whose process still runs
        ``FENCED_GRACE_S`` after every other rank exited would keep rtxnet-run waiting forever
        (a tester's find: the others finished in 2 s, the launcher waited on). Kill it (SIGKILL:
        a stopped process takes no other signal), saying why; its exit code (137) stands, as a
        rank killed any other way. A fenced rank that is alive and hears it (one turned away at
        the end of training, one that wakes) exits by itself within the grace. So is a rank that
        never reached ``rtxnet.init`` (stuck before it: a hung data download; it made no
        ``<error file>.init``, see ``errorfile.mark_init``) while the others, at ``--min-ranks``,
        trained without it and ended (a breaker's find: rtxnet-run waited for it forever); one
        that reaches ``init`` within the grace is turned away (``JobFinishedError``) and exits by
        itself. While the job runs, or a rank that did join still runs (its own work after the
        job), nothing is killed; nor is a process that used ``_WORKING_CPU_S`` of CPU in the
        grace (working: its heartbeats starved on loaded cores; looked at again each grace).
        Asked of the coordinator every second (its ``fenced`` processes by host and pid, or the
        ones it held when the job ended); returns when no rank runs."""
        stuck_since: float | None = None
        killed: set[int] = set()        # pids killed here (reaped soon after)
        cpu_at: dict[int, float | None] = {}   # pid -> its CPU seconds when the grace began
        working_said: set[int] = set()
        while not self.stopping:
            alive = [s for s in self.slots if s.proc is not None and s.proc.returncode is None
                     and s.proc.pid not in killed]
            if not alive:
                return
            st, pids = await self._fenced_pids()
            if st is not None:
                # (a fenced rank reached init: "never joined" only of one that is not fenced)
                absent = {s.rank for s in alive if s.proc.pid not in pids
                          and not errorfile.reached_init(s.error_path)}
                if all(s.proc.pid in pids or s.rank in absent for s in alive):
                    now = time.monotonic()
                    if stuck_since is None:
                        stuck_since = now
                        cpu_at = {s.proc.pid: _cpu_seconds(s.proc.pid) for s in alive}
                    if now - stuck_since >= FENCED_GRACE_S:
                        ended = "finished" if self.job in st["finished"] else "finished training"
                        stuck_since = None
                        for s in alive:
                            if s.rank in absent and errorfile.reached_init(s.error_path):
                                continue    # it reached init just now: turned away, it ends by itself
                            used = _cpu_seconds(s.proc.pid)
                            before = cpu_at.get(s.proc.pid)
                            if used is not None and before is not None and used - before >= _WORKING_CPU_S:
                                # Declared lost, but computing (its heartbeats starved: its own
                                # work after training on loaded cores): left to end by itself.
                                # Before, a rank of 1 evaluating after finish() at load 17 was
                                # killed, its result with it (a CI run). Frozen (SIGSTOP) or hung
                                # in a wait, a process uses no CPU and is killed as before.
                                if s.proc.pid not in working_said:
                                    working_said.add(s.proc.pid)
                                    _say(f"rank {s.rank} (pid {s.proc.pid}) was declared lost by the "
                                         f"coordinator but is working ({used - before:.1f} s of CPU in "
                                         f"the last {FENCED_GRACE_S:g} s): waiting for it to end")
                                continue
                            killed.add(s.proc.pid)
                            if s.rank in absent:
                                _say(f"rank {s.rank} (pid {s.proc.pid}) never joined job {self.job} "
                                     f"(it has not reached rtxnet.init()) and still runs "
                                     f"{FENCED_GRACE_S:g} s after every other rank ended; the job "
                                     f"{ended} without it: killing it (SIGKILL)")
                            else:
                                _say(f"rank {s.rank} (pid {s.proc.pid}) was declared lost by the "
                                     f"coordinator (its heartbeats stopped: frozen or cut off; or "
                                     f"evicted, alive but late in the others' collectives) and still "
                                     f"runs {FENCED_GRACE_S:g} s after every other rank ended; job "
                                     f"{self.job} {ended} without it: killing it (SIGKILL)")
                            _kill(s.proc)
                else:
                    stuck_since = None
            await asyncio.sleep(1.0)

    async def _last_look_at_exits_0(self) -> None:
        """Once every rank ended: the others may have trained on without a rank that exited 0
        mid-training, and finished, between two looks of ``_watch_exits_0``."""
        from transport.errors import RtxError

        if any(s.exit_step is not None and not s.noted_mid_training for s in self._exited_0):
            try:
                st = await self._job_status(_FINISHED_PROBE_S)
            except RtxError:
                return
            self._note_trained_on_without(_committed_step(st, self.job))

    def _note_trained_on_without(self, committed: int | None, world: int | None = None) -> None:
        """Name the ranks that exited 0 mid-training (their ``exit_step`` seen) once the job's
        committed step ``committed`` has moved past it: the others trained on without them."""
        gone = [s for s in self._exited_0 if not s.noted_mid_training and not s.left_early
                and s.exit_step is not None and committed is not None and committed > s.exit_step]
        if not gone:
            return
        for slot in gone:
            slot.noted_mid_training = True
        them = "them" if len(gone) > 1 else "it"
        k = min(s.exit_step for s in gone)
        # the job's step when the launcher (polling every second) saw it gone, not the rank's own
        at = (f"gone by the job's committed step {k}, when rtxnet-run looked" if k >= 0 else
              "before the job committed a step")
        _say(f"{_ranks([s.rank for s in gone])} exited with code 0 during the training of job "
             f"{self.job} ({at}), before FaultTolerance.finish(): not restarted (exit 0); the "
             f"others trained on without {them}" + ("" if world is None else f", {_n(world)} now"))

    async def _training_finished(self) -> bool:
        """Whether the coordinator says this job's training is over (``FaultTolerance.finish``)
        or the job has finished; False when it does not answer within ``_FINISHED_PROBE_S`` (a
        coordinator that is down: stopped with the ranks by a Ctrl-C, being restarted) or the
        launcher is stopping. Once true, remembered."""
        from transport.errors import RtxError

        if not self.training_finished and not self.stopping:
            try:
                st = await self._job_status(_FINISHED_PROBE_S)
            except RtxError:
                return False
            job = _job_entry(st, self.job)
            self.training_finished = self.job in st["finished"] or bool(job and job.get("finished_training"))
        return self.training_finished

    async def _forgive_failures_after_the_end(self) -> None:
        """A replacement that failed (``JobFinishedError`` from its ``init``, say) after the job
        had finished, every member having left in order, does not fail the run: the job's result
        stands (the process it replaced died after its own work was done); nor does a rank
        declared lost that woke after the end and raised ``JobFinishedError``. Not a rank that was
        not restarted because training had finished: its own exit code
        stands, whatever ``--max-restarts`` (a survivor that could not produce its result exits
        non-zero too). Asked of the coordinator; without an answer nothing is forgiven."""
        from transport.errors import RtxError

        # ... and a rank whose own process was declared lost (frozen: SIGSTOP, a long GC pause)
        # and woke after the end, its guard raising JobFinishedError: the job did its steps
        late = [s for s in self.slots if s.returncode not in (0, None) and (
            s.restarts > 0 or (s.error is not None and s.error.get("type") == "JobFinishedError"))]
        if not late:
            return
        try:
            finished = self.job in (await self._job_status(_PROBE_S))["finished"]
        except RtxError:
            return
        if not finished:
            return
        for s in late:
            who = (f"rank {s.rank}'s replacement (restart {s.restarts})" if s.restarts else
                   f"rank {s.rank}, turned away by the finished job (JobFinishedError: declared "
                   f"lost and woken, or it reached rtxnet.init() after the end),")
            _say(f"{who} exited with code {s.returncode} after job {self.job} had finished (its "
                 f"last members left in order): the job's result stands; not counted as a failure")
            s.returncode = 0
        failed = [s for s in self.slots if s.returncode not in (0, None)]
        self.first_failure = (self.first_failure[0], failed[0].returncode) if failed else None

    async def _supervise_coordinator(self, journal: str) -> None:
        """Restart the coordinator this launcher started if it dies: same address, same journal,
        at once; one that keeps dying at once is restarted after growing pauses and given up on
        after the ranks' ``coordinator_s`` (see ``_COORD_STABLE_S``)."""
        from .config import Timeouts

        give_up_s = Timeouts.from_env().coordinator_s
        failing_since: float | None = None
        pause, restarts = _COORD_PAUSE_S, 0
        while True:
            started = time.monotonic()
            rc = await self.coordinator_proc.wait()
            if self.stopping or self.done:
                return
            now = time.monotonic()
            stable = failing_since is None or now - started >= _COORD_STABLE_S
            if stable:
                failing_since, pause, restarts = now, _COORD_PAUSE_S, 0   # it was up a while
            why = (f"exit code 3: its journal {journal} cannot be written or read: "
                   f"{_journal_trouble(journal)}" if _code(rc) == 3 else "its log says why")
            if _code(rc) == 3:
                # the ranks' CoordinatorLostError may follow: the last line names this cause too
                # (a fresh user's full disk ended in "answered no heartbeat for 31 s" alone)
                self.coordinator_trouble = (f"the coordinator exited {restarts + 1} time(s) in "
                                            f"{now - failing_since:.0f} s ({why})")
            if not stable and now - failing_since >= give_up_s:
                _say(f"coordinator exited with code {_code(rc)} again: {restarts} restarts in "
                     f"{now - failing_since:.0f} s did not keep it up ({why}); not restarting it "
                     f"again: the ranks stop with CoordinatorLostError within their coordinator timeout "
                     f"(RTXNET_COORDINATOR_TIMEOUT, {give_up_s:g} s)")
                return
            if not stable:
                _say(f"coordinator exited with code {_code(rc)} {now - started:.1f} s after it "
                     f"started; restarting it on {self.address} with journal {journal} in {pause:g} s")
                await asyncio.sleep(pause)
                pause = min(2 * pause, _COORD_PAUSE_MAX_S)
                if self.stopping or self.done:
                    return
            if not restarts:
                _say(f"coordinator exited with code {_code(rc)}; restarting it on {self.address} "
                     f"with journal {journal}")
            restarts += 1
            said = ""
            for attempt in range(50):
                try:
                    self.coordinator_proc, _ = await start_coordinator(
                        journal, bind=self.address, extra=self._coordinator_args())
                    break
                except RuntimeError as exc:
                    # The port may linger for a moment after a kill; or the new process died
                    # before it answered (killed again): said once per different reason.
                    if isinstance(exc, JournalRefused):   # exit code 3 at its start
                        self.coordinator_trouble = (
                            f"the coordinator could not start again on its journal {journal} "
                            f"(exit code 3: {_journal_trouble(journal)})")
                    if attempt == 49:
                        _say(f"could not restart the coordinator: {exc}")
                        return
                    if str(exc) != said:
                        said = str(exc)
                        _say(f"coordinator restart failed ({exc}); trying again")
                    await asyncio.sleep(0.1)
            self._note_coordinator_pid()
            _say(f"coordinator restarted (pid {self.coordinator_proc.pid})")

    def _note_coordinator_pid(self) -> None:
        """Write the running coordinator's pid and start time (psutil's ``create_time``) into
        ``COORDINATOR_PIDFILE`` of the error folder, replaced atomically, for the ranks'
        ``kill-coordinator`` faults (``RTXNET_COORDINATOR_PIDFILE``): ``RTXNET_COORDINATOR_PID``
        is the one of the rank's start, which a restart replaces (a re-verifier's find: the
        fault was then skipped, "coordinator already gone", and could have hit whatever process
        took the old pid)."""
        proc = self.coordinator_proc
        if self.error_dir is None or proc is None:
            return
        import psutil

        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            return      # gone already: the supervisor restarts it and comes here again
        path = os.path.join(self.error_dir, COORDINATOR_PIDFILE)
        with open(path + ".tmp", "w") as f:
            f.write(f"{proc.pid} {started!r}\n")
        os.replace(path + ".tmp", path)

    async def _job_status(self, timeout_s: float) -> dict:
        """The coordinator's status answer about this job (``cli._status``); when it answers,
        ``_answered_at`` says so for :meth:`_watch_coordinator_answers`.

        Raises:
            RtxError: no answer within ``timeout_s``.
        """
        from .cli import _status

        st = await _status(self.address, timeout_s, self.job)
        self._answered_at = time.monotonic()
        return st

    async def _watch_coordinator_answers(self) -> None:
        """Kill (SIGKILL, by its pid) the coordinator this launcher started when its process
        lives but has answered no status request for ``_COORD_HUNG_FRACTION`` of the ranks'
        ``coordinator_s`` (10 s of 30 s) or ``_REQUEST_HUNG_FRACTION`` of their ``request_s``
        (5 s of 10 s), whichever is less, and at least 2 s: SIGSTOPped, or hung. ``_supervise_coordinator`` then
        restarts it on its journal and the ranks reconnect, as after a crash, before their own
        ``coordinator_s`` ends (else they would stop with CoordinatorLostError and the whole job
        with them: a fresh user's trial). It asks only when the launcher's other status requests
        (:meth:`_job_status`) got no answer lately. A process is watched only once it has
        answered since it started, so a restart still replaying its journal is left to finish."""
        from transport.errors import RtxError

        from .config import Timeouts

        timeouts = Timeouts.from_env()
        coordinator_s = timeouts.coordinator_s
        hung_s = max(2.0, min(coordinator_s * _COORD_HUNG_FRACTION,
                              timeouts.request_s * _REQUEST_HUNG_FRACTION))
        ask_s = min(1.0, hung_s / 2)
        proc, since = None, math.inf
        while not (self.stopping or self.done):
            if self.coordinator_proc is not proc:
                proc, since = self.coordinator_proc, time.monotonic()   # a new process
            if proc.returncode is None:
                if self._answered_at < time.monotonic() - ask_s:   # nobody heard from it lately
                    with contextlib.suppress(RtxError):
                        await self._job_status(ask_s)
                silent = time.monotonic() - self._answered_at
                if (self._answered_at >= since and silent >= hung_s and proc is self.coordinator_proc
                        and proc.returncode is None and not (self.stopping or self.done)):
                    _say(f"coordinator (pid {proc.pid}, {_proc_state(proc.pid)}) has answered "
                         f"nothing for {silent:.1f} s; killing it to restart it from its "
                         f"journal before the ranks give up on it (their coordinator timeout, "
                         f"RTXNET_COORDINATOR_TIMEOUT, {coordinator_s:g} s)")
                    proc.kill()
                    since = math.inf   # watched again once its successor answers
                    continue
            await asyncio.sleep(ask_s)

    async def _shutdown(self) -> None:
        self.done = True
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                _kill(slot.proc)
                await slot.proc.wait()
            if slot.proc is not None:
                remove_segments(slot.proc.pid)
        for pgid, timer in list(self._leftovers.items()):
            timer.cancel()
            self._kill_leftovers(pgid)
        if self.coordinator_proc is not None and self.coordinator_proc.returncode is None:
            self.coordinator_proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.coordinator_proc.wait()
            except TimeoutError:
                self.coordinator_proc.kill()
                await self.coordinator_proc.wait()
        if self.fork_server is not None:
            await self.fork_server.close()
        if self.tmp_journal:
            shutil.rmtree(self.tmp_journal, ignore_errors=True)
        if self._guard is not None:
            self._tell_guard("done")
            with contextlib.suppress(OSError):
                self._guard.stdin.close()   # it ends by itself on reading "done" (not waited for)


class JobIdTaken(RuntimeError):
    """``--job`` names a job that has finished on the coordinator, or that another launch runs
    or forms (exit code 2)."""


async def _claim(address: str, job: str, node: int, ttl_s: float, timeout_s: float = _PROBE_S,
                 replaces: int | None = None, bounds: tuple[int, int] | None = None) -> dict:
    """Ask the coordinator at ``address`` for node ``node`` of job id ``job`` for ``ttl_s``
    seconds (0: give it back; ``replaces``: the pid of a launcher of this host, gone, whose claim
    to take over; ``bounds``: the (min_ranks, max_ranks) this launch's ranks ask for); its
    answer, ``{"held": bool[, "by": {"host", "pid", "left_s"}][, "conflict": {"node", "host",
    "pid", "min_ranks", "max_ranks"}]}``.

    Raises:
        RtxError: no answer within ``timeout_s``, or a refusal.
    """
    from .cli import _ask
    from .topology import host_id

    extra: dict[str, int] = {} if replaces is None else {"replaces": replaces}
    if bounds is not None:
        extra.update(min_ranks=bounds[0], max_ranks=bounds[1])
    return await _ask(address, "claim", timeout_s, job, node=node, host=host_id(), pid=os.getpid(),
                      ttl_s=ttl_s, token=os.environ.get("RTXNET_TOKEN", ""), **extra)


async def _probe_coordinator(address: str, job: str | None, *, alone: bool = True,
                             bounds: tuple[int, int] | None = None, ranks: list[int] | None = None) -> None:
    """Ask the coordinator at ``address`` for its status, as ``rtxnet status`` does, and whether
    ``job`` (when given) has finished there: a finished job id is never reused (its ranks would
    be told the job is over and exit 0 with nothing trained). ``alone`` (one launcher for the
    job, not ``--nnodes``): a job that has live members or joiners is another launch's, and
    starting ranks into it would fight them (a fresh user's find: a second launch's ranks died
    of JobFullError, or took places in the first's rendezvous and both jobs failed).

    ``bounds`` (``(min_ranks, max_ranks)`` this launch's ranks ask for) and ``ranks`` (its
    launch ranks): a job the coordinator holds with other bounds (another host's ``--nproc``,
    ``--nnodes`` or ``--min-ranks`` differ, or the id of a crashed job of another size) would
    refuse every rank, one traceback each; one that forms with this launch's ranks already
    joined has them from another launch (the same ``--node-rank`` twice).

    Raises:
        RuntimeError: no answer within ``_PROBE_S`` (or another transport error), or ``job`` has
            finished, or (``alone``) it runs or forms, or it was begun with other bounds, or
            others hold this launch's ranks in its rendezvous; one line that names ``address``.
    """
    from transport.errors import RtxError, RtxTimeoutError

    from .cli import _status

    try:
        status = await _status(address, _PROBE_S, job or "")
    except RtxTimeoutError:
        from transport.channel import nobody_there

        why = await asyncio.to_thread(nobody_there, address)   # refused, unknown host, ...
        raise RuntimeError(f"the coordinator at {address} did not answer within {_PROBE_S:g} s"
                           + (f": {why}" if why else " (is it running, not stopped, and is --coordinator right?)")
                           + "; no rank was started") from None
    except RtxError as exc:
        raise RuntimeError(f"the coordinator at {address} did not give its status: {exc}; no rank "
                           f"was started") from None
    entry = _job_entry(status, job) if job else None
    if entry is not None and entry.get("finished_training"):
        raise JobIdTaken(f"job {job!r} on the coordinator at {address} finished training "
                         f"({last_committed(entry['committed_step'])}) and admits no ranks; a job id "
                         f"is not reused: give a new --job; no rank was started")
    if alone and entry is not None and (entry["members"] or entry.get("pending")):
        what = (f"runs with {len(entry['members'])} rank(s) (pids "
                f"{', '.join(str(m['pid']) for m in entry['members'][:8])}"
                f"{', ...' if len(entry['members']) > 8 else ''})" if entry["members"] else
                f"is forming ({entry['pending']} rank(s) joined)")
        raise JobIdTaken(f"job {job!r} on the coordinator at {address} {what}: another launch's; "
                         f"one rtxnet-run per job id (several hosts: --nnodes/--node-rank on each); "
                         f"give a new --job (the ranks of a launcher that died are dropped within "
                         f"their heartbeat timeout); no rank was started")
    if entry is not None and bounds is not None and (entry["min_ranks"], entry["max_ranks"]) != bounds:
        raise JobIdTaken(f"job {job!r} on the coordinator at {address} was begun for "
                         f"{_bounds_text(entry['min_ranks'], entry['max_ranks'])}; this launch asks "
                         f"for {_bounds_text(*bounds)}: every host of a job needs the same --nnodes, "
                         f"--nproc and --min-ranks (or give a new --job); no rank was started")
    missing = entry.get("missing_ranks") if entry is not None else None
    if missing is not None and ranks and entry.get("pending"):
        taken = sorted(r for r in ranks if r < entry["min_ranks"] and r not in missing)
        if taken:
            raise JobIdTaken(f"job {job!r} on the coordinator at {address} is forming with launch "
                             f"rank{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} "
                             f"joined already, from another launch (the same --node-rank twice?); "
                             f"no rank was started")
    if job and job in status["finished"]:
        raise JobIdTaken(f"job {job!r} has finished on the coordinator at {address} "
                           f"({last_committed(status['finished'][job])}); a job id is not reused: give a new --job "
                           f"(to continue its training, e.g. from its checkpoints, under a new id); "
                           f"no rank was started")


def _bounds_text(min_ranks: int, max_ranks: int) -> str:
    """``"a world of 4 ranks"``, or ``"2..4 ranks"`` when the job may shrink."""
    return (f"a world of {max_ranks} rank{'s' if max_ranks != 1 else ''}" if min_ranks == max_ranks
            else f"{min_ranks}..{max_ranks} ranks")


def _job_entry(status: dict, job: str) -> dict | None:
    """Job ``job``'s entry in a coordinator's status answer, or None when it holds no such job
    (not begun, or finished: see ``status["finished"]``)."""
    return next((j for j in status["jobs"] if j["job"] == job), None)


def _committed_step(status: dict, job: str) -> int | None:
    """The last committed step of ``job`` in a status answer, finished or running; None if absent."""
    if job in status["finished"]:
        return status["finished"][job]
    entry = _job_entry(status, job)
    return None if entry is None else entry["committed_step"]


def _journal_folder_error(path: str) -> str | None:
    """Why the coordinator could not keep its journal in folder ``path`` (it cannot be made, or
    a file cannot be written in it), or None. Makes the folder, as the coordinator would."""
    if not path:
        return "--journal must name a folder, got ''"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".rtxnet-run-probe-"):
            pass
    except OSError as exc:
        return (f"--journal {path!r}: the coordinator could not keep its journal there "
                f"({exc.strerror or exc}{': ' + exc.filename if exc.filename else ''})")
    return None


def _bind_host_error(host: str, name: str = "--bind-host") -> str | None:
    """Why the ranks could not listen on ``host`` (not an IP address, not one of this host's),
    or None; ``name`` is where the value came from."""
    import ipaddress
    import socket

    from .config import ipv6_bind_error

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{name} must be an IP address of this host, got {host!r}"
    if ip.version == 6:
        return ipv6_bind_error(host, name)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # IPv6 refused above
            s.bind((host, 0))
    except OSError as exc:
        return f"{name} {host}: the ranks could not listen there ({exc.strerror or exc})"
    if ip.is_unspecified:
        return (f"{name} {host} is not an address other nodes can reach (every interface); "
                f"give this host's own address")
    return None


def _other_nodes_reach_us(args: argparse.Namespace) -> list[str]:
    """With ``--nnodes`` > 1: why the other nodes could not reach this node's ranks, or []. A
    loopback ``--bind-host`` with a coordinator on another address (the other nodes' collectives
    timed out naming this node's ranks, and with --min-ranks below the world the job evicted and
    readmitted them for ever, a tester's find); no route to the coordinator, where the ranks'
    address comes from without --bind-host (a Python traceback before: a name that does not
    resolve yet, a host without a route)."""
    import ipaddress

    host = _coordinator_host(args.coordinator)
    try:
        coordinator_local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        coordinator_local = host == "localhost"
    if args.bind_host is not None:
        if ipaddress.ip_address(args.bind_host).is_loopback and not coordinator_local:
            return [f"--bind-host {args.bind_host} is a loopback address: with --nnodes {args.nnodes} "
                    f"the other nodes cannot reach this node's ranks there; give this host's address "
                    f"on the network the nodes share"]
        return []
    try:
        _route_address(args.coordinator)
    except OSError as exc:
        return [f"--coordinator {args.coordinator}: no route from this host to {host!r} "
                f"({exc.strerror or exc}); the ranks listen on this host's address on that route "
                f"(or give --bind-host)"]
    return []


def _route_address(coordinator: str) -> str:
    """This host's address on the route to ``coordinator`` (``tcp://HOST:PORT``): what the other
    nodes can reach this one at."""
    from transport.channel import route_address

    return route_address(_coordinator_host(coordinator))


def _coordinator_host(coordinator: str) -> str:
    """The host of ``coordinator`` (``tcp://HOST:PORT``, brackets of an IPv6 one taken off)."""
    return coordinator.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def _n(world: int) -> str:
    return f"{world} rank{'' if world == 1 else 's'}"


def _ranks(items: list) -> str:
    """``rank 2`` / ``ranks 0, 1`` (items: rank numbers, or texts that start with one)."""
    return f"rank{'s' if len(items) > 1 else ''} {', '.join(map(str, items))}"


ERROR_DIR_PREFIX = "rtxnet-run-errors-"   # + the launcher's pid, in the temporary folder
JOURNAL_DIR_PREFIX = "rtxnet-journal-"     # + the launcher's pid + "-" + mkdtemp's suffix
FAULTRUN_DIR_PREFIX = "rtxnet-faultrun-"   # + tools/faultrun.py's pid + "-" + mkdtemp's suffix


def _sweep_left_behind() -> None:
    """Remove what launchers killed by SIGKILL left in the temporary folder (this user's only, of
    a launcher pid that no longer runs): their ranks' error-file folders, and the temporary
    journals they made up when no daemon holds them any more (a journal's own files only, then
    the folder if nothing else is in it: coordinator.journal.remove_journal); and the events
    folders of ``tools/faultrun.py`` runs killed by SIGKILL (of a faultrun pid that no longer
    runs)."""
    from coordinator.journal import journal_in_use, remove_journal

    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        if name.startswith(ERROR_DIR_PREFIX):
            pid, journal = name[len(ERROR_DIR_PREFIX):], False
        elif name.startswith((JOURNAL_DIR_PREFIX, FAULTRUN_DIR_PREFIX)):
            journal = name.startswith(JOURNAL_DIR_PREFIX)
            prefix = JOURNAL_DIR_PREFIX if journal else FAULTRUN_DIR_PREFIX
            pid, sep, _ = name[len(prefix):].partition("-")
            if not sep:   # not PID-SUFFIX: no launcher (or faultrun) of this version made it
                continue
        else:
            continue
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(tmp, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:   # its launcher is gone
            if not journal:
                shutil.rmtree(path, ignore_errors=True)
            elif not journal_in_use(path):
                remove_journal(path)
        except OSError:
            pass


# the running coordinator's "pid create_time", in the error folder (Launcher._note_coordinator_pid),
# named to the ranks by faults.COORDINATOR_PIDFILE_ENV
COORDINATOR_PIDFILE = "coordinator.pid"


def _error_dir() -> str:
    """A new folder for this launcher's ranks' error files, ``rtxnet-run-errors-PID`` in the
    temporary folder (removed when the run ends)."""
    path = os.path.join(tempfile.gettempdir(), f"{ERROR_DIR_PREFIX}{os.getpid()}")
    shutil.rmtree(path, ignore_errors=True)   # a launcher before this one with the same pid
    os.mkdir(path, 0o700)
    return path


def _stopped_only(s: _Slot, stopped_at: float | None) -> bool:
    """Whether rank slot ``s`` ended only because rtxnet-run stopped it (SIGTERM, then SIGKILL
    after --grace: 143 or 137), not of an exception it raised before that."""
    raised_before = s.error is not None and stopped_at is not None and s.error["time"] < stopped_at
    return s.killed_after_stop and not raised_before


def _root_cause(slots, stopped_at: float | None) -> tuple[_Slot | None, int]:
    """The rank that failed first, as torchrun's "Root Cause (first observed failure)": of the
    ranks that failed for good, the one whose error file (rtxnet.errorfile) holds the earliest
    time, or whose exit came first when it wrote none (killed, ``sys.exit(N)``); ranks rtxnet-run
    only stopped do not count, nor, while another rank failed otherwise, those that failed of
    another's loss (``errorfile.CONSEQUENCES``: a rank ending by ``sys.exit(3)`` writes no time,
    and its reaped exit comes after the PeerLostErrors it caused). Returns it and the launcher's
    exit code: its exit code, or 1 (an uncaught exception's) when it raised and was stopped
    while it ended. ``(None, 0)`` when no rank failed."""
    failed = [s for s in slots if s.returncode not in (0, None) and not _stopped_only(s, stopped_at)]
    if not failed:
        return None, 0
    causes = [s for s in failed if s.error is None or s.error["type"] not in errorfile.CONSEQUENCES]
    root = min(causes or failed, key=lambda s: math.inf if s.failed_at is None else s.failed_at)
    return root, (1 if root.killed_after_stop else root.returncode)


def _outcome(slots, max_restarts: int, code: int, root: _Slot | None = None,
             stopped_at: float | None = None, coordinator_trouble: str = "") -> str:
    """The last line of a run with a failure: which ranks ended well, which failed, the first
    failure's exception when its rank wrote one (``root``, see _root_cause), why the coordinator
    this launcher started kept exiting when it did, and why the launcher's code is what it
    is (the documented rule, spelt out: the job may well have finished on the survivors)."""
    # exited 0 while the job still needed them (not restarted): the cause of a stop, not a success
    early = [s for s in slots if s.returncode == 0 and s.left_early]
    ok = [s.rank for s in slots if s.returncode == 0 and not s.left_early]
    # stopped by the launcher's SIGTERM (or its SIGKILL after --grace): not a failure of their own
    # (a fresh user read a rank that was exiting 0 slowly, stopped meanwhile, as failed)
    stopped = [s.rank for s in slots if _stopped_only(s, stopped_at)]
    bad = [f"{s.rank} (exit {s.returncode}{signal_suffix(s.returncode)}, restarted {s.restarts} of "
           f"{max_restarts} times)" for s in slots if s.returncode not in (0, None) and s.rank not in stopped]
    whose = ("the first failing rank's" if bad or not stopped else
             "the ranks rtxnet-run stopped, as the job had too few ranks left")
    parts = [f"{_ranks(ok) if ok else 'no rank'} exited 0"] if ok or not early else []
    parts += [f"{_ranks([s.rank for s in early if s.left_early == when])} exited 0 {when}, which "
              f"the job could not do without" for when in sorted({s.left_early for s in early})]
    parts.append(f"{_ranks(bad) if bad else 'no rank'} failed")
    if stopped:
        parts.append(f"{_ranks(stopped)} stopped by rtxnet-run (143/137)")
    first = ""
    if root is not None and root.error is not None:
        first = (f" First failure: rank {root.rank}, {errorfile.summary(root.error)}"
                 f"{' (then stopped by rtxnet-run as it ended)' if root.killed_after_stop else ''}.")
    elif root is not None and _last_words(root, root.returncode):
        first = f" First failure: rank {root.rank}{_last_words(root, root.returncode)}."
    if coordinator_trouble:
        first = f" Before that, {coordinator_trouble}.{first}"
    return (f"{'; '.join(parts)}.{first} Exit code {code}: {whose} (0 only when every rank's last "
            f"process exited 0 and the job did not stop)")


def _journal_trouble(journal: str) -> str:
    """What keeps the coordinator from using ``journal``, as far as this process can see: its
    file system full or read-only, the folder not writable, or (none of those) its log says."""
    folder = journal
    while folder and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    try:
        st = os.statvfs(folder or ".")
    except OSError as exc:
        return f"{exc.strerror} ({folder!r}); its log says more"
    free = st.f_bavail * st.f_frsize     # what an unprivileged writer may still use
    if free < (1 << 20):
        return f"its file system is full ({free} bytes free under {folder})"
    if st.f_flag & os.ST_RDONLY:
        return f"its file system is read-only ({folder})"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable by this user"
    return "its log above says why"


def _last_words(slot: _Slot, code: int | None) -> str:
    """For a rank that exited with ``code`` 1..127 and wrote no error file (``sys.exit(2)`` from
    argparse, a crash before ``import rtxnet``): ``" (last line on stderr: '...')"`` from its last
    line that was not blank, else ``""`` (a signal's code says what happened; stderr would not)."""
    if code is None or not 0 < code < 128 or not slot.last_err[0]:
        return ""
    from .cli import _shown

    line = slot.last_err[0].decode("utf-8", "replace")
    return f" (last line on stderr: {_shown(line)!r})"


def signal_suffix(code: int | None) -> str:
    """``", SIGKILL"`` for an exit code 128+N of signal N (as shells and this launcher report a
    process killed by a signal), else ``""``."""
    if code is None or code <= 128:
        return ""
    try:
        return f", {signal.Signals(code - 128).name}"
    except ValueError:
        return ""


def _say(text: str) -> None:
    try:
        print(f"[rtxnet-run] {text}", file=sys.stderr, flush=True)
    except BrokenPipeError:   # (rtxnet-run ... 2>&1 | head)
        _reader_gone(sys.stderr)


class _Parser(argparse.ArgumentParser):
    """rtxnet-run's parser: an error says so when rtxnet-run's own options came after the script,
    where they are the script's arguments (``rtxnet-run train.py --nproc 2`` said only "the
    following arguments are required: --nproc": a fresh user's find)."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        late = self._after_script(getattr(self, "_argv", []))
        if late:
            message += (f" ({', '.join(late)} came after the script, whose arguments they are: "
                        f"rtxnet-run's options go before it, rtxnet-run [options] script.py "
                        f"[script arguments])")
        super().error(message)

    def _after_script(self, argv: list[str]) -> list[str]:
        """rtxnet-run's options among the script's arguments in ``argv`` (``-h`` aside: a script
        may take its own)."""
        i = 0
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
            action = self._option_string_actions.get(argv[i].split("=", 1)[0])
            i += 1 + (action is not None and action.nargs != 0 and "=" not in argv[i])
        ours = [a.split("=", 1)[0] for a in argv[i + 1:]]
        return [a for a in dict.fromkeys(ours) if a in self._option_string_actions and a not in ("-h", "--help")]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rtxnet-run", description="Launch N ranks of a training script under rtxnet.")
    p.add_argument("--nproc", type=int, required=True, help="number of ranks to start on this host")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts the job runs on, each with its own rtxnet-run (default 1); with more "
                        "than one, --coordinator and --job are required")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this host's index in 0..nnodes-1: it starts launch ranks "
                        "node_rank*nproc .. node_rank*nproc+nproc-1 (default 0)")
    p.add_argument("--bind-host", default=None,
                   help="address the ranks' data sockets listen on (default: 127.0.0.1 on one node; "
                        "with --nnodes > 1, this host's address on the route to the coordinator)")
    p.add_argument("--coordinator", default=None, help="address of a running coordinator (default: start one)")
    p.add_argument("--journal", default=None, help="journal folder for the coordinator this command starts")
    p.add_argument("--job", default=None, help="job id (default: a fresh random one)")
    p.add_argument("--min-ranks", type=int, default=None, help="smallest world the job may shrink to (default nproc)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of each crashed rank (default 0); a rank whose process lived under "
                        f"{_RANK_STABLE_S:g} s is restarted after a pause, {_RANK_PAUSE_S:g} s doubling "
                        f"to {_RANK_PAUSE_MAX_S:g} s")
    p.add_argument("--faults", default=None,
                   help="fault-injection plan (see README); overrides RTXNET_FAULTS, and --faults '' "
                        "injects none")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds ranks get after SIGINT/SIGTERM/SIGHUP/SIGQUIT before they are killed "
                        "(default 10; a second such signal kills them at once)")
    p.add_argument("--lost-grace", type=float, default=FROZEN_GRACE_S,
                   help=f"seconds a rank the coordinator declared lost may keep running (frozen, "
                        f"hung) while the job needs it before it is killed, to be restarted "
                        f"(default {FROZEN_GRACE_S:g}; a rank that wakes within it rejoins by itself)")
    p.add_argument("--preload", default="auto", metavar="MODULES",
                   help="modules imported once by a fork server that each rank process is forked "
                        "from, instead of each rank importing them at its start (comma-separated; "
                        "'none': every rank a fresh interpreter; default 'auto': torch "
                        "(torch._dynamo too where the script names optim) and rtxnet's "
                        "dependencies when the script imports torch, only the latter when it "
                        "imports rtxnet or numpy, else none; a list replaces auto's)")
    # (optional to argparse, checked in _main: else a missing script was reported as "the
    # following arguments are required: script, script_args", the latter optional: a fresh
    # user's find)
    p.add_argument("script", nargs="?", help="the Python script each rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _environment_errors() -> list[str]:
    """What every rank would refuse in the environment it inherits, found once, here: the
    timeouts (parsed and checked by :meth:`rtxnet.Timeouts.from_env`, as a rank's ``init`` does
    when it is given no ``Timeouts``), ``RTXNET_LAST_CALL`` (the coordinator refuses a join whose
    ``last_call_s`` is negative or not finite), ``RTXNET_LOG_LEVEL``, ``RTXNET_SHM`` and
    ``RTXNET_LOG_JSON`` (on/off values), ``RTXNET_HOST`` (too long
    for an identity), ``RTXNET_TOKEN`` (longer than the coordinator takes) and ``RTXNET_BIND_HOST``
    (an address the ranks could not listen on)."""
    from transport.errors import ConfigError

    from .config import Timeouts, env_float

    errors = []
    try:
        Timeouts.from_env()
    except ConfigError as exc:   # names the variable, or the fields and the variables set
        errors.append(str(exc))
    try:
        last_call = env_float("RTXNET_LAST_CALL", 0.0)
    except ConfigError as exc:
        errors.append(str(exc))
    else:
        if not 0 <= last_call <= 3600:   # as rtxnet.init and the coordinator take it
            errors.append(f"RTXNET_LAST_CALL={os.environ['RTXNET_LAST_CALL']!r} must be a number "
                          f"of seconds in [0, 3600]")
    from transport.logconfig import LOG_LEVELS

    level = os.environ.get("RTXNET_LOG_LEVEL")
    if level and level.lower() not in LOG_LEVELS:
        errors.append(f"RTXNET_LOG_LEVEL={level!r} is not one of {', '.join(LOG_LEVELS)}")
    from transport.logconfig import env_flag

    for flag in ("RTXNET_SHM", "RTXNET_LOG_JSON"):
        try:
            env_flag(flag, False)
        except ConfigError as exc:
            errors.append(str(exc))
    try:
        from .topology import host_id

        host_id()
    except ConfigError as exc:
        errors.append(str(exc))
    token = os.environ.get("RTXNET_TOKEN", "")
    if len(token) > MAX_TOKEN:   # the coordinator refuses the join
        errors.append(f"RTXNET_TOKEN is {len(token)} characters, more than the {MAX_TOKEN} a job "
                      f"token may have")
    bind = os.environ.get("RTXNET_BIND_HOST")
    if bind:
        bad = _bind_host_error(bind, "RTXNET_BIND_HOST")
        if bad:
            errors.append(bad)
    return errors


def main(argv: list[str] | None = None) -> int:
    import structlog

    from transport.logconfig import ensure_standard_fds

    ensure_standard_fds()

    if not structlog.is_configured():
        # the launcher's own control client logs (a request resent to a frozen coordinator):
        # to stderr, warnings and up as the ranks' default, not structlog's default of stdout
        # among the ranks' lines (a fresh user's find)
        from transport.logconfig import LOG_LEVELS, configure_logging, env_flag

        level = os.environ.get("RTXNET_LOG_LEVEL", "warning").lower()
        try:
            json = env_flag("RTXNET_LOG_JSON", False)
        except ValueError:   # _environment_errors names it, in one line (it was a traceback)
            json = False
        configure_logging(level=level if level in LOG_LEVELS else "warning", json=json)
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C before the launcher's own handler was installed
        print("rtxnet-run: interrupted before any rank started", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.script is None:
        parser.error("no script given: rtxnet-run [options] script.py [script arguments]")
    errors = []
    if not 1 <= args.nproc <= MAX_NPROC:
        errors.append(f"--nproc must be in 1..{MAX_NPROC}, got {args.nproc}")
    if not 0 < args.grace < math.inf:   # NaN fails too
        errors.append(f"--grace must be a finite number of seconds > 0, got {args.grace}")
    if not 0 < args.lost_grace < math.inf:
        errors.append(f"--lost-grace must be a finite number of seconds > 0, got {args.lost_grace}")
    if args.job is not None and not args.job.strip():
        errors.append("--job must not be empty")
    elif args.job is not None and len(args.job) > MAX_JOB_ID:
        errors.append(f"--job must be at most {MAX_JOB_ID} characters, got {len(args.job)} "
                      f"({args.job[:20]!r}...)")
    elif args.job is not None and not args.job.isprintable():
        errors.append(f"--job {args.job!r} holds a control character (a newline, an escape, ...); "
                      f"give a printable one")
    if args.coordinator is not None:
        from transport.channel import check_address

        try:
            check_address(args.coordinator)
        except ValueError as exc:
            errors.append(f"--coordinator: {exc}")
    if args.max_restarts < 0:
        errors.append(f"--max-restarts must be >= 0, got {args.max_restarts}")
    errors += _preload_errors(args.preload, args.script)
    total = args.nproc * max(1, args.nnodes)
    if not 1 <= args.nnodes <= MAX_NPROC:
        errors.append(f"--nnodes must be in 1..{MAX_NPROC}, got {args.nnodes}")
    elif not 0 <= args.node_rank < args.nnodes:
        errors.append(f"--node-rank must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes}), got {args.node_rank}")
    elif args.nnodes > 1 and (args.coordinator is None or args.job is None):
        # only what is missing (a fresh user's find: it asked for --coordinator when given)
        need = [w for w, v in (("--coordinator ADDR (an rtxnet-coordinator every node reaches)",
                                args.coordinator), ("--job ID", args.job)) if v is None]
        errors.append(f"--nnodes {args.nnodes} needs {' and '.join(need)}, the same on every node")
    if args.bind_host is not None:
        bad = _bind_host_error(args.bind_host)
        if bad:
            errors.append(bad)
    if args.nnodes > 1 and args.coordinator is not None and not errors:
        errors.extend(_other_nodes_reach_us(args))
    if args.min_ranks is not None and not (1 <= args.min_ranks <= total):
        what = f"nproc({args.nproc})" if args.nnodes == 1 else f"nnodes*nproc({total})"
        errors.append(f"--min-ranks must be in 1..{what}, got {args.min_ranks}")
    if args.journal is not None and args.coordinator:
        errors.append(f"--journal {args.journal!r} is for the coordinator rtxnet-run starts; the one at "
                      f"--coordinator {args.coordinator} keeps its own journal (give one or the other)")
    elif args.journal is not None and os.path.exists(args.journal) and not os.path.isdir(args.journal):
        errors.append(f"--journal {args.journal!r} is not a folder (the journal is a folder; "
                      "give a new or existing folder)")
    elif args.journal is not None:
        bad = _journal_folder_error(args.journal)
        if bad:
            errors.append(bad)
    if not os.path.exists(args.script):
        errors.append(f"script {args.script!r} does not exist")
    elif not os.path.isfile(args.script):
        errors.append(f"script {args.script!r} is not a file")
    # --faults wins over RTXNET_FAULTS (the ranks get --faults); either is checked here, once,
    # instead of by every rank with a traceback.
    plan, where = ((args.faults, "--faults") if args.faults is not None else
                   (os.environ.get("RTXNET_FAULTS"), "RTXNET_FAULTS"))
    if plan:
        from .faults import parse_plan

        try:
            for f in parse_plan(plan):
                if f.rank is not None and f.rank >= total:
                    errors.append(f"{where}: {f.text!r} names rank {f.rank}, but --nproc is {args.nproc}"
                                  + (f" on {args.nnodes} nodes" if args.nnodes > 1 else ""))
                if f.kind == "kill-coordinator" and args.coordinator is not None:
                    errors.append(f"{where}: {f.text!r} kills the coordinator rtxnet-run starts, but "
                                  f"--coordinator {args.coordinator} is another one (rtxnet-run "
                                  f"neither kills nor restarts it); drop --coordinator")
        except ValueError as exc:
            errors.append(f"{where}: {exc}")
    errors += _environment_errors()
    if errors:
        for e in errors:
            print(f"rtxnet-run: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    launcher = Launcher(args)
    try:
        return runner(launcher.run())
    except RuntimeError as exc:  # the coordinator could not start (bad --journal, ...)
        if launcher.stop_signal is not None:   # ... or did not answer: Ctrl-C came first
            print(f"rtxnet-run: stopped by {launcher.stop_signal} before any rank started",
                  file=sys.stderr)
            return 128 + signal.Signals[launcher.stop_signal].value
        if isinstance(exc, JournalRefused) and args.journal is not None:
            print(f"rtxnet-run: --{exc}", file=sys.stderr)   # "--journal '...': ..."
            return 2
        print(f"rtxnet-run: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, JobIdTaken) else 1


def _faults_for_other_nodes(a: argparse.Namespace) -> str | None:
    """With ``--nnodes``: the faults of the plan (``--faults``, else ``RTXNET_FAULTS``; checked
    already) that name a launch rank of another node, as one line, or None."""
    if a.nnodes == 1:
        return None
    mine = range(a.node_rank * a.nproc, (a.node_rank + 1) * a.nproc)
    other = [f"{f.text!r} names rank {f.rank}" for f in _checked_plan(a)
             if f.rank is not None and f.rank >= 0 and f.rank not in mine]   # (-1: rank=any)
    return "faults for other nodes' ranks: " + ", ".join(other) if other else None


def _faults_no_rank_reported(a: argparse.Namespace, world_size: int,
                             reached: dict[int, bool]) -> str | None:
    """The faults of the plan that no process could report as not injected, as one line, or None.

    A rank's process names the faults meant for it that never came due at its exit, but only once
    it made its fault injector, in ``rtxnet.init`` (``connect``); a script that never got there
    (one without rtxnet, one that failed first) said nothing, and the job ended 0 with the plan
    untested without a word (a fresh user's find). ``reached``: launch rank -> whether its first
    process (the one faults fire in) reached ``rtxnet.init``, for this node's ranks that started.
    A fault of no rank (it fires on the first rank to reach it) counts when none of the job's ranks
    reached it: known on one node only."""
    if not reached or all(reached.values()):
        return None
    from .faults import label, parse_plan

    text = _plan_text(a)
    faults = parse_plan(text, world_size=world_size) if text else []   # (rank=any resolved)
    nobody = a.nnodes == 1 and len(reached) == a.nproc and not any(reached.values())
    missed = [f"{label(f, faults)} (launch rank {f.rank})" if f.rank is not None else
              f"{label(f, faults)} (any rank)" for f in faults
              if (reached.get(f.rank) is False if f.rank is not None else nobody)]
    if not missed:
        return None
    return (f"faults never injected, the processes they were meant for never having reached "
            f"rtxnet.init (where a rank arms its faults, and names at exit those that never came "
            f"due): {', '.join(missed)}")


def _checked_plan(a: argparse.Namespace) -> list:
    """The faults of the plan the ranks get (``--faults``, else ``RTXNET_FAULTS``), parsed once
    (``main`` checked it before the launcher started; [] for none)."""
    if not hasattr(a, "_plan"):
        from .faults import parse_plan

        text = _plan_text(a)
        a._plan = parse_plan(text) if text else []
    return a._plan


def _plan_text(a: argparse.Namespace) -> str | None:
    """The fault plan the ranks get: ``--faults``, else ``RTXNET_FAULTS`` (None for none)."""
    return a.faults if a.faults is not None else os.environ.get("RTXNET_FAULTS")


def _short_heartbeat_drops(a: argparse.Namespace) -> str | None:
    """The plan's ``drop-heartbeats`` faults whose ``seconds`` do not exceed the heartbeat
    timeout the ranks read from this environment (``RTXNET_HEARTBEAT_TIMEOUT``, default 2 s), as
    one line, or None: the coordinator declares a rank lost only after that long a silence, so
    such a drop may go unnoticed (a fresh user's find: ``seconds=2`` did nothing, silently). A
    script that passes its own ``Timeouts`` may differ: a warning, not an error."""
    plan = _checked_plan(a)
    if not plan:
        return None
    from transport.errors import ConfigError

    from .config import Timeouts

    try:
        limit = Timeouts.from_env().heartbeat_timeout_s
    except (ValueError, ConfigError):   # (a bad variable: _environment_errors said so)
        return None
    short = [f.text for f in plan
             if f.kind == "drop-heartbeats" and f.seconds is not None and f.seconds <= limit]
    # a pause or a cut as short only delays the steps (a fresh user's find: pause:...:seconds=1
    # was never detected, and nothing said why)
    brief = [f.text for f in plan if f.kind in ("pause", "partition") and f.seconds is not None
             and f.seconds <= limit]
    said = []
    if short:
        said.append(f"{', '.join(map(repr, short))}: heartbeats dropped for no longer than the heartbeat "
                    f"timeout ({limit:g} s, RTXNET_HEARTBEAT_TIMEOUT): the coordinator declares a rank lost "
                    f"only after that long a silence, so the rank may never be; give seconds above it")
    if brief:
        said.append(f"{', '.join(map(repr, brief))}: no longer than the heartbeat timeout ({limit:g} s, "
                    f"RTXNET_HEARTBEAT_TIMEOUT): the rank is not declared lost, its steps are only "
                    f"delayed; give seconds above it to test a recovery")
    return "; ".join(said) or None


if __name__ == "__main__":
    sys.exit(main())
