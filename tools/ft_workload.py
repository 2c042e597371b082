"""A numeric workload with a known right answer, for fault-tolerance tests and the recovery benchmark.

    rtxnet-run --nproc 4 [--faults PLAN] tools/ft_workload.py --steps 60 --out DIR

The state is an int64 vector ``x``. At every step the work is split into 12 shards; the rank
handling shard ``s`` (``s % world_size == rank``) adds ``(x * (s + 1) + 7919 * step + s) % P`` into
a contribution, the contributions are all-reduced (SUM), and ``x = (x + total) % P``. Integer
arithmetic makes the result exact and independent of the world size, so any run, however many
ranks it loses or gains, must end with the same ``x`` as :func:`reference`. Each rank writes
``DIR/final-<pid>.json`` with its final step, the rank, world size and epoch of that step, the
SHA-256 of ``x`` and its recovery events.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

SHARDS = 12
P = 1_000_003


def initial(dim: int) -> np.ndarray:
    return (np.arange(dim, dtype=np.int64) * 31 + 17) % P


def contribution(x: np.ndarray, step: int, shards) -> np.ndarray:
    c = np.zeros_like(x)
    for s in shards:
        c += (x * (s + 1) + 7919 * step + s) % P
    return c


def reference(steps: int, dim: int) -> str:
    x = initial(dim)
    for step in range(steps):
        x = (x + contribution(x, step, range(SHARDS))) % P
    return hashlib.sha256(x.tobytes()).hexdigest()


class State:
    def __init__(self, dim: int):
        self.x = initial(dim)

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, d):
        self.x = d["x"].copy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--step-sleep", type=float, default=0.02, help="seconds of 'compute' per step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rejoin-window", type=float, default=30.0)
    ap.add_argument("--store-every-step", action="store_true",
                    help="each rank also sets a key of the job's store at every step")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import rtxnet

    try:
        pg = rtxnet.init()
    except rtxnet.JobFinishedError as exc:
        # a replacement that arrived after the others finished: their result stands
        print(f"this rank came back after the job finished: {exc}", file=sys.stderr)
        return 0
    except rtxnet.RtxError as exc:   # refused (wrong token, other bounds) or timed out: one line
        print(f"ft_workload: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    state = State(args.dim)
    ft = rtxnet.FaultTolerance(pg, state, rejoin_window_s=args.rejoin_window)
    started = time.monotonic()
    world = (pg.rank, pg.world_size, pg.epoch)
    try:
        while ft.step < args.steps:
            with ft.guard() as step:
                world = (pg.rank, pg.world_size, pg.epoch)   # the world this step runs in
                shards = [s for s in range(SHARDS) if s % pg.world_size == pg.rank]
                c = contribution(state.x, step, shards)
                time.sleep(args.step_sleep)
                if args.store_every_step:
                    pg.store.set(f"ft_workload/rank{pg.rank}", str(step))
                pg.all_reduce(c)
                state.x = (state.x + c) % P
        # training is over: no rank joins now (a replacement restarted in the last steps was
        # admitted after them without it, stranded alone when the others left, and rtxnet-run
        # stopped it: exit 143 for a job that succeeded, a clean-clone run's find)
        ft.finish()
    except rtxnet.JobFinishedError as exc:
        print(f"this rank was away until the job finished: {exc}", file=sys.stderr)
        pg.close()
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        # the last step's world: the others may leave (a new epoch) before this line runs
        "pid": os.getpid(), "rank": world[0], "world_size": world[1], "epoch": world[2],
        "steps": ft.step, "sha256": hashlib.sha256(state.x.tobytes()).hexdigest(),
        "restart_count": int(os.environ.get("RTXNET_RESTART_COUNT", "0")),
        "events": ft.events, "seconds": time.monotonic() - started,
    }
    (out / f"final-{os.getpid()}.json").write_text(json.dumps(result))
    # No barrier needed: the last step's commit was decided for every member at once, so nobody
    # still needs a collective with a rank that leaves now.
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
