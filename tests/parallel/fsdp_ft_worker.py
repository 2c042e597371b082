"""A rank of the FSDP + FaultTolerance test, run under ``python -m rtxnet.launcher``.

    fsdp_ft_worker.py OUT_DIR STEPS [checkpoint|memory|memory-nockpt]

Trains a small MLP with FSDP (SGD with momentum) inside ``FaultTolerance`` steps, saving a sharded
checkpoint every 4 steps. The state ``FaultTolerance`` keeps is the rank's shards, which fit only
this rank and world size: when a rank is lost, the survivor's roll-back is refused (world 1), and
every rank of the new world (with a replacement, or the survivor alone) loads the newest
checkpoint, every saved rank's shards and momentum resharded for it. Every rank also trains the
single-process reference on the whole global batch and writes ``OUT_DIR/rank<r>.json``.

``memory``: ``FaultTolerance(sharded_state=True)``: each rank also holds its ring predecessor's
committed shards, so the new world reshards the committed state of the step before the failure
from memory (no checkpoint loaded, one step lost). ``memory-nockpt``: the same, saving no
checkpoint. ``memory-initsync``: as ``memory``, built with the default ``init_sync=True``, which
a replacement skips by itself. ``checkpoint-corrupt``: as ``checkpoint``, but rank 0 flips a byte of rank 1's
shard of the newest checkpoint (step 8) at step 9: the new world falls back to step 4.

``join-early`` / ``join-late`` (ranks started by hand, ``RTXNET_MIN_RANKS=2``,
``RTXNET_MAX_RANKS=3``): as ``memory-nockpt``, the state held as ``examples/train_digits.py``
holds it (no ``hold_built``: nothing kept as built); launch ranks 0 and 1 form a world of 2 and,
before their first step (early) or before step 3 (late, two steps committed), write
``OUT_DIR/ready`` and wait until launch rank 2, which starts ``rtxnet.init`` only once that file
is there, has joined.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import rtxnet
import rtxnet.checkpoint as ckpt
from rtxnet.parallel.fsdp import FSDPState, FullyShardedDataParallel
from tests.procs import leave_together, wait_until

B = 12   # global batch: divisible by worlds of 1, 2 and 3


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class HeldState:
    """An :class:`FSDPState` held as ``examples/train_digits.py``'s ``TrainState`` holds it: no
    ``hold_built``, so ``FaultTolerance`` keeps no state as built to rebuild from."""

    def __init__(self, inner: FSDPState):
        self.inner = inner

    step = property(lambda self: self.inner.step, lambda self, v: setattr(self.inner, "step", v))

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    def load_state_dicts(self, states, **kw) -> None:
        self.inner.load_state_dicts(states, **kw)

    def sharded_layout(self):
        return self.inner.sharded_layout()

    def layout_digest(self) -> int:
        return self.inner.layout_digest()


def main() -> int:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "checkpoint"
    memory = mode.startswith(("memory", "join"))
    join_at = {"join-early": 0, "join-late": 3}.get(mode)
    joiner = join_at is not None and os.environ.get("RTXNET_RANK") == "2"
    torch.set_num_threads(1)
    if join_at is not None:
        # a first optimizer imports torch._dynamo (1.4 s), before init: the joiner's while it
        # waits, the others' before the heartbeat timeout (the join window) is 1 s
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    if joiner:
        wait_until(lambda: (out / "ready").exists(), 60, "the world of 2 ready for a join")
    hb = 1.0 if join_at is not None else 2.0
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=hb, op_s=30, rendezvous_s=120))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B * steps, 6, generator=g)
    y = x.sum(1, keepdim=True).sin()
    # init_sync=False: a replacement must not broadcast while the others sync (same seed anyway);
    # "memory-initsync" leaves the default, which the replacement skips by itself
    model = FullyShardedDataParallel(make_net(), pg, init_sync=mode == "memory-initsync")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    state = FSDPState(model, opt)   # load_state_dicts: every saved rank's shards, resharded
    if join_at is not None:
        state = HeldState(state)

    def load_checkpoint(step: int, root: str) -> None:
        state.load_state_dicts(ckpt.load_all(root, step), step=step)

    ft = rtxnet.FaultTolerance(pg, state, load_checkpoint=load_checkpoint, sharded_state=memory)
    while ft.step < steps:
        if mode == "checkpoint-between" and ft.step == 10 and pg.rank == 0 and pg.world_size == 2:
            # rank 1 dies as its step 10 begins (the plan) while this rank is between steps:
            # the loss is known before this rank's step 10 begins (no step to roll back)
            wait_until(lambda: pg.world_size == 1, 30, "the world without rank 1")
        if ft.step == join_at and not joiner:
            join_at = None
            if pg.rank == 0:
                (out / "ready").touch()
            wait_until(lambda: pg.world_size == 3, 60, "launch rank 2 joined")
        with ft.guard() as step:
            if step > 0 and step % 4 == 0 and mode not in ("memory-nockpt", "join-early", "join-late"):
                ckpt.save(out / "ckpt", step, state.state_dict(), pg=pg)
            if mode == "checkpoint-corrupt" and step == 9 and pg.rank == 0 and pg.world_size == 2:
                shard = next((out / "ckpt" / "step-8").glob("rank-1*.pt"))
                data = bytearray(shard.read_bytes())
                data[len(data) // 2] ^= 0xFF
                shard.write_bytes(bytes(data))
            lo = step * B + pg.rank * (B // pg.world_size)
            xb, yb = x[lo:lo + B // pg.world_size], y[lo:lo + B // pg.world_size]
            opt.zero_grad()
            ((model(xb) - yb) ** 2).mean().backward()
            opt.step()
            state.step = step + 1
    ref = make_net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        ref_opt.zero_grad()
        ((ref(x[s * B:(s + 1) * B]) - y[s * B:(s + 1) * B]) ** 2).mean().backward()
        ref_opt.step()
    full = model.full_state_dict(rank0_only=False)
    rel = max(float((full[k] - v).norm() / v.norm()) for k, v in ref.state_dict().items())
    res = {"rank": pg.rank, "world_size": pg.world_size, "steps": state.step, "rel": rel,
           "events": [e["event"] for e in ft.events], "report": ft.report()}
    (out / f"rank{pg.rank}.json").write_text(json.dumps(res))
    leave_together(pg, "fsdp-ft", pg.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
