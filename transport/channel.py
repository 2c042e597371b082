"""The control channel: coordinator ROUTER, agent DEALER, one msgpack frame per message.

:class:`ControlClient` (agent side) matches replies to requests by request id, puts a deadline on
every request and hands pushes to a callback. :class:`ControlServer` (coordinator side) yields
``(identity, message)`` pairs and disconnect notices: it maps each connection's file descriptor
(``zmq.SRCFD`` of received frames) to the sender's routing id, so a ZeroMQ ``EVENT_DISCONNECTED``
names the agent whose process went away. (A descriptor is reused as soon as its connection
closes: before each frame the disconnects already reported are taken, so a late notice for the
old connection never names the new one; and a client's disconnect counts only for its newest
connection.) Replies go out without waiting: past ZeroMQ's queue of 16 for a client they wait in
a backlog of that client, at most 64 MiB, sent on as it reads. Sockets close with ``linger=0``. A
ZeroMQ context is bound to the process that made it: using it after ``fork()`` raises
:class:`ClosedError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from . import wire
from .codec import DEFAULT_LIMITS, Limits, decode, encode, encode_with_packed, peek_fields
from .errors import (
    ClosedError,
    ConnectError,
    ProtocolError,
    RtxError,
    RtxTimeoutError,
    error_from_wire,
)
from .logbudget import LogBudget

__all__ = ["ControlClient", "ControlServer", "Inbound", "Disconnected", "process_context", "check_address"]

log = structlog.get_logger(__name__)

_contexts: dict[int, zmq.asyncio.Context] = {}


def check_address(address: str) -> str:
    """Check a ZeroMQ TCP or IPC address (``tcp://HOST:PORT``, ``ipc://PATH``); returns it.

    Raises:
        ValueError: not such an address, or a port outside 0..65535 (ZeroMQ would wrap it).
    """
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(f"{address!r} is not a ZeroMQ address like tcp://HOST:PORT")
    scheme, rest = address.split("://", 1)
    if scheme == "ipc":
        return address
    if scheme != "tcp":
        raise ValueError(f"{address!r}: transport {scheme!r} is not supported (use tcp:// or ipc://)")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{address!r} has no HOST:PORT")
    if host.startswith("[") != host.endswith("]") or (host.startswith("[") and ":" not in host):
        raise ValueError(f"{address!r}: host {host!r} is not an IPv6 address in brackets "
                         f"(tcp://[::1]:PORT)")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ValueError(f"{address!r}: port {port!r} is not in 0..65535")
    return address


def route_address(host: str) -> str:
    """This host's own address on its route to ``host`` (an IP or name), found by connecting a
    UDP socket, which sends nothing: the address other hosts reach this one at.

    Raises:
        OSError: no route to ``host`` (or it does not resolve).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """``sock.get_monitor_socket(events)``, tried again when a signal interrupts it.

    libzmq's ``zmq_socket_monitor`` can fail with EINTR (a SIGCHLD from a rank that exited, in
    rtxnet-run) and pyzmq does not retry it (``InterruptedSystemCall``: "This call should have
    been retried"); the monitor is then not set, so the call is simply made again. Seen once:
    rtxnet-run ended in that traceback when both its ranks exited together under load.

    Raises:
        zmq.ZMQError: any other failure (or EINTR 100 times in a row).
    """
    for _ in range(99):
        try:
            return sock.get_monitor_socket(events)
        except zmq.error.InterruptedSystemCall:
            continue
    return sock.get_monitor_socket(events)


def process_context() -> zmq.asyncio.Context:
    """This process's asyncio ZeroMQ context (a fresh one in a forked child, never the parent's)."""
    pid = os.getpid()
    ctx = _contexts.get(pid)
    if ctx is None:
        ctx = zmq.asyncio.Context()
        _contexts.clear()  # a parent's context must not be touched in a fork child
        _contexts[pid] = ctx
    return ctx


# Requests sent again (same request id; a ``timeout_s`` in it lowered by the time already spent,
# so a wait does not start over) when the connection to the coordinator comes back after a drop:
# a coordinator that died took those in flight with it, and the agent would otherwise wait out
# the request's whole deadline. Each is idempotent, or made so by the coordinator: a ``kv_cas``
# or ``kv_del`` sent again would find its own first write and answer "not swapped" / "not there"
# (two callers would both believe they lost; delete() returned False for a key it had deleted, a
# tester's find), and a ``kv_set`` would undo the writes and deletes that followed it, so the
# coordinator journals the (routing id, request id) of each that wrote and answers a repeat as
# the first time (``coordinator.state.Job.kv_answers``; past the 1,024 it keeps, "unknown"). A
# ``leave`` sent again finds its rank gone (``left=False``) or its job finished; it was not
# resent, and a leave lost with the daemon left the job crashed, not finished, after 10 s of
# "no answer" (a breaker's find); a ``rewind`` sent again finds the step already moved back
# (``rewound=False``). Not ``join``/``heartbeat``: the agent repeats those itself.
RESEND_ON_RECONNECT = frozenset({"kv_set", "kv_get", "kv_wait", "kv_cas", "kv_del", "commit", "reform",
                                 "finish", "status", "leave", "rewind"})


async def _monitor_events(monitor: zmq.asyncio.Socket):
    """The events of a ZeroMQ socket monitor, parsed, until it is closed or the task cancelled."""
    while True:
        try:
            frames = await monitor.recv_multipart()
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        yield parse_monitor_message(frames)


class ControlClient:
    """An agent's DEALER connection to the coordinator.

    When the TCP connection drops and ZeroMQ connects again (the coordinator restarted, or the
    network blinked), requests of :data:`RESEND_ON_RECONNECT` that were sent over the lost
    connection and are still unanswered are sent again, so they are answered by the coordinator
    now there instead of waiting out their deadline.

    Args:
        address: the coordinator's ZeroMQ address, e.g. ``tcp://127.0.0.1:29600``.
        identity: routing id, unique per process; the coordinator recognises the agent by it after
            a coordinator restart.
        on_push: coroutine called with each pushed message (``epoch``, ``fenced``).
    """

    def __init__(
        self,
        address: str,
        identity: str,
        on_push: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        *,
        limits: Limits = DEFAULT_LIMITS,
    ):
        try:
            check_address(address)
        except ValueError as exc:
            raise ConnectError(f"coordinator address: {exc}") from None
        self.address = address
        self.identity = identity
        self._on_push = on_push
        self._limits = limits
        self._pid = os.getpid()
        self._rid = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        # rid -> [encoded request, connection generation it was last sent in] (resendable only)
        self._resend: dict[int, list] = {}
        self._generation = 0   # connections lost so far
        self._closed = False
        ctx = process_context()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        self._sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        self._sock.setsockopt(zmq.IPV6, 1)   # tcp://[::1]:PORT and IPv6 names; IPv4 works as before
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConnectError(f"cannot connect to {address!r}: {exc}") from exc
        self._monitor = monitor_socket(self._sock, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(), name="control-reader")
        self._watcher = loop.create_task(self._monitor_loop(), name="control-monitor")

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("control channel is closed")
        if os.getpid() != self._pid:
            raise ClosedError("control channel was made in another process (fork); make a new one")

    async def request(self, mtype: str, *, job: str, epoch: int, deadline_s: float,
                      on_cancel: Callable[[int], Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Send a request and wait for its answer.

        Args:
            mtype: a request type of :mod:`transport.wire`.
            deadline_s: seconds to wait for the answer.
            on_cancel: called with the request id when this call is cancelled after the request
                was sent (``kv_wait``: to withdraw it at the coordinator).
            fields: the message's own fields (see :mod:`transport.wire`).

        Returns:
            the ``body`` of the reply.

        Raises:
            RtxTimeoutError: no answer within ``deadline_s``.
            RtxError: (a subclass, by name) the coordinator answered with an error.
            ClosedError: the channel was closed meanwhile.
        """
        self._check()
        rid = next(self._rid)
        msg = wire.make(mtype, rid=rid, job=job, epoch=epoch, **fields)
        data = encode(msg, limits=self._limits)   # before the future: an oversize message leaves none behind
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if mtype in RESEND_ON_RECONNECT:
            self._resend[rid] = [data, self._generation, msg, time.monotonic()]
        try:
            try:
                await self._sock.send(data, copy=True)
            except zmq.ZMQError as exc:
                raise ConnectError(f"send to {self.address} failed: {exc}") from exc
            try:
                # not asyncio.wait_for: on Python 3.11 it returns the answer when the task is
                # cancelled as the answer comes, and the cancellation is lost (an agent's
                # heartbeat loop then ran on after asyncio.run() cancelled it, and the process
                # never exited: a tester's find, 5 of 26 runs)
                async with asyncio.timeout(deadline_s):
                    reply = await fut
            except TimeoutError:
                raise RtxTimeoutError(f"{mtype} to {self.address}: no answer within {deadline_s:g} s") from None
            except asyncio.CancelledError:
                # (the task's cancel cancels the future it awaits: cancelled, not answered)
                if on_cancel is not None and (not fut.done() or fut.cancelled()):
                    on_cancel(rid)
                raise
        finally:
            self._pending.pop(rid, None)
            self._resend.pop(rid, None)
        if reply["t"] == "error":
            raise error_from_wire(reply["error"], reply["message"])
        return reply["body"]

    async def _read_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                if len(frames) != 1:
                    raise ProtocolError(f"expected 1 frame, got {len(frames)}")
                msg = wire.validate(decode(frames[0], limits=self._limits))
            except ProtocolError as exc:
                log.warning("control_message_dropped", error=str(exc))
                continue
            if msg["t"] in ("reply", "error"):
                fut = self._pending.get(msg["rid"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif self._on_push is not None:
                try:
                    await self._on_push(msg)
                except Exception:  # a bad handler must not kill the channel
                    log.exception("push_handler_failed", type=msg["t"])

    async def _monitor_loop(self) -> None:
        async for evt in _monitor_events(self._monitor):
            if evt["event"] == zmq.EVENT_DISCONNECTED:
                self._generation += 1
            elif evt["event"] == zmq.EVENT_CONNECTED:
                # Sent over a connection that is gone: lost with it (sent since: queued by
                # ZeroMQ for this one, so not again).
                again = [e for e in self._resend.values() if e[1] < self._generation]
                for e in again:
                    e[1] = self._generation
                    data, msg, sent_at = e[0], e[2], e[3]
                    if isinstance(msg.get("timeout_s"), float):
                        # the time left of the wait, not all of it again (a store.wait(timeout=4)
                        # across a coordinator restart ended after 8.8 s: a tester's find)
                        left = max(0.0, msg["timeout_s"] - (time.monotonic() - sent_at))
                        data = encode({**msg, "timeout_s": left}, limits=self._limits)
                    try:
                        await self._sock.send(data, copy=True)
                    except zmq.ZMQError:
                        return
                if again:
                    log.info("requests_resent", count=len(again), address=self.address)

    async def aclose(self) -> None:
        """Close the socket (``linger=0``) and fail pending requests with :class:`ClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        self._watcher.cancel()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClosedError("control channel closed"))
        self._pending.clear()
        self._resend.clear()
        if os.getpid() == self._pid:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._sock.close(0)


class Inbound:
    """A request received by the server: ``identity`` and the validated ``msg``."""

    __slots__ = ("identity", "msg")

    def __init__(self, identity: str, msg: dict[str, Any]):
        self.identity = identity
        self.msg = msg


class Disconnected:
    """The connection that carried ``identity``'s messages went away."""

    __slots__ = ("identity",)

    def __init__(self, identity: str):
        self.identity = identity


_HEAD = frozenset({"rid", "job"})


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("send_failed", error=str(fut.exception()))


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


class ControlServer:
    """The coordinator's ROUTER socket plus a disconnect monitor.

    Malformed, oversize, wrong-version or unknown messages are answered with a ``ProtocolError``
    (when the request id can be read) or dropped and logged; the server keeps serving everyone.
    """

    def __init__(self, bind: str, *, limits: Limits = DEFAULT_LIMITS):
        self._limits = limits
        ctx = process_context()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # ZeroMQ drops a connection that sends a bigger frame than this (before reading it: a
        # flood of 60 MB frames, buffered in full at 4x, stalled the loop for seconds); smaller
        # oversize messages get a ProtocolError answer from the codec instead.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * limits.max_message_nbytes)
        # Replies for one client: at most SEND_PIPE_MESSAGES in ZeroMQ's queue (a 17 MiB reply
        # each, at worst); the rest wait in this server's backlog for that client, up to
        # BACKLOG_MAX_NBYTES, sent on as the client reads (see send_raw). A client that never
        # reads held the daemon's memory with whatever it asked for (60-byte kv_gets of a 15 MiB
        # value: 3 GB after 210, a tester's find); a client sending thousands of requests at
        # once gets every answer (with a plain message limit of 1000, 1003 of 3000 were lost).
        self._sock.setsockopt(zmq.SNDHWM, SEND_PIPE_MESSAGES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a full queue says EAGAIN, not drop
        # messages ZeroMQ reads ahead per connection; past them it stops reading that one (TCP
        # holds the rest at the client: nothing is lost)
        self._sock.setsockopt(zmq.RCVHWM, 100)
        # a connection that has not completed ZeroMQ's greeting within this is closed (the
        # default, 30 s, let 1,100 connections that never spoke hold every descriptor at a limit
        # of 1024 for that long: new clients got no answer, a breaker's find)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if "[" in bind:   # an IPv6 address (with it on, an IPv4 bind reports [::ffff:a.b.c.d])
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            check_address(bind)
        except ValueError as exc:
            self._sock.close(0)
            raise ConnectError(f"cannot bind: {exc}") from None
        busy = _ipc_in_use(bind)
        if busy:
            self._sock.close(0)
            raise ConnectError(f"cannot bind {bind!r}: {busy}")
        try:
            if bind.endswith(":0"):
                port = self._sock.bind_to_random_port(bind[: -len(":0")])
                self.address = f"{bind[: -len(':0')]}:{port}"
            else:
                self._sock.bind(bind)
                self.address = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise ConnectError(f"cannot bind {bind!r}: {exc}") from exc
        self._monitor = monitor_socket(self._sock, zmq.EVENT_DISCONNECTED)
        # the same monitor socket, read without waiting (_take_disconnects)
        self._monitor_now = zmq.Socket.shadow(self._monitor.underlying)
        self._fd_owner: dict[int, bytes] = {}
        # routing id -> the descriptor of its newest connection: a disconnect of an older one
        # (a client that reconnected under the same id, ROUTER_HANDOVER) is not its disconnect
        self._ident_fd: dict[bytes, int] = {}
        self._backlog: dict[bytes, collections.deque[bytes]] = {}
        self._backlog_nbytes: dict[bytes, int] = {}
        self._backlog_total = 0   # bytes in every client's backlog (BACKLOG_TOTAL_MAX_NBYTES)
        # the last large reply body encoded, and its bytes: a body sent to many (the status
        # answer the coordinator shares among the requests of one batch that ask it) is encoded once
        self._memo: tuple[Any, bytes] | None = None
        self._drainer: asyncio.Task | None = None
        self._drop_log = LogBudget()
        # What came in and waits for the coordinator, per client (routing id), in order; the
        # clients with something waiting take turns (next_nowait). One FIFO for all made a
        # client's heartbeat wait behind every request a flooding client had sent (a breaker's
        # find: 20 sockets sending status requests for 5 s left the daemon answering nobody for
        # 435 s, 4.3 GB, and a real job beside it died of unanswered heartbeats).
        self._inbox: dict[bytes, collections.deque] = {}
        self._turns: collections.deque[bytes] = collections.deque()
        # clients ``prefer`` names (the coordinator: members of formed jobs) take their turns
        # before the others, and are never dropped for MAX_WAITING_TOTAL: a flood spread over
        # 6,000 connections still made a job's heartbeats wait past their timeout (a
        # re-verifier's find)
        self._turns_first: collections.deque[bytes] = collections.deque()
        self._first_ids: set[bytes] = set()   # the clients whose queue is in _turns_first
        self._waiting_total = 0
        self._first_run = 0     # turns in a row taken by preferred clients
        self.prefer: Callable[[str], bool] | None = None
        self._wakeup: asyncio.Future | None = None
        self._full_log = LogBudget()
        self._bad_log = LogBudget()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_loop(), name="control-server-reader"),
            loop.create_task(self._monitor_loop(), name="control-server-monitor"),
        ]

    async def next(self) -> Inbound | Disconnected:
        """The next request or disconnect notice (see :meth:`next_nowait`)."""
        while True:
            item = self.next_nowait()
            if item is not None:
                return item
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None

    def next_nowait(self) -> Inbound | Disconnected | None:
        """The next request or disconnect notice, None when nothing waits: each client's in the
        order they came, the clients with something waiting taking turns."""
        # members first, but every _FIRST_TURNS-th turn goes to another client: a member sending
        # requests without pause (its own client's bug) cannot hold the others off for ever
        if self._turns_first and (self._first_run < _FIRST_TURNS or not self._turns):
            turns = self._turns_first
            self._first_run += 1
        else:
            turns = self._turns
            self._first_run = 0
        if not turns:
            return None
        ident_b = turns.popleft()
        waiting = self._inbox[ident_b]
        item = waiting.popleft()
        self._waiting_total -= 1
        if waiting:
            turns.append(ident_b)
        else:
            del self._inbox[ident_b]
            self._first_ids.discard(ident_b)
        return item

    def _put(self, ident_b: bytes, item: Inbound | Disconnected) -> None:
        """Queue ``item`` of client ``ident_b``. A request beyond ``MAX_WAITING_REQUESTS`` of one
        client, or beyond ``MAX_WAITING_TOTAL`` of all clients but those ``prefer`` names, is
        dropped, logged within a budget (a disconnect notice never is); its client hears nothing
        and its request times out."""
        waiting = self._inbox.get(ident_b)
        if waiting is None:
            first = self.prefer is not None and self.prefer(item.identity)
        else:
            first = ident_b in self._first_ids
        if isinstance(item, Inbound) and (
                (waiting is not None and len(waiting) >= MAX_WAITING_REQUESTS)
                or (self._waiting_total >= MAX_WAITING_TOTAL and not first)):
            ok, dropped = self._full_log.allow()
            if ok:
                log.warning("request_dropped", identity=_short(repr(ident_b)),
                            waiting=len(waiting or ()), all_waiting=self._waiting_total,
                            why="clients send requests faster than the coordinator serves them",
                            suppressed_before=dropped)
            return
        if waiting is None:
            waiting = self._inbox[ident_b] = collections.deque()
            (self._turns_first if first else self._turns).append(ident_b)
            if first:
                self._first_ids.add(ident_b)
        waiting.append(item)
        self._waiting_total += 1
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def _read_loop(self) -> None:
        read = 0
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            read += 1
            if read % _READS_BEFORE_YIELD == 0:
                # pyzmq's recv of a message already queued returns a finished future, so this
                # loop never gave the loop away while a client kept sending (a breaker's find:
                # 3 s of 3-byte garbage on one socket, no answer to anyone for 12.8 s)
                await asyncio.sleep(0)
            ident_b = frames[0].bytes
            try:
                fd = frames[-1].get(zmq.SRCFD)
                # The descriptor may be a closed connection's, reused (by another client, or by
                # this one coming back under its id): the notice of that close is in the monitor
                # already (libzmq reports it before it closes the descriptor), maybe not yet
                # read. Read it now, before this frame, or it would arrive later and name this
                # sender: under a flood of short connections the daemon declared live ranks lost
                # (6 to 8 of 60), and a wait sent again on a new connection was dropped by the
                # old one's close (testers' finds).
                self._take_disconnects()
                if fd >= 0:
                    self._fd_owner[fd] = ident_b
                    self._ident_fd[ident_b] = fd
            except zmq.ZMQError:
                pass
            # surrogateescape: any routing id (ZeroMQ makes binary ones) maps to a str and back.
            identity = ident_b.decode("utf-8", "surrogateescape")
            self._handle(identity, ident_b, frames[1:])

    def _handle(self, identity: str, ident_b: bytes, frames: list) -> None:
        raw = None
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected 1 frame, got {len(frames)}")
            raw = decode(frames[0].buffer, limits=self._limits)
            msg = wire.validate(raw)
            if msg["t"] not in wire.REQUESTS:
                raise ProtocolError(f"{msg['t']!r} is not a request")
        except ProtocolError as exc:
            head = raw if isinstance(raw, dict) else (peek_fields(frames[0].buffer, _HEAD) if frames else {})
            rid = head.get("rid")
            ok, dropped = self._bad_log.allow()
            if ok:
                log.warning("protocol_error", identity=_short(repr(identity)), error=_short(str(exc)),
                            answered=isinstance(rid, int), suppressed_before=dropped)
            if isinstance(rid, int) and not isinstance(rid, bool) and -(2**63) <= rid < 2**64:
                job = head.get("job") if isinstance(head.get("job"), str) else ""
                self.send_raw(ident_b, wire.make("error", rid=rid, job=job, error="ProtocolError", message=str(exc)))
            return
        self._put(ident_b, Inbound(identity, msg))

    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self._monitor.poll(flags=zmq.POLLIN)
                self._take_disconnects()
            except (zmq.ZMQError, asyncio.CancelledError):
                return

    def _take_disconnects(self) -> None:
        """Turn every disconnect the monitor has reported so far into a notice naming the
        descriptor's owner (none for a connection that never sent a frame)."""
        while True:
            try:
                frames = self._monitor_now.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            evt = parse_monitor_message(frames)
            if evt["event"] == zmq.EVENT_DISCONNECTED:
                fd = evt["value"]
                ident_b = self._fd_owner.pop(fd, None)
                # only the client's newest connection: one that came back under the same id
                # before its old connection's close was seen is still there (its wait, sent
                # again, was dropped by the old close: a tester's find)
                if ident_b is not None and self._ident_fd.get(ident_b) == fd:
                    del self._ident_fd[ident_b]
                    self._drop_backlog(ident_b)
                    self._put(ident_b, Disconnected(ident_b.decode("utf-8", "surrogateescape")))

    def send(self, identity: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the agent with routing id ``identity`` (dropped if it is gone)."""
        self.send_raw(identity.encode("utf-8", "surrogateescape"), msg)

    def send_raw(self, ident_b: bytes, msg: dict[str, Any]) -> None:
        backlog = self._backlog.get(ident_b)
        if backlog is not None and self._backlog_full(ident_b, 1):
            # dropped before it is encoded: a client that sends thousands of requests and reads
            # no answer costs no more than its backlog (a breaker's find: 4,000 status answers
            # of 111 KB encoded for one such client stalled the daemon 24 s)
            self._dropped(ident_b)
            return
        try:
            data = self._encode(msg)
        except RtxError as exc:
            log.error("reply_unencodable", error=str(exc), type=msg.get("t"))
            data = encode(wire.make("error", rid=msg.get("rid", 0), error="ProtocolError", message=str(exc)))
        if backlog is not None:          # keep the order: behind what waits already
            self._hold(ident_b, data)
            self._flush(ident_b)
            return
        outcome = self._send_now(ident_b, data)
        if outcome == "gone" and msg.get("t") in ("reply", "error"):
            self._gone(ident_b)
        elif outcome == "full":
            self._backlog[ident_b] = collections.deque()
            self._backlog_nbytes[ident_b] = 0
            self._hold(ident_b, data)
            if self._drainer is None or self._drainer.done():
                self._drainer = asyncio.get_running_loop().create_task(self._drain(), name="control-server-drain")

    def _gone(self, ident_b: bytes) -> None:
        """An answer found its client's connection gone: report the disconnect, unless the
        monitor has (or the client was never seen on a connection). The monitor misses one whose
        close it read before the client's last frame (a connection that sent a join and closed at
        once: 1 to 3% of such joins left their job forming for the joiner's whole heartbeat
        timeout, up to an hour, and 4,000 of them filled the coordinator's jobs: a breaker's
        find). Its later notice for that descriptor is not taken for this client's."""
        fd = self._ident_fd.pop(ident_b, None)
        if fd is None:
            return
        if self._fd_owner.get(fd) == ident_b:
            del self._fd_owner[fd]
        self._drop_backlog(ident_b)
        self._put(ident_b, Disconnected(ident_b.decode("utf-8", "surrogateescape")))

    def _encode(self, msg: dict[str, Any]) -> bytes:
        """``encode(msg)``; a reply whose body is the same object as the last large one encoded
        (see ``_memo``) reuses its bytes. Small replies (heartbeats, votes) take the plain path."""
        body = msg.get("body")
        head = None
        if msg.get("t") == "reply" and isinstance(body, dict) and next(reversed(msg)) == "body":
            head = {k: v for k, v in msg.items() if k != "body"}
            if self._memo is not None and self._memo[0] is body:
                return encode_with_packed(head, "body", self._memo[1], limits=self._limits)
        data = encode(msg, limits=self._limits)
        if head is not None and len(data) >= _MEMO_MIN_NBYTES:
            # the body is the message's last entry: its bytes end the message's
            prefix = len(encode_with_packed(head, "body", b"", limits=self._limits))
            self._memo = (body, data[prefix:])   # (held: its id is not reused while it is)
        return data

    def _backlog_full(self, ident_b: bytes, nbytes: int) -> bool:
        """Whether ``nbytes`` more do not fit in the client's backlog (or in all backlogs)."""
        held = self._backlog_nbytes[ident_b]
        return (held + nbytes > BACKLOG_MAX_NBYTES or len(self._backlog[ident_b]) >= BACKLOG_MAX_MESSAGES
                or self._backlog_total + nbytes > BACKLOG_TOTAL_MAX_NBYTES)

    def _dropped(self, ident_b: bytes) -> None:
        ok, dropped = self._drop_log.allow()
        if ok:
            log.warning("reply_dropped", identity=_short(repr(ident_b)),
                        queued_nbytes=self._backlog_nbytes[ident_b], all_queued_nbytes=self._backlog_total,
                        why="the client does not read its answers", suppressed_before=dropped)

    def _send_now(self, ident_b: bytes, data: bytes) -> str:
        """Hand one message to ZeroMQ without waiting: "sent", "full" (the client's queue holds
        SEND_PIPE_MESSAGES) or "gone" (no such client: dropped)."""
        try:
            fut = self._sock.send_multipart([ident_b, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            exc_or_none: BaseException | None = exc
        else:
            if not fut.done():           # (a non-blocking send completes at once)
                fut.add_done_callback(_log_send_failure)
                return "sent"
            exc_or_none = fut.exception()
        if exc_or_none is None:
            return "sent"
        if isinstance(exc_or_none, zmq.Again):
            return "full"
        if not (isinstance(exc_or_none, zmq.ZMQError) and exc_or_none.errno == zmq.EHOSTUNREACH):
            log.warning("send_failed", error=str(exc_or_none))
        return "gone"

    def _hold(self, ident_b: bytes, data: bytes) -> None:
        """Queue ``data`` in the client's backlog, or drop it (logged, within a budget) when the
        backlog is full: the client has not read its answers for a while."""
        if self._backlog_full(ident_b, len(data)):
            self._dropped(ident_b)
            return
        self._backlog[ident_b].append(data)
        self._backlog_nbytes[ident_b] += len(data)
        self._backlog_total += len(data)

    def _flush(self, ident_b: bytes) -> bool:
        """Send on what the client's backlog holds, as far as its queue takes; whether any went."""
        q = self._backlog[ident_b]
        moved = False
        while q:
            outcome = self._send_now(ident_b, q[0])
            if outcome == "full":
                return moved
            if outcome == "gone":
                break
            n = len(q.popleft())
            self._backlog_nbytes[ident_b] -= n
            self._backlog_total -= n
            moved = True
        self._drop_backlog(ident_b)
        return moved

    def _drop_backlog(self, ident_b: bytes) -> None:
        self._backlog.pop(ident_b, None)
        self._backlog_total -= self._backlog_nbytes.pop(ident_b, 0)

    async def _drain(self) -> None:
        """While some client's answers wait: try again, every millisecond while they move, backing
        off to every 50 ms while none does (a client that does not read)."""
        pause = 0.001
        while self._backlog:
            await asyncio.sleep(pause)
            moved = False
            for ident_b in list(self._backlog):
                moved = self._flush(ident_b) or moved
            pause = 0.001 if moved else min(2 * pause, 0.05)

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._drainer is not None:
            self._drainer.cancel()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self._sock.close(0)
        path = _ipc_socket_file(self.address)
        if path is not None:
            # ZeroMQ unlinks the socket file in its I/O thread, which a process exiting right
            # after this may not wait for: the file would stay behind
            with contextlib.suppress(OSError):
                os.unlink(path)


def _ipc_socket_file(address: str) -> str | None:
    """The socket file of ``ipc://PATH`` when one exists there; None for any other address, an
    abstract one (``ipc://@NAME``), or no socket file at PATH."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):
        return None
    path = address[len("ipc://"):]
    try:
        return path if stat.S_ISSOCK(os.lstat(path).st_mode) else None
    except OSError:
        return None


def _ipc_in_use(address: str) -> str | None:
    """Why ``ipc://PATH`` cannot be bound: a process listens on PATH (ZeroMQ would replace the
    socket file without an error, leaving that process unreachable). None for any other address,
    and for a stale socket file nobody listens on (the bind replaces it)."""
    path = _ipc_socket_file(address)
    if path is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return None
    return f"a process already listens on {path} (Address already in use)"


SEND_PIPE_MESSAGES = 16                 # replies ZeroMQ queues for one client
# A client's ZeroMQ sends its greeting as soon as TCP connects, from its own I/O thread (no GIL,
# no event loop to wait for): milliseconds, seconds only on a machine swapping hard. 5 s is more
# than twice the default heartbeat timeout (2 s, in which a rank must be heard anyway), and a
# client cut off mid-handshake loses nothing: its ZeroMQ reconnects by itself (RECONNECT_IVL).
HANDSHAKE_IVL_MS = 5000
MAX_WAITING_REQUESTS = 10_000           # requests of one client waiting for the coordinator
MAX_WAITING_TOTAL = 200_000             # and of all clients together (but members of jobs)
_FIRST_TURNS = 8                        # turns of preferred clients before one of another
_READS_BEFORE_YIELD = 64                # messages the reader takes before it lets others run
BACKLOG_MAX_NBYTES = 64 * 1024 * 1024   # and this server holds for it beyond those
BACKLOG_MAX_MESSAGES = 100_000
# and for all clients together: 16 clients that never read held 6.6 GB (a breaker's find)
BACKLOG_TOTAL_MAX_NBYTES = 256 * 1024 * 1024
_MEMO_MIN_NBYTES = 16 * 1024            # reply bodies kept encoded for a repeat (ControlServer._memo)

NOTHING_LISTENS = "nothing is listening"   # how nobody_there's answer for a refused connect begins
NOT_ZEROMQ = "it does not speak ZeroMQ"     # in its answer when the listener greets as no coordinator does
# A ZeroMQ peer's greeting begins with this signature: 0xFF, 8 bytes of padding, 0x7F (ZMTP 3.x,
# rfc.zeromq.org/spec/23, "Greeting"; libzmq sends it as soon as a connection is accepted).
_ZMTP_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"


def _not_zeromq(s: socket.socket, where: str) -> str | None:
    """Why the listener on the connected socket ``s`` is no ZeroMQ peer, when it shows it within
    1 s: its first bytes are not ZeroMQ's signature (an HTTP server's answer, an SSH banner), or
    it closes the connection without sending that signature (libzmq sends it as soon as it
    accepts, before it reads anything). Sent to provoke a line-based server: ZeroMQ's signature
    and an empty line. None when the signature comes, or nothing comes (a coordinator that is
    stopped or starved is silent too)."""
    s.settimeout(1.0)
    got, closed = b"", False
    try:
        s.sendall(_ZMTP_SIGNATURE + b"\r\n\r\n")
        while len(got) < len(_ZMTP_SIGNATURE):
            chunk = s.recv(len(_ZMTP_SIGNATURE) - len(got))
            if not chunk:
                closed = True
                break
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    except OSError:    # (the timeout included)
        pass
    if got[:1] == b"\xff" and got[9:10] in (b"", b"\x7f"):
        return None
    if got:
        answer = f"it answered {got!r}"
    elif closed:
        answer = "it closed the connection without a word"
    else:
        return None
    return (f"something listens {where} but {NOT_ZEROMQ} ({answer}; a coordinator greets with "
            f"ZeroMQ's signature): is that the coordinator's address?")


def nobody_there(address: str) -> str | None:
    """Why ``tcp://HOST:PORT`` or ``ipc://PATH`` did not answer, when a plain connect can tell:
    nothing listens there (refused, or no socket file at PATH), the host cannot be reached, or
    what listens answers as no ZeroMQ peer does (an answer that holds :data:`NOT_ZEROMQ`; that
    check takes up to 1 s more). None when something accepts connections and is silent or
    greets as ZeroMQ does (a coordinator that is busy or stopped), and for an abstract
    ``ipc://@NAME``."""
    from urllib.parse import urlsplit

    if address.startswith("ipc://") and not address.startswith("ipc://@"):
        # (it waited out the whole timeout without a word: a tester's find)
        path = address[len("ipc://"):]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            try:
                s.connect(path)
                return _not_zeromq(s, f"at {path}")
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if isinstance(exc, FileNotFoundError):
                    what = "no socket file"
                elif os.path.isdir(path):    # (it said "a stale socket file": a breaker's find)
                    what = "a directory, not a socket file"
                elif not _ipc_socket_file(address):
                    what = "a file that is not a socket"
                else:
                    what = "a stale socket file"
                return f"{NOTHING_LISTENS} at {path} ({what}): is the coordinator running there?"
            except OSError as exc:
                return f"{path} cannot be reached: {exc.strerror or exc}"

    try:
        u = urlsplit(address)
        host, port = u.hostname, u.port
    except ValueError:
        return None
    if u.scheme != "tcp" or host is None or port is None:
        return None
    try:
        with socket.create_connection((host, port), timeout=2.0) as s:
            return _not_zeromq(s, f"on {host} port {port}")
    except ConnectionRefusedError:
        return f"{NOTHING_LISTENS} on {host} port {port}: is the coordinator running there?"
    except OSError as exc:
        return f"{host} port {port} cannot be reached: {exc.strerror or exc}"
