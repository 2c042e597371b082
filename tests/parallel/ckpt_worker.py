"""A rank of the checkpoint tests, run under ``python -m rtxnet.launcher --nproc 2``.

    ckpt_worker.py ROOT OUT_DIR

Scenarios, in order, all ranks together:
    1. save step 1 (model, optimizer, step, sampler, RNG) and load it back;
    2. rank 1's state cannot be serialised at step 2: the save must fail on every rank;
    3. a crash left step 3 half-written (garbage shard, stray temp file, no manifest): saving
       step 3 again succeeds;
    4. saving step 1 again over its complete checkpoint succeeds;
    5. a NumPy array in the state is refused at save time;
    6. ranks asking for different steps are refused before anything is written;
    7. ranks passing different roots (``ROOT/r<rank>``) are refused before anything is written;
    8. ``ROOT/held``, which another run holds (the test process), is refused on every rank;
    9. rank 0 cannot write step 40's manifest (a folder in its place): every rank names why;
    10. with a tensor-parallel layer, loading a checkpoint of a world of one is refused;
    11. one rank's bad ``keep``: the other rank is told at once;
    12. a subgroup (``pg.split``, ``pg.new_group``) as ``pg`` of save/hold/record: refused.
Each rank writes ``OUT_DIR/ckpt-rank<r>.json``.

    ckpt_worker.py ROOT OUT_DIR kill        (under ``--nproc 2 --min-ranks 1``)

Both ranks save step 1 (:func:`old_state`), then save step 1 again. In the middle of that re-save
(after serialising, before writing the shard: the ``checkpoint`` fault point) each rank writes its
pid to ``OUT_DIR/in-save-rank<r>``; rank 1 then waits for the test to SIGKILL it, and rank 0 waits
until the membership moved to the next epoch (the survivor's world of one) and only then writes
its shard and goes on to the save's next collective. Rank 0 writes what the re-save raised and
what ``latest``/``load`` give afterwards, then saves step 1 once more in its new world of one, to
``OUT_DIR/kill-rank0.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

import rtxnet
from rtxnet import checkpoint, faults
from rtxnet.parallel import ColumnParallelLinear, DistributedDataParallel
from rtxnet.sampler import ElasticDistributedSampler
from tests.procs import leave_together, wait_until


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
    checkpoint.save(root, 1, state(1), pg=pg)   # (with keep=, step 3 would go: a later step)
    res["steps_after_resave"] = sorted(p.name for p in root.iterdir())

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

    # 7. ranks passing different roots: refused on every rank before anything is written
    try:
        checkpoint.save(root / f"r{r}", 20, state(20), pg=pg)
        res["roots_mismatch"] = "no error"
    except rtxnet.CollectiveMismatchError as exc:
        res["roots_mismatch"] = {"field": exc.field, "values": {str(k): v for k, v in exc.values.items()},
                                 "msg": str(exc)}
    res["after_roots_mismatch"] = sorted(p.name for p in root.iterdir())

    # 8. a root another run holds (the test process, as job "other-job"): refused on every rank
    try:
        checkpoint.save(root / "held", 30, state(30), pg=pg)
        res["held_by_another_run"] = "no error"
    except checkpoint.CheckpointError as exc:
        res["held_by_another_run"] = {"ranks": exc.ranks, "msg": str(exc)}
    res["after_held"] = sorted(p.name for p in (root / "held").iterdir())

    # 9. rank 0 cannot write the manifest (a folder stands in its place): every rank says why
    if r == 0:
        (checkpoint.step_dir(root, 40) / "manifest.json" / "x").mkdir(parents=True)
    pg.barrier()
    try:
        checkpoint.save(root, 40, state(40), pg=pg)
        res["manifest_unwritable"] = "no error"
    except checkpoint.CheckpointError as exc:
        res["manifest_unwritable"] = {"ranks": exc.ranks, "msg": str(exc)}
    pg.barrier()
    if r == 0:
        res["manifest_dir_latest"] = checkpoint.latest(root)   # a folder is no manifest: skipped
        shutil.rmtree(checkpoint.step_dir(root, 40))

    # 10. a tensor-parallel layer loading a checkpoint of another world size: refused
    if r == 0:
        checkpoint.save(root / "w1", 1, {"tp": {"w": torch.ones(2)}})   # a world of one's
    pg.barrier()
    tp = ColumnParallelLinear(4, 6, pg)
    try:
        checkpoint.load(root / "w1", pg=pg)
        res["tp_other_world"] = "no error"
    except rtxnet.ConfigError as exc:
        res["tp_other_world"] = str(exc)
    res["tp_named_shard"] = checkpoint.load(root / "w1", rank=0)["_checkpoint"]["shard_rank"]
    del tp

    # 11. one rank's bad argument, caught by the script: the other rank is told at once (it
    # waited out its deadline, 30 s here, then met rank 1's next collective: a breaker's find)
    t0 = time.monotonic()
    try:
        checkpoint.save(root, 50, state(50), pg=pg, keep=-1 if r == 1 else None)
        res["bad_keep"] = "no error"
    except rtxnet.ConfigError as exc:
        res["bad_keep"] = str(exc)
    res["bad_keep_s"] = time.monotonic() - t0
    pg.barrier()   # in step after it: the next collective matches on both ranks
    res["after_bad_keep"] = sorted(p.name for p in root.iterdir())

    # 12. a subgroup (pg.split, pg.new_group) as pg: refused on every rank, before any
    # communication (AttributeError: 'Group' object has no attribute 'store' before, and
    # record raised on rank 0 only: rank 1 returned None)
    sub = pg.split(color=0)
    ng = pg.new_group([0, 1])
    for name, call in [("save_split", lambda: checkpoint.save(root / "sub", 60, state(60), pg=sub)),
                       ("save_new_group", lambda: checkpoint.save(root / "sub", 60, state(60), pg=ng)),
                       ("hold_split", lambda: checkpoint.hold(root / "sub", pg=sub)),
                       ("record_split", lambda: checkpoint.record(root, 1, pg=sub))]:
        try:
            res[name] = f"no error: {call()}"
        except Exception as exc:  # noqa: BLE001 - the test checks what it was
            res[name] = f"{type(exc).__name__}: {exc}"
    res["sub_root_made"] = (root / "sub").exists()
    pg.barrier()   # in step after it
    (out / f"ckpt-rank{r}.json").write_text(json.dumps(res))
    leave_together(pg, "ckpt", r)
    return 0


def old_state(rank: int) -> dict:
    """What rank ``rank`` saves as step 1 before the re-save it is killed in (``kill``)."""
    return {"w": torch.arange(4096, dtype=torch.float32) + 1000 * rank, "gen": "old", "rank": rank}


def kill() -> int:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=5.0, op_s=60, rendezvous_s=120))
    r = pg.rank
    checkpoint.save(root, 1, old_state(r), pg=pg)
    point = faults.point

    def stop_in_resave(at, *, pg=None, step=None):
        point(at, pg=pg, step=step)
        if at == "checkpoint":
            epoch = pg.epoch
            (out / f"in-save-rank{r}").write_text(str(os.getpid()))
            if r == 1:   # the test SIGKILLs this process by its pid (the launcher would SIGTERM)
                signal.sigtimedwait([signal.SIGTERM], 120)
            # rank 0: the save's world ends under it
            wait_until(lambda: pg.epoch != epoch, 60, "rank 1 declared lost during the save")

    faults.point = stop_in_resave
    res: dict = {"rank": r}
    try:
        checkpoint.save(root, 1, {"w": torch.zeros(4096), "gen": "new", "rank": r}, pg=pg)
        res["resave"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test checks what it was
        res["resave"] = {"type": type(exc).__name__, "msg": str(exc), "ranks": getattr(exc, "ranks", None)}
    faults.point = point
    res["latest"] = checkpoint.latest(root)
    res["files_after_kill"] = sorted(p.name for p in checkpoint.step_dir(root, 1).iterdir())
    try:
        loaded = [checkpoint.load(root, 1, rank=k) for k in range(2)]
        res["old_loaded_exactly"] = [torch.equal(s["w"], old_state(k)["w"]) and s["gen"] == "old"
                                     and s["rank"] == k for k, s in enumerate(loaded)]
    except checkpoint.CheckpointError as exc:
        res["old_loaded_exactly"] = f"{type(exc).__name__}: {exc}"
    res["world_after_kill"] = pg.world_size
    checkpoint.save(root, 1, {"w": torch.ones(8), "gen": "newer", "rank": r}, pg=pg)   # world of one
    res["latest_after_newer"] = checkpoint.latest(root)
    res["files_after_newer"] = sorted(p.name for p in checkpoint.step_dir(root, 1).iterdir())
    res["newer_loaded"] = checkpoint.load(root, 1)["gen"]
    (out / f"kill-rank{r}.json").write_text(json.dumps(res))
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(kill() if sys.argv[3:] == ["kill"] else main())
