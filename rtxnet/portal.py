"""The blocking bridge: one event loop in a background thread runs the async API.

Modelled on anyio's blocking portal. Training code that is not async calls the same coroutines
through :meth:`Portal.call`; heartbeats keep flowing while that code computes, because the loop
lives in its own thread. There is one copy of the logic, the async one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import numbers
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["Portal", "Work", "result_of", "wait_for"]

T = TypeVar("T")


def result_of(future: concurrent.futures.Future, timeout: float | None = None) -> Any:
    """``future.result(timeout)``, with rtxnet's own errors (``RtxError``: a lost peer, a deadline,
    calls that differ) raised from the caller's line, without the frames of the event loop's
    thread and of ``concurrent.futures`` (a fresh user's find: an uncaught ``PeerLostError`` was a
    25-line traceback through rtxnet's waits, the user's line at its top). Any other exception (a
    bug) keeps its whole traceback. Raises what ``future.result`` raises."""
    from transport.errors import RtxError

    try:
        return future.result(timeout)
    except RtxError as exc:
        raise exc.with_traceback(None)  # noqa: B904 (the same exception: its cause stays)


def wait_for(future: concurrent.futures.Future) -> Any:
    """:func:`result_of` ``(future)``, cancelling ``future`` (the coroutine behind it) when the
    wait is interrupted before it is done."""
    try:
        return result_of(future)
    except BaseException:
        future.cancel()          # nothing when it is done: its own error is what is raised
        raise


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


def _check_wait(timeout: Any) -> float | None:
    """A wait's ``timeout`` as ``Future.result`` takes it (infinite: None); refuses one that is
    not None, 0 or a positive number (a fresh user's find: ``wait(timeout=nan)`` said the
    operation "did not finish within timeout=nan s")."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise ValueError(f"timeout must be None, 0 or a positive number of seconds, got {timeout!r}")
    return None if timeout == math.inf else float(timeout)


class Work:
    """Handle of an operation started with ``async_op=True`` (like ``torch.distributed.Work``).

    ``wait(timeout=None)`` blocks until done and re-raises its error; ``is_completed()`` polls;
    ``result()`` returns what the operation returned.
    """

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finished; raise its error if it failed.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the operation goes on; its own
                deadline still applies), naming ``timeout``.
            ValueError: ``timeout`` is not None, 0 (do not wait) or a positive number of seconds
                (NaN, negative, not a number), naming it.
        """
        self.result(timeout)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and not self._future.cancelled() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def result(self, timeout: float | None = None) -> Any:
        """What the operation returned, once it finished (``timeout``: as :meth:`wait`).

        Raises:
            ValueError: ``timeout`` is not None, 0 (do not wait) or a positive number of seconds
                (infinite: wait as long as it takes), naming it.
        """
        wait_s = _check_wait(timeout)
        try:
            return result_of(self._future, wait_s)
        except concurrent.futures.TimeoutError:
            if self._future.done():   # the operation's own error (a TimeoutError of its own)
                raise
            raise TimeoutError(f"the operation did not finish within timeout={wait_s:g} s; it goes "
                               f"on (until its own deadline): wait again, or poll is_completed()") from None


STOP_DRAIN_S = 1.0   # how long Portal.stop waits for the tasks it cancels to end


async def _cancel_pending() -> None:
    """Cancel the loop's tasks but this one and wait up to ``STOP_DRAIN_S`` for them to end (one
    cancelled already is not cancelled again: that would interrupt its cleanup)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        if not t.cancelling():
            t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=STOP_DRAIN_S)


class Portal:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._stopped = False
        self._pid = os.getpid()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="rtxnet-loop", daemon=True)
        self.thread.start()
        ready.wait()

    @property
    def stopped(self) -> bool:
        return self._stopped or self.loop.is_closed()

    def check_open(self) -> None:
        """Raises ``ClosedError`` once :meth:`stop` was called (the process group was closed), or
        in a child forked after it started: the child has no loop thread (fork copies only the
        calling thread), so a call waited for ever (a breaker's find)."""
        if os.getpid() != self._pid:
            from transport.errors import ClosedError

            raise ClosedError(f"this process group belongs to process {self._pid}; a child forked "
                              f"from it (pid {os.getpid()}) cannot use it: call rtxnet.init() in "
                              f"the child, as another rank, or start children with the 'spawn' "
                              f"method before init")
        if self.stopped:
            from transport.errors import ClosedError

            raise ClosedError("the process group is closed (close() was called); create a new one "
                              "with rtxnet.init()")

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        self.check_open()
        if threading.current_thread() is self.thread:
            raise RuntimeError("the blocking API was called from inside rtxnet's own event loop")
        return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the loop and wait for it. When the wait itself is
        interrupted (Ctrl-C's ``KeyboardInterrupt``, any exception raised into this thread), the
        coroutine is cancelled: left running on the loop, a guard's wait for a replacement
        retried against a group closed at exit and starved the loop (a breaker's find)."""
        return wait_for(self.submit(fn, *args, **kwargs))

    def stop(self) -> None:
        """Stop the loop thread and close the loop. In a child forked from the process that made
        it only marks it stopped: the child has no loop thread, and the copy of the loop it
        holds still reads as running (closing it raised ``RuntimeError: Cannot close a running
        event loop`` from the at-exit release of a child that simply exited: a breaker's find)."""
        self._stopped = True
        if self.loop.is_closed() or os.getpid() != self._pid:
            return
        if threading.current_thread() is not self.thread and self.thread.is_alive():
            # a coroutine cancelled just before (Ctrl-C during init's rendezvous: wait_for cancels
            # it) ends its cancellation first; stopped half-way, its tasks were destroyed pending
            # and each rank printed "Task was destroyed but it is pending!" 4 times after its
            # KeyboardInterrupt traceback (a tester's find)
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel_pending(), self.loop).result(STOP_DRAIN_S + 1)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


def loop_refusal(what: str, home: asyncio.AbstractEventLoop | None) -> Exception | None:
    """Why ``what`` may not run in the running event loop when the group lives in ``home`` (the
    loop its sockets and tasks were made in; from another one a collective waited out its
    deadline naming a live peer: testers' finds), or None where it may (same loop, no running
    loop, no home known).

    Returns:
        ``ClosedError`` when ``home`` has ended (its ``asyncio.run`` returned, ending the group's
        heartbeats and reads); ``ConfigError`` when it is open but not running, or runs in
        another thread.
    """
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return None
    if home is None or running is home:
        return None
    from transport.errors import ClosedError, ConfigError

    if home.is_closed():
        return ClosedError(f"{what}: this process group was made in an event loop that has ended "
                           f"(its asyncio.run() returned, which ended the group's heartbeats): a "
                           f"group serves the loop its connect() ran in; await its aclose() here "
                           f"(it still holds its rank in the job), then connect in this loop")
    if not home.is_running():
        # (one thread, two loops: "another thread's" misled; its heartbeats wait meanwhile)
        return ConfigError(f"{what}: this process group was made in another event loop, which is "
                           f"not running now: a group serves only the loop its connect() ran in; "
                           f"run the call in that loop (loop.run_until_complete), whose turns also "
                           f"carry the group's heartbeats")
    return ConfigError(f"{what}: this process group was made in another event loop (another "
                       f"thread's): a group serves only the loop its connect() ran in; from other "
                       f"threads use the blocking group of rtxnet.init()")
