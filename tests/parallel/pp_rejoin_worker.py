"""A rank of the pipeline-after-a-replacement test, run as ``rtxnet-run --nproc 3 --max-restarts 1``.

    pp_rejoin_worker.py OUT_DIR

Three stages (one per rank) train two GPipe steps; then launch rank 2's first process kills
itself, the survivors' step fails (PeerLostError or a timeout), they wait until the replacement
has joined (world of 3 again), and every rank builds a new PipelineStage on the same process
group and runs one more step from the same parameters. Without FaultTolerance the state is set
by hand: each rank rebuilds its part from the seed (the replacement has nothing else). The last
stage writes ``OUT_DIR/loss.json`` with the pipeline's loss and one process's on the same batch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import rtxnet
from rtxnet.parallel import PipelineStage, ScheduleGPipe
from tests.procs import leave_together

LOSS = torch.nn.functional.cross_entropy


def model() -> torch.nn.Sequential:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 4))


def part(s: int) -> torch.nn.Sequential:
    m = model()
    return torch.nn.Sequential(*[m[0:2], m[2:4], m[4:5]][s])


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 6, generator=g), torch.randint(0, 4, (12,), generator=g)


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=2.0, op_s=20, rendezvous_s=120))
    first = os.environ.get("RTXNET_RESTART_COUNT", "0") == "0"
    launch = int(os.environ["RTXNET_RANK"])
    if first:
        stage = PipelineStage(part(pg.rank), pg)
        sched = ScheduleGPipe(stage, 3, LOSS, timeout_s=20)
        for i in range(2):
            x, y = batch(i)
            sched.step(x if stage.is_first else None, y if stage.is_last else None)
        if launch == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            x, y = batch(2)
            sched.step(x if stage.is_first else None, y if stage.is_last else None)
        except rtxnet.RtxError:
            pass
        wait_for_replacement(pg)
    last_step(pg, out, launch, "pp-rejoin")     # same group object, a new epoch
    return 0


def wait_for_replacement(pg, world: int = 3) -> None:
    """Wait (up to 60 s) until the replacement has joined the running job."""
    deadline = time.monotonic() + 60
    while pg.world_size < world:
        if time.monotonic() > deadline:
            raise SystemExit("no replacement within 60 s")
        time.sleep(0.05)


def last_step(pg, out: Path, launch: int, tag: str, schedule=ScheduleGPipe) -> None:
    """Build this rank's stage as stage ``pg.rank`` and run one step on batch 5; the last stage
    writes its loss and one process's to ``out/loss.json``; then leave with the others."""
    stage = PipelineStage(part(pg.rank), pg)
    x, y = batch(5)
    loss = schedule(stage, 3, LOSS, timeout_s=20).step(x if stage.is_first else None,
                                                        y if stage.is_last else None)
    if stage.is_last:
        (out / "loss.json").write_text(json.dumps({"pipeline": float(loss),
                                                   "one_process": float(LOSS(model()(x), y))}))
    leave_together(pg, tag, launch, timeout_s=60)


if __name__ == "__main__":
    sys.exit(main())
