"""rtxnet.checkpoint's save and load of one shard of N MB, and how long each held the GIL.

Run from the repository root::

    python -m tools.bench.checkpoint_io --mb 64 256 1024 --json out/checkpoint_io.json

For each size a state ``{"w": float32 tensor of N MB (2**20 bytes)}`` is, with a thread beside it
that sleeps 10 ms at a time, as the agent's heartbeat loop wakes (every 0.2 s by default; the
coordinator declares a rank lost after 2 s without one):

- ``save``: ``checkpoint.save(root, step, state)`` (one process: serialise to a temporary file,
  fsync, SHA-256, rename, manifest), a new step each run;
- ``load``: ``checkpoint.load(root, step)`` (SHA-256 checked, then ``torch.load``);
- ``save_bytesio`` / ``load_bytesio``: what rtxnet did before: ``torch.save`` into an
  ``io.BytesIO`` (then SHA-256, write, fsync) and ``torch.load`` from one (after reading the file
  whole and its SHA-256). The copies into and out of the ``BytesIO`` hold the GIL throughout;
- ``write_fsync`` (the anchor): the serialised bytes written to a file and fsynced, the least a
  durable save can cost.

``max_stall_ms`` is the longest the sleeping thread waited beyond its 10 ms. Each figure is the
median of ``--repeat`` runs. Files go to ``--dir`` (default: a temporary folder, removed after).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # run as a script: tools.bench.report
    sys.path.insert(0, str(ROOT))

from rtxnet import checkpoint  # noqa: E402
from rtxnet.config import existing_folder, int_in, memory_for, output_file  # noqa: E402
from tools.bench.report import print_rows, write_rows  # noqa: E402
from tools.bench.snapshot import _timed  # noqa: E402

__all__ = ["bench_checkpoint_io"]


def _write_fsync(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def bench_checkpoint_io(sizes_mb: list[int], folder: Path, *, repeat: int = 3) -> list[dict]:
    """Measure checkpoint.save / load against the BytesIO way and a plain write + fsync.

    Args:
        sizes_mb: shard sizes in MB (``2**20`` bytes), each at least 1.
        folder: an existing folder for the files (each size's are removed after it).
        repeat: runs per figure (the median is reported), at least 1.

    Returns:
        One row per (size, op): ``{"bench": "checkpoint_io", "mb": N, "op": "save" | "load" |
        "save_bytesio" | "load_bytesio" | "write_fsync", "seconds": s, "gb_per_s": r,
        "max_stall_ms": m, "anchor": "write_fsync", "vs_anchor": seconds / the anchor's}``.

    Raises:
        ValueError: a size below 1 or ``repeat`` below 1 (names the value).
        AssertionError: a loaded state differs from the saved one.
    """
    if repeat < 1 or any(mb < 1 for mb in sizes_mb):
        raise ValueError(f"need every size >= 1 MB and repeat >= 1, got sizes {sizes_mb} and repeat {repeat}")
    rows = []
    for mb in sizes_mb:
        w = torch.rand(mb * 2**20 // 4, generator=torch.Generator().manual_seed(0))
        state = {"w": w}
        root = folder / f"mb{mb}"
        steps = iter(range(1, 1_000_000))

        def save(root=root, state=state, steps=steps):
            checkpoint.save(root, next(steps), state, keep=1)

        def save_bytesio(root=root, state=state):
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getvalue()
            hashlib.sha256(data).digest()
            _write_fsync(root / "bytesio.pt", data)

        def load(root=root, w=w, mb=mb):
            got = checkpoint.load(root)["w"]
            if not torch.equal(got, w):
                raise AssertionError(f"{mb} MB: checkpoint.load differs from what was saved")

        def load_bytesio(root=root, w=w, mb=mb):
            data = (root / "bytesio.pt").read_bytes()
            hashlib.sha256(data).digest()
            got = torch.load(io.BytesIO(data), weights_only=True)["w"]
            if not torch.equal(got, w):
                raise AssertionError(f"{mb} MB: torch.load of the BytesIO differs from what was saved")

        root.mkdir(parents=True, exist_ok=True)
        serialised = io.BytesIO()
        torch.save(state, serialised)
        data = serialised.getvalue()
        del serialised
        ops = {"write_fsync": lambda r=root, d=data: _write_fsync(r / "plain.bin", d),
               "save": save, "save_bytesio": save_bytesio, "load": load, "load_bytesio": load_bytesio}
        timed = {op: _timed(fn, repeat) for op, fn in ops.items()}
        for op, (secs, stall) in timed.items():
            rows.append({"bench": "checkpoint_io", "mb": mb, "op": op, "seconds": round(secs, 4),
                         "gb_per_s": round(len(data) / secs / 1e9, 2),
                         "max_stall_ms": round(stall * 1e3, 1), "anchor": "write_fsync",
                         "vs_anchor": round(secs / timed["write_fsync"][0], 2)})
        del data, w, state
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int_in(1, 64 * 1024), nargs="+", default=[64, 256, 1024],
                        help="shard sizes in MB (default 64 256 1024)")
    parser.add_argument("--repeat", type=int_in(1, 100), default=3, help="runs per figure (median)")
    parser.add_argument("--dir", type=existing_folder, default=None,
                        help="folder for the files (default: a temporary folder, removed after)")
    parser.add_argument("--json", metavar="PATH", type=output_file, help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    # the tensor saved and the one loaded back
    if why := memory_for(f"--mb {max(args.mb)}", 2 * max(args.mb) << 20):
        parser.error(why)
    with tempfile.TemporaryDirectory(prefix="rtxnet-ckpt-bench-", dir=args.dir) as d:
        rows = bench_checkpoint_io(args.mb, Path(d), repeat=args.repeat)
    print_rows(rows, ["mb", "op", "seconds", "gb_per_s", "max_stall_ms", "anchor", "vs_anchor"])
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
