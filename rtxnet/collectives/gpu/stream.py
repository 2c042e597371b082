"""Streams and events: rtxnet's own CUDA stream per device, ordering against the user's stream,
and awaiting GPU completion without blocking the event loop.

rtxnet enqueues every GPU collective on a non-blocking stream of its own (``DeviceStream``, one per group),
never on the user's: ``after(user_stream)`` makes it wait for the user's pending work on the
input, ``before(user_stream)`` makes the user's stream wait for rtxnet's writes, and
``await_event`` polls ``cudaEventQuery`` at every turn of the event loop for 10 ms, then every
millisecond (:func:`poll_delay`), so a collective's coroutine yields to the loop while the GPU
works (heartbeats, other groups and deadlines keep running).
"""

from __future__ import annotations

import asyncio

__all__ = ["DeviceStream", "await_event", "poll_delay", "foreign_stream", "producer_stream"]


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
            # after()'s event, recorded again each time: a stream's wait is on the record made
            # before cudaStreamWaitEvent was called, not on later ones (CUDA Runtime API)
            self._after_ev = cupy.cuda.Event(block=False, disable_timing=True)
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
            rt.eventRecord(self._after_ev.ptr, user_stream)
            rt.streamWaitEvent(self.ptr, self._after_ev.ptr, 0)

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


class _StreamProto:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_foreign: dict[tuple[int, int], object] = {}


def foreign_stream(ptr: int, device: int):
    """A CuPy stream object for raw stream ``ptr`` of ``device``, to make current with ``with``
    (kernel launches, copies, CuPy operations): the one way every CuPy version (13:
    ``ExternalStream``; 14: ``Stream.from_external``) takes a stream it did not create."""
    import cupy

    s = _foreign.get((ptr, device))
    if s is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            # from_external records the current device as the stream's: make it ``device``
            with cupy.cuda.Device(device):
                s = cupy.cuda.Stream.from_external(_StreamProto(ptr))
        else:  # pragma: no cover - CuPy 13
            s = cupy.cuda.ExternalStream(ptr, device)
        _foreign[(ptr, device)] = s
    return s


def producer_stream(t) -> int:
    """``cudaStream_t`` (int) rtxnet orders GPU array ``t``'s collectives after: the caller's
    stream captured by the blocking API (:data:`rtxnet.collectives.gpu.arrays.CALLER_STREAM`)
    when set, else torch's current stream on the tensor's device, or CuPy's current stream on
    the array's device."""
    from rtxnet.collectives.gpu.arrays import CALLER_STREAM

    caller = CALLER_STREAM.get()
    if caller is not None:
        return caller
    if type(t).__module__.startswith("torch"):
        import torch

        return int(torch.cuda.current_stream(t.device).cuda_stream)
    import cupy

    dev = t.device.id if isinstance(t, cupy.ndarray) else -1
    return int(cupy.cuda.get_current_stream(dev).ptr)


async def await_event(event, op=None, *, timeout_s: float | None = None) -> None:
    """Return once ``event`` has completed on the GPU, polling without blocking the loop.

    Args:
        event: ``cupy.cuda.Event``.
        op: the running :class:`rtxnet.collectives.engine.Op`, or None; its failure (deadline,
            lost peer, remote abort) is raised as soon as it is set.
        timeout_s: without ``op``, give up after this many seconds (None: wait as long as it
            takes).

    Raises:
        whatever ``op.error`` holds once the op has failed.
        CollectiveError: the device reported an error for the work before the event (a sticky
            CUDA error such as an illegal address), or ``timeout_s`` passed.
    """
    from transport.errors import CollectiveError

    query = _status_of(event)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = None if timeout_s is None else start + timeout_s
    while True:
        rc = query()
        if rc == 0:
            return
        if rc != _NOT_READY:
            raise CollectiveError(f"the GPU reported cudaError {rc} for work rtxnet waited on")
        if op is not None and op.error is not None:
            raise op.error
        if deadline is not None and loop.time() > deadline:
            raise CollectiveError(f"GPU work not complete after {timeout_s:g} s")
        await asyncio.sleep(poll_delay(loop.time() - start))


def poll_delay(waited_s: float) -> float:
    """Seconds to sleep before the next poll, after ``waited_s`` of waiting: 0 (a bare yield, so
    the loop still serves its sockets and other tasks between polls) for the first
    :data:`BUSY_POLL_S`, then 1 ms.

    Why not a short sleep: event loops cannot sleep for less than a millisecond. uvloop rounds a
    delay to whole milliseconds (below 0.5 ms it is 0, a yield), and asyncio's selector waits at
    least 1 ms (``asyncio.sleep(20e-6)`` took 1.2 ms here, against 4 us under uvloop). A 256 MiB
    IPC all_reduce of 2 ranks should take about 0.25 ms on an H200 (4.25 TB/s copy rate), so
    any real sleep in that window would cost more than the work.
    """
    return 0.0 if waited_s < BUSY_POLL_S else 1e-3


BUSY_POLL_S = 10e-3   # a 1 GiB all_reduce of 4 ranks on one H200: about 2 ms of GPU work
_NOT_READY = 600   # cudaErrorNotReady (driver_types.h); eventQuery returns it without raising


def _status_of(event):
    """A function returning the event's ``cudaError_t``: ``cudaEventQuery`` for a CuPy event
    (so a device error is seen, not read as "not done yet"); any other object with ``done``
    (a unit test's stand-in) says only 0 or not ready."""
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None and isinstance(event, cupy.cuda.Event):
        query, ptr = cupy.cuda.runtime.eventQuery, event.ptr
        return lambda: query(ptr)
    return lambda: 0 if event.done else _NOT_READY
