"""Journal append throughput: group commit against one fsync per record, on the same disk.

Run from the repository root (the target is at least 10,000 records/s with group commit)::

    python -m tools.bench.journal_bench --dir /path/on/the/disk --json out/journal.json

Mode ``group_commit``: ``writers`` asyncio tasks (on uvloop when installed, as the coordinator
runs) each loop over ``append`` + ``await flush()``, like many clients each waiting for its
acknowledgement. Mode ``fsync_per_record``: one caller does ``append`` + ``flush_sync()`` per
record. Both use real ``os.fsync``; each run gets a fresh journal in a temporary folder under
``directory``, removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # run as a script: tools.bench.report
    sys.path.insert(0, str(ROOT))

from coordinator.journal import Journal  # noqa: E402
from rtxnet.config import existing_folder, int_in, output_file  # noqa: E402
from tools.bench.report import print_rows, write_rows  # noqa: E402

__all__ = ["bench_journal"]


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def _percentile_ms(samples_s: list[float], q: float) -> float:
    if not samples_s:
        return 0.0
    ordered = sorted(samples_s)
    index = min(len(ordered) - 1, round(q * (len(ordered) - 1)))
    return round(ordered[index] * 1e3, 3)


def _group_commit(directory: Path, records: int, record_nbytes: int, writers: int) -> dict:
    journal = Journal(directory)
    journal.open()
    payload = os.urandom(record_nbytes)
    latencies_s: list[float] = []
    # Spread `records` exactly over the writers.
    shares = [records // writers + (1 if w < records % writers else 0) for w in range(writers)]

    async def writer(count: int) -> None:
        for _ in range(count):
            t0 = time.perf_counter()
            journal.append(payload)
            await journal.flush()
            latencies_s.append(time.perf_counter() - t0)

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(writer(n) for n in shares if n))
        return time.perf_counter() - t0

    factory, loop_name = _loop_factory()
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            seconds = runner.run(run())
    finally:
        journal.close()
    return {
        "bench": "journal",
        "mode": "group_commit",
        "records": records,
        "seconds": round(seconds, 4),
        "records_per_s": round(records / seconds, 1),
        "record_nbytes": record_nbytes,
        "writers": writers,
        "fsyncs": journal.fsync_count,
        "records_per_fsync": round(records / max(1, journal.fsync_count), 2),
        "ack_p50_ms": _percentile_ms(latencies_s, 0.50),
        "ack_p99_ms": _percentile_ms(latencies_s, 0.99),
        "loop": loop_name,
    }


def _fsync_per_record(directory: Path, records: int, record_nbytes: int) -> dict:
    journal = Journal(directory)
    journal.open()
    payload = os.urandom(record_nbytes)
    latencies_s: list[float] = []
    try:
        t0 = time.perf_counter()
        for _ in range(records):
            t1 = time.perf_counter()
            journal.append(payload)
            journal.flush_sync()
            latencies_s.append(time.perf_counter() - t1)
        seconds = time.perf_counter() - t0
    finally:
        journal.close()
    return {
        "bench": "journal",
        "mode": "fsync_per_record",
        "records": records,
        "seconds": round(seconds, 4),
        "records_per_s": round(records / seconds, 1),
        "record_nbytes": record_nbytes,
        "writers": 1,
        "fsyncs": journal.fsync_count,
        "records_per_fsync": round(records / max(1, journal.fsync_count), 2),
        "ack_p50_ms": _percentile_ms(latencies_s, 0.50),
        "ack_p99_ms": _percentile_ms(latencies_s, 0.99),
        "loop": "none",
    }


def bench_journal(
    directory: str | os.PathLike[str],
    *,
    records: int = 20000,
    record_nbytes: int = 100,
    writers: int = 64,
) -> list[dict]:
    """Measure durable appends per second with group commit and with one fsync per record.

    Args:
        directory: an existing folder on the disk to measure; each run uses a fresh temporary
            journal folder inside it and removes it afterwards.
        records: records appended (and made durable) per mode.
        record_nbytes: payload size of each record in bytes (the frame adds 14).
        writers: concurrent asyncio tasks in the group-commit mode.

    Returns:
        One row per mode: ``{"bench": "journal", "mode": "group_commit" | "fsync_per_record",
        "records": N, "seconds": s, "records_per_s": r, ...}`` plus ``fsyncs``,
        ``records_per_fsync`` and acknowledgement latency ``ack_p50_ms`` / ``ack_p99_ms``.

    Raises:
        ValueError: ``records``, ``record_nbytes`` or ``writers`` out of range.
        JournalError: a journal operation failed.
    """
    if records < 1 or writers < 1 or record_nbytes < 0:
        raise ValueError(
            f"need records({records}) >= 1, writers({writers}) >= 1, "
            f"record_nbytes({record_nbytes}) >= 0"
        )
    rows = []
    for mode in ("group_commit", "fsync_per_record"):
        run_dir = Path(tempfile.mkdtemp(prefix=f"journal-bench-{mode}-", dir=directory))
        try:
            if mode == "group_commit":
                rows.append(_group_commit(run_dir, records, record_nbytes, writers))
            else:
                rows.append(_fsync_per_record(run_dir, records, record_nbytes))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import structlog

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=existing_folder, default=".", help="folder on the disk to measure (default: .)")
    parser.add_argument("--records", type=int_in(1, 10**8), default=20000, help="records per mode")
    parser.add_argument("--record-nbytes", type=int_in(1, 64 * 2**20), default=100, help="payload bytes per record")
    parser.add_argument("--writers", type=int_in(1, 10**4), default=64, help="concurrent group-commit writers")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    # The journal's info events (open, close) would drown the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    rows = bench_journal(
        args.dir, records=args.records, record_nbytes=args.record_nbytes, writers=args.writers
    )
    columns = [
        "mode",
        "records",
        "seconds",
        "records_per_s",
        "fsyncs",
        "records_per_fsync",
        "ack_p50_ms",
        "ack_p99_ms",
    ]
    print_rows(rows, columns)
    write_rows(args.json, rows)
    group = next(r for r in rows if r["mode"] == "group_commit")
    speedup = group["records_per_s"] / next(
        r["records_per_s"] for r in rows if r["mode"] == "fsync_per_record"
    )
    print(
        f"group commit: {speedup:.1f}x one fsync per record; target >= 10000 records/s: "
        f"{'met' if group['records_per_s'] >= 10000 else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
