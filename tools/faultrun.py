"""Fault-injection runner: run a training script under a fault plan and report recovery metrics.

    python tools/faultrun.py --plan "kill:rank=2:step=30" --nproc 4 [--min-ranks 3] \\
        [--max-restarts 1] [--json PATH] -- examples/train_digits.py --out out/digits

It runs ``rtxnet-run`` with ``--faults PLAN`` and ``RTXNET_METRICS_DIR`` pointing at a temporary
folder where every rank's :class:`rtxnet.FaultTolerance` appends its failure and recovery events,
then prints, per fault: when it was injected, how long until the survivors detected it
(detection latency), how long until training ran again (time to recover) and how many steps were
redone (steps lost). A coordinator kill shows as a commit stall: training waited for the restarted
coordinator and lost nothing. The exit code is the launcher's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def read_events(folder: Path) -> list[dict]:
    events = []
    for f in sorted(folder.glob("events-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def summarize(events: list[dict]) -> dict:
    """Per failure (grouped by the epoch it opened): worst detection/recovery over the ranks."""
    recovered = [e for e in events if e["event"] == "recovered"]
    stalls = [e for e in events if e["event"] == "commit_stall"]
    out = {"recoveries": [], "stalls": []}
    by_epoch: dict[int, list[dict]] = {}
    for e in recovered:
        by_epoch.setdefault(e["epoch"], []).append(e)
    for epoch, es in sorted(by_epoch.items()):
        det = [e["detection_latency_s"] for e in es if e["detection_latency_s"] is not None]
        out["recoveries"].append({
            "epoch": epoch,
            "error": es[0]["error"],
            "lost": es[0]["lost"],
            "ranks_reporting": len(es),
            "detection_latency_s": max(det) if det else None,
            "time_to_recover_s": max(e["time_to_recover_s"] for e in es),
            "steps_lost": max(e["steps_lost"] for e in es),
        })
    if stalls:
        worst = max(stalls, key=lambda e: e["seconds"])
        out["stalls"].append({"step": worst["step"], "seconds": worst["seconds"],
                              "time_to_recover_s": worst["time_to_recover_s"]})
    return out


def run_plan(plan: str, script_and_args: list[str], *, nproc: int = 4, min_ranks: int | None = None,
             max_restarts: int = 0, env: dict | None = None, timeout: float = 600,
             quiet: bool = True) -> dict:
    """Run one job under ``plan``; returns ``{"returncode", "events", "summary", "stderr"}``."""
    with tempfile.TemporaryDirectory(prefix="rtxnet-faultrun-") as tmp:
        e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                 RTXNET_METRICS_DIR=tmp, **(env or {}))
        cmd = [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc), "--max-restarts", str(max_restarts),
               "--faults", plan]
        if min_ranks is not None:
            cmd += ["--min-ranks", str(min_ranks)]
        proc = subprocess.run(cmd + script_and_args, cwd=ROOT, env=e, timeout=timeout,
                              capture_output=quiet, text=True)
        events = read_events(Path(tmp))
    return {"returncode": proc.returncode, "events": events, "summary": summarize(events),
            "stderr": proc.stderr if quiet else ""}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", required=True, help="fault plan, e.g. 'kill:rank=2:step=30' (see README)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--min-ranks", type=int, default=None)
    ap.add_argument("--max-restarts", type=int, default=0)
    ap.add_argument("--json", default=None, help="write events and summary here")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the script to run after --")
    res = run_plan(args.plan, script, nproc=args.nproc, min_ranks=args.min_ranks,
                   max_restarts=args.max_restarts, quiet=False)
    print(f"\nfault plan: {args.plan}")
    for r in res["summary"]["recoveries"]:
        det = "n/a" if r["detection_latency_s"] is None else f"{r['detection_latency_s'] * 1000:.0f} ms"
        print(f"  epoch {r['epoch']}: {r['error']} lost={r['lost']}  detected after {det}, "
              f"recovered after {r['time_to_recover_s'] * 1000:.0f} ms, steps lost {r['steps_lost']}")
    for s in res["summary"]["stalls"]:
        print(f"  a step's vote waited {s['seconds']:.2f} s at step {s['step']} (the coordinator away, or a peer late); no step lost")
    if not res["summary"]["recoveries"] and not res["summary"]["stalls"]:
        print("  no failure was observed by the ranks")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res["returncode"]


if __name__ == "__main__":
    sys.exit(main())
