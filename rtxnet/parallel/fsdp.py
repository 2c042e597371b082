"""Fully sharded data parallelism (ZeRO-3) for PyTorch modules on the CPU.

Shapes legend: ``T`` elements of one flat parameter (a unit's parameters of one dtype), ``W`` the
world size the shards are laid out for, ``S = ceil(T / W)`` elements of one rank's shard, so the
padded flat parameter ``full_WS`` has ``W * S`` elements and rank ``r`` keeps
``full_WS[r * S:(r + 1) * S]``.

:class:`FullyShardedDataParallel` follows ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", SC 2020) as PyTorch FSDP builds it (Zhao
et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023):

- **Units.** The module is cut into units: the whole module (the root unit) and, by the ``wrap``
  policy, submodules (a list of module classes, a minimum parameter count, or a predicate; units
  may nest). A parameter belongs to the innermost unit containing the module that owns it. Each
  unit's trainable parameters of one dtype are flattened, in registration order, into one flat
  parameter of ``T`` elements, zero-padded to ``W * S``, and each rank keeps only its shard
  ``[S]`` as a ``torch.nn.Parameter`` of the wrapper (``fsdp.parameters()`` yields the shards,
  named ``flat_u<unit>_<dtype>``). Build the optimizer over ``fsdp.parameters()``: its state is
  then sharded too.
- **Forward.** A forward pre-hook on the unit's module all-gathers the unit's flat parameter into a
  fresh buffer ``full_WS`` and sets each original parameter name (``module.l1.weight``) to a view of
  it; a forward hook frees the buffer (its storage is resized to 0) and sets the names back to
  empty placeholders. So the parameters the user sees are views into the gathered buffer while the
  unit runs, and shape-``[0]`` tensors otherwise, which refuse any computation (``ConfigError``
  naming the parameter and its unit; their shape, dtype and printed form may be read). A unit's
  forward run inside a backward (activation checkpointing with ``use_reentrant=True`` recomputing
  it) keeps its buffer until its gradient is reduced: its backward uses the views it saved.
- **Backward.** Autograd saves views of ``full_WS`` for backward; a saved-tensor hook notes them, and
  unpacking one whose buffer was freed all-gathers it again first (blocking, in backward order).
  ``full_WS`` is an autograd leaf, so the views' gradients meet in ``full_WS.grad``; when autograd has
  accumulated it (``register_post_accumulate_grad_hook``) the buffer is freed and the gradient is
  reduce-scattered with ``async_op=True`` (at most one in flight: launching one first waits for the
  previous), and the result is **added** to the shard's ``.grad`` (so several backward passes
  accumulate, as in one process). At the end of backward (an autograd final callback) the last
  reduce-scatter is waited for and every buffer still gathered is freed. After
  ``loss.backward()`` returns, each shard's ``.grad`` holds its slice of the reduced gradient, and
  ``optimizer.step()`` may run.

**Every rank runs the same units in the same order** (as with torch FSDP): the all-gathers of the
forward and the reduce-scatters of the backward are collectives, so a unit that only some ranks
call fails: with a ``CollectiveMismatchError`` naming this rank's unit when another rank's call
at that point is another unit's (the flat parameter's name travels in the collective's
signature: two units of one size, routed experts, were gathered together before), or with a
``CollectiveTimeout`` at the group's deadline when the others call nothing. A parameter unused in a step's forward (on
every rank) gets a zero gradient in its slice of the shard's ``.grad``, not ``None``, as in
torch FSDP's flat parameters: plain SGD leaves it unchanged, but momentum, Adam's moments and
weight decay keep moving it, where one process (its ``grad`` ``None``) would not; put a module used
only in some steps in a unit of its own: a unit no rank calls gets no collective and its shard
keeps ``grad = None``. A parameter shared by modules
of two different units is refused at construction (put the modules in one unit); sharing within a
unit works (each name gets the same view).

**Reduction.** ``reduce_op=ReduceOp.AVG`` (default) averages over the ranks of the current world:
with the same per-rank batch this equals one process with the global batch. ``ReduceOp.SUM`` sums;
scale each rank's mean loss by ``local_n / global_n`` to match one process for uneven shares.

**Devices and dtypes.** CPU modules only (the CPU collectives): a parameter or buffer elsewhere is
refused with ``ConfigError``. Each dtype the collectives support (float32, float64, float16,
bfloat16) gets its own flat parameter. Parameters with ``requires_grad=False`` and buffers are
not sharded: they stay on the module, replicated (broadcast from rank 0 at construction when
``init_sync``), and appear in ``fsdp.parameters()`` / the state dicts under their own names.

**Memory per rank** (parameters and gradients, activations not counted). Persistent: the shards,
``sum(S)`` elements, about ``1/W`` of the trainable parameters plus at most ``W - 1`` padding
elements per flat parameter; their gradients, as many; the optimizer state, built over the shards
(Adam: two more). Transient, while a unit computes: its gathered parameters ``[W * S]``, together
with those of the units enclosing it (the root unit stays gathered for the whole forward and again
from the start of backward, so keep it small by wrapping the heavy children), and in backward its
full gradient ``[W * S]`` plus the one of the unit still being reduce-scattered and that unit's
``[S]`` result. So the peak is about the sharded state plus twice the largest unit's gathered
parameters and gradients (with nesting, plus the enclosing units' parameters). Construction
needs the whole module on every rank once (it is built there before being sharded).

**After a failed step.** When a collective fails (``PeerLostError`` after a rank died,
``CollectiveTimeout``), the error propagates from ``forward`` or ``loss.backward()`` and nothing
waits forever (every collective has the group's deadline, or ``timeout_s``). The module is left
usable: the next ``forward`` starts clean (or call :meth:`FullyShardedDataParallel.reset`), with
buffers that a failed collective may still write replaced by fresh memory, never reused or freed
under it. The shards themselves are untouched (``optimizer.step()`` was never reached), but the
shards' ``.grad`` may hold part of the step's gradients: zero them before retrying.

**World size changes.** The world size and this rank are read from the group at every
``forward``. The shards are laid out for one world (``W`` and the rank); when the group's world
size or this rank's rank differs from the layout, ``forward`` raises ``ConfigError`` naming both,
because a re-formed world cannot rebuild the layout by itself: a lost rank took its shards with
it. The user reloads from a checkpoint: :meth:`FullyShardedDataParallel.load_full_state_dict`
(every rank passes the same full state dict, e.g. from :meth:`full_state_dict` saved earlier)
re-lays the shards out for the current world, keeping the same ``Parameter`` objects but resized,
so the optimizer state of the old layout must be dropped (build a new optimizer, or
``optimizer.state.clear()``). :meth:`load_sharded_state_dict` loads this rank's own shards
only at the world size and rank they were saved with; :meth:`load_sharded_state_dicts` takes every
saved rank's shards of one save (``rtxnet.checkpoint.load_all``) and reshards them for any world,
and :meth:`reshard_optimizer_state_dict` does the same for the optimizer's state, so a sharded
checkpoint of 4 ranks resumes on 3 with its Adam moments. If the world changes
during a step (the epoch moves), the next collective is not started and ``PeerLostError`` is
raised, as DDP does.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog
import torch

from rtxnet.collectives import ReduceOp
from rtxnet.config import is_seconds, shown_list
from transport.errors import CollectiveMismatchError, ConfigError, PeerLostError, StateLayoutError

from ._world import (
    StepWorld,
    broadcastable,
    check_group,
    check_same_layout,
    check_still_frozen,
    check_unchanged,
    graph_task,
    group_size,
    layout_digest,
    skip_init_sync,
)
from .tensor import NormParts, check_clip_args, scale_grads, tp_group_of_attr

__all__ = ["FullyShardedDataParallel", "FSDPState", "FSDP_STATE_FORMAT"]

log = structlog.get_logger(__name__)

FSDP_STATE_FORMAT = "rtxnet.fsdp.sharded/1"

WrapPolicy = Iterable[type] | int | Callable[[torch.nn.Module, str], bool] | None


def _layout_diff(saved: Any, mine: list[list[Any]]) -> str:
    """The first difference between a saved flat-parameter layout (``[[name, numel, [fqn, ...]],
    ...]``) and this module's, in one short line (both whole were 21,000 characters for a model
    of 200 layers, a tester's find)."""
    if not isinstance(saved, list):
        return f"the saved layout is {type(saved).__name__}, not a list of flat parameters"
    for i, (a, b) in enumerate(zip(saved, mine, strict=False)):
        if a != b:
            return (f"flat parameter {i} differs: saved {str(a)[:300]}, this module's {str(b)[:300]} "
                    f"(the state was saved from another model or wrapping)")
    return (f"the saved layout has {len(saved)} flat parameters, this module's {len(mine)} (the "
            f"state was saved from another model or wrapping)")


def _rank_world(pg: Any) -> tuple[int, int]:
    """``(rank, world size)`` of a world group (``world_size``) or a subgroup (``size``)."""
    return int(pg.rank), group_size(pg)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Slot:
    """One trainable parameter inside a flat parameter: where it lives and every name it has."""

    __slots__ = ("fqns", "owners", "shape", "numel", "offset", "tp")

    def __init__(self, fqns: list[str], owners: list[tuple[torch.nn.Module, str]],
                 shape: torch.Size, offset: int):
        self.fqns = fqns
        self.owners = owners
        self.shape = shape
        self.numel = math.prod(shape)
        self.offset = offset
        # the tensor-parallel group the parameter is a slice over (its norm sums over it)
        self.tp = next((g for m, a in owners if (g := tp_group_of_attr(m, a)) is not None), None)


# what a placeholder may be asked without being used in a computation: its metadata (property
# getters arrive as ``__get__``) and its printed form
_PLACEHOLDER_OK = frozenset({"__get__", "numel", "nelement", "dim", "size", "stride", "element_size",
                             "is_floating_point", "is_contiguous", "__repr__", "__format__"})


class _Placeholder(torch.Tensor):
    """What a unit's parameter name holds outside that unit's forward (and its backward): an empty
    tensor that refuses any computation with ``ConfigError`` naming the parameter and its unit.
    A plain empty tensor there took part silently: a forward that read a child unit's weight
    outside the child's forward summed it to 0 and left it out of the gradient (a tester's
    find: the loss 1.37 where one process gives -14.8)."""

    _rtx_fqn = "?"
    _rtx_unit = "?"
    _rtx_group: Any = None   # its _FlatGroup, and its slot index there
    _rtx_slot = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in _PLACEHOLDER_OK:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        held = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, _Placeholder)]
        held += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, _Placeholder)]
        owner = held[0]._rtx_group.owner() if held and held[0]._rtx_group.owner is not None else None
        if owner is not None and _recomputing():
            # inside a backward, with grad: activation checkpointing recomputes a module that is
            # not a unit of its own after its unit's forward ended: gather the unit again
            def sub(a: Any) -> Any:
                if isinstance(a, _Placeholder):
                    return owner._view_for(a)
                if isinstance(a, (list, tuple)):
                    return type(a)(sub(t) for t in a)
                return a
            return func(*sub(args), **{k: sub(v) for k, v in (kwargs or {}).items()})
        fqn, unit = (held[0]._rtx_fqn, held[0]._rtx_unit) if held else ("?", "?")
        raise ConfigError(
            f"FullyShardedDataParallel: parameter {fqn!r} was used ({getattr(func, '__name__', func)}) "
            f"outside the forward of its unit {unit!r}: it is gathered only while that unit runs "
            f"and is an empty placeholder elsewhere. Use it inside that unit's forward, make the "
            f"module that reads it part of the same unit (wrap=...), or read the whole parameters "
            f"with full_state_dict()")


def _unlike_units(exc: CollectiveMismatchError, g: _FlatGroup, units: list[str],
                  phase: str) -> CollectiveMismatchError:
    """``exc`` (a gather or reduce-scatter of ``g`` that the ranks' calls disagreed on) with what
    it means for FSDP: the ranks ran different units at this point of the ``phase``. Before,
    torch-free numbers said it (``ranks disagree on numel: {0: 11, 1: 7}``), or, for units of
    one size, nothing did: the shards of both were exchanged (a tester's find: routed experts
    computed with a weight stitched from two)."""
    unit = units[g.unit] or "<root>"
    return CollectiveMismatchError(
        f"FullyShardedDataParallel: at this point of the {phase} this rank ran unit {unit!r} "
        f"({g.name}), another rank something else ({exc}). Every rank must run every unit's "
        f"forward and backward in the same order: a loss term only some ranks add (give the "
        f"others 0 * that_output.sum()), or units chosen by the data (routed experts: run each on "
        f"every rank), breaks it")


def _recomputing() -> bool:
    """Whether a forward runs inside a backward with grad: activation checkpointing recomputing
    a unit or a layer of one."""
    return torch.is_grad_enabled() and graph_task() not in (-1, None)


def _placeholder(dtype: torch.dtype, fqn: str, unit: str, group: _FlatGroup, slot: int) -> torch.Tensor:
    t = torch.empty(0, dtype=dtype).as_subclass(_Placeholder)
    t._rtx_fqn, t._rtx_unit, t._rtx_group, t._rtx_slot = fqn, unit, group, slot
    return t


class _FlatGroup:
    """A unit's trainable parameters of one dtype: ``T`` elements, this rank's shard ``[S]``."""

    def __init__(self, unit: int, dtype: torch.dtype, slots: list[_Slot], unit_name: str = ""):
        self.unit = unit
        self.dtype = dtype
        self.slots = slots
        self.numel = sum(s.numel for s in slots)                       # T
        self.name = f"flat_u{unit}_{_dtype_name(dtype)}"
        self.shard: torch.nn.Parameter | None = None                   # [S]
        self.current: _Gathered | None = None
        self.owner: Any = None   # weakref to the FullyShardedDataParallel (for _Placeholder)
        self.placeholders = [_placeholder(dtype, s.fqns[0], unit_name or "<root>", self, i)
                             for i, s in enumerate(slots)]

    def shard_numel(self, world: int) -> int:
        return -(-self.numel // world)                                 # S = ceil(T / W)

    def split_sizes(self, world: int) -> list[int]:
        sizes = [s.numel for s in self.slots]
        pad = world * self.shard_numel(world) - self.numel
        return sizes + [pad] if pad else sizes

    def flatten(self, tensors: list[torch.Tensor], world: int) -> torch.Tensor:
        """The padded flat ``[W * S]`` of ``tensors`` (one per slot, in slot order)."""
        full = torch.zeros(world * self.shard_numel(world), dtype=self.dtype)
        for s, t in zip(self.slots, tensors, strict=True):
            full[s.offset:s.offset + s.numel].copy_(t.detach().reshape(-1))
        return full

    def assign(self, views: list[torch.Tensor] | None) -> None:
        """Point every name of every slot at its view (or at its empty placeholder)."""
        for i, s in enumerate(self.slots):
            t = self.placeholders[i] if views is None else views[i]
            for mod, attr in s.owners:
                mod.__dict__[attr] = t


class _Gathered:
    """One gathered copy ``full_WS`` of a flat parameter, for one forward and its backward.

    ``full`` is an autograd leaf when built under grad mode; its storage is resized to 0 when freed
    and back when gathered again, so the views autograd saved stay valid. ``poisoned``: a gather
    into it failed, and the aborted collective may still write it, so it is never resized again.
    """

    __slots__ = ("group", "forward_id", "training", "full", "views", "gathered", "poisoned",
                 "nbytes", "hook")

    def __init__(self, group: _FlatGroup, world: int, forward_id: int, training: bool):
        self.group = group
        self.forward_id = forward_id
        self.training = training
        n = world * group.shard_numel(world)
        self.full = torch.empty(n, dtype=group.dtype)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.views: list[torch.Tensor] | None = None
        self.gathered = False
        self.poisoned = False
        self.hook: Any = None


class FullyShardedDataParallel(torch.nn.Module):
    """Shard ``module``'s parameters, gradients and optimizer state over the ranks of ``pg``.

    Use it like DDP, with the optimizer built over the wrapper's (sharded) parameters::

        model = FullyShardedDataParallel(net, pg, wrap=[Block])
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss = criterion(model(x), y)
        loss.backward()          # each shard's .grad holds its slice of the reduced gradient
        opt.step()

    Args:
        module: a ``torch.nn.Module`` whose parameters and buffers are all on the CPU. Its
            trainable parameters are removed from it and replaced by views or placeholders
            (module notes); keep using the wrapper, not ``module``, to run it.
        pg: a :class:`rtxnet.BlockingProcessGroup` (``rtxnet.init()``) or a subgroup of one
            (``pg.split(...)``, ``pg.new_group(...)``).
        wrap: which submodules become units besides the root: ``None`` (only the root), a list of
            module classes (every submodule of one of those classes), an ``int`` ``n >= 1`` (a
            submodule becomes a unit when its parameters not already in a nested unit number at
            least ``n``, decided bottom-up as torch's ``size_based_auto_wrap_policy``), or a
            callable ``(submodule, qualified_name) -> bool``.
        reduce_op: ``ReduceOp.AVG`` (mean over the current world) or ``ReduceOp.SUM``.
        init_sync: broadcast rank 0's parameters and buffers before sharding (a collective: every
            rank builds the wrapper at the same point). Pass False when every rank built the
            same module (same seed) or will load a state dict.
        timeout_s: deadline in seconds of each collective; ``None`` uses the group's.

    Raises:
        ConfigError: ``module`` is not a module; ``pg`` is not a process group or a subgroup of
            one (``None``, a name); a bad ``wrap``, ``reduce_op`` or ``timeout_s``
            (names the value); a parameter or buffer off the CPU (names it and the device); a
            parameter shared by two units (names both); a parameter dtype the collectives do not
            support; with ``init_sync``, the ranks' modules differ in parameter or buffer names,
            their order, shapes, dtypes or ``requires_grad`` (on every rank, naming the ranks
            unlike rank 0: a broadcast by position would copy one tensor into another).
        PeerLostError, CollectiveTimeout: the initial layout check or broadcast failed.

    Attributes:
        module: the wrapped module.
        units: qualified names of the unit modules, root (``""``) first.
        world_size, rank: the world the shards are laid out for.
        last_gathers, last_reduce_scatters: collectives issued by the last forward + backward.
    """

    def __init__(self, module: torch.nn.Module, pg: Any, *, wrap: WrapPolicy = None,
                 reduce_op: ReduceOp = ReduceOp.AVG, init_sync: bool = True,
                 timeout_s: float | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_group(pg, "FullyShardedDataParallel")
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ConfigError(f"reduce_op({reduce_op!r}) must be ReduceOp.AVG or ReduceOp.SUM")
        if timeout_s is not None and not is_seconds(timeout_s):
            raise ConfigError(f"timeout_s({timeout_s!r}) must be a positive, finite number of seconds")
        _check_cpu(module)
        self.module = module
        self._pg = pg
        self._step_world = StepWorld(pg)   # the world group of the current step
        self.reduce_op = reduce_op
        self.timeout_s = timeout_s
        self._kw = {} if timeout_s is None else {"timeout": timeout_s}
        self.rank, self.world_size = _rank_world(pg)
        self._key_order = list(module.state_dict().keys())

        unit_names = _select_units(module, wrap)
        self.units = unit_names
        self._groups = self._build_groups(module, unit_names)
        self._unit_groups: list[list[_FlatGroup]] = [[g for g in self._groups if g.unit == u]
                                                     for u in range(len(unit_names))]
        self._step_world.begin()
        init_sync = init_sync and not skip_init_sync(self._pg, "FSDP")
        if init_sync:
            with self._step_world.pinned():
                check_same_layout(module, self._pg, "FSDP",
                                  [n for n, p in module.named_parameters() if p.requires_grad], **self._kw)
            self._broadcast_replicated()
        # every rank's flat parameters as built (world size, {flat name: padded full tensor}),
        # until the first forward, or, held by FaultTolerance(sharded_state=True) through
        # FSDPState.hold_built, until its first commit: see built_sharded_state_dicts
        built: dict[str, torch.Tensor] = {}
        for g in self._groups:
            full = g.flatten([getattr(s.owners[0][0], s.owners[0][1]) for s in g.slots], self.world_size)
            if init_sync and self.world_size > 1:
                with self._step_world.pinned():
                    self._pg.broadcast(full, src=0, **self._kw)
            built[g.name] = full
            S = g.shard_numel(self.world_size)
            g.shard = torch.nn.Parameter(full[self.rank * S:(self.rank + 1) * S].clone())
            for s in g.slots:
                for mod, attr in s.owners:
                    mod._parameters.pop(attr, None)
            g.assign(None)
            self.register_parameter(g.name, g.shard)

        self._frozen = list(module.named_parameters())   # the trainable ones were taken out
        # each flat shard's dtype and device (its shape changes with the world: resharding)
        self._shard_kinds = {g.name: (g.shard.dtype, g.shard.device) for g in self._groups}
        self._built: tuple[int, dict[str, torch.Tensor]] | None = (self.world_size, built)
        self._hold_built = False
        for g in self._groups:
            g.owner = weakref.ref(self)
        mods = dict(module.named_modules())
        self._handles = []
        for u, name in enumerate(unit_names):
            m = mods[name]
            self._handles.append(m.register_forward_pre_hook(self._make_pre(u)))
            self._handles.append(m.register_forward_hook(self._make_post(u)))

        self._forward_id = 0
        self._round_epoch: int | None = None
        self._backward_open = False
        self._reduced_in_backward = False   # a gradient was reduced in the backward under way
        self._live: list[_Gathered] = []          # gathered now (storage allocated)
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor, _FlatGroup]] = []
        self.last_gathers = 0
        self.last_reduce_scatters = 0
        log.info("fsdp_ready", units=len(unit_names), flat_params=len(self._groups),
                 world_size=self.world_size, shard_numel=self.shard_numel(),
                 reduce_op=reduce_op.name)

    # -- layout ----------------------------------------------------------------------------------

    def _build_groups(self, module: torch.nn.Module, unit_names: list[str]) -> list[_FlatGroup]:
        unit_of_module: dict[int, int] = {}
        for name, m in module.named_modules():
            # the innermost unit containing m: the longest unit name that prefixes name
            best = 0
            for u, un in enumerate(unit_names):
                if un == "" or name == un or name.startswith(un + "."):
                    if len(un) >= len(unit_names[best]):
                        best = u
            unit_of_module[id(m)] = best
        # every (module, attr) naming each trainable parameter, in registration order
        places: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                params[id(p)] = p
                fqn = f"{mname}.{attr}" if mname else attr
                if all(fqn != f for f, _, _ in places.get(id(p), [])):
                    places.setdefault(id(p), []).append((fqn, m, attr))
        by_key: dict[tuple[int, torch.dtype], list[_Slot]] = {}
        for pid, where in places.items():
            p = params[pid]
            units = {unit_of_module[id(m)] for _, m, _ in where}
            if len(units) > 1:
                names = ", ".join(f"{f} (unit {unit_names[unit_of_module[id(m)]]!r})" for f, m, _ in where)
                raise ConfigError(f"a parameter is shared by modules of different units: {names}; "
                                  "wrap so that the modules sharing it are in one unit")
            u = units.pop()
            if p.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                raise ConfigError(f"{where[0][0]} has dtype {p.dtype}; FSDP shards float32, "
                                  "float64, float16 and bfloat16 parameters")
            lst = by_key.setdefault((u, p.dtype), [])
            off = sum(s.numel for s in lst)
            lst.append(_Slot([f for f, _, _ in where], [(m, a) for _, m, a in where], p.shape, off))
        keys = sorted(by_key, key=lambda k: (k[0], _dtype_name(k[1])))  # same order on every rank
        return [_FlatGroup(u, dt, by_key[(u, dt)], unit_names[u]) for u, dt in keys]

    def shard_numel(self) -> int:
        """Elements of the shards this rank stores (padding included), over all flat parameters."""
        return sum(g.shard.numel() for g in self._groups)

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, gathering each unit's parameters around its forward.

        Raises:
            ConfigError: the group's world size or this rank's rank differs from the layout (see
                "World size changes" in the module notes: reload a state dict); a flat shard
                changed in place since the wrapper was built (``double()``, ``.to()``,
                ``requires_grad_(False)``: make the change before wrapping); a parameter frozen
                then requires gradients now.
            PeerLostError, CollectiveTimeout: an all-gather failed; the module resets at the next
                forward.
        """
        check_still_frozen(self._frozen, "FullyShardedDataParallel")
        check_unchanged([(g.name, g.shard, g.shard.shape, *self._shard_kinds[g.name]) for g in self._groups],
                        "FullyShardedDataParallel", self._describe_flat)
        if self._built is not None and not self._hold_built:
            self._built = None          # (a full model's memory: see built_sharded_state_dicts)
        if self._backward_open:
            self.reset()     # the previous backward failed half way
        # Every collective of this forward and its backward goes to one world group, the one
        # whose layout is checked.
        self._round_epoch = self._step_world.begin()
        self._check_layout(self._step_world)
        self._forward_id += 1
        if torch.is_grad_enabled():
            if not self._live and not self._pending:
                self.last_gathers = 0
                self.last_reduce_scatters = 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        except BaseException as exc:
            log.warning("fsdp_forward_failed", error=type(exc).__name__, detail=str(exc))
            self.reset()
            raise

    def _make_pre(self, u: int) -> Callable:
        def pre(_module: torch.nn.Module, _args: Any) -> None:
            training = torch.is_grad_enabled()
            for g in self._unit_groups[u]:
                g.assign(self._gathered(g, training).views)
        return pre

    def _gathered(self, g: _FlatGroup, training: bool) -> _Gathered:
        """``g``'s gathered copy for this forward (made, and all-gathered, when needed), with its
        views (and, in training, its gradient hook)."""
        gt = g.current
        if gt is None or gt.forward_id != self._forward_id or gt.training != training:
            gt = _Gathered(g, self.world_size, self._forward_id, training)
            g.current = gt
        self._gather(gt)
        if gt.views is None:
            if training:
                gt.full.requires_grad_(True)
                gt.hook = gt.full.register_post_accumulate_grad_hook(
                    lambda full, gt=gt: self._grad_ready(gt, full))
            chunks = torch.split(gt.full, g.split_sizes(self.world_size))
            gt.views = [c.view(s.shape) for c, s in zip(chunks, g.slots, strict=False)]
        return gt

    def _view_for(self, ph: _Placeholder) -> torch.Tensor:
        """The parameter ``ph`` stands for, gathered again inside the backward: a module that is
        not a unit recomputed by activation checkpointing reads its parameters after its unit's
        forward ended (placeholders then; a tester's find: refused as used outside its unit)."""
        self._open_backward()
        return self._gathered(ph._rtx_group, True).views[ph._rtx_slot]

    def _make_post(self, u: int) -> Callable:
        def post(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
            # A forward run inside a backward (activation checkpointing recomputing the unit,
            # torch.utils.checkpoint with use_reentrant=True) keeps its gathered parameters: the
            # backward that follows uses the views it saved, outside this module's saved-tensor
            # hooks, so nothing would gather them again (freed, torch failed with "setStorage ...
            # out of bounds", a tester's find); its gradient's hook frees them.
            recompute = _recomputing()
            for g in self._unit_groups[u]:
                g.assign(None)
                if g.current is not None and not recompute:
                    self._free(g.current)
        return post

    def _check_epoch(self) -> None:
        epoch = getattr(self._pg, "epoch", None)
        if self._round_epoch is not None and epoch is not None and epoch != self._round_epoch:
            m = getattr(self._pg, "membership", None)
            raise PeerLostError(f"membership changed during the step (epoch {self._round_epoch} -> "
                                f"{epoch}); FSDP starts no collective in the new world",
                                ranks=getattr(m, "lost", ()), epoch=epoch)

    def _gather(self, gt: _Gathered) -> None:
        """All-gather the shards into ``gt.full`` (blocking), unless it is gathered already."""
        if gt.gathered:
            return
        self._check_epoch()
        g = gt.group
        gt.full.untyped_storage().resize_(gt.nbytes)
        self._live.append(gt)
        gt.gathered = True
        try:
            if self.world_size > 1:
                with self._step_world.pinned():
                    self._pg.all_gather(gt.full.detach(), g.shard.detach(), label=g.name, **self._kw)
            else:
                gt.full.data.copy_(g.shard.data)   # .data: no version bump on saved views
        except CollectiveMismatchError as exc:
            gt.poisoned = True
            raise _unlike_units(exc, g, self.units, "forward") from exc
        except BaseException:
            gt.poisoned = True
            raise
        self.last_gathers += 1

    def _free(self, gt: _Gathered) -> None:
        if gt.gathered and not gt.poisoned:
            gt.full.untyped_storage().resize_(0)
            gt.gathered = False
            self._live.remove(gt)

    # -- backward machinery ----------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().nbytes():
            ptr = t.untyped_storage().data_ptr()
            for gt in self._live:
                if gt.full.untyped_storage().data_ptr() == ptr:
                    return (_SAVED, gt, t)
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple) and len(packed) == 3 and packed[0] is _SAVED:
            _, gt, t = packed
            if not gt.gathered:
                self._open_backward()
                self._gather(gt)      # freed after forward (or after its gradient was reduced)
            return t
        return packed

    def _open_backward(self) -> None:
        if not self._backward_open:
            self._backward_open = True
            self._reduced_in_backward = False
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)

    def _grad_ready(self, gt: _Gathered, full: torch.Tensor) -> None:
        self._open_backward()
        self._reduced_in_backward = True
        grad = full.grad
        full.grad = None
        self._free(gt)
        if grad is None:
            return
        self._wait_pending()          # at most one reduce-scatter in flight
        self._check_epoch()
        g = gt.group
        out = torch.empty(g.shard_numel(self.world_size), dtype=g.dtype)   # fresh: never reused
        if self.world_size > 1:
            with self._step_world.pinned():
                work = self._pg.reduce_scatter(out, grad.detach(), op=self.reduce_op,
                                               async_op=True, label=g.name, **self._kw)
        else:
            out.copy_(grad.detach())
            work = None
        self._pending.append((work, out, grad, g))
        self.last_reduce_scatters += 1

    def _wait_pending(self) -> None:
        while self._pending:
            work, out, _grad, g = self._pending[0]
            if work is not None:
                try:
                    work.wait()
                except CollectiveMismatchError as exc:
                    raise _unlike_units(exc, g, self.units, "backward") from exc
            self._pending.pop(0)
            if g.shard.grad is None:
                g.shard.grad = out
            else:
                g.shard.grad.add_(out)

    def finish_gradient_sync(self) -> None:
        """Wait for the last reduce-scatter, add it to its shard's ``.grad`` and free every
        gathered buffer.

        Runs automatically at the end of ``loss.backward()``; does nothing when no backward is
        under way.

        Raises:
            PeerLostError, CollectiveTimeout: the reduce-scatter failed; the module resets at the
                next forward.
        """
        if not self._backward_open:
            return
        try:
            self._wait_pending()
        except BaseException as exc:
            log.warning("fsdp_sync_failed", error=type(exc).__name__, detail=str(exc))
            raise
        if self._reduced_in_backward:
            for gt in list(self._live):
                self._free(gt)
        # else a backward that reached no parameter's gradient (torch.autograd.grad of an input,
        # create_graph=True for a gradient penalty): the graph it made may hold the gathered
        # views themselves, beyond this module's saved-tensor hooks, for a backward to come
        # (freed, torch failed there with "setStorage ... out of bounds", a tester's find); they
        # stay gathered until a later backward reduces them, or the next one ends
        self._backward_open = False

    def reset(self) -> None:
        """Abandon a half-done forward or backward so the next step starts clean.

        Called automatically by the next ``forward`` after a failure. Gathered buffers are freed,
        except those a failed all-gather may still write (dropped, never reused); reduce-scatters
        in flight are abandoned (their outputs were private buffers). The shards are untouched;
        their ``.grad`` is left as it is: zero it before retrying.
        """
        poisoned = sum(gt.poisoned for gt in self._live)
        for gt in list(self._live):
            if gt.poisoned:
                self._live.remove(gt)
            else:
                self._free(gt)
        for g in self._groups:
            g.current = None
            g.assign(None)
        self._pending.clear()
        self._backward_open = False
        log.info("fsdp_reset", buffers_dropped=poisoned)

    # -- state -----------------------------------------------------------------------------------

    def _replicated(self) -> dict[str, Any]:
        """Buffers and frozen parameters, still registered on the module (state-dict names), and
        the modules' extra state (``get_extra_state``: any object, not only a tensor)."""
        return dict(self.module.state_dict())

    def _replicated_copy(self) -> dict[str, Any]:
        """:meth:`_replicated`, tensors cloned and extra state deep-copied (``.detach()`` of a
        dict raised ``AttributeError``: a breaker's find)."""
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                for k, v in self._replicated().items()}

    def _broadcast_replicated(self) -> None:
        """Buffers and frozen parameters of rank 0 to every rank, in place."""
        if self.world_size == 1:
            return
        sharded = {f for g in self._groups for s in g.slots for f in s.fqns}
        for k, t in self.module.state_dict().items():
            if isinstance(t, torch.Tensor) and t.numel() and k not in sharded:   # (not extra state)
                with torch.no_grad():
                    flat = t.detach().reshape(-1).clone()
                    with self._step_world.pinned():
                        self._pg.broadcast(broadcastable(flat), src=0, **self._kw)
                    t.copy_(flat.view(t.shape))

    def _describe_flat(self, name: str) -> str:
        """A flat shard's name with the module's parameters it holds, for an error message."""
        held = [repr(f) for g in self._groups if g.name == name for s in g.slots for f in s.fqns]
        return f"{name!r} (the flat shard of {shown_list(held, 4)})"

    def _check_layout(self, step: StepWorld | None = None) -> None:
        """Raises ConfigError when the world this runs in (the step's pinned world group under
        ``FaultTolerance``, else the current one) has another world size or rank than the layout.
        A membership that changed after the step began is not that: the step's collectives fail
        with ``PeerLostError``/``ClosedError``, and ``FaultTolerance`` reshards at its next sync
        (a rank joining before the first commit made every rank raise ConfigError instead).
        ``step``: the world already taken (a forward's), else it is taken here."""
        if step is None:
            step = StepWorld(self._pg)
            step.begin()
        if step.world is not None:
            rank, world = int(step.world.rank), int(step.world.size)
        else:
            rank, world = _rank_world(self._pg)
        if (world, rank) != (self.world_size, self.rank):
            raise ConfigError(
                f"the shards are laid out for world_size({self.world_size}) rank({self.rank}) but "
                f"the group now has world_size({world}) rank({rank}); reload the state: "
                "load_full_state_dict(full_state) on every rank (re-lays the shards out for this "
                "world; drop the optimizer's state), load_sharded_state_dicts(every saved rank's "
                "shards) with reshard_optimizer_state_dict, or load_sharded_state_dict() saved at "
                "this world size")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients of every rank's shards in place so that the norm of the whole
        model's gradient (every rank's shards together) is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does for one process and torch FSDP's
        ``clip_grad_norm_`` for shards. ``torch.nn.utils.clip_grad_norm_(fsdp.parameters())``
        would clip each rank's shard by its own norm: other scales on every rank, wrong numbers.

        A collective (one all-reduce of one float64, in the step's world): call it on every rank,
        after ``backward`` and before ``optimizer.step()``. Padding adds nothing.

        With tensor-parallel layers inside (``shard_mlp``, :class:`ColumnParallelLinear`,
        :class:`RowParallelLinear`; FSDP over a mesh's data-parallel group), their sharded
        parameters' part of the norm is summed over the tensor-parallel group as well (one more
        float64 in the all-reduce, then one all-reduce over that group), and the parameters every
        tensor-parallel rank holds whole count once, as Megatron-LM counts them: every rank clips
        by the whole model's norm. (Before, each tensor-parallel rank clipped by its own slices'
        norm: 1.9e-4 off one process in a tester's run.)

        Args:
            max_norm: the largest total norm kept; a positive finite number.
            norm_type: p of the p-norm, a positive finite number or ``math.inf`` (the largest
                absolute element; all-reduced with MAX, the others' p-th powers with SUM).

        Returns:
            The total norm before clipping: a float64 0-d CPU tensor, the same on every rank.
            The gradients are multiplied by ``max_norm / (total + 1e-6)`` when that is below 1.

        Raises:
            ConfigError: ``max_norm`` or ``norm_type`` out of range (names the value).
            PeerLostError, CollectiveTimeout: the all-reduce failed.
        """
        p = check_clip_args("clip_grad_norm_", max_norm, norm_type)
        parts = NormParts(p)
        for g in self._groups:
            for slot in g.slots:
                parts.register(slot.tp)
            if g.shard is None or g.shard.grad is None:
                continue
            grad, S = g.shard.grad, g.shard.numel()
            lo = self.rank * S                       # this shard: flat elements lo .. lo + S
            for slot in g.slots:                     # each parameter's part of it, with its group
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, lo + S)
                if a < b:
                    parts.add(grad[a - lo:b - lo], slot.tp)

        def over_shards(vec: torch.Tensor, op: ReduceOp) -> None:
            if group_size(self._pg) > 1:
                with self._step_world.pinned():
                    self._pg.all_reduce(vec, op=op, **self._kw)

        norm = parts.total(over_shards, self.timeout_s)
        scale_grads((g.shard.grad for g in self._groups
                     if g.shard is not None and g.shard.grad is not None), max_norm, norm)
        return norm

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole module's state dict, gathered: the keys ``module.state_dict()`` had before
        wrapping, in that order, each a new CPU tensor of the parameter's shape and dtype.

        A collective (one all-gather per flat parameter): every rank must call it. Each flat
        parameter is gathered into a temporary buffer in turn, so besides the result at most one
        ``[W * S]`` buffer is held.

        Args:
            rank0_only: only rank 0 gets the dict; the others get ``{}``.

        Raises:
            PeerLostError, CollectiveTimeout: an all-gather failed.
        """
        self._check_layout()
        rank, world = self.rank, self.world_size
        keep = rank == 0 or not rank0_only
        out: dict[str, torch.Tensor] = {}
        one_world = StepWorld(self._pg)     # not the step's: this may run between two steps
        one_world.begin()
        for g in self._groups:
            full = torch.empty(world * g.shard_numel(world), dtype=g.dtype)
            if world > 1:
                with one_world.pinned():
                    self._pg.all_gather(full, g.shard.detach(), **self._kw)
            else:
                full.copy_(g.shard.detach())
            if keep:
                for s in g.slots:
                    v = full[s.offset:s.offset + s.numel].view(s.shape)
                    for fqn in s.fqns:
                        out[fqn] = v.clone()
        if not keep:
            return {}
        out.update(self._replicated_copy())
        order = {k: i for i, k in enumerate(self._key_order)}
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Shard a full state dict (as :meth:`full_state_dict` gives it) for the group's current
        world, in place. Not a collective: every rank passes the same dict.

        When the group's world size or this rank's rank differs from the layout, the shards are
        laid out again for the current world: the same ``Parameter`` objects, resized to the new
        ``[S]``; drop the optimizer's state of the old layout (build a new optimizer or
        ``optimizer.state.clear()``). Shards' gradients are cleared (``None``) in that case.

        Args:
            state_dict: parameter and buffer tensors by the names ``module.state_dict()`` had
                before wrapping (a tied parameter under any one of its names, as torch loads
                it); any device and dtype convertible to the parameter's.
            strict: refuse missing and unexpected keys.

        Raises:
            ConfigError: a key is missing or unexpected (with ``strict``); without ``strict``, a
                parameter is missing while the shards must be laid out again; or a tensor's shape
                differs from the parameter's (names the key and both shapes).
        """
        if not isinstance(state_dict, dict):
            raise ConfigError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        known = {f for g in self._groups for s in g.slots for f in s.fqns}
        repl = self._replicated()
        if strict:
            missing = sorted((known | set(repl)) - set(state_dict))
            unexpected = sorted(set(state_dict) - known - set(repl))
            if missing or unexpected:
                raise ConfigError(f"load_full_state_dict: missing keys {missing}, unexpected keys "
                                  f"{unexpected}")
        for k, v in state_dict.items():
            ref = repl.get(k)
            if ref is None:
                ref_shape = next((s.shape for g in self._groups for s in g.slots if k in s.fqns), None)
            else:
                ref_shape = ref.shape if isinstance(ref, torch.Tensor) else None   # extra state
            if ref_shape is not None and (not isinstance(v, torch.Tensor) or v.shape != ref_shape):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ConfigError(f"load_full_state_dict: {k} has shape {got}, the module's has "
                                  f"{tuple(ref_shape)}")
        rank, world = _rank_world(self._pg)
        relayout = (world, rank) != (self.world_size, self.rank)
        if self._live or self._pending or self._backward_open:
            self.reset()
        for g in self._groups:
            # a tied parameter under any of its names (a checkpoint may keep one; the first
            # registered alone was read before, and strict=False kept the old values silently);
            # under several, the last registered, as torch copies each in turn into the one tensor
            given = [next((state_dict[f] for f in reversed(s.fqns) if f in state_dict), None)
                     for s in g.slots]
            missing = [s for s, v in zip(g.slots, given, strict=True) if v is None]
            if missing and relayout:
                raise ConfigError(f"load_full_state_dict: the shards must be laid out for "
                                  f"world_size({world}), but {[s.fqns[0] for s in missing]} are "
                                  "missing")
            src = [torch.zeros(s.shape, dtype=g.dtype) if v is None else v.to(g.dtype)
                   for s, v in zip(g.slots, given, strict=True)]
            full = g.flatten(src, world)
            S = g.shard_numel(world)
            lo_r = rank * S
            new = full[lo_r:lo_r + S].clone()
            with torch.no_grad():
                for s in missing:     # keep this rank's current values of what is not given
                    lo, hi = max(s.offset, lo_r), min(s.offset + s.numel, lo_r + S)
                    if lo < hi:
                        new[lo - lo_r:hi - lo_r] = g.shard[lo - lo_r:hi - lo_r]
            self._set_shard(g, new, relayout)
        rest = {k: v for k, v in state_dict.items() if k in repl}
        if rest:
            self.module.load_state_dict(rest, strict=False)
        if relayout:
            self._laid_out(rank, world)

    @staticmethod
    def _set_shard(g: _FlatGroup, new: torch.Tensor, relayout: bool) -> None:
        """Put ``new`` ``[S]`` in as ``g``'s shard: the same Parameter, resized when re-laid out."""
        with torch.no_grad():
            if relayout:
                g.shard.data = new
                g.shard.grad = None
            else:
                g.shard.copy_(new)

    def _laid_out(self, rank: int, world: int) -> None:
        log.info("fsdp_relayout", world_size=world, previous=self.world_size, rank=rank)
        self.rank, self.world_size = rank, world

    def _layout(self) -> list[list[Any]]:
        return [[g.name, g.numel, [f for s in g.slots for f in s.fqns]] for g in self._groups]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards and the replicated state, for ``rtxnet.checkpoint.save`` (one file
        per rank). Not a collective. Plain values only (tensors, str, int, lists, dicts), so
        ``torch.load(weights_only=True)`` reads it.

        Returns:
            ``{"format", "world_size", "rank", "layout", "shards": {flat name: [S] tensor},
            "replicated": {name: tensor}}``; tensors are copies.
        """
        return {"format": FSDP_STATE_FORMAT, "world_size": self.world_size, "rank": self.rank,
                "layout": self._layout(),
                "shards": {g.name: g.shard.detach().clone() for g in self._groups},
                "replicated": self._replicated_copy()}

    def built_sharded_state_dicts(self) -> list[dict[str, Any]] | None:
        """What :meth:`sharded_state_dict` returned, or would have, on **every** rank of the world
        the wrapper was built in, right after it was built (rank ``q``'s shards sliced from this
        rank's flat parameters as built: equal on every rank built from the same seed); the
        replicated state is this rank's now. ``None`` once released: the flat parameters as
        built (a whole model's memory) are kept until the first forward, or while held
        (:meth:`hold_built`, which ``FaultTolerance(sharded_state=True)`` asks for through
        :class:`FSDPState` until its first commit, so a rank lost before any rank's shards were
        copied to another takes nothing with it)."""
        if self._built is None:
            return None
        world, built = self._built
        rep = self._replicated_copy()
        layout = self._layout()
        out = []
        for q in range(world):
            shards = {}
            for g in self._groups:
                S = g.shard_numel(world)
                shards[g.name] = built[g.name][q * S:(q + 1) * S].clone()
            out.append({"format": FSDP_STATE_FORMAT, "world_size": world, "rank": q,
                        "layout": layout, "shards": shards, "replicated": rep})
        return out

    def hold_built(self, hold: bool = True) -> None:
        """Keep the flat parameters as built past the first forward (``hold``), or release them
        now (``False``); see :meth:`built_sharded_state_dicts`."""
        self._hold_built = bool(hold)
        if not hold:
            self._built = None

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank, in place (not a
        collective).

        Raises:
            ConfigError: not such a dict. StateLayoutError (a ConfigError): saved at another
                world size, rank or layout (names both); to change the world size use
                :meth:`load_sharded_state_dicts`.
        """
        if not isinstance(state, dict) or state.get("format") != FSDP_STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"load_sharded_state_dict: format {got!r}, expected {FSDP_STATE_FORMAT!r}")
        rank, world = _rank_world(self._pg)
        if (state["world_size"], state["rank"]) != (world, rank) or (world, rank) != (self.world_size, self.rank):
            raise StateLayoutError(
                f"load_sharded_state_dict: saved at world_size({state['world_size']}) "
                f"rank({state['rank']}), the group has world_size({world}) rank({rank}); to change "
                "the world size load every saved rank's shards (load_sharded_state_dicts, "
                "rtxnet.checkpoint.load_all) or a full state dict (load_full_state_dict)")
        if state["layout"] != self._layout():
            raise StateLayoutError(f"load_sharded_state_dict: {_layout_diff(state['layout'], self._layout())}")
        if self._live or self._pending or self._backward_open:
            self.reset()
        with torch.no_grad():
            for g in self._groups:
                g.shard.copy_(state["shards"][g.name])
        self.module.load_state_dict(state["replicated"], strict=False)

    def load_sharded_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Load one save's :meth:`sharded_state_dict` of **every** saved rank, at any world size,
        re-laid out for the group's current world, in place (not a collective; each rank passes
        the same list). The way back into a smaller or larger world from a sharded checkpoint
        (``rtxnet.checkpoint.load_all``), as ``torch.distributed.checkpoint`` reshards on load.

        Each flat parameter is rebuilt from the saved shards (concatenated in rank order, the
        saved padding dropped: ``T`` elements), padded for the current world ``W`` and cut to this
        rank's ``[S]``. When the world size or this rank's rank differs from the layout, the shards
        are the same ``Parameter`` objects resized and their gradients cleared; load the
        optimizer's state with :meth:`reshard_optimizer_state_dict`. Replicated state (buffers,
        frozen parameters) comes from saved rank 0. Memory: one flat parameter's ``[T]`` at a time
        besides the saved shards.

        Args:
            states: ``states[q]`` is what saved rank ``q`` returned from :meth:`sharded_state_dict`,
                for ``q`` in ``range(saved world size)``; extra keys (``"_checkpoint"``) are
                ignored.

        Raises:
            ConfigError: ``states`` is not a non-empty list of such dicts; a dict's format, rank
                or world size does not fit its place in the list (names both); a saved layout
                differs from this module's; a saved shard has the wrong size or dtype (names the
                flat parameter, the saved rank and both sizes).
        """
        if not isinstance(states, (list, tuple)) or not states:
            raise ConfigError("load_sharded_state_dicts: states must be a non-empty list of every "
                              f"saved rank's sharded_state_dict(), got {type(states).__name__}"
                              + (" of length 0" if isinstance(states, (list, tuple)) else ""))
        saved_world = len(states)
        for q, st in enumerate(states):
            if not isinstance(st, dict) or st.get("format") != FSDP_STATE_FORMAT:
                got = st.get("format") if isinstance(st, dict) else type(st).__name__
                raise ConfigError(f"load_sharded_state_dicts: states[{q}] has format {got!r}, "
                                  f"expected {FSDP_STATE_FORMAT!r}")
            if (st.get("world_size"), st.get("rank")) != (saved_world, q):
                raise ConfigError(
                    f"load_sharded_state_dicts: states[{q}] was saved by world_size"
                    f"({st.get('world_size')}) rank({st.get('rank')}), but a list of {saved_world} "
                    f"needs world_size({saved_world}) rank({q}): pass every saved rank's state, in "
                    "rank order")
            if not isinstance(st.get("shards"), dict) or not isinstance(st.get("replicated"), dict):
                raise ConfigError(f"load_sharded_state_dicts: states[{q}] lacks its shards or "
                                  "replicated state")
            if st.get("layout") != self._layout():
                raise ConfigError(f"load_sharded_state_dicts: states[{q}]: "
                                  f"{_layout_diff(st.get('layout'), self._layout())}")
        rank, world = _rank_world(self._pg)
        relayout = (world, rank) != (self.world_size, self.rank)
        shards = {}
        for g in self._groups:
            want = g.shard_numel(saved_world)
            parts = []
            for q, st in enumerate(states):
                t = st["shards"].get(g.name)
                if not isinstance(t, torch.Tensor) or t.shape != (want,) or t.dtype != g.dtype:
                    got = (f"{_dtype_name(t.dtype)}{list(t.shape)}" if isinstance(t, torch.Tensor)
                           else type(t).__name__)
                    raise ConfigError(f"load_sharded_state_dicts: {g.name} of saved rank {q} is "
                                      f"{got}, expected {_dtype_name(g.dtype)}[{want}]")
                parts.append(t)
            shards[g] = _reshard(torch.cat(parts), g, world, rank)
        if self._live or self._pending or self._backward_open:
            self.reset()
        for g, new in shards.items():
            self._set_shard(g, new, relayout)
        self.module.load_state_dict(states[0]["replicated"], strict=False)
        if relayout:
            self._laid_out(rank, world)

    def reshard_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                     states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``optimizer``'s state dict for this rank and the current layout, built from every saved
        rank's ``optimizer.state_dict()`` of one save (in rank order): pass the result to
        ``optimizer.load_state_dict``. Not a collective; nothing is changed in place.

        Call it after :meth:`load_sharded_state_dicts` of the same save (the shards must already
        be laid out for the current world), with an optimizer built over this wrapper's
        parameters in the same order as the saved one. For each of the optimizer's parameters
        that is a shard, every per-parameter state tensor of the saved shard's shape ``[S_old]``
        (SGD's ``momentum_buffer``, Adam's ``exp_avg`` and ``exp_avg_sq``) is resharded like the
        shard itself; other values (Adam's ``step``, scalars) and ``param_groups`` are saved rank
        0's, as data parallel ranks step alike. Parameters that are not shards keep rank 0's state.

        Args:
            optimizer: the optimizer to load into (read for its parameters only).
            states: ``states[q]`` is saved rank ``q``'s ``optimizer.state_dict()``.

        Returns:
            ``{"state": {index: {name: value}}, "param_groups": [...]}``; new tensors for the
            resharded entries.

        Raises:
            ConfigError: ``states`` is not a non-empty list of optimizer state dicts; their
                parameter count differs from ``optimizer``'s (names both); a saved rank lacks a
                state entry rank 0 has, or has it at another size (names the parameter index, the
                entry, the rank and both sizes).
        """
        if not isinstance(states, (list, tuple)) or not states or not all(
                isinstance(st, dict) and "state" in st and "param_groups" in st for st in states):
            raise ConfigError("reshard_optimizer_state_dict: states must be a non-empty list of "
                              "every saved rank's optimizer.state_dict()")
        saved_world = len(states)
        params = [p for grp in optimizer.param_groups for p in grp["params"]]
        base = states[0]
        n_saved = sum(len(grp["params"]) for grp in base["param_groups"])
        if n_saved != len(params):
            raise ConfigError(f"reshard_optimizer_state_dict: the saved optimizer had {n_saved} "
                              f"parameters, this one has {len(params)}")
        by_id = {id(g.shard): g for g in self._groups}
        rank, world = self.rank, self.world_size
        out: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            if i not in base["state"]:
                continue
            g = by_id.get(id(p))
            entry = {}
            for k, v in base["state"][i].items():
                if (g is None or not isinstance(v, torch.Tensor) or v.dim() != 1
                        or v.numel() != g.shard_numel(saved_world)):
                    entry[k] = v
                    continue
                parts = []
                for q, st in enumerate(states):
                    t = st["state"].get(i, {}).get(k)
                    if not isinstance(t, torch.Tensor) or t.shape != v.shape:
                        got = list(t.shape) if isinstance(t, torch.Tensor) else t
                        raise ConfigError(f"reshard_optimizer_state_dict: parameter {i}'s {k!r} of "
                                          f"saved rank {q} is {got}, rank 0's is {list(v.shape)}")
                    parts.append(t)
                entry[k] = _reshard(torch.cat(parts), g, world, rank, dtype=v.dtype)
            out[i] = entry
        return {"state": out, "param_groups": base["param_groups"]}

    def remove_hooks(self) -> None:
        """Detach the forward hooks (the wrapper stops gathering; the module is unusable)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class FSDPState:
    """The training state of an FSDP model and its optimizer, in the shape
    :class:`rtxnet.FaultTolerance` (also with ``sharded_state=True``) and
    :mod:`rtxnet.checkpoint` take: ``state_dict()``, ``load_state_dict(d)`` and
    ``load_state_dicts(ds)``, which reshards every saved rank's state for the current world (the
    resume of a sharded checkpoint at another world size, or a lost rank's shards rebuilt from
    its ring copy). Subclass it, or hold one, to add what else a step changes (a sampler, RNG
    streams).

    Args:
        model: the :class:`FullyShardedDataParallel` wrapper.
        optimizer: built over ``model.parameters()`` (so its state is sharded too).
        step: steps completed; FaultTolerance's training loops set ``state.step = step + 1``.

    ``state_dict()`` is ``{"model": model.sharded_state_dict(), "optimizer":
    optimizer.state_dict(), "step": int}`` (tensors are the model's copies and the optimizer's
    own; plain values, so ``torch.load(weights_only=True)`` reads a checkpoint of it).
    """

    def __init__(self, model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, step: int = 0):
        if not isinstance(model, FullyShardedDataParallel):
            raise ConfigError(f"FSDPState: model must be a FullyShardedDataParallel, got {type(model).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.step = int(step)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.sharded_state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step}

    def layout_digest(self) -> int:
        """A signed 64-bit digest of the model's layout (flat parameters with their parameter
        names in registration order, and the replicated state's names, shapes and dtypes):
        :class:`rtxnet.FaultTolerance` compares it across ranks at every sync, which catches
        ranks whose modules differ where ``init_sync`` (off under FaultTolerance) would have."""
        rep = [(k, tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else (k,)
               for k, t in self.model._replicated().items()]
        return layout_digest((self.model._layout(), rep))

    def sharded_layout(self) -> tuple[int, int]:
        """``(rank, world_size)`` the shards are laid out for (those of the world the model was
        wrapped in, until a load reshards them): what ``FaultTolerance(sharded_state=True)``
        compares across ranks before the first commit."""
        return self.model.rank, self.model.world_size

    def hold_built(self, hold: bool = True) -> None:
        """:meth:`FullyShardedDataParallel.hold_built`."""
        self.model.hold_built(hold)

    def holds_built(self) -> bool:
        """Whether :meth:`built_state_dicts` can still answer (not released)."""
        return self.model._built is not None

    def built_state_dicts(self) -> list[dict[str, Any]] | None:
        """Every rank's :meth:`state_dict` as the model was built, before any step (the model's
        :meth:`FullyShardedDataParallel.built_sharded_state_dicts`, the optimizer without state,
        step 0), for :meth:`load_state_dicts`; ``None`` once the model released them."""
        models = self.model.built_sharded_state_dicts()
        if models is None:
            return None
        opt = self.optimizer.state_dict()
        fresh = {"state": {}, "param_groups": opt["param_groups"]}
        return [{"model": m, "optimizer": fresh, "step": 0} for m in models]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own state, at the world size and rank it was taken in, in place.

        Raises:
            ConfigError: saved at another world size or rank, or another layout (names both;
                :meth:`load_state_dicts` changes the world size).
        """
        self.model.load_sharded_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.zero_grad(set_to_none=True)
        self.step = int(state["step"])

    def load_state_dicts(self, states: Sequence[dict[str, Any]], *, step: int | None = None) -> None:
        """Every saved rank's state of one committed step or checkpoint, in saved-rank order
        (``rtxnet.checkpoint.load_all``), resharded for the current world, in place: shards by
        :meth:`FullyShardedDataParallel.load_sharded_state_dicts`, the optimizer's moments by
        :meth:`FullyShardedDataParallel.reshard_optimizer_state_dict`, the step from saved rank 0.
        Gradients left by a failed step are dropped (by :meth:`load_state_dict` too).

        Args:
            states: ``states[q]`` is saved rank ``q``'s :meth:`state_dict`.
            step: the checkpoint's step, when loading one: the state must hold that many steps
                (a checkpoint of step N is saved at the start of step N, before it changes
                anything; one saved after the step ran would repeat it on resume).

        Raises:
            ConfigError: not such dicts (names the missing key); the saved ``step`` differs from
                ``step`` (names both); as the two methods above (a missing or misplaced rank,
                another layout).
        """
        for q, st in enumerate(states):
            missing = [k for k in ("model", "optimizer", "step") if not isinstance(st, dict) or k not in st]
            if missing:
                raise ConfigError(f"FSDPState.load_state_dicts: states[{q}] lacks {missing} (save "
                                  f"FSDPState.state_dict(), not a dict of your own)")
        if step is not None and int(states[0]["step"]) != int(step):
            raise ConfigError(
                f"FSDPState.load_state_dicts: the checkpoint of step {step} holds step "
                f"{states[0]['step']}: save it at the start of step {step}, before the step "
                f"changes the state (saved after it, resuming would run a step twice)")
        self.model.load_sharded_state_dicts([st["model"] for st in states])
        self.optimizer.load_state_dict(self.model.reshard_optimizer_state_dict(
            self.optimizer, [st["optimizer"] for st in states]))
        self.optimizer.zero_grad(set_to_none=True)
        self.step = int(states[0]["step"])


_SAVED = object()   # marks a saved tensor that views a gathered buffer


def _reshard(saved: torch.Tensor, g: _FlatGroup, world: int, rank: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rank ``rank``'s ``[S]`` for ``world``, from the saved shards concatenated in rank order
    (the old layout's padded flat: its first ``T`` elements are the data)."""
    S = g.shard_numel(world)
    new = torch.zeros(S, dtype=dtype or g.dtype)
    lo, hi = rank * S, min((rank + 1) * S, g.numel)
    if lo < hi:
        new[:hi - lo] = saved[lo:hi]
    return new


def _check_cpu(module: torch.nn.Module) -> None:
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "cpu":
            raise ConfigError(f"{name} is on {t.device}; rtxnet FSDP takes CPU modules "
                              "(module.to('cpu'))")


def _select_units(module: torch.nn.Module, wrap: WrapPolicy) -> list[str]:
    """Qualified names of the unit modules, root ``""`` first, in ``named_modules`` order.

    Raises:
        ConfigError: ``wrap`` is not None, a list of classes, a positive int or a callable.
    """
    if wrap is None:
        return [""]
    named = list(module.named_modules())
    if isinstance(wrap, bool):
        raise ConfigError(f"wrap({wrap!r}) must be None, a list of module classes, a positive "
                          "int (minimum parameters per unit) or a callable(module, name)")
    if isinstance(wrap, int):
        if wrap < 1:
            raise ConfigError(f"wrap({wrap!r}) as a minimum parameter count must be >= 1")
        chosen: set[str] = set()
        claimed: set[int] = set()
        for name, m in reversed(named):      # children before parents: bottom-up
            if name == "":
                continue
            free = [p for p in m.parameters() if p.requires_grad and id(p) not in claimed]
            if sum(p.numel() for p in free) >= wrap:
                chosen.add(name)
                claimed.update(id(p) for p in free)
        return [""] + [n for n, _ in named if n in chosen]
    if callable(wrap) and not isinstance(wrap, type):
        return [""] + [n for n, m in named if n and wrap(m, n)]
    try:
        classes = tuple(wrap)
    except TypeError:
        classes = ()
    if not classes or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
        raise ConfigError(f"wrap({wrap!r}) must be None, a list of module classes, a positive int "
                          "(minimum parameters per unit) or a callable(module, name)")
    return [""] + [n for n, m in named if n and isinstance(m, classes)]
