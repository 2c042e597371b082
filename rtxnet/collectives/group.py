"""``Group``: the collective API of a set of ranks (``engine.world``, ``new_group``, ``split``).

Shapes legend: ``N`` elements of one rank's array, ``W`` group size.

Ranks given to a group's methods (``src``, ``dst`` of broadcast, reduce, gather, scatter, send,
recv) are **group ranks** (``0 .. W-1``); ``new_group`` takes **world ranks**. ``exc.ranks`` of a
``CollectiveTimeout`` and the keys of ``CollectiveMismatchError.values`` are world ranks.

Collectives of one group run one at a time in call order (sequence numbers are taken when a call
first runs, so the order of calls is what must agree across ranks; a call cancelled before it ran
still takes its number and fails the peers' matching call: :mod:`rtxnet._calls`); different
groups run concurrently;
send/recv do not queue behind collectives. A call that one rank refuses (a bad argument: the
``ValueError``/``TypeError`` is raised there before anything is sent) still takes its place in that
order: the other ranks' matching call fails at once with a ``CollectiveError`` naming the rank and
quoting its error, instead of waiting out its deadline (:func:`_refusal_told`).

Algorithms (``algorithm=`` per call, ``Group.algorithm`` per group, else chosen by size):

==================== ===========================================================================
``"direct"``         one round: every rank sends its payload inside the signature exchange; the
                     reduction is done locally in rank order. Latency-optimal for small messages.
``"recursive_doubling"`` all_reduce in log2(W) rounds (non powers of two folded in first).
``"ring"``           all_reduce as ring reduce-scatter + all-gather, in pipelined 1-4 MiB blocks;
                     from ``BULK_MIN_NBYTES`` over dedicated TCP streams received in place
                     (:mod:`transport.bulk`, Linux), else over ZeroMQ. broadcast (from
                     ``BULK_MIN_NBYTES``, when "shm" does not apply) as a pipelined chain from
                     the root around the ring, on the same streams. all_gather and
                     reduce_scatter as the ring's two halves (the default from
                     ``BULK_MIN_NBYTES`` of the W arrays for a group on several hosts whose
                     members all have a bulk stream).
``"shm"``            same-host ranks: each copies its input once into its shared-memory segment,
                     reduces its 1/W chunk reading the peers' segments, then copies the others'
                     reduced chunks (see :mod:`rtxnet.collectives.shared_memory`).
==================== ===========================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import structlog

from rtxnet._calls import Call
from rtxnet.collectives import ring as ring_mod
from rtxnet.collectives import shared_memory as shmops
from rtxnet.collectives.arrays import Buffer, copy_pairs, off_loop
from rtxnet.collectives.arrays import payload_view as _view
from rtxnet.collectives.doubling import recursive_doubling_all_reduce
from rtxnet.collectives.engine import Engine, Op
from rtxnet.collectives.gpu import cupy_available, is_gpu_array
from rtxnet.collectives.reduce_ops import (
    ReduceOp,
    acc_dtype,
    check_op_dtype,
    dtype_name,
    finish,
    quiet,
    reduce_into,
)
from rtxnet.collectives.ring import (
    chain_broadcast,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from rtxnet.config import timeout_seconds
from rtxnet.portal import loop_refusal
from transport.errors import (
    ClosedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeout,
    ConfigError,
    LinkBrokenError,
    PeerLostError,
    RtxError,
)

__all__ = ["Group", "ALGORITHMS", "SMALL_MAX_NBYTES", "SHM_MIN_NBYTES"]

log = structlog.get_logger(__name__)

SMALL_MAX_NBYTES = 64 * 1024      # all_reduce up to this size: "direct" (<= 8 ranks)
# hierarchical all_reduce of CPU arrays from twice this size runs as a pipeline of chunks of about
# this size, at most PIPELINE_MAX_CHUNKS (tools/bench/multihost.py)
PIPELINE_CHUNK_NBYTES = 4 << 20
PIPELINE_MAX_CHUNKS = 8
# A hierarchical operation numbered s runs its host, leader and rail groups' operations from
# number s * _INNER_STRIDE (see Group._in_step): far more than it ever makes in one group (at
# most 3 stages of PIPELINE_MAX_CHUNKS chunks)
_INNER_STRIDE = 1 << 16
SHM_MIN_NBYTES = 64 * 1024        # same-host operations from this size: "shm"
_DIRECT_MAX_RANKS = 8
# CPU collectives that also run "hierarchical" (within each host, then among the hosts' first
# ranks): forced by algorithm=, or chosen by _hierarchical_default
_HIERARCHICAL_OPS = ("all_reduce", "all_gather", "reduce_scatter")
ALGORITHMS = {
    "all_reduce": ("direct", "recursive_doubling", "ring", "shm"),
    "broadcast": ("direct", "ring", "shm"),
    "all_gather": ("direct", "ring", "shm"),
    "reduce_scatter": ("direct", "ring", "shm"),
}


def _parts(name: str, other: str, arg, n: int, N: int, dtype, *, readonly: bool) -> tuple[list, list]:
    """``(buffers, parts)``: the :class:`Buffer` objects ``arg`` makes (to ``commit()`` after an
    in-place write) and the ``n`` flat parts of ``N`` elements of ``dtype`` they hold; ``arg`` is a
    list of ``n`` arrays, or one array of ``n * N`` elements cut in ``n``.

    Raises:
        ValueError: a part of another size or dtype (names which, and what ``other`` is).
    """
    parts = _as_list(name, arg, n)
    if parts is not None:
        for k, b in enumerate(parts):
            if b.dtype != dtype or b.size != N:
                raise ValueError(f"{name}[{k}] is {b.dtype}[{b.size}], {other} is {dtype}[{N}]")
        if not readonly:
            _refuse_overlapping(name, [b.array for b in parts])
        return parts, [b.flat for b in parts]
    buf = Buffer(arg, readonly=readonly)
    if buf.dtype != dtype or buf.size != n * N:
        raise ValueError(f"{name} is {buf.dtype}[{buf.size}], needs {dtype}[{n} * {N}]")
    return [buf], [buf.flat[k * N:(k + 1) * N] for k in range(n)]


try:   # NumPy 2 (1.x: np.byte_bounds)
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:   # pragma: no cover - NumPy 1.x
    _byte_bounds = np.byte_bounds


def _refuse_overlapping(name: str, arrays: list[np.ndarray]) -> None:
    """Raise ``ValueError`` when two of ``arrays`` (the entries of an output list) share memory:
    each entry receives another rank's part, so the one written last would win and the result
    be undefined (``[buf[2:6], buf[4:8]]`` gave garbage, without a word: a breaker's find).
    Entries sorted by their first byte; only those whose byte ranges overlap are compared
    exactly (``np.shares_memory``), so interleaved views (``buf[0::2]``, ``buf[1::2]``) pass.

    Raises:
        ValueError: names the two entries."""
    spans = sorted((_byte_bounds(a) + (k,) for k, a in enumerate(arrays) if a.size), key=lambda x: x[0])
    active: list[tuple[int, int, int]] = []
    for lo, hi, k in spans:
        active = [x for x in active if x[1] > lo]
        for _, _, j in active:
            if np.shares_memory(arrays[j], arrays[k], max_work=10**6):
                a, b = sorted((j, k))
                raise ValueError(f"{name}[{a}] and {name}[{b}] share memory: each entry receives "
                                 f"another rank's part, so they must not overlap; pass entries of "
                                 f"their own (torch.split/np.split of one buffer are fine)")
        active.append((lo, hi, k))


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    ia, ib = a.__array_interface__, b.__array_interface__
    return ia["data"][0] == ib["data"][0] and a.nbytes == b.nbytes and ia["strides"] == ib["strides"]


def _detached(src: np.ndarray, outputs: Sequence[np.ndarray], own: np.ndarray | None = None) -> np.ndarray:
    """``src``, or a copy of it when an output of the same operation overlaps it: an output
    written before ``src`` is sent or read would change what is sent (``out = [x, y]`` on rank 1
    of an all_gather of ``x``). ``own``, the output that receives ``src`` itself, may be the very
    same memory (the in-place ``out[rank] is x`` idiom) without a copy."""
    for o in outputs:
        if o is own and _same_memory(o, src):
            continue
        if np.may_share_memory(o, src):
            return src.copy()
    return src


def _as_list(name: str, x, n: int) -> list[Buffer] | None:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise ValueError(f"{name} has {len(x)} entries, group size is {n}")
        return [Buffer(t) for t in x]
    return None


def _refusal_told(fn):
    """Decorate a collective of :class:`Group`: when this rank refuses the call itself (a
    ``ValueError`` or ``TypeError`` raised before the call took its sequence number), the call
    still takes one, and the other ranks are sent an abort for it, so their matching call fails
    at once naming this rank and quoting the error rather than timing out; then the error is
    raised here unchanged. Calls raising after they took their number abort the peers already
    (``Group._collective``)."""
    name = fn.__name__

    async def run(self, *args, **kwargs):
        seq = self._seq
        try:
            return await fn(self, *args, **kwargs)
        except (ValueError, TypeError) as exc:
            if self._seq == seq and self._can_tell_peers():
                await self._refuse(name, exc)
            raise

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        # a Call: cancelled before it ran, it still takes its number and aborts the peers' one
        return Call(run(self, *args, **kwargs), functools.partial(self._unstarted, name))

    return call


class Group:
    """A set of ranks that run collectives together. Obtain one from ``Engine.world``,
    :meth:`new_group` or :meth:`split`; the constructor is internal.

    Attributes:
        rank: this process's rank in the group.
        size: number of ranks in the group (also ``world_size``).
        ranks: world ranks of the members, indexed by group rank.
        gid: group id, identical on every member.
        epoch: the epoch the group belongs to.
        algorithm: ``None`` (choose by size) or an algorithm name to force where it applies.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("groups come from engine.world, Group.new_group or Group.split")

    @property
    def world_size(self) -> int:
        """``size``, under the process group's name for it (code written for the process group
        works on a subgroup)."""
        return self.size

    @classmethod
    def _create(cls, engine: Engine, gid: str, ranks: list[int]) -> Group:
        self = object.__new__(cls)
        self.engine = engine
        self.gid = gid
        self.ranks = list(ranks)
        self.size = len(ranks)
        self.rank = self.ranks.index(engine.view.rank)
        self.epoch = engine.view.epoch
        self.algorithm: str | None = None
        self._seq = 0
        self._tail: asyncio.Future | None = None
        self._dead: BaseException | None = None
        self._aborts = 0
        self._abort_exc: BaseException | None = None
        hosts = engine.view.hosts
        me = hosts.get(engine.view.rank)
        self.same_host = me is not None and all(hosts.get(r) == me for r in self.ranks)
        self._shm = shmops.ShmState(engine) if engine.shm_enabled and self.same_host else None
        self._gpu_state = None
        self._host_groups_cache = None
        self._rails_cache = None
        self._by_host_cache: dict | None = None
        engine._groups.append(self)
        return self

    def __repr__(self) -> str:
        return (f"Group(gid={self.gid!r}, rank={self.rank}, size={self.size}, "
                f"epoch={self.epoch})")

    # -- plumbing ----------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        wrong = loop_refusal(f"group {self.gid!r}", self.engine.home_loop)
        if wrong is not None:
            # (subgroups of new_group/split are not wrapped by the ProcessGroup's check: from
            # another loop they waited out their deadline, a re-verifier's find)
            raise wrong
        fenced = self.engine.fenced
        if fenced is not None:
            raise PeerLostError(f"group {self.gid!r} of epoch {self.epoch}: {fenced}") from fenced
        if self._dead is not None:
            if isinstance(self._dead, PeerLostError):
                raise PeerLostError(
                    f"group {self.gid!r} of epoch {self.epoch} is gone: {self._dead}",
                    ranks=self._dead.ranks, epoch=self._dead.epoch) from self._dead
            raise ClosedError(
                f"group {self.gid!r} belongs to epoch {self.epoch}, which ended: {self._dead}"
            ) from self._dead

    def _can_tell_peers(self) -> bool:
        """Whether a call that ends here without running may still tell the peers: a group of
        several ranks, not retired, this rank not fenced, and on the group's own loop."""
        return self.size > 1 and self._dead is None and self.engine.fenced is None \
            and loop_refusal(f"group {self.gid!r}", self.engine.home_loop) is None

    def _unstarted(self, name: str) -> None:
        """A call of ``name`` ended before it ran (cancelled before its coroutine's first step:
        :mod:`rtxnet._calls`): it takes its sequence number here and the peers'
        operation of that number fails at once, so this rank's later calls stay paired with
        theirs. Nothing when the call could not have run anyway (a group of one, retired,
        fenced, or not on the group's own loop)."""
        if not self._can_tell_peers():
            return
        seq = self._seq
        self._seq += 1
        self.engine._abort_unstarted(self, seq, CollectiveError(f"{name} was cancelled on that rank "
                                                                f"before it began"))

    def _retire(self, exc: BaseException) -> None:
        self._dead = exc
        if self._shm is not None:
            self._shm.close()
        if self._gpu_state is not None:
            self._gpu_state.close()

    def _gpu(self):
        """The group's :class:`rtxnet.collectives.gpu.backend.GpuGroup` (made on first GPU use)."""
        self._check_usable()
        if self._gpu_state is None:
            # a ConfigError (a ValueError): refused before the call took its number, so the
            # peers' matching call fails at once naming this rank (before, CuPy's ImportError
            # was raised here and the peers waited out their deadline: a tester's find)
            ok, why = cupy_available()
            if not ok:
                raise ConfigError(f"a CUDA array was passed on rank {self.rank} of group "
                                  f"{self.gid!r}, but rtxnet cannot run GPU collectives here: {why}")
            from rtxnet.collectives.gpu.backend import GpuGroup

            self._gpu_state = GpuGroup(self)
        return self._gpu_state

    def _fail_queued(self, exc: BaseException) -> None:
        self._aborts += 1
        self._abort_exc = exc

    def _timeout_s(self, timeout: float | None) -> float:
        return timeout_seconds(timeout, self.engine.default_timeout_s)

    def _after_hello(self, op: Op) -> None:
        if self._shm is not None:
            self._shm.after_hello(op.seq)

    def _choose(self, opname: str, nbytes: int, forced: str | None) -> str:
        allowed = ALGORITHMS.get(opname, ("direct",))
        if forced is not None and forced not in allowed:
            also = ("hierarchical",) if opname in _HIERARCHICAL_OPS else ()
            raise ValueError(f"{opname}: algorithm {forced!r} not in {allowed + also} (GPU "
                             f"arrays: 'ipc', 'nccl'{', hierarchical' if opname == 'all_reduce' else ''})")
        if forced is None and self.algorithm in allowed:
            forced = self.algorithm
        if self.size == 1:
            return "local"
        shm_ok = self._shm is not None
        if forced == "shm" and not shm_ok:
            raise ValueError(f"{opname}: algorithm 'shm' needs every rank of the group on this "
                             f"host (its {self.size} ranks are on {len(self._by_host())} "
                             f"host(s)) and shared memory enabled (RTXNET_SHM=0 disables it)")
        if forced is not None:
            return forced
        if shm_ok and nbytes >= SHM_MIN_NBYTES and "shm" in allowed:
            return "shm"
        if opname == "all_reduce" and nbytes > SMALL_MAX_NBYTES:
            return "ring"
        if opname == "broadcast" and nbytes >= ring_mod.BULK_MIN_NBYTES and self.size > 1:
            return "ring"
        if (opname in ("all_gather", "reduce_scatter") and nbytes >= ring_mod.BULK_MIN_NBYTES
                and len(self._by_host()) > 1 and self.engine.bulk_ok(self)):
            # across hosts: the ring crosses each host boundary once each way with (W-1)/W of
            # the data, where direct sends every rank's part to every remote rank (a host of P
            # ranks puts P x remote ranks parts on its link: tools/bench/multihost.py --op
            # all_gather); received in place, no fresh ZeroMQ message per part. Within one
            # host without "shm", direct (W-1 sends at once) was as fast or faster with 4 ranks
            # on 2 cores (tools/bench/collectives.py --no-shm --algorithm direct/ring).
            return "ring"
        if opname == "all_reduce" and self.size > _DIRECT_MAX_RANKS:
            return "recursive_doubling"
        return "direct"

    def _ring_bulk(self, nbytes: int) -> bool:
        """Whether a ring of ``nbytes`` (the working array) goes over the bulk TCP streams:
        every member has one and the array is at least ``ring.BULK_MIN_NBYTES`` (smaller ones
        go as ZeroMQ messages). Same answer on every member."""
        return nbytes >= ring_mod.BULK_MIN_NBYTES and self.engine.bulk_ok(self)

    def _sig(self, name, algo, rop=None, root=None, dtype=None, numel=None, shape=None,
             splits=None, label=None) -> list:
        return [name, algo, None if rop is None else rop.value, root,
                None if dtype is None else dtype_name(dtype), numel,
                None if shape is None else list(shape), splits, label]

    def _check_root(self, name: str, root: int) -> int:
        if isinstance(root, bool) or not (isinstance(root, (int, np.integer)) and 0 <= int(root) < self.size):
            raise ValueError(f"{name}: rank {root!r} ({type(root).__name__}) is not a rank of this "
                             f"group of size {self.size} (an int in 0..{self.size - 1})")
        return int(root)

    async def _collective(self, name: str, timeout: float | None, body):
        """Run ``body(op)`` as the next operation of this group, after the previous ones."""
        self._check_usable()
        timeout_s = self._timeout_s(timeout)
        seq = self._seq
        self._seq += 1
        engine = self.engine
        loop = asyncio.get_running_loop()
        aborts = self._aborts
        prev = self._tail
        done = loop.create_future()
        self._tail = done
        try:
            try:
                if prev is not None:
                    await asyncio.shield(prev)
                await engine.wait_not_held()
            except asyncio.CancelledError:
                # cancelled (Ctrl-C, task.cancel()) while queued: its number is taken, so the
                # peers' call of that number would wait out its deadline, and every later call
                # here would be one ahead of theirs (a breaker's find: the next call then timed
                # out on one rank and succeeded on the other). They are told, as for a call
                # cancelled while running.
                engine._abort_unstarted(self, seq, CollectiveError("cancelled on that rank"))
                raise
            self._check_usable()
            if self._aborts != aborts:
                raise self._abort_exc
            op = Op(engine, self, seq, name, timeout_s)
            engine._start_op(op)
            try:
                return await body(op)
            except BaseException as exc:
                cause = None
                if isinstance(exc, LinkBrokenError):
                    # the peer probably died: wait (bounded) for the coordinator's verdict, a
                    # PeerLostError naming it, or a peer's abort
                    verdict = await op.settle(exc)
                    if verdict is not exc:
                        cause, exc = exc, verdict
                if self._shm is not None:
                    self._shm.taint()
                if self._gpu_state is not None:
                    self._gpu_state.taint()
                # errors every rank raises by itself from the same exchanged data (e.g. NCCL
                # refusing ranks that share a GPU) need no abort and win over a peer's abort
                everywhere = getattr(exc, "raised_on_every_rank", False)
                if not (op.failed_remotely or everywhere or isinstance(
                        exc, (CollectiveMismatchError, PeerLostError, ClosedError))):
                    # (a hierarchical operation's stage cut short by Op.bounded says why: it
                    # was told as the user's cancel, hiding the peer's error, a re-verifier's find)
                    err = exc if not isinstance(exc, asyncio.CancelledError) else \
                        CollectiveError("cancelled on that rank" + (
                            f" ({exc.args[0]})" if exc.args and isinstance(exc.args[0], str) else ""))
                    engine._abort_peers(op, err)
                if op.error is not None and exc is not op.error and not everywhere and not \
                        isinstance(exc, asyncio.CancelledError):
                    _stamp_epoch(op.error, self.epoch)
                    raise op.error from exc
                _stamp_epoch(exc, self.epoch)
                if cause is not None:
                    raise exc from cause
                raise
            finally:
                engine._end_op(op)
        finally:
            done.set_result(None)
            if self._tail is done:
                self._tail = None

    async def _refuse(self, name: str, exc: BaseException) -> None:
        """Take the next sequence number for ``name`` and fail it with ``exc`` at once, which
        aborts the peers' operation of that number (see :func:`_refusal_told`)."""
        async def body(op: Op):
            raise exc

        try:
            await self._collective(name, None, body)
        except BaseException as err:   # exc itself, or what the group raised instead
            if err is not exc and not isinstance(err, (RtxError, ValueError, TypeError)):
                raise

    # -- collectives ---------------------------------------------------------------------------

    @_refusal_told
    async def all_reduce(self, tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None,
                         algorithm: str | None = None):
        """Reduce ``tensor`` over the group; every rank ends with the result, in place.

        Args:
            tensor: NumPy array or CPU DLPack tensor, or a GPU array (CuPy array, torch CUDA
                tensor: see :mod:`rtxnet.collectives.gpu`), any shape (0-d, empty and
                non-contiguous views included); same shape and dtype on every rank; written in
                place.
            op: ``ReduceOp``; float16/bfloat16 accumulate in float32, AVG divides at the end.
            timeout: seconds; ``None`` uses the engine's default.
            algorithm: CPU arrays: force ``"direct"``, ``"recursive_doubling"``, ``"ring"``,
                ``"shm"`` or ``"hierarchical"`` (reduce within each host, all_reduce among the
                hosts' first ranks, broadcast within each host); GPU arrays: ``"ipc"``,
                ``"nccl"`` or ``"hierarchical"``. Default for CPU arrays above 64 KiB in a
                group on several hosts with two or more of its ranks on one host:
                ``"hierarchical"``, whose bytes across hosts are 1 array each way against the flat
                ring's 2(n-1)/n (tools/bench/multihost.py, 2 x 2 ranks over a 1 Gbit/s link:
                149 ms against the ring's 208 ms at 16 MiB, pipelined in 4 MiB chunks from
                8 MiB); CPU float16/bfloat16 go through its stages as float32 (GPU ones round
                at each stage).

        Returns:
            ``tensor``.

        Raises:
            ValueError: unsupported dtype, op (PROD/AVG of bool, AVG of ints) or algorithm;
                raised before anything is sent, and the other ranks' matching call fails at
                once with a ``CollectiveError`` quoting it (:func:`_refusal_told`).
            CollectiveMismatchError: ranks disagree on op, dtype, shape or element count.
            CollectiveTimeout: a rank did not contribute in time; ``exc.ranks`` names them.
            PeerLostError: a peer was lost meanwhile; ``tensor`` is undefined.
        """
        if is_gpu_array(tensor):
            return await self._gpu().all_reduce(tensor, op, timeout, algorithm)
        buf = Buffer(tensor)
        rop = check_op_dtype(op, buf.dtype)
        nbytes = buf.size * buf.dtype.itemsize
        forced = algorithm or self.algorithm
        if forced == "hierarchical" or (forced is None and nbytes > SMALL_MAX_NBYTES
                                        and self._hosts_shared()):
            return await self._hierarchical_all_reduce(tensor, rop, timeout, (buf.dtype, buf.size, buf.shape))
        algo = self._choose("all_reduce", nbytes, algorithm)
        sig = self._sig("all_reduce", algo, rop, None, buf.dtype, buf.size, buf.shape)
        flat, dtype, n, N = buf.flat, buf.dtype, self.size, buf.size
        accdt = acc_dtype(dtype)

        async def body(op: Op):
            if algo == "local":
                return tensor
            if algo == "shm":
                await shmops.all_reduce(op, self._shm, sig, flat, rop)
            elif algo == "direct":
                got = await op.hello(sig, None, lambda g: flat)
                xs = [flat if g == self.rank else _view(got[g][1], dtype, N) for g in range(n)]
                await op.flush()      # flat went out without a copy: reduce into it only now
                await off_loop(n * nbytes, reduce_into, rop, xs, flat, n)
            else:
                await op.hello(sig)
                acc = flat if accdt == dtype else await off_loop(nbytes, flat.astype, accdt)
                if algo == "ring":
                    await ring_all_reduce(op, acc, rop, bulk=self._ring_bulk(acc.nbytes))
                else:
                    acc = await recursive_doubling_all_reduce(op, acc, rop)
                    await off_loop(acc.nbytes, finish, rop, acc, n)
                if acc is not flat:
                    await off_loop(acc.nbytes, _copy_cast, flat, acc)
            buf.commit()
            return tensor

        return await self._collective("all_reduce", timeout, body)

    @_refusal_told
    async def broadcast(self, tensor, src: int = 0, *, timeout: float | None = None,
                        algorithm: str | None = None):
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` of every rank, in place.

        Args:
            tensor: same shape and dtype on every rank; read on ``src``, written elsewhere.
            src: group rank of the source.

        Returns:
            ``tensor``.

        Raises:
            ValueError, CollectiveMismatchError, CollectiveTimeout, PeerLostError: as
            :meth:`all_reduce`.
        """
        if is_gpu_array(tensor):
            return await self._gpu().broadcast(tensor, src, timeout, algorithm)
        src = self._check_root("broadcast", src)
        buf = Buffer(tensor, readonly=(self.rank == src))
        nbytes = buf.size * buf.dtype.itemsize
        algo = self._choose("broadcast", nbytes, algorithm)
        sig = self._sig("broadcast", algo, None, src, buf.dtype, buf.size, buf.shape)

        async def body(op: Op):
            if algo == "local":
                return tensor
            if algo == "shm":
                await shmops.broadcast(op, self._shm, sig, buf.flat, src)
            elif algo == "ring":
                await op.hello(sig)
                await chain_broadcast(op, buf.flat, src, bulk=self.engine.bulk_ok(self))
            else:
                me = self.rank == src
                got = await op.hello(sig, None, (lambda g: buf.flat) if me else None)
                if me:
                    await op.flush()
                else:
                    await off_loop(nbytes, np.copyto, buf.flat, _view(got[src][1], buf.dtype, buf.size))
            if self.rank != src:
                buf.commit()
            return tensor

        return await self._collective("broadcast", timeout, body)

    @_refusal_told
    async def reduce(self, tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *,
                     timeout: float | None = None, algorithm: str | None = None):
        """Reduce ``tensor`` over the group into ``tensor`` of group rank ``dst``.

        Other ranks' ``tensor`` is left unchanged. Arguments and errors as :meth:`all_reduce`
        (``algorithm`` applies to GPU arrays only).
        """
        if is_gpu_array(tensor):
            return await self._gpu().reduce(tensor, dst, op, timeout, algorithm)
        dst = self._check_root("reduce", dst)
        buf = Buffer(tensor)
        rop = check_op_dtype(op, buf.dtype)
        sig = self._sig("reduce", "direct", rop, dst, buf.dtype, buf.size, buf.shape)
        n, N, dtype = self.size, buf.size, buf.dtype

        async def body(op: Op):
            if self.size == 1:
                return tensor
            me = self.rank == dst
            got = await op.hello(sig, None, None if me else (lambda g: buf.flat if g == dst else None))
            if me:
                xs = [buf.flat if g == dst else _view(got[g][1], dtype, N) for g in range(n)]
                await off_loop(n * N * dtype.itemsize, reduce_into, rop, xs, buf.flat, n)
                buf.commit()
            else:
                await op.flush()
            return tensor

        return await self._collective("reduce", timeout, body)

    @_refusal_told
    async def all_gather(self, output, input, *, timeout: float | None = None,
                         algorithm: str | None = None, label: str | None = None):
        """Gather every rank's ``input`` into ``output`` on every rank.

        Args:
            output: a list of W arrays shaped like ``input``, or one array of ``W * N`` elements
                (``[W * d0, ...]`` or ``[W, ...]``) whose k-th slice receives rank k's input.
            input: shape ``[...]`` with N elements; same shape and dtype on every rank.
            algorithm: CPU arrays: force ``"direct"``, ``"ring"``, ``"shm"`` or
                ``"hierarchical"`` (hosts of P ranks each: all_gather across hosts among the
                ranks at the same position of every host, then within each host; hosts of
                unequal counts: gather to each host's first rank, all_gather of the hosts'
                blocks among those, broadcast within each host); GPU arrays: ``"ipc"`` or
                ``"nccl"``. Default for CPU arrays of 1 MiB and more (the output) in a group
                on several hosts: ``"hierarchical"`` when it puts fewer parts on a host's link
                than the ring, ``(H-1) * P`` against ``W-1`` (H hosts of at most P ranks, W
                ranks: hosts of two or more ranks each, equal counts), else ``"ring"``
                (tools/bench/multihost.py --op all_gather: 2 x 2 ranks over a 1 Gbit/s link,
                16 MiB in 78 ms against the ring's 104; pipelined in chunks of about
                4 MiB from 8 MiB).
            label: CPU arrays: a name (at most 256 characters) every rank must pass alike; it
                travels in the signature, so ranks calling with different labels get
                ``CollectiveMismatchError`` naming them rather than exchanging unlike data of
                one shape (FullyShardedDataParallel passes its flat parameter's name).

        Returns:
            ``output``.

        Raises:
            ValueError: output of the wrong size or dtype, a bad ``label`` (before anything is
            sent; the other ranks are told at once); others as :meth:`all_reduce`.
        """
        if is_gpu_array(input):
            return await self._gpu().all_gather(output, input, timeout, algorithm)
        _check_label(label)
        n = self.size
        ib = Buffer(input, readonly=True)
        N, dtype = ib.size, ib.dtype
        out_bufs, slots = _parts("all_gather output", "input", output, n, N, dtype, readonly=False)
        mine = _detached(ib.flat, slots, own=slots[self.rank])
        if self._hierarchical("all_gather", n * N * dtype.itemsize, algorithm):
            sig = self._sig("all_gather", "hierarchical", None, None, dtype, N, ib.shape, label=label)
            return await self._hierarchical_all_gather(output, out_bufs, slots, mine, timeout, sig)
        algo = self._choose("all_gather", n * N * dtype.itemsize, algorithm)
        sig = self._sig("all_gather", algo, None, None, dtype, N, ib.shape, label=label)

        async def body(op: Op):
            if algo == "shm":
                await shmops.all_gather(op, self._shm, sig, mine, slots)
            elif algo == "ring":
                await op.hello(sig)
                r = self.rank
                await ring_all_gather(op, [mine if k == r else slots[k] for k in range(n)],
                                      bulk=self._ring_bulk(n * N * dtype.itemsize))
                await off_loop(N * dtype.itemsize, copy_pairs, [(slots[r], mine)])
            else:
                got = await op.hello(sig, None, lambda g: mine) if algo != "local" else {}
                pairs = [(slots[k], mine if k == self.rank else _view(got[k][1], dtype, N))
                         for k in range(n)]
                await off_loop(n * N * dtype.itemsize, copy_pairs, pairs)
                await op.flush()
            for b in out_bufs:
                b.commit()
            return output

        return await self._collective("all_gather", timeout, body)

    @_refusal_told
    async def reduce_scatter(self, output, input, op: ReduceOp = ReduceOp.SUM, *,
                             timeout: float | None = None, algorithm: str | None = None,
                             label: str | None = None):
        """Reduce ``input`` over the group and keep this rank's shard in ``output``.

        Args:
            output: shape ``[...]`` with N elements; dtype of ``input``; written in place.
            input: a list of W arrays shaped like ``output`` (entry k goes to rank k), or one
                array of ``W * N`` elements whose k-th slice goes to rank k.
            op: ``ReduceOp``.
            algorithm: as :meth:`all_gather`'s (``"hierarchical"``, hosts of P ranks each:
                reduce_scatter within each host, then across hosts among the ranks at the same
                position of every host; hosts of unequal counts: reduce the whole input to each
                host's first rank, reduce_scatter of the hosts' blocks among those, scatter
                within each host. AVG runs as SUM and divides at the end, float16/bfloat16
                go through the stages as float32).
            label: as :meth:`all_gather`'s.

        Returns:
            ``output``.

        Raises:
            As :meth:`all_reduce`. Bus bandwidth is reported with the factor (W-1)/W, as
            nccl-tests define it.
        """
        if is_gpu_array(output):
            return await self._gpu().reduce_scatter(output, input, op, timeout, algorithm)
        _check_label(label)
        n = self.size
        ob = Buffer(output)
        N, dtype = ob.size, ob.dtype
        rop = check_op_dtype(op, dtype)
        _, chunks = _parts("reduce_scatter input", "output", input, n, N, dtype, readonly=True)
        chunks = [_detached(c, [ob.flat], own=ob.flat if k == self.rank else None)
                  for k, c in enumerate(chunks)]
        if self._hierarchical("reduce_scatter", n * N * dtype.itemsize, algorithm):
            sig = self._sig("reduce_scatter", "hierarchical", rop, None, dtype, N, ob.shape, label=label)
            return await self._hierarchical_reduce_scatter(output, ob, chunks, rop, timeout, sig)
        algo = self._choose("reduce_scatter", n * N * dtype.itemsize, algorithm)
        sig = self._sig("reduce_scatter", algo, rop, None, dtype, N, ob.shape, label=label)

        async def body(op: Op):
            r = self.rank
            if algo == "local":
                np.copyto(ob.flat, chunks[0])
            elif algo == "shm":
                await shmops.reduce_scatter(op, self._shm, sig, chunks, ob.flat, rop)
            elif algo == "ring":
                await op.hello(sig)
                accdt = acc_dtype(dtype)
                acc = np.empty(n * N, accdt)   # scratch: pages touched only where written
                parts = [acc[k * N:(k + 1) * N] for k in range(n)]
                direct = accdt == dtype        # this rank's chunk reduced into the output itself
                if direct:
                    parts[r] = ob.flat
                await ring_reduce_scatter(op, chunks, parts, rop, bulk=self._ring_bulk(acc.nbytes))
                if not direct:
                    await off_loop(N * dtype.itemsize, _copy_cast, ob.flat, parts[r])
            else:
                got = await op.hello(sig, None, lambda g: chunks[g])
                xs = [chunks[r] if g == r else _view(got[g][1], dtype, N) for g in range(n)]
                await off_loop(n * N * dtype.itemsize, reduce_into, rop, xs, ob.flat, n)
                await op.flush()
            ob.commit()
            return output

        return await self._collective("reduce_scatter", timeout, body)

    @_refusal_told
    async def gather(self, tensor, gather_list: Sequence | None = None, dst: int = 0, *,
                     timeout: float | None = None):
        """Collect every rank's ``tensor`` into ``gather_list`` (W arrays) on group rank ``dst``.

        ``gather_list`` is required on ``dst`` and ignored elsewhere. Returns ``gather_list``.
        Errors as :meth:`all_gather`; a bad ``gather_list`` raises ValueError on ``dst`` and
        ``CollectiveError`` quoting it on the other ranks, at once.
        """
        if is_gpu_array(tensor):
            return await self._gpu().gather(tensor, gather_list, dst, timeout)
        dst = self._check_root("gather", dst)
        n = self.size
        ib = Buffer(tensor, readonly=True)
        N, dtype = ib.size, ib.dtype
        outs = None

        def check_destination() -> list:
            if gather_list is None:
                raise ValueError("gather: gather_list is required on the destination rank")
            bufs = _as_list("gather_list", list(gather_list), n)
            for k, o in enumerate(bufs):
                if o.dtype != dtype or o.size != N:
                    raise ValueError(f"gather_list[{k}] is {o.dtype}[{o.size}], tensor is "
                                     f"{dtype}[{N}]")
            return bufs

        sig = self._sig("gather", "direct", None, dst, dtype, N, ib.shape)

        async def body(op: Op):
            nonlocal outs
            me = self.rank == dst
            if me:
                # checked inside the operation: the other ranks are told at once (an abort naming
                # it) instead of waiting out their deadline, and every rank used the same seq
                outs = check_destination()
            if n == 1:
                got = {}
            else:
                got = await op.hello(sig, None, None if me else (
                    lambda g: ib.flat if g == dst else None))
            if me:
                mine = _detached(ib.flat, [o.flat for o in outs], own=outs[dst].flat)
                for k in range(n):
                    np.copyto(outs[k].flat, mine if k == dst else _view(got[k][1], dtype, N))
                    outs[k].commit()
            else:
                await op.flush()
            return gather_list

        return await self._collective("gather", timeout, body)

    @_refusal_told
    async def scatter(self, tensor, scatter_list: Sequence | None = None, src: int = 0, *,
                      timeout: float | None = None):
        """Send ``scatter_list[k]`` of group rank ``src`` into ``tensor`` of rank k, in place.

        ``scatter_list`` (W arrays shaped like ``tensor``) is required on ``src`` only.
        Returns ``tensor``. Errors as :meth:`all_gather`; a bad ``scatter_list`` raises
        ValueError on ``src`` and ``CollectiveError`` quoting it on the other ranks, at once.
        """
        if is_gpu_array(tensor):
            return await self._gpu().scatter(tensor, scatter_list, src, timeout)
        src = self._check_root("scatter", src)
        n = self.size
        ob = Buffer(tensor)
        N, dtype = ob.size, ob.dtype
        ins = None

        def check_source() -> list:
            if scatter_list is None:
                raise ValueError("scatter: scatter_list is required on the source rank")
            bufs = [Buffer(t, readonly=True) for t in scatter_list]
            if len(bufs) != n:
                raise ValueError(f"scatter_list has {len(bufs)} entries, group size is {n}")
            for k, b in enumerate(bufs):
                if b.dtype != dtype or b.size != N:
                    raise ValueError(f"scatter_list[{k}] is {b.dtype}[{b.size}], tensor is "
                                     f"{dtype}[{N}]")
            return bufs

        sig = self._sig("scatter", "direct", None, src, dtype, N, ob.shape)

        async def body(op: Op):
            nonlocal ins
            me = self.rank == src
            if me:
                # checked inside the operation: the other ranks are told at once (an abort naming
                # it) instead of waiting out their deadline, and every rank used the same seq
                ins = check_source()
            if me:
                sends = [_detached(b.flat, [ob.flat], own=ob.flat if g == src else None)
                         for g, b in enumerate(ins)]
            got = {} if n == 1 else await op.hello(
                sig, None, (lambda g: sends[g]) if me else None)
            if me:
                np.copyto(ob.flat, sends[src])
                await op.flush()
            else:
                np.copyto(ob.flat, _view(got[src][1], dtype, N))
            ob.commit()
            return tensor

        return await self._collective("scatter", timeout, body)

    @_refusal_told
    async def all_to_all(self, output, input, *, timeout: float | None = None):
        """Send ``input[k]`` to rank k and receive rank k's ``input[me]`` into ``output[k]``.

        Args:
            output: W arrays, or one array split evenly into W slices; sizes may differ per
                peer with lists, and must equal the size the peer sends.
            input: W arrays, or one array split evenly into W slices.

        Returns:
            ``output``.

        Raises:
            CollectiveMismatchError: ``field == "splits"`` when a rank's output size for a peer
            differs from what that peer sends; others as :meth:`all_reduce`.
            ValueError: two entries of an ``output`` list share memory (names them).
        """
        if is_gpu_array(input):
            return await self._gpu().all_to_all(output, input, timeout)
        n = self.size
        ins = _as_list("all_to_all input", input, n)
        outs = _as_list("all_to_all output", output, n)
        if ins is None:
            ib = Buffer(input, readonly=True)
            if ib.size % n:
                raise ValueError(f"all_to_all input of {ib.size} elements not divisible by {n}")
            m = ib.size // n
            in_chunks = [ib.flat[k * m:(k + 1) * m] for k in range(n)]
            dtype = ib.dtype
        else:
            in_chunks = [b.flat for b in ins]
            dtype = ins[0].dtype
        if outs is None:
            obuf = Buffer(output)
            if obuf.size % n:
                raise ValueError(f"all_to_all output of {obuf.size} elements not divisible by {n}")
            m = obuf.size // n
            out_chunks = [obuf.flat[k * m:(k + 1) * m] for k in range(n)]
            out_bufs = [obuf]
        else:
            # (overlapping entries were taken, and the result hung on the order of the writes:
            # a breaker's find; all_gather refused them)
            _refuse_overlapping("all_to_all output", [b.array for b in outs])
            out_chunks = [b.flat for b in outs]
            out_bufs = outs
        for a in in_chunks + out_chunks:
            if a.dtype != dtype:
                raise ValueError(f"all_to_all mixes dtypes {a.dtype} and {dtype}")
        splits = [[int(a.size) for a in in_chunks], [int(a.size) for a in out_chunks]]
        sig = self._sig("all_to_all", "direct", None, None, dtype, None, None, None)
        r = self.rank
        in_chunks = [_detached(c, out_chunks, own=out_chunks[r] if k == r else None)
                     for k, c in enumerate(in_chunks)]

        async def body(op: Op):
            got = {} if n == 1 else await op.hello(sig, splits, lambda g: in_chunks[g])
            got[r] = (splits, None)
            _check_splits(self, {g: got[g][0] for g in range(n)})
            for k in range(n):
                src = in_chunks[r] if k == r else _view(got[k][1], dtype, out_chunks[k].size)
                np.copyto(out_chunks[k], src)
            await op.flush()
            for b in out_bufs:
                b.commit()
            return output

        return await self._collective("all_to_all", timeout, body)

    @_refusal_told
    async def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every rank of the group has entered the barrier."""
        sig = self._sig("barrier", "direct")

        async def body(op: Op):
            if self.size > 1:
                await op.hello(sig)

        await self._collective("barrier", timeout, body)

    # -- point to point --------------------------------------------------------------------------

    def send(self, tensor, dst: int, tag: int = 0, *, timeout: float | None = None):
        """Send ``tensor`` to group rank ``dst``; matched with ``recv(src=me, tag=tag)`` there.

        The message is queued when the call first runs, so it is delivered even if the call is
        then wrapped in a task that is dropped or cancelled. Returns when the buffer may be
        modified again (a large message is sent without a copy; this waits until the transport
        has taken it); cancelled, it raises ``CancelledError`` at that same point (at most the
        deadline later), and the peer still receives the message. Cancelled before its message
        was queued (before it began, or while the group was held), the matching ``recv`` fails
        with ``CollectiveRefusedError`` instead of taking this sender's next message.

        A message not taken before the deadline (``CollectiveTimeout``) stays queued and may
        still be delivered, read from the buffer then: leave the buffer alone until the group's
        epoch ends (a message of an ended epoch is dropped on arrival).

        Raises:
            ValueError: bad ``dst``/``tag`` or dtype. ClosedError/PeerLostError: the group's
            epoch ended (checked first, as the collectives do). CollectiveTimeout: a large
            message was not taken before the deadline (``exc.ranks == [dst's world rank]``).
        """
        return Call(self._send(tensor, dst, tag, timeout), functools.partial(self._send_cancelled, dst, tag))

    def _send_cancelled(self, dst, tag) -> None:
        """A send cancelled before its message was queued: its ``recv`` fails at once, naming
        that, instead of taking this sender's next message of that tag (a re-verifier's find)."""
        if self._can_tell_peers():
            self._refuse_send(dst, tag, CollectiveError("the send was cancelled on that rank before "
                                                        "its message was queued"))

    async def _send(self, tensor, dst: int, tag: int, timeout: float | None) -> None:
        try:
            # first, as _collective does: after aclose() the group may be of size 1 (its peers
            # left), and the rank check said "rank 1 is not a rank of this group" where every
            # collective said ClosedError (a tester's find)
            self._check_usable()
            if is_gpu_array(tensor):
                self._check_root("send", dst)
                return await self._gpu().send(tensor, dst, tag, timeout)
            await self._send_host(tensor, dst, tag, timeout)
        except (ValueError, TypeError) as exc:
            self._refuse_send(dst, tag, exc)
            raise

    def _refuse_send(self, dst, tag, exc: BaseException) -> None:
        """This rank refused its send (a bad argument): tell ``dst``, whose matching recv then
        fails at once with ``CollectiveRefusedError`` (it waited out its deadline, and a group
        whose ranks then went on to a collective was out of step: a tester's find). Nothing is
        sent when ``dst`` or ``tag`` is itself what was refused, or the group is over."""
        peer = self._p2p_peer(dst, tag)
        if peer is None:
            return
        with contextlib.suppress(Exception):   # best effort: the refusal itself is raised here
            self.engine._p2p_send(peer, self.gid, int(tag),
                                  [_REFUSED, f"{type(exc).__name__}: {exc}"[:2000]], None)

    def _p2p_peer(self, peer, tag) -> int | None:
        """The world rank of group rank ``peer`` for a refused send or recv's notice, or None when
        ``peer`` or ``tag`` is itself what was refused (or this rank), or the group is over."""
        try:
            peer = self._check_root("p2p", peer)
            _check_tag(tag)
        except ValueError:
            return None
        if peer == self.rank or self._dead is not None or self.engine.fenced is not None:
            return None
        return self.ranks[peer]

    async def _send_host(self, tensor, dst: int, tag: int, timeout: float | None) -> None:
        dst = self._check_root("send", dst)
        if dst == self.rank:
            raise ValueError("send to self")
        _check_tag(tag)
        buf = Buffer(tensor, readonly=True)
        timeout_s = self._timeout_s(timeout)
        try:
            await self.engine.wait_not_held()
        except asyncio.CancelledError:
            self._send_cancelled(dst, tag)
            raise
        self._check_usable()
        payload = buf.flat
        meta = [dtype_name(buf.dtype), list(buf.shape)]
        tracker = self.engine._p2p_send(self.ranks[dst], self.gid, int(tag), meta, payload)
        if tracker is not None:
            # zmq gives no event when a zero-copy send is done: poll, backing off from 0.2 ms to
            # 2 ms as the collectives' flush does, and stop when the group's epoch ends
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            delay_s = 0.0002
            try:
                while not tracker.done:
                    self._check_usable()
                    if loop.time() > deadline:
                        raise CollectiveTimeout(f"send to rank {self.ranks[dst]}: not taken in "
                                                f"{timeout_s:g} s", ranks=[self.ranks[dst]], op="send")
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, 0.002)
            except asyncio.CancelledError:
                # the queued message cannot be withdrawn and is read from this buffer: the
                # cancellation takes effect once the transport has taken it (a breaker's find:
                # the caller wrote its buffer after the cancel and the peer received a mix)
                while not tracker.done and loop.time() < deadline and self._dead is None \
                        and self.engine.fenced is None:
                    with contextlib.suppress(asyncio.CancelledError):   # (cancelled again)
                        await asyncio.sleep(0.001)
                raise

    async def recv(self, tensor, src: int, tag: int = 0, *, timeout: float | None = None) -> int:
        """Receive into ``tensor`` (in place) the message group rank ``src`` sent with ``tag``.

        Messages are matched by (source, tag) in the order they were sent, whatever order sends
        and receives are posted in.

        Returns:
            ``src``.

        Raises:
            ValueError: bad ``src`` or dtype.
            CollectiveMismatchError: the message's dtype or shape differs from ``tensor``'s.
            CollectiveTimeout: nothing arrived in time (``exc.ranks == [src's world rank]``).
            ClosedError/PeerLostError: the group's epoch ended (a rank was lost, for instance);
                checked first, as in :meth:`send`.
        """
        try:
            self._check_usable()
            if is_gpu_array(tensor):
                self._check_root("recv", src)
                return await self._gpu().recv(tensor, src, tag, timeout)
            return await self._recv_host(tensor, src, tag, timeout)
        except (ValueError, TypeError):
            # (GPU point-to-point moves through host memory: the same messages, the same drop)
            self._refuse_recv(src, tag)
            raise

    def _refuse_recv(self, src, tag) -> None:
        """This rank refused its recv before taking a message (a bad argument): the message
        it would have taken is dropped (:meth:`Engine._p2p_discard`), so the next recv from
        ``src`` gets the next send's."""
        peer = self._p2p_peer(src, tag)
        if peer is not None:
            self.engine._p2p_discard(self.gid, peer, int(tag))

    async def _recv_host(self, tensor, src: int, tag: int, timeout: float | None) -> int:
        src = self._check_root("recv", src)
        if src == self.rank:
            raise ValueError("recv from self")
        _check_tag(tag)
        buf = Buffer(tensor)
        timeout_s = self._timeout_s(timeout)
        self._check_usable()
        meta, payload = await self.engine._p2p_recv(self.gid, self.ranks[src], int(tag), timeout_s)
        mine = [dtype_name(buf.dtype), list(buf.shape)]
        me_w, src_w = self.ranks[self.rank], self.ranks[src]
        if not (isinstance(meta, list) and len(meta) == 2):
            raise CollectiveError(f"recv: malformed message from rank {src_w}")
        if meta[0] == _REFUSED:
            raise CollectiveRefusedError(
                f"rank {src_w} refused its send matching this recv (tag {tag}): {meta[1]}",
                rank=src_w, reason=str(meta[1]))
        for i, fname in enumerate(("dtype", "shape")):
            if meta[i] != mine[i]:
                raise CollectiveMismatchError(
                    f"recv tag {tag}: rank {src_w} sent {fname} {meta[i]}, rank {me_w} expects "
                    f"{mine[i]}", field=fname, values={src_w: meta[i], me_w: mine[i]})
        np.copyto(buf.flat, _view(payload, buf.dtype, buf.size))
        buf.commit()
        return src

    # -- hierarchical all_reduce (CPU and GPU arrays) ------------------------------------------

    def _by_host(self) -> dict:
        """This group's world ranks by host (``WorldView.hosts``: the agents' ``RTXNET_HOST`` or
        hostname): each host's ranks in ascending order, hosts in order of their lowest rank
        (whatever the group's own order: a ``split`` orders its ranks by key), so a host's first
        rank is rank 0 of its host group (``new_group`` sorts); made once per group."""
        if self._by_host_cache is None:
            hosts = self.engine.view.hosts
            by_host: dict = {}
            for r in sorted(self.ranks):
                by_host.setdefault(hosts.get(r), []).append(r)
            self._by_host_cache = by_host
        return self._by_host_cache

    def _hosts_shared(self) -> bool:
        """Whether the group spans several hosts and some host has two or more of its ranks (then
        hierarchical all_reduce sends fewer bytes across hosts than a flat ring; with one rank
        per host it is the flat ring)."""
        by_host = self._by_host()
        return len(by_host) > 1 and max(map(len, by_host.values())) > 1

    def _inner(self, role: str, ranks: list[int]) -> Group | None:
        """The group of world ``ranks`` (sorted) that this group's hierarchical collectives use
        for ``role`` (``intra``, ``leaders``, ``rail``), or None where this rank is not in it.
        Its id derives from this group's, not from :meth:`new_group`'s count of groups per rank
        set: made lazily on the loop thread, a count shared with the user's ``new_group`` (the
        blocking facade's calling thread) gave one group two ids on two ranks when the user's
        call came before it on one and after it on the other, and the user's subgroup traffic was
        matched with the hierarchical collective's (a breaker's find: 204 where 6 was due)."""
        rs = sorted(ranks)
        if self.engine.view.rank not in rs:
            return None
        return Group._create(self.engine, f"{self.gid}/{role}:{','.join(map(str, rs))}", rs)

    def _host_groups(self) -> tuple[Group, Group | None]:
        """``(this host's ranks, the hosts' first ranks or None here)``, made once per group."""
        if self._host_groups_cache is None:
            by_host = self._by_host()
            mine = by_host[self.engine.view.hosts.get(self.ranks[self.rank])]
            intra = self._inner("intra", mine)
            leaders = self._inner("leaders", [v[0] for v in by_host.values()])
            self._host_groups_cache = (intra, leaders)
        return self._host_groups_cache

    async def _hierarchical_all_reduce(self, tensor, rop: ReduceOp, timeout: float | None,
                                       meta: tuple) -> Any:
        """all_reduce as reduce to each host's first rank, all_reduce among those, broadcast
        within each host: the bytes crossing hosts are one array per host instead of one per rank.
        CPU float16/bfloat16 go through the stages as float32 (:func:`_wide`), rounded once at
        the end; GPU ones round at each stage, AVG as :func:`_avg_plan` says. ``meta``: the
        array's ``(dtype, numel, shape)`` for the signature every rank checks first (see
        :meth:`_hello_first`)."""
        gpu = is_gpu_array(tensor)
        intra, leaders = self._host_groups()
        buf = None if gpu else Buffer(tensor)
        # CPU float16/bfloat16: the stages on a float32 copy, so partial sums round once, at the
        # end, as the flat algorithms'; a host's float16 sum overflowed 65504 where the whole
        # sum fits (two ranks of 40000 beside one of -40000: inf, a tester's find). The bytes
        # crossing hosts double, as the ring's, which also moves float32.
        wide = None if buf is None else _wide(buf.dtype)
        sub, pre = (_sum_for_avg(rop), False) if wide is not None else _avg_plan(rop, tensor)
        nbytes = 0 if buf is None else buf.size * (wide or buf.dtype).itemsize
        k = min(PIPELINE_MAX_CHUNKS, nbytes // PIPELINE_CHUNK_NBYTES)   # the same on every rank
        sig = self._sig("all_reduce", "hierarchical", rop, None, *meta)

        async def body(op: Op):
            await self._hello_first(op, sig)
            if wide is not None:
                arr = np.empty(buf.size, wide)
                await off_loop(nbytes, _copy_cast, arr, buf.flat)
            else:
                arr = buf.flat if k >= 2 else tensor
            if pre:
                _divide_in_place(arr, self.size)

            async def stages() -> None:
                if k >= 2:
                    await _pipelined_hierarchical(intra, leaders, np.array_split(arr, k), sub, timeout)
                    return
                await intra.reduce(arr, 0, sub, timeout=timeout)
                if leaders is not None:
                    await leaders.all_reduce(arr, sub, timeout=timeout,
                                             algorithm="nccl" if gpu else None)
                await intra.broadcast(arr, 0, timeout=timeout)

            if gpu:   # (GPU stages keep their own numbering: NCCL and IPC boards, untested so)
                await stages()
            else:
                await self._in_step(op, (intra, leaders), stages())
            if rop is ReduceOp.AVG and not pre:
                await off_loop(nbytes, _divide_in_place, arr, self.size)
            if wide is not None:
                await off_loop(nbytes, _copy_cast, buf.flat, arr)
            if wide is not None or k >= 2:
                buf.commit()
            return tensor

        return await self._collective("all_reduce", timeout, body)

    async def _hello_first(self, op: Op, sig: list) -> None:
        """A hierarchical collective's first step: the signature exchange of this group's
        operation, before any operation of its host, leader or rail groups. Without it a rank
        that refused the call (its abort reached an operation no rank waited on) or passed
        another size, dtype or op sent the other ranks into those groups' operations: they took
        the refusing rank's next call's data there (a breaker's find: 22 where the next call was
        due 60), or those on another host waited out the whole deadline with a timeout naming
        nobody. Now they fail as the flat algorithms do (``CollectiveRefusedError``,
        ``CollectiveMismatchError`` on every rank at once), and the inner groups stay in step."""
        await op.hello(sig)

    async def _in_step(self, op: Op, groups: tuple, stages) -> Any:
        """Run ``stages`` (a coroutine: the operations of host, leader or rail ``groups`` that
        hierarchical operation ``op`` is made of) numbered from ``op.seq * _INNER_STRIDE`` in
        each of those groups, and cut short when ``op`` fails (:meth:`Op.bounded`). A rank
        whose call was cancelled or failed part-way made fewer of those groups' operations than
        its host-mates; numbered on from there, its next call's were paired with their previous
        call's for good (a reduce against a broadcast: timeouts, or waits naming nobody, a
        breaker's find). Every rank now numbers each hierarchical operation's stages alike, and
        drops what comes for the numbers it skipped."""
        base = op.seq * _INNER_STRIDE
        for g in groups:
            if g is not None and g._seq < base:
                g._seq = base
                self.engine._skip_to(g.gid, base)
        return await op.bounded(stages)

    # -- hierarchical all_gather and reduce_scatter (CPU arrays) --------------------------------

    def _hierarchical(self, opname: str, nbytes: int, forced: str | None) -> bool:
        """Whether CPU ``opname`` (all_gather, reduce_scatter; ``nbytes``: the gathered output,
        the scattered input) runs hierarchical: forced (``algorithm=``, else the group's
        ``algorithm``), or by default from ``ring.BULK_MIN_NBYTES`` in a group on several hosts
        where it puts fewer parts on a host's link than the ring: ``(H-1) * P < W-1`` (H hosts
        of at most P ranks; hierarchical sends the other hosts' blocks of P parts, padded, the
        ring W-1 parts once across each host boundary)."""
        if forced is None and self.algorithm in ALGORITHMS[opname] + ("hierarchical",):
            forced = self.algorithm
        if forced is not None:
            return forced == "hierarchical"
        if self.size == 1 or nbytes < ring_mod.BULK_MIN_NBYTES:
            return False
        sizes = [len(v) for v in self._by_host().values()]
        return len(sizes) > 1 and (len(sizes) - 1) * max(sizes) < self.size - 1

    def _host_layout(self) -> tuple[list[list[int]], int, int]:
        """``(hosts, P, h)``: each host's **group** ranks (hosts in the order of the hosts' group
        of first ranks, each host's ranks in its host group's order: see :meth:`_by_host`), the
        most ranks one host holds, and the index of this rank's host."""
        index = {w: g for g, w in enumerate(self.ranks)}
        hosts = [[index[w] for w in v] for v in self._by_host().values()]
        h = next(i for i, v in enumerate(hosts) if self.rank in v)
        return hosts, max(map(len, hosts)), h

    def _rails(self) -> tuple[Group, Group, list[list[int]]]:
        """For hosts of equal rank counts: ``(intra, rail, orders)``: this host's group, this
        rank's **rail** (the ranks of every host at this rank's position in its host), and for
        each position p, the host indices in the order of rail p's group ranks (rails sort their
        world ranks, which need not follow the hosts' order); made once per group."""
        if self._rails_cache is None:
            intra, _ = self._host_groups()
            world = list(self._by_host().values())      # world ranks, host by host
            p = intra.rank
            orders = [sorted(range(len(world)), key=lambda i, q=q: world[i][q])
                      for q in range(len(world[0]))]
            rail = self._inner("rail", [v[p] for v in world])
            self._rails_cache = (intra, rail, orders)
        return self._rails_cache

    async def _hierarchical_all_gather(self, output, out_bufs: list, slots: list, mine: np.ndarray,
                                       timeout: float | None, sig: list):
        """all_gather in two stages when every host holds P ranks (H hosts): all_gather across
        hosts within each rail (the ranks at one position of every host: H parts), then
        all_gather of those H-part blocks within each host (shared memory). Each host puts
        ``P (H-1)`` parts on its link, from P ranks at once, against the ring's ``W-1`` from one
        (half of the ring's 3 parts on 2 x 2 ranks). Hosts of unequal counts: see
        :meth:`_leader_all_gather`."""
        if len({len(v) for v in self._by_host().values()}) > 1:
            return await self._leader_all_gather(output, out_bufs, slots, mine, timeout, sig)
        intra, rail, orders = self._rails()
        hosts, P, _ = self._host_layout()
        H, n, N, dtype = len(hosts), self.size, mine.size, mine.dtype
        bounds = _chunk_bounds(N, n * N * dtype.itemsize)

        async def body(op: Op):
            await self._hello_first(op, sig)
            # chunk c of every part: across hosts (by_rail[c], in the rail group's order), then
            # within the host (full[c], by position in the host); chunk c+1 crosses the link
            # while chunk c is exchanged within the host
            by_rail = [np.empty(H * (hi - lo), dtype) for lo, hi in bounds]
            full = [np.empty(P * H * (hi - lo), dtype) for lo, hi in bounds]
            await self._in_step(op, (rail, intra), _pipelined(
                [functools.partial(rail.all_gather, by_rail[c], mine[lo:hi], timeout=timeout)
                 for c, (lo, hi) in enumerate(bounds)],
                [functools.partial(intra.all_gather, full[c], by_rail[c], timeout=timeout)
                 for c in range(len(bounds))]))
            pairs = [(slots[hosts[i][q]][lo:hi], full[c][(q * H + k) * (hi - lo):(q * H + k + 1) * (hi - lo)])
                     for c, (lo, hi) in enumerate(bounds) for q in range(P) for k, i in enumerate(orders[q])]
            await _copy_out(pairs, out_bufs)
            return output

        return await self._collective("all_gather", timeout, body)

    async def _hierarchical_reduce_scatter(self, output, ob: Buffer, chunks: list, rop: ReduceOp,
                                           timeout: float | None, sig: list):
        """reduce_scatter in two stages when every host holds P ranks (H hosts): reduce_scatter
        within each host (shared memory), position p keeping the host's partial sums of the H
        parts of rail p, then reduce_scatter of those across hosts within each rail. Each host
        puts ``P (H-1)`` parts on its link, from P ranks at once, against the ring's ``W-1``.
        float16/bfloat16 go through the stages as float32 (:func:`_wide`), rounded once at the
        end. Hosts of unequal counts: see :meth:`_leader_reduce_scatter`."""
        if len({len(v) for v in self._by_host().values()}) > 1:
            return await self._leader_reduce_scatter(output, ob, chunks, rop, timeout, sig)
        intra, rail, orders = self._rails()
        hosts, P, _ = self._host_layout()
        H, n, N = len(hosts), self.size, ob.size
        wide = _wide(ob.dtype)
        dtype = wide or ob.dtype        # the stages' dtype
        sub = _sum_for_avg(rop)
        bounds = _chunk_bounds(N, n * N * dtype.itemsize)

        async def body(op: Op):
            await self._hello_first(op, sig)
            # chunk c of every part, by rail (each in its group's order): reduced within the
            # host (by_rail[c]: this host's sums of this rail's parts), then across hosts into
            # chunk c of the output, while chunk c+1 is reduced within the host
            xs = [np.empty(P * H * (hi - lo), dtype) for lo, hi in bounds]
            pairs = [(xs[c][(q * H + k) * (hi - lo):(q * H + k + 1) * (hi - lo)], chunks[hosts[i][q]][lo:hi])
                     for c, (lo, hi) in enumerate(bounds) for q in range(P) for k, i in enumerate(orders[q])]
            await off_loop(n * N * dtype.itemsize, copy_pairs, pairs)
            by_rail = [np.empty(H * (hi - lo), dtype) for lo, hi in bounds]
            out = ob.flat if wide is None else np.empty(N, wide)
            await self._in_step(op, (intra, rail), _pipelined(
                [functools.partial(intra.reduce_scatter, by_rail[c], xs[c], sub, timeout=timeout)
                 for c in range(len(bounds))],
                [functools.partial(rail.reduce_scatter, out[lo:hi], by_rail[c], sub, timeout=timeout)
                 for c, (lo, hi) in enumerate(bounds)]))
            await _average_and_commit(ob, out, rop, n)
            return output

        return await self._collective("reduce_scatter", timeout, body)

    async def _leader_all_gather(self, output, out_bufs: list, slots: list, mine: np.ndarray,
                                 timeout: float | None, sig: list):
        """all_gather on hosts of unequal rank counts: gather to each host's first rank (a
        block of the host's parts, padded to the largest host's P), all_gather of the H blocks
        among the hosts' first ranks, broadcast of all of them within each host: the bytes
        crossing hosts are the other hosts' blocks, ``(H-1) P`` parts."""
        intra, leaders = self._host_groups()
        hosts, P, h = self._host_layout()
        N, dtype = mine.size, mine.dtype

        async def body(op: Op):
            await self._hello_first(op, sig)
            full = np.empty(len(hosts) * P * N, dtype)
            block = full[h * P * N:(h + 1) * P * N]

            async def stages() -> None:
                if leaders is not None:      # this host's first rank (rank 0 of its host group)
                    parts = [block[p * N:(p + 1) * N] for p in range(len(hosts[h]))]
                    await intra.gather(mine, parts, 0, timeout=timeout)
                    await leaders.all_gather(full, block, timeout=timeout)
                else:
                    await intra.gather(mine, None, 0, timeout=timeout)
                await intra.broadcast(full, 0, timeout=timeout)

            await self._in_step(op, (intra, leaders), stages())
            pairs = [(slots[g], full[(i * P + p) * N:(i * P + p + 1) * N])
                     for i, v in enumerate(hosts) for p, g in enumerate(v)]
            await _copy_out(pairs, out_bufs)
            return output

        return await self._collective("all_gather", timeout, body)

    async def _leader_reduce_scatter(self, output, ob: Buffer, chunks: list, rop: ReduceOp,
                                     timeout: float | None, sig: list):
        """reduce_scatter on hosts of unequal rank counts: reduce of the whole input (in host
        order, padded to the largest host's P parts a host) to each host's first rank,
        reduce_scatter of the hosts' blocks among those, scatter within each host: the bytes
        crossing hosts are the other hosts' blocks of partial sums, ``(H-1) P`` parts.
        float16/bfloat16 go through the stages as float32 (:func:`_wide`)."""
        intra, leaders = self._host_groups()
        hosts, P, h = self._host_layout()
        n, N = self.size, ob.size
        wide = _wide(ob.dtype)
        dtype = wide or ob.dtype        # the stages' dtype
        sub = _sum_for_avg(rop)

        async def body(op: Op):
            await self._hello_first(op, sig)
            # this rank's input in host order (zeros where a smaller host has no rank); its
            # host's first rank reduces the host's inputs into it
            x = np.zeros(len(hosts) * P * N, dtype)
            pairs = [(x[(i * P + p) * N:(i * P + p + 1) * N], chunks[g])
                     for i, v in enumerate(hosts) for p, g in enumerate(v)]
            await off_loop(n * N * dtype.itemsize, copy_pairs, pairs)
            out = ob.flat if wide is None else np.empty(N, wide)

            async def stages() -> None:
                await intra.reduce(x, 0, sub, timeout=timeout)
                if leaders is not None:
                    block = x[h * P * N:(h + 1) * P * N]     # this host's block of the sums
                    await leaders.reduce_scatter(block, x, sub, timeout=timeout)
                    parts = [block[p * N:(p + 1) * N] for p in range(len(hosts[h]))]
                    await intra.scatter(out, parts, 0, timeout=timeout)
                else:
                    await intra.scatter(out, None, 0, timeout=timeout)

            await self._in_step(op, (intra, leaders), stages())
            await _average_and_commit(ob, out, rop, n)
            return output

        return await self._collective("reduce_scatter", timeout, body)

    # -- subgroups -----------------------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Group | None:
        """A group of the given **world** ranks (a subset of this group's), sorted.

        Only members need to call it; members must create groups of the same rank set in the
        same order. Returns ``None`` on a rank that is not a member. No communication.

        Raises:
            ValueError: ``ranks`` is not a sequence (names it), duplicate ranks, ranks that are
                not ints, or ranks not in this group.
        """
        self._check_usable()
        # (a str is iterable, and its characters were then refused as "not ints")
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise ValueError(f"new_group ranks must be a sequence of world ranks (ints), got {ranks!r} "
                             f"({type(ranks).__name__})")
        ranks = list(ranks)   # once: a generator would be used up by the first check
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
        if bad:
            raise ValueError(f"new_group ranks must be ints, got {bad}")
        rs = sorted(int(r) for r in ranks)
        if len(set(rs)) != len(rs) or not rs:
            raise ValueError(f"new_group ranks must be distinct and non-empty: {list(ranks)}")
        outside = [r for r in rs if r not in self.ranks]
        if outside:
            raise ValueError(f"new_group: ranks {outside} are not in group {self.gid!r}")
        key = tuple(rs)
        k = self.engine._group_counter.get(key, 0)
        self.engine._group_counter[key] = k + 1
        if self.engine.view.rank not in rs:
            return None
        return Group._create(self.engine, f"{','.join(map(str, rs))}#{k}", rs)

    @_refusal_told
    async def split(self, color: int | None, key: int = 0, *,
                    timeout: float | None = None) -> Group | None:
        """Split this group by ``color``; ranks in each new group are ordered by (key, rank).

        A collective over this group. ``color=None`` joins no group and gets ``None``.

        Raises:
            ValueError: color or key is not an int in the signed 64-bit range (names it).
        """
        for name, v in (("color", color), ("key", key)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise ValueError(f"split {name} must be an int, got {v!r}")
            if v is not None and not -2**63 <= int(v) < 2**63:
                raise ValueError(f"split {name} must be in the signed 64-bit range, got {v!r}")
        if key is None:
            raise ValueError("split key must be an int")
        mine = [None if color is None else int(color), int(key)]
        sig = self._sig("split", "direct")
        seq_box = {}

        async def body(op: Op):
            seq_box["seq"] = op.seq
            got = {self.rank: (mine, None)} if self.size == 1 else await op.hello(sig, mine)
            return {g: got[g][0] for g in range(self.size)}

        colors = await self._collective("split", timeout, body)
        if color is None:
            return None
        members = sorted((c[1], g) for g, c in colors.items() if c[0] == mine[0])
        ranks = [self.ranks[g] for _, g in members]
        return Group._create(self.engine, f"{self.gid}/{seq_box['seq']}:{mine[0]}", ranks)


async def _pipelined_hierarchical(intra: Group, leaders: Group | None, chunks: list, rop: ReduceOp,
                                  timeout: float | None) -> None:
    """Hierarchical all_reduce of CPU ``chunks`` (views of one flat array, in place) as a
    pipeline: while the hosts' first ranks all-reduce chunk i across hosts, chunk i+1 is reduced
    within each host, and the broadcasts back overlap the last chunks' exchange, so the time is
    about the slowest stage's, not the three stages' sum.

    Every rank queues its host group's operations in one order, reduce 0..k-1 then broadcast
    0..k-1 (a group runs its operations in call order; the first rank calls broadcast i once
    chunk i is all-reduced, which happens in chunk order). On a failure the rest are cancelled
    and the first error is raised."""
    async def across_then_back(c) -> None:
        if leaders is not None:
            await leaders.all_reduce(c, rop, timeout=timeout)
        await intra.broadcast(c, 0, timeout=timeout)

    await _pipelined([functools.partial(intra.reduce, c, 0, rop, timeout=timeout) for c in chunks],
                     [functools.partial(across_then_back, c) for c in chunks])


async def _copy_out(pairs: list, out_bufs: list) -> None:
    """A hierarchical all_gather's last step: its blocks into the output's parts, off the loop,
    then the output's buffers written back (non-contiguous outputs)."""
    await off_loop(sum(src.nbytes for _, src in pairs), copy_pairs, pairs)
    for b in out_bufs:
        b.commit()


async def _average_and_commit(ob: Buffer, out: np.ndarray, rop: ReduceOp, n: int) -> None:
    """A hierarchical reduce_scatter's last step: AVG (run as SUM) divided by the ``n`` ranks in
    ``out`` (``ob.flat``, or the float32 sums of a float16/bfloat16 output), ``out`` rounded
    into ``ob.flat`` when it is another array, then the output written back."""
    if rop is ReduceOp.AVG:
        await off_loop(out.nbytes, _divide_in_place, out, n)
    if out is not ob.flat:
        await off_loop(out.nbytes, _copy_cast, ob.flat, out)
    ob.commit()


def _sum_for_avg(rop: ReduceOp) -> ReduceOp:
    """The op a hierarchical collective's stages run: AVG runs as SUM (divided at the end)."""
    return ReduceOp.SUM if rop is ReduceOp.AVG else rop


def _chunk_bounds(N: int, nbytes: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the chunks a pipelined hierarchical all_gather / reduce_scatter cuts
    every part of ``N`` elements into, for ``nbytes`` in all (the gathered output, the scattered
    input): one chunk below ``2 * PIPELINE_CHUNK_NBYTES``, else about ``PIPELINE_CHUNK_NBYTES``
    of ``nbytes`` each, at most ``PIPELINE_MAX_CHUNKS`` (as the hierarchical all_reduce's)."""
    k = max(1, min(PIPELINE_MAX_CHUNKS, nbytes // PIPELINE_CHUNK_NBYTES, N))
    edges = [N * c // k for c in range(k + 1)]
    return list(itertools.pairwise(edges))


async def _pipelined(first: list, second: list) -> None:
    """Start every ``first[c]()`` at once (each group runs its operations in call order), and
    ``second[c]()`` as soon as ``first[c]()`` has finished, so stage two of chunk c overlaps
    stage one of chunk c+1. On a failure the rest are cancelled and the first error is raised."""
    tasks = [asyncio.ensure_future(f()) for f in first]
    try:
        for c, g in enumerate(second):
            await tasks[c]
            tasks.append(asyncio.ensure_future(g()))
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _stamp_epoch(exc: BaseException, epoch: int) -> None:
    """Record on a collective's error the epoch it ran in (what ``reform(epoch=)`` takes)."""
    if isinstance(exc, (CollectiveError, CollectiveTimeout)) and exc.epoch is None:
        exc.epoch = epoch


def _check_label(label) -> None:
    """``label=`` of all_gather / reduce_scatter: None or a short str (it travels in the
    signature every rank checks)."""
    if label is not None and not (isinstance(label, str) and len(label) <= 256):
        raise ValueError(f"label must be None or a str of at most 256 characters, got {label!r:.80}")


# the dtype field of a P2P message that says its send was refused (see Group._refuse_send)
_REFUSED = "!refused"


def _check_tag(tag) -> None:
    """Raises ValueError naming ``tag`` unless it is an int in (-2**62, 2**62)."""
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise ValueError(f"tag must be an int, got {tag!r} ({type(tag).__name__})")
    if not -(1 << 62) < int(tag) < (1 << 62):
        raise ValueError(f"tag({tag}) is out of range: a tag lies strictly between -2**62 and 2**62")


@quiet
def _copy_cast(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src, casting="unsafe")


def _wide(dtype: np.dtype) -> np.dtype | None:
    """float32 for a CPU hierarchical collective's float16/bfloat16 stages (``acc_dtype``), else
    ``None`` (the stages run in the array's own dtype)."""
    acc = acc_dtype(dtype)
    return None if acc == dtype else acc


def _avg_plan(rop: ReduceOp, tensor) -> tuple[ReduceOp, bool]:
    """``(the op a hierarchical all_reduce's stages run, whether each rank divides its input by
    the world size before them)`` for arrays whose stages run in their own dtype (GPU arrays; CPU
    float16/bfloat16 go through the stages as float32, :func:`_wide`). AVG runs as SUM. float16
    divides first, as NCCL's ``ncclAvg`` pre-multiplies each input by ``1/n`` for floating
    types: its partial sums are rounded to float16 between the stages, and a host's sum of values
    the mean holds would overflow 65504 (4 ranks of 40000: ``inf`` before, a tester's find).
    Every other dtype divides once at the end (one rounding less; bfloat16 has float32's
    range)."""
    if rop is not ReduceOp.AVG:
        return rop, False
    return ReduceOp.SUM, str(getattr(tensor, "dtype", "")) in ("float16", "torch.float16")


@quiet
def _divide_in_place(tensor, n: int) -> None:
    """``tensor /= n`` in place: torch tensors on their current stream, CuPy arrays on CuPy's,
    NumPy arrays (and bfloat16) on the host."""
    if is_gpu_array(tensor):
        # on the producer's stream (the caller's, under the blocking API), which rtxnet's
        # writes are already ordered before
        from rtxnet.collectives.gpu.stream import foreign_stream, producer_stream

        stream = producer_stream(tensor)
        if type(tensor).__module__.startswith("torch"):
            import torch

            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=tensor.device)):
                tensor.div_(n)
        else:
            with foreign_stream(stream, tensor.device.id):
                tensor /= n
    elif type(tensor).__module__.startswith("torch"):
        tensor.div_(n)
    elif isinstance(tensor, np.ndarray):
        np.divide(tensor, n, out=tensor, casting="unsafe")
    else:
        a = Buffer(tensor).array
        np.divide(a, n, out=a, casting="unsafe")


def _check_splits(group: Group, splits: dict[int, list]) -> None:
    n = group.size
    bad = {}
    for i in range(n):
        for j in range(n):
            sent, expect = splits[i][0][j], splits[j][1][i]
            if sent != expect:
                bad[f"{group.ranks[i]}->{group.ranks[j]}"] = [sent, expect]
    if bad:
        raise CollectiveMismatchError(
            f"all_to_all: ranks disagree on splits, element counts (sent, expected): {bad}",
            field="splits", values=bad)
