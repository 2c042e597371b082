"""``GpuBuffer``: one user GPU array as the pointer, dtype and count the backends work on.

Accepted: CuPy arrays, torch CUDA tensors (bfloat16 included, read through their storage, no
copy), and other DLPack producers on a CUDA device (viewed through ``cupy.from_dlpack``, no copy).
A non-contiguous array is copied into a contiguous scratch array (same device) and written back
by :meth:`GpuBuffer.commit`. The dtype is a NumPy dtype (``ml_dtypes.bfloat16`` for bfloat16), so
the CPU path's dtype and reduce-op rules (:mod:`rtxnet.collectives.reduce_ops`) apply unchanged.
"""

from __future__ import annotations

import contextvars

import numpy as np

from rtxnet.collectives.gpu.stream import producer_stream
from rtxnet.collectives.reduce_ops import bfloat16, dtype_name

__all__ = ["GpuBuffer", "gpu_buffers", "CALLER_STREAM", "caller_stream"]

# The producer's stream as seen by the thread that called the blocking API: its collectives run
# on the portal's loop thread, whose "current stream" is not the caller's (see caller_stream).
CALLER_STREAM: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rtxnet_caller_stream", default=None)


def caller_stream(args, kwargs) -> int | None:
    """The current stream, in the calling thread, of the first GPU array among ``args`` and
    ``kwargs`` (lists searched too): torch's current stream on the tensor's device, or CuPy's
    on the array's device; None when no argument is a GPU array. Never imports CuPy or torch
    for CPU arguments."""
    from rtxnet.collectives.gpu import is_gpu_array

    for a in list(args) + list(kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if is_gpu_array(t):
                return producer_stream(t)
    return None

_TORCH_DTYPES = {
    "torch.float16": np.dtype(np.float16),     # torch.bfloat16: bfloat16(), imported on first use
    "torch.float32": np.dtype(np.float32), "torch.float64": np.dtype(np.float64),
    "torch.int8": np.dtype(np.int8), "torch.int16": np.dtype(np.int16),
    "torch.int32": np.dtype(np.int32), "torch.int64": np.dtype(np.int64),
    "torch.uint8": np.dtype(np.uint8), "torch.bool": np.dtype(np.bool_),
}


class GpuBuffer:
    """A user GPU array and the contiguous memory collectives read and write.

    Attributes:
        array: the user's object (written in place by :meth:`commit` when it needed a scratch).
        ptr: device address of element 0 of the contiguous memory (0 for an empty array).
        dtype: NumPy dtype (bfloat16 as ``ml_dtypes.bfloat16``).
        size: number of elements. shape: the array's shape. nbytes: ``size * itemsize``.
        device: CUDA device ordinal in this process.
        stream: ``cudaStream_t`` (int) of the producer (:func:`.stream.producer_stream`): rtxnet
            orders its work after that stream and that stream after rtxnet's work.

    Raises (constructor):
        ValueError: not a CUDA array, unsupported dtype, or a read-only output.
    """

    __slots__ = ("array", "ptr", "dtype", "size", "shape", "device", "stream", "_scratch",
                 "_commit")

    def __init__(self, t, *, readonly: bool = False):
        self.array = t
        self._scratch = None
        self._commit = None
        if type(t).__module__.startswith("torch"):
            self._from_torch(t)
        else:
            self._from_cupy(t, readonly)
        dtype_name(self.dtype)  # raises ValueError for an unsupported dtype

    def _from_torch(self, t) -> None:
        import torch

        if not t.is_cuda:
            raise ValueError(f"tensor on {t.device}; expected a CUDA tensor")
        dt = bfloat16() if str(t.dtype) == "torch.bfloat16" else _TORCH_DTYPES.get(str(t.dtype))
        if dt is None:
            raise ValueError(f"dtype {t.dtype} is not supported by rtxnet collectives")
        src = t.detach()
        self.device = int(t.device.index if t.device.index is not None else torch.cuda.current_device())
        self.stream = producer_stream(t)
        if not src.is_contiguous():
            # the copy in and the write-back on the producer's stream, which rtxnet's stream
            # waits for (the loop thread's current stream is not ordered with it)
            user = src      # bound now: ``src`` is the scratch copy below
            on = torch.cuda.ExternalStream(self.stream, device=t.device)
            with torch.cuda.stream(on):
                scratch = src.contiguous()

            def commit() -> None:
                with torch.cuda.stream(on):
                    user.copy_(scratch)

            self._scratch = scratch
            self._commit = commit
            src = scratch
        self.ptr = int(src.data_ptr()) if src.numel() else 0
        self.dtype = dt
        self.size = int(src.numel())
        self.shape = tuple(t.shape)

    def _from_cupy(self, t, readonly: bool) -> None:
        import cupy

        a = t
        if not isinstance(a, cupy.ndarray):
            try:
                a = cupy.from_dlpack(t)
            except Exception as exc:  # noqa: BLE001 - BufferError/TypeError from the producer
                raise ValueError(f"cannot view {type(t).__name__} as a CUDA array: {exc}") from exc
        self.dtype = np.dtype(a.dtype)
        self.device = int(a.device.id)
        self.stream = producer_stream(a)
        if not a.flags.c_contiguous:
            from rtxnet.collectives.gpu.stream import foreign_stream

            # on the producer's stream, as for torch tensors above
            user = a        # bound now: ``a`` is the scratch copy below
            on = foreign_stream(self.stream, self.device)
            with cupy.cuda.Device(self.device), on:
                scratch = cupy.ascontiguousarray(a)

            def commit() -> None:
                with cupy.cuda.Device(self.device), on:
                    user[...] = scratch

            self._scratch = scratch
            self._commit = commit
            a = scratch
        self.ptr = int(a.data.ptr) if a.size else 0
        self.size = int(a.size)
        self.shape = tuple(a.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def at(self, element: int) -> int:
        """Device address of element ``element`` of the contiguous memory."""
        return self.ptr + element * self.dtype.itemsize

    def commit(self) -> None:
        """Write the scratch copy back into the user's non-contiguous array (enqueued on the
        user's current stream, after rtxnet's work, which the caller has ordered before it)."""
        if self._commit is not None:
            self._commit()


def gpu_buffers(name: str, arg, n: int, count: int | None, dtype, *,
                readonly: bool) -> tuple[list[GpuBuffer], list[int]]:
    """``(buffers, addresses)``: ``arg`` is a list of ``n`` GPU arrays of ``count`` elements of
    ``dtype`` each, or one array of ``n * count`` elements cut in ``n``; ``addresses[k]`` is the
    device address of part ``k``.

    Raises:
        ValueError: wrong number of parts, or a part of another size or dtype (names which).
    """
    if isinstance(arg, (list, tuple)):
        if len(arg) != n:
            raise ValueError(f"{name} has {len(arg)} entries, group size is {n}")
        bufs = [GpuBuffer(t, readonly=readonly) for t in arg]
        for k, b in enumerate(bufs):
            if b.dtype != dtype or (count is not None and b.size != count):
                raise ValueError(f"{name}[{k}] is {b.dtype}[{b.size}], expected {dtype}[{count}]")
        return bufs, [b.ptr for b in bufs]
    b = GpuBuffer(arg, readonly=readonly)
    if b.dtype != dtype or (count is not None and b.size != n * count):
        raise ValueError(f"{name} is {b.dtype}[{b.size}], needs {dtype}[{n} * {count}]")
    per = b.size // n if n else 0
    return [b], [b.at(k * per) for k in range(n)]
