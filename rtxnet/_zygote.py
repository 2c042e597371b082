"""rtxnet-run's fork server: rank processes forked from one that imported the heavy modules once.

A rank that starts as a fresh interpreter spends seconds importing what every rank imports
(``import torch`` about 2.2 s of CPU on an idle core of this project's machines, and
``torch._dynamo``, which ``torch.optim`` imports at an optimizer's first ``add_param_group``,
about 1.9 s more; measured 2026-12-06). With N ranks that is N times the CPU at the start, and
a replacement after a failure pays it again before it can rejoin. As
:mod:`multiprocessing.forkserver` (``set_forkserver_preload``) and Android's zygote do, this
process imports the modules named by ``rtxnet-run --preload`` once, then forks a rank process
on each request: the child starts with them in ``sys.modules``.

The child then becomes what ``python -u script.py args...`` would be: its own session
(``setsid``), ``PR_SET_PDEATHSIG`` SIGTERM (its parent, this server, dies with rtxnet-run),
standard output and error on the pipes rtxnet-run sent, the rank's working folder and
environment, ``sys.argv``, ``sys.path[0]`` the script's folder, a fresh ``__main__`` module
whose ``__file__`` is the script, NumPy's global random state seeded afresh (the ``random``
module does so itself after a fork). The script runs at the top of this module's stack: an
uncaught exception is printed by ``sys.excepthook`` without this module's frames, and the
process exits 1 (a ``KeyboardInterrupt``: by SIGINT, after ``atexit`` handlers, as Python
does); ``SystemExit`` and ``atexit`` are Python's own. What differs from a fresh interpreter:
the preloaded modules were imported with rtxnet-run's environment for all ranks (the variables
of one rank, ``RTXNET_RANK`` and the like, are set after the import), and every rank shares one
string hash seed (``PYTHONHASHSEED``).

Protocol, on a ``SOCK_SEQPACKET`` Unix socket pair (one JSON object per packet, never a
pickle): rtxnet-run sends ``{"op": "spawn", "id", "argv", "env", "cwd"}`` with the write ends
of the rank's stdout and stderr pipes attached (``SCM_RIGHTS``), and ``{"op": "reap", "pid"}``;
this server answers ``{"op": "ready"}`` or ``{"op": "failed", "why"}`` once, then
``{"op": "spawned", "id", "pid"}`` or ``{"op": "spawn_failed", "id", "why"}``, and
``{"op": "exit", "pid", "rc"}`` (``rc`` as ``Popen.returncode``: negative for a signal) when a
child ends. A child is reaped only once rtxnet-run says ``reap`` (``waitid(WNOWAIT)`` before):
until rtxnet-run has taken its exit, its process id cannot be reused by another process that
rtxnet-run's signals could reach. Exits are seen through a ``pidfd`` per child (Linux 5.3).
The socket's end (rtxnet-run gone or done) ends this server.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

_MAX_PACKET = 1 << 20   # one spawn request: argv and environment (ARG_MAX is 2 MiB on Linux)


class _Child(Exception):
    """Raised in the forked child to leave the server's loop with its request."""

    def __init__(self, msg: dict, fds: list[int]):
        super().__init__()
        self.msg, self.fds = msg, fds


def _send(sock: socket.socket, **msg) -> None:
    sock.send(json.dumps(msg).encode())


def _serve(sock: socket.socket, preload: list[str]) -> None:
    """The server's loop; returns when rtxnet-run closes its end; raises ``_Child`` in a child."""
    try:
        for name in preload:
            __import__(name)
    except BaseException as e:   # (an import may raise anything, SystemExit included)
        _send(sock, op="failed", why=f"{name}: {type(e).__name__}: {e}")
        return
    _send(sock, op="ready")
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    pidfds: dict[int, int] = {}   # pidfd -> pid
    while True:
        for fd, _ in poller.poll():
            if fd != sock.fileno():
                pid = pidfds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
                rc = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                _send(sock, op="exit", pid=pid, rc=rc)
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MAX_PACKET, 2)
            if not data:
                return
            msg = json.loads(data)
            if msg["op"] == "reap":
                try:
                    os.waitpid(msg["pid"], 0)
                except ChildProcessError:   # (not a child of this server's: nothing to reap)
                    pass
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:
                for f in fds:
                    os.close(f)
                _send(sock, op="spawn_failed", id=msg["id"], why=f"fork: {e}")
                continue
            if pid == 0:
                for f in pidfds:
                    os.close(f)
                raise _Child(msg, fds)
            for f in fds:
                os.close(f)
            pidfd = os.pidfd_open(pid)
            pidfds[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            _send(sock, op="spawned", id=msg["id"], pid=pid)


def _become(msg: dict, fds: list[int], server: int) -> tuple:
    """In the child: become the rank's process; returns ``(code, main module)`` to run."""
    import ctypes

    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != server:   # the server died before the line above: so would the rank
        os._exit(128 + signal.SIGTERM)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for f in fds:
        os.close(f)
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    argv = msg["argv"]
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if "numpy" in sys.modules:   # its global RandomState was seeded once, in the server
        sys.modules["numpy"].random.seed()
    # what `import rtxnet` does by the environment (this module's package was imported by the
    # server, with rtxnet-run's environment): the error file's hook (rtxnet.errorfile)
    from rtxnet import errorfile

    errorfile.install()
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    main.__builtins__ = builtins   # (the module, as in a script's __main__; elsewhere its dict)
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        source = f.read()
    return compile(source, script, "exec", dont_inherit=True), main


_BY_SIGINT = False


def _exit_by_sigint() -> None:
    """Registered before any script's ``atexit`` handler, so it runs after them all: a script
    ended by an uncaught ``KeyboardInterrupt`` ends by SIGINT, as CPython's own main does."""
    if _BY_SIGINT:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def main(fd: int, preload: str) -> None:
    """``python -c 'from rtxnet._zygote import main; main(FD, "torch,numpy")'``: serve on the
    inherited socket ``FD`` after importing the comma-separated modules ``preload``."""
    global _BY_SIGINT
    import atexit

    sock = socket.socket(fileno=fd)
    server = os.getpid()
    try:
        _serve(sock, [m for m in preload.split(",") if m])
        return
    except _Child as child:
        sock.close()
        code, module = _become(child.msg, child.fds, server)
    atexit.register(_exit_by_sigint)
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:   # printed as Python prints it, without this file's frames
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        _BY_SIGINT = isinstance(e, KeyboardInterrupt)
        sys.exit(1)


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
        self._done = asyncio.get_running_loop().create_future()

    def _exited(self, rc: int) -> None:
        if self.returncode is None:
            self.returncode = rc
            self._done.set_result(rc)

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


class ForkServer:
    """rtxnet-run's handle on the server (see the module's text). :meth:`start` it, then
    :meth:`spawn` ranks; ``None`` from ``spawn`` means "start this one as a fresh interpreter"
    (the server failed its imports, or died: :attr:`trouble` says why, once)."""

    def __init__(self):
        self.proc = None
        self.sock: socket.socket | None = None
        self.modules: list[str] = []
        self.trouble = ""          # why it serves no more ("": it serves)
        self._ready = None         # Future[bool]
        self._next = 0
        self._pending: dict[int, tuple] = {}    # spawn id -> (future, stdout fd, stderr fd)
        self._children: dict[int, PooledProcess] = {}

    @classmethod
    async def start(cls, modules: list[str], env: dict[str, str], script: str, die_with_parent) -> ForkServer:
        """Start the server process (its own session; SIGTERM when rtxnet-run dies) importing
        ``modules`` with environment ``env``, resolving them from ``script``'s folder first as
        the rank would. Returns at once; the imports go on while ranks are asked for."""
        import asyncio

        self = cls()
        self.modules = list(modules)
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        folder = os.path.dirname(os.path.realpath(script))
        code = (f"import sys; from rtxnet._zygote import main; sys.path[0] = {folder!r}; "
                f"main({theirs.fileno()}, {','.join(modules)!r})")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-u", "-c", code, pass_fds=[theirs.fileno()], env=env,
                preexec_fn=die_with_parent, start_new_session=True)
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
                self._ready.set_result(True)
            elif op == "failed":
                self._lost(f"could not import {msg['why']}")
            elif op == "spawned":
                fut, _, _ = self._pending.pop(msg["id"])
                child = self._children[msg["pid"]] = PooledProcess(msg["pid"])
                fut.set_result(child)
            elif op == "spawn_failed":
                fut, _, _ = self._pending.pop(msg["id"])
                fut.set_exception(OSError(msg["why"]))
            elif op == "exit":
                child = self._children.pop(msg["pid"], None)
                if child is not None:
                    child._exited(msg["rc"])
                with _suppress_oserror():
                    _send(self.sock, op="reap", pid=msg["pid"])

    def _lost(self, why: str) -> None:
        """The server is gone or useless: pending spawns start as fresh interpreters; its
        children (SIGTERMed by their parent's death) are taken as ended by SIGTERM once gone."""
        import asyncio

        if self.trouble:
            return
        code = self.proc.returncode if self.proc is not None else None
        self.trouble = f"the rank fork server (pid {self.proc.pid}) {why}" + (
            f" (exit code {code})" if code is not None else "")
        loop = asyncio.get_running_loop()
        with _suppress_oserror():
            loop.remove_reader(self.sock.fileno())
        if not self._ready.done():
            self._ready.set_result(False)
        for fut, _, _ in self._pending.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()
        for child in self._children.values():
            asyncio.ensure_future(_await_gone(child))
        self._children.clear()

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> PooledProcess | None:
        """Fork a rank running ``python -u argv[0] argv[1:]`` with environment ``env`` in folder
        ``cwd``; its output comes on the returned process's ``stdout``/``stderr``.

        Returns:
            the process, or None where the server does not serve (see :attr:`trouble`).

        Raises:
            OSError: the fork itself failed (as ``create_subprocess_exec`` would raise).
        """
        import asyncio

        if self.trouble or not await self._ready:
            return None
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._next += 1
        fut = loop.create_future()
        self._pending[self._next] = (fut, out_r, err_r)
        try:
            socket.send_fds(self.sock, [json.dumps(
                {"op": "spawn", "id": self._next, "argv": argv, "env": env, "cwd": cwd}).encode()],
                [out_w, err_w])
        except OSError as e:
            self._pending.pop(self._next, None)
            fut.set_result(None)
            self._lost(f"took no request: {e}")
        finally:
            os.close(out_w)
            os.close(err_w)
        try:
            child = await fut
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        if child is None:
            os.close(out_r)
            os.close(err_r)
            return None
        child.stdout = await _reader(out_r)
        child.stderr = await _reader(err_r)
        return child

    async def close(self) -> None:
        """End the server (its socket closed: it leaves its loop) and wait for it, 5 s at most."""
        import asyncio

        if self.sock is not None:
            with _suppress_oserror():
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        if self.proc is not None and self.proc.returncode is None:
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _reader(fd: int):
    import asyncio

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
                                 os.fdopen(fd, "rb", buffering=0))
    return reader


async def _await_gone(child: PooledProcess) -> None:
    """A child of a server that died: its exit status went with the server (it was reparented and
    reaped elsewhere); taken as SIGTERM's, which its parent's death sent it."""
    import asyncio

    import psutil

    while True:
        try:
            if psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:   # gone (or its number another user's process now)
            break
        await asyncio.sleep(0.1)
    child._exited(-signal.SIGTERM)


def _suppress_oserror():
    import contextlib

    return contextlib.suppress(OSError)
