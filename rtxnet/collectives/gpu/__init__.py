"""GPU collectives: CUDA IPC between ranks on one host, NCCL (through CuPy) across hosts.

Importing this package never imports CuPy: :func:`is_gpu_array` tells GPU arrays apart by their
interfaces (``__cuda_array_interface__``, ``__dlpack_device__``, ``torch.Tensor.is_cuda``), and the
backends import CuPy on first use. A :class:`rtxnet.collectives.Group` sends every collective whose
array is on a GPU here, through the same sequencing, deadlines, signature checks and failure
handling as the CPU path (``Group._collective`` and :class:`rtxnet.collectives.engine.Op`); only
the data moves differently.

Modules:

- :mod:`.arrays`: ``GpuBuffer`` (a CuPy array or torch CUDA tensor as pointer, dtype, count,
  device and producer stream; non-contiguous inputs through a contiguous scratch copy).
- :mod:`.stream`: the per-device stream rtxnet enqueues on, events, and ``await_event`` (polls
  ``cudaEventQuery`` with back-off, so the event loop never blocks on the GPU).
- :mod:`.kernels`: the reduction/copy kernels (NVRTC-compiled CUDA C, no headers).
- :mod:`.ipc`: same-host collectives over CUDA IPC memory and event handles.
- :mod:`.handshake`: their hello and "done" between ranks, as control messages or through
  :mod:`.board` (signal boards: a few words per rank in host shared memory, ``RTXNET_IPC_BOARD=1``).
- :mod:`.nccl`: NCCL communicators from a unique id exchanged through the coordinator's store.
- :mod:`.backend`: ``GpuGroup``, the per-group choice between them (topology exchange on first
  use) and the operations ``Group`` calls.
"""

from __future__ import annotations

__all__ = ["is_gpu_array", "cupy_available"]

_KDL_CUDA = 2          # DLPack device types (dlpack.h): CUDA, CUDA managed
_KDL_CUDA_MANAGED = 13


def is_gpu_array(t) -> bool:
    """True if ``t`` is an array in CUDA device memory (CuPy array, torch CUDA tensor, or any
    DLPack producer reporting a CUDA device); never imports CuPy or torch.

    Lists and tuples are GPU when their first element is.
    """
    if isinstance(t, (list, tuple)):
        return bool(t) and is_gpu_array(t[0])
    mod = type(t).__module__
    if mod.startswith("torch"):
        return bool(getattr(t, "is_cuda", False))
    if mod.startswith("numpy"):
        return False
    if hasattr(t, "__cuda_array_interface__"):
        return True
    dev = getattr(t, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) in (_KDL_CUDA, _KDL_CUDA_MANAGED)
        except Exception:  # noqa: BLE001 - a producer that cannot say is not a GPU array
            return False
    return False


def cupy_available() -> tuple[bool, str]:
    """``(True, "")`` if CuPy imports and sees a CUDA device, else ``(False, why)``."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA install
        return False, f"CuPy is not importable ({exc}); install rtxnet[gpu] or rtxnet[cuda13]"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver
        return False, f"no usable CUDA driver ({exc})"
    if n < 1:
        return False, "no CUDA device"
    return True, ""
