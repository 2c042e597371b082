from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Coordinator, Probe  # noqa: E402


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
