"""Collective benchmark in the style of nccl-tests: rtxnet's CPU collectives against torch gloo.

Usage::

    python tools/bench/collectives.py --ranks 2 4 --sizes 8B 1KiB 64KiB 1MiB 16MiB 64MiB \\
        --ops all_reduce all_gather reduce_scatter broadcast --compare gloo --json out.json

For every (implementation, ranks, op, size): warm-up iterations, then timed iterations, each
started right after a barrier; an iteration's time is the slowest rank's, the reported time the
median over iterations. Sizes are the nccl-tests ``size``: the whole array for all_reduce and
broadcast, the gathered output for all_gather, the input for reduce_scatter. float32 data.

    algbw = size / time            busbw = algbw * factor
    factor: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1

Output: a table, JSON rows ``{impl, op, ranks, nbytes, time_s, algbw_gbps, busbw_gbps,
transport}`` (``--json``), and a PNG of busbw against size (``--plot``, default next to the JSON).
``--no-shm`` measures rtxnet over TCP only. gloo runs in the same invocation with a free port.
``--repeat K`` alternates rtxnet and gloo K times per rank count (on a shared machine, load that
comes and goes then hits both alike) and reports the median of the K medians; the JSON rows keep
each run's median in ``runs_s``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000, "MB": 10**6}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB|KB|MB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; e.g. 8B 64KiB 16MiB")
    return int(m.group(1)) * _UNITS[m.group(2) or "B"]


def fmt_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "broadcast": 1.0}[op]


def iterations(nbytes: int) -> tuple[int, int]:
    iters = int(min(200, max(5, 3e9 / max(nbytes, 1) / 40)))
    return max(2, iters // 10), iters


def elems(op: str, nbytes: int, n: int) -> tuple[int, int]:
    """(per-rank input elements, actual size in bytes) for float32."""
    total = max(1, nbytes // 4)
    if op in ("all_gather", "reduce_scatter"):
        per = max(1, total // n)
        return per, per * n * 4
    return total, total * 4


# -- rtxnet ---------------------------------------------------------------------------------------

async def rtxnet_rank(engine, ops, sizes):
    import asyncio

    g = engine.world
    n = g.size
    rows = []
    for op in ops:
        for nbytes in sizes:
            per, actual = elems(op, nbytes, n)
            if op == "all_reduce" or op == "broadcast":
                x = np.zeros(per, np.float32)
                call = (lambda: g.all_reduce(x)) if op == "all_reduce" else (lambda: g.broadcast(x, 0))
            elif op == "all_gather":
                x = np.zeros(per, np.float32)
                out = np.empty(per * n, np.float32)
                call = lambda: g.all_gather(out, x)  # noqa: E731
            else:
                x = np.zeros(per * n, np.float32)
                out = np.empty(per, np.float32)
                call = lambda: g.reduce_scatter(out, x)  # noqa: E731
            warm, iters = iterations(actual)
            for _ in range(warm):
                await call()
            times = []
            for _ in range(iters):
                await g.barrier()
                t0 = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t0)
            rows.append((op, actual, times))
            await asyncio.sleep(0)
    return rows


def run_rtxnet(n, ops, sizes, shm):
    from tests.collectives.harness import run_world

    results = run_world(n, rtxnet_rank, ops, sizes, shm=shm, timeout_s=3600,
                        default_timeout_s=120)
    return _merge(results)


def _merge(results):
    """Per (op, size): iteration time = slowest rank's; returns [(op, nbytes, median_s)]."""
    out = []
    for i, (op, nbytes, _) in enumerate(results[0]):
        per_iter = np.max(np.array([r[i][2] for r in results]), axis=0)
        out.append((op, nbytes, float(statistics.median(per_iter))))
    return out


# -- gloo -----------------------------------------------------------------------------------------

def _gloo_rank(rank, n, port, ops, sizes, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    rows = []
    try:
        for op in ops:
            for nbytes in sizes:
                per, actual = elems(op, nbytes, n)
                if op in ("all_reduce", "broadcast"):
                    x = torch.zeros(per)
                    call = (lambda: dist.all_reduce(x)) if op == "all_reduce" else \
                        (lambda: dist.broadcast(x, 0))
                elif op == "all_gather":
                    x, out = torch.zeros(per), torch.empty(per * n)
                    call = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
                else:
                    x, out = torch.zeros(per * n), torch.empty(per)
                    call = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
                warm, iters = iterations(actual)
                try:
                    for _ in range(warm):
                        call()
                except (RuntimeError, NotImplementedError) as exc:
                    rows.append((op, actual, None, str(exc).splitlines()[0]))
                    dist.barrier()
                    continue
                times = []
                for _ in range(iters):
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                rows.append((op, actual, times, None))
    finally:
        dist.destroy_process_group()
    q.put((rank, rows))


def run_gloo(n, ops, sizes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, n, port, ops, sizes, q)) for r in range(n)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=3600) for _ in range(n))
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    out = []
    for i, (op, nbytes, _, err) in enumerate(got[0]):
        if err is not None:
            print(f"gloo {op}: not supported ({err})", file=sys.stderr)
            continue
        per_iter = np.max(np.array([got[r][i][2] for r in range(n)]), axis=0)
        out.append((op, nbytes, float(statistics.median(per_iter))))
    return out


# -- report ---------------------------------------------------------------------------------------

def to_rows(impl, n, transport, runs):
    """JSON rows from ``runs``: one ``[(op, nbytes, median_s)]`` list per repetition."""
    rows = []
    for i, (op, nbytes, _) in enumerate(runs[0]):
        per_run = [run[i][2] for run in runs]
        t = float(statistics.median(per_run))
        algbw = nbytes / t / 1e9
        rows.append({"impl": impl, "op": op, "ranks": n, "nbytes": nbytes, "time_s": t,
                     "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n),
                     "transport": transport, "runs_s": per_run})
    return rows


def print_table(rows):
    by = {(r["op"], r["ranks"], r["nbytes"], r["impl"]): r for r in rows}
    impls = sorted({r["impl"] for r in rows})
    head = f"{'op':<15}{'ranks':>5}{'size':>9}"
    for impl in impls:
        head += f" | {impl + ' time':>14}{'algbw':>8}{'busbw':>8}"
    if len(impls) == 2:
        head += f" | {'busbw ratio':>11}"
    print(head)
    print("-" * len(head))
    for op, n, nb in sorted({(r["op"], r["ranks"], r["nbytes"]) for r in rows},
                            key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 9, k[1], k[2])):
        line = f"{op:<15}{n:>5}{fmt_size(nb):>9}"
        for impl in impls:
            r = by.get((op, n, nb, impl))
            if r is None:
                line += f" | {'-':>14}{'-':>8}{'-':>8}"
            else:
                t = r["time_s"]
                ts = f"{t * 1e6:.1f}us" if t < 1e-3 else f"{t * 1e3:.2f}ms"
                line += f" | {ts:>14}{r['algbw_gbps']:>8.3f}{r['busbw_gbps']:>8.3f}"
        if len(impls) == 2:
            a, b = (by.get((op, n, nb, i)) for i in impls)
            if a and b and a["busbw_gbps"] > 0:
                # rtxnet / gloo, whichever order the names sort in
                rt = a if a["impl"].startswith("rtxnet") else b
                gl = b if rt is a else a
                line += f" | {rt['busbw_gbps'] / gl['busbw_gbps']:>10.2f}x"
        print(line)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot", file=sys.stderr)
        return
    ops = [o for o in OPS if any(r["op"] == o for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for key in sorted({(r["impl"], r["ranks"]) for r in rows if r["op"] == op}):
            pts = sorted((r["nbytes"], r["busbw_gbps"]) for r in rows
                         if r["op"] == op and (r["impl"], r["ranks"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if key[0].startswith("rtxnet") else "--",
                    label=f"{key[0]} n={key[1]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=parse_size, nargs="+",
                   default=[parse_size(s) for s in ("8B", "1KiB", "64KiB", "1MiB", "16MiB",
                                                    "64MiB")])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--compare", choices=["gloo", "none"], default="gloo")
    p.add_argument("--no-shm", action="store_true", help="rtxnet over TCP only")
    p.add_argument("--repeat", type=int, default=1,
                   help="alternate rtxnet and gloo this many times; report the median")
    p.add_argument("--json", help="write JSON rows here")
    p.add_argument("--plot", help="PNG path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    rows = []
    transport = "tcp" if args.no_shm else "shm"
    if args.repeat < 1:
        p.error(f"--repeat({args.repeat}) must be >= 1")
    for n in args.ranks:
        ours, theirs = [], []
        for k in range(args.repeat):
            t0 = time.perf_counter()
            ours.append(run_rtxnet(n, args.ops, args.sizes, not args.no_shm))
            print(f"rtxnet n={n} run {k} done in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
            if args.compare == "gloo":
                t0 = time.perf_counter()
                theirs.append(run_gloo(n, args.ops, args.sizes))
                print(f"gloo n={n} run {k} done in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
        rows += to_rows("rtxnet", n, transport, ours)
        if theirs:
            rows += to_rows("gloo", n, "tcp", theirs)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"json: {args.json}")
    path = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else None)
    if path:
        plot(rows, path)


if __name__ == "__main__":
    main()
