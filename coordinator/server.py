"""The coordinator daemon: a thin shell of sockets and journal around :func:`coordinator.state.step`.

One asyncio task owns everything (the actor): it takes every event that arrived (requests,
disconnects, a clock tick), runs them through ``step``, appends the resulting records to the
write-ahead journal, makes them durable with one fsync for the whole batch (group commit), and only
then sends the answers and pushes. While the fsync runs, new events queue up and form the next
batch.
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import time
from pathlib import Path

import structlog

from transport import wire
from transport.channel import HANDSHAKE_IVL_MS, ControlServer, Disconnected, Inbound
from transport.codec import Limits, decode, encode
from transport.errors import JournalError, ProtocolError
from transport.logbudget import LogBudget

from .journal import Journal
from .state import (
    Disconnect,
    Record,
    Request,
    Send,
    State,
    StatusQuery,
    Tick,
    answer_status,
    apply_record,
    restore,
    snapshot,
    step,
)

__all__ = ["Coordinator"]

log = structlog.get_logger(__name__)

COMPACT_MIN_NBYTES = 64 * 1024 * 1024   # journal bytes since the last snapshot that compact it
_STALL_S = 0.25   # a tick this much later than due means the daemon itself did not run
REMOVAL_CHECK_S = 1.0   # how often an idle daemon looks for a removed journal (Journal.removed)
MAX_BATCH_EVENTS = 2048   # events handled (and answered after one fsync) together
# Open files: counted every FD_CHECK_S (listing /proc/self/fd, a millisecond for thousands), a
# warning at FD_WARN_FRACTION of the soft limit, at most once every FD_WARN_EVERY_S. At the
# limit the daemon accepts no connection (ZeroMQ retries the accept in a loop, a core at 95%)
# and answers nobody new; it logged nothing (a breaker's find).
FD_CHECK_S = 1.0
FD_WARN_FRACTION = 0.9
FD_WARN_EVERY_S = 10.0

# What the daemon wrote itself (checksummed) is read back with room for all it may have written:
# a record nests a request's values a few levels deeper than the request did, and a snapshot
# holds maps of every job, key and finished job id (a snapshot of a store of 70,000 keys could
# not be read back under the wire's 65,536 pairs a map: a tester's find). The depth is msgpack's
# packer's own limit (511 nested levels).
_ROOMY = {"max_depth": 512, "max_array_len": 2**31 - 1, "max_map_len": 2**31 - 1}
# Journal records may carry key-value entries up to the control limit; give them headroom.
_JOURNAL_LIMITS = Limits(max_message_nbytes=64 * 1024 * 1024, max_bin_len=32 * 1024 * 1024, **_ROOMY)
# a snapshot holds every job's store (at most state.MAX_KV_NBYTES together), members and commit
# metadata (4,096 jobs with 64 KiB each passed 256 MiB: a tester's find)
_SNAPSHOT_LIMITS = Limits(max_message_nbytes=1024 * 1024 * 1024, max_bin_len=32 * 1024 * 1024, **_ROOMY)


class Coordinator:
    """The daemon.

    Args:
        bind: ZeroMQ address to bind, e.g. ``tcp://0.0.0.0:29600``; port 0 picks a free port.
        journal_dir: folder of the write-ahead journal; created if missing; replayed at start.
        tick_s: how often heartbeats and deadlines are checked, seconds.
        snapshot_every: records after which the journal is compacted into a snapshot. It is
            also compacted once the records since the last snapshot hold
            ``max(COMPACT_MIN_NBYTES, 4 x that snapshot's size)`` bytes: a store key rewritten
            with 4 MiB values 60 times made a 240 MiB journal of one key, with 40 GB to go
            before 10,000 records (a tester's find); the factor 4 bounds the time spent writing
            snapshots to a quarter of the time spent appending.
        fsync: make journal appends durable (off only for throwaway tests).
        dead_job_ttl_s: how long a job whose every rank crashed is kept for restarted ranks.

    Raises:
        JournalCorruptError: (from :meth:`start`) the journal is corrupt before its tail.
        ConnectError: (from :meth:`start`) the address cannot be bound.
    """

    def __init__(self, bind: str, journal_dir: str | Path, *, tick_s: float = 0.05,
                 snapshot_every: int = 10000, fsync: bool = True, dead_job_ttl_s: float = 3600.0):
        self.bind = bind
        self.journal = Journal(journal_dir, fsync=fsync)
        self.tick_s = tick_s
        self.snapshot_every = snapshot_every
        self.dead_job_ttl_s = dead_job_ttl_s
        self.state = State()
        self._compact_at_records = snapshot_every
        self._removal_check_at = 0.0     # when an idle daemon next looks for a removed journal
        self._compact_at_nbytes = COMPACT_MIN_NBYTES
        self._fd_check_at = 0.0      # when the open files are next counted (_check_open_files)
        self._fd_warn_log = LogBudget(per_window=1, window_s=FD_WARN_EVERY_S)   # open_files_near_limit
        self.server: ControlServer | None = None
        self.address: str | None = None
        self._stop = asyncio.Event()

    def _replayed(self, raw: bytes, limits: Limits, what: str) -> dict:
        """``raw`` from the journal, decoded; one that passed its checksum but cannot be decoded
        is a ``JournalError`` naming the journal and ``what`` (the daemon exits 3)."""
        try:
            return decode(raw, limits=limits)
        except ProtocolError as exc:
            raise JournalError(f"journal {self.journal.directory}: {what} passed its checksum but "
                               f"cannot be decoded ({exc}); move the folder aside to start "
                               f"afresh") from exc

    def _applied(self, fn, what: str):
        """``fn()`` (a snapshot restored, a record applied); one whose content does not fit
        (a field missing or of another type, an unknown kind, a job never created: written by
        another version or copied from another journal) is a ``JournalError`` naming the journal
        and ``what`` (the daemon exits 3)."""
        try:
            return fn()
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
            raise JournalError(
                f"journal {self.journal.directory}: {what} passed its checksum but does not "
                f"apply ({type(exc).__name__}: {exc}): it was not written by this version of "
                f"the coordinator for this journal; move the folder aside to start afresh"
            ) from exc

    async def start(self) -> str:
        """Replay the journal and bind. Returns the bound address.

        Raises:
            JournalCorruptError, JournalError: see the class; a record or snapshot that decodes
                but does not apply is a ``JournalError`` naming it.
            ConnectError: the address cannot be bound.
        """
        now = time.monotonic()
        snap, records = self.journal.open()
        self._compact_at_nbytes = max(COMPACT_MIN_NBYTES, 4 * len(snap or b""))
        if snap:
            raw = self._replayed(snap, _SNAPSHOT_LIMITS, "the snapshot")
            self.state = self._applied(lambda: restore(raw, now), "the snapshot")
        else:
            self.state = State()
        for i, raw in enumerate(records):
            what = f"record {i + 1} of {len(records)} after the snapshot"
            rec = self._replayed(raw, _JOURNAL_LIMITS, what)
            self._applied(lambda rec=rec: apply_record(self.state, rec, now), what)
        self.state.dead_job_ttl_s = self.dead_job_ttl_s
        for job in self.state.jobs.values():
            if job.formed and not job.members:
                job.empty_since = now   # the TTL of a dead job restarts with the daemon
        log.info(
            "journal_replayed",
            snapshot=snap is not None,
            records=len(records),
            jobs=len(self.state.jobs),   # running or waiting for restarted ranks
            finished_jobs=len(self.state.finished),   # ended; their ids are refused
            # (each job's epoch only for a handful: thousands would make one line of megabytes)
            epochs={j.job: j.epoch for j in list(self.state.jobs.values())[:20]},
        )
        self.server = ControlServer(self.bind)
        self.server.prefer = self._is_member
        self.address = self.server.address
        return self.address

    def _is_member(self, identity: str) -> bool:
        """Whether ``identity`` is a member of a formed job (its requests go first: see
        ``ControlServer.prefer``)."""
        job = self.state.jobs.get(self.state.where.get(identity, ""))
        return job is not None and job.formed and identity not in job.pending

    def stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Run until :meth:`stop`."""
        assert self.server is not None, "start() first"
        server = self.server
        last_tick = time.monotonic()
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                nxt = asyncio.ensure_future(server.next())
                done, _ = await asyncio.wait({nxt, stop_wait}, timeout=self.tick_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                events = []
                if nxt in done:
                    events.append(nxt.result())
                else:
                    nxt.cancel()
                # at most MAX_BATCH_EVENTS a batch, the clients taking turns in it: a flood of
                # requests waiting no longer holds a heartbeat's answer until all are handled
                while len(events) < MAX_BATCH_EVENTS and (ev := server.next_nowait()) is not None:
                    events.append(ev)
                now = time.monotonic()
                if now >= self._fd_check_at:
                    self._fd_check_at = now + FD_CHECK_S
                    self._check_open_files()
                batch = [self._event(ev) for ev in events]
                if now - last_tick >= self.tick_s:
                    gap = now - last_tick
                    # a wait of tick_s that took _STALL_S longer: this process was not running
                    # (SIGSTOP, swapped out, a slow disk); the ranks' silence meanwhile is not theirs
                    stalled_s = gap - self.tick_s if gap > self.tick_s + _STALL_S else 0.0
                    if stalled_s:
                        log.warning("coordinator_stalled", seconds=round(gap, 3))
                    batch.append(Tick(stalled_s=stalled_s))
                    last_tick = now
                await self._run(batch, now)
        finally:
            stop_wait.cancel()

    def _check_open_files(self) -> None:
        """Log ``open_files_near_limit`` (at most every ``FD_WARN_EVERY_S``) when this process
        holds ``FD_WARN_FRACTION`` of its soft limit of open files or more."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY:
            return
        try:
            held = len(os.listdir("/proc/self/fd")) - 1   # (less the listing's own)
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                return   # no /proc (not Linux): not counted
            held = limit   # not one left to list them with
        if held < FD_WARN_FRACTION * limit or not self._fd_warn_log.allow()[0]:
            return
        log.warning("open_files_near_limit", open_files=held, limit=limit,
                    hint=f"each client connection holds one; at the limit no new client is "
                         f"answered; connections that never greet are closed after "
                         f"{HANDSHAKE_IVL_MS / 1000:g} s; raise the hard limit (ulimit -Hn, "
                         f"systemd LimitNOFILE=) or find the idle clients (ss -tn)")

    @staticmethod
    def _event(ev: Inbound | Disconnected) -> Request | Disconnect:
        if isinstance(ev, Disconnected):
            return Disconnect(ev.identity)
        return Request(ev.identity, ev.msg)

    async def _run(self, batch: list, now: float) -> None:
        sends: list[Send] = []
        queries: list[StatusQuery] = []
        wrote = False
        for ev in batch:
            try:
                _, actions = step(self.state, ev, now)
            except Exception:
                # One bad request must not take the daemon down for every other job.
                log.exception("step_failed", event=type(ev).__name__)
                if isinstance(ev, Request):
                    sends.append(Send(ev.identity, wire.make("error", rid=ev.msg["rid"], job=ev.msg["job"],
                                                             error="RtxError", message="internal error in the coordinator")))
                continue
            for act in actions:
                if isinstance(act, Record):
                    try:
                        data = encode(act.data, limits=_JOURNAL_LIMITS)
                    except ProtocolError:
                        # the door's checks keep this from happening; if it does, the state has
                        # the change and the journal not: say so, and keep serving the others
                        log.exception("record_unencodable", kind=act.data.get("k"),
                                      job=act.data.get("job"))
                        continue
                    self.journal.append(data)
                    wrote = True
                    if act.data["k"] == "epoch":
                        log.info("epoch_opened", job=act.data["job"], epoch=act.data["epoch"],
                                 world_size=len(act.data["members"]))
                elif isinstance(act, StatusQuery):
                    queries.append(act)
                else:
                    sends.append(act)
        if wrote:
            await self.journal.flush()  # nothing is acknowledged before it is durable
        if wrote or now >= self._removal_check_at:
            # at each write and each second: the folder (or its files) removed under the daemon
            # is written again from the state, this batch's changes included, before any of them
            # is acknowledged; an idle daemon looks too, so a second daemon has at most a second
            # to take the path (before, until the next write)
            self._removal_check_at = now + REMOVAL_CHECK_S
            if self.journal.removed():
                self._recreate_journal()
                wrote = False
        if wrote and (self.journal.records_since_snapshot >= self._compact_at_records
                      or self.journal.bytes_since_snapshot >= self._compact_at_nbytes):
            self._compact()
        if queries:   # (the state after every event of the batch, each question once)
            try:
                sends += answer_status(self.state, queries, now)
            except Exception:
                log.exception("status_failed", queries=len(queries))
        for s in sends:
            self.server.send(s.identity, s.msg)

    def _encoded_snapshot(self) -> bytes:
        """The state as one snapshot. Raises ``ProtocolError`` when it is too large to encode."""
        return encode(snapshot(self.state), limits=_SNAPSHOT_LIMITS)

    def _snapshot_written(self, nbytes: int) -> None:
        """A snapshot of ``nbytes`` is on disk: the next compaction is counted from it."""
        self._compact_at_records = self.snapshot_every
        self._compact_at_nbytes = max(COMPACT_MIN_NBYTES, 4 * nbytes)

    def _compact(self) -> None:
        """Write a snapshot of the state, which replaces the records before it. A failure that
        leaves the journal usable (the snapshot's temporary file could not be written: a full
        disk, a folder made read-only; or the state is too large to encode as one snapshot) is
        logged and tried again after as many records or bytes once more; the daemon serves on,
        appending.

        Raises:
            JournalError: the compaction failed after its commit point (the journal refuses
                further calls; the daemon exits 3 and a restart replays).
        """
        try:
            data = self._encoded_snapshot()
            self.journal.write_snapshot(data)
        except (ProtocolError, JournalError) as exc:
            if self.journal.failed:
                raise
            # tried again only after as many records or bytes once more: an attempt on every
            # write (a snapshot too large to encode) made each write take 0.75 s (a tester's find)
            self._compact_at_records = self.journal.records_since_snapshot + self.snapshot_every
            self._compact_at_nbytes = self.journal.bytes_since_snapshot + self._compact_at_nbytes
            log.warning("journal_snapshot_skipped", error=str(exc), jobs=len(self.state.jobs),
                        retry_at_records=self._compact_at_records,
                        hint="the journal goes on growing until a snapshot can be written")
            return
        self._snapshot_written(len(data))
        log.info("journal_compacted", jobs=len(self.state.jobs), snapshot_nbytes=len(data))

    def _recreate_journal(self) -> None:
        """The journal's folder or files were removed while the daemon ran (``Journal.removed``):
        make them again with a snapshot of the state (``Journal.recreate``), logged
        ``journal_recreated``.

        Raises:
            JournalError: the journal cannot be made again (its path is a file now, another
                daemon locked it, the folder cannot be made, the state is too large to encode):
                the daemon exits 3 before acknowledging what no disk holds, as after a failed
                write.
        """
        try:
            data = self._encoded_snapshot()
            self.journal.recreate(data)
        except (ProtocolError, JournalError) as exc:
            if self.journal.failed:
                raise
            raise JournalError(
                f"journal {self.journal.directory} was removed while the daemon ran and "
                f"cannot be written again: {exc}; nothing since was acknowledged") from exc
        self._snapshot_written(len(data))
        log.warning("journal_recreated", path=str(self.journal.directory), jobs=len(self.state.jobs),
                    snapshot_nbytes=len(data), hint="the journal's folder or files were removed "
                    "while the daemon ran; it wrote them again from its state")

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.aclose()
        self.journal.close()
