from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Coordinator, Probe  # noqa: E402


@pytest.fixture(autouse=True)
def _structlog_back_to_defaults():
    """A test that runs a rank's entry point in this process (``rtxnet.init``, a script's
    ``main``) configures structlog to print to that test's captured stderr, closed after it; the
    next tests' log calls would raise on the closed file."""
    yield
    import structlog

    if structlog.is_configured():
        structlog.reset_defaults()


@pytest.fixture
def coordinator(tmp_path):
    c = Coordinator(tmp_path / "journal")
    yield c
    c.stop()


@pytest.fixture
def probes():
    """Start probes with ``probes(addr, **cfg)``; all are ended at teardown, by pid."""
    started: list[Probe] = []

    def start(address: str, **cfg) -> Probe:
        p = Probe(address, **cfg)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()
