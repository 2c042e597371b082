"""Real processes for tests and benchmarks: the coordinator daemon and probe agents.

Every process is started here and ended by its own pid; nothing is ever killed by name.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "tools" / "probe_agent.py"


def wait_until(cond, timeout_s: float, what: str):
    """Poll ``cond()`` every 20 ms until it returns something truthy, and return that.

    Raises:
        AssertionError: naming ``what``, when ``timeout_s`` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.02)


@contextmanager
def dealer(address: str, timeout_s: float = 5.0, routing_id: bytes | None = None):
    """A raw ZeroMQ DEALER socket connected to ``address`` (a test speaking the wire itself),
    receiving with a ``timeout_s`` limit, with ``routing_id`` when given (a join's identity must
    be its connection's); closed, with its context, on exit."""
    import zmq

    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    if routing_id is not None:
        d.setsockopt(zmq.ROUTING_ID, routing_id)
    d.connect(address)
    try:
        yield d
    finally:
        d.close(0)
        ctx.term()


def coordinator_jobs(address: str, timeout_s: float = 5.0) -> list[dict]:
    """The coordinator's ``status`` answer (its jobs), over a throwaway DEALER socket."""
    from transport import wire
    from transport.codec import decode, encode

    with dealer(address, timeout_s) as d:
        d.send(encode(wire.make("status", rid=1)))
        return decode(d.recv())["body"]["jobs"]


def leave_together(pg, prefix: str, rank: int, timeout_s: float = 30.0) -> None:
    """Every rank marks itself (``rank``) done in the store and waits for ranks
    ``0..world_size-1``, then closes: an early leave would open a new epoch under ranks still
    running collectives (used by the test workers)."""
    pg.store.set(f"{prefix}/done/{rank}", b"1")
    pg.store.wait([f"{prefix}/done/{q}" for q in range(pg.world_size)], timeout=timeout_s)
    pg.close()


class LateLaunch:
    """``pg`` (a blocking process group) whose collective ``name``, once ``armed`` with an
    epoch, is looked up only after the epoch moved past it (at most 30 s): a wrapper's thread
    descheduled between its step's start and a launch while the agent's thread enters a new
    epoch. The launch must fail with the step's world, not run alone in the new one."""

    def __init__(self, pg, name: str):
        self._pg = pg
        self._name = name
        self.armed: int | None = None

    def __getattr__(self, name: str):
        if name == self._name and self.armed is not None:
            armed, self.armed = self.armed, None
            wait_until(lambda: self._pg.epoch != armed, 30, f"epoch past {armed}")
        return getattr(self._pg, name)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: the repository first on ``PYTHONPATH``, whatever
    was there kept (the GPU host brings packages that way), plus ``extra``."""
    e = dict(os.environ, **extra)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return e


@contextmanager
def ranks(argv: list[str], world: int, address: str, job: str, *, min_ranks: int | None = None,
          only: list[int] | None = None, **extra: str):
    """Rank processes of ``argv`` (a script and its arguments) for a job of ``world`` ranks,
    started by hand, as on hosts of their own with no launcher: ranks ``only`` (default all),
    each with the ``RTXNET_*`` variables ``rtxnet.init`` reads, plus ``extra``. Yields the
    ``Popen`` list (text pipes); those still running at exit are killed by pid."""
    base = env(RTXNET_COORDINATOR=address, RTXNET_JOB=job, RTXNET_WORLD_SIZE=str(world),
               RTXNET_MIN_RANKS=str(min_ranks or world), RTXNET_MAX_RANKS=str(world), **extra)
    started = []
    try:
        for r in (range(world) if only is None else only):
            started.append(subprocess.Popen(
                [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                cwd=ROOT, env=dict(base, RTXNET_RANK=str(r), RANK=str(r))))
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def port_outside_ephemeral(host: str = "127.0.0.1") -> int:
    """:func:`rtxnet.launcher.port_outside_ephemeral` (a free port outside the kernel's ephemeral
    range, for a daemon that is killed and started again on the same address), which must find
    one.

    Raises:
        RuntimeError: it found none."""
    from rtxnet.launcher import _ephemeral_range
    from rtxnet.launcher import port_outside_ephemeral as draw

    port = draw(host)
    if port is None:
        raise RuntimeError(f"no free port on {host} outside the ephemeral range {_ephemeral_range()}")
    return port


# How long a restart on the same port retries its bind while something else holds the port (a
# connection of the killed daemon's last moments, a process that took the port meanwhile): a
# bounded wait, then the restart fails naming the port.
RESTART_BIND_S = 10.0


class Coordinator:
    """``python -m coordinator`` on ``host`` (default 127.0.0.1) with a port chosen at run time;
    ``prefix`` goes before the command (``["ip", "netns", "exec", NS]``: in a network namespace).

    ``restartable``: the port is chosen at run time outside the kernel's ephemeral range
    (:func:`port_outside_ephemeral`), so that :meth:`start` after :meth:`kill` (a restart on the
    same address, which the ranks reconnect to) finds it free; such a restart retries its bind
    for up to ``RESTART_BIND_S``. A coordinator started on a port the kernel chose cannot be
    restarted (``start`` raises): another process could take that port once it died."""

    def __init__(self, journal: Path, *, port: int = 0, extra: list[str] | None = None,
                 host: str = "127.0.0.1", prefix: list[str] | None = None, bind: str | None = None,
                 restartable: bool = False):
        self.bind = bind   # another address than tcp://host:port (ipc://PATH)
        self.journal = Path(journal)
        self.extra = extra or []
        self.restartable = restartable and bind is None and port == 0
        if self.restartable and prefix:
            raise ValueError("restartable: the port is checked free in this network namespace, not in prefix's")
        self.port = port_outside_ephemeral(host) if self.restartable else port
        # a restart needs the port it had; a port the kernel chose (port 0) may be gone by then
        self._kernel_port = bind is None and port == 0 and not self.restartable
        self.host = host
        self.prefix = prefix or []
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.start()

    def start(self) -> None:
        """Start the daemon; again after :meth:`kill`: on the same address, with the same journal.

        Raises:
            RuntimeError: it did not start (its exit code and log); a restart of a coordinator
                whose port the kernel chose (not ``restartable``).
        """
        again = self.proc is not None
        if again and self._kernel_port:
            raise RuntimeError(f"coordinator on port {self.port}, which the kernel chose from its ephemeral "
                               f"range: another process may have it now; make it Coordinator(..., "
                               f"restartable=True) to start it again on the same address")
        deadline = time.monotonic() + RESTART_BIND_S
        draws = 0
        while True:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "coordinator", "--bind",
                 self.bind or f"tcp://{self.host}:{self.port}",
                 "--journal", str(self.journal), *self.extra],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=ROOT,
            )
            line = self.proc.stdout.readline().decode().strip()
            if line.startswith("RTXNET_COORDINATOR="):
                break
            err = self.proc.stderr.read().decode()
            self.proc.wait(10)
            in_use = self.proc.returncode == 4 and "Address already in use" in err
            if in_use and self.restartable and not again and draws < 20:
                # taken since it was checked free: another port will do for a first start
                draws += 1
                self.port = port_outside_ephemeral(self.host)
                continue
            if in_use and self.restartable and again and time.monotonic() < deadline:
                time.sleep(0.1)   # the same port it must have: wait a bounded time for it
                continue
            raise RuntimeError(f"coordinator failed to start (rc={self.proc.returncode}): {err[-2000:]}")
        self.address = line.split("=", 1)[1]
        if self.address.startswith("tcp://"):
            self.port = int(self.address.rsplit(":", 1)[1])
        # Drain stderr so the daemon never blocks on a full pipe.
        self._stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()

    def _drain(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self._stderr.append(line.decode(errors="replace"))

    @property
    def log(self) -> str:
        return "".join(self._stderr)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            self.proc.wait(10)

    def signal(self, sig: int) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT) without waiting for an exit."""
        os.kill(self.proc.pid, sig)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Probe:
    """A rank process (``tools/probe_agent.py``) driven by JSON commands."""

    def __init__(self, coordinator: str, **cfg):
        cfg["coordinator"] = coordinator
        # its log (stderr) and its events (stdout) share one pipe, so a log line written before
        # an event is in ``log`` once the event is seen (read from two pipes by two threads, a
        # test that checked the log after an event found it empty on loaded cores)
        self.proc = subprocess.Popen(
            [sys.executable, str(PROBE), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
        )
        self.pid = self.proc.pid
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "event" in event and "level" not in event:   # (not a JSON log line)
                self.events.put(event)
            else:
                self._stderr.append(line.decode(errors="replace"))
        self.events.put({"event": "eof"})

    @property
    def log(self) -> str:
        return "".join(self._stderr)

    def expect(self, event: str, timeout: float = 20.0, **match) -> dict:
        """The next event named ``event`` whose fields include ``match`` (earlier ones are kept)."""
        for e in self.seen:
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                self.seen.remove(e)
                return e
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"probe {self.pid}: no {event} {match} within {timeout} s; seen {self.seen}; log:\n{self.log[-3000:]}")
            try:
                e = self.events.get(timeout=remaining)
            except queue.Empty:
                continue
            if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                return e
            if e.get("event") == "eof":
                raise AssertionError(f"probe {self.pid} exited (rc={self.proc.poll()}) waiting for {event}; seen {self.seen}; log:\n{self.log[-3000:]}")
            self.seen.append(e)

    def cmd(self, name: str, timeout: float = 20.0, **args) -> dict:
        self.submit(name, **args)
        return self.expect("result", timeout=timeout, cmd=name)

    def submit(self, name: str, **args) -> None:
        """Send a command without waiting for its result (``expect("result", cmd=name)``)."""
        self.proc.stdin.write((json.dumps({"cmd": name, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
