"""The coordinator's write-ahead journal: framed records, group commit, snapshot compaction.

The coordinator appends opaque ``bytes`` records (msgpack made by its caller) with
:meth:`Journal.append` and acknowledges nothing to a client before :meth:`Journal.flush` has
returned for it. ``flush`` is a group commit: one ``write`` + ``os.fsync`` in a worker thread
covers every record appended until that write started, so many concurrent clients share one
fsync while the event loop keeps serving. :meth:`Journal.write_snapshot` compacts: the caller's
state, which covers every record so far, is written atomically and the old segments are deleted.

On-disk layout (all integers little-endian)::

    DIR/snapshot.bin        one frame; payload = u64 covered generation G + snapshot bytes
    DIR/snapshot.bin.tmp    a snapshot being written; ignored and removed by open()
    DIR/journal-<g>.log     segment of generation g (decimal, zero-padded to 20 digits):
                            a sequence of frames, appended through one O_APPEND descriptor

    frame  = header (14 bytes) + payload
    header = u8 magic 0xA5 | u8 version | u32 payload length | u32 payload crc
             | u32 crc32(the first 10 header bytes)

The snapshot's frame is of version 1: its payload crc is ``crc32(payload)``. A segment's frames
are of version 2, chained: the payload crc is ``crc32(payload)`` continued from the crc of the
frame before it in the segment (zlib's running crc, ``crc32(payload, previous)``), the first
frame's from ``segment_chain_seed(g)``; so a whole valid frame removed, repeated or moved fails
the check of the frame after it (they replayed without a word before: a breaker's find), and one
copied from another segment fails too. Version-1 frames in a segment (written before the chain)
are still read; the chain goes on from their crc.

A segment begins with a link frame (version 3, chained like the others, not a record): its payload
is ``u64 g | u32 crc`` where ``crc`` is the payload crc of the snapshot the segment was started
after (0: none). Replay compares it with ``snapshot.bin``'s, so a snapshot from another journal
that covers the same generation (copied by hand) is refused, not replayed with this journal's
segment as one mixed state (a breaker's find). A segment without one (written before the link)
is read as before.

Generations: the snapshot that covers generation ``G`` holds the effect of every record in every
segment ``g <= G``. Replay reads the snapshot (``G = 0`` without one) and then the segments
``G+1, G+2, ...`` in order; segments ``g <= G`` are stale leftovers of an interrupted compaction
and are removed, never replayed, so a record is never applied twice. Compaction of the live
segment ``L`` runs in this order, and a crash between any two steps replays to the same state:

1. write and fsync every buffered record into ``journal-L.log``;
2. write ``snapshot.bin.tmp`` (covers ``L``), fsync it, rename it over ``snapshot.bin``, fsync
   the directory: the commit point (before it the old snapshot + segments ``<= L`` hold the same
   state, after it the new snapshot does);
3. create the empty ``journal-<L+1>.log``, fsync the directory, switch appends to it;
4. delete the segments ``<= L``, fsync the directory.

A torn final record (a kill or power cut during an append: header or payload cut short by EOF,
a payload CRC mismatch on the very last frame, or an all-zero tail) is dropped, logged as
``journal_torn_tail`` and truncated away; the bytes of a complete last frame failing its CRC
are kept first as ``torn-<generation>-<offset>.bin`` in the folder (a bit flipped in an
acknowledged record looks the same as a power cut during an append). Anything else that fails its checks raises
:class:`~transport.errors.JournalCorruptError` with the file and the byte offset of the bad frame;
the header's own CRC makes sure a corrupt length field is never mistaken for a torn tail.

Concurrency: use a :class:`Journal` from one thread (the event loop's); only its private worker
thread touches the file descriptor besides, under a lock. After a failed write or fsync the journal
refuses every further call with :class:`~transport.errors.JournalError` (after a failed fsync the
kernel may have dropped the dirty pages, so the only safe recovery is a restart and a replay).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import re
import stat
import struct
import threading
import time
import zlib
from pathlib import Path

import structlog

from transport.durable import fsync_dir
from transport.errors import JournalCorruptError, JournalError

__all__ = [
    "Journal",
    "holds_journal",
    "journal_in_use",
    "remove_journal",
    "MAX_RECORD_NBYTES",
    "MAX_SNAPSHOT_NBYTES",
    "FRAME_HEADER_NBYTES",
    "encode_frame",
    "encode_chained",
    "encode_link",
    "segment_chain_seed",
]

log = structlog.get_logger(__name__)

MAGIC = 0xA5
VERSION = 1          # the snapshot's frame (and segments written before the chain)
CHAINED_VERSION = 2  # segment frames, each crc chained to the frame before it
LINK_VERSION = 3     # a segment's first frame: the snapshot it follows (see the module doc)
_VERSIONS = (VERSION, CHAINED_VERSION, LINK_VERSION)
_LINK = struct.Struct("<QI")   # generation, snapshot payload crc
_HEADER = struct.Struct("<BBIII")
_HEADER_CRC_SPAN = 10  # magic, version, length, payload crc: what the header crc covers
FRAME_HEADER_NBYTES = _HEADER.size  # 14
MAX_RECORD_NBYTES = 64 * 1024 * 1024
_GENERATION = struct.Struct("<Q")
MAX_SNAPSHOT_NBYTES = 0xFFFFFFFF - _GENERATION.size  # the frame's u32 length field

SNAPSHOT_NAME = "snapshot.bin"
SNAPSHOT_TMP_NAME = "snapshot.bin.tmp"
LOCK_NAME = "LOCK"   # held with lockf while a daemon has the journal open
RECREATE_ATTEMPTS = 20   # tries of Journal.recreate while the folder keeps being removed under it
_SEGMENT_RE = re.compile(r"^journal-(\d+)\.log$")


def encode_frame(payload: bytes | bytearray | memoryview) -> bytes:
    """Return ``payload`` framed: 14-byte header (magic, version, length, CRCs) + payload.

    Args:
        payload: any bytes-like object of at most ``2**32 - 1`` bytes.

    Raises:
        JournalError: the payload does not fit the u32 length field.
    """
    return _frame_header(VERSION, payload, zlib.crc32(payload)) + bytes(payload)


def _frame_header(version: int, payload: bytes | bytearray | memoryview, crc: int) -> bytes:
    """The 14-byte header of a frame of ``version`` holding ``payload`` of crc ``crc``.

    Raises:
        JournalError: the payload does not fit the u32 length field.
    """
    nbytes = len(payload)
    if nbytes > 0xFFFFFFFF:
        raise JournalError(f"frame payload of {nbytes} bytes exceeds the u32 length field")
    head = struct.pack("<BBII", MAGIC, version, nbytes, crc)
    return head + struct.pack("<I", zlib.crc32(head))


def segment_chain_seed(generation: int) -> int:
    """The crc the first frame of segment ``generation`` chains from (see the module doc)."""
    return zlib.crc32(b"rtxnet-journal-segment:" + struct.pack("<Q", generation))


def encode_chained(payload: bytes | bytearray | memoryview, previous: int) -> tuple[bytes, int]:
    """Frame ``payload`` as a segment frame after a frame of crc ``previous`` (or after
    :func:`segment_chain_seed` for a segment's first); returns the frame and its crc, the next
    frame's ``previous``.

    Raises:
        JournalError: the payload does not fit the u32 length field.
    """
    crc = zlib.crc32(payload, previous)
    return _frame_header(CHAINED_VERSION, payload, crc) + bytes(payload), crc


def encode_link(generation: int, snapshot_crc: int) -> tuple[bytes, int]:
    """The link frame that begins segment ``generation``, started after a snapshot of payload
    crc ``snapshot_crc`` (0: none), and its crc, the next frame's ``previous``."""
    payload = _LINK.pack(generation, snapshot_crc)
    crc = zlib.crc32(payload, segment_chain_seed(generation))
    return _frame_header(LINK_VERSION, payload, crc) + payload, crc


def _is_journal_file(name: str) -> bool:
    return bool(_SEGMENT_RE.match(name)) or name in (SNAPSHOT_NAME, SNAPSHOT_TMP_NAME, LOCK_NAME)


def holds_journal(path: str | os.PathLike) -> bool:
    """Whether folder ``path`` holds a journal's segment or snapshot (False when it is missing)."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(_SEGMENT_RE.match(n) or n in (SNAPSHOT_NAME, SNAPSHOT_TMP_NAME) for n in names)


def journal_in_use(path: str | os.PathLike) -> bool:
    """Whether a process holds the journal in folder ``path`` open (its exclusive ``lockf`` on
    ``LOCK``, :meth:`Journal._lock_directory`); False when the folder or its lock file is missing.
    An unreadable lock file counts as in use. The probe's own lock is released before it returns."""
    import fcntl

    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def remove_journal(path: str | os.PathLike, *, keep_folder: bool = False) -> list[str]:
    """Delete the journal in folder ``path``: its segments, snapshot and lock file, then the folder
    itself if nothing else is in it (and not ``keep_folder``). Files that are not the journal's
    are never touched. Only for a journal no daemon holds (after it closed).

    Returns:
        The names left in the folder (sorted; empty when it is gone or empty).
    """
    folder = Path(path)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    for name in names:
        if _is_journal_file(name):
            try:
                os.unlink(folder / name)
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    left = sorted(os.listdir(folder))
    if not left and not keep_folder:
        try:
            folder.rmdir()
        except OSError:
            pass
    return left


def _check_regular(path: Path) -> os.stat_result:
    """Refuse a FIFO, socket or device where a journal file should be: reading a FIFO would
    block the daemon's start for ever. (A folder or a dangling link fails its read, naming it.)
    Returns ``path``'s stat.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        JournalError: it is no regular file (names it).
    """
    st = path.stat()
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise JournalError(f"journal file {path} is not a regular file (a FIFO, socket or "
                           f"device): move it aside")
    return st


def _segment_name(generation: int) -> str:
    return f"journal-{generation:020d}.log"


class _Scan:
    """What reading one segment found: good records, where they end, and a torn tail if any."""

    __slots__ = ("records", "valid_nbytes", "torn_offset", "torn_nbytes", "torn_reason", "chain", "link")

    def __init__(self) -> None:
        self.records: list[bytes] = []
        self.link: tuple[int, int] | None = None   # the segment's link frame: (generation, crc)
        self.chain: int | None = None   # the crc the next frame chains from
        self.valid_nbytes = 0
        self.torn_offset: int | None = None
        self.torn_nbytes = 0
        self.torn_reason = ""


def _scan_frames(data: bytes, path: str, max_payload_nbytes: int, chain: int | None = None) -> _Scan:
    """Split ``data`` into frames; classify a bad final frame as torn, any other as corrupt.
    ``chain``: a segment's :func:`segment_chain_seed` (its version-2 frames are checked as a
    chain); None for the snapshot (version 1 only).

    Raises:
        JournalCorruptError: a frame before the tail fails a check (``exc.offset`` is its start).
    """
    scan = _Scan()
    versions = _VERSIONS if chain is not None else (VERSION,)
    view = memoryview(data)
    total = len(data)
    offset = 0
    while offset < total:
        remaining = total - offset
        torn_reason = ""
        if remaining < FRAME_HEADER_NBYTES:
            head = view[offset:].tobytes()
            if head.count(0) == remaining:
                torn_reason = "zero_filled_tail"
            elif head[0] == MAGIC and (remaining < 2 or head[1] in versions):
                torn_reason = "header_cut_short"   # an append's first bytes: the marker
            else:
                # not the start of a record (a tester's find: "hello" after the last record was
                # dropped as a torn tail)
                raise JournalCorruptError(
                    f"journal {path}: {remaining} bytes after the last record at offset {offset} "
                    f"are not the start of a record ({head[:8].hex()})",
                    path=path,
                    offset=offset,
                )
        else:
            magic, version, length, crc, header_crc = _HEADER.unpack_from(view, offset)
            header_ok = (
                magic == MAGIC
                and version in versions
                and zlib.crc32(view[offset : offset + _HEADER_CRC_SPAN]) == header_crc
            )
            if not header_ok:
                # A power cut can leave a zero-filled tail (size updated, data blocks not);
                # anything else in a header is damage, not an interrupted append.
                if view[offset:].tobytes().count(0) == remaining:
                    torn_reason = "zero_filled_tail"
                elif magic == MAGIC and version not in versions:
                    raise JournalCorruptError(
                        f"journal {path}: the record at offset {offset} is of journal format "
                        f"version {version}; this coordinator reads versions "
                        f"{'/'.join(map(str, versions))} (written by "
                        f"another version of rtxnet: run that one, or move the folder aside)",
                        path=path,
                        offset=offset,
                    )
                else:
                    raise JournalCorruptError(
                        f"journal {path}: bad record header at offset {offset} "
                        f"(magic={magic:#04x}, version={version}, header crc mismatch="
                        f"{zlib.crc32(view[offset : offset + _HEADER_CRC_SPAN]) != header_crc})",
                        path=path,
                        offset=offset,
                    )
            elif length > max_payload_nbytes and not (version == LINK_VERSION
                                                      and length == _LINK.size):
                # (a link is not a record: a journal whose record limit is under its 12 bytes
                # wrote one and then refused its own segment, a re-verifier's find)
                raise JournalCorruptError(
                    f"journal {path}: record at offset {offset} claims {length} bytes, "
                    f"over the limit of {max_payload_nbytes}",
                    path=path,
                    offset=offset,
                )
            else:
                end = offset + FRAME_HEADER_NBYTES + length
                if end > total:
                    torn_reason = "payload_cut_short"
                else:
                    payload = view[offset + FRAME_HEADER_NBYTES : end]
                    if version == LINK_VERSION and (offset != 0 or length != _LINK.size):
                        raise JournalCorruptError(
                            f"journal {path}: a segment's link record at offset {offset} "
                            f"({length} bytes): only a segment's first record is one, of "
                            f"{_LINK.size} bytes",
                            path=path,
                            offset=offset,
                        )
                    chained = version in (CHAINED_VERSION, LINK_VERSION)
                    expected = zlib.crc32(payload, chain) if chained else zlib.crc32(payload)
                    if expected != crc:
                        if end != total:
                            why = (" (or does not follow the record before it: a record removed, "
                                   "repeated or moved)" if chained else "")
                            raise JournalCorruptError(
                                f"journal {path}: record at offset {offset} "
                                f"({length} bytes) fails its CRC{why}",
                                path=path,
                                offset=offset,
                            )
                        torn_reason = "crc_mismatch_last_record"
                    else:
                        if version == LINK_VERSION:
                            scan.link = _LINK.unpack(payload)
                        else:
                            scan.records.append(payload.tobytes())
                        if chain is not None:
                            chain = crc
                        offset = end
                        continue
        scan.torn_offset = offset
        scan.torn_nbytes = remaining
        scan.torn_reason = torn_reason
        break
    scan.valid_nbytes = offset
    scan.chain = chain
    return scan


def _write_file_durably(path: Path, data: bytes, fsync: bool) -> None:
    """Write ``data`` to a new file ``path`` (replacing one of that name), fsynced with its
    folder when ``fsync``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if fsync:
        fsync_dir(path.parent)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class Journal:
    """Append-only write-ahead journal with group commit and snapshot compaction.

    Typical use in the coordinator::

        journal = Journal(path)
        snapshot, records = journal.open()        # replay
        journal.append(msgpack.packb(change))     # buffered, not durable
        await journal.flush()                     # durable: now acknowledge
        if journal.bytes_since_snapshot > limit:
            journal.write_snapshot(msgpack.packb(state))

    Args:
        directory: the journal's directory; created by :meth:`open` if missing.
        fsync: ``False`` skips every ``fsync`` (tests and benchmarks only: nothing is durable
            against a power cut, though still against a process kill).
        max_record_nbytes: largest record :meth:`append` accepts, in bytes (default 64 MiB).

    Attributes:
        fsync_count: fsyncs of segment data done so far (directory fsyncs not counted).
        commit_count: write batches issued so far (one per group commit, with or without fsync).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        fsync: bool = True,
        max_record_nbytes: int = MAX_RECORD_NBYTES,
    ) -> None:
        if not 0 < max_record_nbytes <= MAX_RECORD_NBYTES:
            raise JournalError(
                f"max_record_nbytes({max_record_nbytes}) must be in 1..{MAX_RECORD_NBYTES}"
            )
        self._dir = Path(directory)
        self._fsync = fsync
        self._max_record_nbytes = max_record_nbytes
        self._state = "new"  # new -> open -> closed
        self._failure: JournalError | None = None
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._generation = 0
        # Loop-thread side: records are framed into _pending, sealed into batches that the
        # writer (worker thread or a blocking call) drains in order under _io_lock.
        self._pending = bytearray()
        self._chain = 0   # the crc the next appended frame chains from (set by open)
        self._sealed: collections.deque[tuple[int, bytearray]] = collections.deque()
        self._appended_seq = 0
        self._durable_seq = 0
        # Writer side, guarded by _io_lock.
        self._io_lock = threading.Lock()
        self._written_seq = 0
        self._synced_seq = 0
        self._inflight: asyncio.Task[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._records_since_snapshot = 0
        self._bytes_since_snapshot = 0
        self._snapshot_ino: int | None = None   # the snapshot file's inode, once there is one
        self._snapshot_crc = 0   # its payload crc (0: none), which a new segment's link names
        self.fsync_count = 0
        self.commit_count = 0

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path:
        """The journal's directory."""
        return self._dir

    @property
    def generation(self) -> int:
        """Generation of the live segment (``journal-<generation>.log``); 0 before :meth:`open`."""
        return self._generation

    @property
    def segment_path(self) -> Path:
        """Path of the live segment."""
        return self._dir / _segment_name(self._generation)

    @property
    def snapshot_path(self) -> Path:
        """Path of the snapshot file (it may not exist)."""
        return self._dir / SNAPSHOT_NAME

    @property
    def records_since_snapshot(self) -> int:
        """Records replayed or appended since the latest snapshot (all of them without one)."""
        return self._records_since_snapshot

    @property
    def bytes_since_snapshot(self) -> int:
        """Framed bytes (headers included) replayed or appended since the latest snapshot."""
        return self._bytes_since_snapshot

    @property
    def pending_records(self) -> int:
        """Records appended but not yet known durable."""
        return self._appended_seq - self._durable_seq

    # ------------------------------------------------------------------ open / replay

    def open(self) -> tuple[bytes | None, list[bytes]]:
        """Replay the journal and make it ready for appends.

        Creates the directory if missing, reads the latest snapshot (or ``None``) and every
        record appended after it, in order. A torn final record is dropped, logged
        (``journal_torn_tail`` with ``path``, ``offset``, ``nbytes``) and truncated away, so
        appends continue cleanly. Stale segments and a half-written snapshot left by an
        interrupted :meth:`write_snapshot` are removed. When this raises, nothing on disk has
        been changed.

        Returns:
            ``(snapshot, records)``: the snapshot bytes given to the last completed
            :meth:`write_snapshot` (``None`` if there was none) and the records appended after it.

        Raises:
            JournalCorruptError: a bad record before the tail of the last segment, a corrupt
                snapshot, or a missing segment; ``exc.path`` and ``exc.offset`` name the place.
            JournalError: the journal is already open or closed, or the directory cannot be
                read or written (the ``OSError`` is chained).
        """
        if self._state != "new":
            raise JournalError(f"journal {self._dir} is {self._state}; open() runs once")
        t0 = time.perf_counter()
        if self._dir.exists() and not self._dir.is_dir():
            raise JournalError(f"journal {self._dir} is not a folder: the journal is a folder "
                               "of segments and snapshots; give a new or existing folder")
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._lock_directory()
            snapshot, covered = self._read_snapshot()
            snapshot_crc = self._snapshot_crc
            segments = self._list_segments()
            if snapshot is not None and (segments[-1][0] < covered if segments else covered > 0):
                # write_snapshot keeps the segment the snapshot covers until the next one exists:
                # segments that all end before it mean a snapshot from another journal (or one
                # whose newer segments were deleted); replaying would drop the segments' records.
                # (A snapshot covering generation 0 is recreate's, in a folder made afresh: with
                # no segment yet it is the whole state.)
                newest = segments[-1][0] if segments else None
                raise JournalCorruptError(
                    f"journal {self._dir}: {self.snapshot_path} covers generation {covered} but "
                    f"the newest segment is "
                    f"{'missing' if newest is None else f'of generation {newest}'} (a snapshot "
                    f"from another journal, or segments deleted); nothing was changed: move the "
                    f"snapshot or the folder aside",
                    path=str(self.snapshot_path),
                    offset=0,
                )
            stale = [(g, p) for g, p in segments if g <= covered]
            live = [(g, p) for g, p in segments if g > covered]
            expected = covered + 1
            for generation, _ in live:
                if generation != expected:
                    missing = str(self._dir / _segment_name(expected))
                    raise JournalCorruptError(
                        f"journal {self._dir}: segment {missing} is missing "
                        f"(snapshot covers generation {covered}, next found is {generation})",
                        path=missing,
                        offset=0,
                    )
                expected += 1
            records: list[bytes] = []
            nbytes = 0
            torn: tuple[Path, _Scan] | None = None
            chain = None
            for index, (generation, path) in enumerate(live):
                scan = _scan_frames(path.read_bytes(), str(path), self._max_record_nbytes,
                                    segment_chain_seed(generation))
                chain = scan.chain
                if index == 0 and scan.link is not None and scan.link != (generation, snapshot_crc):
                    # (later segments follow snapshots compacted away since: not checked)
                    raise JournalCorruptError(
                        f"journal {path} was started after a snapshot of crc "
                        f"{scan.link[1]:#010x}, but {self.snapshot_path} "
                        + (f"is of crc {snapshot_crc:#010x}" if snapshot is not None else "is missing")
                        + " (a snapshot from another journal, or an older one put back); nothing "
                        "was changed: move the snapshot or the folder aside",
                        path=str(path),
                        offset=0,
                    )
                if scan.torn_offset is not None:
                    if index != len(live) - 1:
                        raise JournalCorruptError(
                            f"journal {path}: record at offset {scan.torn_offset} is cut short "
                            f"({scan.torn_reason}) but later segments follow",
                            path=str(path),
                            offset=scan.torn_offset,
                        )
                    torn = (path, scan)
                records.extend(scan.records)
                nbytes += scan.valid_nbytes - (FRAME_HEADER_NBYTES + _LINK.size if scan.link else 0)

            # Everything checked: from here on the directory is repaired in place.
            if torn is not None:
                path, scan = torn
                kept = None
                if scan.torn_reason == "crc_mismatch_last_record":
                    # A complete record failing its CRC: a power cut during its append, or a bit
                    # flipped in a record acknowledged long ago, which look the same; its bytes
                    # are kept beside the journal before the tail is dropped (a tester's find:
                    # the evidence was truncated away with only a log line)
                    # (never over an earlier one: after the truncation the next append lands at
                    # the same offset, and a crash loop tore it there again: a tester's find)
                    kept = self._dir / f"torn-{live[-1][0]}-{scan.torn_offset}.bin"
                    n = 1
                    while kept.exists():
                        n += 1
                        kept = self._dir / f"torn-{live[-1][0]}-{scan.torn_offset}-{n}.bin"
                    _write_file_durably(kept, path.read_bytes()[scan.torn_offset:], self._fsync)
                log.warning(
                    "journal_torn_tail",
                    path=str(path),
                    offset=scan.torn_offset,
                    nbytes=scan.torn_nbytes,
                    reason=scan.torn_reason,
                    **({"kept": str(kept)} if kept else {}),
                )
                with open(path, "r+b") as f:
                    f.truncate(scan.valid_nbytes)
                    if self._fsync:
                        os.fsync(f.fileno())
            tmp = self._dir / SNAPSHOT_TMP_NAME
            changed_dir = False
            if tmp.exists():
                tmp.unlink()
                changed_dir = True
            for generation, path in stale:
                log.info("journal_stale_segment_removed", path=str(path), generation=generation)
                path.unlink()
                changed_dir = True
            if live:
                self._generation = live[-1][0]
                self._chain = chain if chain is not None else segment_chain_seed(self._generation)
                self._fd = os.open(self.segment_path, os.O_WRONLY | os.O_APPEND)
                if len(live) == 1 and (torn[1].valid_nbytes if torn else live[-1][1].stat().st_size) == 0:
                    self._write_link(snapshot_crc)   # created, then the daemon died: begin it now
            else:
                self._generation = covered + 1
                self._fd = os.open(
                    self.segment_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644
                )
                self._write_link(snapshot_crc)
                changed_dir = True
            if changed_dir and self._fsync:
                fsync_dir(self._dir)
        except OSError as exc:
            raise JournalError(f"journal {self._dir}: cannot open: {exc}") from exc
        self._state = "open"
        self._records_since_snapshot = len(records)
        self._bytes_since_snapshot = nbytes
        log.info(
            "journal_opened",
            path=str(self._dir),
            generation=self._generation,
            snapshot_nbytes=None if snapshot is None else len(snapshot),
            records=len(records),
            nbytes=nbytes,
            duration_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )
        return snapshot, records

    def _read_snapshot(self) -> tuple[bytes | None, int]:
        path = self._dir / SNAPSHOT_NAME
        try:
            ino = _check_regular(path).st_ino
            data = path.read_bytes()
            self._snapshot_ino = ino
        except FileNotFoundError:
            return None, 0
        spath = str(path)
        scan = _scan_frames(data, spath, 0xFFFFFFFF)
        if scan.torn_offset is not None or len(scan.records) != 1:
            offset = scan.torn_offset if scan.torn_offset is not None else 0
            raise JournalCorruptError(
                f"snapshot {spath} is corrupt at offset {offset} "
                f"({scan.torn_reason or f'{len(scan.records)} frames, expected 1'})",
                path=spath,
                offset=offset,
            )
        payload = scan.records[0]
        if len(payload) < _GENERATION.size:
            raise JournalCorruptError(
                f"snapshot {spath} is corrupt: payload of {len(payload)} bytes has no generation",
                path=spath,
                offset=0,
            )
        (covered,) = _GENERATION.unpack_from(payload)
        self._snapshot_crc = zlib.crc32(payload)
        return payload[_GENERATION.size :], covered

    def _write_link(self, snapshot_crc: int) -> None:
        """Begin the live segment (empty, just made) with its link frame, written and fsynced
        now (the caller fsyncs the folder); the next record chains from it."""
        frame, self._chain = encode_link(self._generation, snapshot_crc)
        _write_all(self._fd, frame)
        if self._fsync:
            os.fsync(self._fd)

    def _list_segments(self) -> list[tuple[int, Path]]:
        found = []
        for entry in os.scandir(self._dir):
            m = _SEGMENT_RE.match(entry.name)
            if m is not None:
                _check_regular(Path(entry.path))
                found.append((int(m.group(1)), Path(entry.path)))
        found.sort()
        return found

    # ------------------------------------------------------------------ append / commit

    def append(self, record: bytes) -> None:
        """Frame (length + CRC32) and buffer ``record``; it is not durable until a flush.

        Args:
            record: an opaque bytes-like payload, at most ``max_record_nbytes`` (64 MiB).

        Raises:
            JournalError: the record is too large or not bytes-like, the journal is not open,
                or an earlier write failed.
        """
        self._check_usable()
        if not isinstance(record, bytes | bytearray | memoryview):
            raise JournalError(f"record must be bytes-like, got {type(record).__name__}")
        nbytes = len(record)
        if nbytes > self._max_record_nbytes:
            raise JournalError(
                f"record of {nbytes} bytes exceeds max_record_nbytes({self._max_record_nbytes})"
            )
        crc = zlib.crc32(record, self._chain)     # (encode_chained, without copying the record)
        self._pending += _frame_header(CHAINED_VERSION, record, crc)
        self._pending += record
        self._chain = crc
        self._appended_seq += 1
        self._records_since_snapshot += 1
        self._bytes_since_snapshot += FRAME_HEADER_NBYTES + nbytes

    async def flush(self) -> None:
        """Group commit: return once every record appended before this call is durable.

        The write and ``os.fsync`` run in the journal's worker thread, so the event loop keeps
        serving. While one commit runs, records appended meanwhile accumulate, and the next
        commit covers all of them for every caller waiting: concurrent callers share one fsync.
        Cancelling a caller does not cancel the commit it was waiting on.

        Raises:
            JournalError: the journal is not open, or the write or fsync failed (the journal
                then refuses every further call; restart and replay).
        """
        self._check_usable()
        target = self._appended_seq
        while self._durable_seq < target:
            self._check_usable()
            task = self._inflight
            if task is None or task.done():
                task = asyncio.get_running_loop().create_task(self._commit())
                task.add_done_callback(self._commit_done)
                self._inflight = task
            await asyncio.shield(task)

    async def _commit(self) -> None:
        if self._state != "open":
            return  # close() drained everything; waiters re-check and report
        self._seal()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="journal"
            )
        loop = asyncio.get_running_loop()
        synced = await loop.run_in_executor(self._executor, self._write_sealed)
        self._durable_seq = max(self._durable_seq, synced)

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        if self._inflight is task:
            self._inflight = None
        if not task.cancelled():
            task.exception()  # retrieved here, so a commit nobody awaits any more never warns

    def flush_sync(self) -> None:
        """Blocking :meth:`flush`: write and fsync every appended record in the calling thread.

        Raises:
            JournalError: as :meth:`flush`.
        """
        self._check_usable()
        self._seal()
        synced = self._write_sealed()
        self._durable_seq = max(self._durable_seq, synced)

    def _seal(self) -> None:
        """Move the pending frames into the writer's queue (loop thread only)."""
        if self._pending:
            self._sealed.append((self._appended_seq, self._pending))
            self._pending = bytearray()

    def _write_sealed(self) -> int:
        """Write and fsync every sealed batch in order; return the sequence now durable."""
        with self._io_lock:
            return self._write_sealed_locked()

    def _write_sealed_locked(self) -> int:
        self._raise_if_failed()
        try:
            wrote = False
            while self._sealed:
                end, data = self._sealed.popleft()
                if self._fd is None:
                    raise JournalError(f"journal {self._dir} is closed")
                _write_all(self._fd, data)
                self._written_seq = end
                wrote = True
            if wrote:
                self.commit_count += 1
            if self._written_seq > self._synced_seq:
                if self._fsync:
                    os.fsync(self._fd)  # type: ignore[arg-type]
                    self.fsync_count += 1
                self._synced_seq = self._written_seq
            return self._synced_seq
        except OSError as exc:
            self._failure = JournalError(
                f"journal {self.segment_path}: write or fsync failed: {exc}; "
                "restart the coordinator to replay"
            )
            log.error("journal_commit_failed", path=str(self.segment_path), error=str(exc))
            raise self._failure from exc

    # ------------------------------------------------------------------ compaction

    def write_snapshot(self, snapshot: bytes) -> None:
        """Compact: durably store ``snapshot`` as covering every record appended so far.

        Records still buffered are written and fsynced to the live segment first (the caller
        normally has flushed already). Then the snapshot is written to a temporary file,
        fsynced, renamed over ``snapshot.bin`` and the directory fsynced; a new empty segment is
        started and the older segments deleted. A crash at any point leaves a state that
        :meth:`open` replays to the same result. Blocks the calling thread for a few fsyncs.

        Args:
            snapshot: opaque bytes-like state, at most ``MAX_SNAPSHOT_NBYTES`` (about 4 GiB).

        Raises:
            JournalError: the snapshot is too large, the journal is not open, or a file
                operation failed. A failure before the rename leaves the journal usable and the
                old snapshot in place; a failure after it makes the journal refuse further calls
                (the new snapshot is durable; restart and replay).
        """
        self._check_usable()
        nbytes = len(snapshot)
        if nbytes > MAX_SNAPSHOT_NBYTES:
            raise JournalError(
                f"snapshot of {nbytes} bytes exceeds MAX_SNAPSHOT_NBYTES({MAX_SNAPSHOT_NBYTES})"
            )
        t0 = time.perf_counter()
        self._seal()
        with self._io_lock:
            synced = self._write_sealed_locked()
            covered = self._generation
            compacted_records = self._records_since_snapshot
            self._write_snapshot_file(snapshot, covered)
            # The new snapshot is the commit point; any failure from here on poisons the journal.
            try:
                new_generation = covered + 1
                new_path = self._dir / _segment_name(new_generation)
                new_fd = os.open(
                    new_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644
                )
                if self._fsync:
                    fsync_dir(self._dir)
                old_fd, self._fd = self._fd, new_fd
                self._generation = new_generation
                self._write_link(self._snapshot_crc)
                if old_fd is not None:
                    os.close(old_fd)
                for generation, path in self._list_segments():
                    if generation <= covered:
                        path.unlink()
                if self._fsync:
                    fsync_dir(self._dir)
            except OSError as exc:
                self._failure = JournalError(
                    f"journal {self._dir}: compaction failed after the snapshot was stored: "
                    f"{exc}; restart the coordinator to replay"
                )
                log.error("journal_compaction_failed", path=str(self._dir), error=str(exc))
                raise self._failure from exc
        self._durable_seq = max(self._durable_seq, synced)
        self._records_since_snapshot = 0
        self._bytes_since_snapshot = 0
        log.info(
            "journal_snapshot_written",
            path=str(self.snapshot_path),
            covered_generation=covered,
            snapshot_nbytes=nbytes,
            records_compacted=compacted_records,
            duration_ms=round((time.perf_counter() - t0) * 1e3, 3),
        )

    def removed(self) -> bool:
        """Whether the live segment or the lock file is no longer linked in the file system, or
        the snapshot is gone or another file (or one appeared where there was none, which a
        restart would refuse, a re-verifier's find): the folder (or those files) removed while the
        daemon runs (a cleaner of ``$TMPDIR``, a hand's ``rm -rf``). Appends would then go on
        to a file no restart can read (a breaker's find: 1,800 writes acknowledged after an
        ``rm -rf``, none replayed), a restart would refuse a journal without its snapshot, and a
        second daemon could lock the path. Two ``fstat`` and one ``stat``."""
        if self._state != "open" or self._fd is None:
            return False
        try:
            if os.fstat(self._fd).st_nlink == 0 or (
                    self._lock_fd is not None and os.fstat(self._lock_fd).st_nlink == 0):
                return True
        except OSError:
            return False
        if self._snapshot_ino is None:   # none yet: one that appears is another's (a copy)
            return os.path.lexists(self._dir / SNAPSHOT_NAME)
        try:
            return os.stat(self._dir / SNAPSHOT_NAME).st_ino != self._snapshot_ino
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def recreate(self, snapshot: bytes) -> None:
        """After :meth:`removed`: make the folder again (and its parents), lock it again when its
        lock file went, and store ``snapshot`` there as :meth:`write_snapshot` does, with a new
        live segment, so what the daemon holds is on disk again.

        Raises:
            JournalError: the folder cannot be made, another process locked the path
                meanwhile (names its pid), or as :meth:`write_snapshot`.
        """
        self._check_usable()
        for attempt in range(RECREATE_ATTEMPTS):
            try:
                self._recreate_once(snapshot)
            except JournalError:
                # removed again while it was being made (a cleaner's second pass, a second rm):
                # every file it wrote is gone with the folder, so nothing half-made is left to
                # stand for the state, and it is made afresh (before, the first compaction step
                # that found the folder gone poisoned the journal, and the daemon exited 3 with
                # nothing on disk: a re-verifier's find)
                if attempt + 1 == RECREATE_ATTEMPTS or (self._dir.is_dir() and not self.removed()):
                    raise
                self._failure = None
                continue
            if not self.removed():
                return
        raise JournalError(f"journal {self._dir}: removed again each of "
                           f"{RECREATE_ATTEMPTS} times it was made")

    def _recreate_once(self, snapshot: bytes) -> None:
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"journal {self._dir}: cannot make the folder again: {exc}") from exc
        old_lock = self._lock_fd
        if old_lock is not None and os.fstat(old_lock).st_nlink == 0:
            try:
                self._lock_directory()     # the new LOCK file; JournalError leaves the old one held
            except OSError as exc:         # (the folder gone again before its LOCK was made)
                raise JournalError(f"journal {self._dir}: cannot lock the folder again: {exc}") from exc
            os.close(old_lock)
        try:
            no_segment = not self._list_segments()
        except OSError as exc:
            raise JournalError(f"journal {self._dir}: cannot list the folder again: {exc}") from exc
        if no_segment:
            # a folder made afresh: its snapshot covers generation 0 and the live segment is 1,
            # so a daemon killed between the snapshot's rename and the segment's creation leaves
            # the one shape open() takes for complete without any segment (a snapshot covering
            # a later generation with none is another journal's, or its segments deleted)
            self._generation = 0
        self.write_snapshot(snapshot)
        if self._fsync:
            try:
                fsync_dir(self._dir.parent)
            except OSError as exc:
                raise JournalError(f"journal {self._dir}: fsync of its parent folder failed: {exc}") from exc

    def _write_snapshot_file(self, snapshot: bytes, covered: int) -> None:
        """Steps up to the commit point; on failure remove the temp file and leave all as was."""
        tmp = self._dir / SNAPSHOT_TMP_NAME
        try:
            payload = _GENERATION.pack(covered) + bytes(snapshot)
            frame = encode_frame(payload)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, frame)
                if self._fsync:
                    os.fsync(fd)
                ino = os.fstat(fd).st_ino   # (the rename keeps it)
            finally:
                os.close(fd)
            os.replace(tmp, self._dir / SNAPSHOT_NAME)
            self._snapshot_ino, self._snapshot_crc = ino, zlib.crc32(payload)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise JournalError(f"journal {self._dir}: cannot write snapshot: {exc}") from exc
        try:
            if self._fsync:
                fsync_dir(self._dir)
        except OSError as exc:
            # The rename may or may not be durable: either outcome replays the same, but the
            # journal cannot tell which, so it stops here.
            self._failure = JournalError(
                f"journal {self._dir}: fsync of the directory after the snapshot failed: {exc}"
            )
            raise self._failure from exc

    # ------------------------------------------------------------------ close

    def _lock_directory(self) -> None:
        """Take an exclusive POSIX lock (``lockf``) on ``DIR/LOCK`` for as long as the journal is
        open: two daemons appending to one journal would corrupt it. (A record lock is held per
        process, so a process may reopen its own journal, as crash-recovery tests do.)

        Raises:
            JournalError: another process holds it (names its pid).
        """
        import fcntl

        fd = os.open(self._dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalError(f"journal {self._dir} is in use by another process (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        """Write and fsync any buffered records, then release the file and the worker thread.

        Idempotent. After a failed write nothing more is written; the descriptor is released.

        Raises:
            JournalError: the final write or fsync failed (resources are released anyway).
        """
        if self._state == "closed":
            return
        was_open = self._state == "open"
        self._state = "closed"
        try:
            if was_open and self._failure is None:
                self._seal()
                synced = self._write_sealed()
                self._durable_seq = max(self._durable_seq, synced)
        finally:
            with self._io_lock:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = None
            log.info("journal_closed", path=str(self._dir), generation=self._generation)

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def failed(self) -> bool:
        """Whether a write, fsync or compaction failed past the point where the journal stays
        usable (every call raises ``JournalError`` from then on; restart and replay)."""
        return self._failure is not None

    def _check_usable(self) -> None:
        if self._state != "open":
            raise JournalError(
                f"journal {self._dir} is {self._state}"
                + ("; call open() first" if self._state == "new" else "")
            )
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        # A fresh exception per call: re-raising one object would pile up tracebacks.
        if self._failure is not None:
            raise JournalError(str(self._failure)) from self._failure
