"""The probe an evicted rank makes of the other members' data ports before it rejoins
(``rtxnet.elastic._unreachable_peers``), on real sockets: a port that listens and a port that
refuses are answers; a port that drops every SYN (a listener whose accept queue is full: Linux
drops the SYN, as a cut link or a blackholed address would) is silent; this rank's own endpoint
and endpoints it cannot parse are not taken for silent ones."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rtxnet.agent import Membership
from rtxnet.elastic import _unreachable_peers

pytestmark = pytest.mark.timeout(30)


def _membership(endpoints: dict[str, str]) -> Membership:
    members = {r: {"identity": ident, "endpoint": ep, "host": "h", "pid": 1, "info": {}}
               for r, (ident, ep) in enumerate(endpoints.items())}
    return Membership(job="j", epoch=3, rank=0, world_size=len(members), members=members, lost=(),
                      added=(), reason="formed", committed_step=5)


def _silent_port(held: list[socket.socket]) -> int:
    """A port on loopback whose listener's accept queue is full: a SYN gets no answer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    held.append(srv)
    port = srv.getsockname()[1]
    for _ in range(8):
        c = socket.socket()
        c.settimeout(0.3)
        held.append(c)
        try:
            c.connect(("127.0.0.1", port))
        except TimeoutError:
            return port
    pytest.fail("the accept queue never filled: this kernel answers SYNs past it")


async def test_listening_and_refusing_ports_answer_and_a_port_dropping_syns_is_silent():
    held: list[socket.socket] = []
    try:
        listening = socket.create_server(("127.0.0.1", 0))
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))       # bound, never listening: a connection is refused
        held += [listening, closed]
        lp, cp, sp = listening.getsockname()[1], closed.getsockname()[1], _silent_port(held)
        m = _membership({
            "me": f"tcp://127.0.0.1:{sp}?bulk=2",                # this rank: never probed
            "live": f"tcp://127.0.0.1:{lp}?bulk=1",
            "gone": f"tcp://127.0.0.1:{cp}?bulk=1",
            "cut": f"tcp://127.0.0.1:{sp}?bulk=5556",
            "odd": "ipc:///tmp/x",
            "bad": "tcp://127.0.0.1:notaport",
        })
        t0 = asyncio.get_running_loop().time()
        silent = await _unreachable_peers(m, "me", 0.5)
        assert silent == [f"tcp://127.0.0.1:{sp}?bulk=5556"]
        assert asyncio.get_running_loop().time() - t0 < 3      # probed at once, not one by one
    finally:
        for s in held:
            s.close()


async def test_no_membership_or_no_other_member_is_nothing_to_wait_for():
    assert await _unreachable_peers(None, "me", 0.5) == []
    assert await _unreachable_peers(_membership({"me": "tcp://127.0.0.1:1?bulk=2"}), "me", 0.5) == []
