"""Committed steps, rollback and re-formed groups: what makes a failure cost at most one step.

Use it around each training step::

    ft = rtxnet.FaultTolerance(pg, state)          # state: state_dict() / load_state_dict()
    while ft.step < total_steps:
        with ft.guard() as step:                   # async: `async with ft.aguard() as step:`
            train_step(step)
    ft.finish()                                    # async: `await ft.afinish()`; see there

On entry to a step the group is in sync: after every new epoch (a rank lost or added) the members
agree collectively who holds the newest committed state (the lowest rank with the highest
committed step) and it is broadcast to the others, so old and new ranks run the same sequence of
operations. On a clean exit the step is voted on (``pg.commit``): it counts only when every member
of the epoch voted success, and the coordinator journals it. Then an in-memory snapshot of the
state is taken (:func:`rtxnet.statesync.pack_state`).

A rank that was cut off for so long that the job finished meanwhile gets
:class:`JobFinishedError` from the guard: the job's result is complete, this rank may just exit.

When the step fails with :class:`PeerLostError`, :class:`CollectiveTimeout`, a membership change
or a failed vote, the guard swallows the error (after a failure that lost nobody it first asks the
coordinator for a fresh epoch with the same members, which realigns every rank's sequence numbers), rolls the state back to the last committed
snapshot, waits (up to ``rejoin_window_s``) until the world has at least ``min_world_size`` ranks,
and the loop simply runs the step again. Other exceptions propagate unchanged.

State that differs per rank (FSDP shards) cannot come from one peer: with ``sharded_state=True``
each rank's committed state is also kept by its ring successor, and after a membership change every
rank gets every committed rank's state and reshards it (``state.load_state_dicts``).

``state`` may also define ``on_world(rank, world_size)``, called after every sync (e.g. to re-split
a sampler), and the guard records failure and recovery events with detection latency, time to
recover and steps lost in :attr:`FaultTolerance.events` (a process started after every rank
that held the committed state was gone, which then loads the newest checkpoint, records a
``restored`` event: the failed step, the step training resumes at, the steps lost and the time
since the last injected fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

import numpy as np
import structlog

from transport.errors import (
    ClosedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    ConfigError,
    JobFinishedError,
    PeerLostError,
    RendezvousError,
    RtxError,
    RtxTimeoutError,
    StateLayoutError,
)

from . import faults as _faults
from .config import CHECKPOINT_STORE_KEY, is_seconds, shown_list
from .faults import Injector
from .process_group import BlockingProcessGroup, ProcessGroup
from .statesync import pack_state, unpack_state

__all__ = ["FaultTolerance", "Stateful", "RECOVERABLE", "note_rank_specific"]

log = structlog.get_logger(__name__)

# p2p tags of the sharded-state ring exchange (size, then blob): _RING_TAG + 2 * epoch and the
# next, so that a message of an exchange an epoch change broke never pairs with one of a later
# epoch (see _ring_exchange); high, away from the tags a user's own sends pick
_RING_TAG = 0x52494E47 << 28

class _SyncAgain(ClosedError):
    """The membership changed while a sync waited for state holders (``_wait_for_holders``):
    the sync begins again in the new world. Not a failure: nothing ran, nothing is rolled back
    (a replacement reported it as "failure at step 6 (ClosedError, no rank lost)": a
    re-verifier's find)."""


# How long a failed vote waits for the epoch that failed it (sent just after the answer), to
# name the ranks it lost; past it the failure is one of the step's alone.
VOTE_EPOCH_WAIT_S = 0.5

# Errors a step can die of that re-forming the group answers.
RECOVERABLE = (PeerLostError, ClosedError, RtxTimeoutError, CollectiveError)
# While a step's vote is pending: how often to look for a collective this rank skipped, and how
# long the peers' first message of it must have waited (their next step's first message can
# come a moment before this rank hears the decision: not a skip)
SKIP_POLL_S = 0.25
SKIP_AFTER_S = 1.0
# the longest pause of an evicted rank before it rejoins (FaultTolerance._pause_if_evicted)
REJOIN_PAUSE_MAX_S = 300.0


# Objects of this process (tensor-parallel layers) that hold state differing between the ranks of
# a group -> (that group, what to call them in an error). Weak: a layer the user dropped no
# longer counts. FaultTolerance without sharded_state reads it: replicated-state recovery hands
# one rank's state to every rank, which loads a rank-specific slice into the wrong rank silently
# (a tester's find: a tensor-parallel MLP ended 0.6 off a fault-free run, exit code 0).
_RANK_SPECIFIC: weakref.WeakKeyDictionary[Any, tuple[Any, str]] = weakref.WeakKeyDictionary()


def note_rank_specific(obj: Any, group: Any, what: str) -> None:
    """Record that ``obj`` (kept weakly) holds state that differs on each rank of ``group`` (a
    process group or subgroup: ``world_size`` or ``size``), named ``what`` in errors.
    :class:`FaultTolerance` without ``sharded_state`` then refuses this process's state when
    ``group`` has more than one rank. Tensor-parallel layers call it when built; a pipeline
    stage or user module whose state is rank-specific may too."""
    _RANK_SPECIFIC[obj] = (group, what)


# Modules replicated on every rank of a process group whose ranks did not sync them when built
# (DDP with init_sync=False, as FaultTolerance's users build it) -> that group. Weak, as above.
_UNSYNCED_REPLICAS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def note_unsynced_replica(module: Any, pg: Any) -> None:
    """Record that ``module`` (a ``torch.nn.Module``, kept weakly) is replicated on every rank of
    ``pg`` and was not made equal there when built (``DistributedDataParallel(...,
    init_sync=False)``): :class:`FaultTolerance`'s first sync of a job with no committed step
    compares its parameters and buffers across the ranks and gives every rank the source
    rank's where they differ (ranks built with rank-dependent seeds trained apart before: a
    breaker's find)."""
    _UNSYNCED_REPLICAS[module] = getattr(pg, "async_pg", pg)


def rank_specific_state(min_ranks: int = 2) -> list[str]:
    """What :func:`note_rank_specific` recorded and still lives, where its group has at least
    ``min_ranks`` ranks: one ``"<what> over N ranks"`` per distinct description, in order of
    record."""
    seen: dict[str, None] = {}
    for group, what in list(_RANK_SPECIFIC.values()):
        size = getattr(group, "world_size", None)
        size = getattr(group, "size", 1) if size is None else size
        if int(size) >= min_ranks:
            seen.setdefault(f"{what} over {int(size)} ranks")
    return list(seen)


def _refuse_rank_specific(where: str) -> None:
    """``ConfigError`` when this process holds rank-specific state (:func:`note_rank_specific`)
    and FaultTolerance replicates state (no ``sharded_state``)."""
    held = rank_specific_state()
    if held:
        shown = shown_list(held, 4)
        raise ConfigError(
            f"FaultTolerance{where}: this rank holds state that differs per rank ({shown}), and "
            f"without sharded_state=True a recovery gives every rank one rank's state (a "
            f"replacement would load another rank's slices and train on silently wrong weights); "
            f"pass FaultTolerance(sharded_state=True) and give the state load_state_dicts(states) "
            f"that loads states[pg.rank] (tensor or pipeline parallel over the whole world) or "
            f"reshards (see the README, 'Tensor and pipeline parallelism')")


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


async def _unreachable_peers(membership: Any, identity: str, timeout_s: float) -> list[str]:
    """The data endpoints of ``membership``'s other members (``tcp://host:port?bulk=port``: the
    first port is probed) that give no TCP answer within ``timeout_s``, probed at once, each by
    a connection opened and closed without a byte sent (ZeroMQ drops it before its greeting).
    A refused connection is an answer: the host is reachable (the rank there may be gone or
    have moved to another port)."""
    if membership is None:
        return []
    endpoints = sorted({m.get("endpoint") or "" for m in (membership.members or {}).values()
                        if m.get("identity") != identity})

    async def silent(endpoint: str) -> bool:
        try:
            url = urllib.parse.urlsplit(endpoint)   # tcp://HOST:PORT?bulk=PORT
            host, port = url.hostname, url.port
        except ValueError:
            return False
        if url.scheme != "tcp" or not host or not port:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except ConnectionRefusedError:
            return False
        except (OSError, TimeoutError):
            return True
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return False

    silence = await asyncio.gather(*(silent(e) for e in endpoints))
    return [e for e, quiet in zip(endpoints, silence, strict=True) if quiet]


class FaultTolerance:
    """Committed steps with rollback and peer state sync; see the module docstring.

    Args:
        pg: the process group, blocking (:func:`rtxnet.init`) or async (:func:`rtxnet.connect`).
        state: the training state: ``state_dict()`` and ``load_state_dict(d)``; optionally
            ``on_world(rank, world_size)``.
        min_world_size: smallest world to go on with; default the ``min_ranks`` the process
            group joined with (``rtxnet.init(min_ranks=)``, else ``RTXNET_MIN_RANKS``, else the
            world size); not below it (collectives refuse a world below ``min_ranks``).
        rejoin_window_s: how long to wait for replacements while the world is below
            ``min_world_size``, seconds.
        commit_timeout_s: deadline of a step's vote; default the group's op timeout.
        faults: an :class:`Injector`; default from ``RTXNET_FAULTS`` (set by ``rtxnet-run --faults``).
        start_step: the first step to run (e.g. a checkpoint's step when resuming: the
            checkpoint of step N holds N completed steps); the state passed in counts as committed
            at ``start_step - 1``.
        load_checkpoint: ``fn(step, root)`` that loads checkpoint ``step`` from folder ``root`` into
            ``state``. Called on every rank when no member of a new epoch holds the job's last
            committed state (all of them restarted) and :mod:`rtxnet.checkpoint` recorded a
            checkpoint in the job's store; training then resumes at that checkpoint's step (the
            checkpoint of step N holds steps 0..N-1, so step N runs next). When it raises
            ``CheckpointError`` (a corrupt or missing shard) or ``OSError`` on any rank, every
            rank tries the newest older intact step (:func:`rtxnet.checkpoint.latest`) instead.
        max_step_retries: how often one step may fail without a membership change before the
            error is raised instead of retried: such a failure, e.g. a
            :class:`CollectiveMismatchError` from ranks that disagree, would repeat forever.
        evict_late_after: a rank that this many tries of one step in a row timed out waiting
            for (``CollectiveTimeout`` naming it: alive, heartbeating, but not taking part: a
            hung data loader, a rank far slower than the others) is evicted, declared lost as a
            frozen rank is, when the world without it still has ``min_world_size`` ranks and the
            job's ``min_ranks`` (else the step is retried as before, up to
            ``max_step_retries``). The evicted rank is fenced; if it wakes, it rejoins after a
            pause (the heartbeat timeout, doubling with each eviction since it last took part
            in a commit, up to ``REJOIN_PAUSE_MAX_S``), and after more pauses, doubling, while
            a TCP connection to any other member's data port gets no answer
            (``rejoin_deferred`` in its log; at the cap it rejoins whatever the probe says).
            A rank admitted after the job's last commit cannot evict every rank that took
            part in it (the coordinator refuses: hosts that reach the coordinator but not each
            other keep the side holding the committed steps). A rank evicts at most
            ``max_step_retries`` times in one step, then raises ``RtxError`` (ranks that come
            back late each time). ``None``: never. Default 2: the first timeout may be ranks
            out of step, which a re-formed epoch mends.
        sharded_state: the state differs per rank (FSDP shards, tensor-parallel slices), so no
            single rank can hand it to the others. Each rank then also keeps its ring
            predecessor's committed state (the ring alternates hosts, else rank ``r`` holds rank
            ``r - 1``'s, mod the world size: :meth:`_ring_order`), sent peer to peer before every
            vote, so one lost rank or host (or any lost ranks that are not ring neighbours)
            costs at most the step that failed, as with replicated state; until the next commit
            after a re-form, two ranks of the new world keep each state it handed out, so a
            second loss during the re-form costs no more. After
            a membership change every rank receives every committed rank's state and calls
            ``state.load_state_dicts(states)`` (``states[q]``: the state of rank ``q`` of the world
            that committed, any world size: reshard there; FSDP's ``load_sharded_state_dicts``).
            When two neighbours are lost, the newest checkpoint is loaded instead. Tensor-parallel
            layers need it (without it: ``ConfigError``). Before the
            first commit the states as built are compared: ``state.sharded_layout()``, when the
            state has it (``FSDPState``), gives ``(rank, world_size)`` of its layout, read when
            this object is made (else that world), and a rank that joined after the others built
            theirs (``init`` returns at ``min_ranks``) takes their state, resharded. Costs per step:
            sending and receiving one rank's state (a point-to-point message each way); memory: two
            ranks' states besides the live one (three while the vote runs).

    Raises:
        ConfigError: ``pg`` is not a process group, ``state`` lacks ``state_dict`` /
            ``load_state_dict``, ``min_world_size`` < 1, below the group's ``min_ranks`` or above
            its ``max_ranks``, ``rejoin_window_s`` / ``commit_timeout_s`` not a finite positive
            number, ``load_checkpoint`` not callable, a mistyped int (names the value); with
            ``sharded_state``, a state without ``load_state_dicts``; without it, a process
            holding rank-specific state (tensor-parallel layers over more than one rank, or
            whatever :func:`note_rank_specific` recorded; names them), here or, for layers built
            later, from ``guard``/``aguard`` at the next sync.
        TypeError, ValueError (here, and from ``guard``/``aguard`` on the rank whose state
            changed, when a commit snapshots it): ``state.state_dict()`` holds what a snapshot
            cannot (:func:`rtxnet.statesync.pack_state`): a value or key of a type it does not
            take (TypeError), a container that contains itself or containers nested more than
            ``statesync.MAX_DEPTH`` deep (ValueError); the message names the key path
            (``state.rng.state``). Ints of any size are taken (a NumPy ``Generator``'s state).
        RendezvousError (from ``guard``/``aguard``): the world stayed below ``min_world_size``
            for ``rejoin_window_s`` after a loss (no replacement came).
    """

    def __init__(self, pg: BlockingProcessGroup | ProcessGroup, state: Stateful, *,
                 min_world_size: int | None = None, rejoin_window_s: float = 60.0,
                 commit_timeout_s: float | None = None, faults: Injector | None | str = "env",
                 start_step: int = 0, max_step_retries: int = 3,
                 load_checkpoint: Callable[[int, str], None] | None = None,
                 sharded_state: bool = False, evict_late_after: int | None = 2):
        if isinstance(pg, BlockingProcessGroup):
            self._portal = pg._portal
            self.pg = pg.async_pg
        elif isinstance(pg, ProcessGroup):
            self._portal = None
            self.pg = pg
        else:
            raise ConfigError(f"FaultTolerance: pg must be the process group of rtxnet.init() or "
                              f"rtxnet.connect(), got {type(pg).__name__}")
        if not (callable(getattr(state, "state_dict", None)) and callable(getattr(state, "load_state_dict", None))):
            raise ConfigError(f"FaultTolerance: state must have state_dict() and load_state_dict(d), "
                              f"got {type(state).__name__}")
        for name, v in (("min_world_size", min_world_size), ("start_step", start_step),
                        ("max_step_retries", max_step_retries), ("evict_late_after", evict_late_after)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
        for name, v in (("rejoin_window_s", rejoin_window_s), ("commit_timeout_s", commit_timeout_s)):
            if v is not None and not is_seconds(v):
                raise ConfigError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        prev = getattr(self.pg, "_fault_tolerance", None)
        if prev is not None and not prev._finished:
            raise ConfigError(f"FaultTolerance: this process group already has one (its next step "
                              f"is {prev.step}); a second would count steps from {start_step!r} "
                              f"again and take committed steps for new ones: make one per process "
                              f"group (a new one once the first finish()ed)")
        if load_checkpoint is not None and not callable(load_checkpoint):
            raise ConfigError(f"load_checkpoint must be a function (step, root) or None, got "
                              f"{type(load_checkpoint).__name__}")
        self.state = state
        if min_world_size is None:
            min_world_size = getattr(self.pg.agent, "min_ranks", None) or int(os.environ.get("RTXNET_MIN_RANKS") or 1)
        self.min_world_size = min_world_size
        if self.min_world_size < 1:
            raise ConfigError(f"min_world_size({self.min_world_size}) must be >= 1")
        min_ranks = getattr(self.pg.agent, "min_ranks", 1)
        if self.min_world_size < min_ranks:
            raise ConfigError(
                f"min_world_size({self.min_world_size}) < the process group's min_ranks({min_ranks}): "
                f"collectives refuse a world below min_ranks; lower min_ranks instead (rtxnet-run "
                f"--min-ranks, RTXNET_MIN_RANKS)")
        max_ranks = getattr(self.pg.agent, "max_ranks", None)
        if max_ranks is not None and self.min_world_size > max_ranks:
            raise ConfigError(f"min_world_size({self.min_world_size}) > the process group's "
                              f"max_ranks({max_ranks}): the world can never be that large")
        if max_step_retries < 0:
            raise ConfigError(f"max_step_retries({max_step_retries}) must be >= 0")
        if evict_late_after is not None and evict_late_after < 1:
            raise ConfigError(f"evict_late_after({evict_late_after}) must be >= 1 or None")
        self.evict_late_after = evict_late_after
        # step -> (the ranks the last timeouts of its tries named, as of their epoch's numbering
        # mapped to identities, how many tries in a row named them)
        self._late_streak: dict[int, tuple[frozenset, int]] = {}
        self._sync_timeouts = 0   # syncs of new epochs that timed out since the last that did not
        self._sync_failed_in: int | None = None   # the epoch of the sync that failed last (_recover)
        self.rejoin_window_s = float(rejoin_window_s)
        self.commit_timeout_s = float(commit_timeout_s) if commit_timeout_s else self.pg.timeouts.op_s
        self.injector = _faults.current() if faults == "env" else faults
        launch = os.environ.get("RTXNET_RANK")
        self.launch_rank = int(launch) if launch else self.pg.rank
        if start_step < 0:
            raise ConfigError(f"start_step({start_step}) must be >= 0")
        self.step = start_step  # the next step to run
        self.committed_step = start_step - 1
        # (epoch, rank, world_size) of the last step this rank committed: every rank that voted
        # for it has the same epoch and world, whatever the world did since (a handshake at the
        # end of training can wait for exactly those ranks). None before the first commit.
        self.committed_world: tuple[int, int, int] | None = None
        self.max_step_retries = max_step_retries
        # delay faults already claimed in the store -> the step it last acted at (see
        # _record_fault: a step again, or an earlier one, is a retry), and the times it acted
        # again, newest last (at most _DELAY_ACTS_KEPT)
        self._delays_recorded: dict[int, int] = {}
        self._delay_acts: dict[int, list[float]] = {}
        self.load_checkpoint = load_checkpoint
        self.sharded_state = bool(sharded_state)
        if not self.sharded_state:
            _refuse_rank_specific("")
        if self.sharded_state and not callable(getattr(state, "load_state_dicts", None)):
            raise ConfigError(f"sharded_state=True needs state.load_state_dicts(states), which "
                              f"{type(state).__name__} lacks: it loads every committed rank's state "
                              "(in rank order, any world size) into this rank's")
        # sharded_state: a state that can give every rank's state as built (FSDPState) keeps it
        # until the first commit: a rank lost before its shards reached its ring successor then
        # costs nothing (before, the job ended: a tester's find)
        self._built_held = False
        if self.sharded_state and all(callable(getattr(state, f, None)) for f in
                                      ("hold_built", "holds_built", "built_state_dicts")):
            state.hold_built(True)
            self._built_held = bool(state.holds_built())
        # sharded_state: the committed states this rank holds, {"step", "epoch", "world",
        # "blobs": {rank in that world: blob}} (its own and its ring predecessor's); None before
        # the first sync
        self._ring: dict[str, Any] | None = None
        # sharded_state: the ring this rank held before a sync replaced it with the new world's,
        # when both hold the same committed step; kept until the next commit. A rank lost during
        # that sync's own ring exchange leaves some ranks with the new ring and some with the
        # old, neither complete alone: the next sync may take this one (a breaker's find)
        self._ring_kept: dict[str, Any] | None = None
        self._same_step_failures: dict[int, int] = {}
        self._evictions: dict[int, int] = {}   # step -> evictions this rank asked for in it
        self._evicted_in_row = 0   # evictions of this rank since it last took part in a commit
        self._snapshot = pack_state(state.state_dict())
        # (snapshot, its array) after a step's commit: the next commit's snapshot may be packed
        # into that array (pack_state(into=)) while self._snapshot is still that snapshot and it
        # was not sent (_broadcast_bytes)
        self._reusable: tuple[memoryview, np.ndarray] | None = None
        # sharded_state: (rank, world size) the snapshot above is laid out for, what a fresh
        # rank's sync row says of the state it would send: the state's sharded_layout() now (it
        # may have been built in an earlier epoch, before a rank joined), else the epoch this
        # was made in. Read here, not at the sync: a sync that resharded the live state for a
        # world that then lost a rank before its ring copy (a joiner killed there) left
        # sharded_layout() naming that world while the snapshot, all this rank sends, was still
        # laid out for the one before, and the next sync found "the states as built of ranks
        # [2] of the world of 3 are gone" (a tester's find: a joiner SIGKILLed in the sync of
        # its join, before the first commit, ended an FSDP job that should have gone on with 2)
        m = self.pg.agent.membership
        self._built = (m.rank, m.world_size) if m is not None else (0, 1)
        layout = getattr(state, "sharded_layout", None)
        if self.sharded_state and callable(layout):
            self._built = tuple(int(v) for v in layout())
        # False once this rank's state refused a snapshot (FSDP shards after the world changed):
        # it then holds no committed state and takes one from a peer or the newest checkpoint.
        self._holds_state = True
        self._synced_epoch = -1
        self._synced_at: tuple[int, int] | None = None   # (rank, world size) of the last sync
        # until when the syncs of one recovery wait for a rank declared lost that holds a
        # committed state no live rank has (_wait_for_holders); None: no such wait began
        self._holders_until: float | None = None
        self._step_epoch = -1
        self._step_t0 = 0.0   # time.monotonic() when the current step began
        self._finished = False   # finish() was called: no step may run any more
        self._noted_through = -1   # the newest epoch whose losses _note_loss_between_steps recorded
        self.events: list[dict[str, Any]] = []
        self._open_failure: dict[str, Any] | None = None
        self._skip_told = ""   # why the last vote failed: a collective this rank skipped (_vote)
        self._epoch_seen: dict[int, float] = {}
        self._epoch_lost: dict[int, list[int]] = {}   # epoch -> ranks its membership lost
        self._epoch_left: set[int] = set()   # epochs made by orderly leaves (pg.close())
        # epochs with the members of the one before (re-forms after a failed step): a step that
        # fails again in such an epoch failed "without a membership change"
        self._epoch_same: set[int] = set()
        # epoch -> the launch ranks (rtxnet-run's RANK, stable across epochs) its membership lost;
        # None where a lost rank's launch rank is unknown (ranks started by hand, an epoch missed)
        self._epoch_lost_launch: dict[int, list[int] | None] = {}
        self._launch_of: dict[int, dict[int, int | None]] = {}  # epoch -> {rank: launch rank}
        # joins seen, reported at the next sync with the step the grown world trains first
        # (the step in flight when the epoch came may still commit in the old world)
        self._pending_joins: list[dict[str, Any]] = []
        # the epoch this rank was in when this was made: the losses of later epochs, before the
        # first sync too (a node lost before step 0), happened to a world this rank was in
        self._made_in = -1
        m = self.pg.agent.membership
        if m is not None:   # the epoch this rank joined in
            prev = self.pg.agent.previous_membership
            if prev is not None and prev.epoch == m.epoch - 1:
                # the lost ranks' launch ranks (a loss before this was made was reported as
                # "rank 2", numbered in the old epoch: a fresh user's find)
                self._note_launch_ranks(prev)
            self._note_launch_ranks(m)
            self._made_in = m.epoch
            if m.lost and m.rank not in (m.added or ()):
                # a loss (or leave) that opened the current epoch before this was made, in a
                # world this rank was in (it was not added with it): noted as if seen
                self._on_epoch(m, m.reason)
                self._made_in = m.epoch - 1
        self.pg.agent.add_listener(self._on_epoch)
        self._in_step: int | None = None   # the step a guard is running (nested guards refused)
        # why no checkpoint could stand in, when the recorded one failed to load on some rank
        self._checkpoint_unusable = ""
        self.pg._fault_tolerance = self

    # ---------------------------------------------------------------------------------------------
    # public API

    @contextlib.contextmanager
    def guard(self) -> Iterator[int]:
        """Run one step (blocking API); yields the step number. See the module docstring."""
        if self._portal is None:
            raise ConfigError("guard() needs the blocking process group (rtxnet.init); use aguard() with connect()")
        self._enter_step()
        try:
            step = self._portal.call(self._begin)
            for f, rec in self._due("step", step):
                if self._portal.call(self._record_fault, rec):
                    self.injector.act(f, agent=self.pg.agent, engine=self.pg.engine)
            try:
                yield step
            except RECOVERABLE as exc:
                self._portal.call(self._recover, exc, step)
                return
            self._portal.call(self._end, step)
        finally:
            self._in_step = None

    @contextlib.asynccontextmanager
    async def aguard(self) -> AsyncIterator[int]:
        """Run one step (async API); yields the step number."""
        self._enter_step()
        try:
            step = await self._begin()
            for f, rec in self._due("step", step):
                if await self._record_fault(rec):
                    self.injector.act(f, agent=self.pg.agent, engine=self.pg.engine)
            try:
                yield step
            except RECOVERABLE as exc:
                await self._recover(exc, step)
                return
            await self._end(step)
        finally:
            self._in_step = None

    def _enter_step(self) -> None:
        """Refuse a guard inside a guard: the inner one would run and vote the outer's step."""
        if self._in_step is not None:
            raise ConfigError(f"a guard inside the guard of step {self._in_step}: one step at a "
                              f"time (end the outer guard's block first)")
        self._in_step = self.step

    def finish(self) -> int:
        """Training is over (blocking API): see :meth:`afinish`."""
        if self._portal is None:
            raise ConfigError("finish() needs the blocking process group (rtxnet.init); use afinish() with connect()")
        return self._portal.call(self.afinish)

    async def afinish(self) -> int:
        """Training is over: call it on every rank after the last step, before what runs after
        training (an evaluation, a final checkpoint, ``full_state_dict``).

        The coordinator then admits no rank into the job: a rank still waiting to join, or one
        admitted after the last commit (it never trained a step), is turned away with
        :class:`JobFinishedError` (``rtxnet-run`` does not count a replacement that fails so, once
        the job has ended, as a failure). Without it, a replacement arriving after the last step
        was admitted one join window later and grew the world under the final collectives:
        FSDP's evaluation forward raised ``ConfigError`` (shards laid out for the old world),
        other collectives ``CollectiveMismatchError``. If the world changed since the last sync
        (ranks turned away, a rank lost after the last step) the ranks then sync as at the start
        of a step (a collective over the ranks that go on): the state is the last committed one,
        a ``sharded_state`` resharded for that world. Replacements are not waited for, since none
        may join: below ``min_world_size`` no sync runs, each rank keeps its own committed state
        (the whole state, unless it is sharded) and collectives refuse that world
        (``PeerLostError``). Call it again on every rank when a rank is lost in what follows
        (a collective raised ``PeerLostError``): the ranks sync again, for the smaller world
        (a call again first waits, up to twice the heartbeat timeout, for the epoch without
        the lost rank when it has not come yet).
        A step after it (``guard``) raises ``ConfigError``.

        Returns:
            How many ranks this call turned away (0 on every rank but the first caller).

        Raises:
            JobFinishedError: this rank is not a member any more (declared lost, frozen or cut
                off, after its last step): the others go on without it.
            RtxTimeoutError: the coordinator did not answer within ``timeouts.request_s``.
            RtxError: the sync failed ``max_step_retries`` + 1 times without a membership change.
        """
        if self.pg.agent.fenced:
            raise self._lost_after_training()
        again = self._finished
        try:
            answer = await self.pg.agent.finish()
        except JobFinishedError:
            raise
        except RendezvousError as exc:   # not a member: declared lost since its last step
            raise self._lost_after_training() from exc
        self._finished = True
        if again and self._synced_epoch == self.pg.epoch and self._open_failure is None:
            # Called again after a loss (a collective raised PeerLostError, from a broken link or
            # a peer's abort) that the epoch has not followed yet, here or at the coordinator:
            # wait for that epoch, so that every rank syncs in it. Before, a rank that came back
            # before it synced nothing and redid its collective, while one that saw the epoch
            # synced: CollectiveMismatchError (all_gather against all_reduce), seen once in CI.
            await self._await_announced_epoch(self.pg.epoch)
        if answer["turned_away"]:
            log.info("late_ranks_turned_away", ranks=answer["turned_away"], epoch=answer["epoch"],
                     committed_step=self.committed_step)
        while self._synced_epoch != self.pg.epoch or self._open_failure is not None:
            if self.pg.agent.fenced:
                raise self._lost_after_training()
            if self._synced_epoch != self.pg.epoch and self._open_failure is None:
                if self._only_left_since_sync():
                    # Peers that finished too and closed their group (pg.close() after their
                    # finish and evaluation) while this rank was still in finish(): the end of
                    # training, not a loss, and nothing to sync (a sharded state could not be:
                    # their shards left with them). Before, every such run logged
                    # lost_between_steps and finished_below_min_world_size (a fresh user's find,
                    # with states of 300 MB and more: the slower rank was still snapshotting).
                    log.info("peers_left_after_training", world_size=self.pg.world_size,
                             epoch=self.pg.epoch, committed_step=self.committed_step)
                    break
                self._note_loss_between_steps()    # (a rank lost after the last step)
            if self.pg.world_size < self.min_world_size:
                # no rank may join to make up the world, and collectives refuse it: each rank
                # keeps its own committed state (the whole state, unless it is sharded)
                log.warning("finished_below_min_world_size", world_size=self.pg.world_size,
                            min_world_size=self.min_world_size, committed_step=self.committed_step)
                break
            try:
                if self._synced_epoch != self.pg.epoch:
                    await self._sync()
                if self._open_failure is not None:
                    await self._close_failure()
            except _SyncAgain:
                continue
            except RECOVERABLE as exc:
                await self._recover(exc, self.step, in_step=False)
        return answer["turned_away"]

    def _lost_after_training(self) -> JobFinishedError:
        """The error of a rank declared lost (frozen, cut off) after its last step: no rank may
        (re)join a job whose training finished, so it ends; the others have the result."""
        return JobFinishedError(
            f"this rank was declared lost after its last step (committed step "
            f"{self.committed_step}) and the job admits no rank any more: the others go on "
            f"without it; their result stands")

    def report(self) -> list[str]:
        """One line per injected fault and per recovery: what was injected, when it was detected,
        how long recovery took and how many steps were lost (blocking API)."""
        if self._portal is None:
            raise ConfigError("report() needs the blocking process group; use await areport()")
        return self._portal.call(self.areport)

    def _report_joins(self) -> None:
        """The joins seen since the last sync, as events at ``self.step``: after a sync the step
        the grown world trains first; at the report, the step training stopped at."""
        for join in self._pending_joins:
            self._event({**join, "step": self.step})
        self._pending_joins.clear()

    async def areport(self) -> list[str]:
        self._report_joins()
        await self._store_unrecorded_faults()
        lines = []
        for f in self.injector.faults if self.injector else []:
            name = _faults.label(f, self.injector.faults)
            try:
                raw = await self.pg.store.get(f"faults/{f.index}")
            except RtxError:
                lines.append(f"fault {name}: unknown (the job's store did not answer)")
                continue
            if raw is not None:
                rec = json.loads(raw)
                where = _fault_where(f.at, rec.get("step"), f.collective)
                lines.append(f"fault {name}: injected on rank {rec['rank']}{where}")
            elif f.at == "rendezvous":
                lines.append(f"fault {name}: no record (a fault during rendezvous is recorded "
                             f"after its rank joined; a rank it killed never did)")
            else:
                lines.append(f"fault {name}: not injected")
        for e in self.events:
            if e["event"] == "recovered":
                if e.get("fenced"):
                    lost = "this rank was declared lost (frozen or cut off) and rejoined"
                elif e.get("lost_launch"):
                    lost = "lost " + name_ranks(e["lost_launch"], launch=True)
                elif len(e.get("losses", ())) > 1:
                    lost = "lost ranks " + " then ".join(f"{x['ranks']} (epoch {x['epoch']})"
                                                         for x in e["losses"])
                else:
                    lost = f"lost ranks {e['lost']}" if e["lost"] else "no rank lost"
                if e.get("late"):
                    lost += f"; {event_ranks(e, 'late')} did not contribute in time"
                if e["detection_latency_s"] is None:   # no injected fault to measure from
                    timing = (f"training resumed {e['time_to_recover_s']:.2f} s after the failure "
                              f"was detected,")
                else:
                    timing = (f"detected {e['detection_latency_s'] * 1000:.0f} ms after injection, "
                              f"training resumed {e['time_to_recover_s']:.2f} s after it")
                lines.append(
                    f"failure at step {e['failed_step']} ({e['error']}, {lost}): {timing} with "
                    f"{_n_ranks(e['world_size'])} at step {e['resumed_step']}; steps lost: {e['steps_lost']}")
            elif e["event"] == "restored":
                after = ("" if e["time_to_recover_s"] is None
                         else f" {e['time_to_recover_s']:.2f} s after the fault was injected")
                lines.append(
                    f"failure at step {e['failed_step']} (no live rank held committed step "
                    f"{e['failed_step'] - 1}): restored the checkpoint of step {e['resumed_step']}"
                    f"{after}, training resumed with {_n_ranks(e['world_size'])} at step "
                    f"{e['resumed_step']}; steps lost: {e['steps_lost']}")
            elif e["event"] == "state_lost":
                lines.append(
                    f"the job had committed step {e['job_committed_step']}, but no live rank held "
                    f"it and no checkpoint stood in ({e['why']}): training went on with "
                    f"{_n_ranks(e['world_size'])} at step {e['resumed_step']}; steps lost: {e['steps_lost']}")
            elif e["event"] == "joined":
                lines.append(describe_join(e))
            elif e["event"] == "lost_between_steps":
                lines.append(describe_loss_between_steps(e))
            elif e["event"] == "commit_stall":
                lines.append(f"step {e['step']}: the vote waited {e['seconds']:.2f} s (the coordinator "
                             f"away, or a peer late); steps lost: 0")
        if not any(e["event"] in ("recovered", "restored", "commit_stall", "lost_between_steps",
                                  "state_lost")
                   for e in self.events):
            lines.append("no failure seen by this rank")
        return lines

    async def _store_unrecorded_faults(self) -> None:
        """Faults this process fired at rendezvous, before it had a store, go to the store now."""
        try:
            await _faults.store_unrecorded(self.pg.store)
        except RtxError as exc:
            log.warning("fault_record_failed", error=str(exc))

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The completed recoveries: detection latency, time to recover, steps lost."""
        return [e for e in self.events if e["event"] == "recovered"]

    # ---------------------------------------------------------------------------------------------
    # the steps of a step (they run on the process group's event loop)

    def _on_epoch(self, membership, reason: str) -> None:
        now = time.monotonic()
        if membership is None:
            self._epoch_seen[-1] = now
        else:
            self._epoch_seen[membership.epoch] = now
            epoch = membership.epoch
            self._note_launch_ranks(membership)
            before = self._launch_of.get(epoch - 1, {})
            if reason == "finished":
                # ranks turned away at the end of training (finish): admitted after the last
                # commit, they never trained; neither a loss nor a join to report
                gone = set(membership.lost)
                self._pending_joins = [j for j in self._pending_joins if not gone & set(j["added"])]
            elif not membership.lost and not membership.added:
                self._epoch_same.add(epoch)
            elif membership.lost:
                if reason == "left":
                    self._epoch_left.add(epoch)
                self._epoch_lost[epoch] = list(membership.lost)
                named = [before.get(r) for r in membership.lost]
                self._epoch_lost_launch[epoch] = None if None in named else named
            if (membership.added and reason == "joined" and membership.rank not in membership.added
                    and (self._synced_epoch >= 0 or self._open_failure is not None)):
                # (a joiner's own recovery or start says it joined; the members report the join;
                # a process not yet in sync, itself just started, knows no step to report it at,
                # unless a failure is open: a replacement for a rank lost in the first sync, which
                # went unreported under FSDP, whose first sync outlasts the replacement's start:
                # a fresh user's find)
                added = [self._launch_of[epoch].get(r) for r in membership.added]
                self._pending_joins.append({"event": "joined", "epoch": epoch,
                                            "added": list(membership.added),
                                            "added_launch": None if None in added else added,
                                            "world_size": membership.world_size})
            # (the epoch the last sync was in stays: a failure in it names its late ranks by
            # launch rank when it closes, epochs later after an eviction: late_launch was None
            # while lost_launch was known, a fresh user's find)
            keep = {self._synced_epoch, (self._open_failure or {}).get("late_epoch")}
            for old in [e for e in self._launch_of if e < epoch - 1 and e not in keep]:
                del self._launch_of[old]

    def _note_launch_ranks(self, membership) -> None:
        self._launch_of[membership.epoch] = {r: (m.get("info") or {}).get("launch_rank")
                                             for r, m in (membership.members or {}).items()}

    async def _begin(self) -> int:
        if self._finished:
            raise ConfigError(f"a step after finish(): training was declared over at step "
                              f"{self.step} (the job admits no ranks any more); call finish() "
                              f"after the last step, not before")
        while True:
            try:
                agent = self.pg.agent
                if agent.fenced:
                    await self._pause_if_evicted()
                    log.warning("rejoining", reason="fenced")
                    await agent.join()
                if self._synced_epoch != self.pg.epoch:
                    if self._open_failure is None:
                        self._note_loss_between_steps()
                    await self._wait_world()
                    await self._sync()
                    self._sync_timeouts = 0
                    if self._synced_epoch != self.pg.epoch:
                        continue   # the world changed again as the sync ended: re-form in it
                if self._open_failure is not None:
                    await self._close_failure()
                if self._synced_epoch != self.pg.epoch:
                    # A loss that came between the end of the sync and the step (during the
                    # failure's closing, which awaits the store): the step began in the new
                    # world with the state synced for the old one, below min_world_size, and an
                    # FSDP state laid out for the old world failed the forward with ConfigError,
                    # which ended the rank and with it the committed state (a fresh user's find,
                    # 2 of 8 runs of a second kill during the sync). Re-form first.
                    continue
                self._step_epoch = self.pg.epoch
                self._step_t0 = time.monotonic()
                if self.pg.engine is not None:
                    self.pg._pinned_world = self.pg.engine.world
                return self.step
            except _SyncAgain:
                continue
            except RECOVERABLE as exc:
                await self._recover(exc, self.step, in_step=False)
                await asyncio.sleep(0)     # a retry that fails at once must not starve the loop

    async def _end(self, step: int) -> None:
        self.pg._pinned_world = None
        m = self.pg.membership          # read once: epoch, rank and world of this vote agree
        epoch = m.epoch
        if epoch != self._step_epoch:
            # (named by the ranks the change lost: a failure's "lost" was empty when the step's
            # collectives had ended before a loss they never met, a CI run of the multi-host cut,
            # the network cut as the step's all_reduce returned)
            lost = self._lost_since(self._step_epoch, epoch)
            shown = describe_lost(self._epoch_lost, self._epoch_lost_launch, self._step_epoch, epoch)
            await self._recover(PeerLostError(
                f"membership changed during step {step} (epoch {self._step_epoch} -> {epoch})"
                + (f": {shown} lost" if lost else ""), ranks=lost, epoch=epoch if lost else None), step)
            return
        pending = None
        if self.sharded_state:
            # before the vote: if the step commits, the predecessor's state of it is here already
            self._skip_told = ""
            try:
                self.pg._pinned_world = self.pg.engine.world if self.pg.engine is not None else None
                # (watched for skipped collectives as the vote is: a rank that left the step early
                # waits here for a predecessor still in a collective it never called; the others
                # waited out their 60 s collective timeout, a re-verifier's find)
                pending = await self._skip_watched(
                    self._ring_exchange(m.rank, m.world_size, epoch, self._hosts(m.world_size, m)), step, epoch)
            except RECOVERABLE as exc:
                await self._recover(CollectiveMismatchError(self._skip_told) if self._skip_told else exc, step)
                return
            finally:
                self.pg._pinned_world = None
        t0 = time.monotonic()
        try:
            committed = await self._vote(step, epoch)
        except RECOVERABLE as exc:
            await self._recover(exc, step)
            return
        waited = time.monotonic() - t0
        if waited > 0.2 and committed:
            # The vote stalled, e.g. while the coordinator restarted: training waited, lost nothing.
            # (A step that then did not commit is a failure, reported as one: a stall "with no
            # step lost" beside "failure at step N; steps lost: 1" read as a contradiction.)
            injected = await self._injection_time(t0 + waited)
            if injected is not None and injected < self._step_t0:
                # a fault of an earlier step (a kill 106 steps before) did not stall this vote: a
                # fresh user's metrics.json had 5.1 s "to recover" for a vote that waited 1.00 s
                injected = None
            self._event({"event": "commit_stall", "step": step, "seconds": round(waited, 4),
                         "committed": committed, "t_start": t0, "t_injected": injected,
                         "time_to_recover_s": None if injected is None else round(t0 + waited - injected, 4)})
        if committed:
            self._same_step_failures.pop(step, None)
            self._evictions.pop(step, None)
            self._evicted_in_row = 0
            self.committed_world = (m.epoch, m.rank, m.world_size)
            self.committed_step = step
            self.step = step + 1
            if pending is not None:
                self._snapshot = pending[m.rank]
                self._ring = {"step": step, "epoch": epoch, "world": m.world_size, "blobs": pending}
                self._ring_kept = None
                if self._built_held:    # a committed step: the state as built is not needed
                    self._built_held = False
                    self.state.hold_built(False)
            else:
                # the last snapshot's memory is written over when nothing else reads it (it was
                # not sent since: _broadcast_bytes drops _reusable) and the layout is the same
                view, into = self._reusable if self._reusable is not None else (None, None)
                self._reusable = None
                if view is not self._snapshot:
                    into = None
                try:
                    self._snapshot = await self._pack(into)
                except BaseException:
                    if into is not None:   # (cancelled mid-copy: the old snapshot is torn)
                        self._holds_state = False
                        self._snapshot = None   # (never loaded: a roll-back takes a peer's)
                    raise
                self._reusable = (self._snapshot, self._snapshot.obj)
            self._holds_state = True
        elif self._skip_told:
            await self._recover(CollectiveMismatchError(self._skip_told), step)
        else:
            if self.pg.epoch == epoch:
                # the coordinator answers the votes it fails for a loss before it sends the new
                # epoch: wait for that, just behind (else the failure named no rank lost: a CI
                # run of the multi-host cut, 2 of 17 loaded runs of it here)
                with contextlib.suppress(RtxTimeoutError):
                    await self.pg.agent.wait_epoch(epoch, timeout_s=VOTE_EPOCH_WAIT_S, or_fenced=True)
            now = self.pg.epoch
            why = (f"epoch {epoch} -> {now}" if now != epoch else
                   f"in epoch {epoch}: another rank voted that it failed, or the vote got no answer")
            # (a loss that came during the vote was recorded as a failure that lost nobody: a CI
            # run of the multi-host cut)
            lost = self._lost_since(epoch, now)
            await self._recover(PeerLostError(f"step {step} was not committed ({why})", ranks=lost,
                                              epoch=now if lost else None), step)

    async def _vote(self, step: int, epoch: int) -> bool:
        """Vote that ``step`` succeeded here; whether it committed. While the vote is pending,
        every ``SKIP_POLL_S``: when peers have waited more than ``SKIP_AFTER_S`` in a collective
        this rank never called (it left the step early: a ``return`` or ``continue`` inside the
        guard, a branch that skips a collective on some ranks), ask for a new epoch, so the step
        fails on every rank at once, instead of the others waiting out their collective timeout
        (60 s) while this vote waits for theirs. Said in a ``collective_skipped`` warning, and
        kept in ``_skip_told``: the step fails here with a ``CollectiveMismatchError`` saying it.

        A peer may also be in the next step's collective because the coordinator answered its
        vote and not yet this rank's (frozen, or slow, between the two answers: a tester's run
        logged a skip that was not). So a collective counts as skipped only once the coordinator
        answered a heartbeat sent after its first message came, with the job's committed step
        below ``step``: a peer that went on had been told ``step`` committed before it sent that
        message, and the coordinator decides a step before it answers what it reads later."""
        self._skip_told = ""
        return await self._skip_watched(
            # (cast in the step's epoch: read by commit later, it could be a newer one's)
            self.pg.commit(step, {"epoch": epoch}, timeout=self.commit_timeout_s, epoch=epoch), step, epoch)

    async def _skip_watched(self, what: Any, step: int, epoch: int) -> Any:
        """Await ``what`` (the vote, or ``sharded_state``'s ring exchange before it), watching
        for a collective of ``step`` this rank skipped (see :meth:`_vote`); its result."""
        vote = asyncio.ensure_future(what)
        engine = self.pg.engine
        try:
            while engine is not None and not self._skip_told:
                done, _ = await asyncio.wait({vote}, timeout=SKIP_POLL_S)
                if done:
                    break
                heard = self.pg.agent.heartbeat_committed
                skipped = ([] if heard is None or heard[1] >= step
                           else engine.skipped(SKIP_AFTER_S, before=heard[0]))
                if skipped:
                    group, seq, senders = skipped[0]
                    why = (f"rank {self.pg.rank} ended step {step} while ranks {senders} wait in "
                           f"collective #{seq} of group {group.gid!r} in epoch {epoch}, which it did "
                           f"not call: the ranks' collectives differ in this step")
                    self._skip_told = why
                    log.warning("collective_skipped", step=step, group=group.gid, seq=seq,
                                waiting=senders, message=why)
                    try:
                        await self.pg.agent.reform(why, epoch)
                    except RtxError as exc:
                        log.warning("reform_failed", error=str(exc))
            return await vote
        finally:
            if not vote.done():
                vote.cancel()
                await asyncio.gather(vote, return_exceptions=True)

    async def _recover(self, exc: BaseException, step: int, *, in_step: bool = True) -> None:
        """Roll back after ``exc`` failed ``step`` (``in_step``: in the step or its vote; else in
        the sync or the failure's closing before it, where none of it ran)."""
        self.pg._pinned_world = None
        sync_failed_in, self._sync_failed_in = self._sync_failed_in, None
        if self.pg.agent.closed:
            # the group was closed (close(), or the release at interpreter exit after Ctrl-C):
            # nothing to recover, and every retry would fail at once (a breaker's find: ranks
            # interrupted while waiting for a replacement spun, logging 190,000 lines, until
            # rtxnet-run killed them)
            raise exc
        now = time.monotonic()
        if self._open_failure is None:
            seen = [t for e, t in self._epoch_seen.items() if e > self._synced_epoch or e == -1]
            detected = min(seen + [now])
            # a fence (-1) counts once: a later failure of a rank fenced before, and rejoined, is
            # detected when it happens (its time to recover was measured from the old fence)
            self._epoch_seen.pop(-1, None)
            at_step = step
            if not in_step and self._synced_epoch < 0:
                # a process that never synced (a replacement, a fresh start) counts steps from 0:
                # its failure is at the job's next step (a breaker read "failure at step 0" of a
                # replacement whose sync before step 4 lost a rank)
                with contextlib.suppress(ConfigError):
                    at_step = max(step, self.pg.membership.committed_step + 1)
            self._open_failure = {
                "event": "failure", "step": at_step, "in_step": in_step, "error": type(exc).__name__, "message": str(exc),
                # only a PeerLostError's ranks are lost; a CollectiveTimeout's did not contribute
                # in time (slow, frozen for a while) and may still be members
                "lost": list(exc.ranks) if isinstance(exc, PeerLostError) else [],
                "late": list(exc.ranks) if isinstance(exc, CollectiveTimeout) else [],
                "epoch": self._synced_epoch,
                # the epoch the late ranks are numbered in: a sync's is the new epoch (named as
                # of the synced one, a joiner late in it was "rank 1", not its launch rank)
                "late_epoch": (exc.epoch if isinstance(exc, CollectiveTimeout) and exc.epoch is not None
                               else self._synced_epoch),
                # this rank itself was declared lost (frozen, cut off) and must rejoin
                "fenced": bool(self.pg.agent.fenced),
                "t_detected": detected, "t_caught": now, "committed_step": self.committed_step,
            }
            self._event(dict(self._open_failure))
            log.warning("step_failed", step=step, error=type(exc).__name__, message=str(exc),
                        committed_step=self.committed_step)
        # Roll back to the last committed state. The state must load its own snapshot: an
        # exception of its load_state_dict is the user's, and propagates (it was swallowed as a
        # refusal: no rank held the state, training went on "at step 0" with the parameters not
        # rolled back and exit code 0: a breaker's find; then still for any RtxError, such as a
        # CheckpointError of the user's own loading: a re-verifier's). Refusals stay where they
        # are expected, and the sync gets a peer's state or a checkpoint: StateLayoutError
        # (FSDP's shards of another world or layout), and, with sharded_state outside the last
        # sync's rank and world, any other (a state of one's own laid out per rank), logged as
        # a warning: a bug of the loader that the ring copies then mend is not silent either.
        own_world = self._synced_at == (self.pg.rank, self.pg.world_size)
        self._holds_state = await self._load_snapshot(
            self._snapshot, "its own last committed state",
            quiet=lambda exc: self.sharded_state and isinstance(exc, StateLayoutError),
            propagate=lambda exc: not isinstance(exc, StateLayoutError) and (own_world or not self.sharded_state),
            step=step)
        self.step = self.committed_step + 1
        if self.pg.epoch == self._synced_epoch and not self.pg.agent.fenced:
            # Nobody was lost (a timeout, a mismatch, a message lost on the way): some ranks may
            # have completed an operation that others did not, so their sequence numbers no longer
            # agree. Ask for a fresh epoch with the same members: every rank's in-flight work fails,
            # all roll back to the committed state and re-sync, in step again.
            # A rank cut off from the coordinator cannot be re-formed (nor learn that the others
            # moved on without it): say so instead of retrying the step into a wall.
            self.pg.agent.check_coordinator(f"step {step} failed ({type(exc).__name__})")
            evict = self._late_to_evict(exc, step)
            if not evict:
                self._count_failure(exc, step)
                await self._ask_reform(exc, step, self._synced_epoch, evict)
            else:
                self._count_eviction(exc, step, evict)
                if await self._ask_reform(exc, step, self._synced_epoch, evict):
                    self._count_failure(exc, step, give_up=False)
                else:
                    # refused (they hold the committed state, this rank does not): nobody was
                    # evicted and no epoch opened (theirs, evicting this rank, is the one that
                    # stands); a failure of the step as any other
                    self._evictions[step] -= 1
                    self._count_failure(exc, step)
        elif isinstance(exc, CollectiveTimeout) and exc.ranks and not self.pg.agent.fenced:
            # The sync of a new epoch timed out waiting for members that do not come (a rank
            # hung with its heartbeats going on): it was retried until they came, for ever for
            # one that never does. Evict them as in a step; else give up after as many tries.
            epoch = self.pg.epoch
            evict = self._late_to_evict(exc, step)
            refused = bool(evict) and not await self._ask_reform(exc, step, epoch, evict)
            if refused:
                evict = []   # they hold the committed state: theirs, evicting this rank, stands
            self._sync_timeouts += 1
            if not evict and self._sync_timeouts > self.max_step_retries:
                why = ("which hold the job's last committed step and could not be evicted by this "
                       "rank, admitted after it (and which did not evict it: are they hung?)"
                       if refused else f"which the world cannot go on without (min_world_size="
                                       f"{self.min_world_size})")
                raise RtxError(
                    f"step {step}: the sync of a new epoch (now {epoch}) timed out "
                    f"{self._sync_timeouts} times in a row waiting for ranks (max_step_retries="
                    f"{self.max_step_retries}), {why}; last error: {exc}") from exc
        elif not in_step and sync_failed_in == self.pg.epoch and not self.pg.agent.fenced:
            await self._after_failed_sync(exc, step, sync_failed_in)
        elif self._only_reformed_since_sync() and not self.pg.agent.fenced:
            # Re-formed (same members) since the step began, by a rank that found the step
            # failing (a skipped collective: its vote asks for the re-form), so this rank sees
            # the epoch change as its error: the same failure again all the same. Counted, or a
            # step one rank always fails was retried for ever (126 tries in a tester's run).
            self._count_failure(exc, step)

    async def _after_failed_sync(self, exc: BaseException, step: int, epoch: int) -> None:
        """The sync of ``epoch`` failed with ``exc`` and the membership has not changed: a loss
        the epoch has not followed yet (a broken link: ``PeerLostError``) is waited for, up to
        twice the heartbeat timeout; else, as a step that fails without a membership change, the
        failure is counted (``RtxError`` past ``max_step_retries``) and a fresh epoch with the
        same members is asked for, so that every rank syncs again, together. Before, the rank
        synced again at once, alone, as often as it failed: a sync that failed the same way each
        time spun (three ranks at 22% CPU each until rtxnet-run's timeout, no line logged), and
        one whose peers had completed it went out of step with them."""
        if isinstance(exc, PeerLostError):
            await self._await_announced_epoch(epoch)
            if self.pg.epoch != epoch or self.pg.agent.fenced:
                if not self.pg.agent.fenced and self._only_since(epoch, self._epoch_same):
                    # a peer's re-form for the same failure: counted here too (each rank
                    # counted only the re-forms it asked for, up to one per rank and try)
                    self._count_failure(exc, step, what="the sync before step {step}")
                return
        self.pg.agent.check_coordinator(f"the sync before step {step} failed ({type(exc).__name__})")
        self._count_failure(exc, step, what="the sync before step {step}")
        await self._ask_reform(exc, step, epoch, [])

    def _count_failure(self, exc: BaseException, step: int, *, give_up: bool = True,
                       what: str = "step {step}") -> None:
        """Count a failure of ``step`` (or of the sync before it: ``what``) without a membership
        change; past ``max_step_retries`` raise ``RtxError`` naming it (unless not ``give_up``:
        an eviction comes instead)."""
        self._same_step_failures[step] = n = self._same_step_failures.get(step, 0) + 1
        if n > self.max_step_retries and give_up:
            raise RtxError(
                f"{what.format(step=step)} failed {n} times without a membership change "
                f"(max_step_retries={self.max_step_retries}); last error: {type(exc).__name__}: {exc}"
            ) from exc

    def _count_eviction(self, exc: BaseException, step: int, evict: list[int]) -> None:
        """Count an eviction this rank asks for in ``step``; past ``max_step_retries`` raise
        ``RtxError``: the ranks evicted come back (a fenced rank rejoins) and are late again, so
        the step never commits. Hosts that reach the coordinator but not each other (a firewall
        on the data ports, a bind address the others cannot reach) evicted and readmitted each
        other's ranks for ever, each side in turn (a tester's find: 5.5 minutes, 14 epochs, not
        a step committed)."""
        self._evictions[step] = n = self._evictions.get(step, 0) + 1
        if n > self.max_step_retries:
            raise RtxError(
                f"step {step}: ranks were evicted {n - 1} times for not taking part in time and "
                f"came back each time (now launch ranks {self._launch_ranks(self._synced_epoch, evict)} "
                f"again; max_step_retries={self.max_step_retries}): if they run on other hosts, "
                f"those may reach the coordinator but not this one's ranks (a firewall on the data "
                f"ports, --bind-host); last error: {type(exc).__name__}: {exc}") from exc

    async def _ask_reform(self, exc: BaseException, step: int, epoch: int, evict: list[int]) -> bool:
        """Ask the coordinator for a fresh epoch in place of ``epoch`` after ``exc`` failed
        ``step``, leaving out the ranks ``evict`` (numbered as in ``epoch``; said in a warning).
        A request that fails is logged: the next failure asks again. Returns False when the
        coordinator refused the eviction (``evict`` hold the job's last committed step and this
        rank, admitted after it, does not: ``eviction_refused`` in the log), else True."""
        if evict:
            log.warning("evicting_late_ranks", step=step, ranks=evict, epoch=epoch,
                        launch_ranks=self._launch_ranks(epoch, evict),
                        tries=self.evict_late_after, error=str(exc))
        try:
            body = await self.pg.agent.reform_request(
                f"rank {self.pg.rank}: {type(exc).__name__}: {exc}", epoch, evict=evict)
        except RtxError as exc2:
            log.warning("reform_failed", error=str(exc2))
            return True
        if body.get("refused"):
            log.warning("eviction_refused", step=step, ranks=evict, epoch=epoch, why=body["refused"])
            return False
        if isinstance(body.get("epoch"), int) and body["epoch"] > epoch:
            # the epoch it opened, before going on: the answer may come before its push, and a
            # rank that went on closed its failure in the old epoch and then failed the step
            # again when the push came (one lost message reported as two recoveries, each
            # "steps lost 1": a fresh user's find)
            await self._await_announced_epoch(epoch)
        return True

    async def _pause_if_evicted(self) -> None:
        """Before an evicted rank rejoins, wait: ``heartbeat_timeout_s`` after its first eviction
        since it last took part in a commit, doubling with each one more, up to
        ``REJOIN_PAUSE_MAX_S``. An evicted rank is alive and reaches the coordinator; when it
        cannot reach the others' data ports (hosts cut from each other, not from the
        coordinator), each rejoin costs them a sync that times out, and rejoining at once made
        the job a livelock (a tester's find: about one step per 20 s, for good). A rank that
        was only slow once rejoins after one heartbeat timeout. While the other members' data
        ports give no TCP answer, it pauses again, doubling (:func:`_unreachable_peers`): the
        cut costs the others one sync timeout, not one per pause."""
        reason = self.pg.agent.fence_reason
        if not reason.startswith("evicted"):
            return
        # the syncs that timed out before were in a world this rank has left: counted afresh
        # (the side evicted, readmitted and evicted again gave up with "the world cannot go on
        # without" ranks the others went on without)
        self._sync_timeouts = 0
        self._evicted_in_row += 1
        pause = min(self.pg.agent.timeouts.heartbeat_timeout_s * 2 ** (self._evicted_in_row - 1),
                    REJOIN_PAUSE_MAX_S)
        log.warning("rejoin_paused", seconds=round(pause, 3), evictions_in_row=self._evicted_in_row,
                    why=reason)
        agent = self.pg.agent
        while True:
            # cut short when the job ends meanwhile (the join then says so: JobFinishedError); a
            # rank still pausing when the others finished was killed by rtxnet-run, exit 137
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):   # (asyncio.wait_for may lose a cancellation: ControlClient.request)
                    await agent.gone.wait()
            if agent.gone.is_set() or pause >= REJOIN_PAUSE_MAX_S:
                return
            unreachable = await _unreachable_peers(agent.membership, agent.identity,
                                                   min(max(agent.timeouts.heartbeat_timeout_s, 0.5), 2.0))
            if not unreachable:
                return
            # Readmitted now, it would cost the others a sync that times out (hosts cut from
            # each other, not from the coordinator: a tester's 2 minutes per rejoin at the 60 s
            # default). It waits instead, doubling, and rejoins at the cap whatever the probe
            # says (an endpoint may be stale: its host gone for good).
            pause = min(pause * 2, REJOIN_PAUSE_MAX_S)
            log.warning("rejoin_deferred", seconds=round(pause, 3), unreachable=unreachable,
                        why="no TCP answer from these peers' data ports: rejoining would cost "
                            "them a sync that times out")

    def _late_to_evict(self, exc: BaseException, step: int) -> list[int]:
        """The ranks (numbered as in the synced epoch) to evict after this failure of ``step``:
        those that ``evict_late_after`` timeouts of its tries in a row named (by identity, as
        ranks renumber), when the world without them is still ``min_world_size`` ranks or more;
        else none."""
        if not isinstance(exc, CollectiveTimeout) or not exc.ranks:
            self._late_streak.pop(step, None)
            return []
        members = self.pg.membership.members if self.pg.membership is not None else {}
        ids = frozenset(members[r]["identity"] for r in exc.ranks if r in members)
        if len(ids) != len(set(exc.ranks)) or self.pg.rank in exc.ranks:
            self._late_streak.pop(step, None)
            return []
        seen, count = self._late_streak.get(step, (frozenset(), 0))
        count = count + 1 if ids == seen else 1
        self._late_streak = {step: (ids, count)}
        if (self.evict_late_after is None or count < self.evict_late_after
                or self.pg.world_size - len(ids) < self.min_world_size):
            return []
        return sorted(set(exc.ranks))

    async def _wait_world(self) -> None:
        agent = self.pg.agent
        loop_deadline = time.monotonic() + self.rejoin_window_s
        try:
            while agent.fenced or self.pg.world_size < self.min_world_size:
                if agent.fenced:
                    # declared lost while waiting (frozen, cut off): no epoch comes to a fenced
                    # rank, so join again now rather than wait out the window in a world that
                    # left it
                    await self._pause_if_evicted()
                    log.warning("rejoining", reason="fenced while waiting for ranks")
                    await agent.join()
                    continue
                remaining = loop_deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousError(
                        f"world_size({self.pg.world_size}) < min_world_size({self.min_world_size}) "
                        f"after waiting rejoin_window_s({self.rejoin_window_s}) for replacements; "
                        f"let the job go on with fewer ranks (rtxnet-run --min-ranks, or "
                        f"RTXNET_MIN_RANKS for ranks started by hand) or restart lost ones "
                        f"(--max-restarts)")
                log.info("waiting_for_ranks", world_size=self.pg.world_size,
                         min_world_size=self.min_world_size)
                # the heartbeats say so: rtxnet-run reads it from status, and stops the job at
                # once when no rank can come (a rank that exited 0 before finish())
                agent.waiting_for = self.min_world_size
                try:
                    await agent.wait_epoch(self.pg.epoch, timeout_s=remaining, or_fenced=True)
                except RtxTimeoutError:
                    continue
        finally:
            agent.waiting_for = None

    async def _sync(self) -> None:
        """Agree on the newest committed state and give it to every member (one collective round).

        Every collective of the sync goes to the world group of the epoch it began in (pinned):
        when the membership changes during it they raise ``PeerLostError`` there, recovered
        from. Unpinned, they went to the new world with the old world's ranks and sizes (a test
        run: a ring send to rank 2 in the new world of 2 raised ``ValueError`` and ended the
        job)."""
        await self.pg._until_world_entered()   # a view held for an orderly leave: entered first
        epoch = self.pg.epoch
        try:
            with self.pg.pinned():
                await self._sync_pinned()
        except _SyncAgain:
            raise
        except RECOVERABLE:
            self._sync_failed_in = epoch    # (for _recover)
            raise
        # every rank goes on from the synced state: the point-to-point messages earlier changes
        # discarded belong to steps now redone (a pipeline stage's recv would raise for them)
        if self.pg.engine is not None:
            self.pg.engine.forget_p2p_dropped()

    async def _sync_pinned(self) -> None:
        pg = self.pg
        epoch, rank, world = pg.epoch, pg.rank, pg.world_size
        await self._check_same_layout(world)
        if self.sharded_state:
            job_committed = pg.membership.committed_step
            best = await self._sync_sharded(job_committed)
            await self._rewind_job(best, job_committed)
            self._synced(best, epoch, rank, world, "sharded")
            return
        # (layers built after FaultTolerance was: refused before one rank's state is handed on)
        _refuse_rank_specific(" (at the sync of a new epoch)")
        before = self._synced_at
        if (self._holds_state and before is not None and before != (rank, world)
                and self._laid_out_for() == before):
            # Shards laid out for the world of the last sync, which changed (FSDP): a rank lost
            # between steps left this rank's live state as it was (nothing rolled back, so no
            # load refused it), and the next forward raised ConfigError "the shards are laid
            # out for world_size(2)" in the world of 1 (a CI run). It holds no state for this
            # world: a peer's or the newest checkpoint's is loaded, as after a refused roll-back.
            log.warning("state_laid_out_for_another_world", laid_out_for=list(before), rank=rank,
                        world_size=world)
            self._holds_state = False
        mine = np.array([self.committed_step if self._holds_state else -1], dtype=np.int64)
        steps = np.zeros(world, dtype=np.int64)
        await pg.all_gather(steps, mine)
        best = int(steps.max())
        src = int(np.flatnonzero(steps == best)[0])
        job_committed = pg.membership.committed_step
        if best == -1 and world > 1:
            await self._sync_replicas_at_start(src)
        if best < job_committed:
            # No live member holds the last committed state: fall back to the newest checkpoint.
            restored = await self._restore_checkpoint(best, job_committed)
            if restored is None:
                self._state_lost(epoch, world, job_committed, best)
            else:
                best = restored
                steps[:] = best  # every rank loaded the same checkpoint: nothing to broadcast
                self._snapshot = await self._pack()
                if self._open_failure is None:
                    # This process saw no failure: it started after every rank that held the
                    # committed state was gone (all killed and restarted, say). Say so.
                    await self._restored_event(job_committed, restored, epoch, world)
        if not np.all(steps == best):
            blob = await self._broadcast_bytes(self._snapshot if rank == src else None, src)
            loaded = True
            if steps[rank] != best:     # a rank already at ``best`` keeps its own state
                self._snapshot = blob
                loaded = await self._load_snapshot(self._snapshot, f"the state of rank {src}")
                if loaded:
                    log.info("state_synced", source=src, step=best, nbytes=len(blob))
            # Every rank must hold the same state now; a state that cannot be loaded in this
            # world (FSDP: a rank's shards fit only its own rank and world size) sends every
            # rank to the newest checkpoint.
            oks = np.zeros(world, dtype=np.int64)
            await pg.all_gather(oks, np.array([int(loaded)], dtype=np.int64))
            if not oks.all():
                best = await self._fall_back_to_checkpoint(np.flatnonzero(oks == 0).tolist(), src,
                                                            job_committed, world)
        await _faults.apoint("sync", pg=pg, step=best + 1)   # fault injection: "during the re-form"
        await self._rewind_job(best, job_committed)
        self._synced(best, epoch, rank, world, src)

    async def _sync_replicas_at_start(self, src: int) -> None:
        """Before any committed step: the modules of :func:`note_unsynced_replica` (DDP built
        with ``init_sync=False``) made equal on every rank. One all_gather of a digest (BLAKE2b,
        8 bytes) of their parameters and buffers, in order; where any rank's differs from rank
        ``src``'s, each tensor is broadcast from ``src`` in place. Every member runs this sync
        (nothing committed: all of them are fresh), so the collectives match; modules that
        differ in shape fail in the broadcast (``CollectiveMismatchError``)."""
        pg = self.pg
        mods = [m for m, g in list(_UNSYNCED_REPLICAS.items()) if g is pg]
        tensors = [t for m in mods for t in (*m.parameters(), *m.buffers())]

        def digest() -> int:
            import torch  # (only torch modules are recorded)

            h = hashlib.blake2b(digest_size=8)
            for t in tensors:
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            return int.from_bytes(h.digest(), "little", signed=True)

        mine = await asyncio.to_thread(digest) if tensors else 0
        digests = np.zeros(pg.world_size, dtype=np.int64)
        await pg.all_gather(digests, np.array([mine], dtype=np.int64))
        differ = np.flatnonzero(digests != digests[src]).tolist()
        if not differ:
            return
        log.warning("replicas_differ_at_start", ranks=differ, source=src,
                    hint=f"their parameters or buffers differ (a rank-dependent seed?): every rank "
                         f"takes rank {src}'s")
        for t in tensors:
            await pg.broadcast(t.data, src)

    async def _rewind_job(self, best: int, job_committed: int) -> None:
        """Every rank goes on from step ``best`` (-1: from scratch), older than the job's committed
        step ``job_committed``: no live rank and no checkpoint holds the steps between. The job's
        committed step moves back to ``best`` (journaled by the coordinator; every rank asks, the
        first acts), so those steps are voted on again: before, their commits were answered
        "already committed" without a vote, and ``finish()`` before the old step turned every
        rank away as admitted after the last commit (a relaunched job with fewer steps failed
        after training)."""
        if best >= job_committed:
            return
        if await self.pg.agent.rewind(best):
            log.warning("job_rewound", from_step=job_committed, to_step=best, epoch=self.pg.epoch)

    async def _check_same_layout(self, world: int) -> None:
        """When the state has ``layout_digest()`` (:class:`rtxnet.parallel.FSDPState`): one
        all_gather of it, and ``ConfigError`` on every rank when some rank's differs from rank
        0's (modules built differently, e.g. layers registered in another order: their flat
        parameters would be exchanged by position). FSDP checks this itself with ``init_sync``,
        which FaultTolerance's replacements cannot use (a tester's find)."""
        digest_of = getattr(self.state, "layout_digest", None)
        if not callable(digest_of):
            return
        got = np.zeros(world, dtype=np.int64)
        await self.pg.all_gather(got, np.array([digest_of()], dtype=np.int64))
        differ = [k for k, d in enumerate(got.tolist()) if d != got[0]]
        if differ:
            raise ConfigError(f"FaultTolerance: the ranks' models differ: rank(s) {differ} have a "
                              f"layout unlike rank 0's (parameter names, their order, shapes or "
                              f"dtypes); build the same module on every rank")

    def _laid_out_for(self) -> tuple[int, int] | None:
        """``state.sharded_layout()`` (FSDP: the rank and world size the shards are laid out
        for), or None where the state has none or it does not answer (a state class with the
        method for one strategy, called under another: train_digits' under DDP raises
        ``AttributeError``)."""
        layout = getattr(self.state, "sharded_layout", None)
        if not callable(layout):
            return None
        try:
            rank, world = (int(v) for v in layout())
        except Exception:   # noqa: BLE001 - the user's method: no answer means no layout
            return None
        return rank, world

    def _synced(self, best: int, epoch: int, rank: int, world: int, src: Any) -> None:
        self._holders_until = None
        self.committed_step = best
        self.step = best + 1
        self._holds_state = True
        self._synced_epoch = epoch
        self._synced_at = (rank, world)
        self._report_joins()
        if hasattr(self.state, "on_world"):
            self.state.on_world(rank, world)
        log.info("group_in_sync", epoch=epoch, world_size=world, step=self.step, source=src)

    async def _restore_checkpoint(self, best: int, job_committed: int) -> int | None:
        raw = await self.pg.store.get(CHECKPOINT_STORE_KEY)   # not via rtxnet.checkpoint: torch
        self._checkpoint_recorded = raw is not None
        if raw is None or self.load_checkpoint is None:
            log.warning("committed_state_lost", job_committed_step=job_committed, best_live_step=best,
                        reason="no checkpoint recorded" if raw is None else "no load_checkpoint given")
            return None
        info = json.loads(raw)
        # The checkpoint of step N holds N completed steps (0..N-1): the state to run step N
        # from, as a training loop saves it before step N (and as ``start_step`` takes it).
        held = int(info["step"]) - 1
        # (held == best: the live ranks' newest state may be that very checkpoint, loaded when
        # they started (a --resume run whose every rank died before it saved): loaded again on
        # every rank, it is a restore, not a loss; the loss was reported before, a tester's find)
        if held < best:
            log.warning("committed_state_lost", job_committed_step=job_committed, best_live_step=best,
                        reason=f"the newest checkpoint (step {info['step']}) is no newer than the "
                               f"live ranks' state")
            return None
        step = await self._load_intact_checkpoint(int(info["step"]), info["root"], best)
        if step is None:
            log.warning("committed_state_lost", job_committed_step=job_committed, best_live_step=best,
                        reason=self._checkpoint_unusable)
            return None
        held = step - 1
        log.warning("restored_from_checkpoint", step=step, committed_step=held,
                    root=info["root"], job_committed_step=job_committed)
        return held

    async def _load_intact_checkpoint(self, step: int, root: str, best: int) -> int | None:
        """Load checkpoint ``step`` of ``root`` on every rank (``load_checkpoint``), else the
        newest older one that every rank can load: the step loaded, or None when none newer than
        the live state ``best`` loads. A checkpoint one rank cannot read (a corrupt or missing
        shard: ``CheckpointError``, ``OSError``; only that rank reads its shard of a replicated
        state) fails on that rank alone, so the ranks agree after each try (one all_gather) and
        all fall back together to :func:`rtxnet.checkpoint.latest` below it (which skips corrupt
        steps). Before, the first rank's error ended the job though an older intact step was on
        disk (a tester's find)."""
        from .checkpoint import CheckpointError, latest

        pg = self.pg
        loaded = False   # this rank's loader ran through once: the state is no longer its own
        while True:
            err: BaseException | None = None
            try:
                # the user's loader (e.g. rtxnet.checkpoint.load), in a worker thread as
                # :meth:`_pack`: reading gigabytes on the loop would stop the heartbeats
                await asyncio.to_thread(self.load_checkpoint, step, root)
                loaded = True
            except (CheckpointError, OSError) as exc:
                err = exc
            bad = np.zeros(pg.world_size, dtype=np.int64)
            await pg.all_gather(bad, np.array([int(err is not None)], dtype=np.int64))
            if not bad.any():
                return step
            # off the loop: it reads and hashes every shard of the steps it looks at
            older = await asyncio.to_thread(latest, root, before=step)
            failed = np.flatnonzero(bad).tolist()
            log.warning("checkpoint_unusable", step=step, ranks=failed, root=root,
                        error=f"{type(err).__name__}: {err}" if err is not None else "on another rank",
                        falls_back_to=older)
            if older is None or older - 1 <= best:
                self._checkpoint_unusable = (
                    f"the newest recorded checkpoint (step {step}) could not be loaded on ranks "
                    f"{failed} and no older intact one is newer than the live ranks' state")
                if loaded:
                    # this rank loaded a checkpoint the others could not: back to the state it
                    # held (its step is what the sync compares), or the replicas would diverge
                    # (a tester's find: 80 against 50 after the same steps, exit 0)
                    await self._load_snapshot(self._snapshot, "its own state before the checkpoint",
                                              quiet=True)
                return None
            step = older

    def _state_lost(self, epoch: int, world: int, job_committed: int, best: int) -> None:
        """Training goes on from ``best``, the newest live state (-1: none, from scratch): the
        steps committed after it are gone, and the summary must say so, once (a sync in the next
        epoch, before a step commits, finds the same loss)."""
        if any(e["event"] == "state_lost" and e["job_committed_step"] == job_committed
               for e in self.events):
            return
        self._event({"event": "state_lost", "epoch": epoch, "world_size": world,
                     "job_committed_step": job_committed, "resumed_step": best + 1,
                     "steps_lost": job_committed - best, "why": self._no_checkpoint_why()})

    def _no_checkpoint_why(self) -> str:
        """Why no checkpoint could stand in, in words (after :meth:`_restore_checkpoint`)."""
        if self.load_checkpoint is None:
            return ("save checkpoints with rtxnet.checkpoint.save(..., pg=pg) and pass "
                    "FaultTolerance(load_checkpoint=)" + (
                        " (the checkpoint functions need the blocking group of rtxnet.init())"
                        if self._portal is None else ""))
        if not getattr(self, "_checkpoint_recorded", False):
            return ("load_checkpoint was given, but the job has recorded no checkpoint yet: "
                    "rtxnet.checkpoint.save(..., pg=pg) records one")
        return self._checkpoint_unusable or (
            "the newest recorded checkpoint is no newer than the live ranks' state")

    async def _pack(self, into: np.ndarray | None = None) -> memoryview:
        """``pack_state(state.state_dict(), into=into)``, in a worker thread: the loop goes on
        meanwhile (heartbeats), as the copies release the GIL (a 1.5 GB state packed on the loop
        took seconds, and the coordinator declared every rank lost at its first step)."""
        return await asyncio.to_thread(lambda: pack_state(self.state.state_dict(), into=into))

    async def _load_snapshot(self, blob: Any, what: str, quiet: bool | Callable[[Exception], bool] = False,
                             propagate: Callable[[Exception], bool] | None = None,
                             step: int | None = None) -> bool:
        """Load ``blob`` into the state (in a worker thread, as :meth:`_pack`); False (logged)
        when the state refuses it. ``quiet`` (or ``quiet(exc)``): a refusal is expected (sharded
        state after the world changed: the sync reshards it) and logged at debug level only: a
        user read the line as an error in a recovery that went well.

        Raises:
            Exception: what the state's ``load_state_dict`` raised, where ``propagate(exc)``
                says it is not a refusal (a note names the roll-back of ``step``)."""
        try:
            value = await asyncio.to_thread(unpack_state, blob)
        except Exception as exc:   # noqa: BLE001 - none kept (torn), or not rtxnet's format
            log.warning("state_unpack_failed", what=what, error=type(exc).__name__, detail=str(exc))
            return False
        try:
            await asyncio.to_thread(self.state.load_state_dict, value)
            return True
        except Exception as exc:   # noqa: BLE001 - the user's loader: any refusal means "cannot"
            if propagate is not None and propagate(exc):
                exc.add_note(f"rtxnet: raised by the state's load_state_dict while FaultTolerance "
                             f"rolled step {step} back to {what} (committed step "
                             f"{self.committed_step}): a state must load its own state_dict()")
                raise
            (log.debug if (quiet(exc) if callable(quiet) else quiet) else log.warning)(
                "state_load_refused", what=what, error=type(exc).__name__, detail=str(exc),
                world_size=self.pg.world_size, rank=self.pg.rank)
            return False

    async def _broadcast_bytes(self, data: Any, src: int) -> Any:
        """``data`` (a blob: bytes-like) of rank ``src`` (None elsewhere) on every rank: its
        length, then its bytes, received into a uint8 array (not copied again). A snapshot sent
        is not written over by the next one (``_reusable``)."""
        if data is not None:
            self._reusable = None
        n = np.array([0 if data is None else len(data)], dtype=np.int64)
        await self.pg.broadcast(n, src)
        buf = (np.frombuffer(data, dtype=np.uint8) if data is not None   # read-only: the source
               else np.empty(int(n[0]), dtype=np.uint8))
        await self.pg.broadcast(buf, src)
        return data if data is not None else buf

    def _lost_since(self, epoch: int, now: int) -> list[int]:
        """The ranks the epochs after ``epoch`` up to ``now`` lost (each numbered as of the epoch
        before it), as a collective's PeerLostError names them."""
        return [r for e, rs in sorted(self._epoch_lost.items()) if epoch < e <= now for r in rs]

    def _hosts(self, world: int, m: Any) -> list[str]:
        """The host of each rank of the world of membership ``m`` (the same on every rank; ``""``
        where unknown)."""
        members = getattr(m, "members", None) or {}
        return [str((members.get(q) or {}).get("host") or "") for q in range(world)]

    @staticmethod
    def _ring_order(hosts: list[str]) -> list[int]:
        """The ring of ``sharded_state`` over ranks ``0..len(hosts)-1`` (``hosts[q]``: rank
        ``q``'s host): each rank's state is kept by the next rank of this order. The hosts take
        turns (one rank of each, in order of their lowest rank), so each rank's successor is on
        another host wherever the other hosts have ranks left: a lost host then leaves every
        state on a live rank. Before, the successor was ``rank + 1``, on the same host for all
        but a host's last rank, and losing a host ended the job (a tester's find). One host:
        ``0, 1, ..., W-1``, as before."""
        by_host: dict[str, list[int]] = {}
        for q, h in enumerate(hosts):
            by_host.setdefault(h, []).append(q)
        cols = list(by_host.values())
        return [qs[i] for i in range(max(map(len, cols), default=0)) for qs in cols if i < len(qs)]

    @classmethod
    def _ring_neighbours(cls, rank: int, hosts: list[str]) -> tuple[int, int]:
        """``(successor, predecessor)`` of ``rank`` in :meth:`_ring_order`."""
        order = cls._ring_order(hosts)
        i = order.index(rank)
        return order[(i + 1) % len(order)], order[(i - 1) % len(order)]

    @classmethod
    def _kept_after_sync(cls, old_world: int, hosts: list[str], rank: int) -> list[int]:
        """The ranks of the world of ``old_world`` whose committed states rank ``rank`` of the
        new world (``hosts``, one per rank) keeps after a sync that gave every rank all of them:
        old rank ``k`` stays on the new rank at position ``k mod W`` of :meth:`_ring_order` and on
        its successor there (another host where there is one), so each lives on two ranks of the
        new world (one when ``W`` is 1), about ``2 * old_world / W`` states per rank. Before,
        every rank dropped them once loaded, and a rank lost before the new world's own ring
        copy was made ended the job when it held the only copy of a lost neighbour's state (a
        tester's find)."""
        order = cls._ring_order(hosts)
        w = len(order)
        return [k for k in range(old_world)
                if rank in (order[k % w], order[(k % w + 1) % w])]

    async def _ring_exchange(self, rank: int, world: int, epoch: int, hosts: list[str]) -> dict[int, Any]:
        """Send this rank's state to its ring successor and take its predecessor's (sharded
        state; :meth:`_ring_order` over ``hosts``, the world of ``epoch``'s); returns
        ``{rank: own blob, predecessor: its blob}``.

        The tags name the epoch: a predecessor's message that an epoch change broke off before
        it was taken here is marked dropped by the engine (its next receive from that peer and
        tag raises PeerLostError), and with one tag for all epochs the next sync's receive from
        the same peer raised it at once; the rank then synced again alone in the same epoch
        while the others stepped (CollectiveMismatchError, all_gather against all_reduce, or
        timeouts, four times: the job ended; a CI run, 7 of 24 runs under load of a job of 4
        that lost 2 ranks in one recovery)."""
        own = await self._pack()
        if world == 1:
            return {rank: own}
        nxt, prv = self._ring_neighbours(rank, hosts)
        tag = _RING_TAG + 2 * epoch
        n_in = np.zeros(1, dtype=np.int64)
        await asyncio.gather(self.pg.send(np.array([len(own)], dtype=np.int64), nxt, tag=tag),
                             self.pg.recv(n_in, prv, tag=tag))
        got = np.empty(int(n_in[0]), dtype=np.uint8)
        await asyncio.gather(self.pg.send(np.frombuffer(own, dtype=np.uint8), nxt, tag=tag + 1),
                             self.pg.recv(got, prv, tag=tag + 1))
        return {rank: own, prv: got}

    async def _sync_sharded(self, job_committed: int) -> int:
        """The sync of ``sharded_state``: every rank gets every committed rank's state (held by
        its owner or its ring successor) and reshards it with ``state.load_state_dicts``, or all
        load the newest checkpoint when some rank's state is gone. Returns the committed step."""
        pg = self.pg
        # read once: the hosts of the ring are those of the world the sync is pinned to (read
        # again later, they were the next epoch's when it came during the sync: a world of 4
        # with the host of rank 3 unknown, another ring order)
        m = pg.membership
        epoch, rank, world = m.epoch, m.rank, m.world_size
        hosts = self._hosts(world, m)
        ring, kept = self._ring, self._ring_kept
        if ring is None:     # a fresh process: its state as built (the snapshot), nothing committed
            built_rank, built_world = self._built
            mine = [0, self.committed_step, -1, built_world, built_rank, -1]
        else:
            mine = self._ring_row(ring)
        mine += self._ring_row(kept) if kept is not None else [0, -1, -1, 0, -1, -1]
        more = list(kept["blobs"])[2:] if kept is not None else []
        # the last column: this rank's live state is the one its row names (see in_place below)
        mine += [int(self._built_held), len(more), int(self._holds_state)]
        # and how long this recovery's wait for state holders has left, in ms (-1: none began
        # here; a replacement's), so that every rank waits alike (_wait_for_holders)
        mine += [-1 if self._holders_until is None
                 else max(0, int((self._holders_until - time.monotonic()) * 1000))]
        both = np.zeros((world, 16), dtype=np.int64)
        await pg.all_gather(both, np.array(mine, dtype=np.int64))
        # the kept rings' further ranks (a kept ring may hold more than two: _kept_after_sync),
        # in a second round only when some rank has any
        extra = None
        n_more = int(both[:, 13].max())
        if n_more:
            extra = np.full((world, n_more), -1, dtype=np.int64)
            await pg.all_gather(extra, np.array(more + [-1] * (n_more - len(more)), dtype=np.int64))
        rows = both[:, :6]
        fresh = not both[:, 0].any() and not both[:, 6].any()
        # nothing committed and every rank holds the state as built: a layout or ring left
        # incomplete by a lost rank is rebuilt from it instead of ending the job
        rebuildable = job_committed < 0 and bool(both[:, 12].all())
        covered, holders = False, {}
        if fresh:
            # Every state as built, laid out for the world it was built in. Ranks that joined
            # before the first sync built theirs for another world than the others (init
            # returns at min_ranks, a late rank joins): a built world whose ranks are all here
            # (this one first, else the largest) is the one every rank takes, resharded.
            best = int(rows[:, 1].max())
            built: dict[int, list[int]] = {}
            for q in range(world):
                built.setdefault(int(rows[q, 3]), []).append(q)
            at_best = next((qs for w0, qs in sorted(built.items(), key=lambda kv: (kv[0] != world, -kv[0]))
                            if {int(rows[q, 4]) for q in qs} >= set(range(w0))), None)
            if at_best is None and rebuildable:
                return await self._rebuild_as_built(rank, world, epoch, hosts)
            if at_best is None:
                # (a tester's find: with a rank lost before the first sync had copied its shards,
                # this said only "start the ranks together", and they had been)
                gone = {w0: sorted(set(range(w0)) - {int(rows[q, 4]) for q in qs})
                        for w0, qs in built.items()}
                if len(built) == 1:
                    # every rank built for one world: some of its ranks' states are missing, no
                    # world differs (before, this said "different worlds" all the same: a
                    # tester's find, a pipeline job with one rank killed in its first sync)
                    (w0, missing), = gone.items()
                    raise RtxError(
                        f"no training has committed yet and the states as built of ranks "
                        f"{missing} of the world of {w0} are gone (world size and rank of each "
                        f"rank's layout: {rows[:, 3:5].tolist()}): a rank was lost in the first "
                        f"sync before its state reached its ring successor. A state that keeps "
                        f"every rank's state as built until the first commit (hold_built(on), "
                        f"holds_built(), built_state_dicts(): FSDPState has them) is rebuilt "
                        f"instead; else start the job again")
                raise RtxError(
                    f"no training has committed yet and the ranks' states as built are laid out "
                    f"for different worlds, none of them complete here (world size and rank of "
                    f"each rank's layout: {rows[:, 3:5].tolist()}; missing: "
                    f"{', '.join(f'ranks {v} of the world of {w0}' for w0, v in gone.items() if v)}): "
                    f"a rank lost before the first sync had copied its state to its ring successor "
                    f"took its shards as built with it (start the job again), or ranks started "
                    f"apart built for different worlds (start them together, or load a checkpoint "
                    f"on every rank before FaultTolerance)")
            old_world = int(rows[at_best[0], 3])
            holders = {}
            for q in at_best:
                holders.setdefault(int(rows[q, 4]), (q, 0))
            covered = True
        else:
            best, old_world, holders, covered, at_best = self._choose_ring(both, extra)
            if not covered and best < 0:
                # Nothing committed, and the first sync's ring copy failed on some ranks (a rank
                # lost during it): a rank that holds no ring still holds its own state as built,
                # in the ring's layout. Before, only rings counted, and a live rank whose copy
                # had not gone round was named as gone with the lost one (a fresh user's find:
                # "ranks [2, 3]", rank 3 alive).
                for q in range(world):
                    if not rows[q, 0] and rows[q, 3] == old_world and 0 <= rows[q, 4] < old_world:
                        holders.setdefault(int(rows[q, 4]), (q, 0))
                covered = all(k in holders for k in range(old_world))
                at_best = sorted(set(at_best) | {q for q, _ in holders.values()})
        # In place: every rank holds its own state of the chosen ring in its world, and every
        # rank's live state is that state (its roll-back to it loaded). A sync that resharded
        # the live state for a grown world whose joiner was lost before that world's ring copy
        # leaves the old ring complete and in place on the survivors, but their live state laid
        # out for the lost world (the roll-back refused, _holds_state False): taken in place,
        # the next forward raised "the shards are laid out for world_size(3) rank(0) but the
        # group now has world_size(2)" on every rank (a tester's find: an FSDP job of 2 whose
        # joiner was SIGKILLed by kill:rank=2:at=sync). Then the ring's states are sent round
        # and loaded as after any loss.
        in_place = covered and old_world == world and len(at_best) == world and all(
            holders.get(q) == (q, 0) for q in range(world)) and bool(both[:, 14].all())
        source = "in place" if in_place else "ring"
        if not covered and not fresh and best < 0 and rebuildable:
            return await self._rebuild_as_built(rank, world, epoch, hosts)
        if not covered and not fresh:
            left_ms = [int(v) for v in both[:, 15] if v >= 0]
            await self._wait_for_holders(epoch, sorted(set(range(old_world)) - set(holders)), old_world,
                                         min(left_ms) / 1000 if left_ms else None)
        if best < job_committed or not covered and not fresh:
            restored = await self._restore_checkpoint(best if covered or fresh else -1, job_committed)
            if restored is not None:
                best, source = restored, "checkpoint"
                if self._open_failure is None:
                    await self._restored_event(job_committed, restored, epoch, world)
            elif covered or fresh:
                # training goes on from the newest live state: the steps after it are gone
                self._state_lost(epoch, world, job_committed, best)
            else:
                lost = sorted(set(range(old_world)) - set(holders))
                what = (f"the committed state of ranks {lost} (of the world of {old_world} that "
                        f"committed step {best}) is gone: each rank's state lives on that rank and "
                        f"its ring successor, and both were lost" if best >= 0 else
                        f"no training has committed yet, and the state as built of ranks {lost} (of "
                        f"the world of {old_world}) is gone: a rank was lost during the first sync, "
                        f"before every rank's state had reached its ring successor (start the job "
                        f"again)")
                raise RtxError(f"{what}; no checkpoint can replace it ({self._no_checkpoint_why()})")
        if source == "ring":
            blobs = []
            q0, slot0 = holders[0]
            sent = {"step": best, "epoch": int(both[q0, 6 * slot0 + 2]), "world": old_world}
            try:
                for k in range(old_world):
                    src, slot = holders[k]
                    held = ring if slot == 0 else kept
                    own = held["blobs"].get(k) if held is not None else self._snapshot  # (fresh)
                    blobs.append(await self._broadcast_bytes(own if src == rank else None, src))
                # off the loop, as :meth:`_pack`
                await asyncio.to_thread(lambda: self.state.load_state_dicts([unpack_state(b) for b in blobs]))
            except BaseException:
                if not fresh:
                    self._keep_received(sent, blobs)
                raise
            log.warning("state_resharded", step=best, saved_world_size=old_world, world_size=world,
                     sources={k: holders[k][0] for k in range(old_world)})
            if not fresh:
                # Until the next commit this rank keeps some of the states it took (two ranks of
                # this world keep each: _kept_after_sync), as the ring they came from: a rank
                # lost before this world's ring copy below is made, or during it, leaves them
                # on a live rank (see _ring_kept)
                self._ring_kept = {
                    **sent, "blobs": {k: blobs[k] for k in self._kept_after_sync(old_world, hosts, rank)}}
                if not self._ring_kept["blobs"]:
                    self._ring_kept = None
            del blobs
        await _faults.apoint("sync", pg=pg, step=best + 1)   # fault injection: "during the re-form"
        if source != "in place" or ring is None:
            # a new world, a checkpoint or the first sync: this world's ring of the committed state
            blobs = await self._ring_exchange(rank, world, epoch, hosts)
            if source != "ring":    # (a ring sync set the one it keeps above)
                self._ring_kept = None
            self._snapshot = blobs[rank]
            self._ring = {"step": best, "epoch": epoch, "world": world, "blobs": blobs}
        else:
            self._ring_kept = None
        return best

    def _keep_received(self, sent: dict[str, Any], blobs: list[Any]) -> None:
        """A sync that sent the committed states of ring ``sent`` (``{"step", "epoch",
        "world"}``) round failed after this rank took ``blobs`` (those of ranks ``0..len-1``):
        keep them (with the states of that ring kept before) until a sync ends or a step
        commits. A state whose only live copy was on a rank lost during that sync stays on
        the ranks that took it. Before, a failed sync dropped them and the job ended with "the
        committed state of ranks [2] ... is gone" (a re-verifier's find, 1 of 114 runs under
        load: a second loss while the first loss's states went round). Memory: meanwhile this
        rank holds up to every rank's committed state (the whole model's, with FSDP) beside its
        own."""
        if not blobs:
            return
        kept = self._ring_kept
        same = kept is not None and all(kept[f] == sent[f] for f in ("step", "epoch", "world"))
        self._ring_kept = {**sent, "blobs": {**(kept["blobs"] if same else {}), **dict(enumerate(blobs))}}

    async def _wait_for_holders(self, epoch: int, missing: list[int], old_world: int,
                                left_s: float | None) -> None:
        """No live rank holds the committed state of ranks ``missing`` (of the world of
        ``old_world``): wait, up to twice the heartbeat timeout from the first such sync of this
        recovery, for the membership to change, and raise ``_SyncAgain`` (a ``ClosedError``) when
        it does (the ranks sync again in the new world). A rank declared lost for silence (frozen, cut off) that
        comes back within that time rejoins with its state. Before, a frozen rank whose ring
        successor was killed in the same step ended the job with "the committed state ... is
        gone" while it lived, or sent every rank to an older checkpoint (a breaker's find:
        pause:rank=1 4 s and kill:rank=2 at one step, --min-ranks 2 of 4, 6 of 6 runs). Every
        rank decides alike, from the sync's all_gather: ``missing``, and ``left_s``, the least
        time left of the ranks whose wait began (None: none began; a replacement's own deadline
        made it wait its whole wait, the others blocked in their checkpoint restore meanwhile: a
        re-verifier's find, 6.1 s); returns at once past the deadline, so a state truly gone
        costs at most that wait."""
        wait_s = 2 * self.pg.agent.timeouts.heartbeat_timeout_s if left_s is None else left_s
        self._holders_until = time.monotonic() + wait_s
        if wait_s <= 0:
            return
        log.warning("waiting_for_state_holders", ranks=missing, of_world_size=old_world, epoch=epoch,
                    seconds=round(wait_s, 2),
                    why="no live rank holds their committed state; a rank declared lost may rejoin with it")
        try:
            await self.pg.agent.wait_epoch(epoch, timeout_s=wait_s, or_fenced=True)
        except RtxTimeoutError:
            return
        raise _SyncAgain(f"membership changed (epoch {epoch} -> {self.pg.epoch}) while waiting for "
                         f"the committed state of ranks {missing}: sync again")

    async def _rebuild_as_built(self, rank: int, world: int, epoch: int, hosts: list[str]) -> int:
        """Nothing committed, and the states as built are not all here (a rank lost before the
        first sync had copied its shards to its ring successor): every rank loads every rank's
        state as built (``state.built_state_dicts()``, the same on every rank), resharded for
        this world, and makes this world's ring. Returns -1 (nothing committed)."""
        states = self.state.built_state_dicts()
        await asyncio.to_thread(lambda: self.state.load_state_dicts(states))
        log.warning("state_rebuilt_as_built", built_world_size=len(states), world_size=world,
                    why="a rank was lost before the first sync had copied its state")
        blobs = await self._ring_exchange(rank, world, epoch, hosts)
        self._ring_kept = None
        self._snapshot = blobs[rank]
        self._ring = {"step": -1, "epoch": epoch, "world": world, "blobs": blobs}
        return -1

    @staticmethod
    def _ring_row(ring: dict[str, Any]) -> list[int]:
        """``[1, step, epoch, world, owner, predecessor]`` of a ring this rank holds (its own
        blob's rank and its predecessor's, -1 when a world of one has none; of a kept ring, the
        first two ranks it holds, the rest sent apart: :meth:`_sync_sharded`)."""
        own = next(iter(ring["blobs"]))
        pred = next((k for k in ring["blobs"] if k != own), -1)
        return [1, ring["step"], ring["epoch"], ring["world"], own, pred]

    @staticmethod
    def _choose_ring(both: np.ndarray, extra: np.ndarray | None = None,
                     ) -> tuple[int, int, dict[int, tuple[int, int]], bool, list[int]]:
        """Which committed ring the sync takes, from every rank's two ring rows (``both``: the
        ring each holds and the one it kept, see :meth:`_ring_row`; ``extra[q]``: the further
        ranks rank ``q``'s kept ring holds, -1 padded, or None): the newest committed step,
        and of the rings holding it (one per epoch they were made in) the newest that is complete
        here, its every rank's state held by some live rank (its owner first); else the newest.
        A row names the ranks it holds, so any ring order (:meth:`_ring_order`) works.
        Returns ``(step, its world size, {rank of that world: (holder, slot)}, complete, the
        ranks holding that ring)``; slot 0 is a rank's ring, 1 the one it kept."""
        entries = [(q, slot, both[q, 6 * slot:6 * slot + 6]) for q in range(both.shape[0])
                   for slot in (0, 1) if both[q, 6 * slot]]
        best = int(max(row[1] for _, _, row in entries))
        choice = None
        for e0 in sorted({int(row[2]) for _, _, row in entries if row[1] == best}, reverse=True):
            group = [(q, slot, row) for q, slot, row in entries if row[1] == best and row[2] == e0]
            old_world = int(group[0][2][3])
            holders: dict[int, tuple[int, int]] = {}
            # owners first (a state in place is not sent), then ring successors, then kept rings
            for want, col in ((0, 4), (0, 5), (1, 4), (1, 5)):
                for q, slot, row in group:
                    if slot == want and row[col] >= 0:
                        holders.setdefault(int(row[col]), (q, slot))
            for q, slot, _ in group:    # then a kept ring's further states
                if slot == 1 and extra is not None:
                    for k in extra[q].tolist():
                        if k >= 0:
                            holders.setdefault(int(k), (q, slot))
            covered = all(k in holders for k in range(old_world))
            found = (best, old_world, holders, covered, sorted({q for q, _, _ in group}))
            if covered:
                return found
            choice = choice or found
        return choice

    async def _fall_back_to_checkpoint(self, refused: list[int], src: int, job_committed: int,
                                       world: int) -> int:
        """Every rank loads the newest checkpoint: ranks ``refused`` could not load the state of
        rank ``src``. Returns the step the checkpoint holds."""
        restored = await self._restore_checkpoint(-1, job_committed)
        if restored is None:
            raise RtxError(
                f"ranks {refused} could not load the committed state of rank {src} in this world "
                f"(world_size {world}; see the state_load_refused log line) and no "
                f"checkpoint can replace it ({self._no_checkpoint_why()}): with FSDP a lost "
                f"rank's shards are gone with it; pass FaultTolerance(sharded_state=True) (each "
                f"rank's state also kept by its ring successor)")
        self._snapshot = await self._pack()
        return restored

    async def _restored_event(self, job_committed: int, held: int, epoch: int, world: int) -> None:
        now = time.monotonic()
        injected = await self._injection_time(now)
        rec = {
            "event": "restored",
            "failed_step": job_committed + 1,
            "resumed_step": held + 1,
            "steps_lost": job_committed + 1 - held,
            "epoch": epoch,
            "world_size": world,
            "t_recovered": now,
            "t_injected": injected,
            "time_to_recover_s": None if injected is None else round(now - injected, 4),
        }
        self._event(rec)
        log.warning("restored", **{k: v for k, v in rec.items() if not k.startswith("t_") and k != "event"})

    async def _close_failure(self) -> None:
        f = self._open_failure
        self._open_failure = None
        now = time.monotonic()
        # every loss while the failure was open (several ranks may go in separate epochs), each
        # in the rank numbers of the epoch it was lost from
        losses = [{"epoch": e, "ranks": r} for e, r in sorted(self._epoch_lost.items())
                  if e > f["epoch"]]
        lost_launch = [self.launch_rank] if f.get("fenced") else self._lost_launch(f, losses)
        epoch, world = self.pg.epoch, self.pg.world_size   # the world recovered into (before the await)
        injected = await self._injection_time(f["t_detected"], lost_launch)
        rec = {
            "event": "recovered",
            "failed_step": f["step"],
            "resumed_step": self.step,
            # a failure in a sync lost no work of its step (the step had not begun): before, a
            # rank lost in the first sync was reported "steps lost: 1" with nothing committed
            "steps_lost": max(0, f["step"] - self.committed_step - (0 if f.get("in_step", True) else 1)),
            "error": f["error"],
            "lost": [r for x in losses for r in x["ranks"]] if losses else f["lost"],
            "losses": losses,
            "lost_launch": lost_launch if not f.get("fenced") else [],
            "late": f.get("late", []),   # a CollectiveTimeout's ranks, numbered as of f["epoch"]
            "late_launch": self._launch_ranks(f.get("late_epoch", f["epoch"]), f.get("late", [])),
            "fenced": f.get("fenced", False),
            "epoch": epoch,
            "world_size": world,
            "t_detected": f["t_detected"],
            "t_recovered": now,
            "t_injected": injected,
            "detection_latency_s": None if injected is None else round(f["t_detected"] - injected, 4),
            "time_to_recover_s": round(now - (injected if injected is not None else f["t_detected"]), 4),
        }
        self._event(rec)
        log.warning("recovered", **{k: v for k, v in rec.items() if not k.startswith("t_") and k != "event"})

    def _only_since(self, epoch: int, kind: set[int]) -> bool:
        """Whether every epoch after ``epoch`` (>= 0), up to the current one, and at least one,
        is in ``kind`` (the epochs of one kind of change, each seen)."""
        later = range(epoch + 1, self.pg.epoch + 1)
        return epoch >= 0 and len(later) > 0 and all(e in kind for e in later)

    def _only_reformed_since_sync(self) -> bool:
        """Whether every epoch after the last sync, up to the current one, kept its members
        (re-forms), each of them seen."""
        return self._only_since(self._synced_epoch, self._epoch_same)

    def _only_left_since_sync(self) -> bool:
        """Whether every epoch after the last sync, up to the current one, came of orderly
        leaves (``reason="left"``), each of them seen (an epoch missed could hold a loss)."""
        return self._only_since(self._synced_epoch, self._epoch_left)

    async def _await_announced_epoch(self, epoch: int) -> None:
        """Wait, up to twice the heartbeat timeout, for the epoch after ``epoch`` (or a fence):
        the one a ``PeerLostError`` from a broken link or a peer's abort announces before the
        coordinator's epoch follows, or the one this rank's re-form opened before its push came.
        Returns either way."""
        with contextlib.suppress(RtxTimeoutError):
            await self.pg.agent.wait_epoch(
                epoch, timeout_s=2 * self.pg.agent.timeouts.heartbeat_timeout_s, or_fenced=True)

    def _note_loss_between_steps(self) -> None:
        """Ranks lost after the last step committed and before this one began: no step failed
        and none is lost, but the world changed; recorded (``lost_between_steps``) so a report
        shows every loss, not only those that failed a step."""
        epochs = [e for e in sorted(self._epoch_lost)
                  if e > max(self._synced_epoch, self._noted_through)
                  and (self._synced_epoch >= 0 or 0 <= self._made_in < e)]
        if not epochs:
            return
        self._noted_through = epochs[-1]   # (finish() may note again before any sync)
        rec = {"event": "lost_between_steps", "step": self.step, "epoch": self.pg.epoch,
               "lost": [r for e in epochs for r in self._epoch_lost[e]],
               "lost_launch": launch_ranks_lost(self._epoch_lost_launch, epochs),
               "world_size": self.pg.world_size}
        self._event(rec)
        log.warning("lost_between_steps", **{k: v for k, v in rec.items() if k != "event"})

    def _lost_launch(self, failure: dict[str, Any], losses: list[dict[str, Any]]) -> list[int] | None:
        """The launch ranks a failure lost, sorted; None if any is unknown."""
        if losses:
            return launch_ranks_lost(self._epoch_lost_launch, [x["epoch"] for x in losses])
        return self._launch_ranks(failure["epoch"], failure["lost"])

    def _launch_ranks(self, epoch: int, ranks: list[int]) -> list[int] | None:
        """``ranks`` as numbered in ``epoch``, as launch ranks, sorted; None if any is unknown."""
        at = self._launch_of.get(epoch, {})
        named = [at.get(r) for r in ranks]
        return None if None in named else sorted(named)

    def _event(self, rec: dict[str, Any]) -> None:
        """Keep ``rec`` and, when ``RTXNET_METRICS_DIR`` is set, append it to this process's
        ``events-<pid>.jsonl`` there (for tools/faultrun.py)."""
        rec = {**rec, "pid": os.getpid(), "launch_rank": self.launch_rank}
        self.events.append(rec)
        folder = os.environ.get("RTXNET_METRICS_DIR")
        if folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"events-{os.getpid()}.jsonl"), "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    async def _injection_time(self, detected: float, lost_launch: list[int] | None = None) -> float | None:
        """When the fault that caused this failure was injected (its rank wrote it to the store
        just before acting; ``time.monotonic`` is one clock for all processes of a host): the
        newest injected before ``detected``; when the failure lost ranks (``lost_launch``, launch
        ranks), only a fault injected on one of them can have caused it (a ``delay`` on rank 0
        at step 0 does not explain rank 2 killed from outside at step 278). A delay, which acts
        at every step, counts from when it last acted before ``detected`` as its rank wrote it
        after a failure (``faults/<i>/last``, see _record_fault)."""
        inj = self.injector
        if inj is None:
            return None
        await self._store_unrecorded_faults()
        best = None
        for f in inj.faults:
            keys = [f"faults/{f.index}"] + ([f"faults/{f.index}/last"] if f.kind == "delay" else [])
            for key in keys:
                try:
                    raw = await self.pg.store.get(key)
                except RtxError:
                    return best
                if raw is None:
                    continue
                rec = json.loads(raw)
                if lost_launch and rec.get("rank") not in lost_launch:
                    continue
                for t in rec.get("acts", [rec["t"]]):
                    if t <= detected + 0.001 and (best is None or t > best):
                        best = t
        return best

    # ---------------------------------------------------------------------------------------------
    # fault injection

    def _due(self, at: str, step: int) -> list[tuple[Any, dict[str, Any]]]:
        inj = self.injector
        if inj is None:
            return []
        # Faults name ranks as launched (RTXNET_RANK), not as renumbered after a loss.
        rank, world = self.launch_rank, self.pg.world_size
        due = inj.due(at, rank=rank, world_size=world, step=step) + inj.timed(rank=rank, world_size=world)
        return [(f, inj.record(f, rank=rank, step=step)) for f in due]

    async def _record_fault(self, rec: dict[str, Any]) -> bool:
        """Claim the fault in the store (once per job, even across restarts); True: act on it.
        A delay acts at every step but is claimed once: later steps skip the store, except a step
        run again (a retry, or a step at or before the last one it acted at: a rollback), which
        writes the time the delay acts again to ``faults/<i>/last`` (a step retried after the
        delay made it time out is detected from that time, not from the first step's: a fresh
        user saw ``detection_latency_s`` 5, 25, 45 s for three timeouts of 5 s each)."""
        if rec["kind"] == "delay" and rec["index"] in self._delays_recorded:
            last, self._delays_recorded[rec["index"]] = self._delays_recorded[rec["index"]], rec["step"]
            if rec["step"] <= last:
                # every recent act, not only the newest: the failure a survivor measures may be
                # the one before (this rank already acting again when the survivor reads)
                acts = self._delay_acts.setdefault(rec["index"], [])
                acts[:] = [*acts, rec["t"]][-_DELAY_ACTS_KEPT:]
                with contextlib.suppress(RtxError):   # a measure only: the delay acts anyway
                    await self.pg.store.set(f"faults/{rec['index']}/last",
                                            json.dumps({**rec, "acts": acts}))
            return True
        try:
            swapped, _ = await self.pg.store.compare_set(f"faults/{rec['index']}", None, json.dumps(rec))
        except RtxError as exc:
            # The store did not answer (a compare-and-set in flight when the coordinator died is
            # not sent again). A fault of a named rank fires only in that rank's first process,
            # so no claim is needed to fire it once: act, and write the record once the store
            # is back (if this process lives). A fault of every rank needs the claim: skip it.
            named = self.injector is not None and self.injector.faults[rec["index"]].rank is not None
            log.warning("fault_record_failed", error=str(exc), acting=named)
            if named:
                _faults._UNRECORDED.append(rec)
            return named
        if swapped:
            log.warning("fault_injected", fault=rec["fault"], rank=rec["rank"], step=rec["step"])
        if rec["kind"] == "delay":
            self._delays_recorded[rec["index"]] = rec["step"]
            return True   # a slow rank is slow at every step; the store keeps the first record
        return swapped


_DELAY_ACTS_KEPT = 16   # a delay's latest acts kept in faults/<i>/last (its retries' times)


def _n_ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def name_ranks(ranks: list[int], *, launch: bool) -> str:
    """``launch ranks 2, 3`` / ``rank 1``: ranks as rtxnet-run started them (``launch``) or as
    numbered in one epoch."""
    kind = "launch rank" if launch else "rank"
    return f"{kind}{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def describe_lost(epoch_lost: dict[int, list[int]], epoch_lost_launch: dict[int, list[int] | None],
                  since: int, now: int) -> str:
    """The ranks the epochs after ``since`` up to ``now`` lost, each process once: ``launch ranks
    2, 3`` when every launch rank is known, else each epoch's ranks as numbered in the epoch
    before it (``rank 2 of epoch 0, rank 2 of epoch 1``). Joined across epochs, the per-epoch
    numbers read ``ranks [2, 2]`` for launch ranks 2 and 3 lost one after the other (the second
    renumbered 2 by the first loss: a fresh user's find).

    ``epoch_lost``: epoch -> the ranks its membership lost (numbered as of the epoch before);
    ``epoch_lost_launch``: epoch -> their launch ranks, None where one is unknown."""
    epochs = [e for e in sorted(epoch_lost) if since < e <= now and epoch_lost[e]]
    launch = launch_ranks_lost(epoch_lost_launch, epochs)
    if epochs and launch is not None:
        return name_ranks(launch, launch=True)
    return ", ".join(f"{name_ranks(epoch_lost[e], launch=False)} of epoch {e - 1}" for e in epochs)


def launch_ranks_lost(epoch_lost_launch: dict[int, list[int] | None], epochs: list[int]) -> list[int] | None:
    """The launch ranks ``epochs`` lost (``epoch_lost_launch``: epoch -> its lost processes'
    launch ranks, None where one is unknown), sorted; None if any epoch's are unknown."""
    named = [epoch_lost_launch.get(e) for e in epochs]
    return None if None in named else sorted(r for x in named for r in x)


def event_ranks(e: dict[str, Any], key: str) -> str:
    """``e[key + "_launch"]`` by launch rank when every one is known, else ``e[key]``."""
    launch = e.get(f"{key}_launch")
    return name_ranks(launch, launch=True) if launch else name_ranks(e[key], launch=False)


def describe_loss_between_steps(e: dict[str, Any]) -> str:
    """One line for a ``lost_between_steps`` event."""
    when = "before the first step" if e["step"] == 0 else f"between steps (before step {e['step']})"
    return (f"epoch {e['epoch']}: {event_ranks(e, 'lost')} lost {when}: "
            f"no step failed; world of {e['world_size']}")


def describe_join(e: dict[str, Any]) -> str:
    """One line for a ``joined`` event: ``epoch 4: launch rank 3 joined at step 65; world of 4``
    (launch ranks when every joiner has one, else ranks numbered as of that epoch)."""
    return f"epoch {e['epoch']}: {event_ranks(e, 'added')} joined at step {e['step']}; world of {e['world_size']}"


def _fault_where(at: str, step: int | None, collective: int | None) -> str:
    """Where a recorded fault fired, for the report; empty where the record does not say."""
    if at == "rendezvous":
        return " during rendezvous"
    if at == "checkpoint" and step is not None:
        return f" while the checkpoint of step {step} was written"
    if at == "collective" and collective is not None:
        return f" before its collective {collective}"
    if at == "sync" and step is not None:
        return f" in the state's sync before step {step}"
    return "" if step is None else f" at step {step}"
