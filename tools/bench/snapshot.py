"""FaultTolerance's per-step snapshot: rtxnet.statesync.pack_state of a state of N MB, against one
plain copy of the same bytes, and how long the GIL was held meanwhile.

Run from the repository root::

    python -m tools.bench.snapshot --mb 64 256 1024 --json out/snapshot.json

For each size a float32 array of that many MB (``2**20`` bytes) is, with a thread beside it that
sleeps 10 ms at a time, as the agent's heartbeat loop wakes (every 0.2 s by default):

- ``pack``: ``pack_state({"w": a})`` into fresh memory, as FaultTolerance's first snapshot;
- ``pack_into``: ``pack_state({"w": a}, into=...)`` over the memory of the last snapshot, as
  FaultTolerance snapshots a state after each commit (the same layout, not sent since);
- ``unpack``: ``unpack_state`` of that blob, as a rollback or a replacement loads it;
- ``memcpy`` (the anchor of ``pack``, ``unpack`` and ``tobytes``): ``np.copyto`` into a fresh
  ``np.empty`` of the same size, one copy, the least a snapshot into new memory can cost (the
  kernel zeroes each fresh page first);
- ``memcpy_into`` (the anchor of ``pack_into``): ``np.copyto`` into an array written before, the
  least a snapshot over the last one can cost;
- ``tobytes``: ``a.tobytes()``, a copy that holds the GIL throughout (pack_state made three such
  copies before; with a 2 s heartbeat timeout, a hold that long gets a rank declared lost).

``max_stall_ms`` is the longest the sleeping thread waited beyond its 10 ms: the time the copy
kept it from running. Each figure is the median of ``--repeat`` runs, after one warm-up run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # run as a script: tools.bench.report
    sys.path.insert(0, str(ROOT))

from rtxnet.config import int_in, memory_for, output_file  # noqa: E402
from rtxnet.statesync import pack_state, unpack_state  # noqa: E402
from tools.bench.report import print_rows, write_rows  # noqa: E402

__all__ = ["bench_snapshot"]


class _Stalls:
    """A thread that sleeps 10 ms at a time and records how late it woke (seconds)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - 0.01)
            last = now

    def __enter__(self) -> _Stalls:
        self._thread.start()
        time.sleep(0.05)
        self.worst = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _timed(fn, repeat: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` and median worst stall (seconds) over ``repeat`` runs, after one
    untimed warm-up run (the first touches fresh pages: with ``--repeat 1`` the anchor took
    0.012 to 0.396 s in three runs, a fresh user's find)."""
    fn()   # warm-up, its result dropped at once
    secs, stalls = [], []
    for _ in range(repeat):
        with _Stalls() as st:
            t0 = time.perf_counter()
            out = fn()
            secs.append(time.perf_counter() - t0)
        stalls.append(st.worst)
        del out
    return statistics.median(secs), statistics.median(stalls)


def bench_snapshot(sizes_mb: list[int], *, repeat: int = 3) -> list[dict]:
    """Measure pack_state / unpack_state against one plain copy, per state size.

    Args:
        sizes_mb: state sizes in MB (``2**20`` bytes), each at least 1.
        repeat: runs per figure (the median is reported), at least 1.

    Returns:
        One row per (size, op): ``{"bench": "snapshot", "mb": N, "op": "pack" | "unpack" |
        "memcpy" | "tobytes" | "pack_into" | "memcpy_into", "seconds": s, "gb_per_s": r,
        "max_stall_ms": m, "anchor": "memcpy" | "memcpy_into", "vs_anchor": seconds / the
        anchor's seconds, "vs_memcpy": seconds / the memcpy anchor's seconds}``.

    Raises:
        ValueError: a size below 1 or ``repeat`` below 1 (names the value).
    """
    if repeat < 1 or any(mb < 1 for mb in sizes_mb):
        raise ValueError(f"need every size >= 1 MB and repeat >= 1, got sizes {sizes_mb} and repeat {repeat}")
    rows = []
    for mb in sizes_mb:
        a = np.random.default_rng(0).random(mb * 2**20 // 4, dtype=np.float32)
        blob = pack_state({"w": a})
        got = unpack_state(blob)["w"]
        if not np.array_equal(got, a):
            raise AssertionError(f"{mb} MB: unpack_state(pack_state(x)) differs from x")
        del got

        def memcpy(a=a):
            out = np.empty_like(a)
            np.copyto(out, a)
            return out

        written = np.empty_like(a)
        np.copyto(written, a)
        last = pack_state({"w": a}).obj          # the last snapshot's memory, written over

        def pack_into(a=a, last=last, mb=mb):
            out = pack_state({"w": a}, into=last)
            if out.obj is not last:
                raise AssertionError(f"{mb} MB: pack_state(into=) did not reuse the memory given")
            return out

        ops = {"memcpy": memcpy, "pack": lambda a=a: pack_state({"w": a}),
               "unpack": lambda b=blob: unpack_state(b), "tobytes": a.tobytes,
               "memcpy_into": lambda a=a, w=written: np.copyto(w, a), "pack_into": pack_into}
        timed = {op: _timed(fn, repeat) for op, fn in ops.items()}
        for op, (secs, stall) in timed.items():
            anchor = "memcpy_into" if op.endswith("_into") else "memcpy"
            rows.append({"bench": "snapshot", "mb": mb, "op": op, "seconds": round(secs, 4),
                         "gb_per_s": round(a.nbytes / secs / 1e9, 2), "max_stall_ms": round(stall * 1e3, 1),
                         "anchor": anchor, "vs_anchor": round(secs / timed[anchor][0], 2),
                         "vs_memcpy": round(secs / timed["memcpy"][0], 2)})
        del blob, a, written, last
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int_in(1, 64 * 1024), nargs="+", default=[64, 256, 1024],
                        help="state sizes in MB (default 64 256 1024)")
    parser.add_argument("--repeat", type=int_in(1, 100), default=3, help="runs per figure (median)")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    # the state, its snapshot, the copies compared with it and pack_state's buffers
    if why := memory_for(f"--mb {max(args.mb)}", 5 * max(args.mb) << 20):
        parser.error(why)
    rows = bench_snapshot(args.mb, repeat=args.repeat)
    columns = ["mb", "op", "seconds", "gb_per_s", "max_stall_ms", "anchor", "vs_anchor", "vs_memcpy"]
    print_rows(rows, columns)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
