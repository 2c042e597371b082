"""Reduction operators, the dtypes they accept, and the arithmetic every algorithm shares.

float16 and bfloat16 accumulate in float32 (``acc_dtype``) and are rounded back once at the end;
AVG divides after accumulation. bool supports SUM (logical or), MIN (and) and MAX (or) only;
integers support every op except AVG (an integer mean is not well defined).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterator, Mapping

import numpy as np

__all__ = ["ReduceOp", "SUPPORTED_DTYPES", "bfloat16", "is_bfloat16", "accepted_pairs", "acc_dtype", "check_op_dtype", "reduce_into",
           "combine", "combine2", "finish", "dtype_name", "dtype_from_name"]


class ReduceOp(enum.Enum):
    """The reductions of ``all_reduce``, ``reduce`` and ``reduce_scatter``. ``PRODUCT`` is
    ``PROD`` under torch.distributed's name for it (an alias: the same member)."""
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PROD = "prod"
    PRODUCT = "prod"


@functools.cache
def bfloat16() -> np.dtype:
    """NumPy's bfloat16 dtype (``ml_dtypes.bfloat16``), imported on first use: importing ml_dtypes
    costs 0.2 s of CPU (0.6.0; about 1 s for 0.7.0, which pyproject excludes), paid by every
    rank at start if it were imported with rtxnet. An array can only be bfloat16 once its
    creator imported ml_dtypes (or asked for this dtype), so the checks below never import it
    for other dtypes."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """``dtype`` (anything ``np.dtype`` takes) is ``ml_dtypes.bfloat16``, found without
    importing ml_dtypes for any other dtype."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return dt.name == "bfloat16" and dt == bfloat16()


def __getattr__(name: str):
    # ``BFLOAT16`` as before, resolved when first asked for (PEP 562)
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_EAGER: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
_NAMES = ("float16", "bfloat16", *list(_EAGER)[1:])


class _SupportedDtypes(Mapping):
    """Wire name -> NumPy dtype of every dtype collectives accept; bfloat16 resolved on first
    lookup (see :func:`bfloat16`)."""

    def __getitem__(self, name: str) -> np.dtype:
        if name == "bfloat16":
            return bfloat16()
        return _EAGER[name]

    def __contains__(self, name: object) -> bool:   # without resolving bfloat16
        return name in _NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)

    def __repr__(self) -> str:
        return f"SUPPORTED_DTYPES({', '.join(_NAMES)})"


SUPPORTED_DTYPES: Mapping[str, np.dtype] = _SupportedDtypes()
_NAME_OF = {v: k for k, v in _EAGER.items()}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PROD: np.multiply}


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a supported dtype.

    Raises:
        ValueError: the dtype is not supported.
    """
    dt = np.dtype(dtype)
    name = _NAME_OF.get(dt) or ("bfloat16" if is_bfloat16(dt) else None)
    if name is None:
        raise ValueError(f"dtype {dtype} is not supported by rtxnet collectives; supported: "
                         f"{', '.join(SUPPORTED_DTYPES)}")
    return name


def dtype_from_name(name: str) -> np.dtype:
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}") from None


def acc_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype reductions of ``dtype`` accumulate in (float32 for float16 and bfloat16)."""
    return np.dtype(np.float32) if dtype == np.float16 or is_bfloat16(dtype) else dtype


def check_op_dtype(op, dtype: np.dtype) -> ReduceOp:
    """Validate a reduction before anything is sent.

    Raises:
        ValueError: unknown op, unsupported dtype, or an op the dtype has no meaning for
            (PROD or AVG of bool, AVG of integers).
    """
    if not isinstance(op, ReduceOp):
        try:
            op = ReduceOp(op) if isinstance(op, str) else ReduceOp[getattr(op, "name", str(op))]
        except (KeyError, ValueError):
            raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.SUM/AVG/MIN/MAX/PROD") from None
    dtype_name(dtype)
    if dtype == np.bool_ and op in (ReduceOp.PROD, ReduceOp.AVG):
        raise ValueError(f"ReduceOp.{op.name} is not supported for bool; use SUM, MIN or MAX")
    if op is ReduceOp.AVG and dtype.kind in "iu":
        raise ValueError(f"ReduceOp.AVG needs a floating dtype, got {dtype}")
    return op


def accepted_pairs() -> list[tuple[str, ReduceOp]]:
    """Every ``(dtype name, ReduceOp)`` that :func:`check_op_dtype` accepts, in table order."""
    out = []
    for name, dtype in SUPPORTED_DTYPES.items():
        for op in ReduceOp:
            try:
                check_op_dtype(op, dtype)
            except ValueError:
                continue
            out.append((name, op))
    return out


# A float reduction that overflows gives inf, and inf - inf NaN, as IEEE 754 defines and as NCCL
# and torch.distributed return them, without a word: NumPy's RuntimeWarning for them ("overflow
# encountered in cast", from rtxnet's own lines) is turned off where rtxnet reduces and casts (a
# fresh user's find). Integers wrap as NumPy's array arithmetic does (it never warns there).
quiet = np.errstate(over="ignore", invalid="ignore")


@quiet
def combine(op: ReduceOp, out: np.ndarray, x: np.ndarray) -> None:
    """``out = out (op) x`` in place; ``out`` is in the accumulation dtype, ``x`` in any."""
    uf = _UFUNC[op]
    if x.dtype != out.dtype:
        uf(out, x, out=out, dtype=out.dtype, casting="unsafe")
    else:
        uf(out, x, out=out)


@quiet
def combine2(op: ReduceOp, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``out = a (op) b`` without temporaries; ``out`` is in the accumulation dtype."""
    uf = _UFUNC[op]
    if a.dtype != out.dtype or b.dtype != out.dtype:
        uf(a, b, out=out, dtype=out.dtype, casting="unsafe")
    else:
        uf(a, b, out=out)


@quiet
def finish(op: ReduceOp, acc: np.ndarray, nranks: int) -> None:
    """Apply what comes after accumulation: AVG divides by the number of ranks."""
    if op is ReduceOp.AVG:
        np.divide(acc, nranks, out=acc)


BLOCK_ELEMS = 1 << 16   # reduce_into's block: cache-sized, and no full-size temporary


@quiet
def reduce_into(op: ReduceOp, xs: list[np.ndarray], out: np.ndarray, n: int,
                also: np.ndarray | None = None) -> None:
    """``out = finish(xs[0] (op) xs[1] (op) ...)`` block by block, accumulating each block in
    the accumulation dtype (:func:`acc_dtype`) and combining in list order, so every rank that
    reduces the same list gets the same bits. ``out`` may be one of ``xs`` (then each block is
    accumulated in a temporary and written once all of its inputs are read); ``also`` gets a
    copy of the result. Needs ``len(xs) >= 2``.
    """
    L = out.size
    accdt = acc_dtype(out.dtype)
    aliased = any(np.may_share_memory(out, x) for x in xs)
    tmp = np.empty(min(BLOCK_ELEMS, L), accdt) if accdt != out.dtype or aliased else None
    for s in range(0, L, BLOCK_ELEMS):
        e = min(s + BLOCK_ELEMS, L)
        o = tmp[:e - s] if tmp is not None else out[s:e]
        combine2(op, o, xs[0][s:e], xs[1][s:e])
        for x in xs[2:]:
            combine(op, o, x[s:e])
        finish(op, o, n)
        if tmp is not None:
            np.copyto(out[s:e], o, casting="unsafe")
        if also is not None:
            np.copyto(also[s:e], out[s:e])
