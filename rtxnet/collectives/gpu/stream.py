"""Streams and events: rtxnet's own CUDA stream per device, ordering against the user's stream,
and awaiting GPU completion without blocking the event loop.

rtxnet enqueues every GPU collective on one non-blocking stream per device (``DeviceStream``),
never on the user's: ``after(user_stream)`` makes it wait for the user's pending work on the
input, ``before(user_stream)`` makes the user's stream wait for rtxnet's writes, and
``await_event`` polls ``cudaEventQuery`` (``Event.done``) with back-off from 20 us to 1 ms, so a
collective's coroutine yields to the loop while the GPU works (heartbeats, other groups and
deadlines keep running).
"""

from __future__ import annotations

import asyncio

__all__ = ["DeviceStream", "device_stream", "await_event"]

_streams: dict[int, DeviceStream] = {}


class DeviceStream:
    """rtxnet's stream on one CUDA device of this process.

    Attributes:
        device: device ordinal. stream: ``cupy.cuda.Stream`` (non-blocking). ptr: its handle.
    """

    def __init__(self, device: int):
        import cupy

        self.device = device
        self._cupy = cupy
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.ptr = int(self.stream.ptr)

    def use(self):
        """Context manager: this device current (kernels and copies go to ``self.stream``
        explicitly)."""
        return self._cupy.cuda.Device(self.device)

    def after(self, user_stream: int) -> None:
        """Make this stream wait for everything enqueued so far on ``user_stream``."""
        if user_stream == self.ptr:
            return
        rt = self._cupy.cuda.runtime
        with self.use():
            ev = self._cupy.cuda.Event(block=False, disable_timing=True)
            rt.eventRecord(ev.ptr, user_stream)
            rt.streamWaitEvent(self.ptr, ev.ptr, 0)

    def before(self, user_stream: int) -> object:
        """Make ``user_stream`` wait for everything enqueued so far on this stream; returns the
        event recorded here (await it with :func:`await_event` for host-side completion)."""
        rt = self._cupy.cuda.runtime
        with self.use():
            ev = self._cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
            if user_stream != self.ptr:
                rt.streamWaitEvent(user_stream, ev.ptr, 0)
        return ev

    def record(self):
        """A fresh event recorded on this stream now."""
        with self.use():
            ev = self._cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream)
        return ev


def device_stream(device: int) -> DeviceStream:
    """The process-wide rtxnet stream of ``device`` (created on first use)."""
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = DeviceStream(device)
    return s


async def await_event(event, op=None) -> None:
    """Return once ``event`` has completed on the GPU, polling without blocking the loop.

    Args:
        event: ``cupy.cuda.Event``.
        op: the running :class:`rtxnet.collectives.engine.Op`, or None; its failure (deadline,
            lost peer, remote abort) is raised as soon as it is set.

    Raises:
        whatever ``op.error`` holds once the op has failed.
    """
    delay = 20e-6
    while not event.done:
        if op is not None and op.error is not None:
            raise op.error
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1e-3)
