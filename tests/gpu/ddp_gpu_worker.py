"""A rank of the DDP-on-CUDA test, run under ``python -m rtxnet.launcher``.

    ddp_gpu_worker.py OUT_DIR

Each rank trains on GPU ``LOCAL_RANK % device_count`` (ranks share the GPU on a one-GPU host) and
also computes the single-process reference on the whole global batch, on the same GPU. Writes
``OUT_DIR/rank<r>.json``. Model, data and tolerances come from ``tests/parallel/ddp_worker.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import rtxnet
from tests.parallel.ddp_worker import equivalence_avg
from tests.procs import leave_together


def run(pg, device: torch.device) -> dict:
    a = equivalence_avg(pg, device=device)
    return {"rank": pg.rank, "world_size": pg.world_size, "device": str(device),
            "buckets": a["avg_buckets"], "bucket_devices": a["avg_bucket_devices"],
            "init_rel": a["init_broadcast_rel"], "rel": a["avg_rel"],
            "never_grad_is_none": a["avg_never_grad_is_none"], "sum": a["avg_sum"]}


def main() -> int:
    out = Path(sys.argv[1])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=5.0, op_s=30, rendezvous_s=120))
    res = run(pg, device)
    (out / f"rank{pg.rank}.json").write_text(json.dumps(res))
    leave_together(pg, "ddp_gpu", pg.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
