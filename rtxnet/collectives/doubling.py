"""Recursive-doubling all-reduce: log2(W) rounds of pairwise exchange, for small messages.

For W not a power of two, the first ``2 * (W - P)`` ranks (P the largest power of two <= W) fold
pairwise first: even ones send to the next odd one and wait for the result at the end. Partners
always combine in rank order (lower rank's data first), so every rank gets bit-identical results.
"""

from __future__ import annotations

import numpy as np

from rtxnet.collectives.arrays import off_loop, payload_view
from rtxnet.collectives.reduce_ops import ReduceOp, combine2

__all__ = ["recursive_doubling_all_reduce"]

_FOLD, _UNFOLD, _ROUND = 1, 2, 16


async def recursive_doubling_all_reduce(op, acc_N: np.ndarray, rop: ReduceOp) -> np.ndarray:
    """The element-wise reduction of every rank's ``acc_N`` (not divided for AVG).

    ``acc_N`` itself is not modified; the result is a new array.
    """
    n, r = op.n, op.r
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    dtype, N = acc_N.dtype, acc_N.size
    if r < 2 * rem:
        if r % 2 == 0:
            op.send(r + 1, _FOLD, acc_N)
            _, payload = await op.recv(r + 1, _UNFOLD)
            out = await off_loop(acc_N.nbytes, payload_view(payload, dtype, N).copy)
            await op.flush()
            return out
        _, payload = await op.recv(r - 1, _FOLD)
        acc_N = await off_loop(2 * acc_N.nbytes, _combined, rop, payload_view(payload, dtype, N), acc_N)
        vr = r // 2
    else:
        vr = r - rem
    mask = 1
    while mask < p:
        pv = vr ^ mask
        peer = 2 * pv + 1 if pv < rem else pv + rem
        step = _ROUND + mask.bit_length()
        op.send(peer, step, acc_N)
        _, payload = await op.recv(peer, step)
        x = payload_view(payload, dtype, N)
        # a new array: acc_N may still be going out without a copy
        a, b = (x, acc_N) if pv < vr else (acc_N, x)
        acc_N = await off_loop(2 * acc_N.nbytes, _combined, rop, a, b)
        mask <<= 1
    if r < 2 * rem:
        op.send(r - 1, _UNFOLD, acc_N)
    await op.flush()
    return acc_N


def _combined(rop: ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty_like(b)
    combine2(rop, out, a, b)
    return out
