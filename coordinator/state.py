"""The coordinator's decisions: a deterministic function of (state, event, now).

:func:`step` takes the current :class:`State`, one event (a decoded request from an agent, a
disconnect noticed by ZeroMQ, or a clock tick) and the monotonic time, and returns the state and
the actions the shell must carry out: :class:`Record` (append to the write-ahead journal) and
:class:`Send` (a message to one agent). The shell makes every record of a batch durable before it
sends anything, so nothing is acknowledged before it is journaled. No I/O and no clock reads
happen here; tests drive it with a fake clock.

Every state change that must survive a coordinator restart is expressed as a record and applied
through :func:`apply_record`, the same function replay uses, so live and replayed state cannot
drift apart. What is not journaled (pending joiners, heartbeat times, waiters) is rebuilt by the
agents themselves after a restart: heartbeats resume and pending joiners join again.

Ranks: a formed world always has ranks ``0..W-1``. When ranks are lost, survivors keep their
relative order and are renumbered densely; a joiner of a running job takes a free requested rank
or the next one.

``step`` mutates ``state`` in place and returns it (copying the whole state per heartbeat would
cost more than it buys); it is otherwise pure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack

from transport import wire
from transport.codec import DEFAULT_LIMITS

__all__ = [
    "Member",
    "Job",
    "State",
    "Request",
    "Disconnect",
    "Tick",
    "Record",
    "Send",
    "step",
    "apply_record",
    "snapshot",
    "restore",
]


@dataclass
class Member:
    identity: str
    endpoint: str
    host: str
    pid: int
    info: dict
    rank: int | None = None  # requested (pending) or assigned (member)
    last_seen: float = 0.0  # monotonic seconds; not journaled
    joined_at: float = 0.0
    # the epoch that admitted this member (-1: unknown, a snapshot of an older coordinator);
    # a member admitted after the epoch of the last commit has never voted for a step
    since: int = -1
    # the world size this member waits for, as its last heartbeat said (None: it waits for
    # nothing); not journaled: the next heartbeat after a restart says it again
    waiting_for: int | None = None
    # this coordinator process has heard from it (its join, a heartbeat); not journaled: a
    # member replayed after a restart is unheard until its next heartbeat, and status shows no
    # heartbeat age for it (it showed the age since the replay, for ranks dead meanwhile: a
    # tester's find)
    heard: bool = False

    def public(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "endpoint": self.endpoint,
            "host": self.host,
            "pid": self.pid,
            "info": self.info,
        }


@dataclass
class Job:
    job: str
    token: str
    min_ranks: int
    max_ranks: int
    last_call_s: float
    heartbeat_timeout_s: float
    epoch: int = -1  # -1 while the first rendezvous is open
    members: dict[int, Member] = field(default_factory=dict)
    pending: dict[str, Member] = field(default_factory=dict)  # identity -> joiner
    ready_since: float | None = None
    kv: dict[str, bytes] = field(default_factory=dict)
    kv_nbytes: int = 0   # keys (UTF-8) and values of kv, kept by apply_record
    committed_step: int = -1
    committed_epoch: int = -1   # the epoch the last step was committed in
    commit_metadata: dict = field(default_factory=dict)
    # (routing identity, request id) of the last MAX_KV_ANSWERS compare_sets that swapped and
    # deletes that deleted, journaled with their write: such a request resent after a
    # coordinator restart (its answer lost with the old daemon) gets the answer it had, where
    # evaluating it again would find its own write and answer "not swapped" / "not there".
    kv_answers: dict[tuple[str, int], bool] = field(default_factory=dict)
    # per routing identity, the highest request id whose answer was dropped from kv_answers: a
    # write resent with an id at or below it may have taken effect, and is answered "unknown"
    # (RtxTimeoutError) rather than applied again (a breaker's find: a compare_set resent after
    # 1,100 others had run swapped a second time). Request ids grow per identity (one
    # ControlClient each), so no first sending is ever at or below it.
    kv_forgotten: dict[str, int] = field(default_factory=dict)
    # A member said training is over (``finish``): no rank is admitted any more (see _finish).
    finished_training: bool = False
    # identities declared lost, oldest first (a dict as an ordered set: status lists the newest)
    fenced: dict[str, None] = field(default_factory=dict)
    # Not journaled: since when a formed job has had neither members nor joiners (every rank
    # crashed); after a restart the wait starts again from the replay.
    empty_since: float | None = None
    # Not journaled: waiters are agents' open requests, which they repeat after a restart.
    # (routing identity, request id) -> the wait, in the order parked: a kv_unwait finds its wait
    # by key (a scan of them all per withdrawal stalled the daemon when a rank cancelled 4,000
    # waits, and the rank was declared lost: a tester's find)
    kv_waiters: dict[tuple[str, int], KvWaiter] = field(default_factory=dict)
    # identity -> how many of kv_waiters are its, so a wait that ends knows in O(1) whether its
    # client still waits in this job (State.kv_waiting)
    kv_waits_of: dict[str, int] = field(default_factory=dict)
    kv_parked_nbytes: int = 0   # what the parked waits' keys cost, as _parked_nbytes counts
    # Not journaled: when the last step decision came and the mean time between decisions, so a
    # joiner of a job that commits steps is admitted at the next step boundary (see _defer_join).
    last_commit_at: float | None = None
    last_refusal: str = ""   # the last join or claim refused (other bounds, a wrong token): told to waiting ranks
    commit_period_s: float | None = None
    votes: dict[int, dict[int, bool]] = field(default_factory=dict)  # step -> rank -> ok
    commit_waiters: dict[int, list[tuple[str, int, float]]] = field(default_factory=dict)
    vote_metadata: dict[int, dict] = field(default_factory=dict)

    @property
    def formed(self) -> bool:
        return self.epoch >= 0

    def member_by_identity(self, identity: str) -> Member | None:
        for m in self.members.values():
            if m.identity == identity:
                return m
        return None


@dataclass
class State:
    jobs: dict[str, Job] = field(default_factory=dict)
    # identity -> job id, for disconnects and heartbeats (identities are unique per process)
    where: dict[str, str] = field(default_factory=dict)
    # job id -> last committed step, for jobs whose every member left or was lost; a join is
    # refused so a late or restarted rank cannot start a fresh job under the old id. The newest
    # MAX_FINISHED only: a coordinator serving a CI loop for months must not grow without bound.
    finished: dict[str, int] = field(default_factory=dict)
    # Configuration, not journaled: a job whose every rank crashed is kept this long for
    # restarted ranks to rejoin (with its committed step, store and checkpoint record), then
    # dropped. Set by the daemon (--dead-job-ttl).
    dead_job_ttl_s: float = 3600.0
    # Not journaled (rebuilt by a replay of the journal, not by a snapshot): job id -> the
    # processes its coordinator had declared lost (or turned away) when it ended, as
    # _fenced_procs, for a launcher still running one of them (see rtxnet-run); the newest
    # FENCED_AT_END_JOBS jobs.
    fenced_at_end: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Not journaled: (job id, node) -> (host, pid, expiry, last renewal) of the launcher that runs
    # that node of the job (see _claim); after a restart the launchers' next renewals take them.
    # (job, node) -> (host, pid, expires, renewed, (min_ranks, max_ranks) or None)
    claims: dict[tuple[str, int], tuple[str, int, float, float, tuple[int, int] | None, str]] = field(default_factory=dict)
    # Not journaled: identity -> the jobs where it has a kv_wait parked (for its disconnect)
    kv_waiting: dict[str, set[str]] = field(default_factory=dict)


@dataclass(eq=False)
class KvWaiter:
    """A ``kv_wait`` parked until its keys exist or its deadline passes; ``missing`` are the keys
    not yet set (a set of one key wakes only the waiters missing it)."""

    identity: str
    rid: int
    keys: list[str]
    deadline: float
    missing: set[str]
    nbytes: int = 0   # what its keys cost against the bounds (_parked_nbytes)


@dataclass(frozen=True)
class Request:
    identity: str
    msg: dict[str, Any]


@dataclass(frozen=True)
class Disconnect:
    identity: str


@dataclass(frozen=True)
class Tick:
    """The clock moved. ``stalled_s``: how long the coordinator itself did not run before this
    tick (frozen, swapped out, a slow disk), as the shell measured it: silence during that time
    is the coordinator's, not the ranks', so heartbeat ages are moved forward by it before any
    rank is judged late (their heartbeats are still queued, unread, when the shell wakes)."""

    stalled_s: float = 0.0


@dataclass(frozen=True)
class Record:
    """A journal record: a msgpack-able dict with ``k`` naming its kind."""

    data: dict[str, Any]


@dataclass(frozen=True)
class Send:
    identity: str
    msg: dict[str, Any]


@dataclass(frozen=True)
class StatusQuery:
    """A status request. The caller of ``step`` answers it with :func:`answer_status` once the
    batch's events are applied, each distinct question once: a client sending 4,000 status
    requests it never read, each answer 111 KB, stalled the daemon 24-35 s and held 0.9 GB (a
    breaker's find), and sharing an answer only until the next event was defeated by a cheap
    request between each two (a re-verifier's find: 15 s, 2 GB, a job lost)."""

    identity: str
    msg: dict[str, Any]


Action = Record | Send | StatusQuery
Event = Request | Disconnect | Tick


# ------------------------------------------------------------------------------------------------
# helpers that build answers


def _reply(identity: str, req: dict, job: Job | None, **body: Any) -> Send:
    return Send(
        identity,
        wire.make(
            "reply",
            rid=req["rid"],
            job=req["job"],
            epoch=job.epoch if job else -1,
            ok=True,
            body=body,
        ),
    )


MAX_CLAIMS = 4096      # launchers' claims held at once (expired ones are dropped first)
MAX_CLAIM_TTL_S = 600.0
CLAIM_STALE_S = wire.CLAIM_STALE_S


def _token_refused(job_id: str, given: str) -> str:
    """Why a request of job ``job_id`` carrying token ``given`` was refused (never the tokens)."""
    if not given:
        # (a fresh user's find: a rank with no token at all was told its token was wrong)
        return f"no token given for job {job_id!r}, which has one: set RTXNET_TOKEN (or token=) to the job's"
    return f"wrong token for job {job_id!r}"


def _claim(state: State, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    """A launcher takes node ``node`` of job id ``msg["job"]`` for ``ttl_s`` seconds (renewing
    its own claim), so a second launch of that node is refused before it starts any rank (a
    fresh user's find: two launches started together each had ranks refused, and the world
    that formed mixed both). Answers ``{"held": True}``, or ``{"held": False, "by": {"host",
    "pid", "left_s"}}`` while another launcher's claim lasts. ``ttl_s`` 0 gives the claim back
    (its holder's only). ``replaces``: the pid of the holder, on the same host, which the asker
    found gone (a launcher killed and started again on its host need not wait for the claim to
    lapse); taken over only when not renewed for ``CLAIM_STALE_S``. A refusal tells
    ``renewed_s``, the seconds since the holder's last renewal. Not journaled: a restarted
    coordinator holds none until the launchers renew them.

    ``min_ranks``/``max_ranks``: the world the launch's ranks will ask for (its ``--nnodes`` x
    ``--nproc``, ``--min-ranks``). A claim whose bounds differ from another node's live claim
    of the job, or from the job's own, is refused with ``{"held": False, "conflict": {"node",
    "host", "pid", "min_ranks", "max_ranks"}}`` (node -1: the job itself): two hosts of one job
    started at once with different ``--nproc`` each had ranks refused, and whichever joined
    first set the size (a breaker's find)."""
    job_id, node, ttl = msg["job"], msg["node"], msg["ttl_s"]
    if not job_id or len(job_id) > MAX_JOB_ID or not 0 <= node < 1 << 20 or not 0 <= ttl <= MAX_CLAIM_TTL_S:
        actions.append(_error(identity, msg, "ConfigError", f"claim: job {job_id[:40]!r} node {node} ttl_s "
                              f"{ttl!r}: need a job id of 1..{MAX_JOB_ID} characters, a node in "
                              f"0..{(1 << 20) - 1} and ttl_s in [0, {MAX_CLAIM_TTL_S:g}]"))
        return
    if not msg["host"] or not 0 < msg["pid"] < 1 << 31:
        # (a tester's find: host '' and pid -1 were held as a launcher's claim)
        actions.append(_error(identity, msg, "ConfigError", f"claim: host {msg['host'][:40]!r} pid "
                              f"{msg['pid']!r}: need a host name and a process id > 0"))
        return
    bounds = (msg["min_ranks"], msg["max_ranks"]) if "min_ranks" in msg and "max_ranks" in msg else None
    if bounds is not None and not 1 <= bounds[0] <= bounds[1] <= 1 << 20:
        actions.append(_error(identity, msg, "ConfigError", f"claim: min_ranks({bounds[0]!r}) "
                              f"max_ranks({bounds[1]!r}): need 1 <= min_ranks <= max_ranks <= {1 << 20}"))
        return
    # A claim comes with the job's token, as every request of a job: refused when the job, or
    # another node's live claim of it, has another (a tester's find: a launcher without the
    # token held a node of a token-protected job, and the right launcher was refused)
    token = msg.get("token", "")
    key, me = (job_id, node), (msg["host"][:MAX_JOB_ID], msg["pid"])
    held = state.claims.get(key)
    # a renewal (same launcher, bounds and token) was checked when made: no scan of every claim
    renewal = held is not None and held[:2] == me and held[4] == bounds and held[5] == token
    job = state.jobs.get(job_id)
    others = [] if renewal else [(k, other) for (j, k), other in state.claims.items()
                                 if j == job_id and k != node and other[2] > now]
    if (job.token if job is not None else next((other[5] for _, other in others), token)) != token:
        why = _token_refused(job_id, token)
        if job is not None:
            # the ranks waiting for that node hear of it in their "rendezvous_waiting" lines
            # (they waited out the rendezvous timeout with no hint: a netns tester's find)
            job.last_refusal = (f"the launcher of node {node} on {msg['host'][:64]} (pid {msg['pid']}) "
                                f"was refused: {why}")
        actions.append(_error(identity, msg, "RendezvousError", f"claim: {why}"))
        return
    if bounds is not None and ttl > 0 and not renewal:
        if job is not None and (job.min_ranks, job.max_ranks) != bounds:
            actions.append(_reply(identity, msg, None, held=False, conflict={
                "node": -1, "host": "", "pid": 0, "min_ranks": job.min_ranks, "max_ranks": job.max_ranks}))
            return
        for k, other in others:
            if other[4] is not None and other[4] != bounds:
                actions.append(_reply(identity, msg, None, held=False, conflict={
                    "node": k, "host": other[0], "pid": other[1],
                    "min_ranks": other[4][0], "max_ranks": other[4][1]}))
                return
    taken_over = (held is not None and held[0] == me[0] and held[1] == msg.get("replaces")
                  and now - held[3] >= CLAIM_STALE_S)
    if held is not None and held[2] > now and held[:2] != me and not taken_over:
        actions.append(_reply(identity, msg, None, held=False,
                              by={"host": held[0], "pid": held[1], "left_s": round(held[2] - now, 1),
                                  "renewed_s": round(now - held[3], 1)}))
        return
    if ttl == 0:
        state.claims.pop(key, None)
    else:
        if key not in state.claims and len(state.claims) >= MAX_CLAIMS:
            for k in [k for k, v in state.claims.items() if v[2] <= now]:
                del state.claims[k]
            if len(state.claims) >= MAX_CLAIMS:
                actions.append(_error(identity, msg, "ConfigError", f"claim: {MAX_CLAIMS} launches hold "
                                      f"claims already; try again later"))
                return
        kept = held[4] if held is not None and held[:2] == me else None
        state.claims[key] = (*me, now + ttl, now, bounds if bounds is not None else kept, token)
    actions.append(_reply(identity, msg, None, held=True))


def _missing_ranks(job: Job) -> list[int] | None:
    """The ranks below ``min_ranks`` that no pending member asked for, when every pending member
    asked for one (rtxnet-run gives each its launch rank); ``None`` when some did not ask (then
    any newcomer can fill any place). At most 16, so the answer stays small."""
    asked = [m.rank for m in job.pending.values()]
    if not asked or any(r is None for r in asked):
        return None
    return sorted(set(range(job.min_ranks)) - set(asked))[:16]


def _error(identity: str, req: dict, error: str, message: str) -> Send:
    return Send(
        identity,
        wire.make("error", rid=req["rid"], job=req["job"], epoch=-1, error=error, message=message),
    )


def _epoch_push(job: Job, identity: str, lost: list[int], added: list[int], reason: str) -> Send:
    return Send(
        identity,
        wire.make(
            "epoch",
            job=job.job,
            epoch=job.epoch,
            world_size=len(job.members),
            members={r: m.public() for r, m in sorted(job.members.items())},
            lost=lost,
            added=added,
            reason=reason,
            committed_step=job.committed_step,
        ),
    )


# ------------------------------------------------------------------------------------------------
# journal records


def apply_record(state: State, rec: dict[str, Any], now: float) -> None:
    """Apply one journal record to ``state`` (used live by :func:`step` and on replay)."""
    kind = rec["k"]
    if kind == "job":
        state.jobs[rec["job"]] = Job(
            job=rec["job"],
            token=rec["token"],
            min_ranks=rec["min_ranks"],
            max_ranks=rec["max_ranks"],
            last_call_s=rec["last_call_s"],
            heartbeat_timeout_s=rec["heartbeat_timeout_s"],
        )
        return
    job = state.jobs[rec["job"]]
    if kind == "epoch":
        old = {m.identity: m for m in job.members.values()}
        job.epoch = rec["epoch"]
        job.members = {}
        for rank, pub in rec["members"].items():
            was = old.get(pub["identity"])
            prev = was or job.pending.pop(pub["identity"], None)
            last_seen = prev.last_seen if prev else now
            job.members[int(rank)] = Member(
                identity=pub["identity"],
                endpoint=pub["endpoint"],
                host=pub["host"],
                pid=pub["pid"],
                info=pub.get("info") or {},
                rank=int(rank),
                last_seen=last_seen,
                heard=prev.heard if prev else False,
                joined_at=prev.joined_at if prev else now,
                since=was.since if was else rec.get("since", {}).get(int(rank), rec["epoch"]),
            )
            state.where[pub["identity"]] = job.job
        for ident in rec.get("fenced", []):
            job.fenced.pop(ident, None)
            job.fenced[ident] = None
        for ident in rec.get("unfenced", []):
            job.fenced.pop(ident, None)
        job.ready_since = None
        # Votes of the old epoch are void: the members changed.
        job.votes.clear()
        job.vote_metadata.clear()
    elif kind == "kv_set":
        _keep_answer(job, rec)
        old = job.kv.get(rec["key"])
        job.kv_nbytes += _kv_item_nbytes(rec["key"], rec["value"]) - (
            0 if old is None else _kv_item_nbytes(rec["key"], old))
        job.kv[rec["key"]] = rec["value"]
    elif kind == "kv_del":
        _keep_answer(job, rec)
        old = job.kv.pop(rec["key"], None)
        if old is not None:
            job.kv_nbytes -= _kv_item_nbytes(rec["key"], old)
    elif kind == "commit":
        job.committed_step = rec["step"]
        job.committed_epoch = rec.get("epoch", job.epoch)
        job.commit_metadata = rec.get("metadata") or {}
    elif kind == "rewind":
        job.committed_step = rec["step"]
        job.committed_epoch = rec["epoch"] if rec["step"] >= 0 else -1
        job.commit_metadata = {}
    elif kind == "finish":
        job.finished_training = True
    elif kind == "job_drop":
        for m in list(job.pending.values()):
            state.where.pop(m.identity, None)
        del state.jobs[rec["job"]]
    elif kind == "job_end":
        for m in list(job.members.values()) + list(job.pending.values()):
            state.where.pop(m.identity, None)
        state.finished[rec["job"]] = job.committed_step
        while len(state.finished) > MAX_FINISHED:   # the oldest ids go first
            del state.finished[next(iter(state.finished))]
        if job.fenced:
            state.fenced_at_end[rec["job"]] = _fenced_procs(job.fenced)
            while len(state.fenced_at_end) > FENCED_AT_END_JOBS:
                del state.fenced_at_end[next(iter(state.fenced_at_end))]
        del state.jobs[rec["job"]]
    else:
        raise ValueError(f"unknown journal record kind {kind!r}")


# after a refusal that two launches of one job id cause (their ranks fight for its places)
_TWO_LAUNCHES = (": another launch (rtxnet-run) may use this job id; one launch per job id (several hosts: "
                 "--nnodes and --node-rank)")

FENCED_AT_END_JOBS = 64   # jobs whose fenced processes State.fenced_at_end keeps
FENCED_SHOWN = 64         # fenced processes a status answer lists per job


def _fenced_procs(identities: dict[str, None]) -> list[dict[str, Any]]:
    """``[{"host", "pid"}]`` of fenced agents (declared lost, or turned away at the end of
    training), read from their identities (``host/pid/uuid``, rtxnet.Agent's), the newest
    ``FENCED_SHOWN`` sorted: not the identities themselves, which would let a client take over an
    agent's connection (see _status). The newest, not the lowest pids: rtxnet-run kills a frozen
    rank only once it is listed, and in a job past 64 losses one frozen later was not (a leak
    soak's find)."""
    out = []
    for ident in reversed(identities):
        parts = ident.rsplit("/", 2)
        if len(parts) == 3 and parts[0] and parts[1].isdigit() and len(parts[1]) < 10:
            out.append({"host": parts[0], "pid": int(parts[1])})
            if len(out) == FENCED_SHOWN:
                break
    return sorted(out, key=lambda d: (d["host"], d["pid"]))


_KV_WRITES = {"kv_set": "set", "kv_cas": "compare_set", "kv_del": "delete"}   # their API names
MAX_KV_ANSWERS = 1024   # set/compare_set/delete answers a job keeps for resent requests (Job.kv_answers)
MAX_KV_FORGOTTEN = 4096   # identities whose dropped answers a job remembers (Job.kv_forgotten)


def _keep_answer(job: Job, rec: dict[str, Any]) -> None:
    """Keep the answer of the set, compare_set or delete that wrote ``rec`` (its ``by``: routing
    identity and request id), the oldest dropped past ``MAX_KV_ANSWERS`` (their ids kept in
    ``kv_forgotten``, at most ``MAX_KV_FORGOTTEN`` identities, the least recently dropped
    first). Run on every write and on replay alike, so a restarted daemon drops the same."""
    by = rec.get("by")
    if by is None:
        return
    job.kv_answers[(by[0], by[1])] = True
    while len(job.kv_answers) > MAX_KV_ANSWERS:
        ident, rid = next(iter(job.kv_answers))
        del job.kv_answers[(ident, rid)]
        high = max(rid, job.kv_forgotten.pop(ident, rid))
        job.kv_forgotten[ident] = high
        if len(job.kv_forgotten) > MAX_KV_FORGOTTEN:
            del job.kv_forgotten[next(iter(job.kv_forgotten))]


def snapshot(state: State) -> dict[str, Any]:
    """The journaled part of ``state`` as a msgpack-able dict (for compaction)."""
    return {
        "finished": dict(state.finished),
        "jobs": [
            {
                "job": j.job,
                "token": j.token,
                "min_ranks": j.min_ranks,
                "max_ranks": j.max_ranks,
                "last_call_s": j.last_call_s,
                "heartbeat_timeout_s": j.heartbeat_timeout_s,
                "epoch": j.epoch,
                "members": {r: m.public() for r, m in j.members.items()},
                "kv": dict(j.kv),
                "kv_answers": [list(k) for k in j.kv_answers],
                "kv_forgotten": [[i, r] for i, r in j.kv_forgotten.items()],
                "committed_step": j.committed_step,
                "committed_epoch": j.committed_epoch,
                "commit_metadata": j.commit_metadata,
                "fenced": list(j.fenced),   # oldest first
                "since": {r: m.since for r, m in j.members.items()},
                "finished_training": j.finished_training,
            }
            for j in state.jobs.values()
        ]
    }


def restore(snap: dict[str, Any], now: float) -> State:
    """Rebuild a :class:`State` from :func:`snapshot` output; every member counts as seen ``now``."""
    state = State()
    state.finished = dict(snap.get("finished", {}))
    for j in snap["jobs"]:
        apply_record(state, {"k": "job", **{k: j[k] for k in _JOB_FIELDS}, "job": j["job"]}, now)
        if j["epoch"] >= 0:
            apply_record(
                state,
                {"k": "epoch", "job": j["job"], "epoch": j["epoch"], "members": j["members"],
                 "fenced": j["fenced"],
                 # (a snapshot without it: every member counts as having voted)
                 "since": {int(r): e for r, e in j.get("since", dict.fromkeys(j["members"], -1)).items()}},
                now,
            )
        job = state.jobs[j["job"]]
        job.committed_epoch = j.get("committed_epoch", -1)
        job.finished_training = bool(j.get("finished_training", False))
        job.kv = dict(j["kv"])
        job.kv_nbytes = sum(_kv_item_nbytes(k, v) for k, v in job.kv.items())
        job.kv_answers = {(k[0], k[1]): True for k in j.get("kv_answers", [])}
        job.kv_forgotten = {i: r for i, r in j.get("kv_forgotten", [])}
        job.committed_step = j["committed_step"]
        job.commit_metadata = j["commit_metadata"]
    return state


MAX_JOB_ID = wire.MAX_JOB_ID
MAX_KV_WAITERS = 4096       # kv_waits parked at once in one job
# bytes of the keys parked waits hold, in one job and in all (a client with no token parked waits
# on 16 keys of 1 MiB each, 2 GB of the daemon's memory in 1.5 s: a tester's find); a wait waits
# for keys of the job's store, which holds MAX_JOB_KV_NBYTES. Each key counts its UTF-8 and
# PARKED_KEY_OVERHEAD more, the daemon's own memory for it (its str, its place in the wait's list
# and in its set of missing keys: a re-verifier measured about 110 bytes a key of 4 characters,
# 1.37 GB for 14 jobs of 2**20 such keys when only the UTF-8 counted)
MAX_PARKED_KEY_NBYTES = wire.MAX_JOB_KV_NBYTES
MAX_ALL_PARKED_KEY_NBYTES = wire.MAX_KV_NBYTES
PARKED_KEY_OVERHEAD = 128
KV_WAIT_KEYS_SHOWN = 10   # missing keys a kv_wait timeout names (then "... and N more")
KV_WAIT_KEY_CHARS_SHOWN = 200   # characters of each key it names
# The stores are journaled and every snapshot holds them all in one message (the server's
# _SNAPSHOT_LIMITS): a job's store, and all of them together, stay well below that.
MAX_JOB_KV_NBYTES = wire.MAX_JOB_KV_NBYTES
MAX_KV_NBYTES = wire.MAX_KV_NBYTES


def _kv_item_nbytes(key: str, value: bytes) -> int:
    return len(key.encode()) + len(value)


def _kv_refusal(state: State, job: Job, key: str, value: bytes) -> str | None:
    """Why setting ``key`` to ``value`` would take a store past its bound (None: it would not)."""
    old = job.kv.get(key)
    grow = _kv_item_nbytes(key, value) - (0 if old is None else _kv_item_nbytes(key, old))
    if grow <= 0:
        return None
    if job.kv_nbytes + grow > MAX_JOB_KV_NBYTES:
        return (f"store of job {job.job!r}: key {key[:100]!r} would bring it to "
                f"{job.kv_nbytes + grow} bytes, more than the {MAX_JOB_KV_NBYTES} a job's store "
                f"may hold (it is for coordination data; move tensors with the collectives, files "
                f"with checkpoints)")
    total = sum(j.kv_nbytes for j in state.jobs.values())
    if total + grow > MAX_KV_NBYTES:
        return (f"store of job {job.job!r}: key {key[:100]!r} would bring this coordinator's "
                f"stores to {total + grow} bytes, more than the {MAX_KV_NBYTES} it holds for all "
                f"jobs together")
    return None

_JOB_FIELDS = ("token", "min_ranks", "max_ranks", "last_call_s", "heartbeat_timeout_s")


def _record(state: State, actions: list[Action], rec: dict[str, Any], now: float) -> None:
    apply_record(state, rec, now)
    actions.append(Record(rec))


# ------------------------------------------------------------------------------------------------
# the step function


def step(state: State, event: Event, now: float) -> tuple[State, list[Action]]:
    """Decide what ``event`` at monotonic time ``now`` changes and what must be said.

    Returns:
        ``(state, actions)``; ``state`` is the same object, updated.
    """
    actions: list[Action] = []
    if isinstance(event, Tick):
        if event.stalled_s > 0:
            for job in state.jobs.values():
                for m in (*job.members.values(), *job.pending.values()):
                    m.last_seen = min(now, m.last_seen + event.stalled_s)
        for job in list(state.jobs.values()):
            _tick_job(state, job, now, actions)
    elif isinstance(event, Disconnect):
        _drop_waits_of(state, event.identity)
        job_id = state.where.get(event.identity)
        job = state.jobs.get(job_id) if job_id else None
        if job is not None:
            member = job.member_by_identity(event.identity)
            if member is not None:
                _lose(state, job, [member.rank], now, actions, reason="lost")
            elif event.identity in job.pending:
                del job.pending[event.identity]
                state.where.pop(event.identity, None)
                if len(job.pending) < job.min_ranks:
                    job.ready_since = None
    else:
        _request(state, event.identity, event.msg, now, actions)
    return state, actions


def _tick_job(state: State, job: Job, now: float, actions: list[Action]) -> None:
    if job.formed:
        late = [r for r, m in job.members.items() if now - m.last_seen > job.heartbeat_timeout_s]
        if late:
            _lose(state, job, late, now, actions, reason="lost")
        for ident, m in list(job.pending.items()):   # joiners waiting for a step boundary
            if now - m.last_seen > job.heartbeat_timeout_s:
                del job.pending[ident]
                state.where.pop(ident, None)
        if job.pending and not _defer_join(job, now):
            _admit(state, job, now, actions)   # no step decision came in time (or a rank was lost)
        if job.members or job.pending:
            job.empty_since = None
        elif job.empty_since is None:
            job.empty_since = now
        elif now - job.empty_since >= state.dead_job_ttl_s:
            # Every rank crashed and none came back within the TTL: forget the job (a later
            # launch under the same id starts afresh).
            _record(state, actions, {"k": "job_drop", "job": job.job}, now)
            return
    else:
        # Pending joiners that stopped heartbeating are dropped before the world forms.
        for ident, m in list(job.pending.items()):
            if now - m.last_seen > job.heartbeat_timeout_s:
                del job.pending[ident]
                state.where.pop(ident, None)
        if not job.pending:
            # Nobody is waiting any more (they left or vanished): forget the job, so a later
            # launch under the same id starts afresh with its own min/max.
            _record(state, actions, {"k": "job_drop", "job": job.job}, now)
            return
        if len(job.pending) < job.min_ranks:
            job.ready_since = None
        elif job.ready_since is not None and now - job.ready_since >= job.last_call_s:
            _form(state, job, now, actions)
    expired = [w for w in job.kv_waiters.values() if now >= w.deadline]
    _unpark(state, job, expired)
    for waiter in expired:
        missing = [k for k in waiter.keys if k not in job.kv]
        # the first few only: a wait on 100,000 keys must not answer with all of them
        more = f" ... and {len(missing) - KV_WAIT_KEYS_SHOWN} more" if len(missing) > KV_WAIT_KEYS_SHOWN else ""
        # each key shortened too: keys of up to 1 MiB quoted whole made an answer past one
        # message's str, which the client dropped, timing out with "no answer" (a tester's find)
        shown = [k if len(k) <= KV_WAIT_KEY_CHARS_SHOWN else f"{k[:KV_WAIT_KEY_CHARS_SHOWN]}... ({len(k)} characters)"
                 for k in missing[:KV_WAIT_KEYS_SHOWN]]
        actions.append(
            _error(waiter.identity, {"rid": waiter.rid, "job": job.job}, "RtxTimeoutError",
                   f"kv_wait timed out; keys still missing: {shown}{more}")
        )
    for step_no, waiters in list(job.commit_waiters.items()):
        for w in list(waiters):
            ident, rid, deadline = w
            if now >= deadline:
                waiters.remove(w)
                votes = job.votes.get(step_no, {})
                missing = sorted(set(job.members) - set(votes))
                actions.append(
                    _error(ident, {"rid": rid, "job": job.job}, "RtxTimeoutError",
                           f"commit of step {step_no} timed out; ranks that did not vote: {missing}")
                )
        if not waiters:
            del job.commit_waiters[step_no]


def _form(state: State, job: Job, now: float, actions: list[Action]) -> None:
    joiners = sorted(job.pending.values(), key=lambda m: m.joined_at)
    world = len(joiners)
    taken: dict[int, Member] = {}
    free_agents = []
    for m in joiners:
        if m.rank is not None and m.rank < world and m.rank not in taken:
            taken[m.rank] = m
        else:
            free_agents.append(m)
    free_ranks = [r for r in range(world) if r not in taken]
    for r, m in zip(free_ranks, free_agents, strict=True):
        taken[r] = m
    members = {r: taken[r].public() for r in range(world)}
    _record(state, actions, {"k": "epoch", "job": job.job, "epoch": 0, "members": members}, now)
    for m in job.members.values():
        actions.append(_epoch_push(job, m.identity, [], sorted(job.members), "formed"))


def _lose(state: State, job: Job, ranks: list[int], now: float, actions: list[Action], *, reason: str,
          why: str | None = None) -> None:
    ranks = sorted(set(ranks))
    lost_ids = [job.members[r].identity for r in ranks]
    survivors = [m for r, m in sorted(job.members.items()) if r not in ranks]
    members = {i: m.public() for i, m in enumerate(survivors)}
    rec = {
        "k": "epoch",
        "job": job.job,
        "epoch": job.epoch + 1,
        "members": members,
        "fenced": lost_ids if reason in ("lost", "finished") else [],
    }
    _fail_commit_waiters(job, actions, f"epoch changed: ranks {ranks} {reason}")
    _record(state, actions, rec, now)
    for ident in lost_ids:
        state.where.pop(ident, None)
    if reason in ("lost", "finished"):
        # A rank declared lost may still be alive (frozen, cut off): tell it, in case it hears.
        # One turned away at the end of training (_finish) is alive: it hears why.
        why = (f"{why or 'declared lost'}; epoch {job.epoch} formed without it" if reason == "lost" else
               f"{_finished_training(job)}; epoch {job.epoch} formed without this rank")
        for ident in lost_ids:
            actions.append(Send(ident, wire.make("fenced", job=job.job, epoch=job.epoch, reason=why)))
    if not job.members:
        if reason == "left":
            _record(state, actions, {"k": "job_end", "job": job.job}, now)
        # Every member crashed: the job stays, with its committed step, key-value entries and
        # checkpoint record, for restarted ranks to rejoin (for state.dead_job_ttl_s).
        job.empty_since = now
        return
    for m in job.members.values():
        actions.append(_epoch_push(job, m.identity, ranks, [], reason))


def _fail_commit_waiters(job: Job, actions: list[Action], why: str) -> None:
    for step_no, waiters in job.commit_waiters.items():
        for ident, rid, _ in waiters:
            actions.append(
                _reply_raw(job, ident, rid, committed=False, step=step_no, reason=why)
            )
    job.commit_waiters.clear()


def answer_status(state: State, queries: list[StatusQuery], now: float) -> list[Send]:
    """The answers to ``queries``: each distinct question (the job asked about, or all) computed
    once, its body shared by the answers that ask it (not copied: the control server encodes a
    body it has just encoded once, ``ControlServer.send_raw``)."""
    bodies: dict[str, dict[str, Any]] = {}
    out = []
    for q in queries:
        body = bodies.get(q.msg["job"])
        if body is None:
            body = bodies[q.msg["job"]] = _status_body(state, q.msg["job"], now)
        out.append(Send(q.identity, wire.make("reply", rid=q.msg["rid"], job=q.msg["job"], epoch=-1,
                                              ok=True, body=body)))
    return out


def _status_body(state: State, only: str, now: float) -> dict[str, Any]:
    """The status answer about job ``only`` ("": every job)."""
    # finished job ids (they cannot be used again): the one asked about, or the newest ones
    if only:
        fin = {only: state.finished[only]} if only in state.finished else {}
    else:
        fin = dict(list(state.finished.items())[-STATUS_FINISHED:])
    jobs = _status(state, now, only=only or None)
    omitted = _nbytes(jobs) > STATUS_MAX_NBYTES
    if omitted:
        for j in jobs:
            for m in j["members"]:
                m["info"] = {}
    # still too large (thousands of jobs): the first ones that fit, and how many were left out
    total, size, kept = len(jobs), 0, []
    for j in jobs:
        size += _nbytes(j)
        if size > STATUS_MAX_NBYTES:
            break
        kept.append(j)
    at_end = {j: state.fenced_at_end[j] for j in fin if j in state.fenced_at_end} if only else {}
    return {"jobs": kept, "launching": _launching(state, only or None, now),
            "jobs_omitted": total - len(kept), "finished": fin,
            "finished_total": len(state.finished), "info_omitted": omitted, "fenced_at_end": at_end}


def _reply_raw(job: Job, ident: str, rid: int, **body: Any) -> Send:
    return _reply(ident, {"rid": rid, "job": job.job}, job, **body)


def _request(state: State, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    t = msg["t"]
    if t == "status":
        actions.append(StatusQuery(identity, msg))
        return
    if t == "join":
        _join(state, identity, msg, now, actions)
        return
    if t == "claim":
        _claim(state, identity, msg, now, actions)
        return
    job = state.jobs.get(msg["job"])
    if job is None:
        if t == "leave" and msg["job"] in state.finished:
            # a leave sent again after a restart, its first one having ended the job
            actions.append(_reply(identity, msg, None, left=False))
        elif t == "heartbeat":
            actions.append(_reply(identity, msg, None, state="unknown", epoch=-1))
        else:
            actions.append(_error(identity, msg, "RendezvousError", f"unknown job {msg['job']!r}"))
        return
    if msg.get("token", "") != job.token:
        actions.append(_error(identity, msg, "RendezvousError", f"{t}: wrong token for job {job.job!r}"))
        return
    if t in ("heartbeat", "leave", "reform", "finish", "rewind") and msg["identity"] != identity:
        actions.append(_not_yours(identity, msg))
        return
    if t.startswith("kv_") and t != "kv_unwait" and "" in (msg["keys"] if t == "kv_wait" else [msg["key"]]):
        actions.append(_error(identity, msg, "ConfigError", f"{t}: a store key must not be empty"))
        return
    if t == "heartbeat":
        member = job.member_by_identity(msg["identity"])
        if member is not None:
            member.last_seen = now
            member.heard = True
            member.waiting_for = msg.get("waiting_for")
            state.where[member.identity] = job.job
            # committed_step: a rank whose vote is unanswered tells a peer that went on to the next
            # step (its answer came first) from one that skipped a collective (FaultTolerance._vote)
            body: dict[str, Any] = {"state": "member", "rank": member.rank,
                                    "committed_step": job.committed_step}
            if msg["epoch"] != job.epoch:
                # The agent missed a push (e.g. the coordinator restarted between journal and send).
                body["view"] = _epoch_push(job, identity, [], [], "resync").msg
            actions.append(_reply(identity, msg, job, **body))
        elif msg["identity"] in job.pending:
            job.pending[msg["identity"]].last_seen = now
            actions.append(_reply(identity, msg, job, state="pending", joined=len(job.pending),
                                  min_ranks=job.min_ranks, max_ranks=job.max_ranks,
                                  refused=job.last_refusal, missing_ranks=_missing_ranks(job)))
        elif msg["identity"] in job.fenced:
            actions.append(_reply(identity, msg, job, state="fenced"))
        else:
            actions.append(_reply(identity, msg, job, state="unknown"))
    elif t == "leave":
        member = job.member_by_identity(msg["identity"])
        if member is not None:
            actions.append(_reply(identity, msg, job, left=True))
            _lose(state, job, [member.rank], now, actions, reason="left")
        else:
            job.pending.pop(msg["identity"], None)
            state.where.pop(msg["identity"], None)
            actions.append(_reply(identity, msg, job, left=False))
    elif t in _KV_WRITES and (identity, msg["rid"]) in job.kv_answers:
        # sent again after a coordinator restart: it took effect before (journaled), its answer
        # was lost with the daemon that gave it (a set applied again would undo the deletes and
        # writes that followed it)
        actions.append(_reply(identity, msg, job, swapped=True, value=msg["value"]) if t == "kv_cas"
                       else _reply(identity, msg, job, deleted=True) if t == "kv_del"
                       else _reply(identity, msg, job))
    elif t in _KV_WRITES and msg["rid"] <= job.kv_forgotten.get(identity, 0):
        actions.append(_error(identity, msg, "RtxTimeoutError", (
            f"store {_KV_WRITES[t]} of key {msg['key'][:200]!r} was sent again after a coordinator "
            f"restart, but the job's store has answered more than {MAX_KV_ANSWERS} writes since "
            f"(the most whose answers it keeps): whether it took effect is unknown, as after a "
            f"timeout; read the key")))
    elif t == "kv_set" and (why := _kv_refusal(state, job, msg["key"], msg["value"])):
        actions.append(_error(identity, msg, "ConfigError", why))
    elif t == "kv_cas" and job.kv.get(msg["key"]) == msg["expected"] and (
            why := _kv_refusal(state, job, msg["key"], msg["value"])):
        actions.append(_error(identity, msg, "ConfigError", why))
    elif t == "kv_set":
        _record(state, actions, {"k": "kv_set", "job": job.job, "key": msg["key"], "value": msg["value"],
                                 "by": [identity, msg["rid"]]}, now)
        actions.append(_reply(identity, msg, job))
        _wake_kv(state, job, msg["key"], actions)
    elif t == "kv_get":
        actions.append(_reply(identity, msg, job, value=job.kv.get(msg["key"])))
    elif t == "kv_wait":
        keys = msg["keys"]
        bad = _bad_duration(msg, "timeout_s")
        if not all(isinstance(k, str) for k in keys):
            actions.append(_error(identity, msg, "ProtocolError", "kv_wait.keys must be a list of str"))
        elif bad:
            actions.append(_error(identity, msg, "ConfigError", bad))
        elif all(k in job.kv for k in keys):
            actions.append(_reply(identity, msg, job, values={k: job.kv[k] for k in keys}))
        elif (identity, msg["rid"]) in job.kv_waiters:
            # the same request sent again (the channel resends a kv_wait when its connection comes
            # back): the wait parked for it answers it, once
            pass
        elif why := _park_refusal(state, job, keys, nbytes := _parked_nbytes(keys)):
            actions.append(_error(identity, msg, "ConfigError", why))
        else:
            job.kv_waiters[identity, msg["rid"]] = KvWaiter(
                identity, msg["rid"], list(keys), now + float(msg["timeout_s"]),
                {k for k in keys if k not in job.kv}, nbytes)
            job.kv_parked_nbytes += nbytes
            job.kv_waits_of[identity] = job.kv_waits_of.get(identity, 0) + 1
            state.kv_waiting.setdefault(identity, set()).add(job.job)
    elif t == "kv_unwait":
        # only the asker's own wait (identity and request id): one client cannot end another's
        waiter = job.kv_waiters.get((identity, msg["wait_rid"]))
        gone = [waiter] if waiter is not None else []
        _unpark(state, job, gone)
        actions.append(_reply(identity, msg, job, withdrawn=bool(gone)))
    elif t == "kv_cas":
        current = job.kv.get(msg["key"])
        if current == msg["expected"]:
            _record(state, actions, {"k": "kv_set", "job": job.job, "key": msg["key"], "value": msg["value"],
                                     "by": [identity, msg["rid"]]}, now)
            actions.append(_reply(identity, msg, job, swapped=True, value=msg["value"]))
            _wake_kv(state, job, msg["key"], actions)
        else:
            actions.append(_reply(identity, msg, job, swapped=False, value=current))
    elif t == "kv_del":
        existed = msg["key"] in job.kv
        if existed:
            _record(state, actions, {"k": "kv_del", "job": job.job, "key": msg["key"], "by": [identity, msg["rid"]]}, now)
        actions.append(_reply(identity, msg, job, deleted=existed))
    elif t == "commit":
        _commit(state, job, identity, msg, now, actions)
    elif t == "finish":
        _finish(state, job, identity, msg, now, actions)
    elif t == "rewind":
        _rewind(state, job, identity, msg, now, actions)
    elif t == "reform":
        member = job.member_by_identity(msg["identity"])
        evict = _evictable(job, member, msg.get("evict") or [])
        refused = _holders_evicted(job, member, evict) if msg["epoch"] == job.epoch else None
        if member is None:
            actions.append(_not_member(identity, msg, job))
        elif refused is not None:
            # nothing done: the holders' own eviction of the asker (they time out waiting for it
            # too, when the two sides cannot reach each other) is the one that stands
            actions.append(_reply(identity, msg, job, epoch=job.epoch, evicted=[], refused=refused))
        elif msg["epoch"] == job.epoch and evict:
            # ranks late in every try of a step while the others waited: declared lost, as a
            # frozen rank is (fenced: it rejoins if it comes back, after a pause: rtxnet.elastic)
            _lose(state, job, evict, now, actions, reason="lost",
                  why=f"evicted: late in every try of a step while rank {member.rank} and the "
                      f"others waited (their data ports may not reach this one)")
            actions.append(_reply(identity, msg, job, epoch=job.epoch, evicted=evict))
        elif msg["epoch"] == job.epoch:
            members = {r: m.public() for r, m in job.members.items()}
            _fail_commit_waiters(job, actions, f"epoch reformed: {msg['reason']}")
            _record(state, actions, {"k": "epoch", "job": job.job, "epoch": job.epoch + 1, "members": members}, now)
            actions.append(_reply(identity, msg, job, epoch=job.epoch))
            for m in job.members.values():
                actions.append(_epoch_push(job, m.identity, [], [], "reform"))
        else:
            actions.append(_reply(identity, msg, job, epoch=job.epoch))  # someone already did
    else:  # pragma: no cover - wire.validate admits only known types
        actions.append(_error(identity, msg, "ProtocolError", f"{t!r} is not a request"))


def _evictable(job: Job, member: Member | None, evict: list) -> list[int]:
    """The ranks of a reform's ``evict`` to drop: all of them, when each is a member's rank other
    than the asker's and the members left would still be ``min_ranks`` or more; else none (a
    plain reform). Anything else a client sends there (not ints, repeated) is ignored likewise."""
    if (member is None or not evict or len(evict) > len(job.members)
            or any(isinstance(r, bool) or not isinstance(r, int) for r in evict)):
        return []
    ranks = sorted(set(evict))
    if (len(ranks) != len(evict) or member.rank in ranks or any(r not in job.members for r in ranks)
            or len(job.members) - len(ranks) < job.min_ranks):
        return []
    return ranks


def _holders_evicted(job: Job, member: Member | None, evict: list[int]) -> str | None:
    """Why an eviction is refused, or None: one asked by a member admitted after the job's last
    commit (which has not voted for a step yet) that names every member that took part in that
    commit. Hosts that reach the coordinator but not each other evict each other's ranks at
    once; if the readmitted side's eviction stood, the job went back to the steps before its
    absence and the holders' commits were lost, each side committing in turn (a tester's find:
    steps 120 and 121 committed, then rewound to 119, with every rank alive)."""
    if member is None or not evict or job.committed_step < 0 or job.committed_epoch < 0:
        return None
    holders = {r for r, m in job.members.items() if 0 <= m.since <= job.committed_epoch}
    if not holders or member.rank in holders or not holders <= set(evict):
        return None
    return (f"ranks {sorted(holders)} took part in the commit of step {job.committed_step} "
            f"(epoch {job.committed_epoch}) and rank {member.rank}, admitted after it, did not: "
            f"the holders of the job's committed state are not evicted by it")


def _finished_training(job: Job) -> str:
    return (f"job {job.job!r} finished training ({wire.last_committed(job.committed_step)}): it "
            f"admits no new ranks")


def _finish(state: State, job: Job, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    """A member says training is over (``FaultTolerance.finish``, called by every rank after its
    last step): from now on the job admits no rank, so what the members do after training (an
    evaluation, a final checkpoint, a handshake) runs in a world that no longer changes by joins.
    Joiners still waiting are dropped (their next heartbeat is answered "unknown", their join
    again is refused with ``JobFinishedError``), and members admitted after the epoch of the last
    commit, which have not trained a step, are turned away: a new epoch without them, and they
    are fenced (their rejoin is refused the same way). Idempotent: the other ranks' calls find
    it done. The answer, after the new epoch's push on the same connection: the job's epoch and
    how many ranks were turned away."""
    member = job.member_by_identity(msg["identity"])
    if member is None:
        actions.append(_not_member(identity, msg, job))
        return
    dropped = evicted = 0
    if not job.finished_training:
        _record(state, actions, {"k": "finish", "job": job.job}, now)
        for ident in list(job.pending):
            del job.pending[ident]
            state.where.pop(ident, None)
            dropped += 1
        if job.committed_step >= 0 and job.committed_epoch >= 0:
            late = [r for r, m in job.members.items()
                    if m.since > job.committed_epoch and m.identity != member.identity]
            if late:
                evicted = len(late)
                _lose(state, job, late, now, actions, reason="finished")
    actions.append(_reply(identity, msg, job, epoch=job.epoch, turned_away=dropped + evicted))


def _rewind(state: State, job: Job, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    """A member says training goes on from ``step``, older than the job's committed step: no live
    rank and no checkpoint holds the steps after it (every rank was lost; ``FaultTolerance``
    found the committed state gone). The committed step becomes ``step`` (journaled) and its
    epoch the current one, so the steps trained again are voted on: before, their commits were
    answered "already committed" without a vote, and ``finish`` before the old step turned every
    rank away as admitted after the last commit. Only a request naming the current epoch acts,
    and only when it moves the step back: the other members' requests find it done. Nothing of
    this epoch can have voted yet (a member votes after its own request's answer)."""
    member = job.member_by_identity(msg["identity"])
    if member is None:
        actions.append(_not_member(identity, msg, job))
        return
    step_no = msg["step"]
    if step_no < -1:
        actions.append(_error(identity, msg, "ConfigError",
                              f"rewind: step({step_no}) must be -1 (from scratch) or a step >= 0"))
        return
    rewound = msg["epoch"] == job.epoch and step_no < job.committed_step
    if rewound:
        _record(state, actions, {"k": "rewind", "job": job.job, "step": step_no, "epoch": job.epoch}, now)
    actions.append(_reply(identity, msg, job, rewound=rewound, committed_step=job.committed_step))


def _wake_kv(state: State, job: Job, key: str, actions: list[Action]) -> None:
    """Answer the waits that ``key``, just set, completes."""
    done = []
    for waiter in job.kv_waiters.values():
        if key not in waiter.missing:
            continue
        waiter.missing.discard(key)
        if not waiter.missing:   # (a key of it deleted since: still missing, wait on)
            waiter.missing = {k for k in waiter.keys if k not in job.kv}
        if not waiter.missing:
            done.append(waiter)
            actions.append(_reply_raw(job, waiter.identity, waiter.rid,
                                      values={k: job.kv[k] for k in waiter.keys}))
    _unpark(state, job, done)


def _parked_nbytes(keys: list[str]) -> int:
    """What parking a wait on ``keys`` costs against MAX_PARKED_KEY_NBYTES and
    MAX_ALL_PARKED_KEY_NBYTES: each key's UTF-8 and PARKED_KEY_OVERHEAD."""
    return sum(len(k.encode()) for k in keys) + PARKED_KEY_OVERHEAD * len(keys)


def _park_refusal(state: State, job: Job, keys: list[str], nbytes: int) -> str | None:
    """Why a ``kv_wait`` on ``keys`` (``nbytes`` as :func:`_parked_nbytes` counts) cannot be
    parked in ``job``, or None: each parked wait holds its keys (a tester parked 600 waits of
    50,000 keys, 2.2 GB, another 16 keys of 1 MiB per wait, 2 GB in 1.5 s)."""
    head = (f"kv_wait of {len(keys)} keys ({nbytes} bytes, each key's UTF-8 and {PARKED_KEY_OVERHEAD} "
            f"more): job {job.job!r} already has {len(job.kv_waiters)} waits")
    if len(job.kv_waiters) >= MAX_KV_WAITERS:
        return f"{head} open; at most {MAX_KV_WAITERS} wait at once"
    if job.kv_parked_nbytes + nbytes > MAX_PARKED_KEY_NBYTES:
        return (f"{head} open on keys of {job.kv_parked_nbytes} bytes; the keys a job's waits hold "
                f"together are at most {MAX_PARKED_KEY_NBYTES} bytes")
    total = sum(j.kv_parked_nbytes for j in state.jobs.values())   # only when a wait parks
    if total + nbytes > MAX_ALL_PARKED_KEY_NBYTES:
        return (f"{head}; the waits of all jobs on this coordinator hold keys of {total} bytes, and "
                f"together they hold at most {MAX_ALL_PARKED_KEY_NBYTES}")
    return None


def _unpark(state: State, job: Job, gone: list[KvWaiter]) -> None:
    """Take ``gone`` out of ``job``'s parked waits: O(len(gone)), however many stay parked."""
    for w in gone:
        if job.kv_waiters.get((w.identity, w.rid)) is not w:
            continue   # not parked (any more): nothing of it to give back
        del job.kv_waiters[w.identity, w.rid]
        job.kv_parked_nbytes -= w.nbytes
        left = job.kv_waits_of[w.identity] - 1
        if left:
            job.kv_waits_of[w.identity] = left
            continue
        del job.kv_waits_of[w.identity]
        jobs = state.kv_waiting.get(w.identity)
        if jobs is not None:
            jobs.discard(job.job)
            if not jobs:
                del state.kv_waiting[w.identity]


def _drop_waits_of(state: State, identity: str) -> None:
    """Forget the parked ``kv_wait``s of a client whose connection closed: nobody would read
    their answers (they held the daemon's memory after the client left: a tester's find)."""
    for job_id in state.kv_waiting.pop(identity, set()):
        job = state.jobs.get(job_id)
        if job is not None:   # (kv_waiting's entry is gone already: _unpark finds none)
            _unpark(state, job, [w for w in job.kv_waiters.values() if w.identity == identity])


def _bad_duration(msg: dict, name: str) -> str | None:
    """Why ``msg[name]`` is not a deadline the coordinator can keep (NaN or infinity would park a
    waiter that never times out; a negative one is a caller's bug), or None when it is fine."""
    v = msg[name]
    if not 0 <= v < math.inf:   # NaN fails too
        return f"{msg['t']}.{name}({v!r}) must be a finite number of seconds >= 0"
    return None


def _not_yours(identity: str, msg: dict) -> Send:
    """The refusal of a request that names an agent other than the connection it came on (each
    agent's ZeroMQ routing id is its identity): a client speaks only for itself."""
    return _error(identity, msg, "RendezvousError",
                  f"{msg['t']}: identity {msg['identity']!r} is not this connection's ({identity!r}); "
                  f"a client acts only for itself")


def _not_member(identity: str, msg: dict, job: Job) -> Send:
    """The refusal of a member's request (commit, reform, finish) from an agent that is not one
    (declared lost meanwhile)."""
    return _error(identity, msg, "RendezvousError",
                  f"{msg['identity']} is not a member of epoch {job.epoch} of job {job.job!r}")


def _commit(state: State, job: Job, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    bad = _bad_duration(msg, "timeout_s")
    if not bad and msg["step"] < 0:
        bad = f"commit: step({msg['step']}) is negative; steps count from 0"
    if not bad:
        bad = _not_json_like(msg.get("metadata") or {}, "commit.metadata", MAX_METADATA_NBYTES,
                             "a commit may carry (it is journaled with the step)")
    if bad:
        actions.append(_error(identity, msg, "ConfigError", bad))
        return
    if msg["identity"] != identity:
        actions.append(_not_yours(identity, msg))
        return
    member = job.member_by_identity(msg["identity"])
    if member is None:
        actions.append(_not_member(identity, msg, job))
        return
    if msg["epoch"] != job.epoch:
        actions.append(_reply(identity, msg, job, committed=False, step=msg["step"], reason=f"stale epoch {msg['epoch']} (current {job.epoch})"))
        return
    step_no = msg["step"]
    if step_no <= job.committed_step:
        actions.append(_reply(identity, msg, job, committed=True, step=step_no, reason="already committed"))
        return
    votes = job.votes.setdefault(step_no, {})
    votes[member.rank] = bool(msg["ok"]) and votes.get(member.rank, True)
    if msg.get("metadata") and member.rank == min(job.members):
        job.vote_metadata[step_no] = msg["metadata"]
    job.commit_waiters.setdefault(step_no, []).append((identity, msg["rid"], now + float(msg["timeout_s"])))
    if set(votes) >= set(job.members):
        ok = all(votes[r] for r in job.members)
        failed = sorted(r for r in job.members if not votes[r])
        waiters = job.commit_waiters.pop(step_no, [])
        job.votes.pop(step_no, None)
        if ok:
            _record(state, actions, {"k": "commit", "job": job.job, "step": step_no, "epoch": job.epoch,
                                     "metadata": job.vote_metadata.pop(step_no, {})}, now)
        if job.last_commit_at is not None:
            dt = now - job.last_commit_at
            job.commit_period_s = dt if job.commit_period_s is None else 0.7 * job.commit_period_s + 0.3 * dt
        job.last_commit_at = now
        if job.pending:
            # Joiners waited for this step boundary: the new epoch reaches every member before
            # its vote's answer (one connection, in order), so the next step starts in it.
            _admit(state, job, now, actions)
        for ident, rid, _ in waiters:
            actions.append(_reply_raw(job, ident, rid, committed=ok, step=step_no, failed=failed,
                                      reason="" if ok else f"ranks {failed} voted failure"))


def _join(state: State, identity: str, msg: dict, now: float, actions: list[Action]) -> None:
    job_id = msg["job"]
    ident = msg["identity"]

    def refuse(error: str, text: str) -> None:
        actions.append(_error(identity, msg, error, text))

    if not job_id:
        return refuse("ConfigError", "job id must not be empty")
    if ident != identity:
        return actions.append(_not_yours(identity, msg))
    min_r, max_r = msg["min_ranks"], msg["max_ranks"]
    if not (1 <= min_r <= max_r):
        return refuse("ConfigError", f"need 1 <= min_ranks({min_r}) <= max_ranks({max_r})")
    if max_r > MAX_RANKS:
        return refuse("ConfigError", f"max_ranks({max_r}) is above the {MAX_RANKS} ranks a job may have")
    # every member connects to it: one that cannot be parsed (or empty: a real agent always has
    # one) would break the others' views
    endpoint = _ENDPOINT.fullmatch(msg["endpoint"])
    if endpoint is None:
        return refuse("ConfigError", f"endpoint {msg['endpoint'][:100]!r} is not tcp://HOST:PORT[?bulk=PORT]")
    for port in endpoint.group("port", "bulk"):
        if port is not None and not 1 <= int(port) <= 65535:
            return refuse("ConfigError", f"endpoint {msg['endpoint'][:100]!r}: port {port} is not in 1..65535")
    # both go into every member's epoch push and every status answer; the host name is also part
    # of the agent's identity (rtxnet.topology.host_id checks the same bound)
    host_nbytes = len(msg["host"].encode())
    if not 0 < host_nbytes <= MAX_HOST_BYTES:
        return refuse("ConfigError", f"join.host {msg['host'][:40]!r}{'...' if len(msg['host']) > 40 else ''} "
                      f"is {host_nbytes} bytes of UTF-8; it must be 1 to {MAX_HOST_BYTES}")
    if len(msg["endpoint"]) > MAX_ENDPOINT:
        return refuse("ConfigError", f"join.endpoint must be at most {MAX_ENDPOINT} characters "
                      f"(got {len(msg['endpoint'])})")
    if len(msg["token"]) > MAX_TOKEN:
        return refuse("ConfigError", f"join.token is {len(msg['token'])} characters, more than the "
                      f"{MAX_TOKEN} a job token may have")
    if len(job_id) > MAX_JOB_ID or len(ident) > MAX_JOB_ID:
        return refuse("ConfigError", f"job id and identity must be at most {MAX_JOB_ID} characters "
                      f"(got {len(job_id)} and {len(ident)})")
    if not job_id.isprintable():   # it is printed in every log line and status answer of the job
        return refuse("ConfigError", f"job id {job_id[:40]!r} holds a control character (a newline, "
                      f"an escape, ...); give a printable one")
    if not (math.isfinite(msg["heartbeat_timeout_s"]) and math.isfinite(msg["last_call_s"])):
        return refuse("ConfigError", f"heartbeat_timeout_s({msg['heartbeat_timeout_s']}) and "
                      f"last_call_s({msg['last_call_s']}) must be finite")
    if not (MIN_HEARTBEAT_TIMEOUT_S <= msg["heartbeat_timeout_s"] <= MAX_SECONDS
            and 0 <= msg["last_call_s"] <= MAX_SECONDS):
        return refuse("ConfigError", f"heartbeat_timeout_s({msg['heartbeat_timeout_s']}) must be in "
                      f"[{MIN_HEARTBEAT_TIMEOUT_S:g}, {MAX_SECONDS:g}] and last_call_s({msg['last_call_s']}) "
                      f"in [0, {MAX_SECONDS:g}]")
    if not 0 < msg["pid"] < 2**31:
        return refuse("ConfigError", f"join.pid({msg['pid']}) is not a process id")
    bad = _not_json_like(msg.get("info") or {}, "join.info", MAX_INFO_NBYTES,
                         "a member may publish (it is in every status answer)")
    if bad:
        return refuse("ConfigError", bad)
    rank = msg["rank"]
    if rank is not None and not (0 <= rank < max_r):
        return refuse("RendezvousError", f"requested rank {rank} is outside 0..{max_r - 1} (max_ranks={max_r})")
    job = state.jobs.get(job_id)
    if job is None and len(state.jobs) >= MAX_JOBS and not _drop_a_dead_job(state, now, actions):
        # running, forming and crashed (kept for restarts) jobs: each is in every snapshot
        return refuse("RendezvousError", f"this coordinator holds {len(state.jobs)} jobs, the most "
                      f"it keeps (MAX_JOBS); job {job_id[:100]!r} cannot start until one ends or crashes "
                      f"(each has a rank connected or joining)")
    if job is None and job_id in state.finished:
        return refuse("JobFinishedError", f"job {job_id!r} has finished "
                      f"({wire.last_committed(state.finished[job_id])}); a job id is used once: start a new one "
                      f"(RTXNET_JOB or rtxnet.init(job=...); rtxnet-run makes a fresh one unless "
                      f"given --job)")
    if job is None and msg.get("rejoin"):
        return refuse("RendezvousError", f"job {job_id!r} is gone (the coordinator does not know it): nothing to rejoin")
    if job is None:
        _record(state, actions, {"k": "job", "job": job_id, "token": msg["token"], "min_ranks": min_r, "max_ranks": max_r,
                                 "last_call_s": float(msg["last_call_s"]), "heartbeat_timeout_s": float(msg["heartbeat_timeout_s"])}, now)
        job = state.jobs[job_id]
    if msg["token"] != job.token:
        why = _token_refused(job_id, msg["token"])
        job.last_refusal = f"a rank on {msg['host'][:64]} (pid {msg['pid']}) was refused: {why}"
        return refuse("RendezvousError", why)
    if (min_r, max_r) != (job.min_ranks, job.max_ranks):
        # the ranks waiting for it hear of it too (their "rendezvous_waiting" lines), instead of
        # waiting out their rendezvous timeout for a rank that will never come
        job.last_refusal = (f"a rank on {msg['host'][:64]} (pid {msg['pid']}) asking for min_ranks({min_r}) "
                            f"max_ranks({max_r}) was refused")
        return refuse("ConfigError", f"job {job_id!r} has min_ranks({job.min_ranks}) max_ranks({job.max_ranks}), "
                      f"but this rank ({ident}) asks for min_ranks({min_r}) max_ranks({max_r}): start every rank "
                      f"of a job with the same bounds (RTXNET_WORLD_SIZE, RTXNET_MIN_RANKS, RTXNET_MAX_RANKS; "
                      f"under rtxnet-run, the same --nnodes, --nproc and --min-ranks on every node)")
    other = state.where.get(ident)
    if other is not None and other != job_id:
        return refuse("RendezvousError", f"identity {ident!r} already belongs to job {other!r}")
    newcomer = Member(identity=ident, endpoint=msg["endpoint"], host=msg["host"], pid=msg["pid"],
                      info=msg.get("info") or {}, rank=rank, last_seen=now, joined_at=now, heard=True)
    if not job.formed:
        if ident in job.pending:   # a repeated join (sent again: the first may have been lost)
            job.pending[ident].last_seen = now
            job.pending[ident].heard = True
            actions.append(_reply(identity, msg, job, state="pending"))
            return
        if rank is not None:
            for m in job.pending.values():
                if m.rank == rank:
                    return refuse("RendezvousError", f"rank {rank} of job {job_id!r} is already claimed by pid "
                                  f"{m.pid} on {m.host}{_TWO_LAUNCHES}")
        if len(job.pending) >= job.max_ranks:
            return refuse("JobFullError", f"job {job_id!r} is full (max_ranks={job.max_ranks}){_TWO_LAUNCHES}")
        job.pending[ident] = newcomer
        state.where[ident] = job_id
        actions.append(_reply(identity, msg, job, state="pending"))
        if len(job.pending) >= job.min_ranks and job.ready_since is None:
            job.ready_since = now
        if len(job.pending) == job.max_ranks or (job.ready_since is not None and job.last_call_s == 0):
            _form(state, job, now, actions)
        return
    # The job is running: this is a rejoin or a replacement.
    existing = job.member_by_identity(ident)
    if existing is not None:
        # A repeated join (a late "fenced" notice, a retry): it is a member; say so and resend the
        # current epoch instead of refusing.
        job.fenced.pop(ident, None)
        existing.heard = True
        actions.append(_reply(identity, msg, job, state="member"))
        actions.append(_epoch_push(job, ident, [], [], "resync"))
        return
    # Ranks of a running job are dense (renumbered at every loss): a requested rank is honoured
    # only if it is the free one, else the joiner gets the free one; it is not refused (a
    # restarted process cannot get back a rank that renumbering gave to a survivor).
    if ident in job.pending:   # a repeated join while it waits for its step boundary
        job.pending[ident].last_seen = now
        job.pending[ident].heard = True
        actions.append(_reply(identity, msg, job, state="pending"))
        return
    if job.finished_training:
        return refuse("JobFinishedError", f"{_finished_training(job)}; its members are ending")
    if len(job.members) + len(job.pending) >= job.max_ranks:
        unheard = sorted(m.rank for m in job.members.values() if not m.heard)
        if unheard:
            # members replayed after a coordinator restart, not heard from since: most likely
            # the rank this joiner replaces, declared lost after the heartbeat timeout (the
            # "another launch" hint misled here: a soak test's find)
            return refuse("JobFullError", f"job {job_id!r} is full (max_ranks={job.max_ranks}), "
                          f"with rank{'s' if len(unheard) > 1 else ''} {', '.join(map(str, unheard))} "
                          f"not heard from since the coordinator restarted: declared lost after "
                          f"the heartbeat timeout if gone, then this one joins")
        return refuse("JobFullError", f"job {job_id!r} is full (max_ranks={job.max_ranks}){_TWO_LAUNCHES}")
    job.pending[ident] = newcomer
    state.where[ident] = job_id
    actions.append(_reply(identity, msg, job, state="pending"))
    if not _defer_join(job, now):
        _admit(state, job, now, actions)


def _drop_a_dead_job(state: State, now: float, actions: list[Action]) -> bool:
    """With ``MAX_JOBS`` held, make room for a new job: drop the job dead longest, those with no
    committed step to lose first. Dead: a forming job whose joiners have all been silent
    ``FORMING_SILENT_S`` at least (a live joiner heartbeats every fraction of a second; one
    client holding 4,000 connections, each joining a job of its own with a heartbeat timeout of
    an hour, kept every new job out for that hour: a breaker's find), dead since its last joiner
    was heard; or a crashed job (formed, no member or joiner connected), dead since it crashed.
    Crashed jobs are kept for ``dead_job_ttl_s`` only while there is room: one client joining
    4,100 one-rank jobs and closing, in 10 s, left 4,096 crashed ones that kept every new job
    out for the hour (a breaker's find). A crashed job that committed a step goes only when no
    other dead job is held: it is what a restarted rank would resume from. Running jobs, forming
    ones that heartbeat and crashed ones a launcher claims (``_claim``) are kept. Whether one was dropped; O(jobs), only when full."""
    silent_since = now - FORMING_SILENT_S
    # a crashed job whose launcher still claims a node of it is about to get its ranks back
    # (rtxnet-run waits up to 5 s before restarting a rank that crashed soon after its start)
    launched = {job_id for (job_id, _), claim in state.claims.items() if claim[2] > now}
    chosen, best = None, None
    for job in state.jobs.values():
        if not job.formed:
            heard = max((m.last_seen for m in job.pending.values()), default=-math.inf)
            if heard > silent_since:
                continue
            key = (False, heard)
        elif job.members or job.pending or job.job in launched:
            continue   # running, or crashed with ranks rejoining it or a launcher restarting them
        else:
            # (empty_since is set when it crashes and again at the daemon's start; a state
            # restored without the daemon may lack it)
            key = (job.committed_step >= 0, job.empty_since if job.empty_since is not None else now)
        if best is None or key < best:   # (ties: the first held, the oldest job)
            chosen, best = job, key
    if chosen is None:
        return False
    _unpark(state, chosen, list(chosen.kv_waiters.values()))
    _record(state, actions, {"k": "job_drop", "job": chosen.job}, now)
    return True


def _join_window_s(job: Job) -> float:
    """How long a joiner of a job that commits steps waits for the next step decision: three
    mean step periods, at least the heartbeat timeout."""
    return max(job.heartbeat_timeout_s, 3 * (job.commit_period_s or 0.0))


def _defer_join(job: Job, now: float) -> bool:
    """Whether joiners of the running ``job`` wait for its next step decision: the members are
    committing steps (a decision within :func:`_join_window_s`) and can go on without them
    (``min_ranks`` present). A new epoch in the middle of a step fails the step on every member
    (ClosedError: redone after a rollback); at the decision it costs nothing."""
    return (len(job.members) >= job.min_ranks and job.last_commit_at is not None
            and now - job.last_commit_at <= _join_window_s(job))


def _admit(state: State, job: Job, now: float, actions: list[Action]) -> None:
    """Open one epoch adding every waiting joiner of the running ``job`` (a requested rank is
    honoured if it is the next free one; ranks stay dense) and push it to every member."""
    members = {r: m.public() for r, m in job.members.items()}
    added = []
    for m in sorted(job.pending.values(), key=lambda m: m.joined_at):
        r = len(members)
        members[r] = m.public()
        added.append(r)
    if not added:
        return
    _record(state, actions, {"k": "epoch", "job": job.job, "epoch": job.epoch + 1, "members": members,
                             "unfenced": [members[r]["identity"] for r in added]}, now)
    _fail_commit_waiters(job, actions, f"epoch changed: rank{'s' if len(added) > 1 else ''} "
                                       f"{', '.join(map(str, added))} joined")
    for m in job.members.values():
        actions.append(_epoch_push(job, m.identity, [], added, "joined"))


STATUS_FINISHED = 20   # finished job ids a status lists (the newest)
MAX_RANKS = 65536      # ranks of one job
_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})(\?bulk=(?P<bulk>\d{1,5}))?")
MAX_SECONDS = 3600.0   # the longest heartbeat timeout or last call a join may ask for
# the shortest heartbeat timeout a join may ask for: rtxnet.Timeouts' shortest heartbeat interval
# (config.MIN_HEARTBEAT_INTERVAL_S); below it a job formed and crashed at once (1e-300 was taken:
# a breaker's find)
MIN_HEARTBEAT_TIMEOUT_S = 0.01
MAX_INFO_NBYTES = 16 * 1024   # a member's published info (topology), encoded
MAX_JOBS = 4096               # jobs a coordinator holds at once (running, forming, crashed)
FORMING_SILENT_S = 10.0       # a forming job silent this long may make room for a new one when full
MAX_HOST_BYTES = wire.MAX_HOST_BYTES   # bytes (UTF-8) of a member's host name
MAX_TOKEN = wire.MAX_TOKEN             # characters of a job token
MAX_ENDPOINT = 512            # characters of a member's data endpoint
# a status answer above this leaves the members' info out (it must fit one message)
STATUS_MAX_NBYTES = DEFAULT_LIMITS.max_message_nbytes // 2


MAX_METADATA_NBYTES = 64 * 1024   # a commit's metadata, encoded
MAX_FINISHED = 100_000            # finished job ids kept (refused if used again), newest first
MAX_VALUE_DEPTH = wire.MAX_VALUE_DEPTH


def _not_json_like(obj: Any, what: str, max_nbytes: int, why: str) -> str | None:
    """Why ``obj`` (a member's info, a commit's metadata) cannot be kept, or None: not JSON-like
    (``wire.json_like_problem``), or encoded larger than ``max_nbytes``."""
    bad = wire.json_like_problem(obj, what)
    if bad:
        return bad
    nbytes = _nbytes(obj)
    if nbytes > max_nbytes:
        return f"{what} is {nbytes} bytes encoded, more than the {max_nbytes} {why}"
    return None


def _nbytes(obj: Any) -> int:
    """Encoded size of ``obj`` (msgpack, as the wire carries it), bytes."""
    return len(msgpack.packb(obj, use_bin_type=True))


STATUS_LAUNCHING = 64   # jobs a status answer lists as launching (claimed, no rank joined yet)


def _launching(state: State, only: str | None, now: float) -> list[dict[str, Any]]:
    """Jobs that a launcher's live claim (``_claim``) holds and no rank has joined yet (its ranks
    import, or wait before ``rtxnet.init()``): ``[{"job", "state": "launching", "committed_step":
    -1, "launchers": [{"node", "host", "pid"}], "members": []}]`` (the keys of a finished job's
    ``rtxnet status --json`` entry, and the launchers), at most ``STATUS_LAUNCHING`` jobs. Before, such
    a job showed as "no jobs" while a second launch of it was refused naming the first (a
    breaker's find)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for (job_id, node), claim in state.claims.items():
        if (claim[2] <= now or job_id in state.jobs or job_id in state.finished
                or (only is not None and job_id != only)):
            continue
        if job_id in out or len(out) < STATUS_LAUNCHING:
            out.setdefault(job_id, []).append({"node": node, "host": claim[0], "pid": claim[1]})
    return [{"job": j, "state": "launching", "committed_step": -1,
             "launchers": sorted(v, key=lambda d: d["node"]), "members": []}
            for j, v in sorted(out.items())]


def _status(state: State, now: float, only: str | None = None) -> list[dict[str, Any]]:
    out = []
    jobs = state.jobs.values() if only is None else [state.jobs[only]] if only in state.jobs else []
    for job in jobs:
        out.append({
            "job": job.job,
            # "crashed": formed, every member lost; kept for restarted ranks (dead_job_ttl_s)
            "state": ("running" if job.members else "crashed") if job.formed else "rendezvous",
            "epoch": job.epoch,
            "world_size": len(job.members),
            "min_ranks": job.min_ranks,
            "max_ranks": job.max_ranks,
            "pending": len(job.pending),
            "missing_ranks": None if job.formed else _missing_ranks(job),
            "committed_step": job.committed_step,
            "finished_training": job.finished_training,
            "kv_keys": len(job.kv),
            "kv_waits": len(job.kv_waiters),   # store waits parked now (at most MAX_KV_WAITERS)
            "members": [
                # no identity: it is the agent's ZeroMQ routing id, and a client that knows it
                # could take over the agent's connection (ROUTER_HANDOVER)
                {"rank": r, "host": m.host, "pid": m.pid,
                 "heartbeat_age_s": round(max(0.0, now - m.last_seen), 3) if m.heard else None,
                 "info": m.info,
                 "waiting_for": m.waiting_for}
                for r, m in sorted(job.members.items())
            ],
            # processes declared lost (or turned away at the end of training) and not back
            "fenced": _fenced_procs(job.fenced),
        })
    return out
