"""Subgroups (new_group, split) with their own sequence numbers running concurrently, and
point-to-point tag matching."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest

from rtxnet.collectives.reduce_ops import ReduceOp
from transport.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeout

from .harness import run_world

pytestmark = pytest.mark.timeout(120)


async def subgroups(engine):
    w = engine.world
    r = w.rank
    out = {}
    evens = w.new_group([0, 2])
    odds = w.new_group([1, 3])
    mine = evens if r % 2 == 0 else odds
    assert (evens is None) == (r % 2 == 1)
    # different groups, different sizes, run at the same time, interleaved with the world
    x = np.full(100_000, r, np.float32)
    y = np.full(10, r, np.int64)
    z = np.ones(3, np.float64)
    await asyncio.gather(mine.all_reduce(x), mine.all_reduce(y), w.all_reduce(z))
    out["sub"] = (float(x[0]), int(y[0]), float(z[0]), mine.rank, mine.size, mine.ranks)
    # split by color, ordered by descending key
    s = await w.split(color=r % 2, key=-r)
    out["split"] = (s.ranks, s.rank)
    out["split_world_size"] = (s.world_size, s.size)
    b = np.array([float(r)])
    await s.broadcast(b, src=0)
    out["split_bc"] = float(b[0])
    none = await w.split(color=None if r == 3 else 0, key=r)
    out["split_none"] = none is None
    # many concurrent operations on one group keep call order
    vals = [np.full(4, r * 10 + i, np.int32) for i in range(8)]
    await asyncio.gather(*(w.all_reduce(v) for v in vals))
    out["queued"] = [int(v[0]) for v in vals]
    # a second new_group of the same ranks is a different group
    e2 = w.new_group([0, 2])
    if e2 is not None:
        a = np.ones(2)
        await e2.all_reduce(a)
        out["e2"] = (e2.gid != evens.gid, float(a[0]))
    return out


def test_subgroups_and_split():
    res = run_world(4, subgroups)
    for r, out in enumerate(res):
        members = [0, 2] if r % 2 == 0 else [1, 3]
        assert out["sub"] == (float(sum(members)), sum(members), 4.0, members.index(r), 2, members)
        want = sorted(members, key=lambda k: -k)
        assert out["split"] == (want, want.index(r))
        assert out["split_world_size"] == (len(want), len(want))
        assert out["split_bc"] == float(want[0])
        assert out["split_none"] == (r == 3)
        assert out["queued"] == [sum(k * 10 + i for k in range(4)) for i in range(8)]
        if r % 2 == 0:
            assert out["e2"] == (True, 2.0)


async def p2p(engine):
    g = engine.world
    r = g.rank
    out = {}
    if r == 0:
        # posted in an order unrelated to the receiver's
        await g.send(np.array([1.0]), 1, tag=7)
        await g.send(np.array([2.0]), 1, tag=3)
        await g.send(np.array([3.0]), 1, tag=7)
        big = np.arange(300_000, dtype=np.float32)
        await g.send(big, 1, tag=1)
        # a send whose task is dropped still delivers
        asyncio.ensure_future(g.send(np.array([42], np.int64), 1, tag=9))
        gc.collect()
        await g.send(np.ones(3, np.float32), 1, tag=11)  # wrong shape for the receiver
        await g.send(np.array([5.0]), 2, tag=0)
    elif r == 1:
        a, b, c = np.zeros(1), np.zeros(1), np.zeros(1)
        t_b = asyncio.ensure_future(g.recv(b, 0, tag=3))
        await g.recv(a, 0, tag=7)
        await g.recv(c, 0, tag=7)
        await t_b
        big = np.zeros(300_000, np.float32)
        await g.recv(big, 0, tag=1)
        d = np.zeros(1, np.int64)
        await g.recv(d, 0, tag=9)
        out["vals"] = [a[0], b[0], c[0], int(d[0]), bool((big == np.arange(300_000)).all())]
        try:
            await g.recv(np.zeros(4, np.float32), 0, tag=11)
        except CollectiveMismatchError as exc:
            out["mismatch"] = exc.field
        try:
            await g.recv(np.zeros(1), 2, tag=5, timeout=0.2)
        except CollectiveTimeout as exc:
            out["timeout"] = exc.ranks
    else:
        m = np.zeros((2, 2))
        await g.recv(m[:, 0][:1], 0, tag=0)
        out["strided"] = m.tolist()
    bad = {}
    for name, call in (("send_big", lambda: g.send(np.zeros(1), (r + 1) % 3, tag=2 ** 70)),
                       ("recv_float", lambda: g.recv(np.zeros(1), (r + 1) % 3, tag=1.5)),
                       ("recv_bool", lambda: g.recv(np.zeros(1), (r + 1) % 3, tag=True)),
                       ("timeout_bool", lambda: g.barrier(timeout=True)),
                       ("split_big", lambda: g.split(2 ** 70)),
                       ("split_bool", lambda: g.split(True))):
        try:
            await call()
        except ValueError as exc:
            bad[name] = str(exc)
    out["bad_tags"] = bad
    await g.barrier()
    return out


def test_send_recv_tag_matching():
    res = run_world(3, p2p)
    assert res[1]["vals"] == [1.0, 2.0, 3.0, 42, True]
    assert res[1]["mismatch"] == "shape"
    assert res[1]["timeout"] == [2]
    assert res[2]["strided"] == [[5.0, 0.0], [0.0, 0.0]]
    for r in res:   # refused before anything is sent, naming the value and what is wrong
        assert r["bad_tags"] == {
            "send_big": "tag(1180591620717411303424) is out of range: a tag lies strictly between "
                        "-2**62 and 2**62",
            "recv_float": "tag must be an int, got 1.5 (float)",
            "recv_bool": "tag must be an int, got True (bool)",
            "timeout_bool": "timeout must be a positive number of seconds, got True",
            "split_big": "split color must be in the signed 64-bit range, got 1180591620717411303424",
            "split_bool": "split color must be an int, got True"}, r


async def send_to_frozen(engine):
    """Rank 1 stops itself (SIGSTOP, zmq's I/O thread too); rank 0 sends it 64 MiB, which the
    kernel's socket buffers cannot hold: the send must end at its deadline, naming rank 1."""
    import os
    import signal
    import time

    g = engine.world
    pids = np.zeros(2, np.int64)
    await g.all_gather(pids, np.array([os.getpid()], np.int64))
    go = np.zeros(1, np.int64)
    if g.rank == 1:
        # stop only once rank 0 says it has everything from here: a message of this rank still
        # queued when it stops would never arrive
        await g.recv(go, 0, tag=1)
        os.kill(os.getpid(), signal.SIGSTOP)      # until rank 0's SIGCONT
        return "woken"
    try:
        await g.send(go, 1, tag=1)
        stat = f"/proc/{int(pids[1])}/stat"
        deadline = time.monotonic() + 10
        while open(stat).read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            assert time.monotonic() < deadline, "rank 1 did not stop"
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        try:
            await g.send(np.ones(16 << 20, np.float32), 1, tag=5, timeout=1.5)
            return "sent"
        except CollectiveTimeout as exc:
            return (type(exc).__name__, exc.ranks, exc.op, round(time.monotonic() - t0, 1))
    finally:
        os.kill(int(pids[1]), signal.SIGCONT)


@pytest.mark.exclusive   # the timeout's length is measured
def test_a_send_a_frozen_peer_cannot_take_times_out_naming_it():
    res = run_world(2, send_to_frozen, timeout_s=60)
    assert res[1] == "woken" and isinstance(res[0], tuple), res
    name, ranks, op, took = res[0]
    assert (name, ranks, op) == ("CollectiveTimeout", [1], "send")
    assert 1.4 <= took < 5, took


async def root_refuses(engine):
    """gather / scatter whose root holds a bad list: the root raises ValueError, the others a
    CollectiveError quoting it at once (not at their 20 s deadline), and the group goes on."""
    g = engine.world
    r = g.rank
    return await outcomes(g, {
        "gather": lambda: g.gather(np.ones(4), [np.zeros(4), np.zeros(3), np.zeros(4)] if r == 0 else None,
                                   0, timeout=20),
        "scatter": lambda: g.scatter(np.zeros(4), None, 1, timeout=20)})


async def outcomes(g, calls: dict) -> dict:
    """``{name: ("Type: message" or "no error", seconds)}`` of each call in turn, under
    ``"refused_by"`` each error's ``rank`` attribute by call, and under ``"after"`` the sum of an
    all_reduce of ones run after them (the group's size if in step)."""
    out, refused_by = {}, {}
    for name, call in calls.items():
        t0 = time.monotonic()
        try:
            await call()
            out[name] = ("no error", 0.0)
        except Exception as exc:   # noqa: BLE001 - the test asserts on type and text
            out[name] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
            refused_by[name] = getattr(exc, "rank", None)
    x = np.ones(2)
    await g.all_reduce(x, timeout=20)
    out["after"] = float(x[0])
    return out | {"refused_by": refused_by}


def test_a_root_refusing_its_list_tells_the_others_at_once():
    res = run_world(3, root_refuses)
    assert res[0]["gather"][0] == "ValueError: gather_list[1] is float64[3], tensor is float64[4]"
    assert res[1]["scatter"][0] == "ValueError: scatter: scatter_list is required on the source rank"
    for r, out in enumerate(res):
        if r != 0:
            assert out["gather"][0].startswith("CollectiveRefusedError: rank 0 refused its call matching this gather") and \
                "gather_list[1] is float64[3]" in out["gather"][0], out
        if r != 1:
            assert out["scatter"][0].startswith("CollectiveRefusedError: rank 1 refused its call matching this scatter") and \
                "scatter_list is required" in out["scatter"][0], out
        assert out["gather"][1] < 10 and out["scatter"][1] < 10, out
        assert out["after"] == 3.0


async def one_rank_refuses(engine):
    """Each collective called with an argument only rank 1 gets wrong: rank 1 raises its own
    ValueError at once; the others' matching call fails at once (not at its 20 s deadline) with
    a CollectiveError naming rank 1 and quoting its error; then the group goes on, in step."""
    g = engine.world
    bad = g.rank == 1
    n = g.size
    return await outcomes(g, {
        "all_reduce": lambda: g.all_reduce(np.ones(4, np.int32 if bad else np.float32), ReduceOp.AVG,
                                           timeout=20),
        "broadcast": lambda: g.broadcast(np.ones(4), 7 if bad else 0, timeout=20),
        "reduce": lambda: g.reduce(np.ones(4), 0, timeout=-1 if bad else 20),
        "all_gather": lambda: g.all_gather(np.zeros(n * 4 + (1 if bad else 0)), np.ones(4), timeout=20),
        "reduce_scatter": lambda: g.reduce_scatter(np.zeros(4), np.ones(n * 4), timeout=20,
                                                   algorithm="fast" if bad else None),
        "all_to_all": lambda: g.all_to_all(np.zeros(n * 2 + (1 if bad else 0)), np.ones(n * 2), timeout=20),
        "barrier": lambda: g.barrier(timeout="soon" if bad else 20),
        "split": lambda: g.split(1.5 if bad else 0, timeout=20),
        "all_reduce of a list": lambda: g.all_reduce([1.0] if bad else np.ones(1), timeout=20),
    })


def test_a_call_one_rank_refuses_fails_the_others_at_once_and_the_group_goes_on():
    res = run_world(3, one_rank_refuses)
    mine = res[1]
    for name, (err, took) in [(k, v) for k, v in mine.items() if k not in ("after", "refused_by")]:
        assert err.startswith("ValueError: "), (name, err)
        assert took < 5, (name, took)
        for r in (0, 2):
            theirs, their_took = res[r][name]
            assert theirs.startswith("CollectiveRefusedError: rank 1 refused its call matching this "), (r, name, theirs)
            assert theirs.endswith("the group is still in step, no reform is needed)"), (r, name, theirs)
            assert res[r]["refused_by"][name] == 1, res[r]["refused_by"]   # exc.rank
            assert err.split(": ", 1)[1] in theirs, (r, name, theirs, err)     # quoted
            assert their_took < 10, (r, name, their_took)
    assert "AVG of integer" in mine["all_reduce"][0] or "AVG" in mine["all_reduce"][0], mine
    assert "rank 7 (int) is not a rank of this group of size 3 (an int in 0..2)" in mine["broadcast"][0], mine
    assert "-1" in mine["reduce"][0] and "'soon'" in mine["barrier"][0], mine
    assert "1.5" in mine["split"][0] and "list" in mine["all_reduce of a list"][0], mine
    assert all(out["after"] == 3.0 for out in res), res


async def a_send_refused(engine):
    """Rank 0 refuses its own sends (an array of objects; a timeout of "soon"); rank 1's matching
    recv fails at once with a CollectiveRefusedError quoting it, and the pair goes on."""
    g = engine.world
    if g.rank == 0:
        return await outcomes(g, {
            "dtype": lambda: g.send(np.array([object()] * 4), 1, tag=3, timeout=20),
            "timeout": lambda: g.send(np.ones(4), 1, tag=4, timeout="soon"),
            "next": lambda: g.send(np.full(4, 7.0), 1, tag=5, timeout=20)})
    got = np.zeros(4)
    out = await outcomes(g, {
        "dtype": lambda: g.recv(np.zeros(4), 0, tag=3, timeout=20),
        "timeout": lambda: g.recv(np.zeros(4), 0, tag=4, timeout=20),
        "next": lambda: g.recv(got, 0, tag=5, timeout=20)})
    return out | {"got": got.tolist()}


def test_a_send_refused_on_its_rank_fails_the_matching_recv_at_once():
    # Before, the receiver waited out its deadline (20 s here), and ranks that then went on to a
    # collective were out of step (a tester's find, a CUDA array sent where CuPy is missing).
    res = run_world(2, a_send_refused)
    for name in ("dtype", "timeout"):
        err, took = res[0][name]
        assert err.startswith("ValueError: "), (name, err)
        theirs, their_took = res[1][name]
        assert theirs.startswith(f"CollectiveRefusedError: rank 0 refused its send matching this "
                                 f"recv (tag {3 if name == 'dtype' else 4}): ValueError: "), theirs
        assert err.split(": ", 1)[1] in theirs and res[1]["refused_by"][name] == 0, (err, theirs)
        assert their_took < 10, their_took
    assert res[0]["next"][0] == res[1]["next"][0] == "no error" and res[1]["got"] == [7.0] * 4
    assert res[0]["after"] == res[1]["after"] == 2.0


async def a_recv_refused(engine):
    """Rank 1 refuses its first recv (a timeout of "soon"), once before rank 0's send arrived
    (tag 1) and once after (tag 2); its next recvs of each tag get the next sends' data."""
    g = engine.world
    if g.rank == 0:
        await g.send(np.full(4, 1.0), 1, tag=2)
        await g.barrier(timeout=20)
        await g.send(np.full(4, 1.0), 1, tag=1)
        for tag in (1, 2):
            await g.send(np.full(4, 2.0), 1, tag=tag)
        await g.barrier(timeout=20)
        return None
    errors = []
    await g.barrier(timeout=20)                      # tag 2's first message is here by now
    for tag in (1, 2):
        try:
            await g.recv(np.zeros(4), 0, tag=tag, timeout="soon")
        except ValueError as exc:
            errors.append(str(exc))
    got = {}
    for tag in (1, 2):
        x = np.zeros(4)
        await g.recv(x, 0, tag=tag, timeout=20)
        got[tag] = x.tolist()
    await g.barrier(timeout=20)
    return errors, got


def test_a_recv_refused_on_its_rank_takes_its_message_so_the_next_recv_gets_the_next():
    # Before, the refused recv left its message queued: every later recv got the message before
    # its own, with no error (a fresh user's find).
    _, (errors, got) = run_world(2, a_recv_refused)
    assert len(errors) == 2 and all("timeout must be a positive number of seconds" in e for e in errors), errors
    assert got == {1: [2.0] * 4, 2: [2.0] * 4}, got


async def mismatched_new_group(engine):
    # a breaker's find: rank 0 made new_group([0, 1]), rank 1 new_group([0, 1, 2]); the timeout
    # named the rank waited for, not the likely cause
    r = engine.world.rank
    g = engine.world.new_group([0, 1] if r == 0 else [0, 1, 2])
    try:
        await g.all_reduce(np.ones(2, np.float32), timeout=1.0)
    except CollectiveTimeout as exc:
        msg = str(exc)
    else:
        msg = None
    # a later operation of a group made alike on its ranks says nothing of new_group
    ok = engine.world.new_group([1, 2])
    a = np.ones(2, np.float32)
    late = None
    if ok is not None:
        await ok.all_reduce(a)
        try:
            if r == 1:   # rank 2 does not take part
                await ok.all_reduce(a, timeout=0.3)
        except CollectiveTimeout as exc:
            late = str(exc)
    return msg, float(a[0]), late


def test_a_new_group_made_of_other_ranks_elsewhere_times_out_naming_the_likely_cause():
    res = run_world(3, mismatched_new_group)
    assert "did rank(s) [1] call new_group([0, 1]) too, as often and in the same order?" in res[0][0], res[0]
    assert "did rank(s) [0] call new_group([0, 1, 2]) too" in res[1][0] \
        or "did rank(s) [0] call new_group([0, 1, 2]) too" in res[2][0], res
    assert [r[1] for r in res] == [1.0, 2.0, 2.0]
    # the second operation of a group: no such hint
    assert res[1][2] is not None and "waiting for ranks [2]" in res[1][2] and "new_group" not in res[1][2], res[1]


async def cancelled_while_queued(engine):
    # a breaker's find: a call cancelled while it waited behind an earlier one of its group
    # (Ctrl-C on a blocking call queued after an async_op, task.cancel()) told nobody: the peer's
    # call of that number waited out its deadline, and the next call timed out on one rank and
    # succeeded on the other
    g = engine.world
    loop = asyncio.get_running_loop()
    out = {}
    a, b = np.ones(4, np.float32), np.full(4, 2, np.float32)
    if g.rank == 0:
        ta = asyncio.ensure_future(g.all_reduce(a, timeout=20))
        tb = asyncio.ensure_future(g.all_reduce(b, timeout=20))
        await asyncio.sleep(0.3)
        tb.cancel()
        await asyncio.gather(ta, tb, return_exceptions=True)
        out["B"] = "cancelled" if tb.cancelled() else "not cancelled"
    else:
        await asyncio.sleep(1.0)
        await g.all_reduce(a, timeout=20)
        t0 = loop.time()
        try:
            await g.all_reduce(b, timeout=20)
            out["B"] = "ok"
        except CollectiveError as exc:
            out["B"] = str(exc)
        out["B_s"] = loop.time() - t0
    out["A"] = float(a[0])
    for name in ("C", "D"):
        c = np.full(4, float(g.rank + 1), np.float32)
        await g.all_reduce(c, timeout=5)
        out[name] = float(c[0])
    return out


async def cancelled_before_it_ran(engine, how):
    # a breaker's find: a call cancelled before its coroutine first ran (wait_for(..., 0), a task
    # cancelled before the loop reached it) took no number and told nobody: the peer's call was
    # paired with this rank's next one (a sum of 200 where 300 was due), and so on for good
    g = engine.world
    out = {}
    x = np.full(4, 100.0 * (g.rank + 1), np.float32)
    if g.rank == 0:
        try:
            if how == "wait_for":
                await asyncio.wait_for(g.all_reduce(x, timeout=20), 0)
            else:
                t = asyncio.ensure_future(g.all_reduce(x, timeout=20))
                t.cancel()
                await t
            out["A"] = "ran"
        except (asyncio.CancelledError, TimeoutError) as exc:
            out["A"] = type(exc).__name__
    else:
        await asyncio.sleep(0.3)
        try:
            await g.all_reduce(x, timeout=20)
            out["A"] = float(x[0])
        except CollectiveError as exc:
            out["A"] = str(exc)
    out["x"] = float(x[0])
    for i in range(2):
        c = np.full(4, float(i + g.rank), np.float32)
        await g.all_reduce(c, timeout=5)
        out[i] = float(c[0])
    return out


@pytest.mark.parametrize("how", ["wait_for", "task"])
def test_a_call_cancelled_before_it_ran_fails_the_peers_matching_call(how):
    res = run_world(2, cancelled_before_it_ran, how, timeout_s=60)
    assert res[0]["A"] == {"wait_for": "TimeoutError", "task": "CancelledError"}[how], res
    assert "rank 0 failed all_reduce (group 'w', seq 0): all_reduce was cancelled on that rank " \
           "before it began" in res[1]["A"], res
    assert [r["x"] for r in res] == [100.0, 200.0], res      # nobody's input touched
    assert [(r[0], r[1]) for r in res] == [(1.0, 3.0)] * 2, res   # and still paired


async def cancelled_behind_queued_calls(engine, mode):
    # a re-verifier's find: a call cancelled while queued (or before it began) dropped the early
    # messages of every earlier call still queued here, not only its own: the queued call B then
    # failed with LinkBrokenError on this rank while the peer's B succeeded (5 of 5)
    import time

    g = engine.world
    out = []
    for _ in range(2):
        a, b, c = (np.full(8, g.rank + 1.0) for _ in range(3))
        ta = asyncio.ensure_future(g.all_reduce(a, timeout=10))
        tb = asyncio.ensure_future(g.all_reduce(b, timeout=10))
        if g.rank == 0:
            await asyncio.sleep(0)      # A runs, B queued behind it
            time.sleep(0.3)             # the loop held: the peer ends A and sends B's hello
            await asyncio.sleep(0)      # read here and kept early, for B
            tc = asyncio.ensure_future(g.all_reduce(c, timeout=10))
            if mode == "queued":
                await asyncio.sleep(0)  # C takes its number, queued behind B
            tc.cancel()
        else:
            await asyncio.gather(ta, tb, return_exceptions=True)
            await asyncio.sleep(0.5)    # C still waits for this rank when rank 0 cancels it
            tc = asyncio.ensure_future(g.all_reduce(c, timeout=10))
        got = await asyncio.gather(ta, tb, tc, return_exceptions=True)
        out.append([type(r).__name__ if isinstance(r, BaseException) else float(x[0])
                    for r, x in zip(got, (a, b, c), strict=True)])
        await g.barrier(timeout=10)
    return out


@pytest.mark.parametrize("mode", ["queued", "before_it_began"])
def test_a_call_cancelled_behind_queued_ones_leaves_their_messages_to_them(mode):
    res = run_world(2, cancelled_behind_queued_calls, mode, timeout_s=60)
    assert res[0] == [[3.0, 3.0, "CancelledError"]] * 2, res
    assert res[1] == [[3.0, 3.0, "CollectiveError"]] * 2, res


async def send_cancelled_before_it_began(engine):
    # a re-verifier's find: a send cancelled before it ran sent nothing, and the peer's recv took
    # the sender's next message of that tag in its place, silently
    g = engine.world
    if g.rank == 0:
        try:
            await asyncio.wait_for(g.send(np.full(4, 1.0), 1, timeout=10), 0)
        except TimeoutError:
            pass
        await g.send(np.full(4, 2.0), 1, timeout=10)
        return None
    await asyncio.sleep(0.3)
    out = []
    for _ in range(2):
        b = np.zeros(4)
        try:
            await g.recv(b, 0, timeout=10)
            out.append(float(b[0]))
        except CollectiveError as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def test_a_send_cancelled_before_it_began_fails_its_recv_and_the_next_gets_the_next_message():
    res = run_world(2, send_cancelled_before_it_began, timeout_s=60)
    assert res[1][0] == ("CollectiveRefusedError: rank 0 refused its send matching this recv (tag 0): "
                         "CollectiveError: the send was cancelled on that rank before its message was "
                         "queued"), res
    assert res[1][1] == 2.0, res


async def send_cancelled_then_buffer_reused(engine):
    # a breaker's find: a send cancelled while the transport still read its buffer (zero-copy)
    # raised at once; the caller wrote the buffer, and the peer received a mix of both
    g = engine.world
    n = 8_000_000
    if g.rank == 0:
        a = np.full(n, 7.0, np.float32)
        try:
            await asyncio.wait_for(g.send(a, 1, timeout=20), 0.001)
            out = "returned"
        except TimeoutError:
            out = "cancelled"
        a[:] = -1.0
        await g.barrier(timeout=20)
        return out
    await asyncio.sleep(0.5)
    b = np.zeros(n, np.float32)
    await g.recv(b, 0, timeout=20)
    await g.barrier(timeout=20)
    u, c = np.unique(b, return_counts=True)
    return dict(zip(u.tolist(), c.tolist(), strict=True))


def test_a_cancelled_send_is_delivered_whole_before_the_caller_may_reuse_its_buffer():
    for _ in range(2):
        res = run_world(2, send_cancelled_then_buffer_reused, shm=False, timeout_s=60)
        assert res[1] == {7.0: 8_000_000}, res


def test_a_call_cancelled_while_queued_fails_the_peers_matching_call_at_once():
    res = run_world(2, cancelled_while_queued, timeout_s=60)
    assert res[0]["B"] == "cancelled", res
    assert "rank 0 failed all_reduce (group 'w', seq 1): cancelled on that rank" in res[1]["B"], res
    assert res[1]["B_s"] < 5, res
    assert [(r["A"], r["C"], r["D"]) for r in res] == [(2.0, 3.0, 3.0)] * 2, res
