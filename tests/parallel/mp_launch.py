"""The one ``rtxnet-run`` launch that both ``test_tensor_parallel.py`` and ``test_pipeline.py``
read (see ``mp_worker.py``): 4 ranks, ``--min-ranks 3`` because rank 3 dies in the last scenario,
and a long last call so that the world still forms with all 4 ranks on a loaded machine.

Under pytest-xdist the two files may run on different workers: the first one to ask launches,
under a file lock in the run's own temporary folder (shared by the workers, as the locks of
``conftest.py``), and the other reads what it left there, instead of launching 4 more ranks.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import procs

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "mp_worker.py"

_DONE: dict[str, tuple[dict, Path]] = {}


def _launch(out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "rtxnet.launcher", "--nproc", "4", "--min-ranks", "3",
         str(WORKER), str(out)],
        capture_output=True, text=True, timeout=100, env=procs.env(RTXNET_LAST_CALL="60"),
        cwd=ROOT)
    return {"rc": proc.returncode, "stdout": proc.stdout[-3000:], "stderr": proc.stderr[-5000:]}


def _shared(tmp_path_factory) -> tuple[dict, Path]:
    """The launch's outcome and folder, made once per run by whichever xdist worker comes first."""
    shared = tmp_path_factory.getbasetemp().parent / "mp-launch"
    shared.mkdir(exist_ok=True)
    fd = os.open(shared / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        done = shared / "outcome.json"
        if not done.exists():
            done.write_text(json.dumps(_launch(shared)))
        return json.loads(done.read_text()), shared
    finally:
        os.close(fd)


def results(tmp_path_factory) -> list[dict]:
    """Every rank's JSON, in launch-rank order; the launch runs once per pytest run.

    Raises:
        AssertionError: the launch failed (with the tail of its output), or a rank wrote nothing.
    """
    if "mp" not in _DONE:
        if os.environ.get("PYTEST_XDIST_WORKER") is not None:
            _DONE["mp"] = _shared(tmp_path_factory)
        else:
            out = tmp_path_factory.mktemp("mp")
            _DONE["mp"] = (_launch(out), out)
    outcome, out = _DONE["mp"]
    assert outcome["rc"] == 0, outcome["stdout"] + outcome["stderr"]
    res = [json.loads(p.read_text()) for p in sorted(out.glob("mp-rank*.json"))]
    assert [r["world_size"] for r in res] == [4, 4, 4, 4], outcome["stderr"]
    return res
