"""A 3-stage pipeline (GPipe, 4 micro-batches) trained under ``FaultTolerance(sharded_state=True)``.

    rtxnet-run --nproc 3 [--faults PLAN] tests/parallel/pp_ft_worker.py OUT STEPS

Each stage writes ``OUT/stage<rank>.json``: its steps, the SHA-256 of its parameters (bitwise
comparison with a fault-free run) and its recovery events.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

import rtxnet
from rtxnet.parallel import PipelineStage, ScheduleGPipe


def part(stage: int) -> torch.nn.Module:
    torch.manual_seed(100 + stage)
    if stage == 2:
        return torch.nn.Sequential(torch.nn.Linear(32, 4))
    return torch.nn.Sequential(torch.nn.Linear(8 if stage == 0 else 32, 32), torch.nn.Tanh())


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


class Stage:
    """The training state of this rank's stage; rebuilt for the rank it has after a re-form."""

    def __init__(self, pg):
        self.pg = pg
        self.build(pg.rank)

    def build(self, stage: int) -> None:
        self.module = part(stage)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
        self.schedule = ScheduleGPipe(PipelineStage(self.module, self.pg), n_microbatches=4,
                                      loss_fn=torch.nn.functional.cross_entropy)

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.module.load_state_dict(d["model"])

    def load_state_dicts(self, states: list[dict]) -> None:
        self.build(self.pg.rank)
        self.load_state_dict(states[self.pg.rank])


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    pg = rtxnet.init()
    state = Stage(pg)
    ft = rtxnet.FaultTolerance(pg, state, sharded_state=True)
    while ft.step < steps:
        with ft.guard() as step:
            x, y = batch(step)
            state.opt.zero_grad()
            state.schedule.step(x if pg.rank == 0 else None, y if pg.rank == 2 else None)
            state.opt.step()
    sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in state.module.parameters())).hexdigest()
    (out / f"stage{pg.rank}.json").write_text(json.dumps(
        {"steps": ft.step, "sha": sha, "events": ft.events}, default=str))
    ft.finish()
    pg.close()


if __name__ == "__main__":
    main()
