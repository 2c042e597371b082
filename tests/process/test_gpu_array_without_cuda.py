"""A CUDA array on a machine where rtxnet cannot run GPU collectives (no CuPy: CUDA torch
installed without the ``gpu`` extra), through the blocking facade and the async API."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import procs
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                       reason="CuPy is installed: a CUDA array takes the GPU path here"),
]

_RANK = textwrap.dedent("""
    import asyncio, json, sys, time
    import numpy as np
    import rtxnet

    class CudaLooking:     # a DLPack producer on device kDLCUDA, as torch CUDA tensors are
        def __dlpack_device__(self):
            return (2, 0)
        def __dlpack__(self, stream=None):
            raise BufferError("not a real array")

    def arg(rank):
        return CudaLooking() if rank == 0 else np.ones(4, np.float32)

    def record(out, call):
        t0 = time.monotonic()
        try:
            call()
            out.append(["no error", "", 0.0])
        except Exception as exc:
            out.append([type(exc).__name__, str(exc), time.monotonic() - t0])

    out = []
    if sys.argv[2] == "p2p":
        # rank 0's first recv is refused (a CUDA array): it still takes rank 1's first message
        # (dropped), so its next recv gets the second one
        pg = rtxnet.init()
        rank = pg.rank
        if rank == 1:
            pg.send(np.full(4, 1.0, np.float32), dst=0)
            pg.send(np.full(4, 2.0, np.float32), dst=0)
        else:
            record(out, lambda: pg.recv(arg(rank), src=1, timeout=20))
            y = np.zeros(4, np.float32)
            pg.recv(y, src=1, timeout=20)
            out.append(float(y[0]))
        pg.barrier(timeout=20)
        pg.close()
        with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        sys.exit(0)
    # (each rank's number is read at the start: once its peer has left, the rank left is 0)
    if sys.argv[2] == "blocking":
        pg = rtxnet.init()
        rank = pg.rank
        record(out, lambda: pg.all_reduce(arg(rank), timeout=20))
        y = np.ones(4, np.float32)
        pg.all_reduce(y, timeout=20)                  # the group is still in step
        out.append(float(y[0]))
        pg.close()
    else:
        async def main():
            pg = await rtxnet.connect()
            rank = pg.rank
            async def call():
                await pg.all_reduce(arg(rank), timeout=20)
            t0 = time.monotonic()
            try:
                await call()
                out.append(["no error", "", 0.0])
            except Exception as exc:
                out.append([type(exc).__name__, str(exc), time.monotonic() - t0])
            y = np.ones(4, np.float32)
            await pg.all_reduce(y, timeout=20)
            out.append(float(y[0]))
            await pg.close()
            return rank
        rank = asyncio.run(main())
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(out, f)
""")


@pytest.mark.parametrize("api", ["blocking", "async"])
def test_a_cuda_array_without_cupy_is_refused_and_the_peers_are_told_at_once(tmp_path, api):
    # Before: rank 0 got a bare ModuleNotFoundError (and, on the blocking facade, "coroutine
    # ... was never awaited"), and rank 1 waited out its whole deadline (a tester's find).
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    p = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "2", str(script),
                        str(tmp_path), api], capture_output=True, text=True, timeout=100,
                       env=procs.env(RTXNET_LAST_CALL="30"), cwd=ROOT)
    text = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, text
    assert "never awaited" not in text, text
    (kind0, msg0, _), sum0 = json.loads((tmp_path / "rank0.json").read_text())
    (kind1, msg1, took1), sum1 = json.loads((tmp_path / "rank1.json").read_text())
    assert kind0 == "ConfigError", msg0
    assert "rtxnet cannot run GPU collectives here" in msg0 and "CuPy is not importable" in msg0, msg0
    assert kind1 == "CollectiveRefusedError" and "rank 0 refused" in msg1, msg1
    assert took1 < 10, took1
    assert sum0 == sum1 == 2.0


def test_a_recv_into_a_cuda_array_refused_without_cupy_still_takes_its_message(tmp_path):
    # GPU point-to-point moves through host memory, as CPU arrays' does: a refused recv drops
    # the message it would have taken, so the next recv gets the next send's (before, a GPU
    # recv refused on its rank left its message queued for the next recv, silently)
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    p = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "2", str(script),
                        str(tmp_path), "p2p"], capture_output=True, text=True, timeout=100,
                       env=procs.env(RTXNET_LAST_CALL="30"), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (kind, msg, _), second = json.loads((tmp_path / "rank0.json").read_text())
    assert kind == "ConfigError" and "rtxnet cannot run GPU collectives here" in msg, msg
    assert second == 2.0
