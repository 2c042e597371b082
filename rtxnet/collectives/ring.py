"""Ring all-reduce: reduce-scatter then all-gather around the ring, in pipelined blocks.

Shapes legend: ``acc_N`` the working array of N elements (accumulation dtype), split into W
chunks by element (chunk c = ``[c*N//W, (c+1)*N//W)``), each cut into blocks (``block_nbytes``).

Step t (0 <= t < 2(W-1)) sends chunk ``(r - t) mod W`` to the right neighbour and receives chunk
``(r - t - 1) mod W`` from the left one: for t < W-1 it is reduced into ``acc_N`` (reduce-scatter),
afterwards copied (all-gather). A block is forwarded as soon as it is processed, so the next
rank works on block b while this one receives block b+1 (the pipelining of nccl's ring). Each
chunk is reduced by one rank only, so every rank ends with bit-identical results.

Block size: a quarter of a chunk, within [``MIN_BLOCK_NBYTES``, ``MAX_BLOCK_NBYTES``]. Over TCP on
2 cores, 1 MiB blocks cost three times the context switches of 4 MiB ones and were slower (64 MiB,
2 ranks: 94 ms against 64 ms, medians of 4 alternated runs); 256 KiB blocks were slower still,
16 MiB ones page-faulted more (each zmq message is a fresh allocation) and pipelined less.

``ring_all_reduce_bulk`` is the same schedule over the bulk TCP streams of
:mod:`transport.bulk`: blocks are received straight into ``acc_N`` (all-gather) or into one reused
scratch block (reduce-scatter), so no message is allocated and nothing is copied twice. A block
sent at step t+1 is not overwritten before the send is complete: its chunk is received again only
at step t+W, from data that went through every rank after this one, the right neighbour included.
"""

from __future__ import annotations

import numpy as np

from rtxnet.collectives.arrays import payload_view
from rtxnet.collectives.reduce_ops import ReduceOp, combine, finish

__all__ = ["ring_all_reduce", "ring_all_reduce_bulk", "chain_broadcast", "block_nbytes",
           "MIN_BLOCK_NBYTES", "MAX_BLOCK_NBYTES", "BULK_MIN_NBYTES"]

MIN_BLOCK_NBYTES = 1 << 20
MAX_BLOCK_NBYTES = 4 << 20
_STEP_STRIDE = 1 << 24
# ring all-reduces from this size (of the accumulation array) use the bulk streams
BULK_MIN_NBYTES = 1 << 20


def block_nbytes(chunk_nbytes: int) -> int:
    """Bytes per block for chunks of ``chunk_nbytes``: about four blocks a chunk, 1-4 MiB."""
    return min(MAX_BLOCK_NBYTES, max(MIN_BLOCK_NBYTES, chunk_nbytes // 4))


def _blocks(lo: int, hi: int, blk: int) -> list[tuple[int, int]]:
    return [(s, min(s + blk, hi)) for s in range(lo, hi, blk)]


def _ring_plan(op, acc_N: np.ndarray) -> tuple[int, int, int, int, list[list[tuple[int, int]]], int]:
    """``(n, r, right, left, chunk_blocks, blk)``: chunk ``c`` of ``acc_N`` is cut in blocks of
    ``blk`` elements, ``chunk_blocks[c]`` lists their ``(lo, hi)`` bounds."""
    n, r = op.n, op.r
    N = acc_N.size
    bounds = [c * N // n for c in range(n + 1)]
    blk = max(1, block_nbytes((N // n) * acc_N.itemsize) // acc_N.itemsize)
    chunk_blocks = [_blocks(bounds[c], bounds[c + 1], blk) for c in range(n)]
    return n, r, (r + 1) % n, (r - 1) % n, chunk_blocks, blk


async def ring_all_reduce(op, acc_N: np.ndarray, rop: ReduceOp) -> None:
    """All-reduce ``acc_N`` in place over ``op``'s group (AVG division included)."""
    n, r, right, left, chunk_blocks, _ = _ring_plan(op, acc_N)
    last = 2 * (n - 1)
    for b, (lo, hi) in enumerate(chunk_blocks[r]):
        op.send(right, b, acc_N[lo:hi])
    for t in range(last):
        c = (r - t - 1) % n
        for b, (lo, hi) in enumerate(chunk_blocks[c]):
            _, payload = await op.recv(left, t * _STEP_STRIDE + b)
            x = payload_view(payload, acc_N.dtype, hi - lo)
            seg = acc_N[lo:hi]
            if t < n - 1:
                combine(rop, seg, x)
                if t == n - 2:
                    finish(rop, seg, n)
            else:
                seg[...] = x
            if t + 1 < last:
                op.send(right, (t + 1) * _STEP_STRIDE + b, seg)
    await op.flush()


async def ring_all_reduce_bulk(op, acc_N: np.ndarray, rop: ReduceOp) -> None:
    """``ring_all_reduce`` over the bulk streams; ``acc_N`` must be contiguous."""
    n, r, right, left, chunk_blocks, blk = _ring_plan(op, acc_N)
    scratch_B = np.empty(blk, acc_N.dtype)
    last = 2 * (n - 1)
    for b, (lo, hi) in enumerate(chunk_blocks[r]):
        op.bulk_send(right, b, acc_N[lo:hi])
    for t in range(last):
        c = (r - t - 1) % n
        for b, (lo, hi) in enumerate(chunk_blocks[c]):
            seg = acc_N[lo:hi]
            if t < n - 1:
                x = scratch_B[:hi - lo]
                await op.bulk_recv_into(left, t * _STEP_STRIDE + b, x)
                combine(rop, seg, x)
                if t == n - 2:
                    finish(rop, seg, n)
            else:
                await op.bulk_recv_into(left, t * _STEP_STRIDE + b, seg)
            if t + 1 < last:
                op.bulk_send(right, (t + 1) * _STEP_STRIDE + b, seg)
    await op.bulk_flush()


async def chain_broadcast(op, flat: np.ndarray, src: int, *, bulk: bool) -> None:
    """Broadcast contiguous ``flat`` from group rank ``src`` along the ring ``src -> src+1 ->
    ...``, in pipelined blocks (1-4 MiB): every link carries the array once, and a rank forwards
    block b while it receives block b+1, so the time is about one array's transfer plus one block
    per hop, whatever the group size (the root of a one-round broadcast sends W-1 copies).

    Args:
        flat: 1-d contiguous array; read on ``src``, written in place elsewhere.
        bulk: over the bulk TCP streams (received in place), else over ZeroMQ messages.
    """
    n, r = op.n, op.r
    pos = (r - src) % n
    right, left = (r + 1) % n, (r - 1) % n
    blk = max(1, block_nbytes(flat.nbytes) // max(1, flat.itemsize))
    for b, (lo, hi) in enumerate(_blocks(0, flat.size, blk)):
        seg = flat[lo:hi]
        if pos:
            if bulk:
                await op.bulk_recv_into(left, b, seg)
            else:
                _, payload = await op.recv(left, b)
                seg[...] = payload_view(payload, flat.dtype, hi - lo)
        if pos != n - 1:
            if bulk:
                op.bulk_send(right, b, seg)
            else:
                op.send(right, b, seg)
    if bulk:
        await op.bulk_flush()
    else:
        await op.flush()
