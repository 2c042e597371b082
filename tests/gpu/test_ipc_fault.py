"""A rank SIGKILLed while its peers wait inside an IPC all_reduce: every survivor gets
PeerLostError within the heartbeat timeout, its GPU memory keeps working, the group re-forms and
the next all_reduce (on a new and on the same buffer) is right. Real coordinator, real launcher,
real signal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
FAST = {"RTXNET_HEARTBEAT_INTERVAL": "0.1", "RTXNET_HEARTBEAT_TIMEOUT": "1.0",
        "RTXNET_OP_TIMEOUT": "20"}


@pytest.mark.parametrize("board", ["0", "1"], ids=["messages", "boards"])
def test_rank_killed_during_ipc_all_reduce(tmp_path, board):
    """With boards, the survivors wait on the dead rank's board (no message is due from it)."""
    nproc = 4
    env = procs.env(**FAST, RTXNET_IPC_BOARD=board)
    proc = subprocess.run(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", str(nproc), "--min-ranks",
         str(nproc - 1), "tests/gpu/ipc_kill_worker.py", str(tmp_path)],
        capture_output=True, text=True, timeout=160, cwd=ROOT, env=env)
    assert proc.returncode == 137, proc.stderr[-4000:]     # the killed rank's code, as documented
    t_kill = json.loads((tmp_path / "kill.json").read_text())["t"]
    res = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("survivor-*.json"))]
    assert len(res) == nproc - 1, proc.stderr[-4000:]
    for r in res:
        assert r["warm_ok"] and r["mem_ok"] and r["after_ok"], r
        assert r["error"] and r["error"].startswith("PeerLostError"), r
        assert r["t_err"] - t_kill < float(FAST["RTXNET_HEARTBEAT_TIMEOUT"]), r
        assert r["new_world"] == nproc - 1, r
