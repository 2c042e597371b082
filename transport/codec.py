"""msgpack codec with explicit limits; never unpickles.

Limits are enforced while unpacking (msgpack's ``max_*_len``), so an oversize length prefix is
refused before memory is allocated for it. Bytes are always packed as msgpack ``bin``
(``use_bin_type=True``); ``str`` must be valid UTF-8; integers outside
``[-2**63, 2**64 - 1]`` cannot be packed and are a :class:`ProtocolError`. Extension types and
timestamps are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ProtocolError

__all__ = ["Limits", "DEFAULT_LIMITS", "encode", "decode", "peek_fields"]


@dataclass(frozen=True)
class Limits:
    """Upper bounds for one decoded message.

    Attributes:
        max_message_nbytes: whole encoded message, bytes.
        max_bin_len: one ``bin`` value, bytes.
        max_str_len: one ``str`` value, bytes of UTF-8.
        max_array_len: elements of one array.
        max_map_len: pairs of one map.
        max_depth: arrays and maps nested in one another (the message itself is depth 1).
            msgpack's own unpacker stops at 1024, its packer sooner: a value nested near that
            could be decoded but never journaled or echoed back, so it is refused here.
    """

    # a job's whole store (wire.MAX_JOB_KV_NBYTES, 16 MiB) fits one value, and one answer (a
    # kv_wait of every key) with the keys and the header
    max_message_nbytes: int = 17 * 1024 * 1024
    max_bin_len: int = 16 * 1024 * 1024
    max_str_len: int = 1024 * 1024
    max_array_len: int = 1 << 20
    max_map_len: int = 1 << 16
    max_depth: int = 32


DEFAULT_LIMITS = Limits()


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def encode(obj: Any, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Pack ``obj`` (dict/list/str/bytes/int/float/bool/None) into msgpack bytes.

    Raises:
        ProtocolError: an unsupported type, an integer outside 64 bits, or a result larger than
            ``limits.max_message_nbytes``.
    """
    try:
        data = msgpack.packb(obj, use_bin_type=True, strict_types=False, datetime=False)
    except OverflowError as exc:
        raise ProtocolError(f"integer outside the 64-bit range: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {type(obj).__name__}: {exc}") from exc
    if len(data) > limits.max_message_nbytes:
        raise ProtocolError(
            f"message of {len(data)} bytes exceeds the limit of {limits.max_message_nbytes} bytes"
        )
    return data


def _map_header(n: int) -> bytes:
    """msgpack's header of a map of ``n`` entries (fixmap, map 16 or map 32)."""
    if n <= 15:
        return bytes([0x80 | n])
    if n <= 0xFFFF:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def encode_with_packed(head: dict[str, Any], key: str, packed: bytes, *,
                       limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The msgpack bytes of ``{**head, key: value}`` where ``packed`` is ``encode(value)``
    already: one large value sent to many (a status answer) is encoded once, and each message
    costs a copy of it. ``key`` must not be in ``head``.

    Raises:
        ProtocolError: as :func:`encode`, for ``head`` or the whole message's size.
    """
    data = encode(head, limits=limits)
    first = data[0]
    if first & 0xF0 == 0x80:
        n, rest = first & 0x0F, data[1:]
    elif first == 0xDE:
        n, rest = int.from_bytes(data[1:3], "big"), data[3:]
    else:
        n, rest = int.from_bytes(data[1:5], "big"), data[5:]
    out = b"".join((_map_header(n + 1), rest, encode(key), packed))
    if len(out) > limits.max_message_nbytes:
        raise ProtocolError(f"message of {len(out)} bytes exceeds the limit of {limits.max_message_nbytes} bytes")
    return out


def decode(data: bytes | memoryview, *, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Unpack one msgpack object from ``data`` under ``limits``.

    Raises:
        ProtocolError: oversize, truncated, trailing bytes, invalid UTF-8, an extension type, or any
            length above the limits.
    """
    n = len(data)
    if n > limits.max_message_nbytes:
        raise ProtocolError(f"message of {n} bytes exceeds the limit of {limits.max_message_nbytes} bytes")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            use_list=True,
            ext_hook=_refuse_ext,
            timestamp=0,
            max_bin_len=limits.max_bin_len,
            max_str_len=limits.max_str_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except msgpack.ExtraData as exc:
        raise ProtocolError("trailing bytes after the message") from exc
    except msgpack.StackError as exc:   # deeper than msgpack's own 1024
        raise ProtocolError(f"malformed message ({n} bytes): arrays and maps nested deeper than "
                            f"{limits.max_depth} levels") from exc
    except (ValueError, msgpack.UnpackException, TypeError, UnicodeDecodeError, RecursionError) as exc:
        why = str(exc) or type(exc).__name__   # msgpack's FormatError (reserved byte 0xc1) has no text
        raise ProtocolError(f"malformed message ({n} bytes): {why}") from exc
    if isinstance(obj, dict | list):
        _check_depth(obj, limits.max_depth, n)
    return obj


_CONTAINERS = (dict, list)   # what msgpack decodes arrays and maps into (exact types)


def _check_depth(obj: dict | list, max_depth: int, n: int) -> None:
    """Refuse ``obj`` when arrays and maps nest deeper than ``max_depth`` (iterative: a deep
    value costs no recursion here)."""
    level = [obj]
    depth = 1
    while level:
        if depth > max_depth:
            raise ProtocolError(f"malformed message ({n} bytes): arrays and maps nested deeper "
                                f"than {max_depth} levels")
        nxt = []
        for c in level:
            vals = c.values() if isinstance(c, dict) else c
            nxt.extend(v for v in vals if type(v) in _CONTAINERS)
        level = nxt
        depth += 1


PEEK_NBYTES = 64 * 1024   # how much of an undecodable message peek_fields reads


def peek_fields(data: bytes | memoryview, names: frozenset[str], *, max_entries: int = 64) -> dict[str, Any]:
    """Read only the small scalar fields ``names`` of a top-level map, skipping everything else.

    Used to answer a message that is too large (or otherwise undecodable) with an error that
    carries its request id. Only the first ``PEEK_NBYTES`` are read (the header fields come first
    in what :func:`transport.wire.make` builds; a field past a huge value is not found): feeding a
    whole 60 MB message cost 46 ms of the coordinator's loop, and a flood of them stalled it for
    seconds. Returns what it could read; never raises.
    """
    found: dict[str, Any] = {}
    try:
        data = memoryview(data)[:PEEK_NBYTES]
        up = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1), max_str_len=256,
                              max_bin_len=0, max_array_len=0, max_map_len=max_entries, max_ext_len=0)
        up.feed(data)
        n = up.read_map_header()
        for _ in range(min(n, max_entries)):
            key = up.unpack()
            if isinstance(key, str) and key in names:
                value = up.unpack()
                if isinstance(value, int | str) and not isinstance(value, bool):
                    found[key] = value
            else:
                up.skip()
    except Exception:  # whatever it is, this is best effort
        pass
    return found
