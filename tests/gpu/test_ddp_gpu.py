"""DDP on CUDA: buckets on the module's GPU, reduced through the group's GPU path, equal to one
process on the global batch; skipped where CUDA (CuPy, torch.cuda) is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ddp_gpu_worker.py"
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

TOL = 1e-4   # relative, float32 on the GPU (reduction order differs from one process)


@pytest.fixture(autouse=True)
def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} sees no CUDA device")


@pytest.mark.parametrize(("nproc", "board"), [(2, "0"), (2, "1")], ids=["2", "2-boards"])
def test_ddp_on_one_shared_gpu_matches_one_process(tmp_path, nproc, board):
    env = procs.env(RTXNET_IPC_BOARD=board)
    proc = subprocess.run(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc), str(WORKER), str(tmp_path)],
        capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(res) == nproc
    for r in res:
        assert r["device"].startswith("cuda:") and r["bucket_devices"] == [r["device"]], r
        assert r["buckets"] >= 2, r
        assert r["init_rel"] == 0.0, r          # rank 0's parameters broadcast over the GPU path
        assert r["rel"] < TOL, r
        assert r["never_grad_is_none"], r
    assert len({r["sum"] for r in res}) == 1     # identical replicas


def test_a_module_on_cpu_and_cuda_is_refused_naming_both():
    import torch

    from rtxnet.parallel import DistributedDataParallel
    from transport.errors import ConfigError

    class Pg:
        world_size, rank, epoch = 1, 0, 0

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).cuda())
    with pytest.raises(ConfigError, match=r"on 2 devices: cpu \(0\.weight\), cuda:0 \(1\.weight\)"):
        DistributedDataParallel(net, Pg(), init_sync=False)
    ddp = DistributedDataParallel(net.cuda(), Pg(), init_sync=False)
    assert ddp.device == torch.device("cuda", 0)
