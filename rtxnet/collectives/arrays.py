"""Adapting user arrays (NumPy, or anything speaking DLPack such as torch CPU tensors).

``as_numpy`` returns a NumPy view of the same memory (no copy). Collectives work on a contiguous
1-d view of it (``Buffer.flat``); a non-contiguous input is copied into a scratch array first and
the result is written back into the original view by ``Buffer.commit``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from rtxnet.collectives.reduce_ops import SUPPORTED_DTYPES, bfloat16, dtype_name

__all__ = ["as_numpy", "Buffer", "payload_view", "off_loop", "copy_pairs", "OFF_LOOP_NBYTES"]

OFF_LOOP_NBYTES = 4 << 20


def as_numpy(t) -> np.ndarray:
    """A NumPy view of ``t`` sharing its memory.

    A subclass of ``numpy.ndarray`` (``np.matrix``, ``np.memmap``) is viewed as a plain
    ``ndarray`` of the same shape: its methods (``np.matrix`` keeps two dimensions whatever it is
    reshaped to) would break the flat view after the data moved (a fresh user's find: a matrix on
    one rank raised NumPy's broadcast error there while the others had its data).

    Raises:
        ValueError: ``t`` is neither a NumPy array nor a CPU DLPack tensor, is a masked array
            (its mask would be ignored), or its dtype is not supported.
    """
    if isinstance(t, np.ma.MaskedArray):
        raise ValueError(f"a masked array ({type(t).__name__}) is not supported: its mask would be "
                         f"ignored; pass .filled(value) or .data")
    if isinstance(t, np.ndarray):
        a = t if type(t) is np.ndarray else t.view(np.ndarray)
    elif type(t).__module__.startswith("torch"):
        a = _torch_to_numpy(t)
    elif hasattr(t, "__dlpack__"):
        from rtxnet.collectives.gpu import is_gpu_array

        if is_gpu_array(t):   # (it said only "cannot view ... as a CPU array": a tester's find)
            raise ValueError(f"a {type(t).__name__} in CUDA memory among the CPU arrays of this "
                             f"call: pass every array of a call on one device")
        try:
            a = np.from_dlpack(t)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise ValueError(f"cannot view {type(t).__name__} as a CPU array: {exc}") from exc
    else:
        raise ValueError(f"expected a NumPy array or a DLPack tensor, got {type(t).__name__}")
    dtype_name(a.dtype)
    return a


def _torch_to_numpy(t) -> np.ndarray:
    import torch

    if t.device.type != "cpu":
        raise ValueError(f"tensor on {t.device}; the CPU collectives take CPU tensors only")
    if t.layout != torch.strided:
        raise ValueError(f"tensor of layout {t.layout}; collectives take dense (torch.strided) "
                         f"tensors: use .to_dense()")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return np.from_dlpack(t.view(torch.int16)).view(bfloat16())
    if t.is_conj() or t.is_neg():
        raise ValueError("conjugated/negated torch views are not supported")
    try:
        return np.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError) as exc:
        # float8, complex32, quantized...: NumPy has no such dtype
        raise ValueError(f"dtype {t.dtype} is not supported by rtxnet collectives "
                         f"(NumPy cannot view it: {exc}); cast it to one of: "
                         f"{', '.join(SUPPORTED_DTYPES)}") from exc


class Buffer:
    """A user array and the contiguous flat view collectives read and write.

    Attributes:
        array: the NumPy view of the user's memory.
        flat: contiguous 1-d array; the user's memory itself when it is contiguous.
    """

    __slots__ = ("array", "flat", "_scratch")

    def __init__(self, t, *, readonly: bool = False):
        a = as_numpy(t)
        self.array = a
        # (refused before the copy below: torch.ones(1).expand(2**40) allocated 4 TiB for its
        # contiguous copy, MemoryError, instead of this ValueError: a breaker's find)
        if not readonly and not a.flags.writeable:
            raise ValueError("output array is read-only")
        if not readonly and _self_overlapping(a):
            raise ValueError(
                f"output array of shape {a.shape} and strides {a.strides} has elements that share "
                f"memory (a stride of 0: torch's expand, np.broadcast_to): a result written in "
                f"place would be undefined, as torch.distributed refuses it; pass one with memory "
                f"of its own (.clone(), np.array(a))")
        if a.flags.c_contiguous:
            self.flat = a.reshape(-1)
            self._scratch = False
        else:
            self.flat = _contiguous_copy(a)
            self._scratch = True

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def size(self) -> int:
        return self.array.size

    def commit(self) -> None:
        """Write ``flat`` back into the user's (non-contiguous) memory."""
        if self._scratch:
            np.copyto(self.array, self.flat.reshape(self.array.shape))


# copies from this size on are checked against the memory available first (smaller ones are
# not: reading /proc/meminfo on every non-contiguous collective cost more than their copy)
_CHECK_MEMORY_FROM_NBYTES = 1 << 30


def _available_memory() -> int:
    import psutil

    return psutil.virtual_memory().available


def _contiguous_copy(a: np.ndarray) -> np.ndarray:
    """A flat contiguous copy of the non-contiguous ``a`` (``a.nbytes`` bytes of host memory).

    Raises:
        ValueError: the copy, of 1 GiB or more, needs more memory than the host has available
            now (psutil's ``virtual_memory().available``), or its allocation failed: an input expanded with a
            stride of 0 (``torch.ones(1).expand(2**40)``: 4 TiB) is the usual cause; the message
            names its shape, strides and size.
    """
    why = ""
    available = _available_memory() if a.nbytes >= _CHECK_MEMORY_FROM_NBYTES else None
    if available is not None and a.nbytes > available:
        why = f"more than the {available} bytes of memory available"
    else:
        try:
            return np.ascontiguousarray(a).reshape(-1)
        except MemoryError:
            why = "its allocation failed (MemoryError)"
    raise ValueError(
        f"array of shape {a.shape}, dtype {a.dtype} and strides {a.strides} is not contiguous, and "
        f"the contiguous copy collectives send from takes {a.nbytes} bytes: {why}; a stride of 0 "
        f"(torch's expand, np.broadcast_to) repeats one element that many times: pass a smaller "
        f"array, or one with memory of its own (.contiguous(), np.ascontiguousarray)")


def _self_overlapping(a: np.ndarray) -> bool:
    """Whether two elements of ``a`` may share memory: True unless, taking its dimensions by
    increasing stride, each stride clears the span of the smaller ones (a sufficient test for no
    overlap: dense, sliced and transposed views pass; a stride of 0 on a dimension of two or more
    elements fails)."""
    if a.size == 0:
        return False
    span = a.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(a.strides, a.shape, strict=True) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def payload_view(payload, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` over a received or mapped buffer, without a copy.

    Raises:
        CollectiveError: the buffer's size is not ``count * itemsize``.
    """
    from transport.errors import CollectiveError

    nbytes = 0 if payload is None else memoryview(payload).nbytes
    if nbytes != count * dtype.itemsize:
        raise CollectiveError(f"payload of {nbytes} bytes, expected {count} x {dtype}")
    if count == 0:
        return np.empty(0, dtype)
    return np.frombuffer(payload, dtype=dtype, count=count)


async def off_loop(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, run in a worker thread when it touches ``nbytes >= OFF_LOOP_NBYTES``.

    NumPy releases the GIL inside its copy and ufunc loops, so the event loop goes on serving
    heartbeats and other operations while a large reduction or copy runs. Inline, a 512 MiB
    reduction blocked the loop for 1-2 s on a 2-core machine, and on a loaded one past the
    heartbeat timeout (2 s), so the coordinator declared healthy ranks lost. Below the threshold
    the hand-off (tens of microseconds) would cost more than it saves.

    If the awaiting task is cancelled (a deadline, a lost peer, the caller), the cancellation
    waits for the thread, which cannot be stopped, before it goes on: nothing the thread changes
    (a shared-memory slot, the caller's arrays) changes after the cancelled call's handlers ran
    or the call returned. Before, a cancelled shm operation's handler dropped this rank's new
    segment while the thread was still making it, and the next operation waited its whole
    deadline for acknowledgements of a segment the peers had mapped long before (a
    re-verifier's find). Such a cancellation takes as long as the work (about 0.2 s per GiB
    copied here).
    """
    if nbytes < OFF_LOOP_NBYTES:
        return fn(*args)
    fut = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait((fut,))
            except asyncio.CancelledError:   # cancelled again: still the thread's end first
                pass
        if not fut.cancelled():
            fut.exception()   # (retrieved: its error is moot once the call was cancelled)
        raise


def copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto(dst, src)`` for each ``(dst, src)``, skipping a source that is its own
    destination (a work item for :func:`off_loop`)."""
    for dst, src in pairs:
        if dst is not src:
            np.copyto(dst, src)
