"""A rank of the checkpoint tests, run under ``python -m rtxnet.launcher --nproc 2``.

    ckpt_worker.py ROOT OUT_DIR

Scenarios, in order, all ranks together:
    1. save step 1 (model, optimizer, step, sampler, RNG) and load it back;
    2. rank 1's state cannot be serialised at step 2: the save must fail on every rank;
    3. a crash left step 3 half-written (garbage shard, stray temp file, no manifest): saving
       step 3 again succeeds;
    4. saving step 1 again over its complete checkpoint succeeds.
Each rank writes ``OUT_DIR/ckpt-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

import rtxnet
from rtxnet import checkpoint
from rtxnet.parallel import DistributedDataParallel
from rtxnet.sampler import ElasticDistributedSampler
from tests.procs import leave_together


def main() -> int:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    # A generous heartbeat timeout: a loaded 2-core machine must not fence a slow rank out.
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=5.0, op_s=30, rendezvous_s=120))
    r = pg.rank
    res: dict = {"rank": r}
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ddp = DistributedDataParallel(net, pg)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sampler = ElasticDistributedSampler(100, 8, rank=r, world_size=pg.world_size, seed=3)
    for _ in range(3):
        b = sampler.next_batch()
        x = torch.randn(b.local_n, 6)
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    def state(step):
        return {"model": ddp.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "sampler": sampler.state_dict(), "rng": checkpoint.capture_rng()}

    # 1. round trip
    s1 = state(1)
    checkpoint.save(root, 1, s1, pg=pg, metadata={"loss": 0.5})
    back = checkpoint.load(root, 1, pg=pg)
    res["roundtrip_model"] = all(torch.equal(back["model"][k], v) for k, v in s1["model"].items())
    res["roundtrip_sampler"] = back["sampler"] == s1["sampler"]
    res["roundtrip_opt_step"] = [int(v["step"]) for v in back["optimizer"]["state"].values()]
    torch.rand(3)
    checkpoint.restore_rng(back["rng"])
    res["rng_restored"] = torch.equal(torch.get_rng_state(), s1["rng"]["torch"])

    # 2. one rank fails
    bad = state(2)
    if r == 1:
        bad["oops"] = lambda: None          # torch.save cannot pickle it
    try:
        checkpoint.save(root, 2, bad, pg=pg)
        res["fail_all"] = "no error"
    except checkpoint.CheckpointError as exc:
        res["fail_all"] = {"ranks": exc.ranks, "msg": str(exc)}
    res["latest_after_failure"] = checkpoint.latest(root)

    # 3. half-written step 3 from an earlier crash
    if r == 0:
        d = checkpoint.step_dir(root, 3)
        d.mkdir(parents=True, exist_ok=True)
        (d / "rank-0.pt").write_bytes(b"torn")
        (d / ".rank-1.pt.tmp-999-deadbeef").write_bytes(b"torn temp")
    pg.barrier()
    res["latest_half_written"] = checkpoint.latest(root)
    checkpoint.save(root, 3, state(3), pg=pg)
    res["latest_after_resave"] = checkpoint.latest(root)
    res["stray_temps"] = sorted(p.name for p in checkpoint.step_dir(root, 3).glob(".*"))

    # 4. save over a complete step
    checkpoint.save(root, 1, state(1), pg=pg, keep=2)
    res["steps_after_keep"] = sorted(p.name for p in root.iterdir())

    # 5. a NumPy array (torch.load(weights_only=True) would refuse it): refused at save time
    try:
        checkpoint.save(root, 5, {**state(5), "extra": {"mask": np.ones(3)}}, pg=pg)
        res["numpy_refused"] = "no error"
    except checkpoint.CheckpointError as exc:
        res["numpy_refused"] = {"ranks": exc.ranks, "msg": str(exc)}

    # 6. ranks asking for different steps: refused on every rank before anything is written
    try:
        checkpoint.save(root, 10 + r, state(10 + r), pg=pg)
        res["steps_mismatch"] = "no error"
    except rtxnet.CollectiveMismatchError as exc:
        res["steps_mismatch"] = {"values": {str(k): v for k, v in exc.values.items()}, "msg": str(exc)}
    res["steps_after_mismatch"] = sorted(p.name for p in root.iterdir())
    (out / f"ckpt-rank{r}.json").write_text(json.dumps(res))
    leave_together(pg, "ckpt", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
