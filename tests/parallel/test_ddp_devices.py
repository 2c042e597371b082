"""Which modules DDP takes: one device, CPU or CUDA; several devices are refused naming them.

No GPU here: a ``meta`` tensor stands in for "not the CPU" (building the wrapper performs no
collective with ``init_sync=False``, so a stand-in process group suffices). The CUDA cases are in
``tests/gpu/test_ddp_gpu.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
import torch

from rtxnet.parallel import (
    ColumnParallelLinear,
    DeviceMesh,
    DistributedDataParallel,
    FullyShardedDataParallel,
    PipelineStage,
    RowParallelLinear,
    shard_mlp,
)
from transport.errors import ConfigError

pytestmark = pytest.mark.timeout(30)


class _Pg:
    world_size = 1
    rank = 0
    epoch = 0


def test_a_cpu_module_gets_cpu_buckets():
    ddp = DistributedDataParallel(torch.nn.Linear(4, 3), _Pg(), init_sync=False)
    assert ddp.device == torch.device("cpu")
    assert all(b.flat.device.type == "cpu" for b in ddp._buckets)


def test_a_module_on_two_devices_is_refused_naming_them():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    net[1].to("meta")
    with pytest.raises(ConfigError, match=r"on 2 devices: cpu \(0\.weight\), meta \(1\.weight\)"):
        DistributedDataParallel(net, _Pg(), init_sync=False)


def test_a_buffer_on_another_device_counts_too():
    net = torch.nn.BatchNorm1d(3)
    net.running_mean = net.running_mean.to("meta")
    with pytest.raises(ConfigError, match=r"cpu \(weight\), meta \(running_mean\)"):
        DistributedDataParallel(net, _Pg(), init_sync=False)


def test_a_sparse_embedding_is_refused_naming_it():
    # it failed at the first backward with torch's "copy_() between dense and sparse Tensors"
    net = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"0 \(Embedding\) has sparse=True"):
        DistributedDataParallel(net, _Pg(), init_sync=False)
    DistributedDataParallel(torch.nn.Embedding(10, 4), _Pg(), init_sync=False)   # dense: accepted


def test_something_that_is_not_a_process_group_is_refused_naming_it():
    # AttributeError: 'NoneType' object has no attribute 'size' ('rank' for FSDP) before
    for wrapper in (DistributedDataParallel, FullyShardedDataParallel):
        for bad, shown in ((None, "None (NoneType)"), ("pg", "'pg' (str)")):
            with pytest.raises(ConfigError, match=rf"^{wrapper.__name__}: pg must be the process group "
                                                  rf"of rtxnet\.init\(\) or a subgroup of it .*, got "
                                                  rf"{re.escape(shown)}$"):
                wrapper(torch.nn.Linear(4, 3), bad, init_sync=False)


def test_a_device_that_is_neither_cpu_nor_cuda_is_refused():
    with pytest.raises(ConfigError, match=r"weight is on meta; rtxnet DDP takes CPU or CUDA"):
        DistributedDataParallel(torch.nn.Linear(4, 3, device="meta"), _Pg(), init_sync=False)



@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
@pytest.mark.timeout(200)   # a fresh interpreter importing torch: 22 s on 2 loaded cores
def test_train_digits_asked_for_cuda_without_cuda_says_so(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = procs.env(RTXNET_COORDINATOR="tcp://127.0.0.1:9")
    r = subprocess.run([sys.executable, str(root / "examples" / "train_digits.py"), "--out",
                        str(tmp_path / "out"), "--device", "cuda"], capture_output=True, text=True,
                       timeout=180, env=env, cwd=root)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "train_digits: --device cuda, but torch" in r.stderr
    assert "use --device cpu" in r.stderr
    assert not (tmp_path / "out").exists()   # refused before the folder is made


@pytest.mark.timeout(60)
def test_digits_npz_is_scikit_learns_split():
    """examples/data/digits_seed0.npz (what seed 0 trains on) holds
    exactly the arrays scikit-learn's load_digits + train_test_split(seed 0) give."""
    sk = pytest.importorskip("sklearn")
    del sk
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    d = np.load(Path(__file__).resolve().parents[2] / "examples" / "data" / "digits_seed0.npz")
    for name, want in (("xtr", xtr), ("xte", xte), ("ytr", ytr), ("yte", yte)):
        assert d[name].shape == want.shape and (d[name].astype(np.float64) == want).all(), name


def test_the_other_parallel_layers_refuse_what_is_not_a_process_group_naming_it():
    # AttributeError: 'NoneType' object has no attribute 'size' before (a breaker's find): the
    # tensor-parallel layers, shard_mlp, PipelineStage and DeviceMesh did not check pg as DDP does
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))
    builds = [   # (who the message names, the build)
        ("ColumnParallelLinear", lambda pg: ColumnParallelLinear(4, 4, pg)),
        ("RowParallelLinear", lambda pg: RowParallelLinear(4, 4, pg)),
        ("ColumnParallelLinear", lambda pg: shard_mlp(mlp, pg, up="0", down="1")),
        ("PipelineStage", lambda pg: PipelineStage(torch.nn.Linear(4, 3), pg)),
        ("DeviceMesh", lambda pg: DeviceMesh(pg, (1,), ("dp",))),
    ]
    for who, build in builds:
        for bad, shown in ((None, "None (NoneType)"), ("pg", "'pg' (str)"), (3, "3 (int)")):
            with pytest.raises(ConfigError, match=rf"^{who}: pg must be the process group of rtxnet\.init\(\) "
                                                  rf"or a subgroup of it .*, got {re.escape(shown)}$"):
                build(bad)


def test_an_infinite_bucket_size_is_refused_naming_it():
    # bucket_cap_mb=inf passed the check and failed with OverflowError: cannot convert float
    # infinity to integer (a breaker's find)
    for name in ("bucket_cap_mb", "first_bucket_mb"):
        for bad in (float("inf"), float("nan"), 0, -1):
            with pytest.raises(ConfigError, match=rf"^{name}\({re.escape(repr(bad))}\) must be a "
                                                  r"positive, finite number of MiB$"):
                DistributedDataParallel(torch.nn.Linear(4, 3), _Pg(), init_sync=False, **{name: bad})
