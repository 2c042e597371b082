"""rtxnet's exception tree: one root, shared by the agent, the coordinator and the transport.

::

    RtxError
    |-- ConfigError (also ValueError)
    |-- ProtocolError               malformed or oversize message, wrong version
    |-- TransportError
    |   |-- ConnectError
    |   |-- ClosedError             we closed it
    |   |-- PeerLostError           a peer died or was declared lost (carries the ranks)
    |   `-- CoordinatorLostError    the coordinator stayed unreachable past its timeout
    |-- RtxTimeoutError (also TimeoutError)
    |   |-- RendezvousTimeout
    |   `-- CollectiveTimeout       carries the ranks that did not contribute
    |-- RendezvousError             duplicate rank, job full, wrong token, stale epoch
    |   `-- JobFinishedError        the job ended (every rank left) before this rank rejoined
    |-- CollectiveError
    |   |-- CollectiveMismatchError shapes, dtypes or ops differ across ranks
    |   |-- CollectiveRefusedError  another rank refused its own call (a bad argument there);
    |   |                           the group stays in step: no reform (carries that rank)
    |   `-- LinkBrokenError         a peer's bulk TCP stream broke and the peer was not declared
    |                               lost within the grace (carries the peer's rank)
    |-- JournalError
    |   `-- JournalCorruptError     carries the file and offset
    `-- CheckpointError             a save failed on some rank, or no checkpoint is usable
        `-- CheckpointCorruptError  a shard or manifest does not match (carries the path)

Errors cross the wire by name (:func:`error_from_wire`); library errors (zmq, OS) are translated
at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "RtxError",
    "ConfigError",
    "ProtocolError",
    "TransportError",
    "ConnectError",
    "ClosedError",
    "PeerLostError",
    "CoordinatorLostError",
    "RtxTimeoutError",
    "RendezvousTimeout",
    "CollectiveTimeout",
    "RendezvousError",
    "JobFinishedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveRefusedError",
    "LinkBrokenError",
    "JournalError",
    "JournalCorruptError",
    "CheckpointError",
    "CheckpointCorruptError",
    "error_from_wire",
]


class RtxError(Exception):
    """Root of every error rtxnet raises on purpose."""


class ConfigError(RtxError, ValueError):
    """A configuration value is invalid or values contradict each other."""


class StateLayoutError(ConfigError):
    """A state laid out for another world (rank, world size) or another layout, refused by a
    sharded module's ``load_state_dict`` (FSDP's shards of another world). ``FaultTolerance``
    takes it as a refusal to be mended (a peer's state, the ring copies, a checkpoint); any other
    exception of a state's loader, in a roll-back to its own state, is the user's and propagates.
    A sharded state of one's own raises it for the same case."""


class ProtocolError(RtxError):
    """A message is malformed, oversize, of an unknown type or of another protocol version."""


class TransportError(RtxError):
    """A link to a peer or to the coordinator failed."""


class ConnectError(TransportError):
    """A connection could not be established."""


class ClosedError(TransportError):
    """The object was closed by this process (as opposed to the peer breaking it), or an
    operation in flight failed because its group's epoch ended with nobody lost (a reform, a
    join).

    Attributes:
        epoch: for an operation failed by a new epoch, the epoch it ran in (else ``None``). A
            rank whose collective was still waiting for the others' calls when another rank's
            reform opened the next epoch gets this error where the others got, say,
            ``CollectiveMismatchError``: ``ProcessGroup.reform(epoch=exc.epoch)`` then waits for
            the epoch already open instead of opening a second one.
    """

    epoch: int | None = None


class PeerLostError(TransportError):
    """One or more peers died or were declared lost.

    Attributes:
        ranks: the lost ranks, sorted.
        epoch: the epoch opened because of the loss, when known.
    """

    def __init__(self, message: str, *, ranks: Iterable[int] = (), epoch: int | None = None):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.epoch = epoch


class CoordinatorLostError(TransportError):
    """The coordinator answered no heartbeat for ``Timeouts.coordinator_s``: steps cannot be
    committed until it is back (restart it on the same journal; agents reconnect by themselves).

    Attributes:
        address: the coordinator's address. silent_s: seconds without an answer.
    """

    def __init__(self, message: str, *, address: str = "", silent_s: float = 0.0):
        super().__init__(message)
        self.address = address
        self.silent_s = silent_s


class RtxTimeoutError(RtxError, TimeoutError):
    """A deadline passed."""


class RendezvousTimeout(RtxTimeoutError):
    """The world did not form before the rendezvous deadline."""


class CollectiveTimeout(RtxTimeoutError):
    """A collective did not complete in time.

    Attributes:
        ranks: ranks that did not contribute in time, sorted.
        op: name of the collective.
        epoch: the epoch the collective ran in (``None`` outside a group); pass it to
            ``ProcessGroup.reform(epoch=)``.
    """

    epoch: int | None = None

    def __init__(self, message: str, *, ranks: Iterable[int] = (), op: str | None = None):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.op = op


class RendezvousError(RtxError):
    """Rendezvous refused: duplicate rank or identity, job full, wrong token, stale epoch."""


class JobFinishedError(RendezvousError):
    """The job this rank tries to (re)join has finished: every member left in order.

    A rank that was frozen or cut off past the end of training meets this; nothing is lost.
    """


class JobFullError(RendezvousError):
    """The job already has ``max_ranks`` members. A replacement (``RTXNET_REJOIN=1``) asks
    again for a while: the rank it replaces may still count as a member until its heartbeats are
    missed."""


class CollectiveError(RtxError):
    """A collective failed.

    Attributes:
        epoch: the epoch the collective ran in (``None`` outside a group); pass it to
            ``ProcessGroup.reform(epoch=)``.
    """

    epoch: int | None = None


class CollectiveMismatchError(CollectiveError):
    """Ranks called a collective with different ops, dtypes, shapes or element counts.

    Attributes:
        field: what differs (``"op"``, ``"dtype"``, ``"shape"``, ...).
        values: per-rank values of that field, ``{rank: value}``.
    """

    def __init__(self, message: str, *, field: str | None = None, values: dict | None = None):
        super().__init__(message)
        self.field = field
        self.values = dict(values or {})


class CollectiveRefusedError(CollectiveError):
    """Another rank refused its own matching call (a bad argument: it raised ``ValueError`` or
    ``TypeError`` there, before it exchanged anything), so this rank's call failed at once
    instead of at its deadline.

    The group stays in step: every rank's call of that number failed before any data moved,
    and the next collective of every rank is matched with the others' next, as before. No
    ``reform`` is needed; the refusing rank has no epoch to name, and a reform by the other
    ranks alone would fail its next call with ``ClosedError``.

    Attributes:
        rank: the rank that refused its call (its rank in the world).
        reason: that rank's error, ``"ValueError: ..."``.
    """

    def __init__(self, message: str, *, rank: int, reason: str):
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class LinkBrokenError(CollectiveError):
    """The bulk TCP stream to or from a peer broke (connection refused or reset, broken pipe).

    Usually the peer died: an operation that meets a broken stream waits for the coordinator's
    verdict (``Engine.link_grace_s``, by default the heartbeat timeout plus one interval) and
    raises the :class:`PeerLostError` naming the lost rank that comes with the new epoch, or a
    peer's abort. Only when neither comes within the grace does it raise this error.

    Attributes:
        peer: the world rank at the other end of the stream.
    """

    def __init__(self, message: str, *, peer: int):
        super().__init__(message)
        self.peer = peer


class JournalError(RtxError):
    """The coordinator's write-ahead journal cannot be used."""


class JournalCorruptError(JournalError):
    """A journal record before the tail failed its length or CRC check.

    Attributes:
        path: the journal file.
        offset: byte offset of the bad record in that file.
    """

    def __init__(self, message: str, *, path: str, offset: int):
        super().__init__(message)
        self.path = path
        self.offset = offset


class CheckpointError(RtxError):
    """A checkpoint could not be saved on every rank, or none is usable.

    Attributes:
        step: the step concerned, when known.
        ranks: ranks whose save failed (sorted), when known.
    """

    def __init__(self, message: str, *, step: int | None = None, ranks: list[int] | None = None):
        super().__init__(message)
        self.step = step
        self.ranks = sorted(ranks or [])


class CheckpointCorruptError(CheckpointError):
    """A shard or manifest does not match what the manifest recorded.

    Attributes:
        path: the offending file.
    """

    def __init__(self, message: str, *, path, step: int | None = None):
        super().__init__(message, step=step)
        from pathlib import Path

        self.path = Path(path)


_BY_NAME = {
    cls.__name__: cls
    for cls in (
        RtxError,
        ConfigError,
        ProtocolError,
        TransportError,
        ConnectError,
        ClosedError,
        RendezvousError,
        JobFinishedError,
        JobFullError,
        RendezvousTimeout,
        RtxTimeoutError,
        CollectiveError,
        JournalError,
    )
}


def error_from_wire(name: str, message: str) -> RtxError:
    """Rebuild an error the coordinator sent by class name; unknown names become ``RtxError``."""
    cls = _BY_NAME.get(name, RtxError)
    return cls(message)
