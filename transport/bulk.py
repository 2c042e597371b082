"""Bulk links: plain TCP streams that carry the ring's large blocks straight into their buffers.

ZeroMQ allocates every incoming message afresh (thousands of page faults per 64 MiB all-reduce)
and cannot receive into a buffer we own, so the ring's payload goes over dedicated TCP streams,
received with ``sock_recv_into`` into the destination (all-gather) or a reused scratch block
(reduce-scatter), as gloo does. ZeroMQ keeps carrying signatures, aborts and small messages.

One stream per (epoch, group, sender, receiver), opened lazily by the sender, which sends first::

    handshake = [magic u32, epoch u64, src u32, len(job) u16, len(gid) u16, key 32B] job gid
    block     = [magic u32, epoch u64, seq u64, step u64, nbytes u64] payload

=========  ===================================================================================
epoch      membership epoch of the sender; a stream of another epoch is never read
src        sender's world rank in that epoch
key        the job's data key (:func:`transport.peer.data_key`, its 32 bytes), zeros without a
           token; a receiver with a key closes a stream whose key differs, before reading on
seq, step  the group's operation and the algorithm's step; checked before the payload is read
nbytes     payload size; must equal what the receiver expects
=========  ===================================================================================

A block of an older ``seq`` (left over by an operation that failed here) is read and discarded;
any other mismatch closes the stream. A sender whose operation fails mid-block closes its stream
(the receiver then waits for the next one); a receiver that fails mid-block remembers how many
bytes of that block are still to be discarded. Every stream is closed at ``set_epoch`` and
``close``. Linux only (``AVAILABLE``).

What a client that reaches the port can make a process hold is bounded: a handshake of another
job is refused whatever its epoch; streams of later epochs (a peer that entered its next epoch
first) are kept up to ``MAX_FUTURE_STREAMS``; a stream not yet read is closed when its peer
closes it without having sent anything.

Buffer sizes are left to the kernel's autotuning: 4 MiB ``SO_SNDBUF``/``SO_RCVBUF`` made no
measurable difference at 4 ranks on 2 cores (64 MiB all-reduce, within the run-to-run noise).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import socket
import struct
import sys
from collections import deque

import structlog

from transport.errors import ClosedError, CollectiveError, LinkBrokenError
from transport.logbudget import LogBudget

__all__ = ["AVAILABLE", "BulkLinks", "SendLink", "RecvLink", "parse_endpoint"]

log = structlog.get_logger(__name__)

AVAILABLE = sys.platform.startswith("linux")
_MAGIC = 0x52545842  # "RTXB"
_HANDSHAKE = struct.Struct("<IQIHH32s")
_BLOCK = struct.Struct("<IQQQQ")
_MAX_NAME = 4096
_HANDSHAKE_TIMEOUT_S = 10.0
_DISCARD_NBYTES = 1 << 20
# Wake the reader once this much of a block has arrived rather than per segment. 64 MiB
# all-reduce, 4 ranks on 2 cores, CPU time per rank and op (user + system, medians of 8, two
# alternated runs): 52-53 ms at SO_RCVLOWAT 1 (the default), 41-51 ms at 1 MiB, 42-47 ms at
# 2 MiB, 43-46 ms at 4 MiB (a whole block); wall times were too noisy on the shared machine to
# rank 1-4 MiB, all beat 1 byte.
RCVLOWAT_NBYTES = 2 << 20
# Streams of a later epoch than this process's, kept until it enters that epoch. Legitimately a
# peer that entered it first opens one per group it sends to this rank in (the ring: one per
# group from its neighbour), so a few per peer; each holds a descriptor, and garbage handshakes
# of far-future epochs kept one each for good (20,500 exhausted the rank's descriptors and
# killed the job: a breaker's find). 256 is ample for the first and well below the usual
# descriptor limits (1,024 at the least). Past it a new one is refused, after closing those
# whose peer has gone: the ones kept are the first opened, those the rank will read first.
MAX_FUTURE_STREAMS = 256
# Out of descriptors (EMFILE, ENFILE) or kernel memory, accept fails for every pending connection
# at once and the listener stays readable: the loop spun on it (45,972 bulk_accept_failed lines,
# a breaker's find). Stop listening this long instead; the backlog holds the connections.
ACCEPT_PAUSE_S = 0.1
_ACCEPT_PAUSE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def parse_endpoint(endpoint: str) -> tuple[str, tuple[str, int] | None]:
    """``"tcp://host:port?bulk=port2"`` -> (``"tcp://host:port"``, (host, port2) or None)."""
    base, _, query = endpoint.partition("?")
    bulk = None
    for item in query.split("&") if query else ():
        key, _, val = item.partition("=")
        if key == "bulk" and val.isdigit() and base.startswith("tcp://"):
            host = base[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
            bulk = (host, int(val))
    return base, bulk


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _recv_exact(loop, sock: socket.socket, mv: memoryview) -> int:
    """Fill ``mv``; returns the bytes read (less than ``len(mv)`` only at end of stream)."""
    got, n = 0, len(mv)
    while got < n:
        k = await loop.sock_recv_into(sock, mv[got:])
        if k == 0:
            return got
        got += k
    return got


class _EndOfStream(Exception):
    pass


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _read_some(loop, link: RecvLink, mv: memoryview) -> int:
    """Read what is there into ``mv`` (at least one byte), waiting until readable.

    The read and the return happen in one step, so a caller cancelled while waiting has lost
    no data (``loop.sock_recv_into`` may complete a read whose result a cancellation drops).
    Before waiting, ``SO_RCVLOWAT`` is set to ``min(len(mv), RCVLOWAT_NBYTES)``: the loop wakes
    once that much has arrived rather than for every segment.

    Raises:
        _EndOfStream: the peer closed the stream.
    """
    sock = link.sock
    while True:
        try:
            k = sock.recv_into(mv)
        except (BlockingIOError, InterruptedError):
            lowat = max(1, min(len(mv), RCVLOWAT_NBYTES))
            if lowat != link.lowat:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                link.lowat = lowat
            fut = loop.create_future()
            fd = sock.fileno()
            loop.add_reader(fd, _wake, fut)
            try:
                await fut
            finally:
                loop.remove_reader(fd)
            continue
        if k == 0:
            raise _EndOfStream
        return k


class SendLink:
    """The outgoing stream of one group to one peer; blocks are written in order by a task.

    ``error`` is set (and ``on_error`` called) when the stream breaks; the link is then dead.
    """

    def __init__(self, loop, addr: tuple[str, int], handshake: bytes, epoch: int, peer: int):
        self._loop = loop
        self._addr = addr
        self._peer = peer
        self._handshake = handshake
        self._epoch = epoch
        self._queue: deque = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.sock: socket.socket | None = None
        self.error: BaseException | None = None
        self.on_error = None
        self.mid_block = False
        self._task = loop.create_task(self._run())

    def send(self, seq: int, step: int, mv: memoryview) -> None:
        """Queue one block; ``mv`` must stay unchanged until :meth:`drain` returns."""
        if self.error is not None:
            raise self.error
        self._queue.append((_BLOCK.pack(_MAGIC, self._epoch, seq, step, mv.nbytes), mv))
        self._idle.clear()
        self._wake.set()

    async def drain(self) -> None:
        """Wait until every queued block is in the kernel's send buffer."""
        await self._idle.wait()
        if self.error is not None:
            raise self.error

    async def _run(self) -> None:
        loop = self._loop
        try:
            sock = socket.socket(_family(self._addr[0]), socket.SOCK_STREAM)
            self.sock = sock
            _tune(sock)
            await loop.sock_connect(sock, self._addr)
            await loop.sock_sendall(sock, self._handshake)
            while True:
                while not self._queue:
                    self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
                header, mv = self._queue[0]
                self.mid_block = True
                await loop.sock_sendall(sock, header)
                await loop.sock_sendall(sock, mv)
                self.mid_block = False
                self._queue.popleft()
        except asyncio.CancelledError:
            self._fail(ClosedError("bulk link closed"))
        except (OSError, ValueError) as exc:   # ValueError: socket closed under us
            err = LinkBrokenError(f"bulk stream to rank {self._peer} at {self._addr[0]}:"
                                  f"{self._addr[1]} broke: {exc}", peer=self._peer)
            err.__cause__ = exc
            self._fail(err)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._queue.clear()
        self._idle.set()
        if self.sock is not None:
            self.sock.close()
        cb, self.on_error = self.on_error, None
        if cb is not None and not isinstance(exc, ClosedError):
            cb(exc)

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self.mid_block

    def close(self) -> None:
        """Stop writing and close; a write in progress is cancelled first (its task closes the
        socket after the loop has stopped watching it)."""
        if not self._task.done():
            self._task.cancel()
        elif self.sock is not None:
            self.sock.close()


class RecvLink:
    """The incoming stream of one group from one peer (after its handshake)."""

    def __init__(self, sock: socket.socket, epoch: int):
        self.sock = sock
        self.epoch = epoch
        self.skip_nbytes = 0   # rest of a block abandoned mid-payload, to discard first
        self.hdr_got = 0       # bytes of the next block header already read
        self.lowat = 1         # the socket's SO_RCVLOWAT
        self.dead = False
        self.reading = False
        self._hdr = bytearray(_BLOCK.size)
        self._watch_loop = None   # set while watched for its peer's close (watch)

    def watch(self, loop, on_closed) -> None:
        """Until a reader claims it (:meth:`unwatch`): call ``on_closed(self)`` once the peer
        closes the stream without having sent anything (a stream nobody reads otherwise sits in
        CLOSE-WAIT for good). A stream with data waiting is no longer watched (the data may be a
        block this rank reads later; it stays counted against its bound)."""
        self._watch_loop = loop
        loop.add_reader(self.sock.fileno(), self._peek, on_closed)

    def unwatch(self) -> None:
        loop, self._watch_loop = self._watch_loop, None
        if loop is not None and not loop.is_closed() and self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())

    def peer_closed(self) -> bool | None:
        """Whether the peer has closed the stream (end of stream or reset): ``None`` when a read
        would block, ``False`` when data is waiting."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:   # reset by the peer
            return True
        return not data

    def _peek(self, on_closed) -> None:
        closed = self.peer_closed()
        if closed is None:
            return
        self.unwatch()
        if closed:
            on_closed(self)

    def close(self) -> None:
        self.dead = True
        self.unwatch()
        self.sock.close()

    def retire(self, loop, *, now: bool) -> None:
        """Stop using this stream. Without ``now``, a read in progress goes on to the end of
        the stream (the sender closed it) and the reader closes it; with ``now`` it is closed
        after the reader's cancellation has reached the loop (never under a pending read)."""
        self.dead = True
        self.unwatch()
        if not self.reading:
            self.sock.close()
        elif now:
            loop.call_soon(self.sock.close)


class BulkLinks:
    """The bulk streams of one process: a listening socket and the links of the current epoch.

    Args:
        bind_host: interface to listen on (the data endpoint's host); the port is random.
    """

    def __init__(self, bind_host: str, key: str | None = None):
        # the job's data key as 32 bytes (zeros: none); streams that do not carry it are closed
        self._key = bytes.fromhex(key) if key is not None else None
        self._listener = socket.socket(_family(bind_host), socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._job: str | None = None
        self._epoch = -1
        self._rank = -1
        self._send: dict[tuple[str, int], SendLink] = {}
        # (epoch, gid, src) -> newest link; older epochs are closed at set_epoch
        self._recv: dict[tuple[int, str, int], RecvLink] = {}
        self._waiters: dict[tuple[int, str, int], list[asyncio.Future]] = {}
        self._handshaking: set[asyncio.Task] = set()
        self._closed = False
        self._accept_paused: asyncio.TimerHandle | None = None
        self._accept_log = LogBudget()
        self._refused_log = LogBudget()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._listener.fileno(), self._on_accept)

    def set_epoch(self, job: str, epoch: int, rank: int) -> None:
        """Enter ``epoch``: close every stream of older epochs."""
        self._job, self._epoch, self._rank = job, epoch, rank
        for link in self._send.values():
            link.close()
        self._send.clear()
        for key in [k for k in self._recv if k[0] < epoch]:
            self._recv.pop(key).retire(self._loop, now=True)
        for key in [k for k in self._waiters if k[0] < epoch]:
            for fut in self._waiters.pop(key):
                if not fut.done():
                    fut.set_exception(ClosedError(f"epoch {key[0]} ended"))

    def open_fds(self) -> int:
        """Sockets this object holds open (the listener included); for leak tests."""
        n = 1 if not self._closed else 0
        n += sum(1 for s in self._send.values() if s.sock is not None and s.sock.fileno() >= 0)
        n += sum(1 for r in self._recv.values() if r.sock.fileno() >= 0)
        return n

    # -- sending ---------------------------------------------------------------------------------

    def send_link(self, gid: str, dst: int, addr: tuple[str, int]) -> SendLink:
        """The (lazily opened) stream of group ``gid`` to world rank ``dst`` at ``addr``."""
        if self._closed:
            raise ClosedError("bulk links closed")
        key = (gid, dst)
        link = self._send.get(key)
        if link is None or link.error is not None:
            job, g = self._job.encode(), gid.encode()
            hs = _HANDSHAKE.pack(_MAGIC, self._epoch, self._rank, len(job), len(g),
                                 self._key or bytes(32)) + job + g
            link = SendLink(self._loop, addr, hs, self._epoch, dst)
            self._send[key] = link
        return link

    def drop_send_link(self, gid: str, dst: int) -> None:
        link = self._send.pop((gid, dst), None)
        if link is not None:
            link.close()

    # -- receiving -------------------------------------------------------------------------------

    def _on_accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                ok, suppressed = self._accept_log.allow()
                paused = exc.errno in _ACCEPT_PAUSE_ERRNOS
                if paused:
                    self._loop.remove_reader(self._listener.fileno())
                    self._accept_paused = self._loop.call_later(ACCEPT_PAUSE_S, self._resume_accept)
                if ok:
                    fields = {"paused_s": ACCEPT_PAUSE_S} if paused else {}
                    log.warning("bulk_accept_failed", error=str(exc), **fields,
                                suppressed_before=suppressed)
                return
            _tune(sock)
            t = self._loop.create_task(self._handshake(sock))
            self._handshaking.add(t)
            t.add_done_callback(self._handshaking.discard)

    def _resume_accept(self) -> None:
        self._accept_paused = None
        if not self._closed:
            self._loop.add_reader(self._listener.fileno(), self._on_accept)

    def _refuse(self, reason: str, **fields) -> None:
        ok, suppressed = self._refused_log.allow()
        if ok:
            log.warning("bulk_stream_refused", reason=reason, suppressed_before=suppressed, **fields)

    def _future_keys(self) -> list[tuple[int, str, int]]:
        return [k for k in self._recv if k[0] > self._epoch]

    def _drop_closed(self, key: tuple[int, str, int], link: RecvLink) -> None:
        """A stream not yet read whose peer closed it (see :meth:`RecvLink.watch`)."""
        if self._recv.get(key) is link:
            del self._recv[key]
        link.close()

    def _room_for_future(self) -> bool:
        future = self._future_keys()
        if len(future) < MAX_FUTURE_STREAMS:
            return True
        # (the watch closes them as their peers go; a peer may also have gone since a block came)
        for key in future:
            link = self._recv[key]
            if link.peer_closed():
                self._drop_closed(key, link)
        return len(self._future_keys()) < MAX_FUTURE_STREAMS

    async def _handshake(self, sock: socket.socket) -> None:
        loop = self._loop
        try:
            fixed = bytearray(_HANDSHAKE.size)
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT_S):
                if await _recv_exact(loop, sock, memoryview(fixed)) < len(fixed):
                    raise ValueError("closed during handshake")
                magic, epoch, src, njob, ngid, key = _HANDSHAKE.unpack(fixed)
                if magic != _MAGIC or njob > _MAX_NAME or ngid > _MAX_NAME:
                    raise ValueError("bad handshake")
                if self._key is not None and not hmac.compare_digest(key, self._key):
                    # (a stream of the same epoch, group and source replaces the live one: a
                    # client without the key could have taken over a ring's blocks)
                    self._refuse("wrong data key", src=src)
                    raise ValueError("wrong data key")
                names = bytearray(njob + ngid)
                if await _recv_exact(loop, sock, memoryview(names)) < len(names):
                    raise ValueError("closed during handshake")
            job, gid = bytes(names[:njob]).decode(), bytes(names[njob:]).decode()
        except (asyncio.CancelledError, TimeoutError, ValueError, OSError,
                UnicodeDecodeError) as exc:
            sock.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        # Another job's stream is refused whatever its epoch: one of a later epoch was kept for
        # good (this process's job never changes, so it could never be read)
        if self._closed or epoch < self._epoch or (self._job is not None and job != self._job):
            sock.close()
            return
        key = (epoch, gid, src)
        old = self._recv.get(key)
        if epoch > self._epoch and old is None and not self._room_for_future():
            self._refuse("too many streams of later epochs", epoch=epoch, src=src,
                         kept=MAX_FUTURE_STREAMS)
            sock.close()
            return
        if old is not None:
            # the sender opens a new stream only after dropping the old one
            old.retire(self._loop, now=False)
        link = self._recv[key] = RecvLink(sock, epoch)
        link.watch(self._loop, functools.partial(self._drop_closed, key))
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def recv_link(self, gid: str, src: int) -> RecvLink:
        """The live stream of group ``gid`` from world rank ``src``; waits for it to be opened."""
        key = (self._epoch, gid, src)
        while True:
            if self._closed:
                raise ClosedError("bulk links closed")
            link = self._recv.get(key)
            if link is not None and not link.dead:
                link.unwatch()   # the reader's own waits take the descriptor from here
                return link
            fut = self._loop.create_future()
            self._waiters.setdefault(key, []).append(fut)
            try:
                await fut
            finally:
                lst = self._waiters.get(key)
                if lst is not None and fut in lst:
                    lst.remove(fut)

    async def recv_into(self, gid: str, src: int, seq: int, step: int, mv: memoryview) -> None:
        """Receive block (``seq``, ``step``) of group ``gid`` from ``src`` into ``mv``.

        Blocks of older operations are discarded; a stream that ends is replaced by the next one
        the sender opens. Cancellable at any point: the stream's position (header bytes read,
        payload bytes still to discard) is updated in the same step as each read, so a later
        call resumes at the right byte.

        Raises:
            CollectiveError: the block's header does not match (the stream is closed).
            LinkBrokenError: the stream broke (reset by the peer).
        """
        loop = self._loop
        while True:
            link = await self.recv_link(gid, src)
            link.reading = True
            try:
                if link.skip_nbytes:
                    junk = memoryview(bytearray(min(link.skip_nbytes, _DISCARD_NBYTES)))
                    while link.skip_nbytes:
                        k = await _read_some(loop, link, junk[:min(link.skip_nbytes, len(junk))])
                        link.skip_nbytes -= k
                hdr = memoryview(link._hdr)
                while link.hdr_got < len(hdr):
                    link.hdr_got += await _read_some(loop, link, hdr[link.hdr_got:])
                link.hdr_got = 0
                magic, epoch, bseq, bstep, nbytes = _BLOCK.unpack(hdr)
                if magic != _MAGIC or epoch != link.epoch or bseq > seq:
                    link.close()
                    raise CollectiveError(
                        f"bulk stream from rank {src} out of step: block (epoch {epoch}, seq "
                        f"{bseq}, step {bstep}) while expecting (epoch {link.epoch}, seq {seq})")
                link.skip_nbytes = nbytes
                if bseq < seq:
                    continue    # left over by an operation that failed here: discard it
                if bstep != step or nbytes != mv.nbytes:
                    link.close()
                    raise CollectiveError(
                        f"bulk stream from rank {src}: got step {bstep} of {nbytes} bytes, "
                        f"expected step {step} of {mv.nbytes} bytes (seq {seq})")
                got = 0
                while got < nbytes:
                    k = await _read_some(loop, link, mv[got:])
                    got += k
                    link.skip_nbytes -= k
                return
            except _EndOfStream:
                link.close()    # the sender dropped it; wait for its next stream
            except (OSError, ValueError) as exc:   # ValueError: socket closed under us
                link.close()
                raise LinkBrokenError(f"bulk stream from rank {src} broke: {exc}", peer=src) from exc
            finally:
                link.reading = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._listener.fileno())
            except Exception:  # loop already torn down
                pass
        if self._accept_paused is not None:
            self._accept_paused.cancel()
        self._listener.close()
        for link in self._send.values():
            link.close()
        self._send.clear()
        for link in self._recv.values():
            link.retire(self._loop, now=True)
        self._recv.clear()
        for t in self._handshaking:
            t.cancel()
        for lst in self._waiters.values():
            for fut in lst:
                if not fut.done():
                    fut.set_exception(ClosedError("bulk links closed"))
        self._waiters.clear()
