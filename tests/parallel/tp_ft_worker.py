"""A rank of the tensor parallel + FaultTolerance tests, run under ``python -m rtxnet.launcher``.

    tp_ft_worker.py OUT_DIR STEPS sharded|replicated

An MLP split column-then-row over the world (:func:`rtxnet.parallel.shard_mlp`), Adam, every rank
the same batch. ``sharded``: ``FaultTolerance(sharded_state=True)`` with ``load_state_dicts``
taking ``states[pg.rank]`` (the README's recipe). ``replicated``: without it, which
FaultTolerance refuses (each rank's slices are its own). Each rank trains the one-process model
too and writes ``OUT_DIR/rank<r>.json`` with the largest relative difference of its slices.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import rtxnet
from rtxnet.parallel import shard_mlp
from tests.procs import leave_together


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def main() -> int:
    out, steps, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    pg = rtxnet.init(timeouts=rtxnet.Timeouts(heartbeat_timeout_s=2.0, op_s=30, rendezvous_s=120))
    model = shard_mlp(make_net(), pg, up="0", down="2")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    class State:
        step = 0

        def state_dict(self):
            return {"model": model.state_dict(), "opt": opt.state_dict(), "step": self.step}

        def load_state_dict(self, d):
            model.load_state_dict(d["model"])
            opt.load_state_dict(d["opt"])
            self.step = d["step"]

        def load_state_dicts(self, ds):   # the same world size: this rank's slices
            self.load_state_dict(ds[pg.rank])

    state = State()
    ft = rtxnet.FaultTolerance(pg, state, sharded_state=mode == "sharded")
    while ft.step < steps:
        with ft.guard() as step:
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step = step + 1
    ref = make_net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for s in range(steps):
        x, y = batch(s)
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    w, r = pg.world_size, pg.rank
    pairs = [(model[0].weight, ref[0].weight.chunk(w, 0)[r]), (model[0].bias, ref[0].bias.chunk(w, 0)[r]),
             (model[2].weight, ref[2].weight.chunk(w, 1)[r]), (model[2].bias, ref[2].bias)]
    rel = max(float((a.detach() - b.detach()).norm() / b.detach().norm()) for a, b in pairs)
    res = {"rank": r, "world_size": w, "steps": state.step, "rel": rel, "report": ft.report()}
    (out / f"rank{r}.json").write_text(json.dumps(res))
    leave_together(pg, "tp-ft", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
