"""``Call``: the awaitable a collective returns, which still takes its place in the group's order
when it is cancelled before it ever ran.

A collective is a coroutine: nothing of it runs until it is awaited or its task first runs. One
cancelled before that (``asyncio.wait_for(pg.all_reduce(x), 0)``, ``ensure_future(...)`` then
``cancel()``, Ctrl-C before the blocking facade's loop thread reached it) took no sequence number
and told no peer: the peers' matching call was paired with this rank's *next* one of the same
shape, and every later call with the wrong one, silently (a breaker's find: sums of 200 where 300
were due, 3 of 3). asyncio delivers such a cancellation by ``throw()``-ing ``CancelledError`` into
the coroutine before its first ``send()``; a ``Call`` sees that and runs its ``unstarted`` hook
first (``Group._unstarted``: take the number and abort the peers' operation of it, as for a call
cancelled while queued), then lets the exception through.

A call created and dropped without ever being awaited (a missing ``await``) is not seen: Python
warns ("coroutine ... was never awaited") when it is collected, at a time no rank can agree on.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any


class Call(Coroutine):
    """A coroutine (``asyncio.iscoroutine`` is true; ``await`` it or make it a task) that runs
    ``coro`` and calls ``unstarted()`` when an exception is thrown into it before ``coro`` began.

    Args:
        coro: the collective's own coroutine, not yet started.
        unstarted: called at most once, on the event loop's thread, when the call ends before it
            began; it must not raise.
    """

    __slots__ = ("_coro", "_unstarted", "_began")

    def __init__(self, coro: Coroutine, unstarted: Callable[[], None]):
        self._coro = coro
        self._unstarted = unstarted
        self._began = False

    def send(self, value: Any) -> Any:
        self._began = True
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if not self._began:
            self._began = True
            self._unstarted()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        # closed before it began by its owner (a failed check of the caller's loop): nothing ran,
        # nothing is told, as for a coroutine never awaited
        self._began = True
        self._coro.close()

    def __await__(self) -> Call:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def around(self, outer: Coroutine) -> Call:
        """``outer`` (a coroutine that awaits this call after checks of its own) as a ``Call``
        whose cancellation before it began counts as this call's."""
        return Call(outer, self.forget)

    def forget(self) -> None:
        """This call will not run (its wrapper was cancelled before it reached it): close it
        and run ``unstarted``, once."""
        if not self._began:
            self._began = True
            self._coro.close()
            self._unstarted()

    def __repr__(self) -> str:
        return f"<rtxnet Call {getattr(self._coro, '__qualname__', self._coro)!r}>"


def around(inner: Any, outer: Coroutine) -> Any:
    """``outer`` wrapped as :meth:`Call.around` when ``inner`` is a :class:`Call`, else as is."""
    return inner.around(outer) if isinstance(inner, Call) else outer


def forget(inner: Any) -> None:
    """:meth:`Call.forget` of ``inner`` when it is a :class:`Call`, else close it (a coroutine)."""
    if isinstance(inner, Call):
        inner.forget()
    else:
        inner.close()
