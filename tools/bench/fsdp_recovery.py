"""FSDP under FaultTolerance: recovery from the ring copies in memory against the checkpoint.

    python tools/bench/fsdp_recovery.py --json out/fsdp_recovery.json [--trials 3] [--nproc 3]

Runs ``tools/fsdp_workload.py`` (an MLP of 4 FSDP units of 512 x 512, Adam) under ``rtxnet-run``:

- fault-free, ``--mode plain`` (the anchor: no ring copies) against ``--mode memory``
  (``FaultTolerance(sharded_state=True)``): the median step period (one step's start to the next,
  the vote included) and what the ring copy adds to it, with the bytes of one rank's state;
- a SIGKILL of rank 1 at step 25 with ``--min-ranks nproc - 1`` (the survivors go on alone), in
  ``--mode memory`` and in ``--mode checkpoint`` (a sharded checkpoint every 10 steps, the
  anchor): detection latency, time to recover (injection until training runs again) and steps
  lost, per trial, from the ranks' FaultTolerance events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from faultrun import run_plan  # noqa: E402

from rtxnet.config import int_in, output_file  # noqa: E402

WORKLOAD = ["tools/fsdp_workload.py", "--steps", "40"]


def fault_free(mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rtxnet-fsdpbench-") as tmp:
        proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc),
                               *WORKLOAD, "--mode", mode, "--out", tmp],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"fault-free {mode} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
        ranks = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
    return {"mode": mode, "period_median_s": statistics.median(r["period_median_s"] for r in ranks),
            "state_bytes": max(r["state_bytes"] for r in ranks), "steps": min(r["steps"] for r in ranks)}


def faulted(mode: str, nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rtxnet-fsdpbench-") as tmp:
        res = run_plan("kill:rank=1:step=25", [*WORKLOAD, "--mode", mode, "--out", tmp],
                       nproc=nproc, min_ranks=nproc - 1, timeout=300)
        ranks = [json.loads(p.read_text()) for p in Path(tmp).glob("rank*.json")]
    rec = res["summary"]["recoveries"]
    r = rec[0] if rec else {}
    return {"mode": mode, "returncode": res["returncode"], "finished": len(ranks),
            "steps": min((x["steps"] for x in ranks), default=None),
            "detection_latency_s": r.get("detection_latency_s"),
            "time_to_recover_s": r.get("time_to_recover_s"), "steps_lost": r.get("steps_lost")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, type=output_file,
                    help="write the fault-free runs, every trial and the summary here as JSON")
    ap.add_argument("--trials", type=int_in(1, 10**3), default=3,
                    help="SIGKILL trials per recovery mode (memory, checkpoint), 1..1000 (default 3)")
    ap.add_argument("--nproc", type=int_in(2, 64), default=3,
                    help="ranks per run, 2..64; after the kill nproc-1 go on (default 3)")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.nproc < 2:
        ap.error(f"--trials({args.trials}) must be >= 1 and --nproc({args.nproc}) >= 2")
    free = [fault_free(m, args.nproc) for m in ("plain", "memory")]
    plain, memory = free
    overhead = memory["period_median_s"] - plain["period_median_s"]
    print(f"{'fault-free':<12} {'step period p50':>16} {'state/rank':>11}")
    for f in free:
        print(f"{f['mode']:<12} {f['period_median_s'] * 1000:>13.1f} ms {f['state_bytes'] / 2**20:>7.1f} MiB")
    print(f"ring copy adds {overhead * 1000:.1f} ms per step "
          f"({overhead / plain['period_median_s']:+.0%} of the plain step)\n")
    rows = []
    for mode in ("memory", "checkpoint"):
        for i in range(args.trials):
            row = {**faulted(mode, args.nproc), "trial": i}
            rows.append(row)
            print(f"{mode:<11} trial {i}: exit {row['returncode']} finished {row['finished']} ranks at "
                  f"step {row['steps']}, detected {row['detection_latency_s']} s, recovered "
                  f"{row['time_to_recover_s']} s, steps lost {row['steps_lost']}", flush=True)
    summary = []
    print(f"\n{'recovery':<11} {'trials':>6} {'detect p50':>11} {'recover p50':>12} {'steps lost':>10}")
    for mode in ("memory", "checkpoint"):
        ks = [r for r in rows if r["mode"] == mode]
        det = [r["detection_latency_s"] for r in ks if r["detection_latency_s"] is not None]
        rec = [r["time_to_recover_s"] for r in ks if r["time_to_recover_s"] is not None]
        s = {"mode": mode, "trials": len(ks),
             "all_finished": all(r["steps"] == 40 and r["finished"] == args.nproc - 1 for r in ks),
             "detect_p50_s": statistics.median(det) if det else None,
             "recover_p50_s": statistics.median(rec) if rec else None,
             "steps_lost": sorted({r["steps_lost"] for r in ks}, key=lambda v: (v is None, v))}
        summary.append(s)
        fmt = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
        print(f"{mode:<11} {s['trials']:>6} {fmt(s['detect_p50_s']):>11} {fmt(s['recover_p50_s']):>12} "
              f"{str(s['steps_lost']):>10}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "nproc": args.nproc, "fault_free": free, "ring_overhead_s": overhead,
            "ring_overhead_fraction": overhead / plain["period_median_s"],
            "rows": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
