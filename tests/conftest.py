"""Shared fixtures, and the lock that lets the suite run on several pytest-xdist workers.

The README's test command runs three workers on the machine's two cores (``-n 3 --dist
loadfile``: a file's module-scoped launches happen once). Many tests wait (heartbeat timeouts,
restarts) while others are CPU-bound (torch rank processes): on 2 idle cores the whole suite,
1186 tests, took 632 s with two workers (19% of the CPU idle) and 553 s with three (6% idle),
2026-12-06; 1209 tests (and 385 skipped) took 671 and 681 s with three in two clean-clone runs
later that day (over the 10 minutes aimed at: about 1,000 CPU-seconds, most of it torch rank
processes starting). With rtxnet-run's rank fork server (``--preload auto``: torch imported once
per launch, not once per rank process) 1230 tests took 535, 547, 599 and 624 s in four
clean-clone runs (10.2 to 11.8 minutes with the install; 900-990 CPU-seconds): at the 10
minutes aimed at, not reliably under. Later, 1238-1239 tests took 457, 541 and 502 s in three
clean-clone runs on idle cores (8.8, 10.3 and 9.8 minutes with the install; 770-860
CPU-seconds), and 736 and 753 s with testers' jobs running beside them; 1248-1251 tests took
477, 505, 559 and 561 s on idle cores (9.3 to 10.8 minutes with the install; a rank released
at exit without close() now lingers up to 1 s for its queued messages), and 1261 tests 590 s
(11.3 minutes with the install) on 2026-12-07; with testers' jobs beside them (a load of about
10) 929 to 1394 s. A test marked ``exclusive`` (one that measures time: an event-loop
stall, a deadline's length) runs while the other worker runs nothing: every test holds a
shared ``flock`` on one file for its whole protocol (module fixtures included), an exclusive
test an exclusive one; a turnstile lock in front keeps a waiting exclusive test from being
overtaken forever. Without xdist nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Coordinator, Probe  # noqa: E402


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)   # releases the lock


# The longest files, longest first, alternating a file whose ranks run torch (CPU-bound: importing
# torch and torch._dynamo costs each rank process 2-3 s of CPU) with one whose ranks mostly wait
# (numpy, timeouts): workers taking whole files in this order finish together only if the
# long ones do not come last, and run two torch files at once less often. Seconds per file in a
# measured run (2026-12-06): faults 161, launcher 152, train_digits 144, fsdp 108, coordinator
# 97, tp_fault_tolerance 61, benches 60, multinode 50, ddp 40, reference 39, ... Longest first
# alone put train_digits beside fsdp: each of their tests took 40-60% longer. (2026-12-07, 1407
# tests: launcher 248, faults 230, train_digits 161, coordinator 150, fsdp 107, benches 84, ...,
# fork_server 36: files left out of the list run last, in collection order.) Whole suite, 1186
# tests, same idle machine: longest first 669 and 690 s, this order 694 s, pytest-xdist's own
# 747 s (runs of one order spread by tens of seconds; two workers then). pytest-xdist's own order
# (``--dist loadfile`` sorts files by their number of tests unless told
# ``--no-loadscope-reorder``) ignores this list: pytest_configure turns it off.
_LONGEST_FIRST = [
    "process/test_faults.py", "process/test_train_digits.py",
    "process/test_launcher.py", "parallel/test_fsdp.py",
    "process/test_coordinator.py", "parallel/test_tp_fault_tolerance.py",
    "process/test_multinode.py", "process/test_benches.py",
    "collectives/test_reference.py", "parallel/test_ddp.py",
    "collectives/test_hierarchical.py", "parallel/test_pipeline.py",
    "collectives/test_unusual.py", "process/test_fork_server.py", "gpu/test_kernels_compile.py",
    "process/test_coordinator_flood.py", "parallel/test_checkpoint.py",
    "gpu/test_kernels.py", "process/test_large_state.py", "unit/test_api.py", "parallel/test_mesh.py",
    "collectives/test_groups_p2p.py", "collectives/test_bulk.py", "collectives/test_lifecycle.py",
]


def pytest_configure(config):
    """Byte-compile the repository's own modules once, in the controlling process (not in each
    xdist worker), as a regular ``pip install`` does for an installed package: with
    ``PYTHONDONTWRITEBYTECODE=1`` (set on this project's machines) the editable install's
    sources were compiled again in every one of the suite's thousands of processes (ranks,
    coordinators, launchers), about 0.2 s of CPU each. Existing ``.pyc`` files are read
    whatever that variable says; stale ones are rebuilt (``compileall`` compares mtimes)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    if hasattr(config.option, "loadscopereorder"):   # xdist's scheduler keeps _LONGEST_FIRST's order
        config.option.loadscopereorder = False
    import compileall

    root = Path(__file__).resolve().parents[1]
    for name in ("rtxnet", "transport", "coordinator", "tools", "tests"):
        compileall.compile_dir(root / name, quiet=1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}

    def weight(item) -> int:
        parts = item.path.parts
        return rank.get("/".join(parts[-2:]), len(rank))

    items.sort(key=weight)   # stable: each file's tests keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    # the workers' base temp folders sit in the run's own one: the lock files live (and are
    # removed, with pytest's old temp folders) there
    run_dir = item.config._tmp_path_factory.getbasetemp().parent
    mode = fcntl.LOCK_EX if item.get_closest_marker("exclusive") else fcntl.LOCK_SH
    with contextlib.ExitStack() as held:
        with _flock(run_dir / "turnstile.lock", fcntl.LOCK_EX):
            held.enter_context(_flock(run_dir / "tests.lock", mode))
        yield


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
    c = Coordinator(tmp_path / "journal", restartable=True)   # (several tests restart it)
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
