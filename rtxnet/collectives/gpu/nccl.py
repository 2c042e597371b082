"""NCCL collectives through CuPy: one communicator per group and epoch, aborted on any failure.

Shapes legend: ``N`` = ``count`` elements per rank, ``W`` = group size. Buffers are CUDA device
addresses (int) on ``NcclState.device``; ``dtype`` is a NumPy dtype (bfloat16 as
``ml_dtypes.bfloat16``). NCCL ranks are group ranks (``0 .. W-1``).

``setup`` (once) checks that no two ranks share a GPU (NCCL refuses that: "Duplicate GPU
detected"; the "ipc" backend serves ranks on one host), lets group rank 0 create the unique id and
share it through the coordinator's store (key ``rtxnet/nccl/<epoch>/<gid>``) or the op's mailbox,
and builds ``NcclCommunicator`` in a daemon thread (``ncclCommInitRank`` blocks until every rank
has joined). Every operation enqueues on rtxnet's ``DeviceStream``, records an event and awaits it
with ``await_event``, which raises the op's failure (deadline, lost peer, remote abort). A kernel
waiting for a dead peer never ends by itself, only ``ncclCommAbort`` releases it: so any failure
aborts the communicator for good, and the next epoch builds a new ``NcclState``. Known limit:
NCCL >= 2.22 connects peers lazily inside the first collective/send call, which blocks the calling
(loop) thread until those peers make it too; ``NCCL_RUNTIME_CONNECT=0`` moves that into init.

Errors: ``CollectiveError`` `-- ``NcclUnavailableError`` (NCCL missing, or ranks share a GPU).
"""

from __future__ import annotations

import asyncio
import platform
import threading
import time

import numpy as np
import structlog

from rtxnet.collectives.gpu.stream import await_event
from rtxnet.collectives.reduce_ops import ReduceOp, check_op_dtype, is_bfloat16
from transport.errors import CollectiveError

__all__ = ["NcclUnavailableError", "NcclState", "uid_to_bytes", "uid_from_bytes",
           "check_distinct_gpus", "nccl_types", "nccl_version", "NCCL_DTYPES", "NCCL_BFLOAT16", "NCCL_OPS"]

log = structlog.get_logger(__name__)

UID_NBYTES = 128          # NCCL_UNIQUE_ID_BYTES (nccl.h)
_UID_STEP = 1 << 20       # mailbox step of the unique id (apart from any algorithm's steps)
_POLL_S = 0.02            # how often a wait on a thread or the store looks at op.error
_INVALID_USAGE = 5        # ncclInvalidUsage (nccl.h)

# ncclDataType_t / ncclRedOp_t values from nccl.h (unchanged since NCCL 2.0; bfloat16 since 2.10),
# so the mapping needs no CuPy; tests compare them with cupy.cuda.nccl's constants.
NCCL_DTYPES: dict[np.dtype, int] = {
    np.dtype(np.int8): 0, np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 4,
    np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(np.float64): 8,
    np.dtype(np.bool_): 1,    # as uint8 (0/1 bytes): SUM becomes MAX (logical or)
}
NCCL_BFLOAT16 = 9   # ncclBfloat16, kept out of NCCL_DTYPES: ml_dtypes is imported on first use
NCCL_OPS: dict[ReduceOp, int] = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2,
                                 ReduceOp.MIN: 3, ReduceOp.AVG: 4}


class NcclUnavailableError(CollectiveError):
    """NCCL cannot serve this group; the message says why and what to use instead.

    Attributes:
        ranks: world ranks concerned (those sharing a GPU), sorted; empty when not rank-specific.
        raised_on_every_rank: True when every rank decided it from the same exchanged topology
            (so no abort is sent and this error, not a peer's abort, reaches every caller).
    """

    def __init__(self, message: str, *, ranks=(), everywhere: bool = False):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.raised_on_every_rank = everywhere


def nccl_version() -> int | None:
    """NCCL's runtime version as an int (2.28.9 -> 22809), or None if ``cupy.cuda.nccl`` cannot
    be imported or has no NCCL library."""
    try:
        from cupy.cuda import nccl

        return int(nccl.get_version())
    except Exception:  # noqa: BLE001 - ImportError, a missing libnccl, no get_version
        return None


def nccl_types(dtype, rop: ReduceOp | None = None) -> tuple[int, int | None]:
    """``(ncclDataType_t, ncclRedOp_t or None)`` for a NumPy dtype and an optional reduce op.

    bool travels as uint8 0/1 bytes: SUM maps to MAX (logical or), MIN to MIN (and), MAX to MAX.

    Raises:
        ValueError: a dtype NCCL has no type for (int16), an unknown op, or an op the dtype has
            no meaning for (PROD/AVG of bool, AVG of integers); the message names them.
    """
    dtype = np.dtype(dtype)
    dt = NCCL_BFLOAT16 if is_bfloat16(dtype) else NCCL_DTYPES.get(dtype)
    if dt is None:
        raise ValueError(f"dtype {dtype} has no NCCL type; NCCL serves "
                         f"{', '.join(str(d) for d in NCCL_DTYPES)}, bfloat16; cast, or use the 'ipc' "
                         f"backend (same host) or CPU collectives")
    if rop is None:
        return dt, None
    rop = check_op_dtype(rop, dtype)
    if dtype == np.bool_ and rop is ReduceOp.SUM:
        rop = ReduceOp.MAX
    return dt, NCCL_OPS[rop]


def uid_to_bytes(uid) -> bytes:
    """CuPy's unique id -> its 128 opaque bytes.

    Args:
        uid: ``bytes`` (CuPy >= 14), or a tuple/list of 128 ints (CuPy < 14: C ``char`` values,
            in [-128, 127] where char is signed, [0, 255] where it is not); ``v & 0xFF`` is the
            byte either way.

    Raises:
        ValueError: not 128 entries, or an entry that is not an int in [-128, 255].
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        b = bytes(uid)
    elif isinstance(uid, (tuple, list)):
        if len(uid) != UID_NBYTES:
            raise ValueError(f"NCCL unique id has {len(uid)} entries, expected {UID_NBYTES}")
        for i, v in enumerate(uid):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -128 <= v <= 255:
                raise ValueError(f"NCCL unique id entry {i} is {v!r}, expected an int in [-128, 255]")
        b = bytes(int(v) & 0xFF for v in uid)
    else:
        raise ValueError(f"NCCL unique id must be bytes or a tuple of ints, got {type(uid).__name__}")
    if len(b) != UID_NBYTES:
        raise ValueError(f"NCCL unique id has {len(b)} bytes, expected {UID_NBYTES}")
    return b


def uid_from_bytes(b: bytes, *, form: str | None = None) -> bytes | tuple[int, ...]:
    """128 bytes -> what ``NcclCommunicator(ndev, commId, rank)`` takes; exact inverse of
    :func:`uid_to_bytes`.

    Args:
        form: ``"bytes"`` (CuPy >= 14), ``"signed"`` (tuple of ints in [-128, 127]: CuPy < 14
            where C char is signed, x86-64), ``"unsigned"`` (tuple in [0, 255]: CuPy < 14 on
            aarch64, ppc64le, s390x); None: what the installed CuPy takes.

    Raises:
        ValueError: not 128 bytes, or an unknown form.
    """
    b = uid_to_bytes(bytes(b) if isinstance(b, (bytearray, memoryview)) else b)
    form = form or _uid_form()
    if form == "bytes":
        return b
    if form == "signed":
        return tuple(v - 256 if v > 127 else v for v in b)
    if form == "unsigned":
        return tuple(b)
    raise ValueError(f"unknown unique id form {form!r}; use 'bytes', 'signed' or 'unsigned'")


def _uid_form() -> str:
    try:
        import cupy

        major = int(cupy.__version__.split(".")[0])
    except Exception:  # noqa: BLE001 - no CuPy: nothing will take a tuple
        return "bytes"
    if major >= 14:
        return "bytes"
    return "unsigned" if platform.machine() in ("aarch64", "arm64", "ppc64le", "s390x") else "signed"


def check_distinct_gpus(topo: dict[int, dict]) -> None:
    """Raise unless every rank has a GPU of its own.

    Args:
        topo: world rank -> ``{"host": str, "uuid": str, ...}`` (the GPU's UUID as NVML or
            ``cudaDeviceProp.uuid`` gives it).

    Raises:
        NcclUnavailableError: ranks share a GPU; names each (host, uuid) and its world ranks;
            ``exc.ranks`` lists them all.
        ValueError: an entry without "host" or "uuid".
    """
    seen: dict[tuple[str, str], list[int]] = {}
    for r, info in sorted(topo.items()):
        try:
            key = (str(info["host"]), str(info["uuid"]))
        except (KeyError, TypeError):
            raise ValueError(f"topology of rank {r} needs 'host' and 'uuid', got {info!r}") from None
        seen.setdefault(key, []).append(r)
    dups = {k: rs for k, rs in seen.items() if len(rs) > 1}
    if dups:
        what = "; ".join(f"ranks {rs} share GPU {uuid} on {host}" for (host, uuid), rs in dups.items())
        raise NcclUnavailableError(
            f"{what}: NCCL refuses several ranks on one GPU (\"Duplicate GPU detected\" at "
            f"ncclCommInitRank); use algorithm/backend \"ipc\" for ranks on one host, or give "
            f"every rank its own GPU", ranks=[r for rs in dups.values() for r in rs],
            everywhere=True)


def _cupy_nccl():
    """``(cupy, cupy.cuda.nccl)``. Raises NcclUnavailableError when either cannot be used."""
    try:
        import cupy
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA install
        raise NcclUnavailableError(
            f"cupy.cuda.nccl is not importable ({exc}); install rtxnet[gpu] or rtxnet[cuda13] "
            f"with NCCL, or use the \"ipc\" backend (same host) or CPU collectives") from exc
    if not getattr(nccl, "available", True):
        raise NcclUnavailableError(
            "CuPy found no NCCL library; install nvidia-nccl-cu12/cu13, or use the \"ipc\" "
            "backend (same host) or CPU collectives")
    return cupy, nccl


def _in_thread(fn) -> asyncio.Future:
    """Run ``fn()`` in a daemon thread; a future of its result. A daemon thread, not the loop's
    executor: an abandoned ncclCommInitRank may block for good and must not hold up exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, exc):
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(result)

    def run():
        try:
            out, err = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            out, err = None, exc
        try:
            loop.call_soon_threadsafe(settle, out, err)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="rtxnet-nccl", daemon=True).start()
    return fut


async def _until_done(op, aw):
    """Await ``aw``; raise ``op.error`` as soon as the op fails (its deadline, a lost peer)."""
    fut = asyncio.ensure_future(aw)
    try:
        while not fut.done():
            if op.error is not None:
                raise op.error
            await asyncio.wait((fut,), timeout=_POLL_S)
        return fut.result()
    finally:
        if not fut.done():
            fut.cancel()


def _remaining_s(op) -> float:
    return max(0.0, op.timeout_s - (time.monotonic() - op.t0))


class NcclState:
    """The NCCL communicator of one group in one epoch, on one device of this process.

    Use one per group and epoch: the unique id's key is fenced by epoch and group id only.
    Operations of a group run one at a time (``Group._collective``); the caller exchanges
    signatures (``op.hello``) first and orders ``stream`` after the user's stream and back.

    Every operation raises:
        ValueError: bad root, count, pointer list or dtype/op (before anything is enqueued).
        CollectiveError: NCCL failed (its message), or the communicator was aborted or closed.
        whatever ``op.error`` holds: CollectiveTimeout, PeerLostError, a remote abort.
    After any failure the communicator is aborted and the buffers written are undefined.
    """

    def __init__(self, group, device: int):
        self.group = group
        self.device = int(device)
        self._comm = None
        self._cupy = self._nccl = None
        self._dead: str | None = None     # why it is unusable (aborted, closed)
        self._inflight = 0
        self._lock = threading.Lock()     # _comm/_dead against the init thread

    async def setup(self, op, topo: dict[int, dict]) -> None:
        """Build the communicator (once; later calls return at once).

        Args:
            op: the running ``engine.Op`` of this group; its deadline bounds the whole setup.
            topo: world rank -> ``{"host", "uuid"}`` of every member (see check_distinct_gpus).

        Raises:
            NcclUnavailableError: ranks share a GPU (before NCCL is touched), NCCL missing, or
                ncclCommInitRank said NCCL_ERROR_INVALID_USAGE (one GPU for several ranks).
            CollectiveError: another NCCL init error, a malformed unique id, or this state is
                dead; op.error (timeout, lost peer) as it is.
        """
        if self._comm is not None:
            return
        self._check_alive()
        check_distinct_gpus(topo)
        cupy, nccl = _cupy_nccl()
        self._cupy, self._nccl = cupy, nccl
        g, t0 = self.group, time.monotonic()
        try:
            uid = uid_from_bytes(await self._share_uid(op))
            await _until_done(op, _in_thread(lambda: self._init_comm(uid)))
        except (nccl.NcclError, KeyError) as exc:
            # KeyError: CuPy builds an NcclError's message from a table of the older codes, so
            # a newer status (ncclRemoteError, ncclInProgress) fails inside its constructor
            self.abort(f"init failed: {exc!r}")
            if getattr(exc, "status", None) == _INVALID_USAGE:
                raise NcclUnavailableError(
                    f"ncclCommInitRank failed on group {g.gid!r} rank {g.rank}: {exc}; at init "
                    f"this means several ranks on one GPU (\"Duplicate GPU detected\"): use "
                    f"algorithm/backend \"ipc\" for ranks on one host", ranks=g.ranks) from exc
            raise CollectiveError(f"NCCL init failed on group {g.gid!r} rank {g.rank}: {exc}") \
                from exc
        except BaseException as exc:
            self.abort(f"setup failed: {exc!r}")
            raise
        log.info("nccl_comm_ready", gid=g.gid, epoch=g.epoch, rank=g.rank, size=g.size,
                 device=self.device, duration_ms=round((time.monotonic() - t0) * 1e3, 1))

    async def _share_uid(self, op) -> bytes:
        g = self.group
        kv = getattr(op.engine, "kv", None)
        key = f"rtxnet/nccl/{g.epoch}/{g.gid}"
        if g.rank == 0:
            uid = uid_to_bytes(await _until_done(op, _in_thread(self._nccl.get_unique_id)))
            if g.size > 1 and kv is not None:
                await _until_done(op, kv.set(key, uid))
            elif g.size > 1:
                for peer in range(1, g.size):
                    op.send(peer, _UID_STEP, meta=uid)
            return uid
        if kv is not None:
            raw = (await _until_done(op, kv.wait([key], timeout=_remaining_s(op)))).get(key)
        else:
            raw, _ = await op.recv(0, _UID_STEP)
        try:
            return uid_to_bytes(raw)
        except ValueError as exc:
            raise CollectiveError(f"malformed NCCL unique id from rank {g.ranks[0]}: {exc}") from None

    def _init_comm(self, uid) -> None:
        """In the init thread: build the communicator, keep it unless given up on meanwhile."""
        with self._cupy.cuda.Device(self.device):
            comm = self._nccl.NcclCommunicator(self.group.size, uid, self.group.rank)
        with self._lock:
            if self._dead is None:
                self._comm = comm
                return
        comm.abort()   # setup gave up (deadline, lost peer): nobody else will release it

    def _check_alive(self):
        """The communicator. Raises CollectiveError when aborted, closed or not set up."""
        g = self.group
        if self._dead is not None:
            raise CollectiveError(f"NCCL communicator of group {g.gid!r} (epoch {g.epoch}) is "
                                  f"unusable ({self._dead}); the next epoch builds a new one")
        return self._comm

    def abort(self, why: str = "aborted") -> None:
        """``ncclCommAbort`` once (releases kernels waiting for dead peers); later operations
        raise CollectiveError. Idempotent; never raises."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = why
            comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception as exc:  # noqa: BLE001 - already broken: nothing more to release
                log.warning("nccl_abort_failed", gid=self.group.gid, error=str(exc))

    def close(self) -> None:
        """Destroy a healthy communicator (abort it if an operation is in flight); nothing after
        an abort. Idempotent; never raises."""
        if self._inflight:
            return self.abort("closed with an operation in flight")
        with self._lock:
            if self._dead is not None:
                return
            self._dead = "closed"
            comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.destroy()
            except Exception as exc:  # noqa: BLE001
                log.warning("nccl_destroy_failed", gid=self.group.gid, error=str(exc))

    # -- operations ------------------------------------------------------------------------------

    async def _run(self, op, stream, enqueue) -> None:
        """Enqueue on ``stream``, await its event; abort on any failure (see the class)."""
        comm = self._check_alive()
        if comm is None:
            raise CollectiveError(f"NcclState.setup() has not completed for group {self.group.gid!r}")
        if stream.device != self.device:
            raise ValueError(f"stream of device {stream.device}, communicator on {self.device}")
        self._inflight += 1
        try:
            with self._cupy.cuda.Device(self.device):
                enqueue(comm)
            await await_event(stream.record(), op)
        except BaseException as exc:
            self.abort(f"{op.name} failed: {exc!r}")
            if isinstance(exc, self._nccl.NcclError):
                raise CollectiveError(f"NCCL {op.name} failed on group {self.group.gid!r} rank "
                                      f"{self.group.rank}: {exc}") from exc
            raise
        finally:
            self._inflight -= 1

    def _root(self, root: int) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or \
                not 0 <= root < self.group.size:
            raise ValueError(f"root {root!r} not in group of size {self.group.size}")
        return int(root)

    def _ptrs(self, name: str, ptrs) -> list:
        if not isinstance(ptrs, (list, tuple)) or len(ptrs) != self.group.size:
            raise ValueError(f"{name} must list {self.group.size} entries, got {ptrs!r}")
        return list(ptrs)

    async def _p2p(self, op, stream, dt: int, sends: list, recvs: list) -> None:
        """One NCCL group of ``(peer, ptr, count)`` sends and receives; count 0 and an in-place
        copy to self are left out, and nothing is enqueued when nothing moves."""
        me = self.group.rank
        own_s, own_r = [p for k, p, _ in sends if k == me], [p for k, p, _ in recvs if k == me]
        if own_s and own_r and own_s[0] == own_r[0]:
            sends, recvs = [x for x in sends if x[0] != me], [x for x in recvs if x[0] != me]
        sends, recvs = [x for x in sends if x[2]], [x for x in recvs if x[2]]
        if not sends and not recvs:
            return
        nccl = self._nccl

        def enqueue(comm):
            nccl.groupStart()
            try:
                for peer, ptr, n in sends:
                    comm.send(ptr, n, dt, peer, stream.ptr)
                for peer, ptr, n in recvs:
                    comm.recv(ptr, n, dt, peer, stream.ptr)
            finally:
                nccl.groupEnd()
        await self._run(op, stream, enqueue)

    async def all_reduce(self, op, send: int, recv: int, count: int, dtype, rop, stream) -> None:
        """``recv[N] = reduce over ranks of send[N]`` (``send == recv``: in place).
        NCCL rounds float16/bfloat16 at each step of its ring (the CPU path rounds once)."""
        dt, nop = nccl_types(dtype, rop)
        if _check_count(count):
            await self._run(op, stream, lambda c: c.allReduce(send, recv, count, dt, nop, stream.ptr))

    async def broadcast(self, op, ptr: int, count: int, dtype, root: int, stream) -> None:
        """``ptr[N]`` of group rank ``root`` into ``ptr[N]`` of every rank, in place."""
        dt, _ = nccl_types(dtype)
        root = self._root(root)
        if _check_count(count):
            await self._run(op, stream, lambda c: c.broadcast(ptr, ptr, count, dt, root, stream.ptr))

    async def reduce(self, op, send: int, recv: int, count: int, dtype, rop, root: int,
                     stream) -> None:
        """``recv[N]`` of ``root`` = reduce of every rank's ``send[N]``; ``recv`` is not touched
        on other ranks."""
        dt, nop = nccl_types(dtype, rop)
        root = self._root(root)
        if _check_count(count):
            await self._run(op, stream,
                            lambda c: c.reduce(send, recv, count, dt, nop, root, stream.ptr))

    async def all_gather(self, op, send: int, recv: int, count: int, dtype, stream) -> None:
        """``recv[W * N]``: part ``k`` (``recv + k*N*itemsize``) gets rank k's ``send[N]``."""
        dt, _ = nccl_types(dtype)
        if _check_count(count):
            await self._run(op, stream, lambda c: c.allGather(send, recv, count, dt, stream.ptr))

    async def reduce_scatter(self, op, send: int, recv: int, count: int, dtype, rop,
                             stream) -> None:
        """``recv[N]`` of rank k = reduce over ranks of part k of ``send[W * N]``."""
        dt, nop = nccl_types(dtype, rop)
        if _check_count(count):
            await self._run(op, stream,
                            lambda c: c.reduceScatter(send, recv, count, dt, nop, stream.ptr))

    async def gather(self, op, send: int, recvs: list[int] | None, count: int, dtype, root: int,
                     stream) -> None:
        """``recvs[k][N]`` of ``root`` gets rank k's ``send[N]`` (grouped send/recv); ``recvs``
        is W addresses on ``root``, ignored elsewhere."""
        dt, _ = nccl_types(dtype)
        root, count = self._root(root), _check_count(count)
        mine = [] if self.group.rank != root else \
            [(k, p, count) for k, p in enumerate(self._ptrs("recvs", recvs))]
        await self._p2p(op, stream, dt, [(root, send, count)], mine)

    async def scatter(self, op, sends: list[int] | None, recv: int, count: int, dtype, root: int,
                      stream) -> None:
        """``recv[N]`` of rank k gets ``sends[k][N]`` of ``root``; ``sends`` is W addresses on
        ``root``, ignored elsewhere."""
        dt, _ = nccl_types(dtype)
        root, count = self._root(root), _check_count(count)
        mine = [] if self.group.rank != root else \
            [(k, p, count) for k, p in enumerate(self._ptrs("sends", sends))]
        await self._p2p(op, stream, dt, mine, [(root, recv, count)])

    async def all_to_all(self, op, sends: list[int], send_counts: list[int], recvs: list[int],
                         recv_counts: list[int], dtype, stream) -> None:
        """``recvs[k][recv_counts[k]]`` gets what rank k sends this rank, from ``sends[k]``
        of ``send_counts[k]`` elements (counts agreed beforehand: the caller's splits check)."""
        dt, _ = nccl_types(dtype)
        scounts = [_check_count(c) for c in self._ptrs("send_counts", send_counts)]
        rcounts = [_check_count(c) for c in self._ptrs("recv_counts", recv_counts)]
        peers = range(self.group.size)
        await self._p2p(op, stream, dt, list(zip(peers, self._ptrs("sends", sends), scounts, strict=True)),
                        list(zip(peers, self._ptrs("recvs", recvs), rcounts, strict=True)))


def _check_count(count) -> int:
    """``count`` as an int >= 0. Raises ValueError otherwise."""
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    return int(count)
