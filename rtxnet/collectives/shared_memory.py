"""Same-host collectives through shared memory; ZeroMQ carries only the signals.

Each rank of a group owns one segment with two slots (double buffering) and maps its peers'
segments read-only. An operation writes this rank's input into its next slot, offers the slot in
the signature exchange (``hello``), then reads what it needs straight from the peers' slots:

- all_reduce: copy the input (all but this rank's own chunk) into the slot; reduce chunk ``r``
  from the peers' slots and the local input, writing it into both the slot and the output; one
  signal round; copy every other reduced chunk from its owner's slot. Memory traffic per rank is
  about 2 reads + 2 writes of the array, with no temporaries (float16/bfloat16 go through a small
  float32 block).
- reduce_scatter: the same without the second half. all_gather and broadcast: one copy in, one
  copy out per peer; a broadcast above two pieces of ``BCAST_PIECE_NBYTES`` goes piece by piece,
  the root's copy of one beside the peers' copies of the one before.

Why two slots and no "done" round: a rank only starts operation k+1 of a group after receiving
every peer's hello of operation k, which each peer sends after finishing operation k-1. So the
slot written at operation k-1 is free again at operation k+1.

Segment files are unlinked as soon as every peer has mapped them: an operation that offers a new
segment ends with every peer acknowledging the mapping, then the owner unlinks the file. Growth is
rare (segments only grow), so this costs one signal round per new segment. A crash after that
leaks nothing; a crash before is cleaned by ``transport.shm.reap_dead_segments``.
"""

from __future__ import annotations

import errno
import gc
import time

import numpy as np

from rtxnet.collectives.arrays import copy_pairs, off_loop, payload_view
from rtxnet.collectives.reduce_ops import ReduceOp, reduce_into
from transport.errors import CollectiveError
from transport.shm import PeerSegment, Segment

__all__ = ["ShmState", "all_reduce", "reduce_scatter", "all_gather", "broadcast"]

_MAPPED_STEP = 1000
_PIECE_STEP = 2000
_BCAST_STEP = 3000
PIECE_NBYTES = 8 << 20  # all_reduce pipeline piece: a quarter of a 32 MiB last-level cache
# broadcast's piece. Measured (tools/bench/collectives.py --repeat 3, broadcast of 16 and 64 MiB,
# this repository's 2-core machine, 2026-12-06), ms at 2 ranks, then at 4: 1 MiB pieces
# 4.50/18.56, 14.05/49.75 (a signal round per piece); 2 MiB 3.17-3.58/12.50-13.27,
# 9.00-11.90/33.17-38.02; 4 MiB 3.31/10.87, 7.30/27.61; 8 MiB 7.44 (two pieces: not
# pipelined)/13.78, 11.32/29.32; one piece 7.19/23.63, 10.66/31.61; TCP alone (2 ranks)
# 4.16/16.54, gloo 5.08/19.48
BCAST_PIECE_NBYTES = 4 << 20
_ALIGN = 1 << 16


class ShmState:
    """This rank's segment for one group and its mappings of the peers' segments."""

    def __init__(self, engine):
        self.engine = engine
        self.seg: Segment | None = None
        self.slot_nbytes = 0
        self.parity = 0
        self.announced: list[tuple[Segment, int]] = []
        self.retired: list[Segment] = []
        self.peer_maps: dict[int, PeerSegment] = {}
        self.fresh = False
        self.unmapped_left: list[Segment | PeerSegment] = []   # see taint
        self.dropped: set[str] = set()   # names of the peers' segments taint unmapped
        # a peer failed an operation that ended well here (Engine._late_abort): it may have
        # unmapped this rank's segment, whose file is unlinked, so the next slot is a new one
        self.renew = False

    def slot(self, nbytes: int, seq: int) -> tuple[memoryview, list]:
        """The next free slot of at least ``nbytes`` and the offer that names it."""
        self._unmap_left()
        if self.seg is None or self.slot_nbytes < nbytes or self.renew:
            cap = max(-(-max(nbytes, 1) // _ALIGN) * _ALIGN, self.slot_nbytes if self.seg else 0)
            self.renew = False
            try:
                seg = self._new_segment(2 * cap)
            except OSError as exc:
                # raised before this rank's hello: the peers are told by the group's abort
                raise CollectiveError(
                    f"cannot make this rank's shared-memory segment for a {nbytes}-byte "
                    f"operation: {exc.strerror or exc}; give /dev/shm more room (a container's "
                    f"is 64 MiB by default: docker run --shm-size, a Kubernetes emptyDir of "
                    f"medium Memory) or set RTXNET_SHM=0 to move same-host payloads over TCP"
                ) from exc
            if self.seg is not None:
                self.retired.append(self.seg)
            self.seg = seg
            self.slot_nbytes = cap
            self.parity = 0
            self.announced.append((self.seg, seq))
            self.fresh = True
        off = self.parity * self.slot_nbytes
        self.parity ^= 1
        return self.seg.buf[off:off + nbytes], [self.seg.name, self.seg.nbytes, off]

    def _new_segment(self, nbytes: int) -> Segment:
        """A new segment; where ``/dev/shm`` has no room, again after a garbage collection and
        :meth:`_unmap_left` (the frames of a failed operation, held by its exception's traceback,
        may still view segments :meth:`taint` could not unmap), a few times over 0.18 s: the
        peers unmap theirs as their own next operation begins, maybe a little later than this
        one (a re-verifier's find: 1 of 6 runs failed a 4 MiB all_reduce after a failed 24 MiB
        all_gather, on 2 ranks and a 64 MiB ``/dev/shm``). Blocks for that time, on that path only.
        """
        for pause in (0.0, 0.0, 0.01, 0.02, 0.05, 0.1):
            if pause:
                time.sleep(pause)
            try:
                return Segment(self.engine._next_segment_name(), nbytes)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                last = exc
            gc.collect()
            self._unmap_left()
        raise last

    def offer(self) -> list | None:
        self._unmap_left()
        return None if self.seg is None else [self.seg.name, self.seg.nbytes, 0]

    def after_hello(self, seq: int) -> None:
        """Every peer finished every operation before ``seq``: unlink what they all mapped."""
        keep = []
        for seg, s in self.announced:
            if s < seq:
                seg.unlink()
            else:
                keep.append((seg, s))
        self.announced = keep
        still = []
        for seg in self.retired:
            if seg.linked:
                still.append(seg)
            else:
                seg.close()
        self.retired = still

    def map_all(self, op, got: dict) -> None:
        """Map every peer's offered segment (so that its owner may unlink it)."""
        for g in self.map_peers(op, got):
            op.send(g, _MAPPED_STEP)

    def map_peers(self, op, got: dict) -> list[int]:
        """Map every peer's offered segment; returns the peers whose segment is new here (they
        must be told, ``_MAPPED_STEP``). Sends nothing, so it may run in a worker thread: a
        mapping is populated page by page (``MAP_POPULATE``), 0.1 s and more for a large one."""
        new = []
        for g, (offer, _) in got.items():
            if g != op.r and offer is not None:
                known = self.peer_maps.get(g)
                self._map(op, g, offer)
                if known is None or known.name != offer[0]:
                    new.append(g)
        return new

    async def settle(self, op) -> None:
        """End of an operation: once every peer mapped a new segment, unlink its file."""
        if self.fresh:
            await op.recv_all(op.peers, _MAPPED_STEP)
            self.fresh = False
            self.seg.unlink()
            self.announced = [(s, q) for s, q in self.announced if s is not self.seg]

    def _map(self, op, g: int, offer) -> PeerSegment:
        if not (isinstance(offer, list) and len(offer) == 3 and isinstance(offer[0], str)
                and all(type(v) is int for v in offer[1:])):
            raise CollectiveError(f"malformed shm offer from rank {op.group.ranks[g]}: {offer!r}")
        m = self.peer_maps.get(g)
        if m is None or m.name != offer[0]:
            if m is not None:
                m.close()
            try:
                m = PeerSegment(offer[0], offer[1])
            except (OSError, ValueError) as exc:
                hint = ""
                if isinstance(exc, FileNotFoundError) and offer[0] in self.dropped:
                    # this rank's own earlier operation failed (or was cancelled) as the peer's
                    # ended well: the peer unlinked its file once mapped everywhere and offers it
                    # again, unaware (a breaker's find, told as the peer's leaving before)
                    hint = (f": this rank unmapped it when an earlier operation of this group "
                            f"failed or was cancelled here, and rank {op.group.ranks[g]} has since "
                            f"removed its file as usual (nobody left: the next operation maps "
                            f"afresh)")
                elif isinstance(exc, FileNotFoundError):
                    # a tester's find: two hosts given one RTXNET_HOST (or one hostname) without
                    # a shared /dev/shm failed every collective of 64 KiB and more with this;
                    # another's: a peer's pg.close() during the operation, told as if the hosts
                    # were set up wrong. Both causes, the commoner first.
                    hint = (f": rank {op.group.ranks[g]} removed it, leaving the group (closed or "
                            "ended during this operation) or failing its own part of it (as "
                            "after an operation cancelled there: its error says), or this rank "
                            "does not share its "
                            "/dev/shm (ranks that report one host must share it: on another "
                            "machine or container, give each host its own RTXNET_HOST)")
                raise CollectiveError(f"cannot map shm segment {offer[0]} of rank "
                                      f"{op.group.ranks[g]}: {exc}{hint}") from exc
            self.peer_maps[g] = m
        return m

    def peer_array(self, op, g: int, offer, dtype: np.dtype, count: int) -> np.ndarray:
        m = self._map(op, g, offer)
        off, nbytes = offer[2], count * dtype.itemsize
        if off < 0 or off + nbytes > m.nbytes:
            raise CollectiveError(f"shm offer of rank {op.group.ranks[g]} out of bounds")
        return payload_view(m.buf[off:off + nbytes], dtype, count)

    def taint(self) -> None:
        """An operation failed: peers may still read our slots, so never write them again.

        Every segment of this rank is unlinked and unmapped now, and so are the mappings of the
        peers' segments (an unmapping is skipped while arrays still view the memory,
        :func:`transport.shm._close_map`; the peers' own mappings stay valid): the peers fail the
        same operation (told by the abort) and offer new segments at the next one. Before, the
        segment a failed operation made stayed linked until the next operation's hello, and the
        peers kept the old ones mapped: a failed growth (a 4 MiB all_reduce, then a 16 MiB one,
        3 ranks, a 64 MiB ``/dev/shm``) failed every later operation, files piling up (a
        tester's find). A peer whose operation had ended before the abort offers its segment
        again, which may be unlinked by then: that operation fails naming it, and the next one
        maps afresh.

        A mapping still viewed (the failed operation's frames, held by its exception's traceback
        until a garbage collection) is unmapped at this rank's next operation
        (:meth:`_unmap_left`): a rank whose own segment was made before a peer's failed kept
        it mapped, and the next operations that fit failed for want of room (a re-verifier's
        find)."""
        held = self.retired + [s for s, _ in self.announced] + ([self.seg] if self.seg is not None else [])
        held += list(self.peer_maps.values())
        self.dropped = {m.name for m in self.peer_maps.values()}
        for m in held:
            m.close()
        self.unmapped_left += [m for m in held if m.mapped]
        self.retired, self.announced, self.seg = [], [], None
        self.fresh = False
        self.peer_maps.clear()

    def _unmap_left(self) -> None:
        """Unmap what :meth:`taint` could not, after a garbage collection (only after a failed
        operation left some)."""
        if self.unmapped_left:
            gc.collect()
            for m in self.unmapped_left:
                m.close()
            self.unmapped_left = [m for m in self.unmapped_left if m.mapped]

    def close(self) -> None:
        for seg in self.retired + ([self.seg] if self.seg is not None else []) + self.unmapped_left:
            seg.close()
        self.unmapped_left = []
        for seg, _ in self.announced:
            seg.close()
        self.retired, self.seg, self.announced = [], None, []
        for m in self.peer_maps.values():
            m.close()
        self.peer_maps.clear()


async def all_reduce(op, st: ShmState, sig: list, flat: np.ndarray, rop: ReduceOp) -> None:
    """Pipelined over pieces of ``PIECE_NBYTES`` so that what one rank writes is still in the
    shared last-level cache when its peers read it (and segments stay small)."""
    n, r, N, dtype = op.n, op.r, flat.size, flat.dtype
    piece = max(n, PIECE_NBYTES // dtype.itemsize)
    for k, s in enumerate(range(0, max(N, 1), piece)):
        part = flat[s:min(s + piece, N)]
        M = part.size
        mv, offer = st.slot(M * dtype.itemsize, op.seq)
        mine = payload_view(mv, dtype, M)
        b = [c * M // n for c in range(n + 1)]
        lo, hi = b[r], b[r + 1]
        np.copyto(mine[:lo], part[:lo])
        np.copyto(mine[hi:], part[hi:])
        if k == 0:
            got = await op.hello(sig, offer)
            st.map_all(op, got)
        else:
            for g in op.peers:
                op.send(g, _PIECE_STEP + 2 * k, meta=offer)
            got = await op.recv_all(op.peers, _PIECE_STEP + 2 * k)
        peers = {g: st.peer_array(op, g, got[g][0], dtype, M) for g in op.peers}
        srcs = [part[lo:hi] if g == r else peers[g][lo:hi] for g in range(n)]
        reduce_into(rop, srcs, mine[lo:hi], n, also=part[lo:hi])
        for g in op.peers:
            op.send(g, _PIECE_STEP + 2 * k + 1)
        await op.recv_all(op.peers, _PIECE_STEP + 2 * k + 1)
        for g in op.peers:
            np.copyto(part[b[g]:b[g + 1]], peers[g][b[g]:b[g + 1]])
    await st.settle(op)


async def _map_all(op, st: ShmState, got: dict, nbytes: int) -> None:
    """:meth:`ShmState.map_all`, the mapping off the event loop when large (the sends on it)."""
    for g in await off_loop(nbytes, st.map_peers, op, got):
        op.send(g, _MAPPED_STEP)


async def reduce_scatter(op, st: ShmState, sig: list, chunks: list[np.ndarray],
                         out: np.ndarray, rop: ReduceOp) -> None:
    n, r, N, dtype = op.n, op.r, out.size, out.dtype
    nbytes = n * N * dtype.itemsize
    mv, offer = await off_loop(nbytes, st.slot, nbytes, op.seq)
    mine = payload_view(mv, dtype, n * N)
    await off_loop(nbytes, copy_pairs, [(mine[g * N:(g + 1) * N], chunks[g]) for g in op.peers])
    got = await op.hello(sig, offer)
    await _map_all(op, st, got, nbytes)
    srcs = [chunks[r] if g == r else
            st.peer_array(op, g, got[g][0], dtype, n * N)[r * N:(r + 1) * N] for g in range(n)]
    await off_loop(nbytes, reduce_into, rop, srcs, out, n)
    await st.settle(op)


async def all_gather(op, st: ShmState, sig: list, inp: np.ndarray,
                     slots: list[np.ndarray]) -> None:
    r, N, dtype = op.r, inp.size, inp.dtype
    nbytes = N * dtype.itemsize
    mv, offer = await off_loop(nbytes, st.slot, nbytes, op.seq)
    await off_loop(nbytes, np.copyto, payload_view(mv, dtype, N), inp)
    got = await op.hello(sig, offer)
    await _map_all(op, st, got, nbytes)
    pairs = [(slots[g], inp if g == r else st.peer_array(op, g, got[g][0], dtype, N))
             for g in range(op.n)]
    await off_loop(op.n * nbytes, copy_pairs, pairs)
    await st.settle(op)


async def broadcast(op, st: ShmState, sig: list, flat: np.ndarray, src: int) -> None:
    N, dtype = flat.size, flat.dtype
    nbytes = N * dtype.itemsize
    if nbytes > 2 * BCAST_PIECE_NBYTES:
        await _broadcast_pieces(op, st, sig, flat, src)
        return
    if op.r == src:
        mv, offer = await off_loop(nbytes, st.slot, nbytes, op.seq)
        await off_loop(nbytes, np.copyto, payload_view(mv, dtype, N), flat)
    else:
        offer = st.offer()
    got = await op.hello(sig, offer)
    await _map_all(op, st, got, nbytes)
    if op.r != src:
        await off_loop(nbytes, np.copyto, flat, st.peer_array(op, src, got[src][0], dtype, N))
    await st.settle(op)


async def _broadcast_pieces(op, st: ShmState, sig: list, flat: np.ndarray, src: int) -> None:
    """A large broadcast in pieces of ``BCAST_PIECE_NBYTES``, the root writing piece k+1 into
    one slot while the peers copy piece k out of the other. In one piece, the peers' copy began
    only when the root's whole copy had ended: 2 ranks took 7.19 ms for 16 MiB where TCP took
    4.16 ms, 3.31 ms in pieces (``BCAST_PIECE_NBYTES``'s figures; a fresh user's find). The root
    writes a slot again only once every peer said it copied the piece it held
    (``_BCAST_STEP + 2k + 1``), and returns once they copied the last two."""
    dtype, N = flat.dtype, flat.size
    per = max(1, BCAST_PIECE_NBYTES // dtype.itemsize)
    pieces = [(a, min(a + per, N)) for a in range(0, N, per)]
    if op.r == src:
        for k, (a, b) in enumerate(pieces):
            if k >= 2:
                await op.recv_all(op.peers, _BCAST_STEP + 2 * (k - 2) + 1)
            mv, offer = st.slot((b - a) * dtype.itemsize, op.seq)
            np.copyto(payload_view(mv, dtype, b - a), flat[a:b])
            if k == 0:
                got = await op.hello(sig, offer)
                await _map_all(op, st, got, per * dtype.itemsize)
            else:
                for g in op.peers:
                    op.send(g, _BCAST_STEP + 2 * k, meta=offer)
        for k in range(max(0, len(pieces) - 2), len(pieces)):
            await op.recv_all(op.peers, _BCAST_STEP + 2 * k + 1)
    else:
        got = await op.hello(sig, st.offer())
        await _map_all(op, st, got, per * dtype.itemsize)
        for k, (a, b) in enumerate(pieces):
            offer = got[src][0] if k == 0 else (await op.recv(src, _BCAST_STEP + 2 * k))[0]
            np.copyto(flat[a:b], st.peer_array(op, src, offer, dtype, b - a))
            op.send(src, _BCAST_STEP + 2 * k + 1)
    await st.settle(op)
