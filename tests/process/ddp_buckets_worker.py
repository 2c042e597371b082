"""DDP with a float32 and a float64 bucket under FaultTolerance (test_faults' at=collective case):
each step's two bucket all_reduces are issued from the backward, the second while the first may
still wait in its fault point. Prints ``FINAL <sha256 of the parameters>`` on every rank."""

from __future__ import annotations

import hashlib
import sys

import torch

import rtxnet
from rtxnet.collectives import ReduceOp

STEPS, BATCH = 12, 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double())


def main() -> int:
    torch.manual_seed(0)
    net = Net()
    try:
        pg = rtxnet.init()
    except rtxnet.JobFinishedError:
        return 0
    model = rtxnet.DistributedDataParallel(net, pg, init_sync=False, reduce_op=ReduceOp.SUM)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    class State:
        def state_dict(self):
            return {"model": net.state_dict(), "opt": opt.state_dict()}

        def load_state_dict(self, d):
            net.load_state_dict(d["model"])
            opt.load_state_dict(d["opt"])

    ft = rtxnet.FaultTolerance(pg, State(), rejoin_window_s=30)
    try:
        while ft.step < STEPS:
            with ft.guard() as step:
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
                idx = [i for i in range(BATCH) if i % pg.world_size == pg.rank]
                opt.zero_grad()
                loss = ((model(x[idx]) - y[idx].double()) ** 2).sum() / BATCH
                loss.backward()
                opt.step()
        ft.finish()
    except rtxnet.JobFinishedError:
        return 0
    digest = hashlib.sha256(b"".join(p.detach().double().numpy().round(6).tobytes()
                                     for p in net.parameters())).hexdigest()
    print(f"FINAL {digest}", flush=True)
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
