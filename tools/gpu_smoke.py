"""One-line-per-check smoke test of every CUDA/CuPy/NCCL call rtxnet's GPU path makes, run first
by ``tools/gpu_check.sh`` so that a failure in the longer tests can be traced to one API call.

    python3 tools/gpu_smoke.py            # prints "ok"/"FAIL" lines; exit 1 if any check failed

Checks, each on device 0: CuPy and the device; rtxnet's stream and ordering events; the reduction
kernels (float32, float16, bfloat16 through torch when present) against NumPy; the allocation range
of an interior pointer (``cuMemGetAddressRange``); CUDA IPC of memory and of an event into a
spawned process (which reads the parent's buffer, queries the parent's event, and writes back
into the parent's memory); ``gpu_identity``; an NCCL communicator of one rank.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RESULTS: list[tuple[str, bool]] = []


def check(name: str):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
            ok = True
            line = f"ok   {name} ({(time.perf_counter() - t0) * 1e3:.1f} ms){': ' + str(detail) if detail else ''}"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            ok = False
            tb = traceback.format_exc(limit=4).strip().splitlines()
            line = f"FAIL {name}: {type(exc).__name__}: {exc}\n     " + "\n     ".join(tb[-6:])
        print(line, flush=True)
        RESULTS.append((name, ok))
        return fn
    return wrap


def _child(handle: bytes, offset: int, ev_handle: bytes, n: int, conn) -> None:
    try:
        import cupy
        import numpy as np

        cupy.cuda.Device(0).use()
        rt = cupy.cuda.runtime
        base = rt.ipcOpenMemHandle(handle)
        ev = rt.ipcOpenEventHandle(ev_handle)
        deadline = time.monotonic() + 10
        rc = rt.eventQuery(ev)
        while rc != 0 and time.monotonic() < deadline:
            time.sleep(0.001)
            rc = rt.eventQuery(ev)
        mem = cupy.cuda.UnownedMemory(base + offset, n * 4, None, 0)
        view = cupy.ndarray((n,), np.float32, cupy.cuda.MemoryPointer(mem, 0))
        seen = float(view.sum())
        view += 1                       # written back into the parent's memory
        cupy.cuda.Device(0).synchronize()
        rt.ipcCloseMemHandle(base)
        conn.send(("ok", rc, seen))
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=4)))


def main() -> int:
    import numpy as np

    state: dict = {}

    @check("cupy and device 0")
    def _():
        import cupy

        state["cupy"] = cupy
        cupy.cuda.Device(0).use()
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return (f"cupy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s), {name}, "
                f"cc {props['major']}.{props['minor']}, runtime {cupy.cuda.runtime.runtimeGetVersion()}")

    cupy = state.get("cupy")
    if cupy is None:
        print("no CuPy: nothing else can be checked")
        return 1

    @check("rtxnet DeviceStream, after/before/record, await_event")
    def _():
        import asyncio

        from rtxnet.collectives.gpu.stream import DeviceStream, await_event

        s = DeviceStream(0)
        s.after(cupy.cuda.get_current_stream().ptr)
        ev = s.before(cupy.cuda.get_current_stream().ptr)
        asyncio.run(await_event(ev, timeout_s=5))
        asyncio.run(await_event(s.record(), timeout_s=5))
        state["stream"] = s

    @check("kernels.launch_reduce float32 / float16, 3 sources, 2 destinations, offset pointers")
    def _():
        from rtxnet.collectives.gpu import kernels
        from rtxnet.collectives.reduce_ops import ReduceOp

        s = state["stream"]
        out = []
        for dt in (np.float32, np.float16):
            n = 1_000_003
            # small integers built exactly, then cast (float16 ends at 65504: an arange in it
            # would turn to inf and NaN, which never compares equal)
            xs = [(cupy.arange(n + 1, dtype=cupy.int32) % 7 + k).astype(dt)[1:] for k in range(3)]
            ds = [cupy.zeros(n + 1, dt)[1:] for _ in range(2)]
            cupy.cuda.Device(0).synchronize()
            kernels.launch_reduce([x.data.ptr for x in xs], [d.data.ptr for d in ds], n, np.dtype(dt),
                                  ReduceOp.SUM, stream=s.ptr, device=0)
            s.stream.synchronize()
            want = (xs[0].astype(np.float32) + xs[1] + xs[2]).astype(dt)
            for d in ds:
                if not bool(cupy.all(d == want)):
                    raise AssertionError(f"{np.dtype(dt)}: {int(cupy.count_nonzero(d != want))} wrong")
            out.append(str(np.dtype(dt)))
        return ", ".join(out)

    @check("kernels.launch_reduce bfloat16 (torch CUDA tensors), AVG over 2")
    def _():
        import torch

        from rtxnet.collectives.gpu import kernels
        from rtxnet.collectives.reduce_ops import BFLOAT16, ReduceOp

        s = state["stream"]
        a = (torch.arange(4097, device="cuda") % 9).to(torch.bfloat16)
        b = a * 3
        d = torch.empty_like(a)
        torch.cuda.synchronize()
        kernels.launch_reduce([a.data_ptr(), b.data_ptr()], [d.data_ptr()], a.numel(), BFLOAT16,
                              ReduceOp.AVG, avg_n=2, stream=s.ptr, device=0)
        s.stream.synchronize()
        want = ((a.float() + b.float()) / 2).to(torch.bfloat16)
        if not bool((d == want).all()):
            raise AssertionError(f"{int((d != want).sum())} wrong")
        return f"torch {torch.__version__}"

    @check("host cost of one launch_reduce (2 and 4 sources), eventQuery, eventRecord")
    def _():
        import timeit

        from rtxnet.collectives.gpu import kernels
        from rtxnet.collectives.reduce_ops import ReduceOp

        s = state["stream"]
        xs = [cupy.zeros(1024, cupy.float32) for _ in range(4)]
        out = []
        for k in (2, 4):
            ptrs = [x.data.ptr for x in xs[:k]]

            def launch(ptrs=ptrs):
                kernels.launch_reduce(ptrs, ptrs, 1024, np.dtype(np.float32), ReduceOp.SUM,
                                      stream=s.ptr, device=0)
            launch()
            s.stream.synchronize()
            per = min(timeit.repeat(launch, number=200, repeat=3)) / 200
            s.stream.synchronize()
            out.append(f"launch_reduce {k} sources {per * 1e6:.1f} us")
        ev = cupy.cuda.Event(block=False, disable_timing=True)
        ev.record(s.stream)
        s.stream.synchronize()
        rt = cupy.cuda.runtime
        q = min(timeit.repeat(lambda: rt.eventQuery(ev.ptr), number=1000, repeat=3)) / 1000
        r = min(timeit.repeat(lambda: rt.eventRecord(ev.ptr, s.ptr), number=1000, repeat=3)) / 1000
        s.stream.synchronize()
        out.append(f"eventQuery {q * 1e6:.2f} us, eventRecord {r * 1e6:.2f} us")
        return "; ".join(out)

    @check("cuMemGetAddressRange of an interior pointer, ipcGetMemHandle, ipcGetEventHandle")
    def _():
        from rtxnet.collectives.gpu.ipc import _address_range

        x = cupy.zeros(1 << 20, cupy.float32)
        ptr = x.data.ptr + 4096
        base, size = _address_range(ptr)
        if not base <= ptr < base + size:
            raise AssertionError(f"{ptr:#x} not in [{base:#x}, +{size})")
        h = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
        ev = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        eh = bytes(cupy.cuda.runtime.ipcGetEventHandle(ev.ptr))
        state.update(x=x, base=base, h=h, ev=ev, eh=eh)
        return f"handle {len(h)} B, event handle {len(eh)} B, offset {ptr - base}"

    @check("CUDA IPC into a spawned process: read, query the event, write back")
    def _():
        x, base, ev = state["x"], state["base"], state["ev"]
        n = 1 << 16
        x[:n] = 2.0
        ev.record(cupy.cuda.get_current_stream())
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(state["h"], x.data.ptr - base, state["eh"], n, child))
        p.start()
        for _ in range(20):                 # a child that crashed says so at once, not in 60 s
            if parent.poll(1) or not p.is_alive():
                break
        if not parent.poll(0.1):
            code = p.exitcode
            p.kill()
            raise TimeoutError(f"the child gave no answer in 20 s (exit code {code})")
        res = parent.recv()
        p.join(10)
        if res[0] != "ok":
            raise RuntimeError(f"child: {res[1]}\n{res[2]}")
        _, rc, seen = res
        if rc != 0 or seen != 2.0 * n:
            raise AssertionError(f"event query {rc}, sum seen {seen}, expected {2.0 * n}")
        if not bool(cupy.all(x[:n] == 3.0)):
            raise AssertionError("the child's write did not reach this process's memory")
        return "read, event and write-back all seen"

    @check("rtxnet.topology.gpu_identity(0)")
    def _():
        from rtxnet.topology import gpu_identity

        ident = gpu_identity(0)
        if not ident.get("uuid"):
            raise AssertionError(f"no uuid: {ident}")
        return ident

    @check("NCCL communicator of one rank, allReduce")
    def _():
        from cupy.cuda import nccl

        from rtxnet.collectives.gpu.nccl import nccl_types, uid_from_bytes, uid_to_bytes
        from rtxnet.collectives.reduce_ops import ReduceOp

        uid = uid_from_bytes(uid_to_bytes(nccl.get_unique_id()))
        comm = nccl.NcclCommunicator(1, uid, 0)
        x = cupy.ones(1 << 20, cupy.float32)
        dt, op = nccl_types(np.dtype(np.float32), ReduceOp.SUM)
        comm.allReduce(x.data.ptr, x.data.ptr, x.size, dt, op, cupy.cuda.get_current_stream().ptr)
        cupy.cuda.Device(0).synchronize()
        comm.destroy()
        if not bool(cupy.all(x == 1.0)):
            raise AssertionError("world of 1 changed the data")
        return f"NCCL {nccl.get_version()}"

    failed = [n for n, ok in RESULTS if not ok]
    print(f"gpu_smoke: {len(RESULTS) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
