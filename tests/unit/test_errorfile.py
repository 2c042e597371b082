"""rtxnet.errorfile: what a rank under rtxnet-run writes when an exception ends it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import procs
import pytest

from rtxnet import errorfile

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("ending, written", [
    ("raise ValueError('bad\\nsecond')", "ValueError"),
    ("import rtxnet.checkpoint as c; c.load('/nonexistent-rtxnet', 1)", None),   # whatever it raises
    ("raise SystemExit(3)", False),          # an exit code the script chose: not recorded
    ("raise KeyboardInterrupt", False),      # a stop
])
def test_an_uncaught_exception_is_written_and_the_traceback_still_printed(tmp_path, ending, written):
    path = tmp_path / "err.json"
    proc = subprocess.run([sys.executable, "-c", f"import rtxnet\n{ending}\n"], capture_output=True, text=True,
                          timeout=60, env=procs.env(RTXNET_ERROR_FILE=str(path)), cwd=procs.ROOT)
    assert proc.returncode != 0
    if written is False:
        assert not path.exists()
        return
    rec = errorfile.read(str(path))
    assert rec is not None and rec["type"] in proc.stderr and "Traceback" in proc.stderr, proc.stderr
    if written:
        assert rec["type"] == written and rec["message"] == "bad\nsecond"
        assert errorfile.summary(rec) == "ValueError: bad [...]"
    assert not [p for p in tmp_path.iterdir() if p.name != "err.json"]   # no temporary file left


def test_read_refuses_what_is_not_a_record_or_is_another_processes(tmp_path):
    path = tmp_path / "err.json"
    assert errorfile.read(str(path)) is None and errorfile.read(None) is None
    for junk in ("not json", "[1]", json.dumps({"time": "now", "type": "E", "message": ""})):
        path.write_text(junk)
        assert errorfile.read(str(path)) is None, junk
    try:
        raise RuntimeError("x\x1b[31m" + "y" * 500)
    except RuntimeError as exc:
        errorfile.write(str(path), exc)
    rec = errorfile.read(str(path), os.getpid())
    assert rec["pid"] == os.getpid() and errorfile.read(str(path), os.getpid() + 1) is None
    text = errorfile.summary(rec)
    assert text.startswith("RuntimeError: x\\x1b[31myyy") and text.endswith(" [...]") and "\x1b" not in text
