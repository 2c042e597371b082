"""rtxnet-run's fork server: rank processes forked from one that imported the heavy modules once.

A rank that starts as a fresh interpreter spends seconds importing what every rank imports
(``import torch`` about 2.2 s of CPU on an idle core of this project's machines, and
``torch._dynamo``, which ``torch.optim`` imports at an optimizer's first ``add_param_group``,
about 1.9 s more; measured 2026-12-06). With N ranks that is N times the CPU at the start, and
a replacement after a failure pays it again before it can rejoin. As
:mod:`multiprocessing.forkserver` (``set_forkserver_preload``) and Android's zygote do, this
process imports the modules named by ``rtxnet-run --preload`` once, then forks a rank process
on each request: the child starts with them in ``sys.modules``.

The rank is forked through an intermediate process that exits as soon as the rank is a session of
its own (a double fork, as a daemon is started), so that its parent is rtxnet-run (made
``PR_SET_CHILD_SUBREAPER`` by :func:`become_subreaper`), not this server: rtxnet-run takes its
exit itself (a ``pidfd``, ``waitid(P_PIDFD)``), and the server's death costs the running ranks
nothing (before, they died with it, their parent).

The rank then becomes what ``python -u script.py args...`` would be: its own session
(``setsid``), ``PR_SET_PDEATHSIG`` SIGTERM (its parent, rtxnet-run, dies), standard output and
error on the pipes rtxnet-run sent, the rank's working folder and environment (plus what the
preloaded imports set in it), ``sys.argv``, ``sys.path[0]`` the script's folder (unless
``PYTHONSAFEPATH``), a fresh ``__main__`` module whose ``__file__`` is the script's absolute
path, NumPy's and torch's global random states seeded afresh (the ``random`` module does so
itself after a fork), rtxnet imported afresh by the script (its error-file hook by the rank's
environment). The script runs at the top of this module's stack: an uncaught exception is printed
by ``sys.excepthook`` without this module's frames and the process exits 1 (130 for a
``KeyboardInterrupt``, the code rtxnet-run reports for Python's own end by SIGINT, after the same
shutdown); ``SystemExit`` and ``atexit`` are Python's own. What differs from a fresh interpreter:
the preloaded modules were imported once, with rtxnet-run's environment for all ranks (the
variables of one rank, ``RTXNET_RANK`` and the like, are set after; ``OMP_NUM_THREADS`` set by
the script before ``import torch`` comes too late), their import-time output and warnings appear
once, unprefixed; every rank shares one string hash seed (``PYTHONHASHSEED``); ``ps`` and
``sys.orig_argv`` show the server's command line, and a stack printed from the script's top level
shows two frames of the server's under it.

Protocol, on a ``SOCK_SEQPACKET`` Unix socket pair (one JSON object per packet, never a
pickle): rtxnet-run sends ``{"op": "spawn", "argv", "env", "cwd"}`` with three descriptors
attached (``SCM_RIGHTS``): the write ends of the rank's stdout and stderr pipes and of a "hello"
pipe; this server answers ``{"op": "ready"}`` or ``{"op": "failed", "why"}`` once. The answer to
a spawn comes on its hello pipe, from the rank itself: ``P<pid>`` once it is a session of its own
and rtxnet-run's child, so that rtxnet-run knows every rank it has whatever becomes of the server
meanwhile (a server killed or stopped between a fork and its report left a rank running that
rtxnet-run did not know, and it started a second one: a breaker's find); ``E <why>`` from a fork
that failed; the pipe's end without either, a server or rank that died first. The socket's end
(rtxnet-run gone or done) ends this server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable

_MAX_PACKET = 1 << 20   # one spawn request: argv and environment (ARG_MAX is 2 MiB on Linux)


class _Child(Exception):
    """Raised in the forked child to leave the server's loop with its request."""

    def __init__(self, msg: dict, fds: list[int]):
        super().__init__()
        self.msg, self.fds = msg, fds


def _send(sock: socket.socket, **msg) -> None:
    sock.send(json.dumps(msg).encode())


def _serve(sock: socket.socket, preload: list[str]) -> None:
    """The server's loop; returns when rtxnet-run closes its end; raises ``_Child`` in a rank."""
    try:
        for name in preload:
            __import__(name)
    except BaseException as e:   # (an import may raise anything, SystemExit included)
        _send(sock, op="failed", why=f"{name}: {type(e).__name__}: {e}")
        return
    _send(sock, op="ready")
    while True:
        data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 3)
        if not data:
            return
        msg = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            mid = os.fork()
        except OSError as e:
            _answer(fds[2], f"E fork: {e}")
            for f in fds:
                os.close(f)
            continue
        if mid == 0:
            _intermediate(msg, fds)   # raises _Child in the rank, exits otherwise
        for f in fds:
            os.close(f)
        os.waitpid(mid, 0)   # (it exits once the rank has called setsid)


def _answer(fd: int, text: str) -> bool:
    """Write one answer line to rtxnet-run's "hello" pipe ``fd``; False when nobody reads it."""
    try:
        os.write(fd, f"{text}\n".encode())
        return True
    except OSError:
        return False


def _intermediate(msg: dict, fds: list[int]) -> None:
    """The server's child between it and the rank (a double fork, as a daemon is started): it
    forks the rank and exits once the rank is a session of its own, so that the rank's parent
    becomes rtxnet-run (the nearest ``PR_SET_CHILD_SUBREAPER`` above it) and not this server,
    whose death then costs the rank nothing. Raises ``_Child`` in the rank."""
    setsid_r, setsid_w = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        _answer(fds[2], f"E fork: {e}")
        os._exit(1)
    if pid == 0:
        os.close(setsid_r)
        raise _Child(msg, fds + [setsid_w])
    os.close(setsid_w)
    os.read(setsid_r, 1)   # (EOF: the rank has called setsid(), or died)
    os._exit(0)


def _become(msg: dict, fds: list[int], launcher: int, start_env: dict[str, str]) -> None:
    """In the rank: become the rank's process (all but running its script)."""
    import ctypes
    import time

    os.setsid()
    middle = os.getppid()
    os.close(fds[3])   # (the intermediate process exits now)
    deadline = time.monotonic() + 10
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0002)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # rtxnet-run died (its ranks die with it) or is no subreaper; or it gave up on this spawn
    # (nobody reads the pipe): either way no rank of its
    if os.getppid() != launcher or not _answer(fds[2], f"P{os.getpid()}"):
        os._exit(128 + signal.SIGTERM)
    os.close(fds[2])   # (told: rtxnet-run has the rank's pid, from the rank itself)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for f in fds[:2]:
        os.close(f)
    os.chdir(msg["cwd"])
    # the rank's environment; what an import in the server added (torch._dynamo sets
    # TORCHINDUCTOR_CACHE_DIR) stays, as it would after the rank's own import
    for k in start_env:
        if k not in msg["env"]:
            os.environ.pop(k, None)
    os.environ.update(msg["env"])
    sys.argv = list(msg["argv"])
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    # random states the server's imports drew once (the random module draws again by itself)
    try:
        sys.modules["numpy"].random.seed()
    except (KeyError, AttributeError):   # not imported, or not NumPy (a script's own numpy.py)
        pass
    try:
        sys.modules["torch"].seed()
    except (KeyError, AttributeError):
        pass
    # rtxnet imported afresh by the script, as in a fresh interpreter: `import rtxnet` installs
    # its error-file hook (rtxnet.errorfile) by this rank's environment, and only then
    for name in [n for n in sys.modules if n == "rtxnet" or n.startswith("rtxnet.")]:
        del sys.modules[name]


def _main_module(script: str):
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    main.__builtins__ = builtins   # (the module, as in a script's __main__; elsewhere its dict)
    sys.modules["__main__"] = main
    return main


def main(fd: int, preload: str) -> None:
    """``python -c 'from rtxnet._zygote import main; main(FD, "torch,numpy")'``: serve on the
    inherited socket ``FD`` after importing the comma-separated modules ``preload``."""
    import resource

    # only the socket and standard streams: what the server's parent let through (copies of its
    # own standard streams) would otherwise live on in every rank and what it starts
    top = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(3, fd)
    os.closerange(fd + 1, top if 0 < top < 1 << 20 else 4096)
    sock = socket.socket(fileno=fd)
    launcher = os.getppid()
    start_env = dict(os.environ)
    try:
        _serve(sock, [m for m in preload.split(",") if m])
        sock.close()
        return
    except (BrokenPipeError, ConnectionResetError):   # rtxnet-run ended (while this imported)
        return
    except _Child as child:
        msg, fds = child.msg, child.fds
    sock.close()
    _become(msg, fds, launcher, start_env)
    # (__file__ of a script's __main__ is absolute: the working folder joined, not normalised)
    script = sys.argv[0] if os.path.isabs(sys.argv[0]) else os.path.join(os.getcwd(), sys.argv[0])
    module = _main_module(script)
    try:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:   # printed as Python prints it, without this file's frames
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        # Python ends a script that an uncaught KeyboardInterrupt stopped by SIGINT after its
        # shutdown; the code rtxnet-run reports is 130 either way, which this exit gives after
        # the same shutdown (atexit, logging, files flushed)
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)


# ---- rtxnet-run's side -------------------------------------------------------------------------

# imported by "auto" for a script that imports rtxnet or numpy: what each such rank imports
# (rtxnet's dependencies; rtxnet itself imports its parts lazily, in milliseconds)
LIGHT_MODULES = ("numpy", "zmq", "msgpack", "structlog", "uvloop")
# and when it imports torch: torch, and torch._dynamo where it names torch.optim (whose
# optimizers import torch._dynamo at their first param group: 1.9 s more)
TORCH_MODULES = LIGHT_MODULES + ("torch",)
OPTIM_MODULES = TORCH_MODULES + ("torch._dynamo",)
# a script importing one of these imports torch (rtxnet.parallel and rtxnet.checkpoint do)
_TORCH_USERS = ("torch", "rtxnet.parallel", "rtxnet.checkpoint")
_LIGHT_USERS = ("rtxnet", "numpy")


def auto_preload(script: str) -> list[str]:
    """What ``--preload auto`` imports for ``script``, judged by the ``import`` statements
    anywhere in it: :data:`TORCH_MODULES` when one names torch, ``rtxnet.parallel`` or
    ``rtxnet.checkpoint`` (:data:`OPTIM_MODULES` when the script also names ``optim``: an
    import of ``torch.optim`` or an attribute ``.optim``), else :data:`LIGHT_MODULES` when one
    names rtxnet or numpy, else nothing (those installed, each). A script that cannot be read
    or parsed gets nothing (Python reports it at the rank's start). A module the script imports
    through its own modules is not seen: its rank imports it, as without the server."""
    import ast
    import importlib.util

    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return []
    names = set()
    optim = False
    for node in ast.walk(tree):
        optim = optim or (isinstance(node, ast.Attribute) and node.attr == "optim")
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)

    def named(users) -> bool:
        return any(n == u or n.startswith(u + ".") for n in names for u in users)

    optim = optim or named(("torch.optim",))
    chosen = ((OPTIM_MODULES if optim else TORCH_MODULES) if named(_TORCH_USERS)
               else LIGHT_MODULES if named(_LIGHT_USERS) else ())
    return [m for m in chosen if importlib.util.find_spec(m.split(".")[0]) is not None]


class PooledProcess:
    """A rank process forked by the server, as rtxnet-run uses ``asyncio.subprocess.Process``:
    ``pid``, ``returncode`` (None while it runs; negative for a signal), ``stdout`` and
    ``stderr`` (``asyncio.StreamReader``), ``wait()``, ``send_signal``/``terminate``/``kill``
    (to the process alone, by its pid, only while its exit is not taken)."""

    def __init__(self, pid: int):
        import asyncio

        self.pid = pid
        self.returncode: int | None = None
        self.stdout = self.stderr = None
        self._pipes: list[_Pipe] = []
        self._done = asyncio.get_running_loop().create_future()
        self._pidfd: int | None = None

    def watch(self) -> None:
        """Take its exit when it ends (a ``pidfd``, Linux 5.3; ``waitid(P_PIDFD)``, 5.4): rtxnet-run
        is its parent (see :func:`become_subreaper`) and alone reaps it, so its pid cannot be
        another process's while rtxnet-run may still signal it."""
        import asyncio

        self._pidfd = os.pidfd_open(self.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._ended)

    def _ended(self) -> None:
        try:
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:   # (not this process's child: nothing tells its exit code)
            info = None
            rc = -signal.SIGKILL
        else:
            if info is None:   # (readable before the exit is visible to waitid: not seen here)
                return
            rc = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        self._exited(rc)

    def _exited(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self._done.set_result(rc)
        self._unwatch()

    def _unwatch(self) -> None:
        import asyncio

        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def close_pipes(self) -> None:
        """Close the read ends of its output pipes (rtxnet-run, once it has read what it wanted)."""
        for t in self._pipes:
            t.close()
        self._pipes = []

    async def wait(self) -> int:
        import asyncio

        return await asyncio.shield(self._done)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


READY_S = 120.0   # the server's imports, at most (torch takes seconds; on loaded cores, tens)
ANSWER_S = 30.0   # its answer to a spawn request, at most
STOPPED_LOOK_S = 0.5   # while it is awaited, how often rtxnet-run looks whether the server is stopped


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``T``, or ``t`` under a tracer) per ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


PR_SET_CHILD_SUBREAPER = 36   # <linux/prctl.h>, Linux 3.4


def become_subreaper() -> None:
    """Make this process (rtxnet-run) the parent of every orphan below it
    (``PR_SET_CHILD_SUBREAPER``): a rank the fork server forks through an intermediate process
    becomes rtxnet-run's child, which waits for it itself (see :func:`reap_orphans`).

    Raises:
        OSError: the kernel refused (not Linux, or older than 3.4)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


# what this process (rtxnet-run) started itself and waits for itself, by pid: never reaped by
# reap_orphans while its owner has not taken its exit (``returncode`` None)
_OWNED: dict[int, object] = {}
_SPAWNING = [0]   # spawns under way: a child whose pid is not known here yet may exist


def own(proc):
    """Record ``proc`` (anything with ``pid`` and ``returncode``) as waited for by its owner;
    returns it."""
    _OWNED[proc.pid] = proc
    return proc


@contextlib.contextmanager
def spawning():
    """A block that starts a child this process will wait for: :func:`reap_orphans` does
    nothing meanwhile (the child may be a zombie before its pid is known and :func:`own`-ed)."""
    _SPAWNING[0] += 1
    try:
        yield
    finally:
        _SPAWNING[0] -= 1


def reap_orphans() -> int:
    """Reap the zombies among this process's children that nothing here waits for: orphans
    adopted as a subreaper (what a rank started and left behind when it ended, a daemon it
    started included). What rtxnet-run starts itself (coordinator, guard, fork server, ranks) is
    :func:`own`-ed and waited for by its owner. While a spawn is under way (:func:`spawning`)
    a zombie that leads its own session is left: it may be a rank whose pid is not known here
    yet (a forked rank leads its session before it becomes this process's child; a fresh one
    before its exec). One that leads none is reaped even then (a spawn waiting up to 30 s on a
    stopped fork server held every orphan's zombie that long: a re-verifier's find). Returns
    how many were reaped."""
    me = os.getpid()
    try:
        tasks = os.listdir(f"/proc/{me}/task")
    except OSError:
        return 0
    reaped = 0
    for tid in tasks:
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:   # (a thread gone meanwhile; a kernel without CONFIG_PROC_CHILDREN)
            continue
        for pid in children:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            # fields: state, ppid, pgrp, session (man 5 proc)
            if fields[0] != b"Z" or int(fields[1]) != me:
                continue
            if _SPAWNING[0] and int(fields[3]) == pid:   # fields[3]: its session
                continue
            owner = _OWNED.get(pid)
            if owner is not None and getattr(owner, "returncode", None) is None:
                continue   # (its owner takes its exit)
            _OWNED.pop(pid, None)
            try:
                os.waitpid(pid, os.WNOHANG)
                reaped += 1
            except ChildProcessError:
                pass
    for pid in [p for p, o in _OWNED.items() if getattr(o, "returncode", None) is not None]:
        del _OWNED[pid]   # (taken: the number may be another process's later)
    return reaped


async def _line_from(fd: int, timeout: float, give_up: Callable[[], str | None] | None = None) -> str:
    """One line (without its newline) read from pipe ``fd``, or what came before its end.
    ``give_up``, asked every ``STOPPED_LOOK_S`` while waiting, ends the wait early with the
    reason it returns (None: wait on); what was read so far is kept across its looks.

    Raises:
        TimeoutError: neither within ``timeout`` seconds, or ``give_up``'s reason."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()
    got = bytearray()

    def readable() -> None:
        try:
            chunk = os.read(fd, 256)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        got.extend(chunk)
        if (not chunk or b"\n" in got) and not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(timeout):
            while give_up is not None and not done.done():
                await asyncio.wait([done], timeout=STOPPED_LOOK_S)
                if not done.done() and (reason := give_up()) is not None:
                    raise TimeoutError(reason)
            await done
    finally:
        loop.remove_reader(fd)
    return got.split(b"\n", 1)[0].decode(errors="replace")


def _line_now(fd: int) -> str:
    """What pipe ``fd`` (non-blocking) holds now, up to its first newline."""
    try:
        return os.read(fd, 256).split(b"\n", 1)[0].decode(errors="replace")
    except OSError:
        return ""


class ForkServer:
    """rtxnet-run's handle on the server (see the module's text). :meth:`start` it, then
    :meth:`spawn` ranks; ``None`` from ``spawn`` means "start this one as a fresh interpreter"
    (the server failed its imports, or died: :attr:`trouble` says why, once)."""

    def __init__(self):
        self.proc = None
        self.sock: socket.socket | None = None
        self.modules: list[str] = []
        self.trouble = ""          # why it serves no more ("": it serves)
        self.say = None
        self._ready = None         # Future[bool]

    @classmethod
    async def start(cls, modules: list[str], env: dict[str, str], script: str, die_with_parent,
                    say=None) -> ForkServer:
        """Start the server process (its own session; SIGTERM when rtxnet-run dies) importing
        ``modules`` with environment ``env``, resolving them from ``script``'s folder first as
        the rank would. Returns at once; the imports go on while ranks are asked for."""
        import asyncio

        self = cls()
        self.say = say   # called once with the line that says the server is given up on
        self.modules = list(modules)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        folder = os.path.dirname(os.path.realpath(script))
        # the script's folder replaces -c's working folder on sys.path before anything is
        # imported (a json.py in the working folder broke the server's imports)
        code = (f"import sys; sys.flags.safe_path or sys.path.__setitem__(0, {folder!r}); "
                f"from rtxnet._zygote import main; main({theirs.fileno()}, {','.join(modules)!r})")
        try:
            with spawning():
                self.proc = own(await asyncio.create_subprocess_exec(
                    sys.executable, "-u", "-c", code, pass_fds=[theirs.fileno()], env=env,
                    preexec_fn=die_with_parent, start_new_session=True))
        finally:
            theirs.close()
        self.sock = mine
        mine.setblocking(False)
        loop.add_reader(mine.fileno(), self._on_message)
        return self

    def _on_message(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 4096, 0)
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(f"failed: its socket said {e}")
                return
            if not data:
                self._lost("ended")
                return
            msg = json.loads(data)
            op = msg["op"]
            if op == "ready":
                if not self._ready.done():   # (cancel(): rtxnet-run stopped meanwhile)
                    self._ready.set_result(True)
            elif op == "failed":
                self._lost(f"could not import {msg['why']}")

    def _lost(self, why: str) -> None:
        """The server is gone or useless: pending spawns start as fresh interpreters. The ranks
        it forked are rtxnet-run's children and go on."""
        import asyncio

        if self.trouble:
            return
        code = self.proc.returncode if self.proc is not None else None
        self.trouble = f"the rank fork server (pid {self.proc.pid}) {why}" + (
            f" (exit code {code})" if code is not None else "")
        if self.say is not None:
            self.say(f"--preload: {self.trouble}; ranks start as fresh interpreters from now on")
        loop = asyncio.get_running_loop()
        with _suppress_oserror():
            loop.remove_reader(self.sock.fileno())
        if not self._ready.done():
            self._ready.set_result(False)

    def cancel(self) -> None:
        """Start no rank any more (rtxnet-run is stopping): a spawn waiting for the server's
        imports returns None at once, and so does every later one."""
        self.trouble = self.trouble or "not used: rtxnet-run is stopping"
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(False)

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> PooledProcess | None:
        """Fork a rank running ``python -u argv[0] argv[1:]`` with environment ``env`` in folder
        ``cwd``; its output comes on the returned process's ``stdout``/``stderr``.

        Returns:
            the process, or None where the server does not serve (see :attr:`trouble`).

        Raises:
            OSError: the fork itself failed (as ``create_subprocess_exec`` would raise).
        """
        import asyncio

        if self.trouble:
            return None
        # a server stopped (SIGSTOP) is given up on, as in _answer: one stopped during its
        # imports kept the ranks from starting for READY_S (a re-verifier's find)
        look = self._stop_look()
        try:
            async with asyncio.timeout(READY_S):
                while not self._ready.done():
                    await asyncio.wait([self._ready], timeout=STOPPED_LOOK_S)
                    if not self._ready.done() and (stopped_s := look()) is not None:
                        self._lost(f"is stopped (SIGSTOP?): it had not imported {', '.join(self.modules)} "
                                   f"and was stopped for {stopped_s:g} s")
                        self._kill()
                        return None
                ready = self._ready.result()
        except TimeoutError:
            self._lost(f"had not imported {', '.join(self.modules)} within {READY_S:g} s (stopped, "
                       f"or an import hangs)")
            self._kill()
            return None
        if not ready:
            return None
        with spawning():   # (the rank is this process's child before its pid is known here)
            child = await self._fork(argv, env, cwd)
        return own(child) if child is not None else None

    async def _fork(self, argv: list[str], env: dict[str, str], cwd: str) -> PooledProcess | None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            hello_r, hello_w = os.pipe()
        except OSError:
            for f in (out_r, out_w, err_r, err_w):
                os.close(f)
            raise
        try:
            socket.send_fds(self.sock, [json.dumps(
                {"op": "spawn", "argv": argv, "env": env, "cwd": cwd}).encode()], [out_w, err_w, hello_w])
        except OSError as e:
            self._lost(f"took no request: {e}")
            for f in (out_r, err_r, hello_r):
                os.close(f)
            return None
        finally:
            for f in (out_w, err_w, hello_w):
                os.close(f)
        # The rank itself says its pid (once it is a session of its own and this process's
        # child), whatever becomes of the server meanwhile; "E ..." is a fork that failed; the
        # end of the pipe without either, a server or rank that died first
        try:
            said = await self._answer(hello_r)
        except TimeoutError as e:
            said = _line_now(hello_r)   # (a last look: the rank may have said it just now)
            if not said.startswith("P"):
                self._lost(str(e))
                self._kill()
        finally:
            os.close(hello_r)   # (a rank that says its pid after this ends by itself)
        if not said.startswith("P"):
            os.close(out_r)
            os.close(err_r)
            if said.startswith("E"):
                raise OSError(said[2:])
            return None
        child = PooledProcess(int(said[1:]))
        child.watch()
        child._pipes = [_Pipe(out_r), _Pipe(err_r)]
        child.stdout, child.stderr = (t.reader for t in child._pipes)
        return child

    async def _answer(self, hello_r: int) -> str:
        """The first line on ``hello_r`` (see :meth:`_fork`), looking every ``STOPPED_LOOK_S``
        whether the server is stopped (SIGSTOP): one stopped at two looks in a row is given up
        on then, not after ``ANSWER_S`` (a restart waiting that long outlived the others' rejoin
        window, and the job lost its steps: a soak test's find).

        Raises:
            TimeoutError: no line, the server stopped or ``ANSWER_S`` passed (the text says which)."""
        look = self._stop_look()

        def stopped() -> str | None:
            stopped_s = look()
            return None if stopped_s is None else (
                f"is stopped (SIGSTOP?): it did not answer a request to start a rank within {stopped_s:g} s")

        try:
            return await _line_from(hello_r, ANSWER_S, stopped)
        except TimeoutError as exc:
            raise TimeoutError(str(exc) or f"did not answer a request to start a rank within "
                                           f"{ANSWER_S:g} s (stopped, or hung)") from None

    def _stop_look(self) -> Callable[[], float | None]:
        """A look at the server, to take every ``STOPPED_LOOK_S`` while it is awaited: the seconds
        it has been seen stopped (SIGSTOP) once that is two looks in a row (give up on it then),
        else None."""
        looks = 0

        def look() -> float | None:
            nonlocal looks
            looks = looks + 1 if self.proc is not None and _is_stopped(self.proc.pid) else 0
            return STOPPED_LOOK_S * looks if looks >= 2 else None

        return look

    def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with _suppress_oserror():
                self.proc.kill()

    async def close(self) -> None:
        """End the server (its socket closed: it leaves its loop) and wait for it, 5 s at most;
        one still importing is killed at once (it reads its socket only after its imports, and
        holds nothing: its ranks are rtxnet-run's)."""
        import asyncio

        if self.sock is not None:
            with _suppress_oserror():
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        if self._ready is not None and not (self._ready.done() and self._ready.result()):
            self._kill()
        if self.proc is not None and self.proc.returncode is None:
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class _Pipe:
    """The read end ``fd`` of a rank's output pipe fed into a ``StreamReader`` from the event loop's
    reader callback: this object alone closes ``fd``, once (at its end, or at :meth:`close`).
    (An ``asyncio`` pipe transport over an ``os.fdopen`` file left who closes the descriptor to
    the loop's implementation; a descriptor closed twice can be one that another thread, ZeroMQ's
    I/O thread, has just been given: rtxnet-run aborted once in ZeroMQ's ``epoll.cpp``.)"""

    def __init__(self, fd: int):
        import asyncio

        self.fd = fd
        self.loop = asyncio.get_running_loop()
        self.reader = asyncio.StreamReader(limit=1 << 16, loop=self.loop)
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.reader.feed_data(data)
        else:
            self.close()

    def close(self) -> None:
        if self.fd < 0:
            return
        with _suppress_oserror():
            self.loop.remove_reader(self.fd)
        os.close(self.fd)
        self.fd = -1
        self.reader.feed_eof()


def _suppress_oserror():
    import contextlib

    return contextlib.suppress(OSError)
