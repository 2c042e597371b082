"""All-reduce across two hosts on a rate-limited link: flat ring against hierarchical (and
all_gather / reduce_scatter: direct and the ring against hierarchical).

    sudo python tools/bench/multihost.py [--op all_reduce] [--rate 1gbit] \\
        [--sizes 1MiB 4MiB 16MiB 64MiB] [--json out/multihost.json]

Two hosts are two network namespaces joined by a veth pair whose each direction is limited to
``--rate`` by a token bucket (tools/netns.py), as a NIC's line rate would; each host runs
``rtxnet-run --nnodes 2 --node-rank K --nproc 2`` (2 x 2 ranks, the coordinator on host 0). For
each size (float32 SUM, timed iterations after warm-up, each started after a barrier; an
iteration's time is the slowest rank's; the median is reported) the ranks all-reduce with
``algorithm="ring"`` (the flat ring over all four ranks, over the bulk TCP streams), with
``"hierarchical"`` (shared memory within each host, a ring of the two hosts' first ranks across
the link, broadcast back) and with the default choice (hierarchical above 64 KiB on hosts that
share ranks; ``ran`` in the JSON). Sizes of a few MiB or less partly ride the token bucket's
1 MB burst and may beat the bound.

Anchor, measured in the same run: the link rate, one TCP stream from host 0 to host 1 (256 MiB,
``link_gbps``). The bound each algorithm cannot beat follows from the bytes it must put on the
busier direction of the link for an array of S bytes over n = 4 ranks on 2 hosts: the flat ring
[h0 r0, h0 r1, h1 r2, h1 r3] crosses the link once each way, with ``2(n-1)/n * S = 1.5 S`` on each
crossing (reduce-scatter then all-gather, nccl's ring); hierarchical sends the hosts' partial sums
over a ring of 2, ``S`` each way. So ``time >= 1.5 S / link`` (ring) and ``S / link``
(hierarchical), and each row carries ``frac_of_bound`` (bound time / measured time).
``--dtype float16`` / ``bfloat16``: the bound still counts the array's own bytes, but the ring
and hierarchical reductions carry partial sums as float32 (rounded once, at the end, as every
form's), twice those bytes, so they reach about half of it.

Output: a table, and JSON rows ``{algorithm, ran, nbytes, time_s, algbw_gbps, busbw_gbps, bound_s,
frac_of_bound, ok}`` plus ``op``, ``link_gbps`` and ``rate``. Needs root (namespaces and tc).

``--op all_gather`` / ``--op reduce_scatter``: S is the gathered output (the scattered input), W
parts of S/4; ``"direct"`` sends every rank's part to every other rank, so each host puts its 2
ranks' parts to 2 remote ranks on the link, ``S`` each way; the ring crosses once each way with
3 of the 4 parts, ``0.75 S``; ``"hierarchical"`` exchanges across the link between the ranks at the
same position of each host (2 streams, 1 part each way each: ``0.5 S`` each way), then within
each host over shared memory (reduce_scatter: within first), pipelined in chunks from 8 MiB. The
default on these hosts is hierarchical from 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rtxnet.config import int_in, output_file, positive_seconds

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

ALGORITHMS = {"all_reduce": ("ring", "hierarchical", "default"),
              "all_gather": ("direct", "ring", "hierarchical", "default"),
              "reduce_scatter": ("direct", "ring", "hierarchical", "default")}
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit in ("GiB", "MiB", "KiB", "B"):
        if text.endswith(unit) and text[:-len(unit)].isdigit():
            return int(text[:-len(unit)]) * _UNITS[unit]
    raise argparse.ArgumentTypeError(f"bad size {text!r}; e.g. 1MiB 64MiB")


# -- rank side (run by rtxnet-run on each host) ---------------------------------------------------

def _op(pg, opname: str, nbytes: int, kw: dict, dtype: np.dtype):
    """``(call, check)`` for one row: ``nbytes`` is the all-reduced array, or all_gather's output
    (reduce_scatter's input) of W parts, of ``dtype`` (sums of 1..4 are exact in each)."""
    n, r = pg.world_size, pg.rank
    k = nbytes // dtype.itemsize
    if opname == "all_reduce":
        x = np.full(k, r + 1.0, dtype)
        return (lambda: pg.all_reduce(x, **kw)), (lambda: np.all(x == n * (n + 1) / 2))
    per = k // n
    if opname == "all_gather":
        x, out = np.full(per, r + 1.0, dtype), np.zeros(per * n, dtype)
        return ((lambda: pg.all_gather(out, x, **kw)),
                (lambda: np.array_equal(out, np.repeat(np.arange(1.0, n + 1, dtype=dtype), per))))
    x, out = np.full(per * n, r + 1.0, dtype), np.zeros(per, dtype)
    return (lambda: pg.reduce_scatter(out, x, **kw)), (lambda: np.all(out == n * (n + 1) / 2))


def rank_main(opname: str, sizes: list[int], out: str, iters: int, dtype: str = "float32") -> int:
    import rtxnet
    from rtxnet.collectives.reduce_ops import dtype_from_name

    pg = rtxnet.init()
    np_dtype = dtype_from_name(dtype)
    rows = []
    for algo in ALGORITHMS[opname]:
        kw = {} if algo == "default" else {"algorithm": algo}
        for nbytes in sizes:
            call, check = _op(pg, opname, nbytes, kw, np_dtype)
            call()
            ok = bool(check())
            times = []
            for i in range(iters + 2):
                pg.barrier()
                t0 = time.perf_counter()
                call()
                t = np.array([time.perf_counter() - t0])
                pg.all_reduce(t, op=rtxnet.ReduceOp.MAX)   # the slowest rank's
                if i >= 2:
                    times.append(float(t[0]))
            flags = np.array([1.0 if ok else 0.0])
            pg.all_reduce(flags, op=rtxnet.ReduceOp.MIN)
            rows.append({"algorithm": algo, "nbytes": nbytes, "time_s": statistics.median(times),
                         "times_s": times, "ok": bool(flags[0] == 1.0)})
    if pg.rank == 0:
        Path(out).write_text(json.dumps(rows))
    pg.barrier()
    pg.close()
    return 0


# -- the link's own rate ---------------------------------------------------------------------------

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; buf = bytearray(1 << 20); t0 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    t0 = t0 or time.perf_counter(); n += k
print(n, time.perf_counter() - t0, flush=True)
"""

_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(block)
c.close()
"""


def link_rate(hosts, mib: int = 256) -> float:
    """Bytes/s of one TCP stream from host 0 to host 1 (the receiver's clock, from its first byte)."""
    sink = hosts.popen(1, [sys.executable, "-c", _SINK, hosts.addrs[1]], stdout=subprocess.PIPE, text=True)
    try:
        port = sink.stdout.readline().strip()
        src = hosts.popen(0, [sys.executable, "-c", _SOURCE, hosts.addrs[1], port, str(mib)])
        if src.wait(120) != 0:   # the sink would wait for its connection forever
            raise RuntimeError(f"the link test's sender on host 0 exited {src.returncode}")
        n, secs = sink.stdout.readline().split()
        sink.wait(30)
    finally:
        for p in (sink,):
            if p.poll() is None:
                p.kill()
    return int(n) / float(secs)


# -- driver ----------------------------------------------------------------------------------------

def run(rate: str, sizes: list[int], iters: int, opname: str = "all_reduce", timeout_s: float = 1500.0,
        dtype: str = "float32") -> dict:
    """Raises RuntimeError: a launcher exited with an error, or both were not done within
    ``timeout_s`` (killed then, their last output in the message)."""
    import netns

    from tests import procs

    with netns.two_hosts(rate=rate) as hosts, tempfile.TemporaryDirectory(prefix="rtxnet-mh-") as tmp:
        link = link_rate(hosts)
        coord = procs.Coordinator(Path(tmp) / "journal", host=hosts.addrs[0], prefix=hosts.prefix(0))
        out = Path(tmp) / "rows.json"
        launchers = []
        try:
            for k in (0, 1):
                env = procs.env(RTXNET_HOST=f"node{k}")
                launchers.append(hosts.popen(
                    k, [sys.executable, "-m", "rtxnet.launcher", "--nnodes", "2", "--node-rank", str(k),
                        "--nproc", "2", "--coordinator", coord.address, "--job", "multihost-bench",
                        __file__, "--rank-side", "--op", opname, "--out", str(out), "--iters", str(iters),
                        "--dtype", dtype,
                        "--sizes", *[f"{s}B" for s in sizes]],
                    env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            deadline = time.monotonic() + timeout_s
            try:
                errs = [p.communicate(timeout=max(0.1, deadline - time.monotonic()))[1] for p in launchers]
            except subprocess.TimeoutExpired:
                for p in launchers:
                    p.kill()
                tails = [f"node {k} (exit {p.wait()}):\n{p.communicate()[1][-3000:]}"
                         for k, p in enumerate(launchers)]
                raise RuntimeError(f"the two launchers were not done within --timeout {timeout_s:g} s; "
                                   f"killed. Their last output:\n" + "\n".join(tails)) from None
            for p, err in zip(launchers, errs, strict=True):
                if p.returncode != 0:
                    raise RuntimeError(f"a launcher exited {p.returncode}:\n{err[-3000:]}")
        finally:
            for p in launchers:
                if p.poll() is None:
                    p.kill()
            coord.kill()
        rows = json.loads(out.read_text())
    from rtxnet.collectives.group import SMALL_MAX_NBYTES
    from rtxnet.collectives.ring import BULK_MIN_NBYTES

    for r in rows:
        s, t = r["nbytes"], r["time_s"]
        r["algbw_gbps"] = s / t / 1e9
        # nccl-tests: all_reduce 2(n-1)/n, all_gather and reduce_scatter (n-1)/n, n = 4
        r["busbw_gbps"] = r["algbw_gbps"] * (2 * 3 / 4 if opname == "all_reduce" else 3 / 4)
        # what the default chose on these hosts (2 x 2 ranks, bulk streams up)
        if r["algorithm"] != "default":
            r["ran"] = r["algorithm"]
        elif opname == "all_reduce":
            r["ran"] = "hierarchical" if s > SMALL_MAX_NBYTES else "direct"
        else:
            r["ran"] = "hierarchical" if s >= BULK_MIN_NBYTES else "direct"
        r["bound_s"] = CROSSING[opname][r["ran"]] * s / link
        r["frac_of_bound"] = r["bound_s"] / t
    return {"op": opname, "dtype": dtype, "rate": rate, "link_gbps": link / 1e9, "ranks": 4, "hosts": 2,
            "rows": rows}


# bytes on the busier direction of the link per byte of the row's size S, 2 hosts x 2 ranks
# (see the module docstring)
CROSSING = {"all_reduce": {"ring": 1.5, "hierarchical": 1.0, "direct": 1.5},
            "all_gather": {"direct": 1.0, "ring": 0.75, "hierarchical": 0.5},
            "reduce_scatter": {"direct": 1.0, "ring": 0.75, "hierarchical": 0.5}}


def tc_rate(text: str) -> str:
    """An ``argparse`` type: a rate ``tc`` takes, a positive number and a unit (``1gbit``,
    ``500mbit``, ``100mbps``); refused naming it before any namespace is built (``bogus`` and
    ``0`` were tc's traceback after them: a tester's find)."""
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)", text.strip().lower())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate tc takes: a positive number and "
                                         f"bit, kbit, mbit, gbit, tbit or bps, kbps, ... (e.g. 1gbit)")
    return text.strip().lower()


def fmt_size(nbytes: int) -> str:
    """``64MiB``, ``1536KiB``, ``1000B``: the largest unit that divides it."""
    for unit in ("GiB", "MiB", "KiB"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def print_table(rows: list[dict]) -> None:
    # (the size was ``nbytes >> 20`` MiB: 1KiB printed as 0MiB, 1.5 MiB as 1MiB: a tester's find)
    print(f"{'algorithm':>13} {'ran':>13} {'size':>9} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} "
          f"{'bound ms':>9} {'of bound':>9} {'ok':>4}")
    for r in rows:
        print(f"{r['algorithm']:>13} {r['ran']:>13} {fmt_size(r['nbytes']):>9} {r['time_s'] * 1e3:9.1f} "
              f"{r['algbw_gbps']:11.3f} {r['busbw_gbps']:11.3f} {r['bound_s'] * 1e3:9.1f} "
              f"{r['frac_of_bound']:9.2f} {'yes' if r['ok'] else 'NO':>4}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=sorted(ALGORITHMS), default="all_reduce",
                    help="the collective (default all_reduce; sizes are all_gather's output, "
                         "reduce_scatter's input)")
    ap.add_argument("--rate", type=tc_rate, default="1gbit", help="tc rate of each direction of the link (default 1gbit)")
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=[1 << 20, 4 << 20, 16 << 20, 64 << 20],
                    help="array sizes, a whole number and B, KiB, MiB or GiB "
                         "(default 1MiB 4MiB 16MiB 64MiB)")
    ap.add_argument("--iters", type=int_in(1, 10**4), default=5, help="timed iterations per row (default 5)")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                    help="the arrays' dtype (default float32; the bound counts the array's own bytes, "
                         "though ring and hierarchical reductions carry float16/bfloat16 sums as float32)")
    ap.add_argument("--json", default=None, type=output_file, help="write the result here")
    ap.add_argument("--timeout", type=positive_seconds, default=1500.0,
                    help="seconds the two launchers get before they are killed, with their output "
                         "in the error (default 1500)")
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    # each row moves nbytes // itemsize elements (all_gather, reduce_scatter: 4 equal parts of
    # them), while algbw and the bound count nbytes: 0B ran empty arrays and 1000B an all_gather of
    # 992 B, reported as 1000 (a tester's find)
    itemsize = 4 if args.dtype == "float32" else 2
    unit = itemsize * (1 if args.op == "all_reduce" else 4)
    for nbytes in args.sizes:
        if nbytes == 0 or nbytes % unit:
            ap.error(f"argument --sizes: {nbytes} B is not a positive multiple of {unit} B "
                     + (f"(one {args.dtype} element)" if args.op == "all_reduce" else
                        f"(4 ranks' parts of whole {args.dtype} elements)"))
    if args.rank_side:
        return rank_main(args.op, args.sizes, args.out, args.iters, args.dtype)
    import netns

    try:
        res = run(args.rate, args.sizes, args.iters, args.op, args.timeout, args.dtype)
    except netns.Unavailable as exc:
        print(f"multihost: {exc}", file=sys.stderr)
        return 2
    print(f"{args.op} {args.dtype}, 2 hosts x 2 ranks, link {args.rate} each way: measured {res['link_gbps']:.3f} GB/s "
          f"(one TCP stream)")
    print_table(res["rows"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if all(r["ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
