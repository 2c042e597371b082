"""Shared-memory segments for same-host payloads, with cleanup that survives crashes.

A segment is a file under ``/dev/shm`` mapped with ``mmap`` (no ``multiprocessing.shared_memory``,
so no resource tracker process). Its name embeds the owner's pid and a random part drawn once per
process (two ranks in containers that share ``/dev/shm`` but not their PID namespace can both be
pid 1: a tester's find, their names collided)::

    rtxnet-<job>-<pid>-<8 hex digits>-<counter>

Lifetime, so that nothing leaks even when a process is SIGKILLed:

1. the owner creates it, reserves its pages (``posix_fallocate``: a ``/dev/shm`` too small for it
   is an ``OSError`` here, where a sparse file was a SIGBUS at the first write past the room,
   Docker's 64 MiB default being the usual case), maps it (small ones populated at once, so the
   first collective does not pay page faults), and holds a shared ``flock`` on it;
2. peers map it by name when the owner announces it;
3. once every peer has mapped it the owner unlinks the file (:meth:`Segment.unlink`) and drops
   its lock; the memory lives on in the mappings and is freed by the kernel when the last one
   goes, crash or not;
4. a crash between 1 and 3 leaves a file nobody holds a lock on: :func:`reap_dead_segments`, run
   by every engine at start, removes it. The lock, not the pid, says whether the owner lives:
   a process in another PID namespace sees other pids (a reaper there removed live segments
   before their peers had mapped them, a tester's find).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets

import structlog

__all__ = ["SHM_DIR", "Segment", "PeerSegment", "segment_name", "reap_dead_segments", "list_segments",
           "remove_segments"]

log = structlog.get_logger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "rtxnet-"
_NAME_RE = re.compile(r"^rtxnet-([A-Za-z0-9_]{0,64})-(\d+)-([0-9a-f]{8})-(\d+)$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# Larger mappings are faulted in by their first use instead: populating 512 MiB at once held the
# event loop of the rank that made it for ~0.5 s (the copy that touches the pages runs off it).
_POPULATE_MAX = 32 << 20


def _populate(nbytes: int) -> int:
    return _POPULATE if nbytes <= _POPULATE_MAX else 0


def _safe_job(job: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", job)[:64]


_nonce: tuple[int, str] = (-1, "")


def _process_nonce() -> str:
    """8 random hex digits, drawn once per process (again after a fork)."""
    global _nonce
    if _nonce[0] != os.getpid():
        _nonce = (os.getpid(), secrets.token_hex(4))
    return _nonce[1]


def segment_name(job: str, pid: int, counter: int) -> str:
    """The file name of segment ``counter`` of process ``pid`` in ``job`` (with this process's
    random part)."""
    return f"{_PREFIX}{_safe_job(job)}-{pid}-{_process_nonce()}-{counter}"


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
    valid, but a peer could not map one again) that no process holds; returns the names removed.
    ``rtxnet-run`` calls it for each rank process that ends, so a rank killed or stopped by a
    signal mid-operation leaves nothing in ``/dev/shm`` (its segments can be a GiB each). A
    segment with that pid in its name held by a live process is another PID namespace's (a
    container sharing ``/dev/shm``) and stays (a tester's find: they were removed)."""
    return [name for name in list_segments(pid) if _unlink_unheld(name)]


def reap_dead_segments() -> list[str]:
    """Unlink segments no process holds (their owner's lock is gone: it died before unlinking
    them); returns the names removed. Works across PID namespaces that share ``/dev/shm``, where
    the pid in a name means nothing. (An owner that finds its new file reaped between creating
    and locking it makes another: see :class:`Segment`.)"""
    removed = [name for name in list_segments() if _unlink_unheld(name)]
    if removed:
        log.info("shm_reaped", segments=len(removed))
    return removed


def _unlink_unheld(name: str) -> bool:
    """Unlink segment ``name`` unless a process holds its lock; whether it was removed."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False           # gone meanwhile, or not ours to read
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False       # its owner holds it: alive
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


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
        fd = _create_locked(self._path)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            _reserve(fd, max(nbytes, 1))
            self._mm = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | _populate(nbytes))
        except BaseException:
            os.close(fd)
            os.unlink(self._path)
            raise
        self._fd: int | None = fd
        self.buf = memoryview(self._mm)
        self.linked = True

    @property
    def mapped(self) -> bool:
        """Whether this process still maps it (:meth:`close` skips the unmapping while arrays
        view the memory)."""
        return not self._mm.closed

    def unlink(self) -> None:
        """Remove the file and drop its lock; mappings (ours and peers') stay valid."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """Unlink and unmap. Unmapping is skipped while arrays still view the memory."""
        self.unlink()
        _close_map(self)


def _create_locked(path: str) -> int:
    """Create ``path`` (``O_EXCL``) and take a shared ``flock`` on it, held until the owner
    unlinks it; a reaper that took the file between the two (it was not locked yet) unlinked it,
    so the file is made again."""
    for _ in range(100):
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(errno.EAGAIN, f"{path} was removed as soon as it was made, 100 times")


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's pages now (tmpfs: zeroed pages charged to it).

    Raises:
        OSError: ``ENOSPC`` naming ``/dev/shm``'s free and total bytes when it has no room.
    """
    if not hasattr(os, "posix_fallocate"):     # not Linux: pages come at first touch
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        st = os.statvfs(SHM_DIR)
        raise OSError(errno.ENOSPC, f"{SHM_DIR} has no room for a segment of {nbytes} bytes "
                      f"({st.f_bavail * st.f_frsize} of {st.f_blocks * st.f_frsize} bytes free)") from None


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

    @property
    def mapped(self) -> bool:
        """Whether this process still maps it (see :meth:`Segment.mapped`)."""
        return not self._mm.closed

    def close(self) -> None:
        _close_map(self)


def _close_map(seg: Segment | PeerSegment) -> None:
    try:
        seg.buf.release()
        seg._mm.close()
    except BufferError:
        # numpy views of the mapping are still alive; the kernel unmaps when they are collected
        pass
