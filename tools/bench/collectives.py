"""Collective benchmark in the style of nccl-tests: rtxnet's CPU collectives against torch gloo,
and its GPU collectives against the device's copy rate.

Usage::

    python tools/bench/collectives.py --ranks 2 4 --sizes 8B 1KiB 64KiB 1MiB 16MiB 64MiB \\
        --ops all_reduce all_gather reduce_scatter broadcast --compare gloo --json out.json
    python tools/bench/collectives.py --device cuda [--max-bytes 256MiB] --out gpu_bench.json

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

``--device cuda``: the ranks are spawned processes (forkserver, never a fork after CUDA
initialised) that all use GPU ``--gpu`` (default 0) with CuPy float32 arrays, so the group's GPU
path runs CUDA IPC between ranks sharing one GPU. Default ops all_reduce, all_gather and
reduce_scatter; default sizes 8 B and 4 KiB (latency) and 1 MiB to 1 GiB (``--max-bytes`` drops
the larger ones). Each (op, size) first checks one result (``ok`` in the JSON), then times with
zeros, twice: as nccl-tests does, the timed iterations back to back after one barrier, then the
rank's current stream synchronised, ``time_s`` being the slowest rank's mean; and each iteration
alone, started right after a barrier and ended when the rank's stream has finished,
``time_barrier_s`` being the median over iterations of the slowest rank's time (each call's own
latency, with the barrier's release skew in it). ``--compare boards`` runs every world again
with ``RTXNET_IPC_BOARD=1`` (impl ``rtxnet-boards``): the IPC hellos and "done"s through signal
boards in shared memory instead of control messages (``rtxnet.collectives.gpu.handshake``). The
anchor is measured in the same run, in a separate spawned process: the device-to-device copy
rate, ``copy_rate = 2 * 1 GiB / time`` of a 1 GiB ``cudaMemcpyAsync`` (bytes read plus written).
Ranks sharing one GPU share its memory bandwidth, and each must at least read its input once and
write its output once, so

    all_reduce:                 n ranks read S and write S each     algbw_max = copy_rate / (2n)
    all_gather, reduce_scatter: inputs S in all, outputs n*S or S   algbw_max = copy_rate / (n+1)
                                (S the nccl-tests size: the gathered output, the scattered input)

and every GPU row carries ``copy_rate_gbps``, ``algbw_max_gbps``, ``frac_of_limit`` (algbw /
algbw_max; ``frac_of_limit_barrier`` from ``time_barrier_s``) and ``limit`` (the rule used),
besides the CPU rows' fields, ``hellos`` (rank 0's IPC hellos so far: through the boards alone,
with offers by message, as messages), and ``phases_us``: where the time went, as the median over
ranks and iterations of each phase of the IPC protocol (``IpcState.phases``: offers received,
peers' inputs ready, work enqueued, completed, peers done), in microseconds from the start of the
exchange; also printed after the table. gloo is not run there.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import sys
import time

import numpy as np
import psutil

from rtxnet.config import int_in, output_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
GPU_OPS = ("all_reduce", "all_gather", "reduce_scatter")
GPU_SIZES = ("8B", "4KiB", "1MiB", "4MiB", "16MiB", "64MiB", "256MiB", "1GiB")
COPY_NBYTES = 1 << 30
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000, "MB": 10**6}


def parse_size(text: str) -> int:
    """An ``argparse`` type: a size in bytes, a whole number of float32 elements (4 B, what the
    benchmark moves) and at least one; for all_gather/reduce_scatter it is rounded down to whole
    elements per rank (the table and JSON give the size that ran)."""
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB|KB|MB)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: a number and a unit of "
                                          f"{', '.join(_UNITS)} (e.g. 8B 64KiB 16MiB)")
    nbytes = int(m.group(1)) * _UNITS[m.group(2) or "B"]
    if nbytes < 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is under 4B, one float32 element")
    if nbytes % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} ({nbytes} B) is not a whole number of "
                                          f"float32 elements (4 B each)")
    return nbytes


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


def gpu_iterations(nbytes: int) -> tuple[int, int]:
    """(warm-up, timed) iterations on the GPU: at least 10 timed, at most 100, about 2 GiB moved."""
    return 3, int(min(100, max(10, (2 << 30) // max(nbytes, 1))))


def elems(op: str, nbytes: int, n: int) -> tuple[int, int]:
    """(per-rank input elements, actual size in bytes) for float32."""
    total = max(1, nbytes // 4)
    if op in ("all_gather", "reduce_scatter"):
        per = max(1, total // n)
        return per, per * n * 4
    return total, total * 4


# -- rtxnet ---------------------------------------------------------------------------------------

async def rtxnet_rank(engine, ops, sizes, algorithm=None):
    import asyncio

    g = engine.world
    n = g.size
    algo = {"algorithm": algorithm}
    rows = []
    for op in ops:
        for nbytes in sizes:
            per, actual = elems(op, nbytes, n)
            if op == "all_reduce" or op == "broadcast":
                x = np.zeros(per, np.float32)
                call = (lambda x=x: g.all_reduce(x, **algo)) if op == "all_reduce" else \
                    (lambda x=x: g.broadcast(x, 0, **algo))
            elif op == "all_gather":
                x = np.zeros(per, np.float32)
                out = np.empty(per * n, np.float32)
                call = lambda out=out, x=x: g.all_gather(out, x, **algo)  # noqa: E731
            else:
                x = np.zeros(per * n, np.float32)
                out = np.empty(per, np.float32)
                call = lambda out=out, x=x: g.reduce_scatter(out, x, **algo)  # noqa: E731
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


def run_rtxnet(n, ops, sizes, shm, algorithm=None):
    from tests.collectives.harness import run_world

    results = run_world(n, rtxnet_rank, ops, sizes, algorithm, shm=shm, timeout_s=3600,
                        default_timeout_s=120)
    return _merge(results)


def _merge(results):
    """Per (op, size): iteration time = slowest rank's; returns [(op, nbytes, median_s)]."""
    out = []
    for i, (op, nbytes, *_) in enumerate(results[0]):
        per_iter = np.max(np.array([r[i][2] for r in results]), axis=0)
        out.append((op, nbytes, float(statistics.median(per_iter))))
    return out


# -- rtxnet on one GPU (CUDA IPC) ----------------------------------------------------------------

async def rtxnet_rank_cuda(engine, ops, sizes, device, board=None):
    """One rank of ``--device cuda``: every (op, size) checked once, then timed; returns
    ``[(op, nbytes, times_s, ok, phases, mean_s, hellos)]``, ``phases`` the IPC state's phase
    times of every iteration timed after a barrier (``IpcState.phases``; empty for a group of
    one), ``mean_s`` the back-to-back mean, ``hellos`` ``IpcState.stats`` after it."""
    import cupy

    if board is not None:
        # read when the group's IPC state is made, at its first GPU collective; set here, in
        # the rank (a forkserver's children do not see the parent's later environment)
        os.environ["RTXNET_IPC_BOARD"] = "1" if board else "0"

    cupy.cuda.Device(device).use()
    g = engine.world
    n, me = g.size, g.rank
    stream = cupy.cuda.get_current_stream()
    f32 = cupy.float32
    rows = []
    for op in ops:
        for nbytes in sizes:
            per, actual = elems(op, nbytes, n)
            if op == "all_reduce":
                x = cupy.full(per, me + 1, f32)
                out = x
                call = functools.partial(g.all_reduce, x)
            elif op == "all_gather":
                x = cupy.full(per, me + 1, f32)
                out = cupy.empty(per * n, f32)
                call = functools.partial(g.all_gather, out, x)
            else:
                x = cupy.full(per * n, me + 1, f32)
                out = cupy.empty(per, f32)
                call = functools.partial(g.reduce_scatter, out, x)
            await call()
            stream.synchronize()
            if op == "all_gather":
                want = cupy.arange(1, n + 1, dtype=f32)[:, None]
                ok = bool((out.reshape(n, per) == want).all())
            else:
                ok = bool((out == n * (n + 1) / 2).all())
            x.fill(0)                  # timed iterations on zeros: no overflow, same work
            warm, iters = gpu_iterations(actual)
            for _ in range(warm):
                await call()
            stream.synchronize()
            # as nccl-tests: the iterations back to back, their mean
            await g.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                await call()
            stream.synchronize()
            mean = (time.perf_counter() - t0) / iters
            # each iteration alone, started right after a barrier (its own latency)
            times, phases = [], []
            for _ in range(iters):
                await g.barrier()
                t0 = time.perf_counter()
                await call()
                stream.synchronize()
                times.append(time.perf_counter() - t0)
                ipc = getattr(g._gpu_state, "_ipc", None)
                phases.append(dict(ipc.phases) if ipc is not None else {})
            ipc = getattr(g._gpu_state, "_ipc", None)
            stats = dict(ipc.stats) if ipc is not None else {}
            rows.append((op, actual, times, ok, phases, mean, stats))
            x = out = call = None      # free before the next, possibly larger, allocation
    return rows


def run_rtxnet_cuda(n, ops, sizes, device, board=None):
    """One world of ``n`` ranks on GPU ``device``; ``board`` True or False runs it with
    ``RTXNET_IPC_BOARD`` 1 or 0 (signal boards, or every IPC hello and "done" as a message),
    None with this process's environment. Returns ``(rows, oks,
    phases, stats)``: ``rows`` ``[(op, nbytes, mean_s, median_barrier_s)]`` (the slowest rank's
    back-to-back mean, and the median over iterations of the slowest rank's time after a
    barrier), ``oks`` whether each checked result was right on every rank, ``phases`` the IPC
    phase medians, ``stats`` the IPC hellos by board and by message (rank 0's, cumulative)."""
    from tests.collectives.harness import run_world

    results = run_world(n, rtxnet_rank_cuda, ops, sizes, device, board, timeout_s=600,
                        default_timeout_s=120)
    merged = [(op, nbytes, max(r[i][5] for r in results), barrier_s)
              for i, (op, nbytes, barrier_s) in enumerate(_merge(results))]
    oks = [all(r[i][3] for r in results) for i in range(len(results[0]))]
    return (merged, oks, [_phase_medians([r[i][4] for r in results]) for i in range(len(oks))],
            [results[0][i][6] for i in range(len(oks))])


PHASES = ("hello", "peers_ready", "launched", "local_done", "peers_done")


def _phase_medians(per_rank: list[list[dict]]) -> dict[str, float]:
    """Median over ranks and iterations of each IPC phase time, in microseconds from the
    operation's start (``{}`` when no phases were recorded)."""
    out = {}
    for name in PHASES:
        vals = [ph[name] for iters in per_rank for ph in iters if name in ph]
        if vals:
            out[name] = float(statistics.median(vals)) * 1e6
    return out


def _copy_rate_child(q, device: int, nbytes: int) -> None:
    try:
        import cupy

        rt = cupy.cuda.runtime
        with cupy.cuda.Device(device):
            src = cupy.ones(nbytes, dtype=cupy.uint8)
            dst = cupy.empty_like(src)
            s = cupy.cuda.Stream(non_blocking=True)

            def copy():
                rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, s.ptr)

            for _ in range(3):
                copy()
            s.synchronize()
            per_copy = []
            for _ in range(5):
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(s)
                for _ in range(10):
                    copy()
                e1.record(s)
                e1.synchronize()
                per_copy.append(cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / 10)
            name = rt.getDeviceProperties(device)["name"]
            src = dst = None   # freed, so the free memory below counts theirs
            cupy.get_default_memory_pool().free_all_blocks()
            free_bytes = rt.memGetInfo()[0]
        t = float(statistics.median(per_copy))
        q.put(("ok", {"time_s": t, "copy_rate_gbps": 2 * nbytes / t / 1e9, "nbytes": nbytes,
                      "gpu": name.decode() if isinstance(name, bytes) else str(name),
                      "cupy": cupy.__version__, "runtime": rt.runtimeGetVersion(),
                      "free_bytes": free_bytes}))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which stops
        q.put(("err", f"{type(exc).__name__}: {exc}"))


def measure_copy_rate(device: int, nbytes: int = COPY_NBYTES) -> dict:
    """The device-to-device copy rate of GPU ``device``, measured in a spawned process (this one
    never initialises CUDA).

    Raises:
        SystemExit: no usable CUDA device or CuPy (says why).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_copy_rate_child, args=(q, device, nbytes))
    p.start()
    try:
        status, info = q.get(timeout=180)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
    if status != "ok":
        hint = ("; install the gpu extra: pip install -e '.[gpu]' (CUDA 12) or '.[cuda13]'"
                if "No module named 'cupy'" in str(info) else "")
        raise SystemExit(f"collectives.py --device cuda: cannot measure GPU {device}: {info}{hint}")
    return info


def gpu_limit(op: str, n: int, copy_rate_gbps: float) -> tuple[float, str]:
    """(algbw_max in GB/s, the rule) for ``n`` ranks sharing one GPU; see the module notes."""
    if op == "all_reduce":
        return copy_rate_gbps / (2 * n), "copy_rate/(2n)"
    return copy_rate_gbps / (n + 1), "copy_rate/(n+1)"


# -- gloo -----------------------------------------------------------------------------------------

def _gloo_rank(rank, n, port, ops, sizes, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # torch 2.13 names them *_single and warns on the older *_into_tensor/*_tensor names
    _gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=n)
    rows = []
    try:
        for op in ops:
            for nbytes in sizes:
                per, actual = elems(op, nbytes, n)
                if op in ("all_reduce", "broadcast"):
                    x = torch.zeros(per)
                    call = (lambda x=x: dist.all_reduce(x)) if op == "all_reduce" else \
                        (lambda x=x: dist.broadcast(x, 0))
                elif op == "all_gather":
                    x, out = torch.zeros(per), torch.empty(per * n)
                    call = lambda out=out, x=x: _gather_single(out, x)  # noqa: E731
                else:
                    x, out = torch.zeros(per * n), torch.empty(per)
                    call = lambda out=out, x=x: _scatter_single(out, x)  # noqa: E731
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


def columns(lines: list[list[str]]) -> list[str]:
    """``lines`` of cells as text columns, each as wide as its widest cell (the first one
    left-aligned, the others right-aligned) and one space apart, so a value wider than usual
    shifts its column instead of running into its neighbour."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [" ".join([line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True)])
            for line in lines]


def print_table(rows):
    by = {(r["op"], r["ranks"], r["nbytes"], r["impl"]): r for r in rows}
    impls = sorted({r["impl"] for r in rows})
    limits = any("frac_of_limit" in r for r in rows)
    head = ["op", "ranks", "size"]
    for impl in impls:
        head += ["|", f"{impl} time", "algbw", "busbw"]
    if len(impls) == 2:
        head += ["|", "busbw ratio"]
    if limits:
        head += ["|", "algbw_max", "of max", "check"]
    lines = [head]
    for op, n, nb in sorted({(r["op"], r["ranks"], r["nbytes"]) for r in rows},
                            key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 9, k[1], k[2])):
        line = [op, str(n), fmt_size(nb)]
        for impl in impls:
            r = by.get((op, n, nb, impl))
            if r is None:
                line += ["|", "-", "-", "-"]
            else:
                t = r["time_s"]
                ts = f"{t * 1e6:.1f}us" if t < 1e-3 else f"{t * 1e3:.2f}ms"
                line += ["|", ts, f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}"]
        if len(impls) == 2:
            a, b = (by.get((op, n, nb, i)) for i in impls)
            if a and b and a["busbw_gbps"] > 0 and b["busbw_gbps"] > 0:
                # rtxnet / gloo, whichever order the names sort in
                rt = a if a["impl"].startswith("rtxnet") else b
                gl = b if rt is a else a
                line += ["|", f"{rt['busbw_gbps'] / gl['busbw_gbps']:.2f}x"]
            else:
                line += ["|", "-"]
        if limits:
            r = by.get((op, n, nb, impls[0]))
            if r is not None and "frac_of_limit" in r:
                line += ["|", f"{r['algbw_max_gbps']:.1f}", f"{r['frac_of_limit'] * 100:.1f}%",
                         "ok" if r.get("ok", True) else "WRONG"]
            else:
                line += ["|", "-", "-", "-"]
        lines.append(line)
    text = columns(lines)
    print(text[0])
    print("-" * len(text[0]))
    for line in text[1:]:
        print(line)


def print_phases(rows) -> None:
    """Where a GPU operation's time goes (stderr): the IPC phases' median times, in microseconds
    from the start of the operation's IPC part, next to the whole iteration."""
    rows = [r for r in rows if r.get("phases_us")]
    if not rows:
        return
    lines = [["impl", "op", "ranks", "size", "total", *PHASES]]
    for r in rows:
        ph = r["phases_us"]
        total = r.get("time_barrier_s", r["time_s"])
        lines.append([r["impl"], r["op"], str(r["ranks"]), fmt_size(r["nbytes"]),
                      f"{total * 1e6:.0f}", *(f"{ph[p]:.0f}" if p in ph else "-" for p in PHASES)])
    print("\nIPC phases (median us from the start of the exchange; total: the iteration after a "
          "barrier, time_barrier_s):", file=sys.stderr)
    for line in columns(lines):
        print(line, file=sys.stderr)


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
    for ax, op in zip(axes[0], ops, strict=True):
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
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--ranks", type=int_in(1, 64), nargs="+", default=[2, 4],
                   help="world sizes to run, each 1..64 (default 2 4)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                   help="default: 8B 1KiB 64KiB 1MiB 16MiB 64MiB (cpu), "
                        f"{' '.join(GPU_SIZES)} (cuda)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=None,
                   help=f"default: {' '.join(OPS)} (cpu), {' '.join(GPU_OPS)} (cuda)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: NumPy arrays, against gloo; cuda: CuPy arrays on one GPU shared by "
                        "the ranks (CUDA IPC), against the copy rate")
    p.add_argument("--gpu", type=int_in(0, 1023), default=0, help="--device cuda: the GPU every rank uses")
    p.add_argument("--max-bytes", type=parse_size, default=None,
                   help="drop sizes above this one (e.g. 256MiB)")
    p.add_argument("--compare", choices=["gloo", "boards", "none"], default=None,
                   help="gloo (cpu; the default there), boards (cuda: also run with "
                        "RTXNET_IPC_BOARD=1, the IPC hellos and 'done's through signal boards), "
                        "or none (the default on cuda)")
    p.add_argument("--no-shm", action="store_true", help="rtxnet over TCP only")
    p.add_argument("--algorithm", default=None,
                   help="cpu: force rtxnet's algorithm for every op (e.g. direct, ring, shm; "
                        "rtxnet.collectives.ALGORITHMS lists each op's); default: rtxnet's choice")
    p.add_argument("--repeat", type=int_in(1, 1000), default=1,
                   help="alternate rtxnet and gloo this many times; report the median")
    p.add_argument("--json", "--out", dest="json", type=output_file, help="write JSON rows here")
    p.add_argument("--plot", type=output_file, help="PNG path (default: the JSON path with .png)")
    given = sys.argv[1:] if argv is None else list(argv)
    for i, value in enumerate(given):   # argparse reads "-1KiB" as an unknown option ("-2" it passes to the type)
        if re.fullmatch(r"-\d\S*", value) and not re.fullmatch(r"-\d+", value):
            flag = next((g for g in reversed(given[:i]) if g.startswith("--")), None)
            p.error(f"{'argument ' + flag + ': ' if flag else ''}bad value {value!r}: sizes are positive")
    args = p.parse_args(given)
    cuda = args.device == "cuda"
    if args.sizes is None:
        names = GPU_SIZES if cuda else ("8B", "1KiB", "64KiB", "1MiB", "16MiB", "64MiB")
        args.sizes = [parse_size(s) for s in names]
    if args.max_bytes is not None:
        args.sizes = [s for s in args.sizes if s <= args.max_bytes]
        if not args.sizes:
            p.error(f"--max-bytes({fmt_size(args.max_bytes)}) leaves no size")
    if args.ops is None:
        args.ops = list(GPU_OPS if cuda else OPS)
    if args.compare is None:
        args.compare = "none" if cuda else "gloo"
    if cuda and args.compare == "gloo":
        p.error("--compare gloo is for --device cpu; on cuda the anchor is the copy rate")
    if not cuda and args.compare == "boards":
        p.error("--compare boards is for --device cuda (the IPC signal boards)")
    if args.repeat < 1:
        p.error(f"--repeat({args.repeat}) must be >= 1")
    if cuda and args.no_shm:
        p.error("--no-shm is for --device cpu (on cuda the ranks share one GPU through CUDA IPC)")
    if not cuda:
        # every rank holds its input, its output and the transport's staging of the same size
        need, free = 3 * max(args.sizes) * max(args.ranks), psutil.virtual_memory().available
        if need > free:
            p.error(f"--sizes {fmt_size(max(args.sizes))} with {max(args.ranks)} ranks needs about "
                    f"{need / 2**30:.1f} GiB of memory (3 buffers per rank); "
                    f"{free / 2**30:.1f} GiB is available")
    if args.algorithm is not None:
        from rtxnet.collectives import ALGORITHMS

        if cuda:
            p.error("--algorithm is for --device cpu")
        bad = [op for op in args.ops if args.algorithm not in ALGORITHMS[op]]
        if bad:
            allowed = "; ".join(f"{op}: {', '.join(ALGORITHMS[op])}" for op in bad)
            p.error(f"--algorithm {args.algorithm!r} does not apply to {', '.join(bad)} ({allowed})")
        if args.algorithm == "shm" and args.no_shm:
            p.error("--algorithm shm moves data through shared memory, which --no-shm turns off; "
                    "give one or the other")
    if cuda:
        rows = run_cuda(args)
    else:
        rows = run_cpu(args)
    print_table(rows)
    # output_file checked the nearest existing folder at the start; the missing ones are made now
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"json: {args.json}")
    path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, path)


def run_cuda(args) -> list[dict]:
    t0 = time.perf_counter()
    copy = measure_copy_rate(args.gpu)
    print(f"GPU {args.gpu} ({copy['gpu']}): device-to-device copy of "
          f"{fmt_size(copy['nbytes'])} in {copy['time_s'] * 1e3:.3f} ms = "
          f"{copy['copy_rate_gbps']:.0f} GB/s (read + written), measured in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rate = copy["copy_rate_gbps"]
    # every rank holds its input and output on the one GPU (and a CUDA context, ~0.5 GiB)
    need = max(args.ranks) * (2 * max(args.sizes) + 2**29)
    if need > copy["free_bytes"]:
        raise SystemExit(f"collectives.py --device cuda: --sizes {fmt_size(max(args.sizes))} with "
                         f"{max(args.ranks)} ranks needs about {need / 2**30:.1f} GiB on GPU "
                         f"{args.gpu}; {copy['free_bytes'] / 2**30:.1f} GiB is free")
    rows = []
    impls = [("rtxnet", "cuda-ipc", None)]
    if args.compare == "boards":
        impls.append(("rtxnet-boards", "cuda-ipc/boards", True))
    for n in args.ranks:
        for impl, transport, board in impls:
            runs, barrier_runs, oks, phases, stats = [], [], None, None, None
            for k in range(args.repeat):
                t0 = time.perf_counter()
                merged, ok, phases, stats = run_rtxnet_cuda(n, args.ops, args.sizes, args.gpu,
                                                            board=board)
                runs.append([m[:3] for m in merged])
                barrier_runs.append([(m[0], m[1], m[3]) for m in merged])
                oks = ok if oks is None else [a and b for a, b in zip(oks, ok, strict=True)]
                print(f"{impl} cuda n={n} run {k} done in {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr)
            barrier = to_rows(impl, n, transport, barrier_runs)
            for row, ok, ph, st, lat in zip(to_rows(impl, n, transport, runs), oks, phases, stats,
                                            barrier, strict=True):
                limit, rule = gpu_limit(row["op"], n, rate)
                row.update(device=f"cuda:{args.gpu}", gpu=copy["gpu"], ok=ok,
                           copy_rate_gbps=rate, phases_us=ph, hellos=st,
                           time_barrier_s=lat["time_s"],
                           algbw_max_gbps=limit, limit=rule,
                           frac_of_limit=row["algbw_gbps"] / limit if limit > 0 else None,
                           frac_of_limit_barrier=(lat["algbw_gbps"] / limit if limit > 0
                                                  else None))
                rows.append(row)
    print_phases(rows)
    wrong = [f"{r['impl']} {r['op']} n={r['ranks']} {fmt_size(r['nbytes'])}" for r in rows
             if not r["ok"]]
    if wrong:
        print(f"WRONG RESULTS: {', '.join(wrong)}", file=sys.stderr)
    return rows


def run_cpu(args) -> list[dict]:
    rows = []
    transport = ("tcp" if args.no_shm else "shm") + (f"/{args.algorithm}" if args.algorithm else "")
    for n in args.ranks:
        ours, theirs = [], []
        for k in range(args.repeat):
            t0 = time.perf_counter()
            ours.append(run_rtxnet(n, args.ops, args.sizes, not args.no_shm, args.algorithm))
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
    return rows


if __name__ == "__main__":
    main()
