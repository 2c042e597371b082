"""The per-rank agent: the control-plane actor of one rank.

It joins the job's rendezvous, heartbeats on the monotonic clock, receives epoch pushes, and
serves key-value and commit requests. When the coordinator restarts, the DEALER socket reconnects
by itself; the heartbeat answers tell the agent whether it is still a member (and hand it any epoch
it missed), whether it must join again (it was pending, which is not journaled), or whether it was
fenced out (declared lost while frozen or cut off).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from transport.channel import ControlClient, nobody_there
from transport.errors import (
    ClosedError,
    ConfigError,
    CoordinatorLostError,
    JobFinishedError,
    JobFullError,
    RendezvousError,
    RendezvousTimeout,
    RtxError,
    RtxTimeoutError,
)

from .config import Timeouts
from .topology import host_id

__all__ = ["Agent", "Membership"]

log = structlog.get_logger(__name__)
# a heartbeat's deadline seen this much late: the process did not run meanwhile
_STOOD_STILL_S = 1.0

FULL_RETRY_TIMEOUTS = 3   # how long a joiner asks a full job again, in heartbeat timeouts
WAITING_LOG_S = 10.0      # a rendezvous that has not formed is reported this often


@dataclass(frozen=True)
class Membership:
    """One epoch of a job as this rank sees it.

    Attributes:
        job: job id.
        epoch: increases by one at every membership change.
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: number of ranks in the epoch.
        members: rank -> ``{"identity", "endpoint", "host", "pid", "info"}``.
        lost: ranks of the previous epoch that were lost or left.
        added: ranks new in this epoch.
        reason: ``formed``, ``lost``, ``left``, ``joined`` or ``resync``.
        committed_step: the job's last committed step, -1 if none.
    """

    job: str
    epoch: int
    rank: int
    world_size: int
    members: dict[int, dict[str, Any]] = field(repr=False)
    lost: tuple[int, ...] = ()
    added: tuple[int, ...] = ()
    reason: str = "formed"
    committed_step: int = -1


Listener = Callable[[Membership | None, str], None]


def _who_came(pending: dict[str, Any] | None) -> str:
    """``"; 1 rank joined, ranks [0, 2] never did"`` from the last "pending" heartbeat answer,
    for the rendezvous timeout message; empty when none came."""
    if not pending or not isinstance(pending.get("joined"), int):
        return ""
    n = pending["joined"]
    text = f"; {n} rank{'s' if n != 1 else ''} joined"
    missing = pending.get("missing_ranks")
    if missing:
        text += f", rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing))} never did"
    return text


class Agent:
    """Control-plane actor of one rank; see the module docstring.

    Args:
        coordinator: the coordinator's address, e.g. ``tcp://127.0.0.1:29600``.
        job: job id; jobs sharing a coordinator are isolated by it.
        token: job token; must match the one the job was created with.
        rank: requested rank or None for any free rank.
        min_ranks / max_ranks: rendezvous bounds, ``1 <= min_ranks <= max_ranks``.
        last_call_s: after ``min_ranks`` are present, seconds to wait for more.
        timeouts: deadlines; see :class:`rtxnet.config.Timeouts`.
        endpoint: this rank's data endpoint (peer-to-peer payloads), told to the others.
        info: topology facts to publish (hostname is always included).
    """

    def __init__(self, *, coordinator: str, job: str, token: str = "", rank: int | None = None,
                 min_ranks: int, max_ranks: int, last_call_s: float = 0.0, timeouts: Timeouts,
                 endpoint: str = "", info: dict[str, Any] | None = None, replacement: bool = False):
        self.coordinator = coordinator
        # a restarted process taking a lost rank's place (RTXNET_REJOIN=1): finding the job full
        # means the coordinator has not yet declared that rank lost, so it asks again a while
        self.replacement = replacement
        self.job = job
        self.token = token
        self.requested_rank = rank
        self.min_ranks = min_ranks
        self.max_ranks = max_ranks
        self.last_call_s = last_call_s
        self.timeouts = timeouts
        self.endpoint = endpoint
        self.host = host_id()  # RTXNET_HOST overrides the hostname
        self.info = dict(info or {})
        # the ZeroMQ routing id too: whoever knows it could take over this agent's connection
        # (the coordinator's ROUTER hands an id over to its newest connection), so 128 random
        # bits, and the coordinator never publishes it outside the job
        self.identity = f"{self.host[:64]}/{os.getpid()}/{uuid.uuid4().hex}"
        self.membership: Membership | None = None
        # the one before it: a listener added after a loss names the lost ranks' launch ranks
        self.previous_membership: Membership | None = None
        self.fenced = False
        self.fence_reason = ""   # why this agent was last fenced (for the errors that follow)
        self.training_finished = False   # this agent told the coordinator so (finish)
        self.last_heartbeat_ok: float | None = None
        # (time.monotonic() when sent, the job's committed step) of the newest heartbeat answered
        # while a member: the coordinator had then read all this agent sent before it (one
        # connection, read in order) and decided on those steps (see FaultTolerance._vote)
        self.heartbeat_committed: tuple[float, int] | None = None
        # loop time of the first unanswered heartbeat of the current silence (None: answered)
        self._unreachable_since: float | None = None
        # loop times of the first "pending" heartbeat answer of this rendezvous, and the last report
        self._waiting_since: float | None = None
        self._waiting_logged = 0.0
        # the last "pending" answer (how many joined, which asked-for ranks are missing)
        self._pending_body: dict[str, Any] | None = None
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        # set when the coordinator, asked by a fenced rank's heartbeat, no longer knows this rank
        # (its job ended or was forgotten): a rank pausing before its rejoin stops waiting
        self.gone = asyncio.Event()
        self._client: ControlClient | None = None
        self._hb_task: asyncio.Task | None = None
        self._withdrawals: set[asyncio.Task] = set()   # kv_unwait requests in flight
        self._joining = False
        self._closed = False
        self._leaving = False
        self._admissions = 0  # memberships accepted so far (a rejoin waits for the next one)
        # this process's first admission was into a job that had formed without it (a
        # replacement, a rank that came after the last call): its peers are training, not
        # building their models (see rtxnet.parallel._world.joined_running)
        self.joined_running = False
        # of those, the ones of at least min_ranks ranks (init returns once one came)
        self.reached_min_ranks = 0
        # bumped at every admission and fence: a heartbeat answer computed before a push that
        # changed this agent's standing (its reply is read after the push) must not undo it
        self._standing = 0
        # a join sent again by the heartbeat loop was refused for good (the job finished, bad
        # settings): whoever waits for admission raises it instead of waiting out its timeout
        self._join_refused: RtxError | None = None
        self._muted_until = 0.0  # fault injection: no heartbeats until this time.monotonic()
        # the world size this member waits for (rtxnet.elastic, below min_world_size), told to
        # the coordinator with each heartbeat (rtxnet-run reads it from status); None: nothing
        self.waiting_for: int | None = None

    # ------------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.membership.epoch if self.membership else -1

    def mute_heartbeats(self, seconds: float | None) -> None:
        """Fault injection: send no heartbeats for ``seconds`` (None: until the process ends)."""
        self._muted_until = float("inf") if seconds is None else time.monotonic() + seconds
        log.warning("heartbeats_muted", seconds=seconds)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(membership, reason)`` at every new epoch (and ``fn(None, "fenced")``)."""
        self._listeners.append(fn)

    async def join(self) -> Membership:
        """Enter the rendezvous and wait for the world to form.

        Raises:
            RendezvousError: refused (duplicate rank or identity, wrong token); JobFullError (a
                RendezvousError) when the job already has max_ranks members.
            RendezvousTimeout: no world within ``timeouts.rendezvous_s``.
            RtxTimeoutError: the coordinator did not answer: within ``timeouts.request_s``
                when nothing listens at its address (connection refused, host unreachable),
                else within ``timeouts.coordinator_s`` (a coordinator frozen or starved that
                long; one that resumes sooner answers the join it queued).
            JobFinishedError: the job finished before this rank was admitted (a rank that was
                declared lost asks to rejoin while the others end: it need not wait).
        """
        if self._client is None:
            self._client = ControlClient(self.coordinator, self.identity, self._on_push)
        admissions = self._admissions
        self._join_refused = None
        # A join waits for a coordinator that accepts connections but does not answer (frozen,
        # starved) as long as members wait for its heartbeats (coordinator_s); where nothing
        # listens (asked after request_s, as `rtxnet status` tells it) it fails then.
        # The join is sent again every heartbeat timeout while unanswered (the coordinator takes
        # a repeated join as the first): one sent over a connection that died before the
        # coordinator read it (killed as this rank started) is not answered, nor sent again by
        # the channel when no disconnect was seen.
        t = self.timeouts
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + max(t.request_s, t.coordinator_s)
        again_s = max(t.heartbeat_timeout_s, 1.0)
        tries: list[asyncio.Future] = []
        sent = warned = None
        try:
            while True:
                now = loop.time()
                if now < deadline and (sent is None or now - sent >= again_s):
                    tries.append(asyncio.ensure_future(self._join_request(deadline_s=deadline - now)))
                    sent = now
                # (past the deadline, the tries end by their own)
                wake = [sent + again_s] if now < deadline else []
                if not warned:
                    wake.append(start + t.request_s)
                done, _ = await asyncio.wait(tries, return_when=asyncio.FIRST_COMPLETED,
                                             timeout=max(0.0, min(wake) - now) if wake else None)
                if done:
                    try:
                        next(iter(done)).result()
                    except RtxTimeoutError:   # (every try ends at the deadline)
                        why = await asyncio.to_thread(nobody_there, self.coordinator)
                        raise RtxTimeoutError(
                            f"join to {self.coordinator}: no answer within "
                            f"{max(t.request_s, t.coordinator_s):g} s" + (f"; {why}" if why else "")) from None
                    break
                if not warned and loop.time() - start >= t.request_s:
                    warned = True
                    why = await asyncio.to_thread(nobody_there, self.coordinator)
                    if why is not None:
                        raise RtxTimeoutError(f"join to {self.coordinator}: no answer within "
                                              f"{t.request_s:g} s; {why}")
                    log.warning("join_waits_for_coordinator", coordinator=self.coordinator,
                                waited_s=t.request_s, up_to_s=max(t.request_s, t.coordinator_s))
        finally:
            for attempt in tries:
                if not attempt.done():
                    attempt.cancel()
            await asyncio.gather(*tries, return_exceptions=True)
        if self._hb_task is None:
            self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop(), name="heartbeat")
        try:
            return await self._wait_admission(admissions, timeout_s=self.timeouts.rendezvous_s)
        except RtxTimeoutError:
            raise RendezvousTimeout(
                f"job {self.job!r}: the world did not form within {self.timeouts.rendezvous_s:g} s "
                f"(min_ranks={self.min_ranks}, max_ranks={self.max_ranks}, coordinator {self.coordinator})"
                + _who_came(self._pending_body)) from None

    async def _join_request(self, deadline_s: float | None = None) -> None:
        """``_send_join``; a rank refused because the job is full asks again every heartbeat
        interval for ``FULL_RETRY_TIMEOUTS`` heartbeat timeouts: the rank whose place it takes
        may have died unseen by the coordinator (killed while it was down: the restarted
        coordinator replays the dead rank as a member until its heartbeats are missed), and is
        dropped within one. Not only a replacement (``RTXNET_REJOIN``): a node's ranks started
        again by a new launch met it too, and the job ended (a tester's find: a node's launcher
        SIGKILLed while the coordinator was down, relaunched right after its restart). A job
        truly full (another launch's) is refused that much later."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FULL_RETRY_TIMEOUTS * self.timeouts.heartbeat_timeout_s
        while True:
            try:
                return await self._send_join(deadline_s)
            except JobFullError as exc:
                if loop.time() >= deadline:
                    raise
                log.warning("join_retry_job_full", error=str(exc))
                await asyncio.sleep(self.timeouts.heartbeat_interval_s)

    async def _send_join(self, deadline_s: float | None = None) -> None:
        self._joining = True
        mute_left = self._muted_until - time.monotonic()
        if mute_left == float("inf") and self.membership is not None:
            # Cut off for good: a real rank that can never reach the coordinator could not join
            # again either; rejoining would only be fenced again a heartbeat timeout later.
            raise RendezvousError(
                f"rank {self.membership.rank} of job {self.job!r} was declared lost and cannot "
                f"rejoin: its heartbeats are stopped for good by fault injection "
                f"(drop-heartbeats without seconds=)")
        if 0 < mute_left < float("inf"):
            # A rank cut off by fault injection (muted heartbeats, simulated partition) could not
            # reach the coordinator either: it (re)joins once that is over, not into a new epoch
            # whose peers' data it would still drop.
            log.info("join_waits_for_fault", seconds=round(mute_left, 3))
            await asyncio.sleep(mute_left)
        await self._request(
            "join",
            deadline_s=deadline_s,
            identity=self.identity,
            token=self.token,
            # After having been a member, ranks were renumbered: take whichever rank is free.
            rank=self.requested_rank if self.membership is None else None,
            min_ranks=self.min_ranks,
            max_ranks=self.max_ranks,
            last_call_s=float(self.last_call_s),
            heartbeat_timeout_s=float(self.timeouts.heartbeat_timeout_s),
            endpoint=self.endpoint,
            host=self.host,
            pid=os.getpid(),
            info=self.info,
            # Only a former member must not create the job anew; a restarted process may be the
            # first to arrive (a kill during rendezvous), the coordinator refuses finished jobs.
            rejoin=self.membership is not None,
        )

    async def _wait_until(self, done: Callable[[], bool], *, timeout_s: float, what: str) -> Membership:
        """Wait, woken by every membership change, until ``done()``; returns the membership."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            if self._closed:
                raise ClosedError("agent closed")
            if self._join_refused is not None:
                exc, self._join_refused = self._join_refused, None
                raise exc
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RtxTimeoutError(f"{what} within {timeout_s:g} s")
            try:
                async with asyncio.timeout(remaining):   # (asyncio.wait_for may lose a cancellation: ControlClient.request)
                    await self._changed.wait()
            except TimeoutError:
                continue
        return self.membership

    async def _wait_admission(self, before: int, *, timeout_s: float) -> Membership:
        return await self._wait_until(lambda: self._admissions > before, timeout_s=timeout_s,
                                      what="not admitted")

    async def wait_epoch(self, after: int, *, timeout_s: float,
                         or_fenced: bool = False) -> Membership:
        """Wait until an epoch newer than ``after`` arrives (or, with ``or_fenced``, this agent is
        fenced out: no epoch will come until it joins again); returns the membership.

        Raises:
            RtxTimeoutError: none within ``timeout_s``.
            ClosedError: the agent was closed.
        """
        return await self._wait_until(
            lambda: (or_fenced and self.fenced)
            or (self.membership is not None and self.membership.epoch > after),
            timeout_s=timeout_s, what=f"no epoch after {after}")

    # ------------------------------------------------------------------------------------------
    async def _request(self, mtype: str, *, deadline_s: float | None = None, epoch: int | None = None,
                       on_cancel: Callable[[int], Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Send ``mtype`` with this agent's job, token and epoch (``epoch`` names another)."""
        if self._closed or self._client is None:
            raise ClosedError("agent is closed" if self._closed else "agent has not joined")
        try:
            return await self._client.request(mtype, job=self.job, epoch=self.epoch if epoch is None else epoch,
                                              deadline_s=deadline_s or self.timeouts.request_s,
                                              on_cancel=on_cancel, **{"token": self.token, **fields})
        except RtxTimeoutError as exc:
            since = self._unreachable_since
            if since is None:
                raise
            # why, as far as this rank can tell (a tester's find: a coordinator that kept exiting
            # on a full journal disk read as a bare "no answer within 10 s")
            silent = asyncio.get_running_loop().time() - since
            raise RtxTimeoutError(
                f"{exc}; the coordinator has answered none of this rank's heartbeats either for "
                f"{silent:.0f} s: it is down, frozen or restarting (its log says why; rtxnet-run "
                f"restarts the one it started), or this rank is cut off from it") from None

    async def _on_push(self, msg: dict[str, Any]) -> None:
        if msg["job"] != self.job:
            return
        if msg["t"] == "epoch":
            self._apply_epoch(msg)
        elif msg["t"] == "fenced":
            if msg["epoch"] < self.epoch:
                return  # about an epoch we have since rejoined past
            self._fence(msg["reason"])

    def _apply_epoch(self, msg: dict[str, Any]) -> None:
        readmit = self.fenced and msg["epoch"] == self.epoch
        if msg["epoch"] <= self.epoch and not readmit:
            return  # stale or duplicate
        members = {int(r): m for r, m in msg["members"].items()}
        mine = [r for r, m in members.items() if m["identity"] == self.identity]
        if not mine:
            self._fence(f"epoch {msg['epoch']} does not include this agent")
            return
        self._joining = False
        self.fenced = False
        self._admissions += 1
        if self._admissions == 1:
            self.joined_running = msg["reason"] != "formed"
        if msg["world_size"] >= self.min_ranks:
            self.reached_min_ranks += 1
        self._standing += 1
        self.previous_membership = self.membership
        self.membership = Membership(
            job=self.job,
            epoch=msg["epoch"],
            rank=mine[0],
            world_size=msg["world_size"],
            members=members,
            lost=tuple(msg["lost"]),
            added=tuple(msg["added"]),
            reason=msg["reason"],
            committed_step=msg["committed_step"],
        )
        structlog.contextvars.bind_contextvars(rank=mine[0], epoch=msg["epoch"], job=self.job)
        log.info("epoch", world_size=msg["world_size"], lost=msg["lost"], added=msg["added"], reason=msg["reason"])
        for fn in self._listeners:
            fn(self.membership, msg["reason"])
        self._changed.set()

    def _fence(self, reason: str) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.fence_reason = reason
        self._standing += 1
        log.warning("fenced", reason=reason)
        for fn in self._listeners:
            fn(None, "fenced")
        self._changed.set()

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.timeouts.heartbeat_interval_s
        me = asyncio.current_task()
        while not self._closed:
            if me is not None and me.cancelling():
                # a cancellation some await swallowed (asyncio.wait_for of Python 3.11, in user
                # code too) still ends the loop: asyncio.run() waits for it at exit
                raise asyncio.CancelledError
            sent_at, sent_mono = loop.time(), time.monotonic()
            mute_left = self._muted_until - time.monotonic()
            if mute_left > 0:
                await asyncio.sleep(min(interval, mute_left))
                continue
            standing = self._standing
            deadline_s = max(interval, self.timeouts.heartbeat_timeout_s)
            try:
                extra = {} if self.waiting_for is None else {"waiting_for": self.waiting_for}
                body = await self._request("heartbeat", identity=self.identity, deadline_s=deadline_s,
                                           **extra)
            except RtxTimeoutError:
                stood_still = time.monotonic() - sent_mono - deadline_s
                if stood_still > _STOOD_STILL_S:
                    # the deadline passed while this process did not run (SIGSTOP, starved): no
                    # sign against the coordinator, whose silence is not counted from it (a
                    # woken rank logged "coordinator_unreachable" of a coordinator that was fine:
                    # a fresh user's find)
                    log.warning("heartbeat_unanswered_while_this_process_stood_still",
                                stood_still_s=round(stood_still, 1), coordinator=self.coordinator)
                elif self._unreachable_since is None:
                    log.warning("coordinator_unreachable", coordinator=self.coordinator)
                    self._unreachable_since = sent_at
                continue
            except ClosedError:
                return
            except RtxError as exc:
                log.warning("heartbeat_refused", error=str(exc))
                body = {"state": "unknown"}
            if self._unreachable_since is not None:
                log.info("coordinator_reachable", coordinator=self.coordinator)
                self._unreachable_since = None
            self.last_heartbeat_ok = loop.time()
            if body.get("state") == "member" and isinstance(body.get("committed_step"), int):
                self.heartbeat_committed = (sent_mono, body["committed_step"])
            if standing == self._standing:
                await self._on_heartbeat_answer(body, loop.time())
            # else an epoch or fence push was read while this answer was on its way (a frozen
            # rank wakes to both; a rejoin's epoch overtakes the "fenced" answer to a heartbeat
            # sent before the join): the answer describes what the push replaced, and acting on
            # it would readmit a fenced rank or fence a readmitted one. The next heartbeat asks.
            await asyncio.sleep(max(0.0, interval - (loop.time() - sent_at)))

    async def _on_heartbeat_answer(self, body: dict[str, Any], now: float) -> None:
        """Act on the coordinator's answer to a heartbeat: a missed epoch, fenced, unknown."""
        state = body.get("state")
        if state == "member" and "view" in body:
            self._apply_epoch(body["view"])
        if state != "pending":
            self._waiting_since = self._pending_body = None
        if state == "pending":
            self._pending_body = body
            self._log_waiting(body, now)
        elif state == "fenced":
            self._fence("the coordinator declared this rank lost")
        elif state == "unknown":
            if self._joining or self.membership is None:
                # The coordinator restarted while we were pending (pending joins are not
                # journaled): join again.
                try:
                    await self._send_join()
                except (JobFinishedError, ConfigError) as exc:
                    # final: asking again every heartbeat would only repeat the refusal
                    log.warning("rejoin_refused", error=str(exc))
                    self._joining = False
                    self._join_refused = exc
                    self._changed.set()
                except RtxError as exc:
                    log.warning("rejoin_failed", error=str(exc))
            elif not self.fenced and not self._leaving:
                self._fence("the coordinator does not know this rank (job ended?)")
            else:
                self.gone.set()

    def _log_waiting(self, body: dict[str, Any], now: float) -> None:
        """Every ``WAITING_LOG_S`` (a quarter of a shorter rendezvous timeout) of a rendezvous
        that has not formed, say how many are missing (as torchrun's "waiting for rendezvous"), so a
        rank started without its peers is not silent until its rendezvous timeout."""
        if self._waiting_since is None:
            self._waiting_since = self._waiting_logged = now
            return
        if now - self._waiting_logged < min(WAITING_LOG_S, self.timeouts.rendezvous_s / 4):
            return
        self._waiting_logged = now
        joined, lo = body.get("joined"), body.get("min_ranks")
        extra = {"refused": body["refused"]} if body.get("refused") else {}
        if body.get("missing_ranks"):
            extra["missing_ranks"] = body["missing_ranks"]
        log.warning("rendezvous_waiting", job=self.job, waited_s=round(now - self._waiting_since),
                    joined=joined, min_ranks=lo, max_ranks=body.get("max_ranks"),
                    missing=(lo - joined) if isinstance(joined, int) and isinstance(lo, int) else None,
                    gives_up_after_s=self.timeouts.rendezvous_s, **extra)

    # ------------------------------------------------------------------------------------------
    # key-value store

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._request("kv_set", key=key, value=bytes(value))

    async def kv_get(self, key: str) -> bytes | None:
        return (await self._request("kv_get", key=key))["value"]

    async def kv_wait(self, keys: list[str], timeout_s: float) -> dict[str, bytes]:
        # The coordinator enforces timeout_s; the channel deadline adds 2 s for its answer
        # (request_s, 10 s by default, made a wait(timeout=2) on a frozen coordinator take 12 s:
        # a tester's find)
        body = await self._request("kv_wait", deadline_s=timeout_s + min(2.0, self.timeouts.request_s),
                                   on_cancel=self._withdraw_wait, keys=list(keys), timeout_s=float(timeout_s))
        return body["values"]

    def _withdraw_wait(self, rid: int) -> None:
        """A ``kv_wait`` cancelled here (``asyncio.wait_for``, Ctrl-C in the blocking store) is
        withdrawn at the coordinator, where it stayed parked until its own timeout: 4,096 such
        waits refused every wait of the job (a breaker's find). Best effort, in the background."""
        if self._closed or self._client is None:
            return

        async def withdraw() -> None:
            with contextlib.suppress(Exception):
                await self._request("kv_unwait", wait_rid=rid)

        task = asyncio.get_running_loop().create_task(withdraw())
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    async def kv_cas(self, key: str, expected: bytes | None, value: bytes) -> tuple[bool, bytes | None]:
        body = await self._request("kv_cas", key=key, expected=None if expected is None else bytes(expected), value=bytes(value))
        return body["swapped"], body["value"]

    async def kv_del(self, key: str) -> bool:
        return (await self._request("kv_del", key=key))["deleted"]

    def check_coordinator(self, what: str) -> None:
        """Raise when the coordinator has answered no heartbeat for ``Timeouts.coordinator_s``.

        Raises:
            CoordinatorLostError: names ``what`` was being done, the address and the silence;
                the coordinator died (and was not restarted on its journal in time) or this rank
                is cut off from it (a network partition: the others, on the coordinator's side,
                go on without this rank).
        """
        since = self._unreachable_since
        if since is None:
            return
        silent = asyncio.get_running_loop().time() - since
        if silent > self.timeouts.coordinator_s:
            raise CoordinatorLostError(
                f"{what}: the coordinator at {self.coordinator} has answered no heartbeat for "
                f"{silent:.0f} s (coordinator_s={self.timeouts.coordinator_s:g}): it is gone, or this "
                f"rank is cut off from it (a network partition; the ranks it still reaches go on "
                f"without this one), so no step can be committed; a coordinator restarted on the "
                f"same journal within coordinator_s is reconnected to without loss (rtxnet-run "
                f"restarts its own)", address=self.coordinator, silent_s=silent)

    async def commit(self, step: int, *, ok: bool = True, metadata: dict | None = None,
                     timeout_s: float, epoch: int | None = None) -> dict[str, Any]:
        """Vote on ``step`` as a member of ``epoch`` (default: the current one); returns the
        coordinator's decision ``{committed, step, reason}``. A vote for an epoch this agent has
        left is answered "epoch changed" at once, without asking.

        Votes are idempotent, so the vote is re-sent every few heartbeat timeouts until the
        overall ``timeout_s``: a coordinator that restarted meanwhile (losing unjournaled votes)
        hears it again, and a decision it journaled before dying is answered "already committed".

        Raises:
            RtxTimeoutError: no decision within ``timeout_s``.
            CoordinatorLostError: the coordinator answered no heartbeat for
                ``Timeouts.coordinator_s`` (checked before every attempt).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        attempt_s = max(4 * self.timeouts.heartbeat_timeout_s, 1.0)
        epoch = self.epoch if epoch is None else epoch
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RtxTimeoutError(f"commit of step {step}: no decision within {timeout_s:g} s")
            since = self._unreachable_since
            self.check_coordinator(f"commit of step {step}")
            if self.epoch != epoch:
                return {"committed": False, "step": step, "reason": f"epoch changed {epoch} -> {self.epoch}"}
            wait_s = min(attempt_s, remaining)
            if since is not None:   # look again when the silence would pass coordinator_s
                silent = loop.time() - since
                wait_s = min(wait_s, max(0.5, self.timeouts.coordinator_s - silent + 0.1))
            else:   # a silence may begin meanwhile: look again within half of coordinator_s
                wait_s = min(wait_s, max(0.5, self.timeouts.coordinator_s / 2))
            try:
                return await self._request(
                    "commit", epoch=epoch, deadline_s=wait_s + 0.5, identity=self.identity,
                    step=int(step), ok=bool(ok), metadata=metadata or {}, timeout_s=float(wait_s))
            except RtxTimeoutError:
                continue
            except RendezvousError as exc:
                # Not a member any more: we were declared lost while frozen or cut off.
                self._fence(str(exc))
                return {"committed": False, "step": step, "reason": str(exc)}

    async def reform(self, reason: str, epoch: int | None = None, *,
                     evict: list[int] | None = None) -> int:
        """Ask for a new epoch with the same members (see ``reform`` in :mod:`transport.wire`)
        in place of ``epoch`` (default: this rank's current one): only a request naming the
        job's current epoch acts, so a rank that asks after another rank's reform already moved
        it on opens no second epoch. ``evict``: ranks of ``epoch`` to leave out of the new one
        (declared lost, as a frozen rank is), which the coordinator does only when the members
        left are at least the job's ``min_ranks`` (else a plain reform). Returns the job's epoch
        after the request."""
        return (await self.reform_request(reason, epoch, evict=evict))["epoch"]

    async def reform_request(self, reason: str, epoch: int | None = None, *,
                             evict: list[int] | None = None) -> dict[str, Any]:
        """:meth:`reform`, returning the coordinator's whole answer: ``{"epoch"}``, with
        ``"evicted"`` (the ranks it evicted) and, when it refused the eviction, ``"refused"``
        (why: the ranks named hold the job's last committed step and this rank does not)."""
        extra = {"evict": [int(r) for r in evict]} if evict else {}
        return await self._request("reform", epoch=None if epoch is None else int(epoch),
                                   identity=self.identity, reason=reason[:500], **extra)

    async def finish(self) -> dict[str, Any]:
        """Tell the coordinator training is over: the job admits no more ranks (see ``finish`` in
        :mod:`transport.wire`). Returns ``{"epoch", "turned_away"}`` once this agent's membership
        has reached that epoch (the one without the ranks turned away).

        Raises:
            RendezvousError: this agent is not a member (declared lost meanwhile).
            RtxTimeoutError: no answer within ``timeouts.request_s``, or that epoch did not
                arrive within it.
        """
        body = await self._request("finish", identity=self.identity)
        self.training_finished = True
        epoch = int(body["epoch"])
        if self.membership is None or self.membership.epoch < epoch:
            await self.wait_epoch(epoch - 1, timeout_s=self.timeouts.request_s)
        return {"epoch": epoch, "turned_away": int(body.get("turned_away", 0))}

    async def rewind(self, step: int) -> bool:
        """Tell the coordinator training goes on from ``step`` (-1: from scratch), older than the
        job's committed step, because nothing holds the steps after it (see ``rewind`` in
        :mod:`transport.wire`). Returns whether this request moved the job's committed step (False:
        another member's did, or the epoch changed meanwhile); this agent's
        ``membership.committed_step`` follows the job's.

        Raises:
            RendezvousError: this agent is not a member (declared lost meanwhile).
            RtxTimeoutError: no answer within ``timeouts.request_s``.
        """
        body = await self._request("rewind", identity=self.identity, step=int(step))
        m = self.membership
        if m is not None and m.epoch == self.epoch:
            self.membership = replace(m, committed_step=int(body["committed_step"]))
        return bool(body["rewound"])

    async def status(self) -> list[dict[str, Any]]:
        return (await self._request("status"))["jobs"]

    # ------------------------------------------------------------------------------------------
    async def leave(self) -> None:
        """Tell the coordinator this rank leaves in order (not a crash)."""
        if self._client is None or self._closed or self.fenced:
            return
        self._leaving = True   # a heartbeat answered after the leave is not a fence
        try:
            await self._request("leave", identity=self.identity)
        except RtxError as exc:
            log.warning("leave_failed", error=str(exc))

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (``close()``, or the release at interpreter exit)."""
        return self._closed

    async def aclose(self, *, leave: bool = True) -> None:
        """Leave (unless ``leave`` is false), stop heartbeats, close the socket."""
        if self._closed:
            return
        if leave:
            await self.leave()
        self._closed = True
        self._changed.set()
        if self._hb_task is not None:
            self._hb_task.cancel()
            try:
                await self._hb_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._client is not None:
            await self._client.aclose()

