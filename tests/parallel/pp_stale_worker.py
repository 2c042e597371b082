"""A rank of the stale-stage test, run as ``rtxnet-run --nproc 3 --max-restarts 1``.

    pp_stale_worker.py OUT_DIR SCHEDULE

Three stages on the world (stage s on rank s) train one step; then launch rank 0's first process
kills itself, so the survivors are renumbered 0, 1 and the replacement takes rank 2: the world
has 3 ranks again, but the survivors' stages (1 and 2) now run on ranks 0 and 1. Every rank runs
one step with the stage it holds (the replacement's is new, stage 2 on rank 2) and writes
``OUT_DIR/stale.LAUNCH_RANK.json`` with what it raised and how long that took; then every rank
rebuilds its stage as stage ``pg.rank`` and runs one more step (the last stage writes its loss
and one process's on the same batch).
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
from rtxnet.parallel import PipelineStage, Schedule1F1B, ScheduleGPipe
from tests.parallel.pp_rejoin_worker import (  # the same 3-stage model
    LOSS,
    batch,
    last_step,
    part,
    wait_for_replacement,
)

OP_S = 20


def step(sched, stage, seed: int):
    x, y = batch(seed)
    return sched.step(x if stage.is_first else None, y if stage.is_last else None)


def main() -> int:
    out, schedule = Path(sys.argv[1]), {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sys.argv[2]]
    torch.set_num_threads(1)
    first = os.environ.get("RTXNET_RESTART_COUNT", "0") == "0"
    if not first:
        # the replacement joins once the survivors were renumbered 0, 1 in a world of 2: joined
        # with the loss still being handled, it could take rank 0 and leave them theirs
        deadline = time.monotonic() + 60
        while not (out / "shrunk").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the survivors never saw a world of 2")
            time.sleep(0.05)
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=2.0, op_s=OP_S, rendezvous_s=120))
    launch = int(os.environ["RTXNET_RANK"])
    stage = PipelineStage(part(pg.rank), pg)
    sched = schedule(stage, 3, LOSS)
    if first:
        step(sched, stage, 0)
        # rank 0 dies only once every rank has ended step 0: killed right after its own end, its
        # last messages of the step's closing all_reduce could go with it, and the others failed
        # step 0, outside the try below (a CI run)
        pg.store.set(f"step0/{launch}", b"1")
        if launch == 0:
            pg.store.wait([f"step0/{r}" for r in range(3)], timeout=60)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            step(sched, stage, 1)
        except rtxnet.RtxError:
            pass
        deadline = time.monotonic() + 60
        while pg.world_size != 2:
            if time.monotonic() > deadline:
                raise SystemExit("no world of 2 within 60 s")
            time.sleep(0.05)
        (out / "shrunk").touch()
        wait_for_replacement(pg)
    # the stages as they are: the survivors' were built before the renumbering
    t0 = time.monotonic()
    got = {"rank": pg.rank, "stage": stage.stage_index}
    try:
        step(sched, stage, 2)
        got["error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        got.update(error=type(exc).__name__, message=str(exc),
                   attrs=[getattr(exc, "stage_index", None), getattr(exc, "rank", None)])
    got["seconds"] = round(time.monotonic() - t0, 2)
    (out / f"stale.{launch}.json").write_text(json.dumps(got))
    last_step(pg, out, launch, "pp-stale", schedule)   # rebuilt, the same group object goes on
    return 0


if __name__ == "__main__":
    sys.exit(main())
