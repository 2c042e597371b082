"""An FSDP training job under ``rtxnet.FaultTolerance``, for ``tools/bench/fsdp_recovery.py``.

    rtxnet-run --nproc 3 tools/fsdp_workload.py --mode memory --steps 40 --out DIR

An MLP of ``--layers`` square ``--width`` layers (each layer one FSDP unit), Adam, a fixed random
regression task, global batch ``--batch`` split over the ranks. ``--mode memory`` keeps the
sharded state with ``FaultTolerance(sharded_state=True)`` (each rank also holds its ring
predecessor's committed shards); ``--mode checkpoint`` only saves a sharded checkpoint every
``--checkpoint-every`` steps and reloads it after a loss; ``--mode plain`` is ``memory`` without
the ring copies (``sharded_state=False``: for the fault-free cost of the copies only). Each rank
writes ``DIR/rank<launch rank>-<pid>.json``: steps run, the median time from one step's start to
the next (the vote and the ring copy included), the bytes of its committed state, the
``FaultTolerance`` report and events.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rtxnet  # noqa: E402
import rtxnet.checkpoint as ckpt  # noqa: E402
from rtxnet.parallel.fsdp import FSDPState, FullyShardedDataParallel  # noqa: E402
from rtxnet.statesync import pack_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("memory", "checkpoint", "plain"), default="memory")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=48, help="global batch (divisible by the world sizes)")
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pg = rtxnet.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[m for _ in range(args.layers)
                                for m in (torch.nn.Linear(args.width, args.width), torch.nn.Tanh())])
    model = FullyShardedDataParallel(net, pg, wrap=[torch.nn.Linear], init_sync=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch * 4, args.width, generator=g)
    y = torch.tanh(x.roll(1, dims=1))

    state = FSDPState(model, opt)
    ft = rtxnet.FaultTolerance(
        pg, state, sharded_state=args.mode == "memory",
        load_checkpoint=lambda step, root: state.load_state_dicts(ckpt.load_all(root, step), step=step))
    starts: list[float] = []
    while ft.step < args.steps:
        with ft.guard() as step:
            starts.append(time.perf_counter())
            if args.mode == "checkpoint" and step > 0 and step % args.checkpoint_every == 0:
                ckpt.save(out / "ckpt", step, state.state_dict(), pg=pg, keep=2)
            n = args.batch // pg.world_size
            lo = (step % 4) * args.batch + pg.rank * n
            opt.zero_grad()
            ((model(x[lo:lo + n]) - y[lo:lo + n]) ** 2).mean().backward()
            opt.step()
            state.step = step + 1
    periods = sorted(b - a for a, b in zip(starts, starts[1:], strict=False))
    res = {"launch_rank": int(os.environ.get("RTXNET_RANK", pg.rank)), "mode": args.mode,
           "world_size": pg.world_size, "steps": state.step,
           "period_median_s": periods[len(periods) // 2] if periods else None,
           "state_bytes": len(pack_state(state.state_dict())),
           "report": ft.report(), "events": ft.events}
    (out / f"rank{res['launch_rank']}-{os.getpid()}.json").write_text(json.dumps(res))
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
