"""Signal boards: a few 64-bit words per rank in host shared memory, which same-host peers poll.

The CUDA IPC collectives (:mod:`.ipc`) use them instead of control messages for the two
synchronisations every operation needs once a group is warm: "my input is ready, here is what I
offer" (the hello) and "my writes into your memory are enqueued behind this event" (the done).
A message through the engine costs about 100 us one way on an H200 host (ZeroMQ, msgpack and two
turns of each event loop); a store into shared memory is seen by a polling peer within a turn of
its loop.

Layout: one segment per rank and :class:`~.ipc.IpcState` (so per group and epoch), made with
:class:`transport.shm.Segment` (named after the job and pid, so ``rtxnet-run`` and every engine's
start remove what a killed rank left), ``NBYTES`` bytes, zero at creation. Word ``slot`` holds
``(value << 32) | seq32``, where ``seq32`` is the group's operation number modulo 2**32 - 1,
plus one (0: never posted). Each word is written by one aligned 8-byte store and read by one aligned
8-byte load (NumPy ``uint64`` element access), which are single-copy atomic on x86-64 and AArch64,
so a reader never sees half of a post; because every word carries the operation number, no order
between words is assumed.

Slots: ``HELLO`` (value: CRC-32 of the operation's signature), ``OFFER`` (value: the id of an
offer of buffers the peers already hold, ``NEW`` when the full offer went as a message, ``FULL``
when this rank wants every rank's full hello by message), ``DONE`` (value 0).

Only the owner writes its board; peers map it read-only. Nothing on a board is trusted beyond the
two numbers: an offer id that a peer does not hold, or a signature hash that differs, sends the
operation down the message path, where the full data is checked (:mod:`.ipc`).
"""

from __future__ import annotations

import zlib

import msgpack
import numpy as np

from transport.shm import PeerSegment, Segment

__all__ = ["Board", "PeerBoard", "HELLO", "OFFER", "DONE", "NEW", "FULL", "NBYTES", "PERIOD", "seq32",
           "sig_hash"]

NBYTES = 64                  # 8 words; 3 used
HELLO, OFFER, DONE = 0, 1, 2
NEW = 0                      # OFFER: the full offer went as a message (a new id is in it)
FULL = 0xFFFFFFFF            # OFFER: this rank takes part by message only, for every rank
_MASK = 0xFFFFFFFF


PERIOD = _MASK               # operation numbers are posted modulo this (so never as 0)


def seq32(seq: int) -> int:
    """The word form of operation number ``seq`` (>= 0): ``seq`` modulo ``PERIOD``, plus one
    (1 .. 2**32 - 1; consecutive numbers never share a form)."""
    return seq % PERIOD + 1


def sig_hash(sig: list) -> int:
    """CRC-32 of the msgpack form of a collective's signature (``Group._sig``): equal on every
    rank for equal signatures. Two signatures that differ collide with probability 2**-32."""
    return zlib.crc32(msgpack.packb(sig, use_bin_type=True))


class Board:
    """This rank's board: a segment it owns and writes.

    Args:
        name: the segment's file name (``Engine._next_segment_name()``).

    Raises:
        OSError: ``/dev/shm`` refused the segment.
    """

    def __init__(self, name: str):
        self.seg = Segment(name, NBYTES)
        self.name = name
        self.words = np.frombuffer(self.seg.buf, np.uint64, NBYTES // 8)

    def post(self, slot: int, seq: int, value: int = 0) -> None:
        """Publish ``value`` (0 .. 2**32 - 1) for operation ``seq`` in ``slot``."""
        self.words[slot] = (value << 32) | seq32(seq)

    def unlink(self) -> None:
        """Remove the file once every peer has mapped it (the mappings stay valid)."""
        self.seg.unlink()

    def close(self) -> None:
        self.words = None
        self.seg.close()


class PeerBoard:
    """A peer's board, mapped read-only.

    Raises:
        ValueError: ``name`` is not an rtxnet segment name, or the segment is too small.
        OSError: the segment cannot be opened (gone, or not on this host).
    """

    def __init__(self, name: str):
        self.seg = PeerSegment(name, NBYTES)
        self.name = name
        self.words = np.frombuffer(self.seg.buf, np.uint64, NBYTES // 8)

    def read(self, slot: int, seq: int) -> int | None:
        """The value posted in ``slot`` for operation ``seq``, or None if the word holds another
        operation's (an earlier one: not posted yet)."""
        w = int(self.words[slot])
        return (w >> 32) if (w & _MASK) == seq32(seq) else None

    def seq(self, slot: int) -> int | None:
        """The operation number last posted in ``slot`` (modulo ``PERIOD``), None if never."""
        s = int(self.words[slot]) & _MASK
        return None if s == 0 else s - 1

    def close(self) -> None:
        self.words = None
        self.seg.close()
