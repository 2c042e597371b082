"""rtxnet-run's rank fork server (``--preload``, rtxnet/_zygote.py) with real rank processes: a
forked rank is what a fresh ``python -u script.py`` would be (rtxnet-run's child too), ends as
one does, and a server that dies costs its running ranks nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import procs
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

# What a rank sees of itself, as JSON on one line (numpy only: the light preload)
PROBE = textwrap.dedent("""
    import sys
    preloaded = "numpy" in sys.modules
    import ctypes, json, os, random
    import numpy as np
    pdeath = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeath))   # PR_GET_PDEATHSIG
    print("PROBE " + json.dumps({
        "preloaded": preloaded, "name": __name__, "file": __file__, "argv": sys.argv,
        "path0": sys.path[0], "cwd": os.getcwd(), "main_is_me": sys.modules["__main__"].__dict__ is globals(),
        "session_leader": os.getsid(0) == os.getpid(), "group_leader": os.getpgid(0) == os.getpid(),
        "pdeathsig": pdeath.value,
        "parent_is_launcher": b"rtxnet.launcher" in open(f"/proc/{os.getppid()}/cmdline", "rb").read(),
        "env": {k: os.environ.get(k) for k in ("RANK", "RTXNET_RANK", "LOCAL_RANK", "RTXNET_RESTART_COUNT",
                                               "RTXNET_COORDINATOR", "RTXNET_ERROR_FILE", "OMP_NUM_THREADS")},
        "np": float(np.random.rand()), "random": random.random(),
        "annotations_future": bool(compile("x: int", "", "exec").co_flags & 0x1000000),
        "stdout_tty": sys.stdout.isatty(), "unbuffered": sys.stdout.write_through,
        "builtins": type(__builtins__).__name__, "spec": repr(__spec__),
        "loader": type(__loader__).__name__, "doc": __doc__, "package": repr(__package__),
    }), flush=True)
""")


def _launch(args: list[str], timeout: float = 90, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rtxnet.launcher", *args], capture_output=True, text=True,
                          timeout=timeout, env=procs.env(**extra), cwd=ROOT)


@contextlib.contextmanager
def _running(args: list[str]):
    """rtxnet-run with ``args``, its output piped; killed (by its pid) if still running at the end."""
    proc = subprocess.Popen([sys.executable, "-m", "rtxnet.launcher", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=procs.env(), cwd=ROOT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _pids_said(proc: subprocess.Popen, word: str, n: int) -> list[int]:
    """The last field, a pid, of the first ``n`` lines of ``proc``'s output holding ``word``
    (60 s at most)."""
    pids: list[int] = []
    deadline = time.monotonic() + 60
    while len(pids) < n and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if word in line:
            pids.append(int(line.split()[-1]))
    return pids


def _probes(stdout: str) -> dict[int, dict]:
    return {int(m.group(1)): json.loads(m.group(2))
            for m in re.finditer(r"^\[rank(\d+)\] PROBE (.*)$", stdout, re.M)}


def test_a_forked_rank_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    seen = {}
    relative = os.path.relpath(script, ROOT)   # (__file__ is absolute all the same)
    for preload in ("numpy", "none"):
        out = _launch(["--nproc", "3", "--preload", preload, relative, "a", "--b=1"])
        assert out.returncode == 0, out.stderr[-3000:]
        seen[preload] = _probes(out.stdout)
        assert sorted(seen[preload]) == [0, 1, 2], out.stdout[-3000:]
    forked = {r: json.loads(json.dumps(d)) for r, d in seen["numpy"].items()}   # (copies)
    fresh = {r: json.loads(json.dumps(d)) for r, d in seen["none"].items()}
    for r in range(3):
        assert forked[r].pop("preloaded") and not fresh[r].pop("preloaded")
        for d in (forked[r], fresh[r]):
            d["env"].pop("RTXNET_COORDINATOR")       # (two launches: two coordinators)
            assert d["env"].pop("RTXNET_ERROR_FILE").endswith(f"rank{r}-0.json")
            d.pop("np"), d.pop("random")
        assert forked[r] == fresh[r], (r, forked[r], fresh[r])
        assert forked[r]["argv"] == [relative, "a", "--b=1"] and forked[r]["name"] == "__main__"
        assert os.path.isabs(forked[r]["file"]) and os.path.samefile(forked[r]["file"], script)
        assert forked[r]["path0"] == str(tmp_path) and forked[r]["pdeathsig"] == signal.SIGTERM
        assert forked[r]["parent_is_launcher"]
        assert forked[r]["session_leader"] and forked[r]["env"]["RANK"] == str(r)
        # (the server's own module compiles with `from __future__ import annotations`: not the script)
        assert not forked[r]["annotations_future"]
    # each forked rank draws its own numbers (NumPy's global state is seeded again in the child)
    for preload in ("numpy", "none"):
        draws = [seen[preload][r] for r in range(3)]
        assert len({d["np"] for d in draws}) == 3 and len({d["random"] for d in draws}) == 3, draws


ENDINGS = textwrap.dedent("""
    import atexit, os, sys
    import numpy
    atexit.register(lambda: print("atexit ran", flush=True))
    class D:
        def __del__(self):
            print("D.__del__ ran", flush=True)
    d = D()
    kept = open(sys.argv[1] + os.environ["RANK"], "w")
    kept.write("written, never flushed by the script")   # (flushed by Python's shutdown)
    def deeper():
        raise ValueError("boom")
    rank = int(os.environ["RANK"])
    if rank == 0:
        sys.exit(3)
    if rank == 1:
        deeper()
    if rank == 2:
        raise KeyboardInterrupt
""")


def test_a_forked_rank_ends_as_a_fresh_interpreter_does(tmp_path):
    # exit codes, tracebacks (no frame of the fork server's), atexit handlers, a KeyboardInterrupt
    # that ends the process by SIGINT (130), each the same with and without the fork server
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    said = {}
    for preload in ("numpy", "none"):
        # (--min-ranks 1: no rank is stopped because others failed)
        out = _launch(["--nproc", "3", "--min-ranks", "1", "--preload", preload, str(script),
                       str(tmp_path / f"{preload}-")])
        for r in range(3):
            assert (tmp_path / f"{preload}-{r}").read_text() == "written, never flushed by the script", (preload, r)
        assert out.returncode in (3, 1, 130), out.stderr[-3000:]   # the first to exit's
        lines = [ln for ln in out.stdout.splitlines() + out.stderr.splitlines() if ln.startswith("[rank")]
        said[preload] = sorted(lines)
        for code, r in ((3, 0), (1, 1), (130, 2)):
            assert f"rank {r} exited with code {code}" in out.stderr, out.stderr[-3000:]
    assert said["numpy"] == said["none"], (said["numpy"], said["none"])
    text = "\n".join(said["numpy"])
    assert text.count("atexit ran") == 3 and text.count("D.__del__ ran") == 3 and "_zygote" not in text, text
    assert f'[rank1]   File "{script}", line 12, in deeper' in text, text


SLEEPER = textwrap.dedent("""
    import os, sys, time
    print("started", os.environ["RTXNET_RESTART_COUNT"], "numpy" in sys.modules, os.getpid(), flush=True)
    import numpy
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    if os.environ["RANK"] == "1" and os.environ["RTXNET_RESTART_COUNT"] == "0":
        sys.exit(1)
""")


def test_a_fork_server_killed_costs_its_ranks_nothing(tmp_path):
    # The ranks are rtxnet-run's children (the server forks each through an intermediate process
    # that exits: rtxnet-run, a subreaper, adopts it). Before, they were the server's, died with
    # it (PR_SET_PDEATHSIG) and were all restarted: a breaker lost 52 steps of a job that way.
    script, go = tmp_path / "sleeper.py", tmp_path / "go"
    script.write_text(SLEEPER)
    with _running(["--nproc", "2", "--max-restarts", "1", "--preload", "numpy", str(script), str(go)]) as launcher:
        ranks = [psutil.Process(p) for p in _pids_said(launcher, "started 0 True", 2)]
        assert len(ranks) == 2, "the ranks did not start from the fork server"
        assert [p.ppid() for p in ranks] == [launcher.pid] * 2
        server = _server_of(launcher, ranks)
        os.kill(server.pid, signal.SIGKILL)
        time.sleep(1.0)
        assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), ranks
        go.write_text("")
        out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err[-3000:]
    assert err.count(f"--preload: the rank fork server (pid {server.pid}) ended") == 1, err[-3000:]
    # 143 as a rank's exit only: a job id (8 random hex digits) may hold "143" too
    assert "rank 1 exited with code 1;" in err, err[-3000:]
    assert not re.search(r"code 143|exit 143|\(143/137\)", err), err[-3000:]
    # rank 0 ran on; rank 1's restart (after its own exit) started as a fresh interpreter
    assert out.count("started 1 False") == 1 and "started 1 True" not in out, out


def test_a_preload_module_that_is_not_installed_is_refused_before_any_rank_starts(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("print('ran')\n")
    out = _launch(["--nproc", "1", "--preload", "numpy,no_such_module_here", str(script)], timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--preload: no module named 'no_such_module_here' is installed or in the script's folder" in out.stderr, out.stderr[-2000:]
    assert "ran" not in out.stdout


def test_a_preload_module_that_fails_to_import_leaves_ranks_to_start_fresh(tmp_path):
    (tmp_path / "brittle.py").write_text("raise RuntimeError('not today')\n")
    script = tmp_path / "one.py"
    script.write_text("import sys\nprint('ran', 'brittle' in sys.modules)\n")
    # (found in the script's folder, as the rank would find it)
    out = _launch(["--nproc", "2", "--preload", "brittle", str(script)], timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("ran False") == 2, out.stdout
    assert ("could not import brittle: RuntimeError: not today; ranks start as fresh interpreters"
            in out.stderr), out.stderr[-2000:]


@pytest.mark.parametrize("source, expected", [
    ("import torch\n", "torch"),
    ("import torch\nopt = torch.optim.SGD([], lr=0.1)\n", "optim"),
    ("from torch.optim import Adam\n", "optim"),
    ("from torch import optim\n", "optim"),
    ("from rtxnet.parallel import DDP\n", "torch"),
    ("def f():\n    import torch.nn as nn\n", "torch"),
    ("import rtxnet\n", "light"),
    ("from numpy import zeros\n", "light"),
    ("import json\n", "none"),
    ("this is not python\n", "none"),
])
def test_auto_preload_follows_the_scripts_imports(tmp_path, source, expected):
    from rtxnet import _zygote

    script = tmp_path / "s.py"
    script.write_text(source)
    got = _zygote.auto_preload(str(script))
    want = {"optim": list(_zygote.OPTIM_MODULES), "torch": list(_zygote.TORCH_MODULES),
            "light": list(_zygote.LIGHT_MODULES), "none": []}[expected]
    assert got == want


def test_each_forked_rank_draws_its_own_torch_numbers(tmp_path):
    # the server's import of torch seeded its generator once: every rank and restart drew the same
    script = tmp_path / "seeds.py"
    script.write_text("import torch\nprint('SEED', torch.initial_seed(), torch.rand(1).item(), flush=True)\n")
    out = _launch(["--nproc", "3", "--preload", "torch", str(script)])
    assert out.returncode == 0, out.stderr[-3000:]
    seeds = re.findall(r"SEED (\d+) (\S+)", out.stdout)
    assert len(seeds) == 3 and len(set(seeds)) == 3, out.stdout


def test_forked_ranks_leave_no_pipe_open_in_rtxnet_run(tmp_path):
    # the read ends of a forked rank's output pipes stayed open in rtxnet-run (2 per rank process:
    # a restarting rank ran it out of descriptors; unclosed transports at its exit)
    script = tmp_path / "quick.py"
    script.write_text("import numpy\nprint('done')\n")
    out = _launch(["--nproc", "3", "--preload", "numpy", str(script)],
                  PYTHONWARNINGS="error::ResourceWarning", PYTHONTRACEMALLOC="0")
    assert out.returncode == 0, out.stderr[-3000:]
    # (the guard of the ranks' process groups is left to end by itself: "still running" is its)
    assert "unclosed" not in out.stderr, out.stderr[-3000:]


def test_a_local_module_named_as_a_preloaded_one_is_the_ranks_module(tmp_path):
    (tmp_path / "numpy.py").write_text("def hello():\n    return 'local numpy'\n")
    script = tmp_path / "main.py"
    script.write_text("import numpy\nprint(numpy.hello())\n")
    for preload in ("numpy", "none"):
        out = _launch(["--nproc", "2", "--preload", preload, str(script)], timeout=60)
        assert out.returncode == 0, (preload, out.stderr[-3000:])
        assert out.stdout.count("local numpy") == 2, (preload, out.stdout)


def _server_of(launcher: subprocess.Popen, ranks=()) -> psutil.Process | None:
    """The fork server of ``launcher`` (its child running ``rtxnet._zygote`` that is none of
    ``ranks``, whose command line is the server's too), or None."""
    for c in psutil.Process(launcher.pid).children():
        try:
            if "rtxnet._zygote" in " ".join(c.cmdline()) and c.pid not in {int(getattr(r, "pid", r)) for r in ranks}:
                return c
        except psutil.Error:   # (a child gone meanwhile)
            continue
    return None


@contextlib.contextmanager
def _stopped_while_importing(tmp_path, script: str):
    """rtxnet-run of 2 ranks of ``script`` with ``--preload slow_import`` (3 s), its fork server
    SIGSTOPped as it imports (once rtxnet-run says it starts the ranks); yields rtxnet-run and
    the server, killed at the end."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n")
    path = tmp_path / "script.py"
    path.write_text(script)
    with _running(["--nproc", "2", "--preload", "slow_import", str(path)]) as launcher:
        deadline = time.monotonic() + 60
        while "starting 2 ranks" not in launcher.stderr.readline() and time.monotonic() < deadline:
            pass
        server = _server_of(launcher)
        server.suspend()
        try:
            yield launcher, server
        finally:
            with contextlib.suppress(psutil.Error):
                server.kill()


def test_a_signal_while_the_server_imports_stops_the_job_without_starting_ranks(tmp_path):
    # Before: a rank forked after rtxnet-run forwarded the signal (its spawn waited for the
    # server's imports) ran on until --grace and was SIGKILLed; later (a breaker's find) rtxnet-run
    # waited out the imports (up to 120 s for a stopped server) and started a rank only to stop
    # it. Ranks not started when the signal comes are not started; the server is killed.
    with _stopped_while_importing(tmp_path, "import time\ntime.sleep(60)\n") as (launcher, server):
        # the signal while the server imports, stopped too as the breaker's was (sent before
        # rtxnet-run's two looks, 0.5 s apart, give the stopped server up)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=150)
        took = time.monotonic() - t0
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "[rank" not in out + err and took < 10, (took, err[-3000:])
    assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE


def test_a_fork_server_stopped_during_its_imports_is_given_up_on_at_once(tmp_path):
    # A re-verifier's find: the ranks waited READY_S (120 s) for a server SIGSTOPped while it
    # imported; stopped at two looks in a row (STOPPED_LOOK_S apart), it is given up on as when
    # it stops while a rank waits for its answer, and the ranks start as fresh interpreters
    script = "import os\nprint('running', os.environ['RANK'], flush=True)\n"
    with _stopped_while_importing(tmp_path, script) as (launcher, _):
        t0 = time.monotonic()
        out, err = launcher.communicate(timeout=150)
        took = time.monotonic() - t0
    assert launcher.returncode == 0, err[-3000:]
    assert "[rank0] running 0" in out and "[rank1] running 1" in out, out + err[-3000:]
    assert "is stopped (SIGSTOP?)" in err and took < 15, (took, err[-3000:])


# SIGKILL to rtxnet-run's (argv[1]) fork server as soon as it has forked its first intermediate
# process (polled every 0.2 ms; ends with rtxnet-run)
KILL_AT_FORK = textwrap.dedent("""
    import os, signal, sys, time
    launcher = int(sys.argv[1])
    def children(p):
        try:
            return [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            return []
    def cmdline(p):
        try:
            return open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            return b""
    server = None
    while os.path.exists(f"/proc/{launcher}"):
        if server is None:
            server = next((c for c in children(launcher) if b"rtxnet._zygote" in cmdline(c)), None)
        elif children(server):   # its first intermediate process: a rank is being forked
            os.kill(server, signal.SIGKILL)
            print("killed", server, flush=True)
            break
        time.sleep(0.0002)
""")


def test_a_fork_server_killed_as_it_forks_a_rank_leaves_no_rank_untracked(tmp_path):
    # A breaker's find: the server killed (or stopped) between forking a rank and reporting it;
    # the rank ran on unknown to rtxnet-run and a second rank 0 was started ("rank 0 ... is
    # already claimed by pid N"), failing the job. The rank now says its pid to rtxnet-run itself.
    script = tmp_path / "joiner.py"
    script.write_text("import time, numpy, rtxnet\npg = rtxnet.init()\nprint('joined', pg.rank, flush=True)\n"
                      "time.sleep(1)\npg.barrier()\npg.close()\n")
    with _running(["--nproc", "3", "--preload", "numpy", str(script)]) as launcher:
        killer = subprocess.Popen([sys.executable, "-c", KILL_AT_FORK, str(launcher.pid)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            said = killer.communicate(timeout=90)[0]
        finally:
            if killer.poll() is None:
                killer.kill()
                killer.wait()
        out, err = launcher.communicate(timeout=90)
    assert "killed" in said, said
    assert launcher.returncode == 0, err[-3000:]
    assert sorted(re.findall(r"^\[rank\d\] joined \d$", out, re.M)) == [f"[rank{r}] joined {r}" for r in range(3)], out
    assert "already claimed" not in err and "Traceback" not in err, err[-3000:]


def test_a_stopped_fork_server_does_not_hang_rtxnet_run(tmp_path):
    script = tmp_path / "napper.py"
    script.write_text("import os, time, numpy\nprint('napping', os.getpid(), flush=True)\ntime.sleep(2)\n")
    with _running(["--nproc", "2", "--preload", "numpy", str(script)]) as launcher:
        server = _server_of(launcher, _pids_said(launcher, "napping", 2))
        server.suspend()   # SIGSTOP: the ranks' exits are rtxnet-run's to take all the same
        try:
            out, err = launcher.communicate(timeout=60)
        finally:
            if server.is_running():
                server.kill()
    assert launcher.returncode == 0, err[-3000:]
    assert "exited with code" not in err, err[-3000:]   # (each rank's own exit 0, not a guess)


CRASHER = textwrap.dedent("""
    import os, sys, time
    import numpy
    print("up", os.getpid(), flush=True)
    if os.environ["RANK"] == "1" and os.environ["RTXNET_RESTART_COUNT"] == "0":
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.05)
        sys.exit(1)   # a crash: rtxnet-run restarts the rank
    print("running", os.environ["RANK"], os.environ["RTXNET_RESTART_COUNT"], flush=True)
""")


def test_a_rank_restarted_while_the_fork_server_is_stopped_starts_without_waiting_30_s(tmp_path):
    # A soak tester's find: a rank crashed while the server was SIGSTOPped; its restart waited
    # the server's 30 s answer timeout, past ft_workload's rejoin window (30 s), so the
    # survivors failed too and the job lost every committed step. A stopped server is given up
    # on at once: the replacement starts as a fresh interpreter.
    script, go = tmp_path / "crasher.py", tmp_path / "go"
    script.write_text(CRASHER)
    with _running(["--nproc", "2", "--max-restarts", "1", "--preload", "numpy", str(script), str(go)]) as launcher:
        server = _server_of(launcher, _pids_said(launcher, "up", 2))
        server.suspend()
        t0 = time.monotonic()
        go.write_text("")
        try:
            out, err = launcher.communicate(timeout=90)
        finally:
            if server.is_running():
                server.kill()
        took = time.monotonic() - t0
    assert launcher.returncode == 0, err[-3000:]
    assert "[rank1] running 1 1" in out, out + err[-3000:]
    assert "stopped" in err and took < 15, (took, err[-3000:])


LEAVER = textwrap.dedent("""
    import os, subprocess, sys, time
    import numpy
    if os.environ["RANK"] == "0":
        # one in the rank's process group, one a session of its own (a daemon: ends by itself)
        daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"],
                                  start_new_session=True)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("left", daemon.pid, flush=True)
        print("left", child.pid, flush=True)
        os._exit(0)   # without waiting for them: orphans, the second SIGTERMed with its group
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
""")


def test_what_a_forked_rank_leaves_behind_is_reaped_by_rtxnet_run(tmp_path):
    # rtxnet-run adopts the orphans below it (it is their subreaper, for the forked ranks'
    # sake): what a rank left is killed with its group, or ends by itself, and is reaped by
    # rtxnet-run, not left a zombie under it until the job ends (a breaker saw 10 zombies after
    # 6 s of restarts whose ranks each left a daemon: one leading its own session was skipped)
    script, go = tmp_path / "leaver.py", tmp_path / "go"
    script.write_text(LEAVER)
    with _running(["--nproc", "2", "--min-ranks", "1", "--preload", "numpy", "--grace", "2", str(script),
                   str(go)]) as launcher:
        orphans = _pids_said(launcher, "left", 2)
        deadline = time.monotonic() + 20
        while any(psutil.pid_exists(p) for p in orphans) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in orphans if psutil.pid_exists(p)]
        go.write_text("")
        out, err = launcher.communicate(timeout=60)
    assert "left 1 process running in its process group" in err, err[-3000:]
    assert len(orphans) == 2 and not left, f"pids {left} still exist (zombies under rtxnet-run?)\n{err[-3000:]}"
    assert launcher.returncode == 0, err[-3000:]



def test_a_rank_that_cannot_be_started_for_want_of_descriptors_is_one_line(tmp_path):
    # A breaker's find: `ulimit -n 40` and 8 ranks; rtxnet-run ended with a traceback from
    # os.pipe() (OSError: Too many open files). Now one line naming the rank and the limit; what
    # had started is stopped as at any end.
    import resource

    script = tmp_path / "quick.py"
    script.write_text("import numpy, rtxnet\npg = rtxnet.init()\npg.barrier()\npg.close()\n")
    proc = subprocess.run([sys.executable, "-m", "rtxnet.launcher", "--nproc", "8", str(script)],
                          capture_output=True, text=True, timeout=90, env=procs.env(), cwd=ROOT,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40)))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert re.search(r"^rtxnet-run: rank \d could not be started: Too many open files \(ulimit -n is 40\)$",
                     proc.stderr, re.M), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
