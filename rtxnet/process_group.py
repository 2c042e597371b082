"""What a training script holds: the process group of its job, async and blocking.

``pg = await rtxnet.connect(...)`` (or ``async with rtxnet.connect(...) as pg``) gives the async
:class:`ProcessGroup`; ``pg = rtxnet.init(...)`` gives :class:`BlockingProcessGroup`, the same
object driven from a background event loop, with ``async_op=True`` returning a :class:`Work`.

Arguments not given are read from the environment the launcher sets:

    RTXNET_COORDINATOR   coordinator address            (required)
    RTXNET_JOB           job id                         (default "default")
    RTXNET_TOKEN         job token                      (default "")
    RTXNET_RANK          requested rank                 (default: any free rank)
    RTXNET_WORLD_SIZE    sets min_ranks = max_ranks
    RTXNET_MIN_RANKS / RTXNET_MAX_RANKS / RTXNET_LAST_CALL
    RTXNET_BIND_HOST     IPv4 address for this rank's data socket (default 127.0.0.1)
    RTXNET_SHM           0 (or false, no, off) disables shared memory between ranks on one host
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import structlog

from transport import wire
from transport.errors import (
    ConfigError,
    PeerLostError,
    RendezvousTimeout,
    RtxTimeoutError,
)
from transport.logconfig import env_flag

from . import _calls as calls
from . import errorfile
from .agent import Agent, Membership
from .config import Timeouts, env_float, env_int, ipv6_bind_error, is_seconds, timeout_seconds
from .portal import Portal, Work, loop_refusal, wait_for

__all__ = ["ProcessGroup", "BlockingProcessGroup", "Store", "connect", "init"]

log = structlog.get_logger(__name__)

# Names served by the collective engine's world group.
_COLLECTIVES = frozenset({
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
    "all_to_all", "barrier", "send", "recv", "new_group", "split",
})


_COUNTED = _COLLECTIVES - {"new_group", "split", "send", "recv"}
# the blocking calls that one thread at a time may make on a group (send/recv are matched by
# peer and tag, not by their order)
_ONE_THREAD = _COLLECTIVES - {"send", "recv"}


class _OneThreadAtATime:
    """Refuses blocking collectives of one group called from two threads at once.

    Collectives are matched across ranks in the order they reach the group; threads reach it in
    an order that differs between ranks, and same-kind, same-shape calls were then matched with
    another thread's data on the peer: silently wrong results that differed between ranks (a
    breaker's find: 8 threads each all-reducing ``full(1000, i)``, 1 of 30 rounds wrong). A call
    made while another thread is in a collective of the same group raises ``ConfigError`` before
    it is sent, and the call it overlapped raises it too once its operation has ended (its
    result cannot be trusted). Calls that never overlap are not seen: threads that take turns
    must do so in the same order on every rank. Groups are told apart (a subgroup per thread
    is fine); ``async_op=True`` calls count while they are being issued.

    Once an overlap was seen, the group refuses every collective until it is re-formed (its
    epoch changes: ``pg.reform()``, or FaultTolerance's recovery): the refused call was not sent
    here but its peers' may have been, so the ranks' calls are out of step, and later
    same-shaped calls were matched with other calls' data (a re-verifier's find: threads that
    went on after a refusal got wrong sums in 10 of 21 runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside: dict[int, dict[int, list]] = {}   # id(group) -> thread id -> [calls, overlapped by]
        # id(group) -> (the group, its epoch when an overlap was seen, the threads)
        self._out_of_step: dict[int, tuple[Any, Any, list[str]]] = {}

    @contextlib.contextmanager
    def call(self, group: Any, name: str) -> Iterator[None]:
        me, who = threading.get_ident(), threading.current_thread().name
        epoch = getattr(group, "epoch", None)
        with self._lock:
            seen = self._out_of_step.get(id(group))
            if seen is not None and (seen[0] is not group or seen[1] != epoch):
                del self._out_of_step[id(group)]     # re-formed since (or another group)
            elif seen is not None:
                raise ConfigError(
                    f"{name}: this group's collectives were called from threads {seen[2]} at once "
                    f"in epoch {epoch}, so the ranks' calls may be out of step (a call refused here "
                    f"may have been sent by a peer): the group refuses collectives until it is "
                    f"re-formed (pg.reform(); FaultTolerance's recovery does it)")
            inside = self._inside.setdefault(id(group), {})
            others = {t: e for t, e in inside.items() if t != me}
            if others:
                for e in others.values():
                    e[1] = e[1] or who
                names = sorted({e[2] for e in others.values()})
                self._out_of_step[id(group)] = (group, epoch, sorted({*names, who}))
                raise ConfigError(
                    f"{name}: called from thread {who!r} while thread(s) {names} are in a "
                    f"collective of the same group: collectives are matched across ranks in the "
                    f"order they reach the group, and threads reach it in an order that differs "
                    f"between ranks (same-shaped calls would be matched with another thread's data "
                    f"on the peer: wrong results). Call a group's collectives from one thread, or "
                    f"give each thread a group of its own (pg.new_group)")
            entry = inside.setdefault(me, [0, None, who])
            entry[0] += 1
        try:
            yield
        finally:
            with self._lock:
                entry[0] -= 1
                overlapped = entry[1]
                if entry[0] == 0:
                    del inside[me]
                    if not inside:
                        self._inside.pop(id(group), None)
        if overlapped is not None:
            raise ConfigError(
                f"{name}: thread {overlapped!r} called a collective of the same group while this "
                f"one (thread {who!r}) was in it: the ranks may have matched the two calls with "
                f"each other's data, so this result is not to be trusted. Call a group's "
                f"collectives from one thread, or give each thread a group of its own (pg.new_group)")


_ONE_THREAD_AT_A_TIME = _OneThreadAtATime()


def _with_fault_point(pg: ProcessGroup, fn: Any) -> Any:
    """``fn`` preceded by the ``at=collective`` fault point (only when a fault plan is set)."""
    from . import faults

    def call(*args: Any, **kwargs: Any) -> Any:
        res = fn(*args, **kwargs)

        async def run() -> Any:
            try:
                await faults.apoint("collective", pg=pg)
            except BaseException:
                calls.forget(res)   # cancelled at the fault point: the call never ran
                raise
            return await res
        return calls.around(res, run())

    call.__name__ = getattr(fn, "__name__", "collective")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call


def _utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8, the store's encoding on the wire.

    Raises:
        ConfigError: ``text`` holds a lone surrogate (``"\\udc80"``, from ``os.fsdecode`` of
            bytes that are not UTF-8), which UTF-8 cannot encode; names where.
    """
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(f"store {what} {text[:60]!r} is not valid UTF-8 ({exc.reason} at index "
                          f"{exc.start}): store keys and str values travel as UTF-8; pass bytes "
                          f"for a value") from None


def _loop_checked(pg: Any, name: str, target: Any) -> Any:
    """``target`` whose coroutine, when it runs, first checks the loop it runs in
    (``pg._check_loop``): the look-up's own check passes outside any loop, as in
    ``asyncio.run(pg.all_reduce(x))`` after ``connect()``'s loop ended, where the collective then
    waited out its deadline and named a live peer (a breaker's find)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        res = target(*args, **kwargs)
        if not asyncio.iscoroutine(res):
            return res   # new_group: no communication, no loop

        async def checked() -> Any:
            try:
                pg._check_loop(name)
            except BaseException:
                res.close()
                raise
            return await res
        return calls.around(res, checked())
    return call


class Store:
    """The job's key-value store on the coordinator (journaled; survives coordinator restarts).

    Values are ``bytes``; ``str`` is encoded as UTF-8. Every call has a deadline
    (``Timeouts.request_s``, or ``timeout`` for :meth:`wait`). Every method raises
    ``ConfigError`` for a key (or ``str`` value) that UTF-8 cannot encode (a lone surrogate),
    naming it.
    """

    def __init__(self, agent: Agent, check_loop: Any = None):
        self._agent = agent
        # the group's check of the calling loop (the store's requests from another loop got
        # "no answer within 10 s" with the coordinator up: a breaker's find)
        self._check = check_loop or (lambda name: None)

    @staticmethod
    def _k(key: str) -> str:
        if not isinstance(key, str):   # what would reach the wire as a key of another type
            raise TypeError(f"store keys are str, got {type(key).__name__} ({key!r:.60})")
        nkey = len(_utf8(key, "key"))
        if nkey > wire.MAX_KEY_NBYTES:
            # (a tester's find: a 2 MiB key failed the coordinator's decode, a ProtocolError)
            raise ConfigError(f"store key {key[:40]!r}... is {nkey} bytes of UTF-8, more than the "
                              f"{wire.MAX_KEY_NBYTES} a key may have")
        return key

    @staticmethod
    def _b(value: bytes | str, key: str = "", what: str = "value") -> bytes:
        if isinstance(value, str):
            value = _utf8(value, f"{what} of key {key[:100]!r}")
        elif isinstance(value, bytes | bytearray | memoryview):
            value = bytes(value)
        else:
            raise TypeError(f"store values are bytes or str, got {type(value).__name__}")
        nkey = len(key.encode())
        if nkey + len(value) > wire.MAX_JOB_KV_NBYTES:
            # one item above the bound: refused here, before a message that size is built
            raise ConfigError(
                f"store: key {key[:100]!r} with {'a' if what == 'value' else 'an'} {what} of {len(value)} bytes is "
                f"{nkey + len(value)} bytes with the key, more than the "
                f"{wire.MAX_JOB_KV_NBYTES} bytes a job's store may hold (it is for coordination data; "
                f"move tensors with the collectives, files with checkpoints)")
        return value

    async def set(self, key: str, value: bytes | str) -> None:
        """Set ``key`` to ``value``.

        Raises:
            ConfigError: the job's store would hold more than 16 MiB (this item alone, or with
                what it holds), or the coordinator's more than 48 MiB; the key is empty or more
                than 1 MiB of UTF-8; the key or a str value is not valid UTF-8.
            RtxTimeoutError: no answer within the request deadline. One in flight when the
                coordinator dies is sent again when it is back; a repeat of one that was written
                writes nothing again (journaled with the write), so it cannot undo what others
                wrote or deleted since; resent after the job's store answered more than 1,024
                writes since, whether it took effect is unknown, and this error says so.
            TypeError: ``key`` is not a str, ``value`` not bytes or str.
        """
        self._check("store.set")
        await self._agent.kv_set(self._k(key), self._b(value, key))

    async def get(self, key: str) -> bytes | None:
        """The value, or None when the key is absent.

        Raises:
            TypeError: ``key`` is not a str.
        """
        self._check("store.get")
        return await self._agent.kv_get(self._k(key))

    async def wait(self, keys: list[str] | str, timeout: float | None = None) -> dict[str, bytes]:
        """Wait until every key exists; returns their values. Cancelled (``asyncio.wait_for``,
        Ctrl-C in the blocking store), the wait is withdrawn at the coordinator.

        Raises:
            RtxTimeoutError: some key is still missing after ``timeout`` seconds (names them).
            ConfigError: ``timeout`` is not a finite number of seconds > 0 (names it); more than
                2**20 keys; the job has 4,096 waits open, or 2**20 keys waited on, already.
            TypeError: a key is not a str.
        """
        self._check("store.wait")
        if timeout is not None and not is_seconds(timeout):
            raise ConfigError(f"store.wait: timeout must be a finite number of seconds > 0, got {timeout!r}")
        # (bytes would be taken as a sequence of ints: "got int (100)" for b"d", a tester's find)
        keys = [self._k(keys)] if isinstance(keys, str | bytes | bytearray) else [self._k(k) for k in keys]
        if len(keys) > wire.MAX_WAIT_KEYS:   # (the wire's list limit: a ProtocolError before)
            raise ConfigError(f"store.wait of {len(keys)} keys: at most {wire.MAX_WAIT_KEYS} keys wait at once")
        return await self._agent.kv_wait(keys, float(timeout) if timeout is not None else self._agent.timeouts.op_s)

    async def compare_set(self, key: str, expected: bytes | str | None, value: bytes | str) -> tuple[bool, bytes | None]:
        """Set ``key`` to ``value`` only if it currently equals ``expected`` (None: absent).

        Returns:
            ``(swapped, current_value)``.

        Raises:
            RtxTimeoutError: no answer within the request deadline. One in flight when the
                coordinator dies is sent again when it is back; the coordinator journals the
                request's id with the write, so a repeat of one that swapped gets
                ``(True, value)`` again (not a lost race against its own write); resent after
                the job's store answered more than 1,024 writes, whether it swapped is unknown,
                and this error says so (it is never applied twice).
            TypeError: ``key`` is not a str, ``expected`` or ``value`` not bytes or str.
        """
        self._check("store.compare_set")
        key = self._k(key)
        return await self._agent.kv_cas(key, None if expected is None else self._b(expected, key, "expected value"),
                                        self._b(value, key))

    async def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed.

        Raises:
            RtxTimeoutError: no answer within the request deadline. One in flight when the
                coordinator dies is sent again when it is back, and a repeat of one that
                removed the key answers True again (journaled with the delete); resent after
                the job's store answered more than 1,024 writes, whether it removed the key is
                unknown, and this error says so.
            TypeError: ``key`` is not a str.
        """
        self._check("store.delete")
        return await self._agent.kv_del(self._k(key))

    def epoch_key(self, key: str) -> str:
        """``key`` scoped to the current epoch (``epoch/<n>/<key>``)."""
        return f"epoch/{self._agent.epoch}/{key}"


class ProcessGroup:
    """The world of one job, as seen by one rank (async API).

    Attributes:
        rank: this process's rank in the current epoch.
        world_size: ranks in the current epoch.
        epoch: the current epoch; increases at every membership change.
        store: the job's key-value store.
    """

    def __init__(self, agent: Agent, engine: Any, timeouts: Timeouts):
        self._agent = agent
        self._engine = engine
        self.timeouts = timeouts
        self.store = Store(agent, self._check_loop)
        if engine is not None:
            engine.kv = self.store   # NCCL unique ids travel through the journaled store
        # While a FaultTolerance step runs, collectives go to the world group of the epoch the step
        # began in; after a membership change that group is retired and raises, so a step never
        # mixes two worlds.
        self._pinned_world: Any = None
        self._pins: list[list[Any]] = []   # open pinned() blocks, in the order they began
        self._pins_lock = threading.Lock()

    @property
    def membership(self) -> Membership:
        m = self._agent.membership
        if m is None:
            raise ConfigError("the process group has not joined a world yet")
        return m

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    @property
    def job(self) -> str:
        return self._agent.job

    @property
    def agent(self) -> Agent:
        return self._agent

    @property
    def engine(self) -> Any:
        return self._engine

    def _check_loop(self, name: str) -> None:
        """Refuse a call from another event loop than the one ``connect()`` ran in: the group's
        sockets and tasks live there (from a second ``asyncio.run`` a collective hung or went
        out of step with its peers: a tester's find).

        Raises:
            ClosedError: that loop has ended (its ``asyncio.run`` returned, ending the group's
                heartbeats and reads).
            ConfigError: it still runs (in another thread), or is open but not running.
        """
        wrong = loop_refusal(name, _OPEN_ASYNC.get(self))
        if wrong is not None:
            raise wrong

    def __getattr__(self, name: str) -> Any:
        if name in _COLLECTIVES:
            return self._collective(name)
        raise AttributeError(name)

    def _collective(self, name: str, *, check_loop: bool = True) -> Any:
        """The collective ``name`` of the world in use (pinned, else current), refused when this
        rank is fenced or the world is below ``min_ranks``; ``check_loop``: refused from another
        event loop than the group's (the blocking facade, which runs it on the group's own loop
        whatever loop calls, passes False)."""
        if check_loop:
            self._check_loop(name)
        engine = self.__dict__.get("_engine")
        if self._agent.fenced:
            why = getattr(self._agent, "fence_reason", "") or "declared lost"
            raise PeerLostError(f"{name}: this rank was fenced out of epoch {self._agent.epoch} "
                                f"({why}); call pg.rejoin() before any other collective "
                                f"(FaultTolerance does it by itself)")
        if engine is None or engine.world is None:
            raise ConfigError(f"{name}: the collective engine is not available in this process")
        pinned = self.__dict__.get("_pinned_world")
        if pinned is None and not self._agent._closed:   # closed: the call says so
            self._check_min_ranks(name)
        target = getattr(pinned or engine.world, name)
        if name in _COUNTED and os.environ.get("RTXNET_FAULTS"):
            target = _with_fault_point(self, target)
        if check_loop:
            return _loop_checked(self, name, target)
        return target

    def _check_min_ranks(self, name: str) -> None:
        """Refuse a collective in a world that shrank below ``min_ranks``: the job's own bound
        for the smallest world it may run in (a sum over 2 of 4 ranks is not the sum the script
        asked for). Above ``min_ranks`` a smaller world is allowed by the job, as torchrun's
        elastic bounds allow it."""
        m, lo = self._agent.membership, self._agent.min_ranks
        if m is not None and m.world_size < lo:
            gone = (f"ranks {list(m.lost)} of the epoch before were lost or left" if m.lost else
                    "ranks were lost or left in an earlier epoch")
            if self._agent.training_finished:
                what = ("training was declared over (FaultTolerance.finish) and the job admits no "
                        "replacement: what follows training runs below min_ranks only without "
                        "collectives; start the job with --min-ranks below its world size for "
                        "collectives after such a loss")
            else:
                what = ("rtxnet.FaultTolerance waits for replacements and restores their state; "
                        "without it, end this process and let rtxnet-run --max-restarts start it "
                        "again")
            raise PeerLostError(
                f"{name}: the world of epoch {m.epoch} has {m.world_size} rank(s), fewer than "
                f"min_ranks({lo}) ({gone}); no collective runs below min_ranks. {what}",
                ranks=m.lost, epoch=m.epoch)

    def current_world(self) -> Any:
        """The world group collectives go to now: the pinned one (see :meth:`pinned`), else the
        current epoch's; ``None`` without a collective engine. Its ``epoch`` never changes:
        after a membership change its collectives raise ``PeerLostError`` (``ClosedError`` when
        nobody was lost) instead of running in the new world.

        Raises:
            PeerLostError: not pinned, and the world shrank below ``min_ranks`` (names the lost
                ranks); the collectives themselves raise the same."""
        if self._pinned_world is not None:
            return self._pinned_world
        if self._engine is None:
            return None
        self._check_min_ranks("collectives")
        return self._engine.world

    async def _until_world_entered(self) -> None:
        """Wait until the engine has entered the membership's epoch, so that
        :meth:`current_world` is that epoch's group: the agent sets the membership first and the
        engine enters its view after (at once from the event loop's thread; a thread of the
        blocking facade can read the new membership before that), and a view of ranks that left
        in order is held while operations in flight finish (``set_view``'s grace)."""
        if self._engine is not None:
            await self._engine.until_entered()

    @contextlib.contextmanager
    def pinned(self, world: Any = None) -> Iterator[Any]:
        """Send the collectives called in this block to ``world`` (from :meth:`current_world`;
        default: the current one).

        A step made of several collectives called at different times (DDP's buckets, FSDP's
        gathers) pins the world group it began in: checking ``epoch`` and then calling a
        collective is not atomic (the epoch may move between the two, and the collective would
        then run in the new world on this rank alone). Yields ``world``. The pin holds for the
        whole process group (every thread) until the block ends; blocks nest, and blocks of
        concurrent tasks may end in any order: when the last open one ends, the pin in force
        before the first is back (ending in the order they began left the second block's view of
        the first one's pin in force for good: a breaker's find).

        Raises:
            Nothing itself; collectives called in the block raise ``PeerLostError`` (naming the
            lost ranks; ``ClosedError`` when nobody was lost) once the membership changed.
        """
        if world is None:
            world = self.current_world()
        # [the pin to restore, this block's world]: a block that ends under a later one hands
        # its pin to restore to that one, which ends after it
        with self._pins_lock:   # (threads too: the list is one for the process group)
            mine = [self._pinned_world, world]
            self._pins.append(mine)
            self._pinned_world = world
        try:
            yield world
        finally:
            with self._pins_lock:
                at = next(i for i, p in enumerate(self._pins) if p is mine)
                del self._pins[at]
                if at == len(self._pins):
                    self._pinned_world = mine[0]
                else:
                    self._pins[at][0] = mine[0]

    async def commit(self, step: int, metadata: dict | None = None, *, ok: bool = True,
                     timeout: float | None = None, epoch: int | None = None) -> bool:
        """Vote that ``step`` succeeded (``ok``) on this rank; returns whether the step committed.

        The step counts only when every member of the epoch voted success; the coordinator
        journals it before answering. False when a member voted failure or the epoch changed.
        ``epoch``: the epoch the step ran in (``pg.epoch`` when it began); default the current
        one. Give it: a vote cast after the membership changed mid-step would otherwise be cast
        in the new epoch, whose members never vote on that step, and wait out ``timeout`` (a
        fresh user's find: FaultTolerance's training stood 60 s); for a left epoch it is False
        at once.

        Raises:
            ConfigError: ``step`` is not an int in 0..2**63-1 (a bool is refused), ``ok`` not a bool,
                ``metadata`` not a dict of what JSON holds (string keys, finite numbers, no
                bytes or sets), nested at most 8 levels, at most 64 KiB encoded; names the value.
            RtxTimeoutError: not every member voted within ``timeout`` seconds (default op timeout).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < 2**63:
            raise ConfigError(f"commit: step({step!r}) must be an int in 0..2**63-1")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0):
            raise ConfigError(f"commit: epoch({epoch!r}) must be None or an int >= 0")
        if not isinstance(ok, (bool, np.bool_)):
            raise ConfigError(f"commit: ok({ok!r}) must be a bool")
        if metadata is not None and not isinstance(metadata, dict):
            raise ConfigError(f"commit: metadata({metadata!r:.80}) must be a dict")
        # (a set, a tuple key or 2**64 was a ProtocolError of the encoder naming nothing)
        if metadata is not None and (bad := wire.json_like_problem(metadata, "commit.metadata")):
            raise ConfigError(bad)
        self._check_loop("commit")
        body = await self._agent.commit(step, ok=ok, metadata=metadata,
                                        timeout_s=timeout if timeout is not None else self.timeouts.op_s,
                                        epoch=None if epoch is None else int(epoch))
        return bool(body["committed"])

    async def rejoin(self) -> Membership:
        """Join the job again after this rank was declared lost (frozen past the heartbeat
        timeout, or cut off): its collectives raise ``PeerLostError`` saying so until then.
        :class:`FaultTolerance` does this by itself; code without it calls this, then takes the
        state of a live rank (the others went on without this one).

        Returns:
            The new membership (its rank may differ; the epoch is a new one).

        Raises:
            ConfigError: this rank was not declared lost (nothing to rejoin).
            JobFinishedError: the job finished meanwhile (every other rank left).
            RendezvousError: the coordinator refused the join (e.g. heartbeats stopped for good by
                fault injection), naming why.
            RendezvousTimeout: the job did not take it in within ``Timeouts.rendezvous_s``.
        """
        self._check_loop("rejoin")
        if not self._agent.fenced:
            raise ConfigError(f"rejoin: this rank was not declared lost (it is rank {self.rank} of "
                              f"epoch {self.epoch}); nothing to rejoin")
        return await self._agent.join()

    async def reform(self, reason: str = "reform requested", *, epoch: int | None = None,
                     timeout: float | None = None) -> int:
        """Open a new epoch with the same members and wait for it; returns the new epoch.

        After a ``CollectiveTimeout`` or ``CollectiveMismatchError`` that lost nobody, ranks may
        disagree on how many operations ran (one completed what another gave up on), and every
        later collective of the group would fail with ``CollectiveMismatchError``. A new epoch
        starts every group afresh: call this on the ranks that saw the error (a call finding
        that another rank already reformed just waits for that epoch); ranks that did not
        see it get the new epoch pushed. :class:`rtxnet.FaultTolerance` does this by itself.
        Operations in flight on any rank fail with ``ClosedError``.

        Args:
            reason: a str, logged by the coordinator (first 500 characters).
            epoch: the epoch the failure happened in: the error's ``epoch`` attribute
                (``CollectiveTimeout.epoch``, ``CollectiveError.epoch``, ``ClosedError.epoch``
                when a new epoch failed the call). Only a request naming
                the job's current epoch opens a new one, so a rank that calls this after another
                rank's reform already reached it opens no second epoch. Default: this rank's
                current epoch (right when no other rank may have reformed meanwhile).
            timeout: seconds to wait for the new epoch, finite and > 0; default the request
                deadline.

        Raises:
            ValueError: ``epoch`` is not an int in ``0..pg.epoch``, ``timeout`` is not a finite
                number of seconds > 0, or ``reason`` is not a str (names the argument and the
                value). Checked before anything is sent: no epoch is opened.
            RtxTimeoutError: the new epoch did not arrive within ``timeout`` seconds (default:
                the request deadline).
            RendezvousError: this rank is no longer a member (it was declared lost).
        """
        self._check_loop("reform")
        # every argument before the request: a bad timeout, checked after it, raised once the new
        # epoch was open (a tester's find), and a reason that is not a str a bare TypeError
        if not isinstance(reason, str):
            raise ValueError(f"reform: reason must be a str, got {reason!r} ({type(reason).__name__})")
        timeout_s = timeout_seconds(timeout, self.timeouts.request_s, "reform")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)
                                  or not 0 <= epoch <= self.epoch):
            raise ValueError(f"reform: epoch must be an epoch this rank was in, 0..{self.epoch}, "
                             f"got {epoch!r}")
        before = self.epoch if epoch is None else epoch
        epoch = await self._agent.reform(reason, before)
        m = await self._agent.wait_epoch(max(before, epoch - 1), timeout_s=timeout_s)
        return m.epoch

    async def status(self) -> list[dict[str, Any]]:
        """Every job on the coordinator, as ``rtxnet status`` shows them."""
        self._check_loop("status")
        return await self._agent.status()

    async def aclose(self) -> None:
        """Leave the job in order and release sockets and shared memory. Made in an event loop
        that has ended, the group cannot leave in order any more (its heartbeats ended with that
        loop): then this releases its sockets and shared memory without leaving, and the
        coordinator declares the rank lost, as if it had been killed. (Left open, such a group's
        sockets made a garbage collection wait for ever in ``zmq_ctx_term``.)

        Raises:
            ConfigError: called from another live event loop than the group's (another thread's).
        """
        made_in = _OPEN_ASYNC.get(self)
        if made_in is not None and made_in.is_closed():
            _OPEN_ASYNC.pop(self, None)
            log.warning("group_closed_after_its_loop", job=self.job, rank=self.rank,
                        how="released without leaving: its event loop has ended")
            try:
                await self._agent.aclose(leave=False)
            finally:
                if self._engine is not None:
                    await self._engine.aclose()
            return
        self._check_loop("aclose")
        _OPEN_ASYNC.pop(self, None)
        await self._agent.aclose()
        if self._engine is not None:
            await self._engine.aclose()

    close = aclose

    async def __aenter__(self) -> ProcessGroup:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


def _settings(coordinator, job, token, rank, world_size, min_ranks, max_ranks, last_call_s) -> dict[str, Any]:
    for name, v in (("rank", rank), ("world_size", world_size), ("min_ranks", min_ranks),
                    ("max_ranks", max_ranks)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    for name, v in (("coordinator", coordinator), ("job", job), ("token", token)):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{name} must be a str, got {v!r} ({type(v).__name__})")
    if job is not None and not job.strip():
        raise ConfigError(f"job must not be empty, got {job!r}")
    if last_call_s is not None and (isinstance(last_call_s, bool) or not isinstance(last_call_s, (int, float))):
        raise ConfigError(f"last_call_s must be a number of seconds, got {last_call_s!r} ({type(last_call_s).__name__})")
    coordinator = coordinator or os.environ.get("RTXNET_COORDINATOR")
    if not coordinator:
        raise ConfigError("no coordinator address: pass coordinator= or set RTXNET_COORDINATOR (rtxnet-run sets it)")
    job = job or os.environ.get("RTXNET_JOB") or "default"
    token = token if token is not None else os.environ.get("RTXNET_TOKEN", "")
    rank_src = "rank"
    if rank is None:
        rank, rank_src = env_int("RTXNET_RANK", None), "RTXNET_RANK"
    replacement = os.environ.get("RTXNET_REJOIN") == "1"
    if replacement and rank == env_int("RTXNET_RANK", None):
        rank = None  # a restarted rank takes whatever rank is free in the re-formed world
    # where each size came from, so a bad one is named as the user wrote it
    src = {"world_size": "world_size", "min_ranks": "min_ranks", "max_ranks": "max_ranks"}
    if world_size is None and os.environ.get("RTXNET_WORLD_SIZE"):
        src["world_size"] = "RTXNET_WORLD_SIZE"
    world_size = world_size if world_size is not None else env_int("RTXNET_WORLD_SIZE", None)
    if min_ranks is None:
        src["min_ranks"] = "RTXNET_MIN_RANKS" if os.environ.get("RTXNET_MIN_RANKS") else src["world_size"]
        min_ranks = env_int("RTXNET_MIN_RANKS", world_size)
    if max_ranks is None:
        src["max_ranks"] = ("RTXNET_MAX_RANKS" if os.environ.get("RTXNET_MAX_RANKS")
                            else src["world_size"] if world_size else src["min_ranks"])
        max_ranks = env_int("RTXNET_MAX_RANKS", world_size or min_ranks)
    if min_ranks is None or max_ranks is None:
        raise ConfigError("world size unknown: pass world_size= (or min_ranks=/max_ranks=) or set RTXNET_WORLD_SIZE")
    if min_ranks < 1:
        raise ConfigError(f"{src['min_ranks']}={min_ranks}: a world needs at least 1 rank")
    if min_ranks > max_ranks:
        raise ConfigError(f"need min_ranks <= max_ranks, got {src['min_ranks']}={min_ranks} and "
                          f"{src['max_ranks']}={max_ranks}")
    if rank is not None and not (0 <= rank < max_ranks):
        raise ConfigError(f"{rank_src}={rank} must be in 0..{max_ranks - 1} ({src['max_ranks']}={max_ranks})")
    last_call_src = "last_call_s"
    if last_call_s is None:
        last_call_s = env_float("RTXNET_LAST_CALL", 0.0 if min_ranks == max_ranks else 1.0)
        last_call_src = "RTXNET_LAST_CALL"
    if not 0 <= last_call_s <= 3600:   # the coordinator's bound; NaN fails too
        raise ConfigError(f"{last_call_src}={last_call_s!r} must be a number of seconds in [0, 3600]")
    return dict(coordinator=coordinator, job=job, token=token, rank=rank, min_ranks=min_ranks,
                max_ranks=max_ranks, last_call_s=last_call_s, replacement=replacement)


async def _make_engine(timeouts: Timeouts, bind_host: str | None, key: str | None = None) -> Any:
    try:
        from .collectives import Engine
    except ImportError:  # the data plane is optional for control-only use
        return None
    host = bind_host or os.environ.get("RTXNET_BIND_HOST", "127.0.0.1")
    shm = env_flag("RTXNET_SHM", True)
    ipv6 = ipv6_bind_error(host, "bind_host" if bind_host else "RTXNET_BIND_HOST")
    if ipv6:
        raise ConfigError(ipv6)
    import zmq

    try:
        engine = await Engine.create(bind_host=host, default_timeout_s=timeouts.op_s, shm=shm, key=key)
    except (OSError, ValueError, zmq.ZMQError) as exc:
        where = "bind_host" if bind_host else "RTXNET_BIND_HOST"
        raise ConfigError(f"{where}={host!r}: this rank cannot listen there ({exc}); give an "
                          f"address of this host") from exc
    # a broken bulk stream waits this long for the coordinator to declare its peer lost
    engine.link_grace_s = timeouts.heartbeat_timeout_s + timeouts.heartbeat_interval_s
    # and a collective waiting this long for a message asks its sender whether it sent it
    engine.probe_after_s = engine.link_grace_s
    return engine


def _wire_engine(agent: Agent, engine: Any) -> None:
    from .collectives import WorldView

    def on_epoch(m: Membership | None, reason: str) -> None:
        if engine.closed:
            # closed before the agent (a group released at exit: _release_at_exit): a view
            # pushed meanwhile has nobody to serve (it was logged as push_handler_failed with a
            # ClosedError traceback, a re-verifier's find)
            return
        if m is None:
            engine.fence("the coordinator declared it lost; rejoin")
            return
        # ranks that left in order finished their operations first, but their last messages
        # may still be on the way (a barrier they completed before this rank did): in-flight
        # operations get a moment to finish (the grace a broken link gets for its verdict)
        engine.set_view(
            WorldView(job=m.job, epoch=m.epoch, rank=m.rank, world_size=m.world_size,
                      endpoints={r: i["endpoint"] for r, i in m.members.items()},
                      hosts={r: i["host"] for r, i in m.members.items()}),
            lost=m.lost, leave_grace_s=engine.link_grace_s if reason == "left" else 0.0,
        )

    agent.add_listener(on_epoch)


# every group this process joined (connect, init) and has not closed, with the loop it runs on;
# and the joins under way (loop, job, coordinator address)
_OPEN_ASYNC: weakref.WeakKeyDictionary[ProcessGroup, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()
_JOINING: list[tuple[asyncio.AbstractEventLoop, str, str]] = []


async def _coordinator_key(address: str) -> frozenset[str]:
    """``address``'s host resolved, as ``{"ip:port", ...}`` (``tcp://localhost:N`` and
    ``tcp://127.0.0.1:N`` are one coordinator); ``{address}`` where it does not resolve."""
    import socket
    from urllib.parse import urlsplit

    try:
        u = urlsplit(address)
        infos = await asyncio.get_running_loop().getaddrinfo(u.hostname, u.port, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError):
        return frozenset({address})
    return frozenset(f"{i[4][0]}:{i[4][1]}" for i in infos) or frozenset({address})


async def _refuse_a_second_rank(settings: dict[str, Any], joining: list[tuple[Any, str, str]]) -> None:
    """ConfigError when this process already holds an open group of ``settings``' job on its
    coordinator (under any name that resolves alike), or is joining it (``joining``: the joins
    under way before this one), on a loop that still runs (``asyncio.run`` closes its loop at
    the end). A second ``connect()`` joined as another rank of the same job, silently, or failed
    with a ``JobFullError`` blaming another launch (a tester's find; a re-verifier's: under
    another name of the coordinator, or two at once); ``init`` refused it already. Resolves
    names only when this process has a group or join of the same job."""
    job, address = settings["job"], settings["coordinator"]
    held = [(g.rank, g._agent.coordinator) for g, loop in list(_OPEN_ASYNC.items())
            if not loop.is_closed() and g.job == job]
    under_way = [a for loop, j, a in joining if not loop.is_closed() and j == job]
    if not held and not under_way:
        return
    mine = await _coordinator_key(address)
    for rank, other in held:
        if other == address or await _coordinator_key(other) & mine:
            raise ConfigError(
                f"this process already holds rank {rank} of job {job!r} on {other} (an earlier "
                f"rtxnet.connect() or rtxnet.init() whose group is open): a process is one rank; "
                f"use that group, or close it before joining again")
    for other in under_way:
        if other == address or await _coordinator_key(other) & mine:
            raise ConfigError(f"this process is already joining job {job!r} on {other} (another "
                              f"rtxnet.connect() under way): a process is one rank")


async def _connect(coordinator=None, *, job=None, token=None, rank=None, world_size=None,
                   min_ranks=None, max_ranks=None, last_call_s=None, timeouts=None,
                   bind_host=None, info=None) -> ProcessGroup:
    # for rtxnet-run: this rank reached init (a rank that never does is stopped once the job
    # finished without it and the others ended; rtxnet.launcher._end_fenced_leftovers)
    errorfile.mark_init()
    settings = _settings(coordinator, job, token, rank, world_size, min_ranks, max_ranks, last_call_s)
    loop = asyncio.get_running_loop()
    before = list(_JOINING)              # no await between this look and the append below
    joining = (loop, settings["job"], settings["coordinator"])
    _JOINING.append(joining)
    try:
        await _refuse_a_second_rank(settings, before)
        pg = await _join(settings, timeouts, bind_host, info)
    finally:
        _JOINING.remove(joining)
    _OPEN_ASYNC[pg] = loop
    return pg


async def _join(settings: dict[str, Any], timeouts: Any, bind_host: str | None, info: Any) -> ProcessGroup:
    """:func:`_connect` once its settings are checked and no other group of this process holds
    the job."""
    if not structlog.is_configured():
        # A rank process is an entry point too; without this, structlog's default prints to stdout.
        from transport.logconfig import configure_logging

        configure_logging(level=os.environ.get("RTXNET_LOG_LEVEL", "warning"))
    if timeouts is not None and not isinstance(timeouts, Timeouts):
        raise ConfigError(f"timeouts must be an rtxnet.Timeouts, got {timeouts!r} ({type(timeouts).__name__})")
    timeouts = timeouts or Timeouts.from_env()
    if info is not None:
        # (a str was a ValueError from dict() deep in the agent, naming nothing: a fresh user's find)
        if not isinstance(info, dict):
            raise ConfigError(f"info({info!r:.60}) must be a dict (published in the job's status)")
        if bad := wire.json_like_problem(info, "info"):
            raise ConfigError(bad)
    if info is None:
        from .topology import agent_info

        info = {"topology": agent_info()}
        launch = os.environ.get("RTXNET_RANK", "")
        if launch.isdigit():
            # the rank rtxnet-run started this process as: stable across epochs (renumbering)
            # and restarts, so a lost rank can be named the way the launcher named it
            info["launch_rank"] = int(launch)
    if "torch" in sys.modules:
        # bfloat16 tensors need ml_dtypes, whose import holds the GIL (0.2 s for 0.6, about
        # 0.8 s for 0.7, which pyproject excludes for that reason): imported now, before the
        # agent heartbeats, not at the first bfloat16 collective (a stall of the loop that, on
        # a loaded host, can reach the heartbeat timeout)
        from .collectives.reduce_ops import bfloat16

        bfloat16()
    from transport.peer import data_key

    # with a token, the ranks' data ports admit only the job's ranks (see transport.peer)
    engine = await _make_engine(timeouts, bind_host, data_key(settings["job"], settings["token"]))
    agent = Agent(timeouts=timeouts, endpoint=engine.endpoint if engine else "", info=info, **settings)
    from . import faults

    await faults.apoint("rendezvous")
    if engine is not None:
        _wire_engine(agent, engine)
    try:
        reached = agent.reached_min_ranks
        await agent.join()
        await _until_min_ranks(agent, timeouts.rendezvous_s, reached)
    except BaseException:
        await agent.aclose(leave=False)
        if engine is not None:
            await engine.aclose()
        raise
    return ProcessGroup(agent, engine, timeouts)


async def _until_min_ranks(agent: Agent, timeout_s: float, reached: int) -> None:
    """Return once this rank has been in an epoch of at least ``min_ranks`` ranks since it asked
    to join (``agent.reached_min_ranks`` past ``reached``).

    A join into a running job (its ranks all crashed and are coming back one by one, or some died
    while the others wait for replacements) is admitted at once into an epoch of whoever is
    there; ``init(world_size=2)`` must not hand back a world of 1 that never had 2. A world that
    had them and shrank since (a peer that called ``close`` at once) is handed back: its
    collectives raise ``PeerLostError`` below ``min_ranks`` (waiting here for a replacement that
    never comes hung such an ``init`` until the rendezvous timeout).

    Raises:
        RendezvousTimeout: the world did not reach ``min_ranks`` within ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while agent.fenced or (agent.membership.world_size < agent.min_ranks
                               and agent.reached_min_ranks == reached):
            if agent.fenced:
                await agent.join()
                continue
            log.info("waiting_for_min_ranks", world_size=agent.membership.world_size,
                     min_ranks=agent.min_ranks, epoch=agent.membership.epoch)
            agent.waiting_for = agent.min_ranks   # the heartbeats say so (status, rtxnet-run)
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise RtxTimeoutError("deadline passed")
                await agent.wait_epoch(agent.membership.epoch, timeout_s=remaining, or_fenced=True)
            except RtxTimeoutError:
                raise RendezvousTimeout(
                    f"job {agent.job!r}: joined a running job of world_size({agent.membership.world_size})"
                    f" < min_ranks({agent.min_ranks}), and it did not grow to min_ranks within "
                    f"{timeout_s:g} s (rendezvous timeout)") from None
    finally:
        agent.waiting_for = None


class connect:  # noqa: N801 - used like a function: `await connect()` / `async with connect()`
    """Join a job and return its :class:`ProcessGroup` (asyncio).

    Usable as ``pg = await rtxnet.connect(...)`` or ``async with rtxnet.connect(...) as pg:``
    (leaves the job at the end of the block).

    Args:
        coordinator: address like ``tcp://host:29600``; default ``RTXNET_COORDINATOR``.
        job: job id; default ``RTXNET_JOB`` or ``"default"``.
        token: job token; default ``RTXNET_TOKEN`` or ``""``.
        rank: requested rank; default ``RTXNET_RANK`` or any free rank. Joining a job that is
            already running (a restarted process) gives the free rank instead: ranks of a
            running job stay dense, ``0..world_size-1``.
        world_size: shorthand for ``min_ranks = max_ranks = world_size``. Returns only once the
            world has at least ``min_ranks`` ranks, also when joining a running job.
        min_ranks, max_ranks: rendezvous bounds.
        last_call_s: seconds to wait for more ranks once ``min_ranks`` are present.
        timeouts: :class:`Timeouts`; default from ``RTXNET_*`` variables.
        bind_host: the address this rank's data sockets listen on; default ``RTXNET_BIND_HOST``.
        info: what this rank publishes in the job's status (default: its topology and launch
            rank): a dict of what JSON holds, nested at most 8 levels, at most 16 KiB encoded.

    Raises:
        ConfigError: missing, mistyped or contradictory settings, a ``bind_host`` /
            ``RTXNET_BIND_HOST`` this host cannot listen on, bounds other than the running job's,
            an ``info`` that is not such a dict (names the values); this process already holds
            an open group of the same job on the same coordinator (one process is one rank).
        RendezvousError: the coordinator refused the join (duplicate rank, job full, wrong token).
        RendezvousTimeout: the world did not form, or reach ``min_ranks``, within
            ``timeouts.rendezvous_s``.
    """

    def __init__(self, coordinator: str | None = None, **kwargs: Any):
        self._args = (coordinator,)
        self._kwargs = kwargs
        self._pg: ProcessGroup | None = None

    def __await__(self):
        return _connect(*self._args, **self._kwargs).__await__()

    async def __aenter__(self) -> ProcessGroup:
        self._pg = await _connect(*self._args, **self._kwargs)
        return self._pg

    async def __aexit__(self, *exc: Any) -> None:
        if self._pg is not None:
            await self._pg.aclose()


class BlockingProcessGroup:
    """The blocking facade of :class:`ProcessGroup`: same methods, same names, no ``await``.

    Collectives take ``async_op=True`` to return a :class:`Work` handle at once, so communication
    overlaps computation. The event loop runs in a background thread, so heartbeats continue while
    the caller computes.
    """

    def __init__(self, portal: Portal, pg: ProcessGroup):
        self._portal = portal
        self._pg = pg
        self.store = _BlockingProxy(portal, pg.store)

    rank = property(lambda self: self._pg.rank)
    world_size = property(lambda self: self._pg.world_size)
    epoch = property(lambda self: self._pg.epoch)
    job = property(lambda self: self._pg.job)
    membership = property(lambda self: self._pg.membership)
    timeouts = property(lambda self: self._pg.timeouts)
    async_pg = property(lambda self: self._pg, doc="The underlying async ProcessGroup.")

    def __getattr__(self, name: str) -> Any:
        # (called inside a running event loop of the caller's, e.g. in asyncio.run: the call
        # blocks that loop as any blocking call does, and runs on the group's loop; it raised
        # "made in another event loop (another thread's)", on the caller's own thread: a
        # breaker's find)
        target = (self._pg._collective(name, check_loop=False) if name in _COLLECTIVES
                  else getattr(self._pg, name))
        if not callable(target):
            return target
        return _blocking(self._portal, target, one_thread=(self._pg, name) if name in _ONE_THREAD else None)

    def pinned(self, world: Any = None) -> Any:
        """:meth:`ProcessGroup.pinned` (``with pg.pinned(): ...``); ``world`` as
        ``current_world()`` returned it, default the current one."""
        return self._pg.pinned(getattr(world, "_obj", world))

    def close(self) -> None:
        """Leave the job, release resources and stop the background loop. A second call does
        nothing; any other call after it raises ``ClosedError``."""
        if self._portal.stopped:
            return
        try:
            self._portal.call(self._pg.aclose)
        finally:
            self._portal.stop()

    def __enter__(self) -> BlockingProcessGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _BlockingProxy:
    def __init__(self, portal: Portal, obj: Any):
        self._portal = portal
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._obj, name)
        if not callable(target):
            return target
        group = name in _ONE_THREAD and hasattr(self._obj, "all_reduce")   # (not the store)
        return _blocking(self._portal, target, one_thread=(self._obj, name) if group else None)

    def __dir__(self) -> list[str]:
        # the wrapped object's names (help() and tab completion listed none: a fresh user's find)
        return sorted(set(dir(self._obj)) | set(object.__dir__(self)))


def _blocking(portal: Portal, fn: Any, *, one_thread: Any = None) -> Any:
    """``fn`` (a method of the async group or its store) called from the caller's thread and run
    on the group's loop; ``one_thread``: ``(group, name)`` when ``fn`` is the collective ``name``
    of ``group`` (:class:`_OneThreadAtATime`)."""
    def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        portal.check_open()
        if one_thread is None:
            return run(args, async_op, kwargs)
        with _ONE_THREAD_AT_A_TIME.call(*one_thread):
            return run(args, async_op, kwargs)

    def run(args: tuple, async_op: bool, kwargs: dict) -> Any:
        result = fn(*args, **kwargs)
        if not asyncio.iscoroutine(result):
            return _wrap(portal, result)
        try:
            result = _on_caller_stream(result, args, kwargs)
            fut = portal.submit(lambda: result)
        except BaseException:
            # interrupted (Ctrl-C) before the loop had the call: it ends there, before it began,
            # taking its place in the group's order as a cancelled call does (dropped, it left
            # this rank one call behind the others for good: a breaker's find)
            with contextlib.suppress(RuntimeError):   # (the loop closed meanwhile)
                portal.loop.call_soon_threadsafe(calls.forget, result)
            raise
        if async_op:
            return Work(fut)
        return _wrap(portal, wait_for(fut))   # split() returns a group: it gets the blocking face

    call.__name__ = getattr(fn, "__name__", "call")
    call.__doc__ = getattr(fn, "__doc__", None)
    call.__wrapped__ = fn    # inspect.signature / help() show the method's own arguments
    return call


def _on_caller_stream(coro: Any, args: tuple, kwargs: dict) -> Any:
    """``coro``, run with the caller thread's current CUDA stream as the producer stream of its
    GPU arrays (the loop thread's own current stream would be the default one), so that
    ``pg.all_reduce(x)`` under ``with torch.cuda.stream(s):`` waits for ``s``'s work on ``x``."""
    from .collectives.gpu.arrays import CALLER_STREAM, caller_stream

    try:
        stream = caller_stream(args, kwargs)
    except Exception:  # noqa: BLE001 - no CuPy, no driver: the call itself refuses the array,
        return coro    # telling the peers (raised here, it left them waiting out their deadline)
    if stream is None:
        return coro

    async def run() -> Any:
        CALLER_STREAM.set(stream)   # in the task's own context
        return await coro

    return calls.around(coro, run())


def _wrap(portal: Portal, value: Any) -> Any:
    # Subgroups returned by new_group() are async objects too: give them the blocking face.
    from .collectives.group import Group

    if isinstance(value, Group):
        return _BlockingProxy(portal, value)
    return value


def init(coordinator: str | None = None, **kwargs: Any) -> BlockingProcessGroup:
    """Join a job and return the blocking :class:`BlockingProcessGroup`.

    Takes the arguments of :class:`connect`; reads the environment ``rtxnet-run`` sets.

    Raises:
        ConfigError, RendezvousError, RendezvousTimeout: as :class:`connect`; ConfigError also
            when this process already holds an open group of the same job on the same
            coordinator (a second ``init``: one process is one rank, as torch.distributed's
            "initialize the default process group twice" says).
        TypeError: a keyword :class:`connect` does not take, named.
    """

    takes = list(inspect.signature(_connect).parameters)[1:]   # (after the coordinator)
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        raise TypeError(f"init() got an unexpected keyword argument {unknown[0]!r} (it takes "
                        f"{', '.join(takes)})")
    # a second group of the same job: refused by _connect (_refuse_a_second_rank), as for connect()
    portal = Portal()
    try:
        pg = portal.call(_connect, coordinator, **kwargs)
    except BaseException:
        portal.stop()
        raise
    atexit.register(_release_at_exit, portal, pg)
    return BlockingProcessGroup(portal, pg)


AT_EXIT_RELEASE_S = 5.0
AT_EXIT_DATA_HEAD_S = 0.1   # see _release_at_exit


def _release_at_exit(portal: Portal, pg: ProcessGroup) -> None:
    """At interpreter exit, for a process group the script did not close: close its sockets and
    shared memory and stop its loop thread, without leaving the job (as if the process had been
    killed: the coordinator declares the rank lost, so a job never looks finished because its
    ranks crashed). Left running, the daemon loop thread met the interpreter's finalization and
    could die with SIGSEGV (seen once in about 60 runs of a rank exiting by SystemExit under load)."""
    if portal.stopped:
        return

    async def release() -> None:
        # The data plane first: what this rank sent its peers leaves (the engine lingers up to
        # CLOSE_LINGER_S), and they get AT_EXIT_DATA_HEAD_S to take it in, before the
        # coordinator, seeing the connection close, declares this rank lost: a peer whose last
        # collective, completed on this rank's side, still waited for its data failed with
        # PeerLostError (in 3 to 5 runs of 12 of a 4-rank script that ends without close(), a
        # breaker's find; 3 of 16 with the flush alone). A head start, not a guarantee: the
        # loss and the data reach a peer on two connections (close() leaves in order instead,
        # and the peers wait for what is in flight).
        try:
            if pg._engine is not None:
                await pg._engine.aclose()
                await asyncio.sleep(AT_EXIT_DATA_HEAD_S)
        finally:
            await pg._agent.aclose(leave=False)

    try:
        portal.submit(release).result(timeout=AT_EXIT_RELEASE_S)
    except Exception:   # at exit, best effort: the loop is stopped regardless
        pass
    portal.stop()
