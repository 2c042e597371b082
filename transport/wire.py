"""The wire contract: every control message between agents and the coordinator, in one place.

A message is a msgpack map. Every message carries the header fields:

    v      int   protocol version (:data:`PROTOCOL_VERSION`); another version is a ProtocolError
    t      str   message type, one of :data:`MESSAGES`
    rid    int   request id chosen by the sender (0 for pushes); replies echo it
    job    str   job id ("" for job-less requests such as ``status``)
    epoch  int   the sender's epoch (-1 when it has none yet)

and then the fields of its type, listed below with their types and whether they are required.
Bytes travel as msgpack ``bin``; nothing is ever pickled. Integers must fit in 64 bits. A job id
and an agent identity are at most :data:`MAX_JOB_ID` characters (the coordinator refuses a longer
one with a ``ConfigError``; ``rtxnet-run`` checks ``--job`` against the same bound). A ``join``'s
``token`` is at most :data:`MAX_TOKEN` characters, its ``host`` not empty and at most
:data:`MAX_HOST_BYTES` bytes of UTF-8, and its ``endpoint`` ``tcp://HOST:PORT[?bulk=PORT]`` with
ports in 1..65535 (a ``ConfigError`` naming the value otherwise). Durations
(``*_s`` fields) must be finite: the coordinator answers a request with a NaN, infinite or negative
duration (``heartbeat_timeout_s`` also 0) with a ``ConfigError`` naming the field and the value.

Requests (agent -> coordinator) are answered with ``reply`` (same ``rid``, ``ok`` true and the
answer's fields) or ``error`` (same ``rid``, the error's class name and message). Pushes
(coordinator -> agent) have ``rid`` 0 and need no answer.

Message types and their meaning:

- ``join``: ask to enter a job's rendezvous (creating the job if it does not exist) or to rejoin a
  formed job. Answered at once (``reply`` with ``state`` "pending" or "member"); the world itself
  arrives later as an ``epoch`` push.
- ``heartbeat``: "I am alive"; answered with the job's epoch and this agent's standing (``member``,
  ``pending``, ``fenced`` or ``unknown``), so an agent learns that the coordinator restarted or that
  it was declared lost; a ``pending`` answer also says how many have ``joined`` the rendezvous and
  its ``min_ranks`` / ``max_ranks``, and, when every pending rank asked for its place, which
  places below ``min_ranks`` no one asked for (``missing_ranks``). A member waiting for the world to grow (a fault-tolerant
  job below its ``min_world_size``) says for what size (``waiting_for``), for ``status``.
- ``leave``: orderly exit of a rank; distinct from a crash.
- ``kv_set`` / ``kv_get`` / ``kv_wait`` / ``kv_cas`` / ``kv_del``: the job's key-value store. A
  ``kv_wait`` reply comes when the key exists or the request's ``timeout_s`` runs out.
- ``kv_unwait``: the client's ``kv_wait`` of request id ``wait_rid`` was cancelled: the
  coordinator forgets it (it stayed parked until its timeout, and 4,096 cancelled waits refused
  every wait of the job: a breaker's find); the reply says whether it was still ``withdrawn``.
- ``commit``: a rank's vote that ``step`` succeeded (or failed) in ``epoch``; the reply comes once
  every member voted (``committed`` true only if all voted success) or the epoch changed.
- ``reform``: a member's request to open a new epoch with the same members, after an operation
  failed without anyone being lost (a timeout, a mismatch, a message lost to a partition): the
  ranks' sequence numbers may no longer agree, and only a fresh epoch realigns them. Only a request
  that names the current epoch acts, so many ranks asking at once open one epoch.
- ``finish``: a member says training is over: the job admits no more ranks, waiting joiners are
  dropped, and members admitted after the epoch of the last commit are turned away (fenced, in a
  new epoch with reason ``finished``); the reply carries the job's ``epoch`` and how many ranks
  were ``turned_away``. Idempotent.
- ``rewind``: a member of the current epoch says training goes on from ``step`` (-1: from
  scratch), older than the job's last committed step, because no live rank and no checkpoint
  holds the steps after it (``FaultTolerance`` after every rank was lost): the job's committed
  step becomes ``step`` (journaled), so the steps trained again are voted on anew. The reply
  carries ``rewound`` (false when the epoch is not the current one, or the committed step is not
  newer than ``step``: another member's request already did it) and the job's ``committed_step``.
- ``status``: a snapshot of every job for ``rtxnet status``.
- ``epoch`` (push): a new epoch was formed; carries the members and the ranks lost or added.
- ``fenced`` (push): this agent belongs to an epoch that is gone; it must rejoin.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "HEADER",
    "MESSAGES",
    "REQUESTS",
    "PUSHES",
    "INT64_MIN",
    "UINT64_MAX",
    "MAX_JOB_ID",
    "MAX_TOKEN",
    "last_committed",
    "MAX_HOST_BYTES",
    "validate",
    "make",
]

PROTOCOL_VERSION = 1

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1
MAX_JOB_ID = 256   # characters of a job id or an agent identity
MAX_TOKEN = 256    # characters of a job token (join refuses a longer one)


def last_committed(step: int) -> str:
    """``"last committed step N"``, or ``"no step committed"`` for -1 (a job that committed none),
    as status lines and refusals word a job's progress."""
    return f"last committed step {step}" if step >= 0 else "no step committed"
MAX_HOST_BYTES = 128   # bytes (UTF-8) of a rank's host name (join refuses a longer or empty one)
# bytes of keys and values a job's store holds, and all jobs' stores on one coordinator (a
# snapshot of the journal holds them all); the coordinator refuses a kv_set past either with a
# ConfigError, and the agent refuses one item above the first before sending it
MAX_JOB_KV_NBYTES = 16 * 1024 * 1024
# A store key's UTF-8 bytes: one str of a control message (transport.codec's max_str_len);
# refused by the client naming the key, where a longer one failed the coordinator's decode
MAX_KEY_NBYTES = 1024 * 1024
MAX_KV_NBYTES = 48 * 1024 * 1024

# Field spec: name -> (python type or tuple of types, required).
_Num = (int, float)
_Opt = type(None)

HEADER: dict[str, tuple[Any, bool]] = {
    "v": (int, True),
    "t": (str, True),
    "rid": (int, True),
    "job": (str, True),
    "epoch": (int, True),
    # the job's token on every request of a job (absent: ""); a request whose token is not the
    # job's is refused, so knowing a job id is not enough to write its store or make it leave
    "token": (str, False),
}

MESSAGES: dict[str, dict[str, tuple[Any, bool]]] = {
    # --- requests -------------------------------------------------------------------------------
    "join": {
        "identity": (str, True),  # unique per agent process; also its ZeroMQ routing id
        "token": (str, True),  # job token; the first joiner sets it, later ones must match
        "rank": ((int, _Opt), True),  # requested rank or None
        "min_ranks": (int, True),
        "max_ranks": (int, True),
        "last_call_s": (_Num, True),  # window after min_ranks are present for more to join
        "heartbeat_timeout_s": (_Num, True),
        "endpoint": (str, True),  # this rank's data endpoint for peer-to-peer payloads
        "host": (str, True),  # hostname, for same-host paths and topology
        "pid": (int, True),
        "info": (dict, False),  # free-form topology facts (GPU UUID, ...)
        "rejoin": (bool, False),  # this agent was a member before: never create the job anew
    },
    # waiting_for: the world size this member waits for (FaultTolerance below min_world_size,
    # rtxnet.elastic); absent when it waits for nothing. Shown by status, read by rtxnet-run.
    "heartbeat": {"identity": (str, True), "waiting_for": (int, False)},
    "leave": {"identity": (str, True)},
    "kv_set": {"key": (str, True), "value": (bytes, True)},
    "kv_get": {"key": (str, True)},
    "kv_wait": {"keys": (list, True), "timeout_s": (_Num, True)},
    "kv_unwait": {"wait_rid": (int, True)},
    "kv_cas": {
        "key": (str, True),
        "expected": ((bytes, _Opt), True),  # None: the key must be absent
        "value": (bytes, True),
    },
    "kv_del": {"key": (str, True)},
    "commit": {
        "identity": (str, True),
        "step": (int, True),
        "ok": (bool, True),
        "metadata": (dict, False),
        "timeout_s": (_Num, True),
    },
    # evict: ranks of ``epoch`` to drop from the new one instead of keeping them (late in the
    # collectives of a step, again and again: FaultTolerance's evict_late_after), when the job can
    # go on without them (coordinator.state: otherwise a plain reform)
    "reform": {"identity": (str, True), "reason": (str, True), "evict": (list, False)},
    # training is over: the job admits no more ranks (coordinator.state._finish)
    "finish": {"identity": (str, True)},
    # training goes on from ``step``, older than the job's committed step (coordinator.state._rewind)
    "rewind": {"identity": (str, True), "step": (int, True)},
    "status": {},
    # a launcher (rtxnet-run) takes job id ``job`` for its node for ttl_s seconds, renewed while
    # it runs; ttl_s 0 gives it back; replaces: the pid of a launcher of the same host that is
    # gone, whose claim this one takes over; min_ranks/max_ranks: the world its ranks will ask
    # for, refused when another node's live claim of the job asks for another (coordinator.state._claim)
    "claim": {"node": (int, True), "host": (str, True), "pid": (int, True), "ttl_s": (_Num, True),
              "replaces": (int, False), "min_ranks": (int, False), "max_ranks": (int, False)},
    # --- answers ---------------------------------------------------------------------------------
    "reply": {"ok": (bool, True), "body": (dict, True)},
    "error": {"error": (str, True), "message": (str, True)},
    # --- pushes ----------------------------------------------------------------------------------
    "epoch": {
        "world_size": (int, True),
        # rank -> {"identity", "endpoint", "host", "pid", "info"}; msgpack map keys are ints
        "members": (dict, True),
        "lost": (list, True),
        "added": (list, True),
        "reason": (str, True),  # "formed", "lost", "left", "joined", "reform", "finished"
        "committed_step": (int, True),  # last committed step of the job, -1 if none
    },
    "fenced": {"reason": (str, True)},
}

# a launcher's claim may be taken over (claim.replaces) only once its holder has not renewed it
# for this long: a pid gone from the asker's /proc may live on in another PID namespace of the
# same host name (two containers), renewing every 2 s (a tester's find)
CLAIM_STALE_S = 5.0

REQUESTS = frozenset(
    {"join", "heartbeat", "leave", "kv_set", "kv_get", "kv_wait", "kv_unwait", "kv_cas", "kv_del", "commit", "reform",
     "finish", "rewind", "status", "claim"}
)
PUSHES = frozenset({"epoch", "fenced"})


def _check_type(name: str, value: Any, expected: Any, mtype: str) -> None:
    # bool is an int in Python; an int field must not accept True.
    exp = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in exp:
        raise ProtocolError(f"{mtype}.{name}: expected {_names(exp)}, got bool")
    if not isinstance(value, exp):
        raise ProtocolError(f"{mtype}.{name}: expected {_names(exp)}, got {type(value).__name__}")


def _names(types: tuple) -> str:
    return "|".join("None" if t is _Opt else t.__name__ for t in types)


def validate(msg: Any) -> dict[str, Any]:
    """Check a decoded message against the contract.

    Args:
        msg: the decoded msgpack object.

    Returns:
        ``msg`` itself, known to be a dict with a valid header and the fields of its type.

    Raises:
        ProtocolError: not a map, wrong version, unknown type, a missing or mistyped field.
    """
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, not a map")
    v = msg.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {v!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    for name, (typ, required) in HEADER.items():
        if name not in msg:
            if required:
                raise ProtocolError(f"header field {name!r} missing")
            continue
        _check_type(name, msg[name], typ, "header")
    mtype = msg["t"]
    spec = MESSAGES.get(mtype)
    if spec is None:
        raise ProtocolError(f"unknown message type {mtype!r}")
    for name, (typ, required) in spec.items():
        if name not in msg:
            if required:
                raise ProtocolError(f"{mtype}.{name} missing")
            continue
        _check_type(name, msg[name], typ, mtype)
    return msg


def make(mtype: str, *, rid: int = 0, job: str = "", epoch: int = -1, **fields: Any) -> dict[str, Any]:
    """Build a message dict of type ``mtype`` with the header filled in (not validated)."""
    return {"v": PROTOCOL_VERSION, "t": mtype, "rid": rid, "job": job, "epoch": epoch, **fields}


# Maps and lists nested in a member's info or a commit's metadata: the records, snapshots, pushes
# and status answers that carry them nest them 5 to 7 levels further, under the codec's 32.
MAX_VALUE_DEPTH = 8
MAX_WAIT_KEYS = 1 << 20   # keys of one kv_wait (the codec's longest list), and of a job's waits


def json_like_problem(obj: Any, what: str) -> str | None:
    """Why ``obj`` (a rank's published info, a commit's metadata) is not a value the coordinator
    keeps, or None. It must be what JSON holds, since ``rtxnet status --json`` prints it: maps with
    string keys, lists (tuples count as lists), strings, integers of 64 bits, finite floats,
    booleans and None; and nest at most ``MAX_VALUE_DEPTH`` maps and lists, since every message and
    journal record that carries it nests it further (one 29 levels deep was accepted, and the
    epoch record holding it could not be replayed: a tester's find). Checked by the agent before
    sending and by the coordinator at the door (which also bounds the size)."""
    stack = [(obj, 1)]   # (value, how many maps and lists hold it, itself included)
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list | tuple):
            if depth > MAX_VALUE_DEPTH:
                return f"{what} nests maps and lists deeper than {MAX_VALUE_DEPTH} levels"
            if isinstance(v, dict):
                key = next((k for k in v if not isinstance(k, str)), None)
                if key is not None:
                    return f"{what} has a key {key!r:.60} that is not a string"
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
        elif isinstance(v, float):
            if not math.isfinite(v):
                return f"{what} holds a NaN or infinite number"
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            pass
        elif isinstance(v, int):
            if not -(2**63) <= v < 2**64:
                return f"{what} holds the integer {v!r:.40}, outside 64 bits"
        elif isinstance(v, bytes):
            return f"{what} holds bytes ({v!r:.40}); JSON has none: use a string"
        else:
            return (f"{what} holds a {type(v).__name__} ({v!r:.40}); it may hold dicts with string "
                    f"keys, lists, strings, numbers, booleans and None")
    return None
