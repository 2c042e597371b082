"""``rtxnet-coordinator``: run the coordinator daemon.

    rtxnet-coordinator --bind tcp://0.0.0.0:29600 --journal DIR

On start it replays the journal in ``DIR`` and prints one line ``RTXNET_COORDINATOR=<address>`` on
stdout (useful with port 0); logs go to stderr. SIGINT/SIGTERM stop it after the current batch.
Exit codes: 0 after a signal, 2 for bad arguments, 3 for a corrupt journal, 4 if it cannot bind.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import sys

import structlog

from transport.errors import ConnectError, JournalCorruptError, JournalError
from transport.logconfig import configure_logging

from .server import Coordinator

log = structlog.get_logger("coordinator")

DEFAULT_BIND = "tcp://0.0.0.0:29600"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtxnet-coordinator", description="rtxnet coordinator daemon")
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"ZeroMQ address to bind (default {DEFAULT_BIND}; port 0 = any free port)")
    p.add_argument("--journal", required=True, help="write-ahead journal folder (replayed at start)")
    p.add_argument("--tick", type=float, default=0.05, help="seconds between heartbeat/deadline checks (default 0.05)")
    p.add_argument("--snapshot-every", type=int, default=10000, help="journal records between snapshots (default 10000)")
    p.add_argument("--log-level", default=None)
    p.add_argument("--log-json", action="store_true")
    p.add_argument("--dead-job-ttl", type=float, default=3600.0,
                   help="seconds a job whose every rank crashed is kept for restarted ranks to "
                        "rejoin (committed step, store, checkpoint record), then forgotten "
                        "(default 3600)")
    p.add_argument("--remove-journal-on-stop", action="store_true",
                   help="delete the journal folder after a clean stop (SIGTERM/SIGINT), not after a "
                        "crash; rtxnet-run uses it for the temporary journal it creates")
    return p


async def _amain(args: argparse.Namespace) -> int:
    coord = Coordinator(args.bind, args.journal, tick_s=args.tick, snapshot_every=args.snapshot_every,
                        dead_job_ttl_s=args.dead_job_ttl)
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
        return 4
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, coord.stop)
    print(f"RTXNET_COORDINATOR={address}", flush=True)
    log.info("coordinator_started", address=address, journal=args.journal)
    try:
        await coord.serve()
    finally:
        try:
            await coord.aclose()
        finally:
            # before logging: with rtxnet-run gone, writing to its pipe raises BrokenPipeError
            if args.remove_journal_on_stop:
                shutil.rmtree(args.journal, ignore_errors=True)
        log.info("coordinator_stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tick <= 0:
        print(f"rtxnet-coordinator: --tick must be > 0, got {args.tick}", file=sys.stderr)
        return 2
    if not 0 < args.dead_job_ttl < float("inf"):
        print(f"rtxnet-coordinator: --dead-job-ttl must be a positive number of seconds, got "
              f"{args.dead_job_ttl}", file=sys.stderr)
        return 2
    from transport.channel import check_address

    try:
        check_address(args.bind)
    except ValueError as exc:
        print(f"rtxnet-coordinator: --bind: {exc}", file=sys.stderr)
        return 2
    configure_logging(level=args.log_level, json=args.log_json or None)
    try:
        import uvloop
        return uvloop.run(_amain(args))
    except ImportError:
        return asyncio.run(_amain(args))


if __name__ == "__main__":
    sys.exit(main())
