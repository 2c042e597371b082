"""``rtxnet-coordinator``: run the coordinator daemon.

    rtxnet-coordinator --bind tcp://0.0.0.0:29600 --journal DIR

On start it replays the journal in ``DIR`` and prints one line ``RTXNET_COORDINATOR=<address>`` on
stdout (useful with port 0; bound to every interface, ``0.0.0.0``, it prints this host's address on
its default route, which other hosts can connect to); logs go to stderr. SIGINT/SIGTERM/SIGHUP stop it after the current batch.
Exit codes: 0 after a signal, 2 for bad arguments (usage and one line naming the bad value, from
argparse, before anything starts), 3 for a corrupt or unusable journal (also one whose write or
fsync fails while running: disk full), 4 if it cannot bind.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys

import structlog

from transport.channel import route_address
from transport.errors import ConnectError, JournalCorruptError, JournalError
from transport.logconfig import FLAG_VALUES, LOG_LEVELS, configure_logging, ensure_standard_fds

from .journal import holds_journal, remove_journal
from .server import Coordinator

log = structlog.get_logger("coordinator")

DEFAULT_BIND = "tcp://0.0.0.0:29600"
# The tick is how often heartbeat silences, kv_wait and commit deadlines and last-call windows are
# checked, so it adds up to one tick to every such decision. Above 1 s it would swamp the default
# heartbeat_timeout (2 s, ../shared/DESIGN.md) in loss detection; below 1 ms the serve loop spins.
TICK_RANGE_S = (0.001, 1.0)
# an open-files limit below this is logged as a warning: fewer connections than that (ranks,
# launchers, status clients, idle ones) would fill it; 1024 is a common default soft limit
LOW_OPEN_FILES = 4096


def _address(text: str) -> str:
    from transport.channel import check_address

    try:
        address = check_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
        if host != "*" and not _bindable_host(host):
            # before the journal is touched (ZeroMQ said only "No such device": a fresh user's find)
            raise argparse.ArgumentTypeError(
                f"cannot bind {text!r}: host {host!r} is neither an IP address, '*', an interface "
                f"of this machine nor a name that resolves")
    return address


def _bindable_host(host: str) -> bool:
    """Whether ZeroMQ can bind on ``host``: an IP address, a network interface's name, or a name
    that resolves (ZeroMQ then binds its address)."""
    import ipaddress
    import socket

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        if host in {name for _, name in socket.if_nameindex()}:
            return True
    except OSError:
        pass
    try:
        socket.getaddrinfo(host, None)
        return True
    except (OSError, UnicodeError):
        return False


def _checked(cast, kind: str, ok, rule: str):
    """An argparse ``type``: ``cast(text)``, refused as "not {kind}" when it does not parse and
    with ``rule`` when ``ok(value)`` is false (NaN fails every comparison, so it is refused)."""

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{text!r} {rule}")
        return v

    return parse


_tick = _checked(float, "a number", lambda v: TICK_RANGE_S[0] <= v <= TICK_RANGE_S[1],
                 f"is not a number of seconds in {TICK_RANGE_S[0]:g}..{TICK_RANGE_S[1]:g}")
_ttl = _checked(float, "a number", lambda v: 0 < v < math.inf,
                "is not a finite, positive number of seconds")
_count = _checked(int, "an integer", lambda v: v >= 1, "must be >= 1")


def _folder(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder name (empty)")
    return text


def _level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.lower()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtxnet-coordinator", description="rtxnet coordinator daemon")
    p.add_argument("--bind", type=_address, default=DEFAULT_BIND,
                   help=f"ZeroMQ address to bind (default {DEFAULT_BIND}; port 0 = any free port)")
    p.add_argument("--journal", type=_folder, required=True, help="write-ahead journal folder (replayed at start)")
    p.add_argument("--tick", type=_tick, default=0.05,
                   help=f"seconds between heartbeat/deadline checks, {TICK_RANGE_S[0]:g}..{TICK_RANGE_S[1]:g} "
                        "(default 0.05)")
    p.add_argument("--snapshot-every", type=_count, default=10000,
                   help="journal records between snapshots, >= 1 (default 10000)")
    p.add_argument("--log-level", type=_level, default=None,
                   help=f"one of {', '.join(LOG_LEVELS)} (default RTXNET_LOG_LEVEL or info)")
    p.add_argument("--log-json", action="store_true",
                   help="log JSON lines to stderr instead of readable console lines (default "
                        f"RTXNET_LOG_JSON: {', '.join(w for w, on in FLAG_VALUES.items() if on)} "
                        f"for JSON; {', '.join(w for w, on in FLAG_VALUES.items() if not on)} or "
                        f"unset for console lines; any other value is refused)")
    p.add_argument("--dead-job-ttl", type=_ttl, default=3600.0,
                   help="seconds a job whose every rank crashed is kept for restarted ranks to "
                        "rejoin (committed step, store, checkpoint record), then forgotten "
                        "(default 3600); sooner when a new job needs its place (MAX_JOBS held)")
    p.add_argument("--remove-journal-on-stop", action="store_true",
                   help="delete the journal (its segments, snapshot and lock file; then the folder, "
                        "if nothing else is in it) after a clean stop (SIGTERM/SIGINT), not after a "
                        "crash; rtxnet-run uses it for the temporary journal it creates")
    p.add_argument("--journal-owner", type=_count, default=None, metavar="PID",
                   help="with --remove-journal-on-stop: while process PID (this daemon's parent, "
                        "rtxnet-run) lives, a clean stop keeps the journal, for PID to restart the "
                        "daemon on it (a SIGTERM from someone else loses nothing) or remove it; only "
                        "once PID is gone does the daemon remove it itself")
    return p


def _reachable(address: str) -> str:
    """``address`` as other hosts connect to it: a wildcard host (``0.0.0.0``, ``*``, ``::``) is
    replaced by this host's address on its default route (found by connecting a UDP socket;
    nothing is sent), else by a non-loopback address its hostname resolves to; with neither, the
    address is kept (it serves this host) and a warning says so."""
    import socket

    if not address.startswith("tcp://"):   # ipc://PATH: this host only, as given
        return address
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    host = host.strip("[]")
    if host not in ("0.0.0.0", "*", "::"):
        return address
    try:
        return f"tcp://{route_address('10.255.255.255')}:{port}"   # any address off this host
    except OSError:   # no default route: an address the hostname resolves to, not a loopback one
        try:
            infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        except OSError:
            infos = []
        for *_, sockaddr in infos:
            if not sockaddr[0].startswith("127."):
                return f"tcp://{sockaddr[0]}:{port}"
    log.warning("no_reachable_address", bind=address,
                hint="no route and no non-loopback address for this host; other hosts need --bind "
                     "with an interface address")
    return address


def _owner_alive(pid: int | None) -> bool:
    """Whether ``--journal-owner`` ``pid`` still runs as this daemon's parent (when it dies the
    daemon is reparented, so a pid reused by another process does not count). A parent whose
    main thread has exited (a zombie thread-group leader) is dying: a SIGKILLed rtxnet-run sends
    this daemon its SIGTERM (``PR_SET_PDEATHSIG``) when its main thread ends, while the daemon is
    still its child through a worker thread that has not ended yet; under load the daemon then
    kept the temporary journal (a test saw it)."""
    import psutil

    if pid is None or os.getppid() != pid:
        return False
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


async def _amain(args: argparse.Namespace) -> int:
    coord = Coordinator(args.bind, args.journal, tick_s=args.tick, snapshot_every=args.snapshot_every,
                        dead_job_ttl_s=args.dead_job_ttl)
    made_journal = not os.path.lexists(args.journal)
    # a folder with no journal in it yet: the journal files a failed start adds to it are ours
    fresh_folder = os.path.isdir(args.journal) and not holds_journal(args.journal)
    try:
        address = await coord.start()
    except JournalCorruptError as exc:
        log.error("journal_corrupt", path=exc.path, offset=exc.offset, error=str(exc))
        return 3
    except JournalError as exc:
        log.error("journal_unusable", error=str(exc))
        return 3
    except ConnectError as exc:
        log.error("bind_failed", error=str(exc))
        if made_journal or fresh_folder:   # nothing was acknowledged: leave no trace
            remove_journal(args.journal, keep_folder=not made_journal)
        return 4
    loop = asyncio.get_running_loop()
    # SIGHUP too: a daemon whose launcher died while one of its ranks was stopped gets it with
    # the rest of the orphaned process group; it stops as cleanly (a temporary journal removed)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, coord.stop)
    reach = _reachable(address)
    print(f"RTXNET_COORDINATOR={reach}", flush=True)
    log.info("coordinator_started", address=address, reachable_at=reach, journal=args.journal)
    code, clean = 0, False
    try:
        await coord.serve()
        clean = True
    except JournalError as exc:
        # a write or fsync failed (disk full, I/O error): nothing more can be made durable, and
        # nothing not durable is ever acknowledged; what was acknowledged replays on restart
        log.error("journal_failed", error=str(exc),
                  hint="free the disk or fix the device, then restart with the same --journal")
        code = 3
    finally:
        left = []
        try:
            await coord.aclose()
        finally:
            # before logging: with rtxnet-run gone, writing to its pipe raises BrokenPipeError
            # (only after a clean stop: a failed one leaves it for the restart to replay); the
            # journal's own files only, never what else the folder holds
            if args.remove_journal_on_stop and clean and not _owner_alive(args.journal_owner):
                left = remove_journal(args.journal)
        if left:
            log.warning("journal_folder_kept", path=args.journal, not_the_journals=left[:10],
                        hint="the journal's files were removed; the folder holds others")
        log.info("coordinator_stopped")
    return code


def _raise_open_files_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit, as servers do: every
    client connection (each rank, launcher, ``rtxnet status``) holds a file descriptor, and at a
    soft limit of 1024 (a common default) 1,100 idle connections kept every new rank and
    ``rtxnet status`` out, and the journal's snapshots failed with EMFILE (a tester's find).
    Logged (``open_files_limit``), with a warning when the limit stays low: a hard limit of
    1024 (``ulimit -n 1024`` sets both) cannot be raised from inside."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    was = soft
    # the hard limit is kept as it is (lowered, it cannot be raised again); an unlimited one is
    # not a soft limit Linux takes (fs.nr_open, 2**20 by default, bounds it)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    error = None
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:   # a sandbox that forbids it: the limit stays as it was
            error = str(exc)

    def shown(n: int) -> int | str:
        return "unlimited" if n == resource.RLIM_INFINITY else n

    figures = {"soft_was": shown(was), "soft": shown(soft), "hard": shown(hard)}
    if error is not None:
        figures["error"] = error
    if soft != resource.RLIM_INFINITY and soft < LOW_OPEN_FILES:
        log.warning("open_files_limit_low", **figures,
                    hint="each client connection holds one; raise the hard limit (ulimit -Hn, "
                         "systemd LimitNOFILE=) so that idle or hostile connections cannot keep "
                         "ranks out")
    else:
        log.info("open_files_limit", **figures)


def main(argv: list[str] | None = None) -> int:
    """Run the daemon until a signal; returns the exit code (module docstring).

    Raises:
        SystemExit: code 2, from argparse, for a bad argument or ``RTXNET_LOG_LEVEL``.
    """
    ensure_standard_fds()
    p = _parser()
    args = p.parse_args(argv)
    if args.journal_owner is not None and not args.remove_journal_on_stop:
        # it only says when that removal may happen: alone it would do nothing, silently
        p.error("argument --journal-owner: only applies with --remove-journal-on-stop")
    try:
        configure_logging(level=args.log_level, json=args.log_json or None)
    except ValueError as exc:   # RTXNET_LOG_LEVEL or RTXNET_LOG_JSON: --log-level is a choice
        p.error(str(exc))
    _raise_open_files_limit()
    try:
        import uvloop
        return uvloop.run(_amain(args))
    except ImportError:
        return asyncio.run(_amain(args))


if __name__ == "__main__":
    sys.exit(main())
