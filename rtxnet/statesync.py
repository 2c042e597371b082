"""Training state to bytes and back, without pickle, for in-memory snapshots and peer sync.

A state is any nesting of dict (str or int keys), list, tuple, None, bool, int, float, str,
bytes, NumPy arrays and torch tensors (any device; they come back on the CPU, or on ``device``
when given), at most ``MAX_DEPTH`` containers deep and without cycles. Ints of any size are
exact: those outside msgpack's range (-2**63 .. 2**64-1, e.g. the 128-bit ints of a NumPy
``Generator``'s ``bit_generator.state``) are encoded as a msgpack ExtType (code ``_EXT_BIGINT``:
the int's signed little-endian two's-complement bytes), never pickled. The layout of a blob::

    u64 little-endian  length of the msgpack header
    header             the structure, with each array replaced by {"__a": i, "dtype", "shape", "kind"}
    payload            the arrays' bytes, each 64-byte aligned, in order

Arrays are copied once into the blob, so a blob is also a deep, immutable snapshot (a read-only
``memoryview``). The copies into it, and out of it when decoding, are NumPy copies, which release
the GIL: a thread that packs a state of gigabytes lets the agent's event loop go on sending
heartbeats (``bytes`` and ``bytearray`` copies hold the GIL throughout, and three of them took
6 s for a 1.5 GB state on a 2-core host, long past the 2 s heartbeat timeout). Decoding never
executes anything: dtypes are looked up by name in an allow-list.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

__all__ = ["pack_state", "unpack_state"]

_ALIGN = 64
MAX_DEPTH = 100   # containers (dict, list, tuple) nested in a state, at most
_EXT_BIGINT = 1   # msgpack ExtType code of an int outside msgpack's range (-2**63 .. 2**64-1)
_INT_MIN, _INT_MAX = -2**63, 2**64 - 1
_TORCH_DTYPES: dict[str, Any] = {}


def _torch():
    import torch

    if not _TORCH_DTYPES:
        for name in ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
                     "complex64", "complex128"):
            _TORCH_DTYPES[name] = getattr(torch, name)
    return torch


def pack_state(state: Any, *, into: np.ndarray | None = None) -> memoryview:
    """Encode ``state`` into one blob (see the module docstring): a read-only, C-contiguous
    ``memoryview`` of unsigned bytes (``len()`` is its size in bytes; ``bytes(blob)`` copies it).
    Each array is copied into it once, with the GIL released.

    Args:
        into: the array of an earlier blob of this function (``blob.obj``) that nothing reads
            any more: written over in place when it is the size this blob needs (every byte
            is written), else left alone and a new array allocated. Reuse skips the kernel's
            zeroing of fresh pages: one copy of 1 GiB took 0.13 s into written pages against
            0.37-0.42 s into fresh ones on the 2-core CI host (``tools/bench/snapshot.py``).
            Every view of ``into`` sees the new bytes: the caller vouches that none is read.

    Raises:
        TypeError: a value (or dict key) of an unsupported type (names its type and its key
            path, e.g. ``state.rng.state``); ``into`` is then unchanged.
        ValueError: a container that contains itself, or containers nested more than
            ``MAX_DEPTH`` deep (names the key path); ``into`` is then unchanged.
    """
    arrays: list[np.ndarray] = []
    open_ids: dict[int, str] = {}   # id -> key path of the containers being encoded (cycles)

    def enc(v: Any, where: str, depth: int = 0) -> Any:
        if v is None or isinstance(v, bool | float | str | bytes):
            return v
        if isinstance(v, int):
            return _int(v)
        if isinstance(v, dict | tuple | list):
            if id(v) in open_ids:
                raise ValueError(f"{_short(where)}: a {type(v).__name__} that contains itself (it is "
                                 f"{_short(open_ids[id(v)])}) cannot be part of a synced state")
            if depth >= MAX_DEPTH:
                raise ValueError(f"{_short(where)}: containers nested more than {MAX_DEPTH} deep "
                                 f"cannot be part of a synced state")
            open_ids[id(v)] = where
            try:
                if isinstance(v, dict):
                    return {"__d": [[_int(k) if isinstance(k, int) else k if isinstance(k, str) else _bad(k, where),
                                     enc(x, f"{where}.{k}", depth + 1)] for k, x in v.items()]}
                if isinstance(v, tuple):
                    return {"__t": [enc(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
                return [enc(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
            finally:
                del open_ids[id(v)]
        if isinstance(v, np.ndarray):
            arrays.append(np.ascontiguousarray(v))
            return {"__a": len(arrays) - 1, "dtype": v.dtype.str, "shape": list(v.shape), "kind": "numpy"}
        if isinstance(v, np.generic):
            item = v.item()   # (a longdouble's is itself: a bare RecursionError before)
            return _bad(v, where) if isinstance(item, np.generic) else enc(item, where, depth)
        if type(v).__module__.startswith("torch") and hasattr(v, "detach"):
            torch = _torch()
            t = v.detach().to("cpu").contiguous()
            name = str(t.dtype).removeprefix("torch.")
            raw = t.view(torch.uint8) if t.numel() and t.dim() else t.reshape(-1).view(torch.uint8)
            arrays.append(raw.numpy().reshape(-1))
            return {"__a": len(arrays) - 1, "dtype": name, "shape": list(t.shape), "kind": "torch"}
        return _bad(v, where)

    header = msgpack.packb(enc(state, "state"), use_bin_type=True)
    offsets = []
    pos = 8 + len(header)
    for a in arrays:
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(pos)
        pos += a.nbytes
    if (into is not None and into.dtype == np.uint8 and into.ndim == 1 and into.size == pos
            and into.flags.c_contiguous and into.base is None):
        out = into
        out.flags.writeable = True   # (its own memory: it may be made writable again)
    else:
        out = np.empty(pos, dtype=np.uint8)   # not zero-filled: every byte is written below
    out[:8] = np.frombuffer(struct.pack("<Q", len(header)), dtype=np.uint8)
    out[8:8 + len(header)] = np.frombuffer(header, dtype=np.uint8)
    end = 8 + len(header)
    for off, a in zip(offsets, arrays, strict=True):
        out[end:off] = 0   # the alignment padding
        if a.nbytes:
            np.copyto(out[off:off + a.nbytes], a.reshape(-1).view(np.uint8))
        end = off + a.nbytes
    out.flags.writeable = False
    return memoryview(out)


def _bad(v: Any, where: str):
    raise TypeError(f"{_short(where)}: values of type {type(v).__name__} cannot be part of a synced state")


def _short(where: str, keep: int = 100) -> str:
    """A key path for a one-line message: its middle elided when it is long (deep nesting)."""
    return where if len(where) <= 2 * keep else f"{where[:keep]}...{where[-keep:]}"


def _int(v: int) -> Any:
    """An int as msgpack holds it: itself within msgpack's range, else an ExtType of its bytes."""
    if isinstance(v, bool) or _INT_MIN <= v <= _INT_MAX:
        return v
    return msgpack.ExtType(_EXT_BIGINT, int(v).to_bytes(v.bit_length() // 8 + 1, "little", signed=True))


def _ext(code: int, data: bytes) -> Any:
    if code != _EXT_BIGINT:
        raise ValueError(f"unknown msgpack extension type {code} in a state blob")
    return int.from_bytes(data, "little", signed=True)


def unpack_state(blob: Any, *, device: Any = None) -> Any:
    """Decode a blob from :func:`pack_state` (any C-contiguous buffer: ``bytes``, a
    ``memoryview``, a uint8 array as a collective received it); arrays are fresh copies
    (writable), made with the GIL released.

    Raises:
        ValueError: the blob is malformed.
    """
    mv = memoryview(blob)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    if len(mv) < 8:
        raise ValueError(f"state blob of {len(mv)} bytes is too short")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if 8 + hlen > len(mv):
        raise ValueError("state blob header runs past its end")
    tree = msgpack.unpackb(mv[8:8 + hlen], raw=False, strict_map_key=False, ext_hook=_ext)
    pos = [8 + hlen]

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if isinstance(v, dict):
            if "__d" in v:
                return {k: dec(x) for k, x in v["__d"]}
            if "__t" in v:
                return tuple(dec(x) for x in v["__t"])
            if "__a" in v:
                return arr(v)
        return v

    def arr(spec: dict) -> Any:
        if spec["kind"] == "numpy":
            dtype = np.dtype(spec["dtype"])
            if dtype.hasobject:
                raise ValueError("object arrays are not allowed in a state blob")
        else:
            torch = _torch()
            if spec["dtype"] not in _TORCH_DTYPES:
                raise ValueError(f"unknown torch dtype {spec['dtype']!r}")
            dtype = np.dtype(np.uint8)
        shape = tuple(spec["shape"])
        count = int(np.prod(shape)) if shape else 1
        start = (pos[0] + _ALIGN - 1) // _ALIGN * _ALIGN
        if spec["kind"] == "numpy":
            nbytes = count * dtype.itemsize
            a = np.frombuffer(mv[start:start + nbytes], dtype=dtype).reshape(shape).copy()
            pos[0] = start + nbytes
            return a
        tdtype = _TORCH_DTYPES[spec["dtype"]]
        itemsize = torch.empty((), dtype=tdtype).element_size()
        nbytes = count * itemsize
        raw = np.frombuffer(mv[start:start + nbytes], dtype=np.uint8).copy()
        pos[0] = start + nbytes
        t = torch.from_numpy(raw).view(tdtype).reshape(shape)
        return t.to(device) if device is not None else t

    return dec(tree)
