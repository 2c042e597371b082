"""rtxnet's structlog set-up (``transport.logconfig``), in a fresh interpreter each."""

import ast
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(60)

_CHILD = textwrap.dedent("""
    import sys
    import structlog
    from transport.logconfig import configure_logging

    class Recorder:
        def __init__(self):
            self.writes = []
        def write(self, text):
            self.writes.append(text)
            return len(text)
        def flush(self):
            pass

    rec = Recorder()
    real, sys.stderr = sys.stderr, rec
    configure_logging(level="info", json={json})
    structlog.get_logger("t").info("fenced", rank=1, reason="peer lost")
    structlog.get_logger("t").debug("hidden")
    sys.stderr = real
    print(repr(rec.writes))
""")


@pytest.mark.parametrize("json", [False, True])
def test_each_log_line_is_one_write_with_its_newline(json):
    # a tester's Ctrl-C: "[rank1] ... fenced ... reason='...'interrupted": print() wrote the line
    # and its newline apart, and the example's "interrupted" came in between
    out = subprocess.run([sys.executable, "-c", _CHILD.replace("{json}", str(json))],
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    writes = ast.literal_eval(out.stdout)
    assert len(writes) == 1 and writes[0].endswith("\n") and writes[0].count("\n") == 1, writes
    assert "fenced" in writes[0] and "peer lost" in writes[0] and "hidden" not in writes[0]


def test_a_bad_level_is_named():
    from transport.logconfig import configure_logging

    with pytest.raises(ValueError, match="log level 'loud' is not one of debug, info, warning, error"):
        configure_logging(level="loud")
