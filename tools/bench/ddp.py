"""Benchmark: rtxnet DDP against torch DDP on gloo, same model, same per-rank batch, same run.

    python tools/bench/ddp.py [--json PATH] [--worlds 1,2,4] [--steps 20] [--batch 32]
                              [--width 1024] [--depth 4]

For each world size and each implementation, N rank processes train an MLP (``depth`` linear
layers of ``width`` x ``width``, a few million parameters so that communication matters) on random
data with SGD; the per-rank batch is fixed (weak scaling). Each rank measures ``steps`` timed steps
after 3 warm-up steps, twice: with gradient synchronisation and under ``no_sync()`` (compute only).
Each configuration runs ``--repeat`` times and the fastest run counts. Reported, from rank 0:

    step_ms            wall time of one synchronised step
    samples_per_s      N * batch / step time
    scaling_eff        thr_N / (N * thr_1), per implementation
    exposed_comm       (step_ms - compute_ms) / step_ms: communication not hidden behind backward
    vs_torch           torch step time / rtxnet step time (> 1: rtxnet faster)

torch runs ``torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>")``
with ``torch.nn.parallel.DistributedDataParallel`` defaults (25 MiB buckets); rtxnet runs under
``python -m rtxnet.launcher`` with :class:`rtxnet.parallel.DistributedDataParallel` defaults. Every
rank uses one intra-op thread. On a machine with fewer cores than ranks the ranks time-share the
cores, which inflates compute and communication alike; the table says how many cores there were.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rtxnet.config import int_in, ints_in, output_file

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 3


def make_model(width: int, depth: int):
    import torch

    layers = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def timed_steps(model, opt, x, y, steps: int, barrier, sync: bool) -> float:
    """Seconds per step, after WARMUP steps; ``barrier`` aligns the ranks before the clock starts."""
    import contextlib

    import torch

    loss_fn = torch.nn.functional.cross_entropy
    ctx = contextlib.nullcontext if sync else model.no_sync

    def one():
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(WARMUP):
        one()
    barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    barrier()
    return (time.perf_counter() - t0) / steps


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = make_model(args.width, args.depth)
    if args.worker == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
        model = torch.nn.parallel.DistributedDataParallel(net)
        rank, world, barrier = dist.get_rank(), dist.get_world_size(), dist.barrier
    else:
        import rtxnet
        from rtxnet.parallel import DistributedDataParallel

        pg = rtxnet.init()
        model = DistributedDataParallel(net, pg)
        rank, world, barrier = pg.rank, pg.world_size, pg.barrier
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step_s = timed_steps(model, opt, x, y, args.steps, barrier, sync=True)
    compute_s = timed_steps(model, opt, x, y, args.steps, barrier, sync=False)
    if rank == 0:
        Path(args.result).write_text(json.dumps({
            "impl": args.worker, "world_size": world, "step_ms": step_s * 1e3,
            "compute_ms": compute_s * 1e3,
            "params": sum(p.numel() for p in net.parameters())}))
    if args.worker == "torch":
        torch.distributed.destroy_process_group()
    else:
        pg.store.set(f"bench/done/{rank}", b"1")
        pg.store.wait([f"bench/done/{r}" for r in range(world)], timeout=60)
        pg.close()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(impl: str, n: int, args: argparse.Namespace, tmp: Path) -> dict:
    result = tmp / f"{impl}-{n}.json"
    common = ["--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width),
              "--depth", str(args.depth), "--result", str(result)]
    env = dict(os.environ, RTXNET_LOG_LEVEL="warning",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    me = str(Path(__file__).resolve())
    if impl == "rtxnet":
        procs = [subprocess.Popen([sys.executable, "-m", "rtxnet.launcher", "--nproc", str(n), me,
                                   "--worker", "rtxnet", *common], env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)]
    else:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, me, "--worker", "torch", "--rank", str(r), "--world", str(n),
                                   "--port", str(port), *common], env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(n)]
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append(err.decode(errors="replace")[-2000:])
    if errors or not result.exists():
        raise SystemExit(f"{impl} at {n} ranks failed:\n" + "\n".join(errors))
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=output_file, help="write the rows here")
    p.add_argument("--worlds", type=ints_in(1, 1024), default=[1, 2, 4],
                   help="comma-separated world sizes (default 1,2,4; scaling_eff needs 1 among them)")
    p.add_argument("--steps", type=int_in(1, 10**6), default=20,
                   help="timed steps per measurement, after 3 warm-up steps (default 20)")
    p.add_argument("--batch", type=int_in(1, 10**6), default=32, help="samples per rank per step")
    p.add_argument("--width", type=int_in(1, 65536), default=1024,
                   help="features of each hidden layer of the MLP (default 1024)")
    p.add_argument("--depth", type=int_in(1, 1000), default=4, help="linear layers of the MLP (default 4)")
    p.add_argument("--repeat", type=int_in(1, 100), default=2,
                   help="runs per configuration; the fastest counts (robust to noisy neighbours)")
    # worker mode (internal)
    p.add_argument("--worker", choices=["rtxnet", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    worlds = args.worlds
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds:
            for impl in ("rtxnet", "torch"):
                runs = [run_config(impl, n, args, Path(tmp)) for _ in range(max(1, args.repeat))]
                r = min(runs, key=lambda q: q["step_ms"])
                r["step_ms_runs"] = [round(q["step_ms"], 2) for q in runs]
                r["samples_per_s"] = n * args.batch / (r["step_ms"] / 1e3)
                r["exposed_comm"] = max(0.0, (r["step_ms"] - r["compute_ms"]) / r["step_ms"]) if n > 1 else 0.0
                rows.append(r)
                print(f"  {impl:6s} N={n}: {r['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    base = {r["impl"]: r["samples_per_s"] for r in rows if r["world_size"] == 1}
    torch_ms = {r["world_size"]: r["step_ms"] for r in rows if r["impl"] == "torch"}
    for r in rows:
        r["scaling_eff"] = r["samples_per_s"] / (r["world_size"] * base[r["impl"]]) if r["impl"] in base else None
        r["vs_torch"] = torch_ms[r["world_size"]] / r["step_ms"]
        r.update(batch_per_rank=args.batch, width=args.width, depth=args.depth, steps=args.steps,
                 cpu_count=os.cpu_count())

    params = rows[0]["params"]
    print(f"\nMLP {args.depth}x{args.width} ({params / 1e6:.2f} M params, {params * 4 / 2**20:.1f} MiB of "
          f"float32 gradients), batch {args.batch}/rank, {args.steps} steps, {os.cpu_count()} CPU cores")
    print(f"{'impl':8s}{'N':>3s}{'step_ms':>10s}{'compute_ms':>12s}{'samples/s':>11s}"
          f"{'scaling':>9s}{'exposed':>9s}{'vs_torch':>10s}")
    for r in rows:
        eff = "-" if r["scaling_eff"] is None else f"{r['scaling_eff']:.2f}"
        print(f"{r['impl']:8s}{r['world_size']:>3d}{r['step_ms']:>10.1f}{r['compute_ms']:>12.1f}"
              f"{r['samples_per_s']:>11.0f}{eff:>9s}{r['exposed_comm']:>9.2f}{r['vs_torch']:>10.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
