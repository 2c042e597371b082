"""Recovery benchmark: SIGKILL, SIGSTOP, coordinator kill and a lost message, repeated, with
default timeouts.

    python tools/bench/recovery.py --json out/recovery.json [--trials 20]

Each trial runs the 4-rank numeric job of ``tools/ft_workload.py`` under ``rtxnet-run`` with one
injected fault and checks that every surviving rank ends with the exact reference result. Per
fault kind it reports p50 and p99 of the detection latency (injection until the survivors know)
and of the time to recover (injection until training runs again), and the steps lost. For a
coordinator kill the ranks never stop training; what is measured is how long a step's vote waited
for the restarted coordinator, and that no committed step was lost.

Heartbeats use the defaults (every 0.2 s, declared lost after 2 s). Targets (issue 4): SIGKILL
detected in <= 0.5 s and recovered in <= 2 s at p50; SIGSTOP detected in <= 2.5 s; zero committed
steps lost to a coordinator kill. A lost message (``lose-message``) is found by the probe of the
rank waiting for it after the heartbeat timeout plus one interval (2.2 s); before the probes it
cost the op timeout (60 s by default).

The anchor, from torch elastic's defaults for the same faults: a dead rank is found by the
rendezvous keep-alive (every 5 s, 3 misses: ~15 s) or, while the others wait in an NCCL
collective, by the NCCL timeout (10 min); then every worker is restarted from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from faultrun import run_plan  # noqa: E402
from ft_workload import reference  # noqa: E402

from rtxnet.config import int_in, output_file  # noqa: E402

KINDS = {
    "SIGKILL": ("kill:rank=2:step=15", dict(min_ranks=3), 40),
    "SIGSTOP": ("pause:rank=2:step=15:seconds=3", dict(min_ranks=3), 40),
    "coordinator-kill": ("kill-coordinator:step=15", {}, 40),
    # a collective message lost between live ranks (a connection reset under ZeroMQ): found by
    # the waiting rank's probe after the heartbeat timeout plus one interval, where the op
    # timeout (60 s by default) was paid before
    "lost-message": ("lose-message:rank=2:step=15", {}, 40),
}


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def trial(kind: str, workdir: Path) -> dict:
    plan, kw, steps = KINDS[kind]
    out = workdir / "out"
    res = run_plan(plan, ["tools/ft_workload.py", "--steps", str(steps), "--out", str(out)], **kw)
    want = reference(steps, 1024)
    finals = [json.loads(p.read_text()) for p in out.glob("final-*.json")]
    correct = bool(finals) and all(f["sha256"] == want and f["steps"] == steps for f in finals)
    s = res["summary"]
    row = {"kind": kind, "plan": plan, "correct": correct, "ranks_finished": len(finals)}
    if kind == "coordinator-kill":
        stall = s["stalls"][0] if s["stalls"] else None
        row.update(detection_latency_s=None,
                   time_to_recover_s=stall["time_to_recover_s"] if stall else 0.0,
                   steps_lost=sum(r["steps_lost"] for r in s["recoveries"]),
                   stall_s=stall["seconds"] if stall else 0.0)
    else:
        r = s["recoveries"][0] if s["recoveries"] else None
        row.update(detection_latency_s=r["detection_latency_s"] if r else None,
                   time_to_recover_s=r["time_to_recover_s"] if r else None,
                   steps_lost=r["steps_lost"] if r else None)
    return row


# The anchor is torch elastic's documented defaults, not a measurement (the other benchmarks
# measure theirs in the same run; this one was printed only, and out of the JSON: a tester's find)
ANCHOR = {
    "source": "torch elastic's documented defaults, not measured in this run",
    "detect_dead_rank_s": 15.0,            # rendezvous keep-alive every 5 s, 3 misses
    "detect_in_nccl_collective_s": 600.0,  # NCCL collective timeout, 10 min
    "recovery": "every worker restarted from the last checkpoint",
    "text": "torch elastic defaults for comparison: keep-alive 5 s x 3 (~15 s to notice a dead "
            "agent), NCCL collective timeout 10 min, then a restart of every worker from the last "
            "checkpoint; a lost message waits out the collective timeout there (and waited out "
            "rtxnet's 60 s op timeout before its probes).",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, type=output_file,
                    help="write every trial and the per-kind summary here as JSON")
    ap.add_argument("--trials", type=int_in(1, 10**4), default=20,
                    help="trials per fault kind, 1..10000 (default 20)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                    help=f"fault kinds to run (default all: {' '.join(KINDS)})")
    args = ap.parse_args(argv)
    rows, summary = [], []
    for kind in args.kinds:
        for i in range(args.trials):
            with tempfile.TemporaryDirectory(prefix="rtxnet-recovery-") as tmp:
                row = trial(kind, Path(tmp))
            row["trial"] = i
            rows.append(row)
            print(f"{kind:<17} trial {i:>2}: correct={row['correct']} detect={row['detection_latency_s']} "
                  f"recover={row['time_to_recover_s']} steps_lost={row['steps_lost']}", flush=True)
        ks = [r for r in rows if r["kind"] == kind]
        det = [r["detection_latency_s"] for r in ks if r["detection_latency_s"] is not None]
        rec = [r["time_to_recover_s"] for r in ks if r["time_to_recover_s"] is not None]
        summary.append({
            "kind": kind, "trials": len(ks), "all_correct": all(r["correct"] for r in ks),
            "detect_p50_s": pct(det, 50), "detect_p99_s": pct(det, 99),
            "recover_p50_s": pct(rec, 50), "recover_p99_s": pct(rec, 99),
            "steps_lost_max": max((r["steps_lost"] or 0) for r in ks),
        })
    print(f"\n{'fault':<17} {'trials':>6} {'correct':>8} {'detect p50':>11} {'detect p99':>11} "
          f"{'recover p50':>12} {'recover p99':>12} {'steps lost':>10}")
    fmt = lambda v: "n/a" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
    for s in summary:
        print(f"{s['kind']:<17} {s['trials']:>6} {str(s['all_correct']):>8} {fmt(s['detect_p50_s']):>11} "
              f"{fmt(s['detect_p99_s']):>11} {fmt(s['recover_p50_s']):>12} {fmt(s['recover_p99_s']):>12} "
              f"{s['steps_lost_max']:>10}")
    print(f"\n{ANCHOR['text']} ({ANCHOR['source']})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "anchor": ANCHOR},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
