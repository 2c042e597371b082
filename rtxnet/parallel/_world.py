"""The world group one step of a wrapper (DDP's buckets, FSDP's gathers) began in.

A step that calls several collectives at different times must call all of them in one world.
Reading ``pg.epoch`` and then calling ``pg.all_reduce`` is not atomic: the agent's thread may
enter a new epoch between the two, and the collective then runs in the new world on this rank
alone, one operation ahead of every other rank there (each later collective pairs with the wrong
one). :class:`StepWorld` takes the world group once and sends every collective of the step to it;
after a membership change that group raises ``PeerLostError`` instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import torch

from rtxnet.collectives.reduce_ops import SUPPORTED_DTYPES
from rtxnet.config import shown_list
from transport.errors import ConfigError

log = structlog.get_logger(__name__)


def check_group(pg: Any, who: str) -> None:
    """Refuse a ``pg`` that is not a process group or a subgroup of one (``None``, a name): the
    wrappers failed later with ``AttributeError: 'NoneType' object has no attribute 'size'`` (a
    fresh user's find). Checked by what the wrappers read (``rank`` and ``world_size`` or
    ``size``), not by class: the blocking facade's subgroups are proxies.

    Raises:
        ConfigError: names ``who``, the value and what is accepted.
    """
    rank = getattr(pg, "rank", None)
    has_size = getattr(pg, "world_size", None) is not None or getattr(pg, "size", None) is not None
    if isinstance(rank, int | np.integer) and not isinstance(rank, bool) and has_size:
        return
    raise ConfigError(f"{who}: pg must be the process group of rtxnet.init() or a subgroup of it "
                      f"(pg.new_group, pg.split, DeviceMesh.get_group), got {reprlib.repr(pg)} "
                      f"({type(pg).__name__})")


def group_size(pg: Any) -> int:
    """The size of a world group (``world_size``) or of a subgroup (``size``)."""
    ws = getattr(pg, "world_size", None)
    return int(pg.size if ws is None else ws)


def joined_running(pg: Any) -> bool:
    """Whether this process joined its job after the job had formed (a replacement started by
    ``rtxnet-run --max-restarts``, a rank that came after ``--min-ranks``' last call): its peers
    are training, so a collective at model construction (``init_sync``) would meet theirs of a
    training step or of ``FaultTolerance``'s sync, not its like."""
    agent = getattr(getattr(pg, "async_pg", pg), "agent", None)
    return bool(getattr(agent, "joined_running", False))


def skip_init_sync(pg: Any, wrapper: str) -> bool:
    """``init_sync`` on a rank that :func:`joined_running`: skipped, with a warning (a fresh
    user's find: the README's FSDP example, built with the default ``init_sync=True``, ended the
    job when a replacement broadcast at construction while the others synced). The state comes
    from the peers: ``FaultTolerance`` syncs it at the replacement's first step."""
    if not joined_running(pg):
        return False
    log.warning(
        "init_sync_skipped", wrapper=wrapper,
        why="this rank joined a running job (a replacement or a late rank): its peers are "
            "training, not building the model; FaultTolerance syncs the state at its first step "
            "(pass init_sync=False to say so)")
    return True


class StepWorld:
    """The world group of the current step of ``pg`` (a process group, blocking or async, or a
    subgroup: a subgroup belongs to one epoch already and is used as it is)."""

    def __init__(self, pg: Any):
        self._apg = getattr(pg, "async_pg", pg)
        # the blocking facade, whose event loop runs in another thread: this thread can wait on it
        self._entered = getattr(pg, "_until_world_entered", None) if self._apg is not pg else None
        self.world: Any = None

    def begin(self) -> int | None:
        """Take the world group collectives go to now; returns its epoch (``None`` if unknown).

        When the membership is already in a newer epoch than that group (the engine enters a view
        after the agent took it: a thread of the blocking facade can see the new world size
        first, and a view of ranks that left in order is held while operations in flight end),
        waits for the engine to enter it, at most the engine's grace for such a hold
        (``heartbeat_timeout_s + heartbeat_interval_s``): a step begun in the old group would
        only fail (a CI run: DDP's retry after a loss raised ``PeerLostError`` a second time,
        its forward taken in the world the first attempt failed in)."""
        current = getattr(self._apg, "current_world", None)
        self.world = current() if current is not None else None
        if self.world is None:
            return getattr(self._apg, "epoch", None)
        epoch = getattr(self._apg, "epoch", None)
        if (self._entered is not None and epoch is not None and self.world.epoch < epoch
                and getattr(self._apg, "_pinned_world", None) is None):
            self._entered()
            self.world = current()
        return self.world.epoch

    def pinned(self) -> contextlib.AbstractContextManager:
        """A block whose collectives go to the step's world group (nothing to pin before
        :meth:`begin` or for a subgroup)."""
        if self.world is None:
            return contextlib.nullcontext()
        return self._apg.pinned(self.world)


def step_size(pg: Any) -> int:
    """The size of the world the group's collectives go to now: the world a step pinned
    (``FaultTolerance``'s guard, ``pg.pinned()``) while one is pinned, else :func:`group_size`.

    A layer built for N ranks checks its group against this, not against the membership: when a
    rank is lost in the middle of a step, the step's collectives still go to the pinned world of
    N and raise ``PeerLostError`` there, which ``FaultTolerance`` recovers from; comparing with
    the new membership raised ``ConfigError`` (not recoverable) instead, and ended the job (a CI
    run: a replacement's first forward ran just as its ring neighbour was killed in the sync)."""
    step = StepWorld(pg)
    step.begin()
    return int(step.world.size) if step.world is not None else group_size(pg)


def layout_digest(layout: Any) -> int:
    """A signed 64-bit digest (BLAKE2b of its ``repr``) of a layout description, to compare
    across ranks as one int64."""
    return int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=8).digest(), "little",
                          signed=True)


def check_same_layout(module: Any, pg: Any, who: str, trainable: list[str],
                      **kw: Any) -> None:
    """Refuse replicas whose parameters or buffers differ in name, order, shape, dtype or
    ``requires_grad``, with one all_gather of an 8-byte digest (a collective over ``pg``).

    Without it, equal-sized tensors pair up by position: DDP would average one rank's gradient of
    ``a`` with another's of ``b``, and an initial broadcast (DDP's, FSDP's flat parameters) copy
    rank 0's ``a`` into another rank's ``b``, without any error (e.g. layers built from a ``set``
    of names, whose order changes per process with hash randomisation).

    Args:
        module: the wrapped ``torch.nn.Module``, before any wrapper changed its parameters.
        pg: the group the wrapper runs over.
        who: the wrapper's name for the message (``"DDP"``, ``"FSDP"``).
        trainable: this rank's trainable parameter names, the first few named in the message.
        kw: passed to the all_gather (``timeout``).

    Raises:
        ConfigError: on every rank, naming the ranks whose layout differs from rank 0's.
        PeerLostError, CollectiveTimeout: the all_gather failed.
    """
    layout = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    layout += [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]
    digest = layout_digest(layout)
    got = torch.zeros(group_size(pg), dtype=torch.int64)
    pg.all_gather(got, torch.tensor([digest], dtype=torch.int64), **kw)
    digests = got.tolist()
    differ = [k for k, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ConfigError(
            f"{who}: the replicas differ: rank(s) {differ} have parameters or buffers unlike rank "
            f"0's (names, their order, shapes, dtypes and requires_grad must be the same on every "
            f"rank); this rank trains {len(trainable)} parameter(s): {', '.join(trainable[:6])}"
            f"{', ...' if len(trainable) > 6 else ''}")


# torch dtypes the collectives reduce (bool aside: it broadcasts as its bytes like the others)
_REDUCIBLE = {getattr(torch, name) for name in SUPPORTED_DTYPES if name != "bool"}


def broadcastable(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (1-D, contiguous) as the collectives carry it, sharing its memory: itself, or its
    bytes as ``uint8`` for a dtype they do not reduce (bool, complex such as rotary embeddings'
    ``freqs_cis``, uint16, float8): a broadcast copies bits, whatever they mean."""
    return flat if flat.dtype in _REDUCIBLE else flat.view(torch.uint8)


def graph_task() -> int | None:
    """The id of the autograd graph task running this hook (-1 outside a backward; None where
    torch does not say): a backward run inside a backward (activation checkpointing with
    ``use_reentrant=True``) has its own."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return None if fn is None else fn()


def check_unchanged(laid_out: list[tuple[str, torch.nn.Parameter, tuple, torch.dtype, torch.device]],
                    who: str, describe: Callable[[str], str] = repr) -> None:
    """Raise ``ConfigError`` naming the trainable parameters of ``laid_out`` (``(name,
    parameter, shape, dtype, device)``, as the wrapper ``who`` laid its buffers out for them)
    changed in place since: ``module.double()``, ``.half()`` or
    ``.to(device)`` after wrapping (they change ``param.data``, not the parameter), or
    ``requires_grad_(False)``. Before, DDP reduced on without a word: one rank's frozen weight
    made the others' gradient half of it and its own still moved; ``double()`` on one rank left
    replicas of two dtypes; FSDP said only "all_gather output is float32[50], needs float64" (a
    breaker's finds). One look at each parameter's attributes per forward. ``describe`` shows a
    name in the message (FSDP's flat shards name the module's parameters they hold)."""
    changed = []
    for n, p, shape, dtype, device in laid_out:
        if not p.requires_grad:
            changed.append(f"{describe(n)} has requires_grad=False")
        elif p.dtype != dtype:
            changed.append(f"{describe(n)} is {p.dtype}, was {dtype}")
        elif p.device != device:
            changed.append(f"{describe(n)} is on {p.device}, was on {device}")
        elif p.shape != shape:
            changed.append(f"{describe(n)} has shape {tuple(p.shape)}, was {tuple(shape)}")
    if changed:
        shown = shown_list(changed, 8, "; ")
        raise ConfigError(f"{who}: trainable parameter(s) changed after the wrapper was built: {shown} "
                          f"(module.double()/.half()/.to() or requires_grad_(False) after wrapping): "
                          f"its buffers and collectives are laid out for them as they were, and the "
                          f"replicas would differ. Make the change before wrapping, or build the "
                          f"wrapper again (torch DDP and FSDP ask the same)")


def check_still_frozen(frozen: list[tuple[str, torch.nn.Parameter]], who: str) -> None:
    """Raise ``ConfigError`` naming the parameters of ``frozen`` (``(name, parameter)``, frozen
    when the wrapper ``who`` was built) that require gradients now: the wrapper reduces only the
    gradients of the parameters that were trainable then, so theirs would stay on each rank and
    the replicas drift apart without an error (a tester's find: staged unfreezing, 0.035 off one
    process after 2 steps, the ranks' weights unlike each other)."""
    thawed = [n for n, p in frozen if p.requires_grad]
    if thawed:
        shown = shown_list([repr(n) for n in thawed], 8)
        raise ConfigError(f"{who}: parameter(s) {shown} had requires_grad=False when the wrapper was "
                          f"built and require gradients now: their gradients would not be reduced "
                          f"and the replicas would drift apart. Build the wrapper again after "
                          f"changing requires_grad (torch DDP and FSDP ask the same)")
