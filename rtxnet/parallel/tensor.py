"""Tensor parallelism for PyTorch linear layers over an rtxnet process group (Megatron style).

Shapes legend: ``B`` batch dimensions (any number, ``*``), ``I`` in_features, ``O`` out_features,
``W`` ranks of the tensor-parallel group, ``r`` this rank's index in it.

The two layers and their composition follow Shoeybi et al., "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism" (2019), section 3:

- :class:`ColumnParallelLinear` splits the weight ``[O, I]`` along the **output** dimension: rank
  ``r`` holds rows ``r*O/W .. (r+1)*O/W`` (``weight_OlI`` with ``Ol = O/W``) and the matching bias
  slice, and computes its slice of the output. Its input is used whole on every rank, so backward
  all-reduces (sums) the input gradient (Megatron's ``f``). With ``gather_output=True`` the output
  slices are all-gathered into the full ``[*, O]`` (backward keeps this rank's slice of the
  gradient); with ``gather_output=False`` the output stays split, ``[*, O/W]``, ready for a
  row-parallel layer.
- :class:`RowParallelLinear` splits the weight along the **input** dimension: rank ``r`` holds
  columns ``r*I/W .. (r+1)*I/W``. Each rank multiplies its slice of the input and the partial
  products are all-reduced (Megatron's ``g``); the bias, whole on every rank, is added once after
  the sum. With ``input_is_parallel=True`` the input is already split (``[*, I/W]``, the output of
  a column-parallel layer with ``gather_output=False``); otherwise the full ``[*, I]`` is taken
  and this rank keeps its slice (backward all-gathers the gradient).

An MLP ``down(act(up(x)))`` sharded column-then-row (:func:`shard_mlp`) needs one all-reduce in
forward and one in backward, and no communication between the two layers.

The collectives are wrapped in ``torch.autograd.Function`` pairs, each the other's transpose:

=====================  =======================  ==========================
function               forward                  backward
=====================  =======================  ==========================
copy_to_parallel       identity                 all-reduce (SUM)
reduce_from_parallel   all-reduce (SUM)         identity
gather_from_parallel   all-gather, last dim     keep this rank's slice
scatter_to_parallel    keep this rank's slice   all-gather, last dim
=====================  =======================  ==========================

**Matching one process.** Every rank must run the same computation on the same input (the same
data and the same seed; tensor parallelism replicates the batch, it does not split it). A layer
built with :meth:`ColumnParallelLinear.from_linear` / :meth:`RowParallelLinear.from_linear` holds
exact slices of the given ``nn.Linear``; one built from sizes initialises the **full** weight
with ``torch.nn.Linear``'s own initialisation from the current torch RNG state and keeps its
slice, as Megatron's ``_initialize_affine_weight_cpu`` does, so ranks seeded alike hold slices of
the very layer ``torch.manual_seed(s); nn.Linear(I, O)`` would build in one process (the full
weight exists on each rank while it is built). Outputs and gradients then match one process up
to float rounding of the summation order; the gradients of the column layer's weight and bias and
of the row layer's weight are the slices of the single-process gradients, the row layer's bias
gradient is the whole one, on every rank.

**Devices.** CPU tensors (rtxnet's CPU collectives carry them); parameters keep the dtype and
device of the layer they came from. The layers run on CUDA tensors too where the process group
has its GPU path, untested here.

**Failures.** The collectives use the group's deadline (``timeout_s`` overrides it). A peer lost or
a timeout raises :class:`~transport.errors.PeerLostError` or
:class:`~transport.errors.CollectiveTimeout` from ``forward`` or from ``loss.backward()`` (autograd
re-raises an error of a custom Function's backward unchanged). The shards are fixed when the layer
is built: a layer whose group no longer has the size it was built for raises ``ConfigError`` at
its next forward (rebuild it from the full weights, e.g. from a checkpoint). Inside a step that
pinned its world (``FaultTolerance``'s guard, ``pg.pinned()``) the size is that world's: a rank
lost during the step makes its collectives raise ``PeerLostError``, which the guard recovers from. Each rank's slices
are its own: :class:`rtxnet.FaultTolerance` refuses them (``ConfigError``) unless given
``sharded_state=True``, as a recovery without it hands one rank's state to every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from rtxnet.collectives import ReduceOp
from rtxnet.config import is_seconds
from rtxnet.elastic import note_rank_specific
from transport.errors import ConfigError

from ._world import check_group, group_size, step_size

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_mlp", "copy_to_parallel",
           "reduce_from_parallel", "gather_from_parallel", "scatter_to_parallel",
           "clip_grad_norm_", "tp_group_of"]

log = structlog.get_logger(__name__)


def _kw(timeout_s: float | None) -> dict[str, float]:
    return {} if timeout_s is None else {"timeout": timeout_s}


def _all_reduce(x: torch.Tensor, pg: Any, timeout_s: float | None) -> torch.Tensor:
    out = x.detach().contiguous().clone()
    if group_size(pg) > 1:
        pg.all_reduce(out, **_kw(timeout_s))
    return out


def _all_gather_last(x: torch.Tensor, pg: Any, timeout_s: float | None) -> torch.Tensor:
    """``[*, n]`` from every rank -> ``[*, W * n]``, rank k's part at columns ``k*n .. (k+1)*n``."""
    W = group_size(pg)
    if W == 1:
        return x.detach().clone()
    x = x.detach().contiguous()
    out_WBn = torch.empty((W, *x.shape), dtype=x.dtype, device=x.device)
    pg.all_gather(out_WBn, x, **_kw(timeout_s))
    return torch.cat(out_WBn.unbind(0), dim=-1)


def _my_slice_last(x: torch.Tensor, pg: Any) -> torch.Tensor:
    W = group_size(pg)
    n = x.shape[-1]
    if n % W:
        raise ConfigError(f"last dimension({n}) is not divisible by the group size({W})")
    k = n // W
    return x[..., pg.rank * k:(pg.rank + 1) * k].contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, timeout_s):
        ctx.pg, ctx.timeout_s = pg, timeout_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.pg, ctx.timeout_s), None, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, timeout_s):
        return _all_reduce(x, pg, timeout_s)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, timeout_s):
        ctx.pg = pg
        return _all_gather_last(x, pg, timeout_s)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last(grad, ctx.pg), None, None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, timeout_s):
        ctx.pg, ctx.timeout_s = pg, timeout_s
        return _my_slice_last(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.pg, ctx.timeout_s), None, None


def copy_to_parallel(x: torch.Tensor, pg: Any, timeout_s: float | None = None) -> torch.Tensor:
    """Identity in forward; all-reduce (SUM) of the gradient over ``pg`` in backward.

    Args:
        x: any shape and float dtype, CPU; the same on every rank.
        pg: the tensor-parallel group (a process group or a ``new_group`` subgroup).
        timeout_s: deadline of the backward all-reduce; ``None`` uses the group's.

    Raises (in backward):
        PeerLostError, CollectiveTimeout: the all-reduce failed.
    """
    return _CopyToParallel.apply(x, pg, timeout_s)


def reduce_from_parallel(x: torch.Tensor, pg: Any, timeout_s: float | None = None) -> torch.Tensor:
    """All-reduce (SUM) over ``pg`` in forward, into a new tensor; identity in backward.

    Args:
        x: any shape, same shape and dtype on every rank, CPU; not modified.

    Raises:
        PeerLostError, CollectiveTimeout, CollectiveMismatchError: the all-reduce failed.
    """
    return _ReduceFromParallel.apply(x, pg, timeout_s)


def gather_from_parallel(x: torch.Tensor, pg: Any, timeout_s: float | None = None) -> torch.Tensor:
    """All-gather along the last dimension in forward (``[*, n]`` -> ``[*, W*n]``, in rank
    order); backward keeps this rank's slice of the gradient.

    Raises:
        PeerLostError, CollectiveTimeout, CollectiveMismatchError: the all-gather failed.
    """
    return _GatherFromParallel.apply(x, pg, timeout_s)


def scatter_to_parallel(x: torch.Tensor, pg: Any, timeout_s: float | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension in forward (``[*, W*n]`` -> ``[*, n]``);
    backward all-gathers the gradient.

    Raises:
        ConfigError: the last dimension is not divisible by the group size (names both).
        PeerLostError, CollectiveTimeout: the backward all-gather failed.
    """
    return _ScatterToParallel.apply(x, pg, timeout_s)


def _check_split(what: str, n: int, W: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{what}({n!r}) must be a positive int")
    if n % W:
        raise ConfigError(f"{what}({n}) is not divisible by the tensor-parallel group size({W})")
    return n // W


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and not is_seconds(timeout_s):
        raise ConfigError(f"timeout_s({timeout_s!r}) must be a positive number of seconds")


def _full_linear(in_features: int, out_features: int, bias: bool, device: Any, dtype: Any) -> torch.nn.Linear:
    return torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class _ParallelLinear(torch.nn.Module):
    """What the two layers share: the group, its size at build time, the deadline."""

    def __init__(self, pg: Any, timeout_s: float | None):
        super().__init__()
        check_group(pg, type(self).__name__)
        _check_timeout(timeout_s)
        self._pg = pg
        self.world_size = group_size(pg)
        self.rank = int(pg.rank)
        self.timeout_s = timeout_s
        # its slices differ per rank: FaultTolerance without sharded_state would hand one rank's
        # to another after a failure, so it refuses them (rtxnet.elastic.note_rank_specific)
        note_rank_specific(self, pg, f"tensor-parallel {type(self).__name__}")

    def _sharded_names(self) -> tuple[str, ...]:
        return ("weight", "bias")

    def _mark_sharded(self) -> None:
        for name in self._sharded_names():
            p = getattr(self, name, None)
            if isinstance(p, torch.nn.Parameter):
                p._rtx_tp_group = self._pg

    def _check_world(self) -> None:
        self._mark_sharded()
        now = step_size(self._pg)
        if now != self.world_size:
            raise ConfigError(f"{type(self).__name__} was sharded over {self.world_size} ranks and "
                              f"its group now has {now}: rebuild it from the full weights")

    @staticmethod
    def _check_linear(linear: Any) -> None:
        if not isinstance(linear, torch.nn.Linear):
            raise ConfigError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")


def _take_params(layer: _ParallelLinear, full: torch.nn.Linear, w_index, b_index) -> None:
    """Copy ``full.weight[w_index]`` and ``full.bias[b_index]`` (or no bias) into ``layer``'s own
    parameters, keeping ``requires_grad``, and mark the sharded ones (:func:`tp_group_of`)."""
    layer.weight = torch.nn.Parameter(full.weight.detach()[w_index].clone(),
                                      requires_grad=full.weight.requires_grad)
    if full.bias is not None:
        layer.bias = torch.nn.Parameter(full.bias.detach()[b_index].clone(),
                                        requires_grad=full.bias.requires_grad)
    else:
        layer.register_parameter("bias", None)
    layer._mark_sharded()


def tp_group_of(param: torch.Tensor) -> Any | None:
    """The tensor-parallel group ``param`` is sharded over (each rank of it holds another slice),
    or None for a parameter every rank holds whole: the weights and the column layer's bias of
    :class:`ColumnParallelLinear` / :class:`RowParallelLinear` are sharded, the row layer's bias
    is not. (The layers mark their parameters when built and at every forward: a
    ``copy.deepcopy`` of a layer holds unmarked copies until its first forward.)"""
    return getattr(param, "_rtx_tp_group", None)


def tp_group_of_attr(module: torch.nn.Module, attr: str) -> Any | None:
    """:func:`tp_group_of` for the parameter ``module`` holds as ``attr``, from the layer itself
    (what FSDP asks when it takes the parameters over)."""
    if isinstance(module, _ParallelLinear) and attr in module._sharded_names():
        return module._pg
    return None


class NormParts:
    """A gradient norm summed from pieces: ``p``-th powers (maxima for ``p = inf``) of the pieces
    every rank of a tensor-parallel group holds alike (counted once) and of those sharded over
    each group (summed over it). Megatron-LM counts its norm the same way (``clip_grad_norm_fp32``
    skips the tensor-parallel duplicates on all but one rank).

    Every rank that takes part must :meth:`register` the same groups in the same order (one per
    distinct group object of the model's parameters), whatever pieces it holds, so the
    collectives of :meth:`total` match.
    """

    def __init__(self, p: float):
        self.p = p
        self.once = 0.0
        self.groups: dict[int, list[Any]] = {}   # id(group) -> [group, value], registration order

    def _combine(self, a: float, b: float) -> float:
        return max(a, b) if math.isinf(self.p) else a + b

    def register(self, group: Any | None) -> None:
        if group is not None:
            self.groups.setdefault(id(group), [group, 0.0])

    def add(self, t: torch.Tensor, group: Any | None) -> None:
        """Count gradient piece ``t`` (any shape, dtype and device), sharded over ``group``."""
        if not t.numel():
            return
        if math.isinf(self.p):
            v = float(t.detach().abs().max())
        else:
            v = float(torch.linalg.vector_norm(t.detach().double(), self.p) ** self.p)
        if group is None:
            self.once = self._combine(self.once, v)
        else:
            self.register(group)
            entry = self.groups[id(group)]
            entry[1] = self._combine(entry[1], v)

    def total(self, outer: Any = None, timeout_s: float | None = None) -> torch.Tensor:
        """The norm: a float64 0-d CPU tensor. ``outer(vec)``, if given, reduces the float64 vector
        of parts in place over the ranks the pieces were further split across (FSDP's shards)
        before each group's part is reduced over its group.

        Raises:
            PeerLostError, CollectiveTimeout: a reduction failed.
        """
        op = ReduceOp.MAX if math.isinf(self.p) else ReduceOp.SUM
        vec = torch.tensor([self.once] + [v for _, v in self.groups.values()], dtype=torch.float64)
        if outer is not None:
            outer(vec, op)
        for i, (g, _) in enumerate(self.groups.values(), start=1):
            if group_size(g) > 1:
                part = vec[i:i + 1].clone()
                g.all_reduce(part, op=op, **_kw(timeout_s))
                vec[i] = part[0]
        if math.isinf(self.p):
            return vec.max()
        return vec.sum() ** (1.0 / self.p)


def check_clip_args(where: str, max_norm: Any, norm_type: Any) -> float:
    """``float(norm_type)`` once both are in range.

    Raises:
        ConfigError: ``max_norm`` not a positive finite number, ``norm_type`` not a positive
            number or ``math.inf`` (names the value).
    """
    for name, v in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                or (math.isnan(v) or (math.isinf(v) and name == "max_norm")):
            raise ConfigError(f"{where}: {name}({v!r}) must be a positive number"
                              f"{' or math.inf' if name == 'norm_type' else ''}")
    return float(norm_type)


def scale_grads(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``max_norm / (norm + 1e-6)`` when that is below 1 (torch's
    ``clip_grad_norm_`` rule)."""
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *,
                    timeout_s: float | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model with tensor-parallel layers (plain, or
    wrapped in :class:`~rtxnet.parallel.DistributedDataParallel`, whose replicas hold equal
    gradients after backward): the norm of the whole, unsharded model's gradient, the same on
    every rank. torch's own function would take each rank's slices for the whole: every
    tensor-parallel rank would clip by another factor and the slices would drift apart.

    A parameter :func:`tp_group_of` names counts the sum over its group (one all-reduce of one
    float64 per distinct group, in the order the parameters first name it); the others count
    once. A collective: call it on every rank of the tensor-parallel groups, after ``backward``,
    with the same parameters in the same order. For FSDP use its own ``clip_grad_norm_``, which
    does this and sums over the shards too.

    Args:
        parameters: a tensor or an iterable of tensors (e.g. ``model.parameters()``); those
            without ``.grad`` are skipped.
        max_norm: the largest total norm kept; a positive finite number.
        norm_type: p of the p-norm, a positive number or ``math.inf`` (the largest absolute
            element).
        timeout_s: deadline of each all-reduce in seconds; ``None`` uses the group's.

    Returns:
        The total norm before clipping: a float64 0-d CPU tensor. The gradients are multiplied
        in place by ``max_norm / (total + 1e-6)`` when that is below 1.

    Raises:
        ConfigError: ``max_norm`` or ``norm_type`` out of range, a bad ``timeout_s`` (names the
            value).
        PeerLostError, CollectiveTimeout: an all-reduce failed.
    """
    p = check_clip_args("clip_grad_norm_", max_norm, norm_type)
    _check_timeout(timeout_s)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    parts = NormParts(p)
    for t in params:
        parts.register(tp_group_of(t))
        if t.grad is not None:
            parts.add(t.grad, tp_group_of(t))
    norm = parts.total(timeout_s=timeout_s)
    scale_grads((t.grad for t in params if t.grad is not None), max_norm, norm)
    return norm


class ColumnParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` (``[O, I]``) split along the output dimension over ``pg``.

    Args:
        in_features: ``I``.
        out_features: ``O``; must be divisible by the group size ``W``.
        pg: the tensor-parallel group: a :class:`rtxnet.BlockingProcessGroup` or a subgroup from
            its ``new_group``; rank ``r`` of it holds shard ``r``.
        bias: learn a bias (``[O/W]`` here).
        gather_output: all-gather the output to ``[*, O]`` (default, the layer then replaces an
            ``nn.Linear``); False leaves ``[*, O/W]`` for a :class:`RowParallelLinear` with
            ``input_is_parallel=True``.
        timeout_s: deadline of each collective in seconds; ``None`` uses the group's.
        device, dtype: of the parameters (as ``nn.Linear``).

    The full ``nn.Linear(I, O)`` is initialised from the current torch RNG state on every rank and
    this rank's slice kept (see the module notes): seed every rank alike.

    Raises:
        ConfigError: ``O`` not divisible by ``W``, a size that is not a positive int, or a bad
            ``timeout_s``; the message names the values.

    Attributes:
        weight: ``[O/W, I]``, rows ``r*O/W .. (r+1)*O/W`` of the full weight.
        bias: ``[O/W]`` or None.
    """

    def __init__(self, in_features: int, out_features: int, pg: Any, *, bias: bool = True,
                 gather_output: bool = True, timeout_s: float | None = None, device: Any = None,
                 dtype: Any = None, _full: torch.nn.Linear | None = None):
        super().__init__(pg, timeout_s)
        _check_split("in_features", in_features, 1)
        shard = _check_split("out_features", out_features, self.world_size)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = shard
        self.gather_output = bool(gather_output)
        full = _full if _full is not None else _full_linear(in_features, out_features, bias, device, dtype)
        rows = slice(self.rank * shard, (self.rank + 1) * shard)
        _take_params(self, full, rows, rows)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, pg: Any, *, gather_output: bool = True,
                    timeout_s: float | None = None) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (copied; ``linear`` is not modified).

        Args:
            linear: the full layer, identical on every rank (e.g. built after the same seed or
                loaded from the same checkpoint); its dtype, device and ``requires_grad`` are
                kept.

        Raises:
            ConfigError: ``linear`` is not an ``nn.Linear``, or its ``out_features`` is not
                divisible by the group size (names both).
        """
        cls._check_linear(linear)
        return cls(linear.in_features, linear.out_features, pg, bias=linear.bias is not None,
                   gather_output=gather_output, timeout_s=timeout_s, _full=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[*, I]``, identical on every rank. Returns ``[*, O]`` (``gather_output``) or
        ``[*, O/W]``.

        Raises:
            TypeError: ``x`` is not a torch.Tensor.
            ValueError: ``x`` is 0-d, or its last dimension is not ``I`` (names both).
            ConfigError: the group's size changed since the layer was built.
            PeerLostError, CollectiveTimeout: a collective failed (also from backward).
            CollectiveMismatchError: ranks fed inputs of different shapes or dtypes.
        """
        self._check_world()
        if _last_dim("ColumnParallelLinear", x) != self.in_features:
            raise ValueError(f"ColumnParallelLinear: input last dimension({x.shape[-1]}) != "
                             f"in_features({self.in_features})")
        x = copy_to_parallel(x, self._pg, self.timeout_s)
        y_BOl = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            return gather_from_parallel(y_BOl, self._pg, self.timeout_s)
        return y_BOl

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} on rank {self.rank} of {self.world_size}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(_ParallelLinear):
    """``y = x A^T + b`` with ``A`` (``[O, I]``) split along the input dimension over ``pg``.

    Args:
        in_features: ``I``; must be divisible by the group size ``W``.
        out_features: ``O``.
        pg: the tensor-parallel group (as :class:`ColumnParallelLinear`).
        bias: learn a bias, whole (``[O]``) on every rank, added after the all-reduce.
        input_is_parallel: the input is already this rank's slice ``[*, I/W]`` (the output of a
            :class:`ColumnParallelLinear` with ``gather_output=False``); False (default) takes
            the full ``[*, I]`` and slices it here.
        timeout_s, device, dtype: as :class:`ColumnParallelLinear`.

    Raises:
        ConfigError: ``I`` not divisible by ``W``, a size that is not a positive int, or a bad
            ``timeout_s``; the message names the values.

    Attributes:
        weight: ``[O, I/W]``, columns ``r*I/W .. (r+1)*I/W`` of the full weight.
        bias: ``[O]`` or None.
    """

    def __init__(self, in_features: int, out_features: int, pg: Any, *, bias: bool = True,
                 input_is_parallel: bool = False, timeout_s: float | None = None,
                 device: Any = None, dtype: Any = None, _full: torch.nn.Linear | None = None):
        super().__init__(pg, timeout_s)
        shard = _check_split("in_features", in_features, self.world_size)
        _check_split("out_features", out_features, 1)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = shard
        self.input_is_parallel = bool(input_is_parallel)
        full = _full if _full is not None else _full_linear(in_features, out_features, bias, device, dtype)
        cols = slice(self.rank * shard, (self.rank + 1) * shard)
        _take_params(self, full, (slice(None), cols), slice(None))

    def _sharded_names(self) -> tuple[str, ...]:
        return ("weight",)   # the bias is whole on every rank

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, pg: Any, *, input_is_parallel: bool = False,
                    timeout_s: float | None = None) -> RowParallelLinear:
        """This rank's shard of ``linear`` (copied; ``linear`` is not modified).

        Raises:
            ConfigError: ``linear`` is not an ``nn.Linear``, or its ``in_features`` is not
                divisible by the group size (names both).
        """
        cls._check_linear(linear)
        return cls(linear.in_features, linear.out_features, pg, bias=linear.bias is not None,
                   input_is_parallel=input_is_parallel, timeout_s=timeout_s, _full=linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[*, I/W]`` (``input_is_parallel``) or ``[*, I]`` identical on every rank.
        Returns ``[*, O]``, identical on every rank.

        Raises:
            TypeError: ``x`` is not a torch.Tensor.
            ValueError: ``x`` is 0-d, or its last dimension is not the expected one (names both).
            ConfigError: the group's size changed since the layer was built.
            PeerLostError, CollectiveTimeout: a collective failed (also from backward).
            CollectiveMismatchError: ranks fed inputs of different shapes or dtypes.
        """
        self._check_world()
        want = self.in_per_rank if self.input_is_parallel else self.in_features
        if _last_dim("RowParallelLinear", x) != want:
            what = "in_features/W" if self.input_is_parallel else "in_features"
            raise ValueError(f"RowParallelLinear: input last dimension({x.shape[-1]}) != "
                             f"{what}({want})")
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self._pg, self.timeout_s)
        y_BO = reduce_from_parallel(F.linear(x, self.weight), self._pg, self.timeout_s)
        return y_BO + self.bias if self.bias is not None else y_BO

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} on rank {self.rank} of "
                f"{self.world_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


def _last_dim(who: str, x: Any) -> int:
    """``x``'s last dimension; ``TypeError`` for what is not a tensor, ``ValueError`` for a 0-d
    one (a NumPy input raised AttributeError, a 0-d one IndexError: a breaker's find)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: the input must be a torch.Tensor [*, in_features], got "
                        f"{type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{who}: the input is 0-d; it needs a last dimension of in features "
                         f"([*, in_features])")
    return x.shape[-1]


def shard_mlp(module: torch.nn.Module, pg: Any, *, up: str, down: str,
              timeout_s: float | None = None) -> torch.nn.Module:
    """Shard an MLP ``down(act(up(x)))`` over ``pg``, in place: column-parallel ``up`` (output
    left split), row-parallel ``down`` (input taken split).

    Whatever runs between the two (an element-wise activation, dropout with a rank-independent
    mask aside) sees only this rank's ``[*, H/W]`` slice of the hidden layer, so it must act
    element-wise. The module's output and gradients match the unsharded module (module notes).

    Args:
        module: holds both layers; replaced in place, and returned.
        pg: the tensor-parallel group.
        up, down: dotted names of the two ``nn.Linear`` submodules (``"fc1"``, ``"mlp.0"``).
        timeout_s: as :class:`ColumnParallelLinear`.

    Raises:
        ConfigError: a name that is not a str naming an ``nn.Linear`` submodule, ``up`` and
            ``down`` naming the same layer (the same name, or one ``nn.Linear`` under two names), ``down``'s in_features other than ``up``'s
            out_features (names swapped), or the hidden size (``up``'s out_features) not
            divisible by the group size; names them.
    """
    layers = {}
    for role, name in (("up", up), ("down", down)):
        if not isinstance(name, str):
            raise ConfigError(f"shard_mlp: {role}({name!r}) must be a str, the dotted name of an "
                              f"nn.Linear submodule")
        try:
            sub = module.get_submodule(name)
        except AttributeError as exc:
            raise ConfigError(f"shard_mlp: {role}({name!r}) is not a submodule: {exc}") from exc
        if not isinstance(sub, torch.nn.Linear):
            raise ConfigError(f"shard_mlp: {role}({name!r}) is a {type(sub).__name__}, not an nn.Linear")
        layers[role] = sub
    if layers["up"] is layers["down"]:
        # the same name, or one nn.Linear under two names (accepted before: the row layer
        # replaced the column one, and the first forward failed naming neither; breakers' finds)
        same = "name the same layer" if up == down else "are the same nn.Linear under two names"
        raise ConfigError(f"shard_mlp: up({up!r}) and down({down!r}) {same}: up is the first "
                          f"nn.Linear of the MLP, down the second")
    if layers["up"].out_features != layers["down"].in_features:
        # (names swapped, or not one MLP: it failed only at the first forward, naming neither)
        raise ConfigError(
            f"shard_mlp: up({up!r}) has out_features({layers['up'].out_features}) and down({down!r}) "
            f"in_features({layers['down'].in_features}): down must take what up gives (are the "
            f"names swapped?)")
    col = ColumnParallelLinear.from_linear(layers["up"], pg, gather_output=False, timeout_s=timeout_s)
    row = RowParallelLinear.from_linear(layers["down"], pg, input_is_parallel=True, timeout_s=timeout_s)
    for name, new in ((up, col), (down, row)):
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, new)
    log.debug("tp_mlp_sharded", up=up, down=down, world_size=col.world_size, rank=col.rank)
    return module
