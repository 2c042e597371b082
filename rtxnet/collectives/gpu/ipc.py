"""Same-host GPU collectives over CUDA IPC: peers map each other's buffers and run CuPy kernels.

Every rank of a group on one host (several may share one GPU, which NCCL refuses) exports the
allocations that hold its buffers (``cudaIpcGetMemHandle`` of the allocation's base, found with
``cuMemGetAddressRange``, plus the offset) in the operation's signature exchange (``Op.hello``);
a peer opens each handle once (``cudaIpcOpenMemHandle``) and caches it by the handle's bytes, so a
training loop that reuses its buckets opens nothing after the first step. Handles are closed when
the group's epoch ends and at exit.

Ordering uses two inter-process CUDA events per rank and group, ``ready`` and ``done``, and the
group's :class:`.handshake.Handshake` (control messages, or signal boards: a few words in host
shared memory that peers poll, see :mod:`.handshake`):

1. rtxnet's stream waits for the user's stream, then records ``ready``, and the rank offers its
   buffers (their IPC handles and offsets) and its events' handles to its peers: the hello,
   sent at once, so it overlaps the GPU work still pending before ``ready``.
2. Once it has every peer's offer, the rank maps their buffers (each allocation opened once),
   polls each peer's ``ready`` (``cudaEventQuery`` on the opened handle, on the host) until it
   has completed, then enqueues its share of the work, reading and writing peers' memory
   directly, and records ``done`` behind it.
3. It waits (polling) until its own ``done`` has completed and every peer's work has: with
   boards, each peer posts that its ``done`` is recorded and this rank polls that event; without,
   each peer sends a "done" message once its work completed. Every write into this rank's
   memory is then complete, and the operation returns.

Without boards (the default) every hello and "done" is a message: about 100 us each way through
the engine on an H200 host, three such steps per operation. ``RTXNET_IPC_BOARD=1`` (read when a
group makes its IPC state, at its first GPU collective) turns the boards on: once a group is warm
an operation sends no message at all, unless it offers buffers the peers do not hold yet. Opt-in
until it has run on a GPU: its protocol is tested on the CPU (``tests/collectives/
test_handshake.py``), the CUDA side by ``tests/gpu/test_ipc.py``, and ``tools/bench/
collectives.py --device cuda --compare messages`` measures both.

The stream never waits on the GPU for another process: a peer that dies before its ``ready``
completes would otherwise leave this rank's stream blocked forever, with a kernel queued behind
the wait that could write into memory already reused after recovery. Host-side polling instead
ends with the op's ``PeerLostError`` or ``CollectiveTimeout``, and nothing is left queued.

Why one event of each kind suffices: a rank records ``ready`` of operation k+1 only after
operation k finished on its host side, which needs every peer's "done" of k, which each peer
gives after it stopped polling ``ready`` of k; and it records ``done`` of k+1 only after every
peer's hello of k+1, which each gives after it stopped polling ``done`` of k.

Work per rank, with ``W`` ranks and ``S`` bytes per rank (every rank's input read once and every
output written once, the physical limit when ranks share one GPU's memory):

============== =================================================================================
all_reduce     reduce chunk ``r`` of every rank's buffer, write it to chunk ``r`` of every buffer
               (one fused kernel: reads S, writes S)
reduce_scatter reduce part ``r`` of every rank's input into this rank's output
all_gather     one kernel reads this rank's input once and writes it to slot ``r`` of every output
reduce         chunk ``r`` of every rank's buffer reduced into the root's buffer
broadcast      every other rank copies the root's buffer (copy engine)
gather/scatter each rank copies its part to/from the root; all_to_all: each rank pulls its parts
============== =================================================================================

A rank killed during an operation is reported by the control plane (``PeerLostError`` from the
engine); this rank's memory stays valid (peers only ever write the chunks they own, and only
after this rank's ``ready``), its mapping of the dead peer is dropped with the group.
"""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections import OrderedDict

import numpy as np
import structlog

from rtxnet.collectives.gpu import kernels
from rtxnet.collectives.gpu.handshake import Handshake, make_board
from rtxnet.collectives.gpu.stream import DeviceStream, poll_delay
from rtxnet.collectives.reduce_ops import ReduceOp
from transport.errors import CollectiveError

__all__ = ["IpcState", "MAX_RANKS", "chunk_bounds"]

log = structlog.get_logger(__name__)

MAX_RANKS = kernels.MAX_POINTERS  # a fused kernel takes at most this many peer pointers
_RAW = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}
_OPEN_CACHE = 256                 # opened peer allocations kept per group
_NOT_READY = 600                  # cudaErrorNotReady (driver_types.h)
_libcuda = None


def _address_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the device allocation containing ``ptr`` (``cuMemGetAddressRange``).

    Raises:
        CollectiveError: the driver refuses (not device memory).
    """
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                       ctypes.c_uint64]
        fn.restype = ctypes.c_int
        _libcuda = fn
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = _libcuda(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != 0:
        raise CollectiveError(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}: "
                              f"not CUDA device memory of this process")
    return int(base.value), int(size.value)


def chunk_bounds(count: int, n: int, itemsize: int) -> list[int]:
    """``n + 1`` element boundaries cutting ``count`` elements in ``n`` near-equal chunks whose
    starts are 16-byte multiples (so every chunk can take the kernels' vector path)."""
    v = max(1, 16 // itemsize)
    b = [(c * count // n) // v * v for c in range(n)]
    b.append(count)
    return b


class IpcState:
    """CUDA IPC state of one group on one device: stream, events, opened peer allocations.

    Args:
        group: the :class:`rtxnet.collectives.group.Group`.
        device: CUDA device ordinal the group's arrays live on.
        stream: the group's :class:`DeviceStream` on ``device`` (a new one if None).

    Raises:
        ValueError: the group has more than ``MAX_RANKS`` ranks.
    """

    def __init__(self, group, device: int, stream: DeviceStream | None = None):
        import cupy

        if group.size > MAX_RANKS:
            raise ValueError(f"CUDA IPC collectives take at most {MAX_RANKS} ranks per group, "
                             f"group {group.gid!r} has {group.size}")
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        self.group = group
        self.device = device
        self.stream = stream if stream is not None else DeviceStream(device)
        with self.stream.use():
            self._ready = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self._ready_h = bytes(self._rt.ipcGetEventHandle(self._ready.ptr))
            self._done = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self._done_h = bytes(self._rt.ipcGetEventHandle(self._done.ptr))
        self._opened: OrderedDict[bytes, int] = OrderedDict()   # mem handle -> mapped base
        self._peer_events: dict[bytes, int] = {}                 # event handle -> event
        self._peer_done: dict[int, int] = {}                     # group rank -> its done event
        self._tainted = False
        self._closed = False
        self._t0 = 0.0
        self._not_ready = getattr(self._rt, "errorNotReady", _NOT_READY)
        self.handshake = Handshake(group, make_board(group))
        #: the last operation's phases, in seconds from its start (``time.perf_counter``), for
        #: benchmarks: ``hello`` (every peer's offer known), ``peers_ready`` (their ``ready``
        #: events completed), ``launched`` (this rank's work enqueued), ``local_done`` (completed
        #: on the GPU), ``peers_done`` (every peer's work completed).
        self.phases: dict[str, float] = {}

    @property
    def stats(self) -> dict[str, int]:
        """Hellos through the boards and as messages (:attr:`.handshake.Handshake.stats`)."""
        return self.handshake.stats

    def _phase(self, name: str) -> None:
        self.phases[name] = time.perf_counter() - self._t0

    # -- export and map ----------------------------------------------------------------------

    def _export(self, ptr: int) -> list | None:
        if not ptr:
            return None
        with self.stream.use():
            base, _ = _address_range(ptr)
            try:
                handle = bytes(self._rt.ipcGetMemHandle(base))
            except Exception as exc:  # noqa: BLE001 - CUDARuntimeError
                raise CollectiveError(
                    f"CUDA IPC cannot export the allocation at {base:#x} ({exc}): memory from "
                    f"cudaMallocAsync pools or virtual-memory allocators (e.g. torch with "
                    f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be shared this "
                    f"way; allocate with cudaMalloc (CuPy's and torch's default allocators)"
                ) from exc
        return [handle, ptr - base]

    def _map(self, g: int, item) -> int:
        if item is None:
            return 0
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)
                and isinstance(item[1], int) and item[1] >= 0):
            raise CollectiveError(f"malformed IPC buffer offer from rank {self.group.ranks[g]}")
        handle, offset = item
        base = self._opened.get(handle)
        if base is None:
            with self.stream.use():
                base = int(self._rt.ipcOpenMemHandle(handle))
            self._opened[handle] = base
        else:
            self._opened.move_to_end(handle)
        return base + offset

    def _evict(self) -> None:
        # rare: the stream must be idle before an old mapping goes (a kernel may still read it)
        self.stream.stream.synchronize()
        while len(self._opened) > _OPEN_CACHE // 2:
            _, base = self._opened.popitem(last=False)
            with self.stream.use():
                self._rt.ipcCloseMemHandle(base)

    def _event(self, handle) -> int:
        if not isinstance(handle, bytes):
            raise CollectiveError("malformed IPC event handle")
        ev = self._peer_events.get(handle)
        if ev is None:
            with self.stream.use():
                ev = int(self._rt.ipcOpenEventHandle(handle))
            self._peer_events[handle] = ev
        return ev

    # -- the three phases of every operation ---------------------------------------------------

    async def exchange(self, op, sig: list, user_stream: int, exports: list[int],
                       extra=None) -> tuple[dict[int, list[int]], dict]:
        """Phase 1-2: order after the user's stream, offer ``exports`` (device addresses) and the
        events (:class:`.handshake.Handshake`: through the boards, or as messages), map every
        peer's offers and wait (polling on the host) until every peer's ``ready`` has completed.

        Returns:
            ``(ptrs, extras)``: group rank -> the addresses it offered, as mapped here (this
            rank's own included, 0 for an empty buffer); group rank -> its ``extra``.

        Raises:
            CollectiveMismatchError, CollectiveTimeout, PeerLostError: from the hello.
        """
        if self._closed:
            raise CollectiveError(f"IPC state of group {self.group.gid!r} is closed")
        self._t0, self.phases = time.perf_counter(), {}
        if self._tainted:
            # an earlier operation failed half way: let whatever it enqueued drain first
            self.stream.stream.synchronize()
            self._tainted = False
        if len(self._opened) > _OPEN_CACHE:
            self._evict()   # before this op maps anything, so nothing it uses goes
        self.stream.after(user_stream)
        with self.stream.use():
            self._rt.eventRecord(self._ready.ptr, self.stream.ptr)
        items = [self._export(p) for p in exports]
        key = tuple(None if it is None else (it[0], it[1]) for it in items)
        got = await self.handshake.hello(op, sig, [items, self._ready_h, self._done_h, extra],
                                         key, per_call=extra is not None)
        self._phase("hello")
        ptrs: dict[int, list[int]] = {op.r: list(exports)}
        extras = {op.r: extra}
        waits = {}
        for g in op.peers:
            d = got[g]
            if not (isinstance(d, list) and len(d) == 4 and isinstance(d[0], list)):
                raise CollectiveError(f"malformed IPC offer from rank {self.group.ranks[g]}")
            ptrs[g] = [self._map(g, item) for item in d[0]]
            waits[g] = self._event(d[1])
            if g not in self._peer_done:
                self._peer_done[g] = self._event(d[2])
            extras[g] = d[3]
        await self._await_peer_events(op, waits)
        self._phase("peers_ready")
        return ptrs, extras

    async def _await_peer_events(self, op, waits: dict[int, int]) -> None:
        """Poll ``cudaEventQuery`` on peers' events (group rank -> event) until all completed.

        Raises:
            op.error once the op failed; CollectiveError if the driver reports an error other
            than "not ready" for a peer's event.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        while waits:
            # a failed op may already have closed this state (epoch end): never touch its
            # handles again, and never hand unmapped addresses to a kernel
            if op.error is not None:
                raise op.error
            for g, ev in list(waits.items()):
                if self._completed(g, ev):
                    del waits[g]
            if not waits:
                break
            await asyncio.sleep(poll_delay(loop.time() - start))
        if op.error is not None or self._closed:
            raise op.error or CollectiveError(f"IPC state of group {self.group.gid!r} closed")

    def _completed(self, g: int, ev: int) -> bool:
        """Whether event ``ev`` (of group rank ``g``) has completed. Raises CollectiveError when
        the driver reports it failed."""
        try:
            rc = self._rt.eventQuery(ev)
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError for a failed event
            raise CollectiveError(f"CUDA event of rank {self.group.ranks[g]} failed: "
                                  f"{exc}") from exc
        if rc == 0:
            return True
        if rc != self._not_ready:
            raise CollectiveError(f"CUDA event of rank {self.group.ranks[g]} failed with "
                                  f"cudaError {rc}")
        return False

    async def finish(self, op, user_stream: int) -> None:
        """Phase 3: record ``done`` behind this rank's work and wait (polling, through the
        handshake) until it and every peer's work have completed: their writes into this rank's
        memory are then complete. Then order the user's stream after rtxnet's."""
        self._phase("launched")
        with self.stream.use():
            self._rt.eventRecord(self._done.ptr, self.stream.ptr)
        me, done = self.group.rank, self._done.ptr

        def local_done() -> bool:
            if self._completed(me, done):
                self._phase("local_done")
                return True
            return False

        await self.handshake.done(op, local_done,
                                  lambda g: self._completed(g, self._peer_done[g]))
        self._phase("peers_done")
        self.stream.before(user_stream)

    def taint(self) -> None:
        """An operation failed: drain the stream before the next one; offers by id again only
        once sent again (:meth:`.handshake.Handshake.taint`)."""
        self._tainted = True
        self.handshake.taint()

    def ahead(self, next_seq: int, now: float) -> list[tuple[int, list[int], float]]:
        """See :meth:`.handshake.Handshake.ahead`."""
        return self.handshake.ahead(next_seq, now)

    # -- operations (inside Group._collective; ``op`` is the running Op) -------------------------

    def _reduce(self, srcs, dsts, count, dtype, rop, n) -> None:
        if self._closed:
            raise CollectiveError(f"IPC state of group {self.group.gid!r} is closed")
        if count > 0:
            kernels.launch_reduce(srcs, dsts, count, dtype, rop, avg_n=n, stream=self.stream.ptr,
                                  device=self.device)

    def _copy(self, dst: int, src: int, nbytes: int, *, stream: int) -> None:
        if self._closed:
            raise CollectiveError(f"IPC state of group {self.group.gid!r} is closed")
        kernels.copy(dst, src, nbytes, stream=stream)

    async def all_reduce(self, op, sig, buf, rop: ReduceOp) -> None:
        n, r, isz = op.n, op.r, buf.dtype.itemsize
        ptrs, _ = await self.exchange(op, sig, buf.stream, [buf.ptr])
        b = chunk_bounds(buf.size, n, isz)
        at = [ptrs[g][0] + b[r] * isz for g in range(n)]
        self._reduce(at, at, b[r + 1] - b[r], buf.dtype, rop, n)
        await self.finish(op, buf.stream)

    async def reduce(self, op, sig, buf, root: int, rop: ReduceOp) -> None:
        n, r, isz = op.n, op.r, buf.dtype.itemsize
        ptrs, _ = await self.exchange(op, sig, buf.stream, [buf.ptr])
        b = chunk_bounds(buf.size, n, isz)
        srcs = [ptrs[g][0] + b[r] * isz for g in range(n)]
        self._reduce(srcs, [ptrs[root][0] + b[r] * isz], b[r + 1] - b[r], buf.dtype, rop, n)
        await self.finish(op, buf.stream)

    async def reduce_scatter(self, op, sig, parts: list[int], out, rop: ReduceOp) -> None:
        n, r = op.n, op.r
        ptrs, _ = await self.exchange(op, sig, out.stream, parts)
        self._reduce([ptrs[g][r] for g in range(n)], [out.ptr], out.size, out.dtype, rop, n)
        await self.finish(op, out.stream)

    async def all_gather(self, op, sig, inp, slots: list[int]) -> None:
        n, r = op.n, op.r
        ptrs, _ = await self.exchange(op, sig, inp.stream, slots)
        # as integers of the same width: one source summed is then a bit-exact copy (a float
        # path would canonicalise NaN payloads and bools)
        self._reduce([inp.ptr], [ptrs[g][r] for g in range(n)], inp.size,
                     _RAW[inp.dtype.itemsize], ReduceOp.SUM, 1)
        await self.finish(op, inp.stream)

    async def broadcast(self, op, sig, buf, root: int) -> None:
        me = op.r == root
        ptrs, _ = await self.exchange(op, sig, buf.stream, [buf.ptr] if me else [])
        if not me and buf.nbytes:
            self._copy(buf.ptr, ptrs[root][0], buf.nbytes, stream=self.stream.ptr)
        await self.finish(op, buf.stream)

    async def gather(self, op, sig, inp, slots: list[int] | None, root: int) -> None:
        me = op.r == root
        ptrs, _ = await self.exchange(op, sig, inp.stream, slots if me else [])
        if inp.nbytes:
            self._copy(ptrs[root][op.r], inp.ptr, inp.nbytes, stream=self.stream.ptr)
        await self.finish(op, inp.stream)

    async def scatter(self, op, sig, parts: list[int] | None, out, root: int) -> None:
        me = op.r == root
        ptrs, _ = await self.exchange(op, sig, out.stream, parts if me else [])
        if out.nbytes:
            self._copy(out.ptr, ptrs[root][op.r], out.nbytes, stream=self.stream.ptr)
        await self.finish(op, out.stream)

    async def all_to_all(self, op, sig, user_stream: int, parts: list[int], splits: list,
                         outs: list[int], itemsize: int, check_splits) -> None:
        """Each rank pulls peer g's part for it into its own output part g.

        ``splits`` = ``[sent counts, received counts]``; ``check_splits(dict g -> splits)`` raises
        the mismatch error on every rank when a sender and receiver disagree.
        """
        ptrs, extras = await self.exchange(op, sig, user_stream, parts, splits)
        check_splits(extras)
        r = op.r
        for g in range(op.n):
            nbytes = splits[1][g] * itemsize
            if nbytes:
                self._copy(outs[g], ptrs[g][r], nbytes, stream=self.stream.ptr)
        await self.finish(op, user_stream)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap every peer allocation and drop the events (epoch end, group retired, exit).
        Idempotent; drains this rank's stream first."""
        if self._closed:
            return
        self._closed = True
        rt = self._rt
        try:
            with self.stream.use():
                # bounded: rtxnet's stream never waits on another process, so this only drains
                # this rank's own kernels, which may still touch the peer memory unmapped below
                self.stream.stream.synchronize()
                for base in self._opened.values():
                    try:
                        rt.ipcCloseMemHandle(base)
                    except Exception as exc:  # noqa: BLE001 - best effort at teardown
                        log.debug("ipc_close_failed", error=str(exc))
                for ev in self._peer_events.values():
                    try:
                        rt.eventDestroy(ev)
                    except Exception as exc:  # noqa: BLE001
                        log.debug("ipc_event_destroy_failed", error=str(exc))
        finally:
            self._opened.clear()
            self._peer_events.clear()
            self._peer_done.clear()
            self.handshake.close()
