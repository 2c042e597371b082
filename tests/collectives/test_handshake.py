"""The hello/done protocol of same-host GPU collectives (rtxnet.collectives.gpu.handshake) on the
CPU: real rank processes with real engines and real signal boards in /dev/shm, offers of opaque
data instead of CUDA handles, and "done" at once (the CUDA side is tests/gpu/test_ipc.py's).

Each rank runs ``op_with(handshake, ...)`` as the group's next collective, through
``Group._collective`` as the IPC backend does: the signature exchange, the offers, the "done".
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from rtxnet.collectives import ReduceOp
from tests.collectives.harness import run_world

pytestmark = pytest.mark.timeout(120)


def _handshake(w, board: bool):
    from rtxnet.collectives.gpu.handshake import BOARD_ENV, Handshake, make_board

    hs = getattr(w, "_test_handshake", None)
    if hs is None:
        os.environ[BOARD_ENV] = "1" if board else "0"
        hs = w._test_handshake = Handshake(w, make_board(w))
    return hs


async def op_with(w, hs, key, *, numel: int = 10, name: str = "all_reduce",
                  per_call: bool = False, timeout=None):
    """One collective of group ``w`` whose offer is ``[key, rank]``; returns group rank -> the
    peer's offer. ``key`` names the offer (equal keys, equal offers: as buffers are reused)."""
    # the reduce op a real IPC all_reduce's signature carries (its default, SUM): only the
    # algorithm then tells it from a CPU all_reduce of the same array
    rop = ReduceOp.SUM if name == "all_reduce" else None
    sig = w._sig(name, "ipc", rop, None, np.dtype(np.float32), numel, [numel])

    async def body(op):
        try:
            got = await hs.hello(op, sig, [key, w.rank], key, per_call=per_call)
            await hs.done(op, lambda: True, lambda g: True)
            return got
        except BaseException:
            hs.taint()
            raise

    return await w._collective(name, timeout, body)


def _check(got, key, n, r):
    want = {g: [key, g] for g in range(n) if g != r}
    assert got == want, (got, want)


async def _warm(w):
    """Group ``w``'s handshake with boards, after two operations (hellos through the boards)."""
    hs = _handshake(w, True)
    for _ in range(2):
        _check(await op_with(w, hs, "a"), "a", w.size, w.rank)
    return hs


async def warm_then_fast(engine, board):
    w = engine.world
    n, r = w.size, w.rank
    hs = _handshake(w, board)
    stats = []
    for key in ("a", "a", "a", "b", "a", "b"):
        _check(await op_with(w, hs, key), key, n, r)
        stats.append(dict(hs.stats))
    name = None if hs.board is None else hs.board.name
    linked = name is not None and os.path.exists(f"/dev/shm/{name}")
    hs.close()
    return stats, linked


@pytest.mark.parametrize("n", [2, 3])
def test_a_warm_group_exchanges_nothing_but_new_offers_by_message(n):
    """The first operation goes by message (no board known yet); reused offers go through the
    boards alone, a new one with its offer as a message; the board's file is gone once every
    peer has mapped it."""
    for stats, linked in run_world(n, warm_then_fast, True, timeout_s=60):
        assert [list(s.values()) for s in stats] == [
            # fast, offers, full
            [0, 0, 1], [1, 0, 1], [2, 0, 1], [2, 1, 1], [3, 1, 1], [4, 1, 1]]
        assert not linked


def test_without_boards_every_hello_is_a_message():
    for stats, linked in run_world(2, warm_then_fast, False, timeout_s=60):
        assert stats[-1] == {"fast": 0, "offers": 0, "full": 6}
        assert not linked


async def boards_on_one_rank(engine):
    w = engine.world
    hs = _handshake(w, board=(w.rank == 0))
    for key in ("a", "a", "b", "a"):
        _check(await op_with(w, hs, key), key, w.size, w.rank)
    return dict(hs.stats)


def test_a_rank_without_a_board_makes_every_rank_use_messages():
    assert run_world(2, boards_on_one_rank, timeout_s=60) == [{"fast": 0, "offers": 0, "full": 4}] * 2


async def mismatch_when_warm(engine):
    from transport.errors import CollectiveMismatchError

    w = engine.world
    n, r = w.size, w.rank
    hs = await _warm(w)
    out = []
    try:
        await op_with(w, hs, "a", numel=10 + r)           # the hashes differ
        out.append("no error")
    except CollectiveMismatchError as exc:
        out.append(exc.field)
    # after a failed operation every offer goes by message once more, then by id again
    for _ in range(2):
        _check(await op_with(w, hs, "a"), "a", n, r)
    out.append(dict(hs.stats))
    return out


def test_a_mismatch_in_a_warm_group_is_the_same_error_everywhere_and_the_group_goes_on():
    res = run_world(3, mismatch_when_warm, timeout_s=60)
    assert res == [["numel", {"fast": 2, "offers": 1, "full": 2}]] * 3, res


async def cpu_collective_meets_board_op(engine):
    from transport.errors import CollectiveMismatchError

    w = engine.world
    n, r = w.size, w.rank
    hs = await _warm(w)
    try:
        if r == 0:
            await w.all_reduce(np.ones(10, np.float32), timeout=20)   # a CPU collective
        else:
            await op_with(w, hs, "a", timeout=20)                     # posted on the boards only
        field = "no error"
    except CollectiveMismatchError as exc:
        field = exc.field
    _check(await op_with(w, hs, "a"), "a", n, r)
    return field


def test_a_rank_in_a_cpu_collective_is_a_mismatch_not_a_hang():
    """The board ranks see rank 0's hello message without a post and fall back to messages,
    so every rank gets the same CollectiveMismatchError well before the 20 s deadline."""
    assert run_world(3, cpu_collective_meets_board_op, timeout_s=40) == ["algorithm"] * 3


async def missing_rank(engine):
    import asyncio

    from transport.errors import CollectiveTimeout

    w = engine.world
    hs = await _warm(w)
    if w.rank == 1:
        await asyncio.sleep(2.5)          # never calls the third operation
        return None
    try:
        await op_with(w, hs, "a", timeout=1.0)
    except CollectiveTimeout as exc:
        return exc.ranks
    return "no error"


def test_a_rank_that_never_posts_is_named_by_the_timeout():
    assert run_world(2, missing_rank, timeout_s=40)[0] == [1]


async def per_call_and_many_offers(engine, count):
    w = engine.world
    n, r = w.size, w.rank
    hs = _handshake(w, True)
    _check(await op_with(w, hs, "first"), "first", n, r)
    for k in range(3):
        _check(await op_with(w, hs, f"splits{k}", per_call=True), f"splits{k}", n, r)
    for k in range(count):                 # more offers than either side keeps by id
        _check(await op_with(w, hs, f"buf{k}"), f"buf{k}", n, r)
    for k in (count - 1, 0, count - 2):    # kept, dropped by its owner, kept
        _check(await op_with(w, hs, f"buf{k}"), f"buf{k}", n, r)
    return dict(hs.stats)


def test_per_call_offers_go_by_message_and_dropped_ids_are_offered_again():
    from rtxnet.collectives.gpu.handshake import OFFER_IDS

    count = OFFER_IDS + 6
    res = run_world(2, per_call_and_many_offers, count, timeout_s=90)
    # first and per-call: full; every buf new once, and buf0 again (its id was dropped); the
    # newest two reused by id
    assert res == [{"fast": 2, "offers": count + 1, "full": 4}] * 2, res


def test_ahead_reports_posts_this_rank_has_not_issued_and_when_first_seen():
    from types import SimpleNamespace

    from rtxnet.collectives.gpu.board import HELLO, PERIOD, Board, PeerBoard
    from rtxnet.collectives.gpu.handshake import Handshake
    from transport.shm import segment_name

    group = SimpleNamespace(ranks=[4, 7], rank=0, gid="world")
    owner = Board(segment_name("hstest", os.getpid(), 1))
    try:
        hs = Handshake(group, None)
        hs._boards = {1: PeerBoard(owner.name)}
        assert hs.ahead(5, now=1.0) == []                 # never posted
        owner.post(HELLO, 4)
        assert hs.ahead(5, now=1.0) == []                 # an operation this rank issued
        owner.post(HELLO, 5)
        assert hs.ahead(5, now=2.0) == [(5, [7], 2.0)]
        assert hs.ahead(5, now=3.0) == [(5, [7], 2.0)]    # counted from when first seen
        owner.post(HELLO, PERIOD + 6)                     # numbers past the words' period
        assert hs.ahead(PERIOD + 5, now=4.0) == [(PERIOD + 6, [7], 4.0)]
        hs.close()
    finally:
        owner.close()
