"""NumPy references and input generators shared by the collective tests (run inside ranks)."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

from rtxnet.collectives import ReduceOp

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "bool"]
FLOATS = {"float16", "bfloat16", "float32", "float64"}
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def ops_for(dtype: str) -> list[ReduceOp]:
    if dtype == "bool":
        return [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX]
    if dtype in FLOATS:
        return list(ReduceOp)
    return [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]


def make(rank: int, case: str, shape, dtype: str, op: ReduceOp | None = None) -> np.ndarray:
    """Deterministic input of ``rank`` for ``case``; small values so sums stay exact."""
    seed = int.from_bytes(hashlib.blake2b(f"{rank}|{case}|{shape}|{dtype}".encode(),
                                          digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if op is ReduceOp.PROD:
        vals = rng.integers(1, 3, size=shape)
    elif dtype == "uint8":
        vals = rng.integers(0, 40, size=shape)
    else:
        vals = rng.integers(-20, 21, size=shape)
    return np.asarray(vals).astype(np_dtype(dtype))


def reduce_ref(xs: list[np.ndarray], op: ReduceOp, dtype: str) -> np.ndarray:
    dt = np_dtype(dtype)
    if dtype == "bool":
        stack = np.stack(xs)
        return (stack.all(0) if op is ReduceOp.MIN else stack.any(0)).astype(bool)
    wide = np.stack([x.astype(np.float64 if dtype in FLOATS else np.int64) for x in xs])
    out = {ReduceOp.SUM: wide.sum(0), ReduceOp.AVG: wide.sum(0) / len(xs),
           ReduceOp.MIN: wide.min(0), ReduceOp.MAX: wide.max(0),
           ReduceOp.PROD: wide.prod(0)}[op]
    return np.asarray(out).astype(dt)


def close(got: np.ndarray, want: np.ndarray, dtype: str, atol: float | None = None) -> bool:
    if got.shape != want.shape:
        return False
    if dtype in FLOATS:
        return np.allclose(got.astype(np.float64), want.astype(np.float64),
                           rtol=RTOL[dtype], atol=RTOL[dtype] if atol is None else atol)
    return np.array_equal(got, want)


# a rank function of test_properties: lives here so ranks need not import Hypothesis
async def run_cases(engine, case_list):
    g = engine.world
    n, r = g.size, g.rank
    fails = []
    for i, (dtype, shape, opname, strided, algo) in enumerate(case_list):
        op = ReduceOp[opname]
        xs = [make(k, f"h{i}", shape, dtype, op) for k in range(n)]
        if strided:
            base = np.zeros(shape + (2,), np_dtype(dtype))
            base[..., 1] = xs[r]
            x = base[..., 1]
        else:
            x = xs[r].copy()
        await g.all_reduce(x, op, algorithm=algo)
        if not close(x, reduce_ref(xs, op, dtype), dtype):
            fails.append((dtype, shape, opname, strided, algo))
        if strided and np.any(base[..., 0]):
            fails.append(("clobbered", dtype, shape))
        out = np.zeros((n,) + shape, np_dtype(dtype))
        await g.all_gather(out, xs[r])
        if not close(out, np.stack(xs), dtype):
            fails.append(("all_gather", dtype, shape))
    return fails


