"""Ring all-reduce: reduce-scatter then all-gather around the ring, in pipelined blocks; the
ring reduce-scatter and all-gather are its two halves (one schedule, :func:`_ring_schedule`).

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

``bulk=True`` runs the same schedule over the bulk TCP streams of
:mod:`transport.bulk`: blocks are received straight into ``acc_N`` (all-gather) or into one reused
scratch block (reduce-scatter), so no message is allocated and nothing is copied twice. A block
sent at step t+1 is not overwritten before the send is complete: its chunk is received again only
at step t+W, from data that went through every rank after this one, the right neighbour included.
The same holds for the halves: a chunk is received (and changed) at most once per operation.
"""

from __future__ import annotations

import numpy as np

from rtxnet.collectives.arrays import off_loop, payload_view
from rtxnet.collectives.reduce_ops import ReduceOp, combine, combine2, finish, quiet

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather",
           "chain_broadcast", "block_nbytes",
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


async def _ring_schedule(op, parts: list[np.ndarray], rop: ReduceOp | None, *, shift: int,
                         nsteps: int, nreduce: int, bulk: bool,
                         sources: list[np.ndarray] | None = None) -> None:
    """The ring's steps over ``parts`` (W contiguous chunks of one dtype, chunk c's elements):
    first send chunk ``(r - shift) mod W``; step t receives chunk ``(r - t - 1 - shift) mod W``
    from the left neighbour, reduces it into the part (t < ``nreduce``; ``finish`` at the last
    such step) or copies it, and forwards it at step t+1 (t+1 < ``nsteps``). Blocks of 1-4 MiB
    (:func:`block_nbytes` of the largest part) pipeline each step. With ``sources`` (W chunks
    like ``parts``, read only) the first send reads ``sources`` and a reduction writes
    ``part = source (op) received`` (no copy of the input into ``parts`` beforehand).

    all-reduce: shift 0, 2(W-1) steps, W-1 reducing; reduce-scatter (rank r ends with chunk r):
    shift 1, W-1 steps, all reducing; all-gather (rank r starts with chunk r): shift 0, W-1
    steps, none reducing.
    """
    n, r = op.n, op.r
    right, left = (r + 1) % n, (r - 1) % n
    dtype = parts[0].dtype
    blk = max(1, block_nbytes(max(p.nbytes for p in parts)) // dtype.itemsize)
    blocks = [_blocks(0, p.size, blk) for p in parts]
    send = op.bulk_send if bulk else op.send
    scratch_B = np.empty(blk, dtype) if bulk and nreduce else None
    first = (r - shift) % n
    if sources is not None:
        # what goes around is in the parts' dtype (float32 for float16 input): cast the first
        # chunk into its part (otherwise unused) unless the dtypes agree
        if sources[first].dtype == dtype:
            parts = [*parts[:first], sources[first], *parts[first + 1:]]
        else:
            await off_loop(parts[first].nbytes, _cast_into, parts[first], sources[first])
    for b, (lo, hi) in enumerate(blocks[first]):
        send(right, b, parts[first][lo:hi])
    for t in range(nsteps):
        c = (r - t - 1 - shift) % n
        for b, (lo, hi) in enumerate(blocks[c]):
            seg, tag = parts[c][lo:hi], t * _STEP_STRIDE + b
            if t < nreduce:
                if bulk:
                    x = scratch_B[:hi - lo]
                    await op.bulk_recv_into(left, tag, x)
                else:
                    _, payload = await op.recv(left, tag)
                    x = payload_view(payload, dtype, hi - lo)
                if sources is None:
                    combine(rop, seg, x)
                else:
                    combine2(rop, seg, sources[c][lo:hi], x)
                if t == nreduce - 1:
                    finish(rop, seg, n)
            elif bulk:
                await op.bulk_recv_into(left, tag, seg)
            else:
                _, payload = await op.recv(left, tag)
                seg[...] = payload_view(payload, dtype, hi - lo)
            if t + 1 < nsteps:
                send(right, (t + 1) * _STEP_STRIDE + b, seg)
    await (op.bulk_flush() if bulk else op.flush())


@quiet
def _cast_into(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst, src, casting="unsafe")


def _split(acc_N: np.ndarray, n: int) -> list[np.ndarray]:
    N = acc_N.size
    return [acc_N[c * N // n:(c + 1) * N // n] for c in range(n)]


async def ring_all_reduce(op, acc_N: np.ndarray, rop: ReduceOp, *, bulk: bool = False) -> None:
    """All-reduce contiguous ``acc_N`` in place over ``op``'s group (AVG division included);
    ``bulk``: over the bulk TCP streams, else over ZeroMQ messages."""
    n = op.n
    await _ring_schedule(op, _split(acc_N, n), rop, shift=0, nsteps=2 * (n - 1), nreduce=n - 1,
                         bulk=bulk)


async def ring_reduce_scatter(op, chunks: list[np.ndarray], parts: list[np.ndarray], rop: ReduceOp,
                              *, bulk: bool) -> None:
    """Reduce-scatter around the ring: ``chunks[k]`` (this rank's input for rank k, contiguous,
    read only) reduced over the group lands in ``parts[r]`` (AVG divided); the other ``parts``
    (the accumulation dtype, contiguous, ``parts[(r-1) mod W]`` unused) are scratch. Each rank
    sends and receives (W-1)/W of the input, as nccl's ring."""
    n = op.n
    await _ring_schedule(op, parts, rop, shift=1, nsteps=n - 1, nreduce=n - 1, bulk=bulk,
                         sources=chunks)


async def ring_all_gather(op, parts: list[np.ndarray], *, bulk: bool) -> None:
    """All-gather around the ring: ``parts[k]`` (contiguous, writable but for this rank's own)
    receives rank k's chunk; ``parts[r]`` is read only. Each rank sends and receives W-1
    chunks, forwarding each block as it lands."""
    n = op.n
    await _ring_schedule(op, parts, None, shift=0, nsteps=n - 1, nreduce=0, bulk=bulk)


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
