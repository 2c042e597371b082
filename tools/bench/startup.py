"""Start-up and replacement benchmark: rtxnet-run's rank fork server against fresh interpreters.

    python tools/bench/startup.py --json out/startup.json [--trials 3] [--nproc 4]

Each trial runs the README's first command (``examples/train_digits.py`` under ``rtxnet-run
--max-restarts 1 --faults kill:rank=2:step=S``: rank 2 is SIGKILLed at step S and a replacement
started) with ``--preload auto`` (ranks, the replacement included, forked from one server that
imported torch, ``torch._dynamo`` and rtxnet's dependencies) and with ``--preload none`` (every
rank process a fresh interpreter importing them itself, as torchrun's workers do: the anchor,
measured in the same run, trials alternating). Per mode it reports the median over the trials of:

- ``wall_s``: the whole command, start to exit;
- ``cpu_s``: the CPU time (user + system) of rtxnet-run and everything it started (the
  coordinator, the ranks, the server: ``getrusage(RUSAGE_CHILDREN)``, which counts each process
  once its parent has waited for it, as each parent here does);
- ``resumed_s``: from the fault to training running again with 4 ranks (rank 0's
  ``time_to_recover_s`` in ``metrics.json``): the replacement's start, its join and its state.

A trial whose command does not exit 0, or whose report lacks the recovery, fails the benchmark;
one whose rank 0 saw the loss between two steps (no step failed, nothing to time) runs again, up
to 3 times.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import print_rows, write_rows  # noqa: E402

from rtxnet.config import int_in, output_file  # noqa: E402

MODES = ("none", "auto")   # the anchor first


_ATTEMPTS = 3   # runs of one trial, when rank 0 saw the loss between two steps (see trial)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def trial(mode: str, nproc: int, steps: int, kill_step: int, workdir: Path) -> dict | None:
    """One run of the command with ``--preload mode``; its figures, or None when rank 0 saw the
    loss between two steps (``lost_between_steps``: on loaded cores rank 0 may end step S-1 after
    rank 2 died at the start of step S), which fails no step and so times no recovery.

    Raises:
        RuntimeError: the command failed, or rank 0 reported neither a recovery nor that loss.
    """
    out = workdir / f"digits-{mode}"
    cmd = [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc), "--max-restarts", "1",
           "--faults", f"kill:rank=2:step={kill_step}", "--preload", mode,
           str(ROOT / "examples" / "train_digits.py"), "--out", str(out), "--steps", str(steps)]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"--preload {mode}: exit code {proc.returncode}:\n{proc.stderr[-3000:]}")
    events = json.loads((out / "metrics.json").read_text())["events"]
    resumed = [e["time_to_recover_s"] for e in events
               if e.get("event") == "recovered" and e.get("time_to_recover_s") is not None]
    if not resumed and any(e.get("event") == "lost_between_steps" for e in events):
        return None
    if not resumed:
        raise RuntimeError(f"--preload {mode}: no recovery in rank 0's report: {events}")
    return {"preload": mode, "wall_s": wall, "cpu_s": cpu, "resumed_s": max(resumed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, type=output_file, help="write the rows here")
    ap.add_argument("--trials", type=int_in(1, 100), default=3, help="runs per mode (default 3)")
    ap.add_argument("--nproc", type=int_in(3, 16), default=4, help="ranks (default 4; rank 2 is killed)")
    ap.add_argument("--steps", type=int_in(20, 10**5), default=60, help="training steps (default 60)")
    args = ap.parse_args(argv)
    kill_step = args.steps // 2
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="rtxnet-bench-startup-") as tmp:
        for i in range(args.trials):
            for mode in MODES:
                for attempt in range(1, _ATTEMPTS + 1):   # (a loss between steps times nothing)
                    r = trial(mode, args.nproc, args.steps, kill_step, Path(tmp) / f"{i}-{attempt}")
                    if r is not None:
                        break
                    print(f"trial {i + 1}/{args.trials} --preload {mode}: rank 0 saw the loss between "
                          f"two steps (no recovery to time); run again", flush=True)
                else:
                    raise RuntimeError(f"--preload {mode}: rank 0 saw the loss between two steps in "
                                       f"{_ATTEMPTS} runs in a row: no recovery to time")
                runs[mode].append(r)
                print(f"trial {i + 1}/{args.trials} --preload {mode}: wall {r['wall_s']:.2f} s, "
                      f"cpu {r['cpu_s']:.2f} s, resumed {r['resumed_s']:.2f} s", flush=True)
    rows = []
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in ("wall_s", "cpu_s", "resumed_s")}
        rows.append({"preload": mode, "anchor": mode == "none", "nproc": args.nproc, "steps": args.steps,
                     "trials": args.trials, **{k: round(v, 3) for k, v in med.items()},
                     "runs": runs[mode]})
    base = rows[0]
    for row in rows:
        for k in ("wall_s", "cpu_s", "resumed_s"):
            row[f"{k.removesuffix('_s')}_vs_anchor"] = round(row[k] / base[k], 3) if base[k] else None
    print_rows(rows, ["preload", "nproc", "trials", "wall_s", "cpu_s", "resumed_s", "wall_vs_anchor",
                      "cpu_vs_anchor", "resumed_vs_anchor"])
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
