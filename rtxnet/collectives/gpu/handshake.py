"""The host side of a same-host GPU collective's two synchronisations, through signal boards
(:mod:`.board`) once a group is warm, through control messages otherwise.

:class:`Handshake` knows nothing of CUDA: an *offer* is what a rank tells its peers about an
operation (for CUDA IPC, :mod:`.ipc` puts its buffers' IPC handles and its events' handles in
it), and "done" is whatever the caller's ``local_done`` and ``peer_done`` say. So the protocol,
its fallbacks and its failures run on any machine (``tests/collectives/test_handshake.py``, with
real processes and real boards), and the CUDA parts stay in :mod:`.ipc`.

Per operation number ``seq`` of the group (``Op.seq``, the same on every rank):

hello
    A rank posts ``OFFER`` then ``HELLO`` (the signature's CRC-32) on its board. Its offer goes as
    a message as well when the peers do not hold it yet (``OFFER = NEW``; the message carries the
    id later operations name it by), and when this rank takes part by message only
    (``OFFER = FULL``: it has no board, has not mapped every peer's yet, or the operation carries
    per-call data). A rank that has mapped every peer's board then polls them until each posted
    ``seq``; if every hash equals its own and no peer said ``FULL``, each peer's offer is the one
    its id names (or its message, for ``NEW``), and no message was needed. Otherwise (hashes
    differ, a peer said ``FULL``, or a peer sent a hello message without posting, which a CPU
    collective or another backend does) every rank sends its hello as a message, if it had not,
    and takes every peer's: ``Op.hello``, which raises the same ``CollectiveMismatchError`` on
    every rank when the calls differ. Every rank sees the same posts, so every rank takes the same
    branch.
done
    With boards on every rank: post ``DONE``, then poll until ``local_done()`` and, for each peer
    that posted ``DONE``, ``peer_done(g)``. Otherwise: ``local_done`` polled, then a "done"
    message to and from every peer.

Offer ids: a rank keeps the ids of its last ``OFFER_IDS`` offers, registered once an operation
that sent them succeeded (every peer then holds them) and all forgotten when an operation fails
(a peer may not have received one); a peer keeps twice as many per rank and drops the oldest
first, so it never drops an id its owner may still name. An id a peer does not hold is a
``CollectiveError``, not a wrong buffer.

Every wait polls ``op.error`` first, so a lost peer (``PeerLostError``), the deadline
(``CollectiveTimeout``, naming the ranks that had not posted) or a peer's abort ends it.

Errors: ``CollectiveError`` (a malformed offer or board, an unknown offer id) and whatever
``op.error`` or ``Op.hello`` raise.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import Callable

import structlog

from rtxnet.collectives.gpu import board as board_mod
from rtxnet.collectives.gpu.board import Board, PeerBoard
from rtxnet.collectives.gpu.stream import poll_delay
from transport.errors import CollectiveError
from transport.logconfig import env_flag
from transport.peer import Kind

__all__ = ["Handshake", "make_board", "BOARD_ENV", "OFFER_IDS", "DONE_STEP"]

log = structlog.get_logger(__name__)

BOARD_ENV = "RTXNET_IPC_BOARD"   # on (1, true, ...): signal boards; off: every hello as a message
OFFER_IDS = 64                   # offers of this rank's kept by id (the newest)
_PEER_OFFERS = 2 * OFFER_IDS     # each peer's kept here: more than it keeps (see the module)
DONE_STEP = 1                    # the mailbox step of the "done" messages
_OFFER_LEN = 4                   # an offer: [pid, board name, offer id, the caller's data]


def make_board(group) -> Board | None:
    """This rank's signal board for a group's new IPC state: None unless ``RTXNET_IPC_BOARD=1``,
    and when ``/dev/shm`` refuses (the group's hellos and "done"s then go as messages on every
    rank: the peers learn from the offers that this rank has none)."""
    if not env_flag(BOARD_ENV, False):
        return None
    try:
        return Board(group.engine._next_segment_name())
    except OSError as exc:
        log.warning("ipc_board_unavailable", gid=group.gid, error=str(exc))
        return None


class Handshake:
    """One group's hello and done protocol on this rank (see the module).

    Args:
        group: the :class:`rtxnet.collectives.group.Group`.
        board: this rank's board (:func:`make_board`), or None: messages only. Closed by
            :meth:`close`.

    Attributes:
        stats: operations whose hello went through the boards alone (``fast``), through the boards
            with some offer sent as a message (``offers``: new to the peers), and as messages
            (``full``); tests and benchmarks read them.
    """

    def __init__(self, group, board: Board | None):
        self.group = group
        self.board = board
        self._board_linked = board is not None
        self._boards: dict[int, PeerBoard | None] = {}    # group rank -> its board (None: none)
        self._offer_ids: OrderedDict[object, int] = OrderedDict()   # offer key -> id, newest last
        self._next_offer_id = 1
        self._peer_offers: dict[int, OrderedDict[int, list]] = {}  # g -> id -> offer
        self._registering: tuple[object, int] | None = None
        self._ahead_seen: dict[int, float] = {}
        self.stats = {"fast": 0, "offers": 0, "full": 0}

    def boards_ready(self, op) -> bool:
        """Whether this rank and every peer have a board this rank has mapped (the same answer on
        every rank once one hello was exchanged: each learns every board from the offers)."""
        return self.board is not None and all(self._boards.get(g) is not None for g in op.peers)

    async def hello(self, op, sig: list, data: list, key, *, per_call: bool = False
                    ) -> dict[int, list]:
        """Exchange offers for operation ``op``.

        Args:
            sig: this rank's signature (``Group._sig``).
            data: what the peers need of this rank for this operation (msgpack-able).
            key: hashable; equal keys mean equal ``data`` (the offer is then named by its id).
            per_call: ``data`` changes with every call (never named by an id; messages only).

        Returns:
            group rank -> that peer's ``data``, for every peer.

        Raises:
            CollectiveMismatchError: the ranks' signatures differ (on every rank).
            CollectiveError: a malformed offer, an unknown offer id, or a board that cannot be
                mapped. op.error as it is.
        """
        fast = not per_call and self.boards_ready(op)
        offer_id = self._offer_ids.get(key) if fast else None
        new_id = None
        if offer_id is None and self.board is not None and not per_call \
                and self._next_offer_id < board_mod.FULL:
            new_id = self._next_offer_id
            self._next_offer_id += 1
        offer = [os.getpid(), None if self.board is None else self.board.name, new_id, data]
        mine = board_mod.sig_hash(sig)
        if self.board is not None:
            self.board.post(board_mod.OFFER, op.seq, offer_id if offer_id is not None else
                            (board_mod.NEW if fast else board_mod.FULL))
            self.board.post(board_mod.HELLO, op.seq, mine)
        if offer_id is None:
            op.send_hello(sig, offer)
        posts = await self._await_posts(op) if fast else None
        if posts is None or any(h != mine or o == board_mod.FULL for h, o in posts.values()):
            self.stats["full"] += 1
            got = await op.hello(sig, offer, send=offer_id is not None)
            offers = {g: got[g][0] for g in op.peers}
        else:
            offers = {}
            for g, (_, o) in posts.items():
                if o == board_mod.NEW:
                    offers[g] = await self._recv_offer(op, g)
                else:
                    offers[g] = self._peer_offers.get(g, {}).get(o)
                    if offers[g] is None:
                        raise CollectiveError(f"rank {self.group.ranks[g]} named its buffers by "
                                              f"offer id {o}, which this rank does not hold")
            self.group._after_hello(op)
            new = offer_id is None or any(o == board_mod.NEW for _, o in posts.values())
            self.stats["offers" if new else "fast"] += 1
        out = {}
        for g in op.peers:
            out[g] = self._learn(g, offers[g])
        self._registering = (key, new_id) if new_id is not None else None
        return out

    async def _await_posts(self, op) -> dict[int, tuple[int, int]] | None:
        """Poll every peer's board until it posted this operation's hello and offer: group rank
        -> ``(signature hash, offer)``; None when a peer sent a hello message without posting
        (its call took another path)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        seq, boards = op.seq, self._boards
        pending = list(op.peers)
        op.waiting_for(Kind.HELLO, 0, pending)
        got: dict[int, tuple[int, int]] = {}
        while True:
            if op.error is not None:
                raise op.error
            for g in list(pending):
                b = boards[g]
                h, o = b.read(board_mod.HELLO, seq), b.read(board_mod.OFFER, seq)
                if h is not None and o is not None:
                    got[g] = (h, o)
                    pending.remove(g)
                    op.waiting_for(Kind.HELLO, 0, pending)
                elif op.has_mail(g, Kind.HELLO, 0):
                    # a rank posts before it sends, so a message without a post is another path
                    return None
            if not pending:
                return got
            await asyncio.sleep(poll_delay(loop.time() - start))

    async def _recv_offer(self, op, g: int) -> list:
        m, _ = await op.recv(g, 0, Kind.HELLO)
        if not (isinstance(m, list) and len(m) == 2 and isinstance(m[0], list)):
            raise CollectiveError(f"{op.name}: malformed hello from rank {self.group.ranks[g]}")
        return m[1]

    def _learn(self, g: int, offer) -> list:
        """Check a peer's offer, map its board once, keep the offer under its id; its data."""
        who = self.group.ranks[g]
        if not (isinstance(offer, list) and len(offer) == _OFFER_LEN):
            raise CollectiveError(f"malformed offer from rank {who}: {str(offer)[:200]}")
        pid, board_name, offer_id, data = offer
        if pid == os.getpid():
            raise CollectiveError(f"rank {who} is this process; same-host GPU collectives need "
                                  f"one process per rank")
        if g not in self._boards:
            if board_name is None:
                self._boards[g] = None
            elif isinstance(board_name, str):
                try:
                    self._boards[g] = PeerBoard(board_name)
                except (OSError, ValueError) as exc:
                    raise CollectiveError(f"cannot map the signal board {board_name!r} of rank "
                                          f"{who}: {exc}") from exc
            else:
                raise CollectiveError(f"malformed board name from rank {who}: {board_name!r}")
        if offer_id is not None:
            if isinstance(offer_id, bool) or not isinstance(offer_id, int) or \
                    not 0 < offer_id < board_mod.FULL:
                raise CollectiveError(f"malformed offer id from rank {who}: {offer_id!r}")
            held = self._peer_offers.setdefault(g, OrderedDict())
            held[offer_id] = offer
            while len(held) > _PEER_OFFERS:
                held.popitem(last=False)    # the oldest id: its owner dropped it long ago
        return data

    async def done(self, op, local_done: Callable[[], bool],
                   peer_done: Callable[[int], bool]) -> None:
        """Wait (polling) until ``local_done()`` and every peer's work is done: with boards, post
        ``DONE`` and poll each peer's, then ``peer_done(g)``; without, a "done" message to and
        from every peer once ``local_done()``. Then keep the offer id this operation sent, and
        unlink this rank's board file once every peer has mapped it.

        Args:
            local_done: True once this rank's work has completed (polled; may raise).
            peer_done: True once group rank ``g``'s work has completed (polled only after ``g``
                posted ``DONE``; may raise).
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        seq, boards = op.seq, self._boards
        by_board = self.boards_ready(op)
        if by_board:
            self.board.post(board_mod.DONE, seq)
        unposted = list(op.peers) if by_board else []
        posted: list[int] = []
        local = False
        op.waiting_for(Kind.DATA, DONE_STEP, unposted)
        while True:
            if op.error is not None:
                raise op.error
            for g in list(unposted):
                if boards[g].read(board_mod.DONE, seq) is not None:
                    unposted.remove(g)
                    posted.append(g)
                    op.waiting_for(Kind.DATA, DONE_STEP, unposted)
            posted = [g for g in posted if not peer_done(g)]
            local = local or local_done()
            if local and not unposted and not posted:
                break
            await asyncio.sleep(poll_delay(loop.time() - start))
        if not by_board:
            for g in op.peers:
                op.send(g, DONE_STEP)
            await op.recv_all(op.peers, DONE_STEP)
        if self._registering is not None:
            key, offer_id = self._registering
            self._offer_ids[key] = offer_id
            while len(self._offer_ids) > OFFER_IDS:
                self._offer_ids.popitem(last=False)
            self._registering = None
        if self._board_linked and by_board:
            # every peer has mapped this board: each polled it for this operation's DONE
            self.board.unlink()
            self._board_linked = False

    def taint(self) -> None:
        """An operation failed: name no offer by id until it was sent again (a peer may not
        have received an offer sent in the failed operation)."""
        self._offer_ids.clear()
        self._registering = None

    def ahead(self, next_seq: int, now: float) -> list[tuple[int, list[int], float]]:
        """Operations peers posted on their boards that this group has not issued: ``(seq,
        world ranks, when first seen here)`` for each number at or past ``next_seq`` (see
        ``Engine.skipped``; a post counts from when a call of this saw it)."""
        posted: dict[int, list[int]] = {}
        for g, b in self._boards.items():
            if b is None or b.words is None:
                continue
            s = b.seq(board_mod.HELLO)
            if s is None:
                continue
            d = (s - next_seq) % board_mod.PERIOD
            if d < board_mod.PERIOD // 2:
                posted.setdefault(next_seq + d, []).append(self.group.ranks[g])
        self._ahead_seen = {s: self._ahead_seen.get(s, now) for s in posted}
        return [(s, sorted(rs), self._ahead_seen[s]) for s, rs in sorted(posted.items())]

    def close(self) -> None:
        """Unmap the peers' boards, unlink and unmap this rank's. Idempotent."""
        for b in self._boards.values():
            if b is not None:
                b.close()
        self._boards.clear()
        if self.board is not None:
            self.board.close()
            self.board = None
