"""``Work``: the handle an ``async_op=True`` call returns, so communication overlaps computation."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

__all__ = ["Work"]


class Work:
    """Handle of an operation running on an engine's event loop.

    Wraps a ``concurrent.futures.Future`` (the blocking facade, loop in another thread) or an
    ``asyncio.Future`` (the caller is in the loop; then ``wait`` must not be called from the loop
    thread, use ``await work`` instead).
    """

    def __init__(self, future: concurrent.futures.Future | asyncio.Future):
        self._future = future

    @classmethod
    def submit(cls, coro, loop: asyncio.AbstractEventLoop) -> Work:
        """Run ``coro`` on ``loop`` (running in another thread) and return its handle."""
        return cls(asyncio.run_coroutine_threadsafe(coro, loop))

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finishes and re-raise its error, if any.

        Args:
            timeout: seconds to wait; ``None`` waits as long as the operation's own deadline.

        Returns:
            True.

        Raises:
            TimeoutError: not finished within ``timeout`` (the operation goes on).
            Whatever the operation raised.
        """
        self.result(timeout)
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The operation's return value (the output array), after ``wait``."""
        from rtxnet.portal import _check_wait, result_of

        wait_s = _check_wait(timeout)
        fut = self._future
        if isinstance(fut, asyncio.Future):
            if not fut.done():
                raise RuntimeError("Work.wait() on an asyncio future that is not done; await it")
            return fut.result()
        try:
            return result_of(fut, wait_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"operation not finished within {timeout} s") from None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def __await__(self):
        fut = self._future
        if isinstance(fut, concurrent.futures.Future):
            fut = asyncio.wrap_future(fut)
        return fut.__await__()
