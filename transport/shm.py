"""Shared-memory segments for same-host payloads, with cleanup that survives crashes.

A segment is a file under ``/dev/shm`` mapped with ``mmap`` (no ``multiprocessing.shared_memory``,
so no resource tracker process). Its name embeds the owner's pid::

    rtxnet-<job>-<pid>-<counter>

Lifetime, so that nothing leaks even when a process is SIGKILLed:

1. the owner creates and maps it (pages populated at once, so the first collective does not pay
   page faults);
2. peers map it by name when the owner announces it;
3. once every peer has mapped it the owner unlinks the file (:meth:`Segment.unlink`); the memory
   lives on in the mappings and is freed by the kernel when the last one goes, crash or not;
4. a crash between 1 and 3 leaves a file whose pid is dead: :func:`reap_dead_segments`, run by
   every engine at start, removes it.
"""

from __future__ import annotations

import mmap
import os
import re

import psutil
import structlog

__all__ = ["SHM_DIR", "Segment", "PeerSegment", "segment_name", "reap_dead_segments", "list_segments",
           "remove_segments"]

log = structlog.get_logger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "rtxnet-"
_NAME_RE = re.compile(r"^rtxnet-([A-Za-z0-9_]{0,64})-(\d+)-(\d+)$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# Larger mappings are faulted in by their first use instead: populating 512 MiB at once held the
# event loop of the rank that made it for ~0.5 s (the copy that touches the pages runs off it).
_POPULATE_MAX = 32 << 20


def _populate(nbytes: int) -> int:
    return _POPULATE if nbytes <= _POPULATE_MAX else 0


def _safe_job(job: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", job)[:64]


def segment_name(job: str, pid: int, counter: int) -> str:
    """The file name of segment ``counter`` of process ``pid`` in ``job``."""
    return f"{_PREFIX}{_safe_job(job)}-{pid}-{counter}"


def list_segments(pid: int | None = None) -> list[str]:
    """Names of rtxnet segments present in ``/dev/shm`` (of ``pid`` only, when given)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME_RE.match(name)
        if m and (pid is None or int(m.group(2)) == pid):
            out.append(name)
    return sorted(out)


def remove_segments(pid: int) -> list[str]:
    """Unlink every segment of process ``pid`` (which must have exited: its own mappings stay
    valid, but a peer could not map one again); returns the names removed. ``rtxnet-run`` calls
    it for each rank process that ends, so a rank killed or stopped by a signal mid-operation
    leaves nothing in ``/dev/shm`` (its segments can be a GiB each)."""
    removed = []
    for name in list_segments(pid):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def reap_dead_segments() -> list[str]:
    """Unlink segments whose owner pid is no longer alive; returns the names removed."""
    removed = []
    for name in list_segments():
        pid = int(_NAME_RE.match(name).group(2))  # type: ignore[union-attr]
        if pid == os.getpid() or psutil.pid_exists(pid):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    if removed:
        log.info("shm_reaped", segments=len(removed))
    return removed


class Segment:
    """A segment this process owns: created, written, and unlinked by it.

    Attributes:
        name: file name under ``/dev/shm``.
        nbytes: size in bytes.
        buf: writable ``memoryview`` of the whole mapping.
    """

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = nbytes
        self._path = os.path.join(SHM_DIR, name)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            self._mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | _populate(nbytes))
        except BaseException:
            os.close(fd)
            os.unlink(self._path)
            raise
        os.close(fd)
        self.buf = memoryview(self._mm)
        self.linked = True

    def unlink(self) -> None:
        """Remove the file; mappings (ours and peers') stay valid."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink and unmap. Unmapping is skipped while arrays still view the memory."""
        self.unlink()
        _close_map(self)


class PeerSegment:
    """A read-only mapping of a segment another process on this host owns."""

    def __init__(self, name: str, nbytes: int):
        if not _NAME_RE.match(name):
            raise ValueError(f"not an rtxnet segment name: {name!r}")
        self.name = name
        self.nbytes = nbytes
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"segment {name} has {size} bytes, peer announced {nbytes}")
            self._mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | _populate(nbytes),
                                 prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mm)

    def close(self) -> None:
        _close_map(self)


def _close_map(seg: Segment | PeerSegment) -> None:
    try:
        seg.buf.release()
        seg._mm.close()
    except BufferError:
        # numpy views of the mapping are still alive; the kernel unmaps when they are collected
        pass
