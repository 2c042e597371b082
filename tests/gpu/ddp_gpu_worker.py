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
from rtxnet.parallel import DistributedDataParallel
from tests.parallel.ddp_worker import BUCKETS, LOSS, data, flat_params, make_net, rel
from tests.procs import leave_together


def run(pg, device: torch.device, steps: int = 5, per_rank: int = 4) -> dict:
    W, r = pg.world_size, pg.rank
    B = per_rank * W
    x, y = (t.to(device) for t in data(B * steps))
    ref = make_net(1).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    net = make_net(1 if r == 0 else 100 + r).to(device)   # differs off rank 0: broadcast fixes it
    ddp = DistributedDataParallel(net, pg, **BUCKETS)
    init_rel = rel(flat_params(net), flat_params(make_net(1).to(device)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    for s in range(steps):
        xb, yb = x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]
        ref_opt.zero_grad()
        LOSS(ref(xb), yb).backward()
        ref_opt.step()
        opt.zero_grad()
        mine = slice(r * per_rank, (r + 1) * per_rank)
        LOSS(ddp(xb[mine]), yb[mine]).backward()
        opt.step()
    return {"rank": r, "world_size": W, "device": str(device), "buckets": len(ddp.buckets),
            "bucket_devices": sorted({str(b.flat.device) for b in ddp._buckets}),
            "init_rel": init_rel, "rel": rel(flat_params(net), flat_params(ref)),
            "never_grad_is_none": net.never.weight.grad is None,   # used by no rank
            "sum": float(flat_params(net).double().sum())}


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
