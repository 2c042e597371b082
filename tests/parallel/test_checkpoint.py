"""rtxnet.checkpoint: atomic commit across real ranks, corruption, half-written steps, resharding."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import procs
import pytest
import torch

from rtxnet import checkpoint
from rtxnet.checkpoint import CheckpointCorruptError, CheckpointError

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "ckpt_worker.py"
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The checkpoint folder and per-rank results of one 2-rank run of ``ckpt_worker.py``."""
    base = tmp_path_factory.mktemp("ckpt")
    root, out = base / "root", base / "out"
    root.mkdir()
    out.mkdir()
    env = procs.env()
    proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "2", str(WORKER), str(root), str(out)],
                          capture_output=True, text=True, timeout=80, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return root, [json.loads(p.read_text()) for p in sorted(out.glob("ckpt-rank*.json"))]


def test_round_trip_restores_model_optimizer_sampler_and_rng(two_ranks):
    _, res = two_ranks
    assert len(res) == 2
    for r in res:
        assert r["roundtrip_model"] and r["roundtrip_sampler"] and r["rng_restored"], r
        assert r["roundtrip_opt_step"] == [3, 3, 3, 3]


def test_one_rank_failing_fails_the_save_on_every_rank(two_ranks):
    root, res = two_ranks
    for r in res:
        assert r["fail_all"]["ranks"] == [1], r
        assert "rank 1" in r["fail_all"]["msg"] and "state['oops'] is a builtins.function" in r["fail_all"]["msg"]
        assert r["latest_after_failure"] == 1
    assert not (root / "step-2" / "manifest.json").exists()
    with pytest.raises(CheckpointError, match="never committed"):
        checkpoint.load(root, 2)


def test_a_state_no_load_could_read_is_refused_at_save_time_naming_the_key(two_ranks):
    # torch.load(weights_only=True) refuses NumPy arrays: before, the save succeeded and every
    # load (and --resume) of that step failed with torch's bare UnpicklingError
    root, res = two_ranks
    for r in res:
        err = r["numpy_refused"]
        assert err["ranks"] == [0, 1], r
        assert "state['extra']['mask'] is a numpy.ndarray" in err["msg"] and "torch.from_numpy" in err["msg"]
    assert not (root / "step-5" / "manifest.json").exists()


def test_ranks_saving_different_steps_are_refused_before_anything_is_written(two_ranks):
    root, res = two_ranks
    for r in res:
        assert r["steps_mismatch"]["values"] == {"0": 10, "1": 11}, r
        assert "different steps" in r["steps_mismatch"]["msg"]
        assert not any(name in ("step-10", "step-11") for name in r["steps_after_mismatch"]), r


@pytest.mark.parametrize("value, kind", [(np.float64(1.5), "numpy.float64"), (np.str_("a"), "numpy.str_"),
                                         (collections.defaultdict(int), "collections.defaultdict"),
                                         ([1.0, np.float64(2.0)], "numpy.float64")])
def test_numpy_scalars_that_subclass_python_types_are_refused_too(tmp_path, value, kind):
    # np.float64 and np.str_ subclass float and str: they passed the check and made a
    # committed checkpoint that no load could read
    with pytest.raises(CheckpointError, match=kind):
        checkpoint.save(tmp_path, 2, {"w": torch.ones(2), "x": value})
    assert checkpoint.latest(tmp_path) is None


def test_an_intact_shard_no_safe_load_can_read_is_named(tmp_path):
    # a shard written by another tool: its digest matches, but weights_only refuses its content
    import numpy as np

    checkpoint.save(tmp_path, 4, {"w": torch.ones(2)})
    shard = tmp_path / "step-4" / "rank-0.pt"
    import io
    buf = io.BytesIO()
    torch.save({"w": np.ones(2)}, buf)
    shard.write_bytes(buf.getvalue())
    manifest = json.loads((tmp_path / "step-4" / "manifest.json").read_text())
    import hashlib
    manifest["files"]["rank-0.pt"] = {"sha256": hashlib.sha256(buf.getvalue()).hexdigest(),
                                      "nbytes": len(buf.getvalue())}
    (tmp_path / "step-4" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="rank-0.pt is intact but cannot be loaded safely") as ei:
        checkpoint.load(tmp_path, 4)
    assert ei.value.path == shard


def test_saving_over_a_half_written_step_succeeds(two_ranks):
    root, res = two_ranks
    for r in res:
        assert r["latest_half_written"] == 1              # no manifest: never a candidate
        assert r["latest_after_resave"] == 3
        assert r["stray_temps"] == []
    checkpoint.verify(root, 3)
    checkpoint.verify(root, 1)                            # re-saved over a complete step


def test_loading_at_another_world_size_reshards_ddp_state(two_ranks):
    root, _ = two_ranks
    states = [checkpoint.load(root, 3, rank=k) for k in range(4)]   # saved by 2 ranks, read by 4
    assert [s["_checkpoint"]["shard_rank"] for s in states] == [0, 1, 0, 0]
    assert [s["_checkpoint"]["resharded"] for s in states] == [False, False, True, True]
    for s in states:
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        net.load_state_dict(s["model"])
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        opt.load_state_dict(s["optimizer"])
        for k, v in states[0]["model"].items():
            assert torch.equal(net.state_dict()[k], v)    # replicated: every shard agrees
        assert s["sampler"] == states[0]["sampler"] and s["step"] == 3


def test_load_all_reads_every_saved_rank_in_order_and_refuses_a_corrupt_one(two_ranks, tmp_path):
    root, _ = two_ranks
    states = checkpoint.load_all(root, 3)
    assert [s["_checkpoint"]["shard_rank"] for s in states] == [0, 1]
    assert [s["_checkpoint"]["world_size"] for s in states] == [2, 2]
    for k, s in enumerate(states):
        one = checkpoint.load(root, 3, rank=k)
        assert one["sampler"] == s["sampler"] and one["step"] == s["step"] == 3
    assert [s["_checkpoint"]["step"] for s in checkpoint.load_all(root)] == [3, 3]   # latest
    shutil.copytree(root / "step-3", tmp_path / "step-3")
    shard = tmp_path / "step-3" / "rank-1.pt"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(CheckpointCorruptError, match="rank-1.pt") as info:
        checkpoint.load_all(tmp_path, 3)
    assert info.value.path == shard
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        checkpoint.load_all(tmp_path / "nothing")


def test_resaving_a_step_with_fewer_ranks_removes_the_shards_it_does_not_list(two_ranks, tmp_path):
    root, _ = two_ranks
    shutil.copytree(root / "step-3", tmp_path / "step-3")      # saved by 2 ranks
    checkpoint.save(tmp_path, 3, {"step": 3, "w": torch.ones(4)})  # again, by 1
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == ["manifest.json", "rank-0.pt"]
    assert list(checkpoint.verify(tmp_path, 3)["files"]) == ["rank-0.pt"]
    assert torch.equal(checkpoint.load(tmp_path, 3, rank=1)["w"], torch.ones(4))   # rank 0's stands in


def _single(tmp_path, steps=(1, 2)):
    for s in steps:
        checkpoint.save(tmp_path, s, {"w": torch.full((64,), float(s)), "step": s})


def test_corrupt_shard_is_refused_naming_the_file(tmp_path):
    _single(tmp_path)
    shard = tmp_path / "step-2" / "rank-0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="sha256") as info:
        checkpoint.load(tmp_path, 2)
    assert str(shard) in str(info.value) and info.value.path == shard
    assert checkpoint.latest(tmp_path) == 1               # falls back to the newest intact step
    assert torch.equal(checkpoint.load(tmp_path)["w"], torch.full((64,), 1.0))


def test_truncated_shard_and_garbled_manifest_are_refused(tmp_path):
    _single(tmp_path)
    shard = tmp_path / "step-1" / "rank-0.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="bytes, manifest says"):
        checkpoint.load(tmp_path, 1)
    manifest = tmp_path / "step-2" / "manifest.json"
    manifest.write_text(manifest.read_text()[:20])
    with pytest.raises(CheckpointCorruptError, match="not a valid manifest") as info:
        checkpoint.load(tmp_path, 2)
    assert info.value.path == manifest
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        checkpoint.load(tmp_path)


def test_keep_prunes_old_steps_and_bad_arguments_are_named(tmp_path):
    for s in range(4):
        checkpoint.save(tmp_path, s, {"step": s}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    with pytest.raises(ValueError, match=r"step\(-1\)"):
        checkpoint.save(tmp_path, -1, {})
    with pytest.raises(ValueError, match=r"keep\(0\)"):
        checkpoint.save(tmp_path, 5, {}, keep=0)


def test_rng_capture_and_restore(tmp_path):
    import random

    import numpy as np

    st = checkpoint.capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.save(tmp_path, 0, {"rng": st})
    checkpoint.restore_rng(checkpoint.load(tmp_path, 0)["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
    shutil.rmtree(tmp_path / "step-0")
