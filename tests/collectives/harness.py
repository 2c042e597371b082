"""Test bootstrap without a coordinator: N real processes, each with its own ``Engine``.

The parent starts the ranks (forkserver with rtxnet preloaded, so a world of 5 starts in well under
a second), collects every rank's data endpoint over a pipe, sends each the full ``WorldView``,
and waits for the result of ``fn(engine, *args)`` (an importable top-level coroutine function)
from every rank. The pipe is a test-only side channel; nothing on it touches the data plane.

Ranks that hang past the deadline are killed by pid. A rank's exception comes back as the
exception object (``RankError`` wraps it with the remote traceback).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import traceback
import uuid
from collections.abc import Callable

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["numpy", "zmq", "msgpack", "rtxnet.collectives",
                                        "tests.collectives.harness"])
        except ValueError:
            ctx = mp.get_context("spawn")
        _CTX = ctx
    return _CTX


class RankError(Exception):
    """A rank raised; ``exc`` is its exception, ``rank`` the rank, ``tb`` the remote traceback."""

    def __init__(self, rank: int, exc: BaseException, tb: str):
        super().__init__(f"rank {rank} raised {type(exc).__name__}: {exc}\n{tb}")
        self.rank, self.exc, self.tb = rank, exc, tb


def _child(rank: int, conn, fn: Callable, args: tuple, shm: bool, default_timeout_s: float,
           hang_dump_s: float):
    import faulthandler

    faulthandler.dump_traceback_later(hang_dump_s, exit=False)  # stacks of a hung rank, to stderr
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run

    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    reported = False

    def report(msg: tuple) -> None:
        nonlocal reported
        reported = True
        try:
            conn.send(msg)
        except Exception:   # an exception that does not pickle
            conn.send((msg[0], RuntimeError(repr(msg[1])), *msg[2:]))

    async def main():
        from rtxnet.collectives import Engine

        loop = asyncio.get_running_loop()
        engine = await Engine.create(shm=shm, default_timeout_s=default_timeout_s)
        try:
            conn.send(engine.endpoint)
            view = await loop.run_in_executor(None, conn.recv)
            engine.set_view(view)
            try:
                report(("ok", await fn(engine, *args)))
            except Exception as exc:  # report everything to the parent
                report(("err", exc, traceback.format_exc()))
            # Keep the engine, and the messages it has yet to send, until every rank reported:
            # closing it drops what is still queued (linger 0), such as this rank's part of the
            # last operation, which its peers would wait for until their deadline.
            await loop.run_in_executor(None, lambda: conn.poll(120) and conn.recv())
        finally:
            await engine.aclose()

    try:
        runner(main())
    except BaseException as exc:
        if not reported:
            report(("err", exc, traceback.format_exc()))
    finally:
        conn.close()


def run_world(n: int, fn: Callable, *args, shm: bool = True, hosts: dict[int, str] | None = None,
              timeout_s: float = 60.0, default_timeout_s: float = 10.0,
              return_exceptions: bool = False, job: str | None = None) -> list:
    """Run ``fn(engine, *args)`` on ``n`` fresh ranks and return their results by rank.

    Args:
        hosts: rank -> hostname for the view (default: all on this host). Different names make
            those ranks talk over TCP only.
        timeout_s: deadline for the whole world; ranks still alive then are killed.
        return_exceptions: return ``RankError`` objects instead of raising the first one.
    """
    from rtxnet.collectives import WorldView

    ctx = _context()
    job = job or f"t{uuid.uuid4().hex[:10]}"
    procs, conns = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(rank, child, fn, args, shm, default_timeout_s,
                                                   max(1.0, timeout_s - 5)),
                        daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    results: list = [None] * n
    try:
        endpoints = {}
        for rank, c in enumerate(conns):
            if not c.poll(timeout_s):
                raise TimeoutError(f"rank {rank} did not report its endpoint")
            endpoints[rank] = c.recv()
        host = os.uname().nodename
        hmap = hosts or {r: host for r in range(n)}
        for rank, c in enumerate(conns):
            c.send(WorldView(job=job, epoch=0, rank=rank, world_size=n, endpoints=endpoints,
                             hosts=dict(hmap)))
        import time

        deadline = time.monotonic() + timeout_s
        for rank, c in enumerate(conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {rank} did not finish within {timeout_s} s")
            try:
                msg = c.recv()
            except EOFError:
                procs[rank].join(5)
                results[rank] = RankError(rank, RuntimeError(
                    f"rank {rank} exited with code {procs[rank].exitcode} without a result"), "")
                continue
            if msg[0] == "ok":
                results[rank] = msg[1]
            else:
                results[rank] = RankError(rank, msg[1], msg[2])
        for c in conns:   # every rank reported: they may close now
            try:
                c.send("close")
            except OSError:
                pass
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()
    if not return_exceptions:
        for r in results:
            if isinstance(r, RankError):
                raise r
    return results
