"""Benchmark: per-rank model-state memory of rtxnet FSDP against rtxnet DDP, same model, same run.

    python tools/bench/fsdp.py [--json PATH] [--worlds 2,4] [--width 512] [--depth 4]

For each world size, N rank processes (``python -m rtxnet.launcher``) build the same MLP (``depth``
linear layers of ``width`` x ``width``), wrap it once with DDP and once with FSDP (one unit per
Linear), run one Adam step on random data, and measure on every rank the bytes held by the
parameters, the gradients and the optimizer state: the storage of every tensor the module and the
optimizer keep after the step (DDP: the module's parameters, their ``.grad`` and its gradient
buckets; FSDP: the shards and their ``.grad``), so padding and buckets are counted. Reported, from
rank 0 (every rank's figures are in the JSON):

    params_B, grads_B, optim_B   bytes per rank, per implementation
    total_B                      their sum
    fsdp/ddp                     FSDP total over DDP total (ideal: 1/N)

FSDP's transient gathered parameters and gradients (one unit at a time, see
``rtxnet.parallel.fsdp``) are not in these figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rtxnet.config import int_in, ints_in, output_file

ROOT = Path(__file__).resolve().parents[2]


def _nbytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _optim_bytes(opt) -> int:
    import torch

    return _nbytes(v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def worker(out: Path, width: int, depth: int) -> None:
    import torch

    import rtxnet
    from rtxnet.parallel import DistributedDataParallel
    from rtxnet.parallel.fsdp import FullyShardedDataParallel

    pg = rtxnet.init()
    torch.set_num_threads(1)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    x = torch.randn(8, width)
    res = {"rank": pg.rank, "world_size": pg.world_size, "numel": sum(p.numel() for p in make().parameters())}
    ddp = DistributedDataParallel(make(), pg)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    ddp(x).square().mean().backward()
    opt.step()
    ps = list(ddp.module.parameters())
    res["ddp"] = {"params_B": _nbytes(ps),
                  "grads_B": _nbytes([p.grad for p in ps] + [b.flat for b in ddp._buckets]),
                  "optim_B": _optim_bytes(opt)}
    del ddp, opt, ps
    fsdp = FullyShardedDataParallel(make(), pg, wrap=[torch.nn.Linear])
    opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    fsdp(x).square().mean().backward()
    opt.step()
    ps = list(fsdp.parameters())
    res["fsdp"] = {"params_B": _nbytes(ps), "grads_B": _nbytes([p.grad for p in ps]),
                   "optim_B": _optim_bytes(opt)}
    for k in ("ddp", "fsdp"):
        res[k]["total_B"] = sum(res[k].values())
    res["fsdp_over_ddp"] = res["fsdp"]["total_B"] / res["ddp"]["total_B"]
    (out / f"rank{pg.rank}.json").write_text(json.dumps(res))
    pg.barrier()
    pg.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=output_file, default=None,
                    help="write width, depth and every rank's figures here as JSON")
    ap.add_argument("--worlds", type=ints_in(1, 1024), default=[2, 4], help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--width", type=int_in(1, 65536), default=512,
                    help="in and out features of each Linear of the MLP (default 512)")
    ap.add_argument("--depth", type=int_in(1, 1000), default=4, help="Linear layers of the MLP (default 4)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.width, a.depth)
        return 0
    rows = []
    for w in a.worlds:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(w), __file__,
                   "--worker", d, "--width", str(a.width), "--depth", str(a.depth)]
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if p.returncode != 0:
                sys.stderr.write(p.stderr[-3000:])
                return p.returncode
            ranks = [json.loads(f.read_text()) for f in sorted(Path(d).glob("rank*.json"))]
        rows.append({"world_size": w, "ranks": ranks})
    print(f"{'N':>3} {'impl':>5} {'params_B':>12} {'grads_B':>12} {'optim_B':>12} {'total_B':>12} {'fsdp/ddp':>9}")
    for row in rows:
        r0 = row["ranks"][0]
        for k in ("ddp", "fsdp"):
            m = r0[k]
            ratio = f"{r0['fsdp_over_ddp']:.3f}" if k == "fsdp" else ""
            print(f"{row['world_size']:>3} {k:>5} {m['params_B']:>12,} {m['grads_B']:>12,} "
                  f"{m['optim_B']:>12,} {m['total_B']:>12,} {ratio:>9}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"width": a.width, "depth": a.depth, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
