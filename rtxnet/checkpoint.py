"""Sharded, atomically committed checkpoints.

Layout under a root folder::

    root/step-<N>/rank-<r>.pt          one shard per rank: torch.save of that rank's plain state
    root/step-<N>/rank-<r>.<tag>.pt    the same, written by a save over a committed step N
    root/step-<N>/manifest.json        written last: the commit point

The manifest lists every rank's shard (``"shards"``: file names in rank order) with its size and
SHA-256 (``"files"``); only the files it lists belong to the step. A save runs in one epoch's
world (it pins the world group it began in, :meth:`rtxnet.ProcessGroup.pinned`), in four phases,
on every rank of the group:

1. the ranks exchange the step and the root (its resolved absolute path) with one ``all_gather``
   and refuse, on every rank and before anything is written, when they differ; then every rank
   holds the root for its run (a shared ``flock`` on ``root/.rtxnet-checkpoint.lock`` naming the
   job, :func:`claim_folder`, kept until the process exits) and a second ``all_gather`` refuses,
   on every rank, when another run holds it (two jobs saving into one root replaced each other's
   steps and removed each other's shards: a tester's find);
2. every rank serialises its state into a file of a temporary name (``torch.save`` to a file,
   which writes tensors' bytes with the GIL released, so the agent's heartbeats go on however
   large the shard; its SHA-256 taken on the way), fsyncs it, renames it to
   its shard name and fsyncs the folder (the POSIX recipe for an atomic, durable replace). The
   shard name is ``rank-<r>.pt`` when the step has no manifest; when it has one (a save over a
   committed step: the README's FaultTolerance pattern saves at the start of step N, so a redone
   step saves N again) it is a new name ``rank-<r>.<tag>.pt``, so no file the committed manifest
   lists is touched before the new manifest replaces it;
3. ranks exchange ``(ok, nbytes, sha256, shard name, error text)`` with one ``all_gather``;
4. rank 0 checks that it sees every rank's shard (a root not shared by the ranks is refused
   here), writes ``manifest.json`` (temporary name, fsync, rename over the old one, fsync of the
   folder) only if every rank succeeded, removes the files of the folder the new manifest does
   not list (shards of the replaced save, leftovers of failed ones, stray temporary files), and
   broadcasts the outcome; if any rank failed, every rank removes the shard it wrote for this save
   and raises :class:`CheckpointError` naming the failed ranks and the first error.

Crash windows (a rank SIGKILLed, a power cut): the rename of ``manifest.json`` is the only commit
point. Before it, the step is what it was (committed with its old shards, which nothing
overwrote, or not committed at all); the new shards are unlisted leftovers, removed by the next
successful save of that step. After it, the new manifest lists shards that were all fsynced
before it was written. A crash after the rename, before the folder's fsync, may lose the rename
on a power cut: the step is then the old one again. (The root folder is fsynced before the
rename, so the step folder a save made is on disk by then.) A crash during the removal of leftovers
leaves unlisted files, which are never loaded and are removed by the next save of the step. A
membership change during a save (a rank lost, a rank joining) fails the save's next collective
with :class:`PeerLostError` (``ClosedError`` when nobody was lost) naming the step and what was
committed; it never runs in the new world.

A step without a manifest is never loaded. A manifest that is not valid JSON of the expected form
or does not list a shard for every rank of its world, and a shard whose size or SHA-256 differs
from the manifest, are refused with :class:`CheckpointCorruptError` naming the file; :func:`latest`
skips such steps, falling back to the newest intact one. Shards are read with
``torch.load(weights_only=True)``, so a checkpoint cannot run code: states hold tensors, numbers,
strings, lists, tuples and dicts only (:func:`capture_rng` turns the RNG states into such values).

Loading at another world size: :func:`load` returns the shard of ``rank`` if the checkpoint has
one, else rank 0's. Data-parallel state (model, optimizer, step, sampler position) is replicated,
so any shard serves; per-rank RNG streams of ranks that did not exist are rank 0's, which a script
may re-seed with its rank. Sharded state (FSDP) needs every rank's shard: :func:`load_all` returns
them in rank order, for ``FullyShardedDataParallel.load_sharded_state_dicts``. State that
differs per rank and is not resharded (tensor-parallel layers, pipeline stages) is refused by
:func:`load` at another world size with a ``ConfigError``.

Errors (from the tree in ``transport/errors.py``)::

    RtxError
    `-- CheckpointError             a save failed on some rank, or no usable checkpoint
        `-- CheckpointCorruptError  a shard or manifest does not match (carries the path)
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import random
import re
import reprlib
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from rtxnet import faults
from rtxnet.config import CHECKPOINT_STORE_KEY, shown_list
from transport.durable import fsync_dir
from transport.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ClosedError,
    CollectiveMismatchError,
    ConfigError,
    PeerLostError,
    RtxError,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "ROOT_LOCK",
    "capture_rng",
    "claim_folder",
    "hold",
    "latest",
    "load",
    "load_all",
    "read_manifest",
    "record",
    "release",
    "restore_rng",
    "run_id",
    "save",
    "shown_holder",
    "step_dir",
    "verify",
]

log = structlog.get_logger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_SHARD_RE = re.compile(r"^rank-(\d+)(?:\.([0-9a-f]{1,32}))?\.pt$")   # rank-<r>.pt, rank-<r>.<tag>.pt
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_STATUS_NBYTES = 1024         # ok(1) pad(1) msg_len(2) name_len(2) pad(2) nbytes(8) sha256(32)
_NAME_MAX = 64                # name(64) msg(912)
_MSG_MAX = _STATUS_NBYTES - 48 - _NAME_MAX
_ROOT_NBYTES = 4096           # a root's path, exchanged only when the ranks' roots differ


LATEST_KEY = CHECKPOINT_STORE_KEY   # the job's store key of the newest committed checkpoint


# -- RNG ------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """The Python, NumPy (legacy global) and torch CPU RNG states as plain values.

    Returns:
        ``{"python": tuple, "numpy": {...}, "torch": uint8 tensor}``, loadable with
        ``weights_only=True``.
    """
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states captured by :func:`capture_rng`.

    Raises:
        ConfigError: ``state`` lacks one of the three generators (names it).
    """
    for k in ("python", "numpy", "torch"):
        if k not in state:
            raise ConfigError(f"RNG state has no {k!r} entry (keys: {sorted(state)})")
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], np.asarray(n["key"]).astype(np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["cached_gaussian"])))
    torch.set_rng_state(state["torch"])


# -- paths and files ------------------------------------------------------------------------------

MAX_STEP = 2**63 - 1   # steps travel as int64 (the ranks' agreement, the journal)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step({step!r}) must be an integer in 0..2**63-1")
    return int(step)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step-<step>``.

    Raises:
        ConfigError: ``root`` is empty or not a path, or ``step`` is not an integer in 0..2**63-1.
    """
    _check_root(root, "step_dir")
    return Path(root) / f"step-{_check_step(step)}"


def _check_root(root: Any, fn: str, what: str = "root") -> None:
    """Refuse an empty ``root`` (``""``: ``Path("")`` is the current folder, where a save wrote
    ``step-N`` unasked, a breaker's find), and one that is not a path at all (``Path()``'s raw
    ``TypeError`` named neither the function nor the argument: a fresh user's find)."""
    try:
        empty = os.fspath(root) in ("", b"")
    except TypeError:
        raise ConfigError(f"checkpoint.{fn}: {what} must be a folder path (str or os.PathLike), "
                          f"got {reprlib.repr(root)} ({type(root).__name__})") from None
    if empty:
        raise ConfigError(f"checkpoint.{fn}: {what} {root!r} is empty: give the checkpoint folder "
                          f"('.' for the current one)")
    try:
        Path(os.fsdecode(root)).resolve()
    except (RuntimeError, OSError) as exc:   # a symbolic link loop (raw RuntimeError: a tester's find)
        raise ConfigError(f"checkpoint.{fn}: {what} {os.fsdecode(root)!r} cannot be resolved ({exc}): a "
                          f"symbolic link that leads back to itself?") from None


def _check_pg(pg: Any, fn: str, *, required: bool = False) -> None:
    """Refuse a ``pg`` that is not the blocking process group of :func:`rtxnet.init` (``None``
    unless ``required``): a subgroup (``pg.split``, ``pg.new_group``) has no job store and
    raised ``AttributeError`` ('Group' object has no attribute 'store'), on some ranks only for
    :func:`record`; the async group of ``rtxnet.connect()`` returned coroutines nothing awaited."""
    from rtxnet.collectives.group import Group
    from rtxnet.process_group import BlockingProcessGroup, ProcessGroup, _BlockingProxy

    if (pg is None and not required) or isinstance(pg, BlockingProcessGroup):
        return
    inner = pg._obj if isinstance(pg, _BlockingProxy) else pg   # (a blocking subgroup)
    why = (": rtxnet.connect()'s group is async, and the checkpoint functions block"
           if isinstance(inner, ProcessGroup) else
           ": a subgroup (pg.split, pg.new_group) has no job store; pass the whole group"
           if isinstance(inner, Group) else "")
    raise ConfigError(f"checkpoint.{fn}: pg must be the process group of rtxnet.init()"
                      f"{'' if required else ' (or None: a single process)'}, got "
                      f"{type(inner).__name__}{why}")


def _write_atomic(path: Path, data: bytes, *, sync_folder: bool = True) -> None:
    """Write ``data`` to a temporary name, fsync, rename over ``path``, fsync the folder (unless
    ``sync_folder`` is False: the caller does, knowing the rename happened).

    Raises:
        OSError: writing, syncing or renaming failed; the temporary file is removed, ``path`` is
            untouched unless only the folder's fsync failed.
    """
    tmp = _temp_of(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync_dir(path.parent)


def _temp_of(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


class _ShardSink:
    """The file ``torch.save`` writes a shard to: takes the SHA-256 and size of what passes
    (``hashlib`` releases the GIL on each chunk, as the file's ``write`` does), so the shard is
    not read back; and keeps the exception of a failed write, which torch's writer swallows,
    raising ``RuntimeError("... unexpected pos 704 vs 598")`` instead: an ``OSError``, or a
    ``KeyboardInterrupt`` of a Ctrl-C that came during the write (which the save then raised as
    a ``CheckpointError`` with torch's words, and the script went on: a tester's find). A
    ``seek`` (torch does none for a plain save) drops the running hash: ``digest`` is then
    None."""

    def __init__(self, f: Any):
        self._f = f
        self._h: Any = hashlib.sha256()
        self.nbytes = 0
        self.error: BaseException | None = None

    def write(self, b: Any) -> int:
        try:
            n = self._f.write(b)
        except BaseException as exc:
            self.error = exc
            raise
        try:
            if self._h is not None:
                self._h.update(b)
                self.nbytes += memoryview(b).nbytes
        except BaseException as exc:
            self.error = exc
            raise
        return n

    def seek(self, *args: Any) -> int:
        self._h = None
        return self._f.seek(*args)

    @property
    def digest(self) -> bytes | None:
        return None if self._h is None else self._h.digest()

    def __getattr__(self, name: str) -> Any:   # flush, tell, fileno
        return getattr(self._f, name)


_HASH_CHUNK = 16 << 20


def _hash_file(path: Path) -> tuple[int, bytes]:
    """The size in bytes and SHA-256 of ``path``, read in 16 MiB chunks (``read`` and ``hashlib``
    release the GIL on them: the agent's heartbeats go on)."""
    h = hashlib.sha256()
    nbytes = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            nbytes += len(chunk)
    return nbytes, h.digest()


def _remove_stale_temps(folder: Path, name: str) -> None:
    for p in folder.glob(f".{name}.tmp-*"):
        p.unlink(missing_ok=True)


# -- group plumbing (pg=None: a single process) ---------------------------------------------------

def _kw(timeout_s: float | None) -> dict[str, Any]:
    return {} if timeout_s is None else {"timeout": timeout_s}


def _save_world(pg: Any) -> tuple[Any, int, int, int | None]:
    """The world group the save runs in (pinned for the whole save), this rank's rank in it, its
    size and its epoch; ``(None, 0, 1, None)`` without a group."""
    if pg is None:
        return None, 0, 1, None
    current = getattr(pg, "current_world", None)
    world = current() if current is not None else None
    if world is None:   # no collective engine: the collectives themselves say so
        return None, pg.rank, pg.world_size, getattr(pg, "epoch", None)
    return world, int(world.rank), int(world.size), int(world.epoch)


def _shown_error(err: BaseException, path: Path) -> str:
    """``err`` in one line, naming ``path`` when it is an ``OSError`` naming no file (a full disk
    met by the shard's writes: "rank 0: OSError: [Errno 28] No space left on device" said
    nowhere where, a tester's find)."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError) and not err.filename:
        text += f" (writing {path})"
    elif isinstance(err, FileExistsError):
        # mkdir of the root or step folder: "File exists" named a path that is no folder (a
        # dangling symbolic link, a file), the save wanting one there (a tester's find)
        there = Path(os.fsdecode(err.filename))
        if there.is_symlink() and not there.exists():
            text += (f" (a symbolic link to {os.readlink(there)!r}, which does not exist: make "
                     f"its target, or give another folder)")
        elif there.exists() and not there.is_dir():
            text += " (a file, where the checkpoint needs a folder)"
    elif isinstance(err, NotADirectoryError) and err.filename:
        # a folder of the path is a file (the root given was one): say which
        there = Path(os.fsdecode(err.filename))
        file = next((p for p in (there, *there.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            text += f" ({file} is a file, where the checkpoint needs a folder)"
    return text


def _pack_status(ok: bool, nbytes: int, digest: bytes, name: str, msg: str) -> np.ndarray:
    a = np.zeros(_STATUS_NBYTES, np.uint8)
    n = name.encode("ascii")[:_NAME_MAX]
    m = msg.encode("utf-8", "replace")[:_MSG_MAX]
    a[0] = 1 if ok else 0
    a[2:4] = np.frombuffer(np.uint16(len(m)).tobytes(), np.uint8)
    a[4:6] = np.frombuffer(np.uint16(len(n)).tobytes(), np.uint8)
    a[8:16] = np.frombuffer(np.uint64(nbytes).tobytes(), np.uint8)
    a[16:48] = np.frombuffer(digest.ljust(32, b"\0")[:32], np.uint8)
    a[48:48 + len(n)] = np.frombuffer(n, np.uint8)
    a[48 + _NAME_MAX:48 + _NAME_MAX + len(m)] = np.frombuffer(m, np.uint8)
    return a


def _unpack_status(a: np.ndarray) -> dict[str, Any]:
    b = a.tobytes()
    m = int(np.frombuffer(b[2:4], np.uint16)[0])
    n = int(np.frombuffer(b[4:6], np.uint16)[0])
    return {"ok": bool(b[0]), "nbytes": int(np.frombuffer(b[8:16], np.uint64)[0]),
            "sha256": b[16:48].hex(), "name": b[48:48 + n].decode("ascii", "replace"),
            "error": b[48 + _NAME_MAX:48 + _NAME_MAX + m].decode("utf-8", "replace")}


def _root_key(root_abs: str) -> int:
    """A 63-bit digest of a root's absolute path, compared across ranks."""
    return int.from_bytes(hashlib.sha256(root_abs.encode("utf-8", "surrogateescape")).digest()[:8],
                          "little") >> 1


ROOT_LOCK = ".rtxnet-checkpoint.lock"   # in a checkpoint root: the run that saves there
_HELD: dict[str, tuple[int, str]] = {}  # resolved root -> (lock's descriptor, run) held by this process


def run_id(job: str | None = None) -> str:
    """What names this process's run in a folder lock (:func:`claim_folder`): its job id (``job``,
    else ``RTXNET_JOB``, else ``"default"``), and the address of its coordinator when its
    launcher started that coordinator for it (``RTXNET_COORDINATOR_PID`` set: the address is then
    that launch's alone, and stays the same through the coordinator's restarts). By job id alone,
    two launches given one ``--job`` each with a coordinator of its own took one folder together
    (a tester's find). Ranks of several hosts (``--nnodes``) share a coordinator they did not
    start, and are named by their job id."""
    job = job or os.environ.get("RTXNET_JOB") or "default"
    if os.environ.get("RTXNET_COORDINATOR_PID") and os.environ.get("RTXNET_COORDINATOR"):
        return f"{job} (coordinator {os.environ['RTXNET_COORDINATOR']})"
    return job


def claim_folder(folder: str | os.PathLike, run: str, *, lock_name: str = ROOT_LOCK,
                 wait_s: float = 5.0) -> tuple[int | None, str | None]:
    """Share ``folder`` with the other processes of run ``run`` (:func:`run_id`) and keep other
    runs out: two runs writing one folder at once interleave their files (two jobs saving into one
    checkpoint root replaced each other's steps, and one's failed save removed the shard the other
    had just committed: a tester's find).

    The first process takes an exclusive ``flock`` on ``folder/lock_name``, writes ``run`` there
    and turns the lock into a shared one; a process that finds it held reads the run (under a
    shared lock, waiting up to ``wait_s`` seconds while another process writes it) and joins in if
    it is its own. The kernel drops a process's lock when it exits, however it ends, so a run that
    is over, or killed, leaves nothing to clean up; its replacements and a resumed run get the
    folder again. (Turning the exclusive lock into a shared one is not atomic: a second run
    starting in that instant may write its id in between; every process reads the id under its
    shared lock, so the run whose id is there keeps the folder and the other is refused.) Across
    hosts the lock holds where the shared file system implements ``flock`` (NFS does, as POSIX
    locks).

    Returns:
        ``(fd, None)``: the lock's descriptor, to keep open while the process runs (closing it
        gives this process's share up); or ``(None, holder)``: the run that holds the folder, as
        it wrote itself (or a line saying the lock stayed exclusive for ``wait_s`` seconds); or
        ``(None, None)``: nobody holds it, but the lock file is another user's and this process
        cannot write its run there (it is not held by this process).

    Raises:
        OSError: the lock file cannot be opened or locked (the folder is missing or read-only, or
            the file system has no ``flock``).
        ConfigError: ``folder`` is empty.
    """
    _check_root(folder, "claim_folder", "folder")
    path = Path(folder) / lock_name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except PermissionError:
        # another user's lock file in a shared folder: it can still be read and locked (a
        # process that saved unlocked here replaced the holder's steps: a re-verifier's find)
        return _claim_read_only(path, run, wait_s)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:       # another process, of this run or of another, holds it
            if (late := _share_lock(fd, path, wait_s)) is not None:
                os.close(fd)
                return None, late
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, run.encode(), 0)
            fcntl.flock(fd, fcntl.LOCK_SH)
        holder = os.pread(fd, 1024, 0).decode(errors="replace")
    except BaseException:
        os.close(fd)
        raise
    if holder != run:
        os.close(fd)
        return None, holder
    return fd, None


def _share_lock(fd: int, path: Path, wait_s: float) -> str | None:
    """Take a shared ``flock`` on ``fd`` (``path``'s), waiting up to ``wait_s`` seconds while
    another process holds it exclusively (it is writing its run there): None once taken, else a
    line saying so."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if time.monotonic() > deadline:
                return f"a process that held {path} exclusively for more than {wait_s:g} s"
            time.sleep(0.05)


def _claim_read_only(path: Path, run: str, wait_s: float) -> tuple[int | None, str | None]:
    """:func:`claim_folder` where the lock file exists but cannot be written (another user's):
    ``(None, holder)`` while a process holds it for another run; ``(fd, None)`` (a shared lock)
    while one holds it for ``run``; ``(None, None)`` when nobody holds it (this process cannot
    write its run there: it goes on unlocked). A missing file raises the ``PermissionError``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:   # held: by whom
            if (late := _share_lock(fd, path, wait_s)) is not None:
                os.close(fd)
                return None, late
            holder = os.pread(fd, 1024, 0).decode(errors="replace")
            if holder == run:
                return fd, None
            os.close(fd)
            return None, holder
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)   # nobody holds it
    return None, None


def shown_holder(holder: str) -> str:
    """``job 'job-a'``, with what follows it in ``holder`` (`` (coordinator ADDR)``, `` (run
    ID)``) outside the quotes."""
    job, sep, rest = holder.partition(" (")
    return f"job {job!r}" + (f" ({rest}" if sep else "")


RUN_KEY = "rtxnet/checkpoint/run"   # the job's store key of its run id (_save_run)
_RUNS: dict[tuple[str, str | None], str] = {}   # (job, coordinator) -> its run, as read once


def _save_run(pg: Any) -> str:
    """What names this process's run in a checkpoint root's lock: with a group, its job id and a
    random id the job's first save puts in the job's store (every rank of the job, on any host,
    reads the same one; two jobs of one id on two coordinators have two stores: by job id alone,
    or with the coordinator's address only when a launcher started it, they shared a root, a
    re-verifier's find); without one, this process (its pid and host: two single-process saves
    into one root were both let through).

    Raises:
        RtxError: the store did not answer.
    """
    import socket

    if pg is None:
        return f"process {os.getpid()} on {socket.gethostname()}"
    job = getattr(pg, "job", None) or "default"
    key = (job, getattr(getattr(pg, "agent", None), "coordinator", None))
    if key not in _RUNS:   # once per process and job: a save asks the store nothing more
        _, current = pg.store.compare_set(RUN_KEY, None, uuid.uuid4().hex[:16])
        _RUNS[key] = f"{job} (run {bytes(current).decode(errors='replace')})"
    return _RUNS[key]


def _claim_root(root: Path, pg: Any) -> str | None:
    """Hold ``root`` for this process's run (:func:`_save_run`; once per process and root, kept
    until it exits). Returns None, or the holder of the root when another run holds it. A root
    that cannot be created or locked (read-only, no ``flock``, the job's store not answering) is
    not refused here: the save's writes report the first, and the others save without the lock
    (logged once)."""
    key = str(root.resolve())
    held = _HELD.get(key)
    try:
        run = _save_run(pg)
    except RtxError as exc:
        log.warning("checkpoint_root_not_locked", root=key, error=str(exc),
                    hint="the job's store did not answer for its run id; saving without the lock")
        return None
    if held is not None and held[1] == run:
        if held[0] < 0 or _same_file(held[0], root / ROOT_LOCK):
            return None
        # The root was removed or replaced since this process claimed it (its lock is on a file
        # no longer there): claimed again, refused if another run holds the new one. Before,
        # the claim was taken as held for good, and this run's saves went into a root that
        # another run had claimed since (both wrote and pruned steps there).
        log.warning("checkpoint_root_replaced", root=key,
                    hint="the root was removed or replaced while this run held it; claiming it again")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, holder = claim_folder(root, run)
        unlocked = "the lock file is another user's" if fd is None and holder is None else None
    except OSError as exc:
        unlocked = str(exc)
    if unlocked is not None:
        if held is None:
            _HELD[key] = (-1, run)
            log.warning("checkpoint_root_not_locked", root=key, error=unlocked,
                        hint="another run saving into this root would not be refused")
        return None
    if fd is None:
        return holder
    if held is not None and held[0] >= 0:
        os.close(held[0])
    _HELD[key] = (fd, run)
    return None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (device and inode)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def hold(root: str | os.PathLike, *, pg: Any = None) -> None:
    """Hold checkpoint folder ``root`` for this process's run, as :func:`save` does at its first
    save there (creating ``root``): call it before deleting or writing anything there yourself
    (``examples/train_digits.py`` does before removing an earlier run's steps). Not a
    collective; each process holds it for itself.

    Raises:
        CheckpointError: another run holds ``root`` (names its job).
        ConfigError: ``root`` is empty or not a path, or exists and is not a folder; ``pg`` is
            not the process group of :func:`rtxnet.init` or None (a subgroup: names its type).
    """
    _check_pg(pg, "hold")
    _check_root(root, "hold")
    root = Path(root)
    if root.exists() and not root.is_dir():   # a file: it warned that it was not locked, and held nothing
        raise ConfigError(f"root {str(root)!r} is not a folder: checkpoint.hold takes the folder "
                          f"checkpoints are saved into")
    holder = _claim_root(root, pg)
    if holder is not None:
        raise CheckpointError(f"{root.resolve()} is in use by another run ({shown_holder(holder)}) "
                              f"that is still running; give another folder, or wait for that run "
                              f"to end")


def release(root: str | os.PathLike) -> None:
    """Give up this process's hold of checkpoint folder ``root`` (:func:`hold`, or the first
    :func:`save` there), so that another run may save there while this process lives; a later
    save here holds it again. Nothing happens when this process does not hold it.

    Raises:
        ConfigError: ``root`` is empty or not a path.
    """
    _check_root(root, "release")
    held = _HELD.pop(str(Path(root).resolve()), None)
    if held is not None and held[0] >= 0:
        os.close(held[0])


def _agree(pg: Any, step: int, root_abs: str, world: int, timeout_s: float | None,
           bad: ConfigError | None = None) -> None:
    """Phase 1: every rank saves the same step into the same root, held by this run, or none
    writes anything (a shard in another step's or another root's folder would leave no loadable
    set). ``bad``: this rank's arguments were refused (raised here, after the others were told:
    they raise ``ConfigError`` naming this rank)."""
    got = np.zeros(3 * world, np.int64)
    pg.all_gather(got, np.array([step, _root_key(root_abs), bad is None], np.int64), **_kw(timeout_s))
    steps, keys, oks = got[0::3], got[1::3], got[2::3]
    refused = [k for k, v in enumerate(oks.tolist()) if not v]
    if bad is not None:
        raise bad
    if refused:
        raise ConfigError(f"checkpoint.save: rank(s) {refused} refused their step, root, keep or metadata "
                          f"argument (their error names it); nothing was written")
    if len(set(steps.tolist())) > 1:
        by_rank = {k: int(v) for k, v in enumerate(steps)}
        raise CollectiveMismatchError(
            f"checkpoint.save: the ranks asked for different steps {by_rank}: every rank of "
            f"the group saves the same step; nothing was written", field="step", values=by_rank)
    if len(set(keys.tolist())) > 1:
        mine = np.zeros(_ROOT_NBYTES, np.uint8)
        raw = root_abs.encode("utf-8", "surrogateescape")[:_ROOT_NBYTES]
        mine[:len(raw)] = np.frombuffer(raw, np.uint8)
        paths = np.zeros(world * _ROOT_NBYTES, np.uint8)
        pg.all_gather(paths, mine, **_kw(timeout_s))
        roots = {k: paths[k * _ROOT_NBYTES:(k + 1) * _ROOT_NBYTES].tobytes().rstrip(b"\0")
                 .decode("utf-8", "replace") for k in range(world)}
        raise CollectiveMismatchError(
            f"checkpoint.save of step {step}: the ranks passed different roots {roots}: every "
            f"rank of the group saves into the same folder (one path, shared by the ranks); "
            f"nothing was written", field="root", values=roots)
    # the root is held by this run on every rank (it is created here, once the roots agree)
    holder = _claim_root(Path(root_abs), pg)
    claimed = np.zeros(world, np.int64)
    pg.all_gather(claimed, np.array([holder is None], np.int64), **_kw(timeout_s))
    refused = [k for k, v in enumerate(claimed.tolist()) if not v]
    if refused:
        if holder is None:   # the holder as the refused ranks read it, from the shared folder
            with contextlib.suppress(OSError):
                holder = (Path(root_abs) / ROOT_LOCK).read_text(errors="replace")[:1024]
        raise _in_use(step, root_abs, holder, refused)


def _in_use(step: int, root_abs: str, holder: str | None, ranks: list[int]) -> CheckpointError:
    return CheckpointError(
        f"checkpoint.save of step {step}: {root_abs} is in use by another run "
        f"({shown_holder(holder) if holder else 'unknown'}) that is still running (rank(s) {ranks} "
        f"found {ROOT_LOCK} there held); one run saves into a checkpoint folder at a time: give "
        f"another root, or wait for that run to end; nothing was written", step=step, ranks=ranks)


def _group_broke(exc: PeerLostError | ClosedError, step: int, outcome: str) -> BaseException:
    """``exc`` (the save's world group ended) again, naming the step and what was committed."""
    if isinstance(exc, PeerLostError):
        lost = f"lost rank(s) {exc.ranks}" if exc.ranks else "lost a rank"
        out: BaseException = PeerLostError(
            f"checkpoint step {step}: the group {lost} during the save; {outcome} ({exc})",
            ranks=exc.ranks, epoch=exc.epoch)
    else:
        out = ClosedError(f"checkpoint step {step}: the group's membership changed during the "
                          f"save; {outcome} ({exc})")
    # a warning: the error is raised to the caller, and FaultTolerance recovers from it (a fresh user
    # read an ERROR line in a run that ended well as alarming)
    log.warning("checkpoint_group_broke", step=step, outcome=outcome, error=str(exc))
    return out


# -- save -----------------------------------------------------------------------------------------

def save(root: str | os.PathLike, step: int, state: dict[str, Any], *, pg: Any = None,
         keep: int | None = None, metadata: dict[str, Any] | None = None,
         timeout_s: float | None = None) -> Path:
    """Save this rank's ``state`` as its shard of ``step`` and commit it with a manifest.

    Collective: every rank of ``pg`` must call it with the same ``step`` and ``root``. The whole
    save runs in the world group of the epoch it began in.

    Args:
        root: checkpoint folder (created if needed; shared by the ranks, e.g. one host or a shared
            file system, under the same absolute path on every rank).
        step: the number of completed training steps the state holds (>= 0): the checkpoint of
            step N is saved after steps 0..N-1 and resumes at step N, as
            ``FaultTolerance(start_step=N)`` and its ``load_checkpoint`` take it. Saving a step
            again replaces it when the new save commits; until then (and for good if the new save
            fails or a rank dies during it) the old one stays committed and loadable.
        state: this rank's state, a dict of nested dicts/lists/tuples of tensors, numbers,
            strings, bools, None (e.g. ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": s,
            "sampler": sampler.state_dict(), "rng": capture_rng()}``).
        pg: the :class:`rtxnet.BlockingProcessGroup`; ``None`` for a single process.
        keep: (rank 0's is used) after a successful save, rank 0 deletes all but the newest ``keep`` step folders
            up to ``step``, the one just saved always among them; a step :func:`latest` found
            corrupt in this process is not counted among them (it is deleted once older than the
            oldest kept). Steps after ``step`` are the abandoned future of a run that went back
            (resumed from an older checkpoint) and are deleted too: :func:`latest` would return
            them. (Before, the newest ``keep`` of all were kept: a save of step 25 after steps
            30 existed deleted the checkpoint it had just written, a tester's find.) Without
            ``keep`` no committed step is deleted, and a save below existing committed steps
            logs ``checkpoint_newer_steps_remain`` naming them. With or without it, what killed
            saves left (temporary files, a step folder that never got its manifest, shards a
            manifest of an earlier step does not list) is removed.
        metadata: a dict of JSON values stored in the manifest (e.g. the loss; floats finite,
            keys strings, lists not tuples: it is given back as saved); rank 0's is stored (the
            others' may differ, a time stamp say, and are only checked).
        timeout_s: deadline of each collective, in seconds; ``None`` uses the group's.

    Returns:
        The step folder.

    Raises:
        CheckpointError: another run (another job, or another launch with a coordinator of its
            own) holds ``root``: it is saving there and still running (names its job; nothing
            written); or some rank failed to write its shard (its state is not a dict, holds a
            value no safe load could read, or the write failed), or rank 0 failed to write the
            manifest or could not see a rank's shard (a root not shared by the ranks); raised on
            every rank, ``exc.ranks`` names the failed ranks. Nothing was committed: the step is
            what it was before (a committed step stays committed, with its old shards).
        ConfigError: ``pg`` is not the process group of :func:`rtxnet.init` or None (a subgroup
            from ``pg.split``/``pg.new_group``: names its type), raised before any communication;
            bad ``step`` (not an integer in 0..2**63-1), ``root`` (empty), ``keep`` or
            ``metadata`` (not a dict of strict JSON: a float that is not finite, bytes, other
            objects), or a save into ``root`` that runs in this process already (another
            thread's: names its step and thread); with ``pg``, after the first collective, and
            the other ranks raise it too, naming this rank.
        KeyboardInterrupt: a Ctrl-C during the save (on the main thread, under Python's own
            SIGINT handler) is raised once the save has ended on every rank, committed or not
            (the message says which; a failure is its cause). A second Ctrl-C is raised at
            once: during the shard's write the others then raise ``CheckpointError`` naming the
            rank "interrupted", in a collective ``CollectiveError`` ("cancelled on that
            rank"). A ``KeyboardInterrupt`` or ``SystemExit`` a handler of the script's own
            raises during the write is treated as that second Ctrl-C.
        CollectiveMismatchError: the ranks asked for different steps (``field="step"``) or passed
            different roots (``field="root"``, ``values`` maps rank to its resolved root); raised
            on every rank, nothing written.
        PeerLostError, ClosedError: the group's membership changed during the save (a rank lost,
            or a rank joined); the message names the step and whether it was committed (it is
            not, unless this is rank 0 and it had written the manifest).
        CollectiveTimeout: a collective of the save timed out.
    """
    _check_pg(pg, "save")
    bad = None
    saving = None
    try:
        step = _check_step(step)
        _check_root(root, "save")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"keep({keep!r}) must be None or an integer >= 1")
        _check_metadata(metadata)
        saving = _one_save_per_root(Path(root), step)
    except ConfigError as exc:
        if pg is None:
            raise
        # raised after the first collective, which tells the others (they waited for this
        # rank's collectives until their deadline, then met its next one: a mismatch naming
        # neither save nor the value, a breaker's find)
        bad, step = exc, -1
    world_group, rank, world, epoch = _save_world(pg)
    pin = pg.pinned(world_group) if world_group is not None else contextlib.nullcontext()
    deferred: list[float] = []
    try:
        with pin, _ctrl_c_deferred(step, deferred):
            folder = _save(Path(root), step, state, pg, rank, world, epoch, keep, metadata, timeout_s,
                           bad)
    except Exception as exc:
        if deferred:
            raise KeyboardInterrupt(f"Ctrl-C during checkpoint.save of step {step}, which then failed "
                                    f"({type(exc).__name__}: {exc})") from exc
        raise
    finally:
        if saving is not None:
            _save_ended(saving)
    if deferred:
        raise KeyboardInterrupt(f"Ctrl-C during checkpoint.save of step {step}, which ended first: "
                                f"committed ({folder})")
    return folder


# root (resolved) -> (step, thread name) of the save into it running in this process
_SAVING: dict[str, tuple[int, str]] = {}
_SAVING_LOCK = threading.Lock()


def _one_save_per_root(root: Path, step: int) -> str:
    """Mark a save of ``step`` into ``root`` as running in this process; returns the key to
    unmark. Two threads saving into one root at once removed each other's temporary files
    (``FileNotFoundError`` on the manifest's: a breaker's find, 1 of 4 runs).

    Raises:
        ConfigError: a save into ``root`` runs in this process already (names its step and
            thread)."""
    key, me = str(root.resolve()), threading.current_thread().name
    with _SAVING_LOCK:
        other = _SAVING.get(key)
        if other is None:
            _SAVING[key] = (step, me)
    if other is not None:
        raise ConfigError(f"checkpoint.save of step {step} into {key}: the save of step {other[0]} into "
                          f"it runs in this process (thread {other[1]!r}); saves of one root run one "
                          f"after the other")
    return key


def _save_ended(key: str) -> None:
    """Unmark the save :func:`_one_save_per_root` marked under ``key``."""
    with _SAVING_LOCK:
        _SAVING.pop(key, None)


@contextlib.contextmanager
def _ctrl_c_deferred(step: int, got: list[float]) -> Any:
    """While a save runs on the main thread under Python's own SIGINT handler: a first Ctrl-C is
    noted in ``got`` (and logged) instead of raised, and :func:`save` raises it once the save
    has ended on every rank; a second one is raised at once. A ``KeyboardInterrupt`` raised
    between the save's collectives left the other ranks in the one this rank never entered, and
    its next collective met theirs: every later save was a mismatch ("ranks asked for different
    steps", "disagree on dtype"), the group out of step for good (a re-verifier's find, at
    three places in the save). A save on another thread, or under a handler of the script's
    own, is left as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def note(signum: int, frame: Any) -> None:
        if got:
            raise KeyboardInterrupt
        got.append(time.monotonic())
        log.warning("checkpoint_save_interrupt_deferred", step=step,
                    hint="the save ends on every rank first, then Ctrl-C is raised; Ctrl-C again "
                         "stops it at once (the other ranks' save then fails)")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_metadata(metadata: Any) -> None:
    """Refuses, before anything is written, ``metadata`` the manifest could not hold as strict
    JSON or would give back changed (it failed on rank 0 only once the shards were written;
    ``inf`` was written as ``Infinity``, which strict JSON readers refuse: a tester's find)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise ConfigError(f"metadata must be None or a dict, got {type(metadata).__name__}")
    give = "give JSON numbers (finite), strings, bools, None, lists and dicts with string keys"
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"metadata is not JSON the manifest can hold ({exc}): {give}") from None
    # json.dumps writes other keys (int, float, bool, None) as strings and tuples as lists: what
    # a load gave back then differed from what was saved, without a word (a tester's note)
    todo: list[tuple[str, Any]] = [("metadata", metadata)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, tuple):
            raise ConfigError(f"{path} is a tuple, which the manifest would give back as a list: {give}")
        if isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"{path} has the key {k!r} ({type(k).__name__}), which the manifest "
                                      f"would give back as the string {next(iter(json.loads(json.dumps({k: 0}))))!r}: {give}")
                todo.append((f"{path}[{k!r}]", v))


def _save(root: Path, step: int, state: dict[str, Any], pg: Any, rank: int, world: int,
          epoch: int | None, keep: int | None, metadata: dict[str, Any] | None,
          timeout_s: float | None, bad: ConfigError | None = None) -> Path:
    t0 = time.perf_counter()
    if pg is not None:   # Phase 1: the same step and root on every rank, held by this run
        try:
            _agree(pg, step, str(root.resolve()), world, timeout_s, bad)
        except (PeerLostError, ClosedError) as exc:
            raise _group_broke(exc, step, "nothing was written") from exc
    elif (holder := _claim_root(root, pg)) is not None:
        raise _in_use(step, str(root.resolve()), holder, [0])
    folder = step_dir(root, step)

    # Phase 2: this rank's shard, under a name no committed manifest lists.
    err: BaseException | None = None
    digest, nbytes, name, written = b"", 0, f"rank-{rank}.pt", False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / MANIFEST).exists():
            name = f"rank-{rank}.{uuid.uuid4().hex[:12]}.pt"
        else:
            _remove_stale_temps(folder, name)
        if not isinstance(state, dict):   # load() returns a dict, with "_checkpoint" added
            raise TypeError(f"state must be a dict (e.g. {{'model': model.state_dict()}}), got "
                            f"{type(state).__name__}")
        _check_loadable(state, "state")
        tmp = _temp_of(folder / name)
        try:
            # To a file, not a BytesIO: torch hands the file each tensor's bytes, which it
            # writes with the GIL released. Into a BytesIO the copies held the GIL throughout
            # (2.4 s for a 700 MB shard): the agent's heartbeats stopped and the coordinator
            # declared the saving ranks lost. (Not to a path either: torch's own writer reports
            # a full disk only as "unexpected pos", without the OSError.)
            with open(tmp, "wb") as f:
                sink = _ShardSink(f)
                try:
                    torch.save(state, sink)
                except RuntimeError as exc:
                    if sink.error is None:
                        raise
                    raise sink.error from exc   # e.g. "No space left on device"
                f.flush()
                os.fsync(f.fileno())
            faults.point("checkpoint", pg=pg, step=step)   # fault injection: "during the write"
            nbytes, digest = sink.nbytes, sink.digest
            if digest is None or nbytes != tmp.stat().st_size:   # a seek, or bytes not seen
                nbytes, digest = _hash_file(tmp)
            written = True   # from here on a failure may leave the file
            os.replace(tmp, folder / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(folder)
    except BaseException as exc:  # noqa: BLE001 - any failure must reach every rank
        # A KeyboardInterrupt (Ctrl-C) or SystemExit too: this rank still takes part in phase 3,
        # saying it was interrupted, and raises it after. Raised at once, it left the others in
        # phase 3's all_gather, which its next collective then met (a tester's find: "ranks
        # disagree on dtype" on every later save, the group out of step for good).
        err = exc
    interrupt = err if err is not None and not isinstance(err, Exception) else None
    mine = _pack_status(err is None, nbytes, digest, name, "" if err is None else (
        f"interrupted ({type(err).__name__})" if interrupt else _shown_error(err, folder / name)))

    # Phase 3: everyone's outcome.
    if pg is None:
        statuses = [_unpack_status(mine)]
    else:
        out = np.zeros(world * _STATUS_NBYTES, np.uint8)
        try:
            pg.all_gather(out, mine, **_kw(timeout_s))
        except (PeerLostError, ClosedError) as exc:
            # rank 0 commits only with every rank's status: it may have got them all (this rank
            # sent its own) and committed, unless this rank is rank 0
            raise _group_broke(exc, step, "nothing was committed" if rank == 0 else
                               f"rank 0 may have committed it: see checkpoint.latest({str(root)!r})"
                               ) from exc
        statuses = [_unpack_status(out[k * _STATUS_NBYTES:(k + 1) * _STATUS_NBYTES]) for k in range(world)]
    failed = [k for k, s in enumerate(statuses) if not s["ok"]]

    # Phase 4: the commit point.
    committed = np.zeros(1, np.uint8)
    manifest_error = ""
    outcome = np.zeros(_STATUS_NBYTES, np.uint8)   # committed, or rank 0's error in writing it
    if rank == 0 and not failed:
        shards = [s["name"] for s in statuses]
        try:
            for k, s in enumerate(statuses):
                g = _SHARD_RE.match(s["name"])
                if g is None or int(g.group(1)) != k:
                    raise ValueError(f"rank {k} reported the shard name {s['name']!r}")
                try:
                    seen = f"{(folder / s['name']).stat().st_size} bytes"
                except FileNotFoundError:
                    seen = "no such file"
                if seen != f"{s['nbytes']} bytes":
                    raise FileNotFoundError(
                        f"rank {k} wrote {s['nbytes']} bytes to {folder / s['name']}, rank 0 sees "
                        f"{seen} (is {root} one folder shared by every rank?)")
            manifest = {
                "format": FORMAT, "step": step, "world_size": world, "epoch": epoch,
                "created_unix_s": time.time(), "shards": shards,
                "files": {s["name"]: {"sha256": s["sha256"], "nbytes": s["nbytes"]} for s in statuses},
                "metadata": metadata or {},
            }
            data = json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False).encode()
            # the step folder's own entry first: made by mkdir, it was in no fsynced folder, so a
            # power cut could lose the whole step after save returned, older steps pruned (a
            # breaker's reading)
            fsync_dir(root)
            _write_atomic(folder / MANIFEST, data, sync_folder=False)
            committed[0] = 1          # renamed: the commit point has passed
        except (OSError, TypeError, ValueError) as exc:
            manifest_error = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - a Ctrl-C: the others still hear the outcome
            interrupt = exc           # raised on this rank once they have
            manifest_error = (f"{type(exc).__name__}: {exc}" if isinstance(exc, Exception)
                              else f"interrupted ({type(exc).__name__})")
        if committed[0]:
            try:
                try:
                    fsync_dir(folder)
                except OSError as exc:    # committed and visible; only its durability is in doubt
                    log.warning("checkpoint_folder_fsync_failed", step=step, path=str(folder),
                                error=str(exc))
                # before the broadcast: no rank starts another save of this step while files go
                _remove_leftovers(folder, set(shards))
            except BaseException as exc:  # noqa: BLE001 - committed: the others hear so first
                interrupt = exc
    if pg is not None:
        if rank == 0:
            outcome = _pack_status(bool(committed[0]), 0, b"", "", manifest_error)
        try:
            # with rank 0's error: the others said only "could not write manifest.json" (a
            # tester's find: a full disk, named on rank 0 alone)
            pg.broadcast(outcome, src=0, **_kw(timeout_s))
            got = _unpack_status(outcome)
            committed[0], manifest_error = int(got["ok"]), got["error"]
        except (PeerLostError, ClosedError) as exc:
            raise _group_broke(exc, step, (
                f"rank 0 committed it ({folder / MANIFEST} written)" if committed[0] else
                "nothing was committed" if rank == 0 else
                f"rank 0 may have committed it: see checkpoint.latest({str(root)!r})")) from exc

    if not committed[0]:
        if written:   # nothing vouches for this save's shard: do not leave it taking space
            try:
                (folder / name).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("checkpoint_shard_kept", path=str(folder / name), error=str(exc))
        with contextlib.suppress(OSError):
            # the last rank to remove its shard removes the step folder this save made (one
            # holding a committed manifest or another rank's shard is not empty, and stays)
            folder.rmdir()
        if failed:
            first = statuses[failed[0]]["error"]
            msg = (f"checkpoint step {step} failed on rank(s) {failed}: rank {failed[0]}: {first}; "
                   f"no manifest written")
        else:
            failed = [0]
            msg = (f"checkpoint step {step}: rank 0 could not write {folder / MANIFEST}"
                   f"{': ' + manifest_error if manifest_error else ''}; no manifest written")
        log.error("checkpoint_failed", step=step, ranks=failed, error=msg)
        if interrupt is not None:
            raise interrupt
        raise CheckpointError(msg, step=step, ranks=failed) from err
    if interrupt is not None:   # rank 0, interrupted once the manifest was renamed: committed
        raise interrupt

    duration_ms = (time.perf_counter() - t0) * 1e3
    log.info("checkpoint_saved", step=step, nbytes=nbytes, world_size=world,
             duration_ms=round(duration_ms, 1))
    if rank == 0:
        _SWEPT.discard((str(root.resolve()), step))
        _sweep_killed_saves(root, step)
    if rank == 0 and keep is not None:
        _prune(root, keep, step)
    elif rank == 0 and (newer := [s for s in _steps(root) if s > step
                                  and (step_dir(root, s) / MANIFEST).exists()]):
        log.warning("checkpoint_newer_steps_remain", step=step, newer=newer,
                    hint="checkpoint.latest() returns the newest of them; save with keep= to "
                         "remove them, or remove them by hand")
    if rank == 0 and pg is not None:
        # The coordinator journals the newest committed checkpoint with the job's other state, so a
        # rank that rejoins (or a whole new set of ranks) can find it when no live peer holds the
        # committed state (see rtxnet.FaultTolerance(load_checkpoint=...)).
        try:
            _record(pg, root, step, world)
        except RtxError as exc:
            # The save is committed on every rank (the broadcast said so); this record only
            # helps a rank that rejoins find it. Raising here, on rank 0 alone, made the ranks
            # disagree on the save's outcome (a tester's find: a full store).
            log.warning("checkpoint_not_recorded", step=step, error=str(exc),
                        hint="a rank that rejoins without a live peer will not find this step "
                             "through the job's store; checkpoint.latest(root) still does")
    return folder


def _record(pg: Any, root: Path, step: int, world: int) -> None:
    pg.store.set(LATEST_KEY, json.dumps({"step": step, "root": str(root.resolve()), "world_size": world}))


def record(root: str | os.PathLike, step: int, *, pg: Any) -> None:
    """Tell the job's store that committed checkpoint ``step`` of ``root`` is the job's newest, as
    :func:`save` does after it commits one: call it after resuming from a checkpoint (every rank
    may call it; rank 0 writes). :class:`rtxnet.FaultTolerance` restores from the recorded
    checkpoint when no live rank holds the committed state (every rank died); without a record,
    a resumed run whose every rank died before its first save went on from its live state's
    nothing and said "no checkpoint recorded" (a tester's find).

    Raises:
        CheckpointError, CheckpointCorruptError: ``step`` of ``root`` has no valid manifest.
        ConfigError: ``pg`` is not the process group of :func:`rtxnet.init` (a subgroup: names
            its type; raised on every rank), ``root`` is empty, or ``step`` is not an integer
            in 0..2**63-1.
        RtxError: the store refused the record (a full store; names it).
    """
    _check_pg(pg, "record", required=True)
    _check_root(root, "record")
    m = read_manifest(root, step)
    if pg.rank == 0:
        _record(pg, Path(root), step, int(m["world_size"]))


_PLAIN = (bool, int, float, complex, str, bytes, type(None))
# (resolved root, step) of the checkpoints latest() found corrupt in this process: not counted
# among the ``keep`` newest by _prune
_CORRUPT_SEEN: set[tuple[str, int]] = set()
# containers nested deeper than this are refused by _check_loadable (real states: under 10)
_MAX_DEPTH = 256


def _check_loadable(v: Any, where: str, within: dict[int, str] | None = None) -> None:
    """Refuse, naming where it is, a value ``torch.load(weights_only=True)`` would refuse (NumPy
    arrays and scalars, arbitrary objects): saved, it would make a checkpoint that no load can
    read. Containers and tensors are walked; any other leaf is tried on its own. ``within``:
    the containers on the path to ``v`` (id -> path).

    Raises:
        TypeError: names the value's path and type.
        ValueError: a container holds itself (a cycle; names both paths: it was a
            RecursionError that named no key, a breaker's find), or containers are nested
            more than ``_MAX_DEPTH`` deep (names the path: 3000 levels were a RecursionError
            naming no key, a re-verifier's find).
    """
    # exact types: np.float64 and np.str_ subclass float and str but a safe load refuses them;
    # and a tensor subclass (a custom Parameter) is refused by a safe load too (a tester's find:
    # it was saved, then every load said "cannot be loaded safely"), so it is tried below
    if type(v) in _PLAIN or type(v) in (torch.Tensor, torch.nn.Parameter):
        return
    if type(v) in (dict, collections.OrderedDict, list, tuple, set):
        within = {} if within is None else within
        if id(v) in within:
            raise ValueError(f"{where} is {within[id(v)]} itself (the state holds a cycle), which a "
                             f"checkpoint cannot hold")
        if len(within) >= _MAX_DEPTH:
            raise ValueError(f"{where} is nested {len(within)} containers deep, more than a checkpoint "
                             f"takes ({_MAX_DEPTH}: torch.save's pickler recurses once per level, and "
                             f"Python's recursion limit ends it near 1000)")
        within[id(v)] = where
        if type(v) in (dict, collections.OrderedDict):
            for k, x in v.items():
                _check_loadable(k, f"{where} key {k!r}", within)
                _check_loadable(x, f"{where}[{k!r}]", within)
        else:
            for i, x in enumerate(v):
                _check_loadable(x, f"{where}[{i}]", within)
        del within[id(v)]    # (a raise above ends the walk: nothing to undo then)
        return
    buf = io.BytesIO()
    try:
        torch.save(v, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - whatever torch refuses, the message names it
        hint = (" (convert it: torch.from_numpy(a), or .item() / .tolist())"
                if type(v).__module__ == "numpy" else "")
        raise TypeError(
            f"{where} is a {type(v).__module__}.{type(v).__qualname__}, which a checkpoint cannot "
            f"hold: shards are loaded with torch.load(weights_only=True), which takes tensors, "
            f"numbers, strings, bytes, None and dicts/lists/tuples/sets of them{hint}") from None


def _remove_leftovers(folder: Path, listed: set[str]) -> None:
    """Rank 0, after a commit: remove the shards of ``folder`` the new manifest does not list (the
    replaced save's, those of ranks ``>= world`` of an earlier save with more ranks, those of
    failed or killed saves) and stray temporary files. Only names this module writes are touched;
    a file that cannot be removed is logged and left (it is never loaded)."""
    for p in folder.iterdir():
        n = p.name
        if n in listed or n == MANIFEST:
            continue
        stray_tmp = n.startswith((".rank-", f".{MANIFEST}.tmp-")) and ".tmp-" in n
        if not (_SHARD_RE.match(n) or stray_tmp):
            continue
        try:
            p.unlink()
            log.info("checkpoint_leftover_removed", path=str(p))
        except OSError as exc:
            log.warning("checkpoint_leftover_kept", path=str(p), error=str(exc))


# (resolved root, step) of committed step folders this process swept clean: a save after them
# skips them (a run without keep= would read every older manifest at every save). A step saved
# again is forgotten here (_save), so its leftovers are looked for once more.
_SWEPT: set[tuple[str, int]] = set()


def _sweep_killed_saves(root: Path, saved: int) -> None:
    """Rank 0 after committing step ``saved``: what killed saves left (a rank SIGKILLed mid-write
    leaves its temporary file; a re-save of a committed step killed before its commit leaves
    unlisted shards) goes: in the folder of a committed step before ``saved`` the files its
    manifest does not list, and a step folder with no manifest (a first save that never
    committed, before or after ``saved``) entirely, once only names this module writes are in
    it. A folder with a manifest that cannot be read is left as it is (:func:`latest` reports
    it); committed steps after ``saved`` are for ``keep`` to remove."""
    resolved = str(root.resolve())
    for s in _steps(root):
        if s == saved or (resolved, s) in _SWEPT:
            continue
        folder = step_dir(root, s)
        if (folder / MANIFEST).exists():
            if s > saved:
                continue
            try:
                listed = set(read_manifest(root, s)["shards"])
            except CheckpointError:
                continue
            _remove_leftovers(folder, listed)
            _SWEPT.add((resolved, s))   # committed and clean: not read again at every save
            continue
        _remove_leftovers(folder, set())
        with contextlib.suppress(OSError):
            folder.rmdir()        # only once empty: a folder holding anything else stays
            log.info("checkpoint_uncommitted_removed", step=s, path=str(folder))


def _steps(root: Path) -> list[int]:
    """The steps of ``root``'s ``step-<N>`` folders, ascending: only those :func:`step_dir` names
    (``N`` in 0..2**63-1 without leading zeros). Others are not this module's and are left
    alone: a stray ``step-9223372036854775808`` made :func:`latest`, :func:`load` and ``save(keep=)``
    raise ``ConfigError`` for the whole root (a tester's find)."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and (n := int(m.group(1))) <= MAX_STEP and str(n) == m.group(1) and p.is_dir():
            out.append(n)
    return sorted(out)


def _prune(root: Path, keep: int, saved: int) -> None:
    """Rank 0 after committing step ``saved``: delete the steps after it (an abandoned future)
    and all but the newest ``keep`` complete steps up to it."""
    # a step this process found corrupt does not count among the kept (a fresh user's find: after
    # a resume past a corrupt step-300, keep=3 kept 200, the corrupt 300 and 320, and deleted the
    # intact 100); it goes with the others once older than the oldest kept
    resolved = str(root.resolve())
    complete = [s for s in _steps(root) if s <= saved and (step_dir(root, s) / MANIFEST).exists()
                and (resolved, s) not in _CORRUPT_SEEN]
    cutoff = complete[-keep] if len(complete) > keep else -1
    for s in _steps(root):
        if s < cutoff or s > saved:
            manifest = step_dir(root, s) / MANIFEST
            try:
                fd = os.open(manifest, os.O_RDONLY)
            except OSError:
                fd = None   # no manifest (uncommitted), or not readable: nothing to lock
            try:
                if fd is not None and s < cutoff:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        # a reader holds it (_held_step: load, load_all, latest's check): left
                        # for a later save's prune, older than the kept ones then too (under a
                        # writer with keep=1 a read of a few MB never finished, each step pruned
                        # under it: a re-verifier's find)
                        log.info("checkpoint_prune_deferred", step=s, why="being read")
                        continue
                # the manifest first: the step is uncommitted before any shard goes, so a reader
                # in another process that finds a shard missing can tell a pruned step (its
                # manifest gone too) from a corrupt one (_StepRemoved); a crash between the two
                # leaves an uncommitted folder, which the next save's sweep removes
                with contextlib.suppress(FileNotFoundError):
                    manifest.unlink()
                shutil.rmtree(step_dir(root, s), ignore_errors=True)
                log.info("checkpoint_pruned", step=s, why="after the step saved" if s > saved else "older")
            finally:
                if fd is not None:
                    os.close(fd)


@contextlib.contextmanager
def _held_step(root: str | os.PathLike, step: int) -> Any:
    """Hold ``step`` against a prune while it is read: a shared ``flock`` on its manifest, which a
    prune (``save(keep=)``, in any process) asks for exclusively and, refused, leaves the step for
    a later save. Raises :class:`_StepRemoved` when the manifest was removed by the time the lock
    came (its link count 0); without a manifest nothing is held (the read says why). Where the
    file system has no ``flock`` across hosts, a read can still lose the step to a prune, which
    :func:`_read_newest` retries."""
    path = step_dir(root, step) / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):   # (no flock there: unheld, as before)
            fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:
            raise _StepRemoved(path.parent, step)
        yield
    finally:
        os.close(fd)


# -- load -----------------------------------------------------------------------------------------

def read_manifest(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """The manifest of ``step``, checked for form: it lists one shard for every rank of its world.

    Returns:
        The manifest, with ``"shards"`` (the shard file names in rank order; for a manifest written
        before the list existed, ``rank-<r>.pt``).

    Raises:
        CheckpointError: the step has no manifest (never committed, or half-written).
        CheckpointCorruptError: the manifest is not valid JSON of the expected form (names the
            file and what is wrong: a missing or mistyped field, a rank of its world without a
            shard, a shard without its size and SHA-256).
        ConfigError: ``root`` is empty or not a path, or ``step`` is not an integer in 0..2**63-1.
    """
    _check_root(root, "read_manifest")
    path = step_dir(root, step) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: step {step} was never committed", step=step)
    try:
        m = json.loads(_read_manifest_bytes(path, step))
        _check_manifest(m, step)
    except (ValueError, KeyError, TypeError, IsADirectoryError) as exc:
        raise CheckpointCorruptError(f"{path}: not a valid manifest ({exc})", path=path, step=step) from exc
    return m


def _read_manifest_bytes(path: Path, step: int) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:   # there a moment ago: pruned since
        raise _StepRemoved(path.parent, step) from exc


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(m: Any, step: int) -> None:
    """Raises ValueError naming what is wrong with manifest ``m`` of ``step``; adds ``"shards"``
    to a manifest written before the list existed."""
    if not isinstance(m, dict):
        raise ValueError(f"a JSON {type(m).__name__}, not an object")
    if m.get("format") != FORMAT:
        raise ValueError(f"format {m.get('format')!r}, expected {FORMAT}")
    if not _is_int(m.get("step")) or m["step"] != step:
        raise ValueError(f"step {m.get('step')!r}, expected {step}")
    world = m.get("world_size")
    if not _is_int(world) or world < 1:
        raise ValueError(f"world_size {world!r} is not an integer >= 1")
    files = m.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"files {files!r} is not an object")
    if "shards" not in m:
        # written before the list existed: every shard is in files. (Built whatever world_size
        # said, a manifest's world_size of 10**9 took the memory of a billion names: a tester's
        # find, the process killed by the kernel's out-of-memory killer.)
        if world > len(files):
            raise ValueError(f"world_size {world} but files lists {len(files)} file(s) and no shards")
        m["shards"] = [f"rank-{k}.pt" for k in range(world)]
    shards = m["shards"]
    if not isinstance(shards, list) or len(shards) != world:
        raise ValueError(f"shards {shards!r} is not a list of {world} file names (world_size {world})")
    for k, name in enumerate(shards):
        g = _SHARD_RE.match(name) if isinstance(name, str) else None
        if g is None or int(g.group(1)) != k:
            raise ValueError(f"shards[{k}] {name!r} is not a shard name of rank {k}")
        entry = files.get(name)
        if entry is None:
            raise ValueError(f"rank {k} of its world of {world} has no shard: files lists no {name}")
        if (not isinstance(entry, dict) or not _is_int(entry.get("nbytes")) or entry["nbytes"] < 0
                or not isinstance(entry.get("sha256"), str) or not _SHA256_RE.match(entry["sha256"])):
            raise ValueError(f"files[{name!r}] {entry!r} is not {{'sha256': 64 hex digits, "
                             f"'nbytes': integer >= 0}}")
    extra = sorted(set(files) - set(shards))
    if extra:
        raise ValueError(f"files lists {extra}, which are no shard of its world of {world}")


class _StepRemoved(CheckpointError):
    """A step removed while this process read it: pruned (``save(keep=)``) by a run writing to
    the same root. Not corrupt: :func:`latest` goes on to an older step, :func:`load` and
    :func:`load_all` without a step take the newest again."""

    def __init__(self, folder: Path, step: int):
        super().__init__(f"{folder} was removed while it was read (step {step} pruned by a save "
                         f"with keep= in another process?)", step=step)


def _missing_shard(path: Path, step: int, exc: FileNotFoundError) -> CheckpointError:
    """The error for a listed shard that is not there: the step was pruned meanwhile when its
    manifest is gone too (a prune removes the manifest first), else the step is corrupt."""
    if not (path.parent / MANIFEST).exists():
        return _StepRemoved(path.parent, step)
    return CheckpointCorruptError(f"{path} is listed in the manifest but missing", path=path,
                                  step=step)


def _verify_shard(path: Path, entry: dict[str, Any], step: int) -> None:
    """Check ``path``'s size and SHA-256 against its manifest entry, streaming it (the GIL is
    released on each 16 MiB chunk)."""
    try:
        size = path.stat().st_size
        if size == int(entry["nbytes"]):
            size, digest = _hash_file(path)
    except FileNotFoundError as exc:
        raise _missing_shard(path, step, exc) from exc
    if size != int(entry["nbytes"]):
        raise CheckpointCorruptError(f"{path}: {size} bytes, manifest says {entry['nbytes']}",
                                     path=path, step=step)
    got = digest.hex()
    if got != entry["sha256"]:
        raise CheckpointCorruptError(f"{path}: sha256 {got} does not match the manifest's "
                                     f"{entry['sha256']}", path=path, step=step)


def verify(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """Check every shard of ``step`` against its manifest; returns the manifest.

    Raises:
        CheckpointError: the step has no manifest (never committed, or half-written).
        CheckpointCorruptError: the manifest is malformed or does not list a shard for every rank
            of its world (names the manifest), or a shard is missing or its size or SHA-256
            differs from the manifest (names the shard).
        ConfigError: ``root`` is empty or not a path, or ``step`` is not an integer in 0..2**63-1.
    """
    _check_root(root, "verify")
    m = read_manifest(root, step)
    for name in m["shards"]:
        _verify_shard(step_dir(root, step) / name, m["files"][name], step)
    return m


def latest(root: str | os.PathLike, *, verify_shards: bool = True, before: int | None = None) -> int | None:
    """The newest committed step under ``root`` whose shards match the manifest, or None.

    Steps without a manifest (half-written) are skipped; a corrupt step (a manifest that is
    malformed or does not list a shard for every rank of its world, or, with ``verify_shards``, a
    shard whose size or SHA-256 differs from it) is skipped with a ``checkpoint_corrupt`` warning,
    so a resume falls back to the newest intact one. ``before``: only steps below it (the one
    before a step that could not be loaded).

    Raises:
        ConfigError: ``root`` is empty or not a path, or ``before`` is not None or an integer.
        OSError: a manifest or shard exists but cannot be read (e.g. permissions).
    """
    _check_root(root, "latest")
    if before is not None and (isinstance(before, bool) or not isinstance(before, int | np.integer)):
        raise ConfigError(f"before({before!r}) must be None or an integer step")
    corrupt: set[int] = set()   # found corrupt in this call: not read again on a new look
    for _ in range(_PRUNED_RETRIES):
        changed = _mtime_ns(root)
        found, pruned = _newest_intact(root, verify_shards, before, corrupt)
        # none found because a run saving there with keep= pruned a step as it was read: the
        # step that run committed just before may be missing from the listing (a folder made
        # during a readdir may or may not be in it, POSIX says), so list again while the root
        # changes under the scan
        if found is not None or not (pruned or _mtime_ns(root) != changed):
            return found
    return None


def _mtime_ns(root: str | os.PathLike) -> int | None:
    try:
        return os.stat(root).st_mtime_ns
    except OSError:
        return None


def _newest_intact(root: str | os.PathLike, verify_shards: bool, before: int | None,
                   corrupt: set[int]) -> tuple[int | None, bool]:
    """(the newest intact step of one listing of ``root`` or None, whether a step listed had no
    manifest or lost it while it was read: a step being saved or pruned, so worth a new look)."""
    pruned = False
    for s in reversed(_steps(Path(root))):
        if (before is not None and s >= before) or s in corrupt:
            continue
        if not (step_dir(root, s) / MANIFEST).exists():
            # uncommitted: being saved (committed by now, perhaps), or pruned since the listing
            pruned = True
            continue
        try:
            with _held_step(root, s):
                verify(root, s) if verify_shards else read_manifest(root, s)
        except CheckpointCorruptError as exc:
            log.warning("checkpoint_corrupt", step=s, path=str(exc.path), error=str(exc))
            _CORRUPT_SEEN.add((str(Path(root).resolve()), s))
            corrupt.add(s)
            continue
        except CheckpointError:   # the manifest went between the two looks (pruned meanwhile)
            pruned = True
            continue
        return s, pruned
    return None, pruned


def _resolve_step(root: str | os.PathLike, step: int | None) -> int:
    if step is None:
        step = latest(root)
        if step is None:
            missing = "" if os.path.isdir(root) else (
                " (a file, where the checkpoints' folder should be)" if os.path.exists(root)
                else " (no such folder)")
            raise CheckpointError(f"no committed checkpoint under {root}{missing}")
    return _check_step(step)


def _load_shard(root: str | os.PathLike, step: int, m: dict[str, Any], shard: int) -> dict[str, Any]:
    name = m["shards"][shard]   # read_manifest checked: one per rank of the saved world
    path = step_dir(root, step) / name
    _verify_shard(path, m["files"][name], step)
    try:
        # from the path (the file verified just now: shard names are never written twice), as
        # torch then reads it with the GIL released; from a BytesIO it held the GIL throughout
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError as exc:   # verified a moment ago: pruned since
        raise _missing_shard(path, step, exc) from exc
    except pickle.UnpicklingError as exc:
        # intact (its SHA-256 matches) but holding what weights_only refuses: written by another
        # tool or an older rtxnet that did not check the state at save time
        raise CheckpointCorruptError(
            f"{path} is intact but cannot be loaded safely (torch.load(weights_only=True) refused "
            f"it: {str(exc).splitlines()[0]})", path=path, step=step) from exc


def load_all(root: str | os.PathLike, step: int | None = None) -> list[dict[str, Any]]:
    """Every rank's shard of one checkpoint, in rank order: what sharded state (FSDP's
    ``load_sharded_state_dicts``) needs to resume at another world size. Not a collective.

    Args:
        root: checkpoint folder.
        step: the step; ``None`` takes :func:`latest`.

    Returns:
        ``states[q]`` is the state saved rank ``q`` passed to :func:`save`, for ``q`` in
        ``range(saved world size)``, each with ``"_checkpoint"`` as :func:`load` gives it
        (``shard_rank`` = ``q``, ``resharded`` False). Every shard is read and verified; memory is
        the whole checkpoint.

    Raises:
        CheckpointError: no committed checkpoint under ``root``, or ``step`` was never committed,
            or it was removed while it was read (pruned by a save with ``keep`` in another
            process; without ``step`` the newest step is taken again, up to 8 times).
        CheckpointCorruptError: the manifest is malformed or does not list a shard for every rank
            of its world (names the manifest), or a shard's size or SHA-256 differs from the
            manifest (names the file).
        ConfigError: ``root`` is empty or not a path, or ``step`` is not None or an integer in
            0..2**63-1.
    """
    _check_root(root, "load_all")

    def read(step: int) -> list[dict[str, Any]]:
        m = read_manifest(root, step)
        saved_world = int(m["world_size"])
        out = []
        for q in range(saved_world):
            state = _load_shard(root, step, m, q)
            state["_checkpoint"] = {"step": step, "world_size": saved_world, "shard_rank": q,
                                    "resharded": False}
            out.append(state)
        log.info("checkpoint_loaded_all", step=step, saved_world_size=saved_world)
        return out

    return _read_newest(root, step, read)


# how many times load/load_all without a step take the newest step again when the one they read
# is pruned meanwhile (a save with keep= in another process; each try reads a newer step)
_PRUNED_RETRIES = 8


def _read_newest(root: str | os.PathLike, step: int | None, read: Any) -> Any:
    """``read(step)``; with ``step`` None, of the newest intact step, taken again when the step
    read is removed meanwhile (:class:`_StepRemoved`: a run saving there with ``keep=`` pruned
    it, a tester's find: a bare ``FileNotFoundError`` before). A step given is not replaced."""
    if step is not None:
        step = _check_step(step)
        with _held_step(root, step):
            return read(step)
    for attempt in range(_PRUNED_RETRIES):
        s = _resolve_step(root, None)
        try:
            with _held_step(root, s):
                return read(s)
        except CheckpointError as exc:
            # latest() found s committed a moment ago: with its manifest gone now (a prune
            # removes it first) it was pruned, whatever the read tripped on
            gone = isinstance(exc, _StepRemoved) or (
                not isinstance(exc, CheckpointCorruptError)
                and not (step_dir(root, s) / MANIFEST).exists())
            if not gone or attempt == _PRUNED_RETRIES - 1:
                raise
            log.info("checkpoint_pruned_while_read", step=s, retry="the newest step again")
    raise AssertionError("unreachable")


def _refuse_resharding(root: Any, step: int, saved_world: int, world: int | None, rank: int) -> None:
    """``ConfigError`` when this process holds state that differs per rank (tensor-parallel layers,
    pipeline stages: :func:`rtxnet.elastic.note_rank_specific`) and a checkpoint of another world
    size would give it another rank's shard, or one of several (a tester's find: stage 0's weights
    loaded into every stage of a larger pipeline, without an error)."""
    from rtxnet.elastic import rank_specific_state  # (elastic imports this module)

    held = rank_specific_state(min_ranks=1)
    if held:
        shown = shown_list(held, 4)
        now = f"this world has {world}" if world is not None else f"this is rank {rank}"
        raise ConfigError(
            f"checkpoint.load: step {step} of {root} was saved by {saved_world} rank(s), {now}, "
            f"and this process holds state that differs per rank ({shown}): a shard of another "
            f"rank would load its slices or stage silently. Resume at {saved_world} rank(s), read "
            f"every shard with checkpoint.load_all(root, step) and reshard, or pass rank= the "
            f"saved rank whose shard holds this rank's part")


def load(root: str | os.PathLike, step: int | None = None, *, rank: int | None = None,
         pg: Any = None) -> dict[str, Any]:
    """Load the shard of ``rank`` (or rank 0's, when the checkpoint had fewer ranks).

    Args:
        root: checkpoint folder.
        step: the step; ``None`` takes :func:`latest`.
        rank: which shard; default ``pg.rank`` (0 without a group).
        pg: the process group, for the default rank.

    Returns:
        The state passed to :func:`save` on that rank, plus ``"_checkpoint"``: ``{"step",
        "world_size", "shard_rank", "resharded"}`` (``resharded``: rank 0's shard stood in).

    Raises:
        CheckpointError: no committed checkpoint under ``root``, or ``step`` was never committed,
            or it was removed while it was read (pruned by a save with ``keep`` in another
            process; without ``step`` the newest step is taken again, up to 8 times).
        CheckpointCorruptError: the manifest is malformed or does not list a shard for every rank
            of its world (names the manifest), or the shard's size or SHA-256 differs from the
            manifest (names the file); such a checkpoint is never loaded.
        ConfigError: ``root`` is empty or not a path; ``rank`` is not an int >= 0 (names it); or the checkpoint's world size
            differs from ``pg``'s (checked when ``rank`` is not given), or it has no shard
            ``rank``, while this process holds state that
            differs per rank (tensor-parallel layers, pipeline stages), which another rank's
            shard would fill silently wrong (names both sizes and the state); or, with that
            state, neither ``pg`` nor ``rank`` given. Build the model before loading: state
            built after the load is not known to it.
    """
    _check_root(root, "load")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0):
        raise ConfigError(f"checkpoint.load: rank({rank!r}) must be an int >= 0")
    # a rank given names its shard itself (a 2-D mesh resumed with fewer data-parallel ranks may
    # take the first ranks' shards): only the world size is not checked then
    world = int(pg.world_size) if pg is not None and rank is None else None
    if rank is None and pg is None:
        from rtxnet.elastic import rank_specific_state

        if held := rank_specific_state():
            # rank 0's shard by default: another rank's slices, loaded without a word (a
            # re-verifier's find)
            raise ConfigError(f"checkpoint.load: this process holds state that differs per rank "
                              f"({', '.join(held[:4])}): pass pg= (its rank's shard) or rank=")
    if rank is None:
        rank = pg.rank if pg is not None else 0

    def read(step: int) -> dict[str, Any]:
        m = read_manifest(root, step)
        saved_world = int(m["world_size"])
        if rank >= saved_world or (world is not None and world != saved_world):
            _refuse_resharding(root, step, saved_world, world, rank)
        shard = rank if rank < saved_world else 0
        state = _load_shard(root, step, m, shard)
        state["_checkpoint"] = {"step": step, "world_size": saved_world, "shard_rank": shard,
                                "resharded": shard != rank}
        log.info("checkpoint_loaded", step=step, shard_rank=shard, saved_world_size=saved_world)
        return state

    return _read_newest(root, step, read)
