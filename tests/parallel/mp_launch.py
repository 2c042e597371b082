"""The one ``rtxnet-run`` launch that both ``test_tensor_parallel.py`` and ``test_pipeline.py``
read (see ``mp_worker.py``): 4 ranks, ``--min-ranks 3`` because rank 3 dies in the last scenario,
and a long last call so that the world still forms with all 4 ranks on a loaded machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import procs

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "mp_worker.py"

_DONE: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def results(tmp_path_factory) -> list[dict]:
    """Every rank's JSON, in launch-rank order; the launch runs once per pytest session.

    Raises:
        AssertionError: the launch failed (with the tail of its output), or a rank wrote nothing.
    """
    if "mp" not in _DONE:
        out = tmp_path_factory.mktemp("mp")
        proc = subprocess.run(
            [sys.executable, "-m", "rtxnet.launcher", "--nproc", "4", "--min-ranks", "3",
             str(WORKER), str(out)],
            capture_output=True, text=True, timeout=100, env=procs.env(RTXNET_LAST_CALL="60"),
            cwd=ROOT)
        _DONE["mp"] = (proc, out)
    proc, out = _DONE["mp"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = [json.loads(p.read_text()) for p in sorted(out.glob("mp-rank*.json"))]
    assert [r["world_size"] for r in res] == [4, 4, 4, 4], proc.stderr[-5000:]
    return res
