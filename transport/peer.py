"""Peer data links: one ROUTER bound for incoming messages, one DEALER per peer for outgoing ones.

A data message is ``[header, payload?]``: ``header`` is a msgpack array (never pickle; bytes use
the bin type) and the optional payload travels as its own frame, zero-copy at or above
``ZERO_COPY_MIN_NBYTES``::

    header = [version, job, epoch, group, seq, src, kind, step, meta]

=========  =========================================================================
version    ``DATA_VERSION``; other versions are dropped
job        job id (str); messages of another job are dropped
epoch      membership epoch (int) of the sender
group      group id (str), identical on every member of the group
seq        the group's sequence number of the operation (int); point-to-point: the
           message's number per (group, destination) in the epoch, from 0
src        the sender's index in the world of ``epoch`` (int)
kind       what the message is (:class:`Kind`)
step       step of the algorithm (int), or the tag for point-to-point messages
meta       small msgpack value whose meaning depends on ``kind``
=========  =========================================================================

The receive side is an edge-triggered reader on the ROUTER's file descriptor that drains every
queued message into a handler, so no future is created per message. Sends never block: the
high-water marks are unlimited, and a zero-copy send returns a tracker that says when zmq is done
with the buffer.

The ring all-reduce's large blocks bypass this mesh: they go over the plain TCP streams of
:mod:`transport.bulk`, received in place (its wire format is documented there).

With a job token (``RTXNET_TOKEN``) the mesh admits only connections that prove the job's data
key (:func:`data_key`, an HMAC of the job id under the token): ZeroMQ's PLAIN mechanism, checked
by a ZAP handler (pyzmq's ``ThreadAuthenticator``) once per connection, before ZeroMQ accepts any
message on it. A client that knows a rank's data port but not the token cannot deliver a message
(a forged point-to-point message was taken as a peer's data, and a 600 MB frame was buffered
whole before its header was refused: a tester's finds). PLAIN sends the key in the clear, as the
control plane sends the token (see the README's trust paragraph); without a token any client that
reaches the port is admitted, as before.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack
import structlog
import zmq

from transport.errors import ClosedError, ProtocolError
from transport.logbudget import LogBudget

__all__ = ["DATA_VERSION", "ZERO_COPY_MIN_NBYTES", "Kind", "DataHeader", "encode_header",
           "decode_header", "PeerMesh", "data_key"]

log = structlog.get_logger(__name__)

DATA_VERSION = 1
ZERO_COPY_MIN_NBYTES = 64 * 1024
MAX_HEADER_NBYTES = 1 << 20


_ZAP_DOMAIN = "rtxnet-data"
_ZAP_USER = "rtxnet"


def data_key(job: str, token: str) -> str | None:
    """The key a job's ranks prove to each other's data ports: 64 hex digits, HMAC-SHA256 of the
    job id under the job's token (so the token itself never travels on the data plane, and one
    token gives every job its own key); None without a token (no check)."""
    if not token:
        return None
    return hmac.new(token.encode(), b"rtxnet-data\0" + job.encode(), hashlib.sha256).hexdigest()


class Kind(enum.IntEnum):
    HELLO = 0   # first message of every collective: signature (+ inline payload or shm offer)
    DATA = 1    # a step of an algorithm
    ABORT = 2   # the sender failed this operation; meta = [error class, message, ranks]
    P2P = 3     # point-to-point send; step = tag; meta = [dtype, shape]
    PROBE = 4   # "did you send me (kind, step) of this operation?"; meta = [kind]
    PROBED = 5  # "yes": the answer to a PROBE, sent only when it did; meta = [kind]


class DataHeader(NamedTuple):
    job: str
    epoch: int
    group: str
    seq: int
    src: int
    kind: Kind
    step: int
    meta: Any


def encode_header(h: DataHeader) -> bytes:
    return msgpack.packb([DATA_VERSION, h.job, h.epoch, h.group, h.seq, h.src, int(h.kind),
                          h.step, h.meta], use_bin_type=True)


def decode_header(buf: bytes | memoryview) -> DataHeader:
    """Parse and validate a header.

    Raises:
        ProtocolError: malformed, oversize, or of another version.
    """
    if len(buf) > MAX_HEADER_NBYTES:
        raise ProtocolError(f"data header of {len(buf)} bytes > {MAX_HEADER_NBYTES}")
    try:
        obj = msgpack.unpackb(buf, raw=False, use_list=True, strict_map_key=True,
                              max_str_len=1 << 16, max_bin_len=MAX_HEADER_NBYTES,
                              max_array_len=1 << 16, max_map_len=1 << 10, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable data header: {exc}") from exc
    if not isinstance(obj, list) or len(obj) != 9:
        raise ProtocolError("data header is not an array of 9")
    version, job, epoch, group, seq, src, kind, step, meta = obj
    if version != DATA_VERSION:
        raise ProtocolError(f"data header version {version!r} != {DATA_VERSION}")
    if not (isinstance(job, str) and isinstance(group, str)):
        raise ProtocolError("data header job/group must be str")
    for name, v in (("epoch", epoch), ("seq", seq), ("src", src), ("step", step)):
        if type(v) is not int:
            raise ProtocolError(f"data header {name} must be int, got {type(v).__name__}")
    try:
        kind = Kind(kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown data message kind {kind!r}") from exc
    return DataHeader(job, epoch, group, seq, src, kind, step, meta)


Handler = Callable[[DataHeader, "memoryview | None", "zmq.Frame | None"], None]


class PeerMesh:
    """The data sockets of one process.

    Args:
        bind_host: interface for the ROUTER; the port is picked at random.
        handler: called in the event loop for every valid incoming message with the header, the
            payload as a ``memoryview`` (or ``None``) and the frame that owns it.
        key: the job's data key (:func:`data_key`): connections to this mesh must prove it, and
            this mesh proves it to its peers; None: no check.
    """

    def __init__(self, bind_host: str, handler: Handler, key: str | None = None):
        self._ctx = zmq.Context()
        self._key = key
        self._auth = None
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.RCVBUF, 4 << 20)
        if key is not None:
            from zmq.auth.thread import ThreadAuthenticator

            # the ZAP handler answers before the ROUTER accepts any connection (it binds next)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_plain(domain=_ZAP_DOMAIN, passwords={_ZAP_USER: key})
            self._router.plain_server = True
            self._router.zap_domain = _ZAP_DOMAIN.encode()
        port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._dealers: dict[str, zmq.Socket] = {}
        self._handler = handler
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.dropped = 0
        # whoever reaches the port can send garbage: one line per message wrote 6 MB for 50,000
        # of them (a breaker's find); ``dropped`` still counts every one
        self._drop_log = LogBudget()

    def start(self) -> None:
        """Start reading (in the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._router.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        router = self._router
        while not self._closed and router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                if len(frames) not in (2, 3):
                    raise ProtocolError(f"data message of {len(frames)} frames")
                header = decode_header(frames[1].buffer)
            except ProtocolError as exc:
                self.dropped += 1
                ok, suppressed = self._drop_log.allow()
                if ok:
                    log.warning("data_message_dropped", reason=str(exc), suppressed_before=suppressed)
                continue
            if len(frames) == 3:
                self._handler(header, frames[2].buffer, frames[2])
            else:
                self._handler(header, None, None)

    def connect(self, endpoint: str) -> None:
        """Open (once) the outgoing link to ``endpoint``."""
        if endpoint not in self._dealers:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.SNDBUF, 4 << 20)
            if self._key is not None:
                s.plain_username = _ZAP_USER.encode()
                s.plain_password = self._key.encode()
            s.connect(endpoint)
            self._dealers[endpoint] = s

    def send(self, endpoint: str, header: bytes, payload=None) -> zmq.MessageTracker | None:
        """Queue a message for ``endpoint``; never blocks.

        Returns:
            A tracker when the payload was sent without a copy (the caller must not modify the
            buffer before ``tracker.done``), else ``None``.

        Raises:
            ClosedError: the mesh was closed.
        """
        if self._closed:
            raise ClosedError("peer mesh is closed")
        self.connect(endpoint)
        sock = self._dealers[endpoint]
        if payload is None:
            sock.send(header, zmq.NOBLOCK)
            return None
        mv = memoryview(payload)
        if mv.nbytes >= ZERO_COPY_MIN_NBYTES:
            frame = zmq.Frame(mv, copy=False, track=True)
            sock.send_multipart([header, frame], zmq.NOBLOCK, copy=False)
            return frame.tracker
        sock.send_multipart([header, mv], zmq.NOBLOCK)
        return None

    def disconnect(self, endpoint: str) -> None:
        """Close the outgoing link to ``endpoint``, dropping what is still queued for it."""
        s = self._dealers.pop(endpoint, None)
        if s is not None:
            s.close(linger=0)

    def retain(self, endpoints) -> None:
        """Close the outgoing links to every endpoint not in ``endpoints`` (peers no longer in
        the job: what is queued for them is dropped, and never holds up :meth:`aclose`)."""
        for ep in [ep for ep in self._dealers if ep not in endpoints]:
            self.disconnect(ep)

    def _stop_reading(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._router.getsockopt(zmq.FD))
            except Exception:  # loop already torn down
                pass
        return True

    def close(self) -> None:
        """Close at once: messages still queued are dropped (``LINGER`` 0)."""
        if not self._stop_reading():
            return
        for s in self._dealers.values():
            s.close(linger=0)
        self._dealers.clear()
        self._router.close(linger=0)
        self._stop_auth()
        self._ctx.term()

    def _stop_auth(self) -> None:
        # before the context's term, which waits for the ZAP handler's socket
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    async def aclose(self, linger_s: float) -> None:
        """Close, giving the messages still queued for peers up to ``linger_s`` seconds to leave
        (``zmq_ctx_term`` waits for them, in a worker thread: the loop goes on meanwhile). A
        message sent just before (the last hello of a barrier this rank completed, its peers
        still waiting for it) is otherwise dropped when ZeroMQ's I/O thread has not written it
        to the socket yet, and the peer fails with this rank's leave instead of completing."""
        if not self._stop_reading():
            return
        dealers, self._dealers = list(self._dealers.values()), {}
        router, ctx = self._router, self._ctx
        ms = max(0, int(linger_s * 1000))

        def finish() -> None:
            for s in dealers:
                s.close(linger=ms)
            router.close(linger=0)
            self._stop_auth()
            ctx.term()

        try:
            done = asyncio.get_running_loop().run_in_executor(None, finish)
        except RuntimeError:
            # at interpreter exit (a group released by its atexit handler) the default executor
            # takes no new work ("cannot schedule new futures after interpreter shutdown"): wait
            # here, on the loop's thread, which nothing else needs any more. Before, the close
            # raised, the sockets were left to the process's end and the queued messages lost.
            finish()
            return
        await done
