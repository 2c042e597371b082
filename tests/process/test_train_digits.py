"""The main job: examples/train_digits.py under rtxnet-run, with and without a killed rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def train(out: Path, *launcher_args: str) -> dict:
    env = procs.env()
    proc = subprocess.run(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", "4", *launcher_args, "examples/train_digits.py",
         "--out", str(out)],
        capture_output=True, text=True, timeout=230, cwd=ROOT, env=env,
    )
    metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else None
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "metrics": metrics}


def final_params(out: Path) -> dict:
    from rtxnet import checkpoint

    state = checkpoint.load(out / "checkpoints", 300, rank=0)
    return state["model"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault_free")
    run = train(out)
    assert run["rc"] == 0, run["stderr"][-4000:]
    return out, run


def test_fault_free_run_reaches_95_percent(fault_free):
    out, run = fault_free
    assert run["metrics"]["test_accuracy"] >= 0.95
    assert f"test_accuracy={run['metrics']['test_accuracy']:.4f}" in run["stdout"]
    assert (out / "loss_curve.png").stat().st_size > 1000


def test_killed_rank_replaced_gives_the_fault_free_parameters(fault_free, tmp_path):
    ref_out, _ = fault_free
    run = train(tmp_path, "--max-restarts", "1", "--faults", "kill:rank=2:step=30")
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert "recovery: fault 'kill:rank=2:step=30': injected on rank 2 at step 30" in run["stdout"]
    assert "steps lost: 1" in run["stdout"] and run["metrics"]["world_size_end"] == 4
    want, got = final_params(ref_out), final_params(tmp_path)
    assert want.keys() == got.keys()
    for k in want:
        rel = float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12))
        assert rel <= 1e-5, (k, rel)


def test_continuing_with_three_ranks_keeps_accuracy(fault_free, tmp_path):
    _, ref = fault_free
    run = train(tmp_path, "--min-ranks", "3", "--faults", "kill:rank=2:step=30")
    # The launcher reports the killed rank's code; the job itself finished on three ranks.
    assert run["rc"] == 137, run["stderr"][-4000:]
    assert run["metrics"]["world_size_end"] == 3
    assert abs(run["metrics"]["test_accuracy"] - ref["metrics"]["test_accuracy"]) <= 0.005


def test_every_rank_killed_restarts_from_the_journaled_checkpoint(tmp_path):
    plan = "; ".join(f"kill:rank={r}:step=150" for r in range(4))
    run = train(tmp_path, "--max-restarts", "1", "--faults", plan)
    assert run["rc"] == 0, run["stderr"][-4000:]
    # No live rank held step 149; the coordinator's store named checkpoint 100, which every
    # restarted rank loaded before training went on.
    assert run["stderr"].count("restored_from_checkpoint") == 4
    assert "job_committed_step=149" in run["stderr"] and "step=100" in run["stderr"]
    assert run["metrics"]["test_accuracy"] >= 0.95
