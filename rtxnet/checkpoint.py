"""Sharded, atomically committed checkpoints.

Layout under a root folder::

    root/step-<N>/rank-<r>.pt        one shard per rank: torch.save of that rank's plain state
    root/step-<N>/manifest.json      written last: the commit point

A save runs in four phases on every rank of the group:

1. rank 0 removes an old ``manifest.json`` of the same step (a save over a step left half-written
   by a crash, or over a finished one), then the group meets in a barrier, so no shard is replaced
   while a manifest still vouches for the old one;
2. every rank serialises its state, writes it to a temporary name, flushes, fsyncs, renames it to
   ``rank-<r>.pt`` and fsyncs the folder (the POSIX recipe for an atomic, durable replace);
3. ranks exchange ``(ok, nbytes, sha256, error text)`` with one ``all_gather``;
4. rank 0 writes ``manifest.json`` (temporary name, fsync, rename, fsync) only if every rank
   succeeded, and broadcasts the outcome; if any rank failed, every rank raises
   :class:`CheckpointError` naming the failed ranks and the first error.

A step without a manifest is never loaded; a shard whose size or SHA-256 differs from the
manifest is refused with :class:`CheckpointCorruptError` naming the file. Shards are read with
``torch.load(weights_only=True)``, so a checkpoint cannot run code: states hold tensors, numbers,
strings, lists, tuples and dicts only (:func:`capture_rng` turns the RNG states into such values).

Loading at another world size: :func:`load` returns the shard of ``rank`` if the checkpoint has
one, else rank 0's. Data-parallel state (model, optimizer, step, sampler position) is replicated,
so any shard serves; per-rank RNG streams of ranks that did not exist are rank 0's, which a script
may re-seed with its rank. Sharded state (FSDP) needs every rank's shard: :func:`load_all` returns
them in rank order, for ``FullyShardedDataParallel.load_sharded_state_dicts``.

Errors (from the tree in ``transport/errors.py``)::

    RtxError
    `-- CheckpointError             a save failed on some rank, or no usable checkpoint
        `-- CheckpointCorruptError  a shard or manifest does not match (carries the path)
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from rtxnet import faults
from transport.durable import fsync_dir
from transport.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CollectiveMismatchError,
    ConfigError,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "capture_rng",
    "latest",
    "load",
    "load_all",
    "read_manifest",
    "restore_rng",
    "save",
    "step_dir",
    "verify",
]

log = structlog.get_logger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_STATUS_NBYTES = 1024         # ok(1) pad(1) msg_len(2) pad(4) nbytes(8) sha256(32) msg(976)
_MSG_MAX = _STATUS_NBYTES - 48


LATEST_KEY = "rtxnet/checkpoint/latest"


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

def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ConfigError(f"step({step!r}) must be an integer >= 0")
    return int(step)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step-<step>``."""
    return Path(root) / f"step-{_check_step(step)}"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary name, fsync, rename over ``path``, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _remove_stale_temps(folder: Path, name: str) -> None:
    for p in folder.glob(f".{name}.tmp-*"):
        p.unlink(missing_ok=True)


# -- group plumbing (pg=None: a single process) ---------------------------------------------------

def _rank_world(pg: Any) -> tuple[int, int]:
    return (0, 1) if pg is None else (pg.rank, pg.world_size)


def _kw(timeout_s: float | None) -> dict[str, Any]:
    return {} if timeout_s is None else {"timeout": timeout_s}


def _pack_status(ok: bool, nbytes: int, digest: bytes, msg: str) -> np.ndarray:
    a = np.zeros(_STATUS_NBYTES, np.uint8)
    m = msg.encode("utf-8", "replace")[:_MSG_MAX]
    a[0] = 1 if ok else 0
    a[2:4] = np.frombuffer(np.uint16(len(m)).tobytes(), np.uint8)
    a[8:16] = np.frombuffer(np.uint64(nbytes).tobytes(), np.uint8)
    a[16:48] = np.frombuffer(digest.ljust(32, b"\0")[:32], np.uint8)
    a[48:48 + len(m)] = np.frombuffer(m, np.uint8)
    return a


def _unpack_status(a: np.ndarray) -> dict[str, Any]:
    b = a.tobytes()
    n = int(np.frombuffer(b[2:4], np.uint16)[0])
    return {"ok": bool(b[0]), "nbytes": int(np.frombuffer(b[8:16], np.uint64)[0]),
            "sha256": b[16:48].hex(), "error": b[48:48 + n].decode("utf-8", "replace")}


# -- save -----------------------------------------------------------------------------------------

def save(root: str | os.PathLike, step: int, state: dict[str, Any], *, pg: Any = None,
         keep: int | None = None, metadata: dict[str, Any] | None = None,
         timeout_s: float | None = None) -> Path:
    """Save this rank's ``state`` as shard ``rank-<r>.pt`` of ``step`` and commit it with a manifest.

    Collective: every rank of ``pg`` must call it with the same ``step``.

    Args:
        root: checkpoint folder (created if needed; shared by the ranks, e.g. one host or a shared
            file system).
        step: the number of completed training steps the state holds (>= 0): the checkpoint of
            step N is saved after steps 0..N-1 and resumes at step N, as
            ``FaultTolerance(start_step=N)`` and its ``load_checkpoint`` take it. Saving a step
            again replaces it.
        state: this rank's state: nested dicts/lists/tuples of tensors, numbers, strings, bools,
            None (e.g. ``{"model": model.state_dict(), "optimizer": opt.state_dict(), "step": s,
            "sampler": sampler.state_dict(), "rng": capture_rng()}``).
        pg: the :class:`rtxnet.BlockingProcessGroup`; ``None`` for a single process.
        keep: after a successful save, rank 0 deletes all but the newest ``keep`` step folders.
        metadata: JSON-serialisable values stored in the manifest (e.g. the loss).
        timeout_s: deadline of each collective, in seconds; ``None`` uses the group's.

    Returns:
        The step folder.

    Raises:
        CheckpointError: some rank failed to write its shard, or rank 0 failed to write the
            manifest; raised on every rank, ``exc.ranks`` names the failed ranks. The step has no
            manifest afterwards and will not be loaded.
        ConfigError: bad ``step`` or ``keep``.
        CollectiveMismatchError: the ranks asked for different steps (nothing written).
        PeerLostError, CollectiveTimeout: the group broke during the save; no manifest written.
    """
    step = _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"keep({keep!r}) must be None or an integer >= 1")
    rank, world = _rank_world(pg)
    folder = step_dir(root, step)
    t0 = time.perf_counter()
    if pg is not None:
        # every rank saves the same step, or none writes anything (a shard in another step's
        # folder would leave both steps without a loadable set)
        steps = np.zeros(world, np.int64)
        pg.all_gather(steps, np.array([step], np.int64), **_kw(timeout_s))
        if len(set(steps.tolist())) > 1:
            by_rank = {k: int(v) for k, v in enumerate(steps)}
            raise CollectiveMismatchError(
                f"checkpoint.save: the ranks asked for different steps {by_rank}: every rank of "
                f"the group saves the same step; nothing was written", field="step", values=by_rank)

    # Phase 1: withdraw an old manifest before any shard of this step changes.
    err: BaseException | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if rank == 0 and (folder / MANIFEST).exists():
            (folder / MANIFEST).unlink()
            fsync_dir(folder)
            log.info("checkpoint_manifest_withdrawn", step=step)
    except OSError as exc:
        err = exc
    if pg is not None:
        pg.barrier(**_kw(timeout_s))

    # Phase 2: this rank's shard.
    digest, nbytes = b"", 0
    if err is None:
        try:
            name = f"rank-{rank}.pt"
            _remove_stale_temps(folder, name)
            _check_loadable(state, "state")
            buf = io.BytesIO()
            torch.save(state, buf)
            data = buf.getvalue()
            digest, nbytes = hashlib.sha256(data).digest(), len(data)
            faults.point("checkpoint", pg=pg, step=step)   # fault injection: "during checkpoint write"
            _write_atomic(folder / name, data)
        except Exception as exc:  # noqa: BLE001 - any failure must reach every rank
            err = exc
    mine = _pack_status(err is None, nbytes, digest,
                        "" if err is None else f"{type(err).__name__}: {err}")

    # Phase 3: everyone's outcome.
    if pg is None:
        statuses = [_unpack_status(mine)]
    else:
        out = np.zeros(world * _STATUS_NBYTES, np.uint8)
        pg.all_gather(out, mine, **_kw(timeout_s))
        statuses = [_unpack_status(out[k * _STATUS_NBYTES:(k + 1) * _STATUS_NBYTES]) for k in range(world)]
    failed = [k for k, s in enumerate(statuses) if not s["ok"]]

    # Phase 4: the commit point.
    committed = np.zeros(1, np.uint8)
    manifest_error = ""
    if rank == 0 and not failed:
        manifest = {
            "format": FORMAT, "step": step, "world_size": world,
            "epoch": None if pg is None else pg.epoch, "created_unix_s": time.time(),
            "files": {f"rank-{k}.pt": {"sha256": s["sha256"], "nbytes": s["nbytes"]}
                      for k, s in enumerate(statuses)},
            "metadata": metadata or {},
        }
        try:
            _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            committed[0] = 1
        except (OSError, TypeError, ValueError) as exc:
            manifest_error = f"{type(exc).__name__}: {exc}"
    if pg is not None:
        pg.broadcast(committed, src=0, **_kw(timeout_s))

    if not committed[0]:
        if failed:
            first = statuses[failed[0]]["error"]
            msg = (f"checkpoint step {step} failed on rank(s) {failed}: rank {failed[0]}: {first}; "
                   f"no manifest written")
        else:
            failed = [0]
            msg = (f"checkpoint step {step}: rank 0 could not write {folder / MANIFEST}"
                   f"{': ' + manifest_error if manifest_error else ''}")
        log.error("checkpoint_failed", step=step, ranks=failed, error=msg)
        raise CheckpointError(msg, step=step, ranks=failed) from err

    duration_ms = (time.perf_counter() - t0) * 1e3
    log.info("checkpoint_saved", step=step, nbytes=nbytes, world_size=world,
             duration_ms=round(duration_ms, 1))
    if rank == 0:
        _remove_unlisted_shards(folder, world)
    if rank == 0 and keep is not None:
        _prune(Path(root), keep)
    if rank == 0 and pg is not None:
        # The coordinator journals the newest committed checkpoint with the job's other state, so a
        # rank that rejoins (or a whole new set of ranks) can find it when no live peer holds the
        # committed state (see rtxnet.FaultTolerance(load_checkpoint=...)).
        pg.store.set(LATEST_KEY, json.dumps({"step": step, "root": str(Path(root).resolve()),
                                             "world_size": world}))
    return folder


_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _check_loadable(v: Any, where: str) -> None:
    """Refuse, naming where it is, a value ``torch.load(weights_only=True)`` would refuse (NumPy
    arrays and scalars, arbitrary objects): saved, it would make a checkpoint that no load can
    read. Containers and tensors are walked; any other leaf is tried on its own.

    Raises:
        TypeError: names the value's path and type.
    """
    # exact types: np.float64 and np.str_ subclass float and str but a safe load refuses them
    if type(v) in _PLAIN or isinstance(v, torch.Tensor):
        return
    if type(v) in (dict, collections.OrderedDict):
        for k, x in v.items():
            _check_loadable(k, f"{where} key {k!r}")
            _check_loadable(x, f"{where}[{k!r}]")
        return
    if type(v) in (list, tuple, set):
        for i, x in enumerate(v):
            _check_loadable(x, f"{where}[{i}]")
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
            f"numbers, strings, bytes, None and dicts/lists/tuples of them{hint}") from None


def _remove_unlisted_shards(folder: Path, world: int) -> None:
    """Shards of ranks ``>= world`` left by an earlier save of the same step with more ranks: the
    manifest does not list them, so they are never loaded, but they are not this step's."""
    for p in folder.glob("rank-*.pt"):
        m = re.fullmatch(r"rank-(\d+)\.pt", p.name)
        if m and int(m.group(1)) >= world:
            try:
                p.unlink()
                log.info("checkpoint_stale_shard_removed", path=str(p))
            except OSError as exc:
                log.warning("checkpoint_stale_shard_kept", path=str(p), error=str(exc))


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def _prune(root: Path, keep: int) -> None:
    complete = [s for s in _steps(root) if (step_dir(root, s) / MANIFEST).exists()]
    if len(complete) <= keep:
        return
    cutoff = complete[-keep]
    for s in _steps(root):
        if s < cutoff:
            shutil.rmtree(step_dir(root, s), ignore_errors=True)
            log.info("checkpoint_pruned", step=s)


# -- load -----------------------------------------------------------------------------------------

def read_manifest(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """The manifest of ``step``.

    Raises:
        CheckpointError: the step has no manifest (never committed, or half-written).
        CheckpointCorruptError: the manifest is not valid JSON of the expected form.
    """
    path = step_dir(root, step) / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: step {step} was never committed", step=step)
    try:
        m = json.loads(path.read_bytes())
        if m.get("format") != FORMAT or int(m["step"]) != step or not isinstance(m["files"], dict):
            raise ValueError(f"format {m.get('format')!r}, step {m.get('step')!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(f"{path}: not a valid manifest ({exc})", path=path, step=step) from exc
    return m


def _read_verified(path: Path, entry: dict[str, Any], step: int) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise CheckpointCorruptError(f"{path} is listed in the manifest but missing", path=path,
                                     step=step) from exc
    if len(data) != int(entry["nbytes"]):
        raise CheckpointCorruptError(f"{path}: {len(data)} bytes, manifest says {entry['nbytes']}",
                                     path=path, step=step)
    got = hashlib.sha256(data).hexdigest()
    if got != entry["sha256"]:
        raise CheckpointCorruptError(f"{path}: sha256 {got} does not match the manifest's "
                                     f"{entry['sha256']}", path=path, step=step)
    return data


def verify(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """Check every shard of ``step`` against its manifest; returns the manifest.

    Raises:
        CheckpointError, CheckpointCorruptError: as :func:`read_manifest` and :func:`load`.
    """
    m = read_manifest(root, step)
    for name, entry in m["files"].items():
        _read_verified(step_dir(root, step) / name, entry, step)
    return m


def latest(root: str | os.PathLike, *, verify_shards: bool = True) -> int | None:
    """The newest committed step under ``root`` whose shards match the manifest, or None.

    Steps without a manifest (half-written) are skipped; a corrupt step is skipped with a
    ``checkpoint_corrupt`` warning, so a resume falls back to the newest intact one.
    """
    for s in reversed(_steps(Path(root))):
        if not (step_dir(root, s) / MANIFEST).exists():
            continue
        try:
            verify(root, s) if verify_shards else read_manifest(root, s)
        except CheckpointCorruptError as exc:
            log.warning("checkpoint_corrupt", step=s, path=str(exc.path), error=str(exc))
            continue
        return s
    return None


def _resolve_step(root: str | os.PathLike, step: int | None) -> int:
    if step is None:
        step = latest(root)
        if step is None:
            raise CheckpointError(f"no committed checkpoint under {root}")
    return _check_step(step)


def _load_shard(root: str | os.PathLike, step: int, m: dict[str, Any], shard: int) -> dict[str, Any]:
    name = f"rank-{shard}.pt"
    if name not in m["files"]:
        raise CheckpointCorruptError(f"{step_dir(root, step) / MANIFEST} lists no {name}",
                                     path=step_dir(root, step) / MANIFEST, step=step)
    path = step_dir(root, step) / name
    data = _read_verified(path, m["files"][name], step)
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
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
        CheckpointError: no committed checkpoint under ``root``, or ``step`` was never committed.
        CheckpointCorruptError: a shard's size or SHA-256 differs from the manifest (names the
            file).
    """
    step = _resolve_step(root, step)
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
        CheckpointError: no committed checkpoint under ``root``, or ``step`` was never committed.
        CheckpointCorruptError: the shard's size or SHA-256 differs from the manifest (names the
            file); such a checkpoint is never loaded.
    """
    step = _resolve_step(root, step)
    if rank is None:
        rank = pg.rank if pg is not None else 0
    m = read_manifest(root, step)
    saved_world = int(m["world_size"])
    shard = rank if rank < saved_world else 0
    state = _load_shard(root, step, m, shard)
    state["_checkpoint"] = {"step": step, "world_size": saved_world, "shard_rank": shard,
                            "resharded": shard != rank}
    log.info("checkpoint_loaded", step=step, shard_rank=shard, saved_world_size=saved_world)
    return state
