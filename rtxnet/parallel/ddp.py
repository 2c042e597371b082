"""Data parallelism for PyTorch modules over an rtxnet process group.

Shapes legend: ``N`` elements of one gradient bucket (``grads_N``), ``P`` parameters of a bucket.

:class:`DistributedDataParallel` keeps one replica of the module per rank. Parameters and buffers
are broadcast from rank 0 when it is built. During backward, each parameter's gradient is copied
into a flat per-dtype **bucket** as soon as autograd has accumulated it
(``Tensor.register_post_accumulate_grad_hook``); a bucket that is full is all-reduced at once with
``async_op=True`` on rtxnet's background loop, so communication overlaps the rest of backward. The
design follows ``torch.nn.parallel.DistributedDataParallel`` (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020): buckets hold parameters in reverse
registration order (roughly the order backward produces gradients), the first bucket is small so
communication starts early, and buckets are launched strictly in index order so every rank issues
the same sequence of collectives whatever order its gradients become ready in.

At the end of backward (an autograd final callback) the remaining buckets are launched, every
bucket is waited for and the reduced values are copied back into ``param.grad``. So after
``loss.backward()`` returns, gradients are synchronised and ``optimizer.step()`` may run.

**Devices.** The module's parameters and buffers must all be on one device: the CPU (rtxnet's
CPU collectives) or one CUDA device. On CUDA the buckets are torch tensors on that device and go
through the same process-group calls; the group sends GPU tensors down its GPU path (CUDA IPC
between ranks of one host, several ranks sharing one GPU included; NCCL across hosts), which
orders its work after the stream current on rtxnet's loop thread, the default stream. When
backward runs on another stream, the default stream is made to wait for it before each launch
(an event, no host synchronisation), and it for the default stream before the write-back. A
module spread over several devices (model parallel inside one rank, or CPU and CUDA mixed) is
refused with a ``ConfigError`` naming the devices.

**Parameters without a gradient.** Every bucket is reduced every step, on every rank, whether or
not its parameters got a gradient on this rank (a missing gradient counts as zeros), so ranks never
disagree on the sequence of collectives and nothing hangs. Each bucket carries one extra element
per parameter, 1 where that rank had a gradient: a parameter that no rank produced a gradient for
keeps ``grad = None`` (as in one process, so optimizers skip it); one that some rank used gets the
reduced gradient everywhere.

**Reduction.** ``reduce_op=ReduceOp.AVG`` (default) averages gradients over the ranks of the
current world: with the same per-rank batch this equals one process with the global batch.
``reduce_op=ReduceOp.SUM`` sums them; scale each rank's loss by ``local_n / global_n`` (for a mean
loss) and the result equals one process with the global batch exactly even when ranks hold
different numbers of samples, e.g. a global batch of 64 over 3 survivors after a failure.
Gradients accumulated onto a synchronised one (no ``zero_grad`` between synchronising backwards,
or ``no_sync`` micro-batches after one) count it once under ``SUM`` too: what the ``param.grad``
a synchronisation wrote holds when a backward first adds to it (the synchronised gradient as the
step left it, changed in place included: clipped, scaled; the same on every rank) enters the sum
divided by the world size; a copy of it is kept until the next synchronisation (not when
``param.grad`` was set to ``None``). A tensor assigned to ``param.grad`` counts as the rank's
own. Under ``SUM``, changing ``param.grad`` in place after a backward added this rank's gradient
to that part and before the next synchronisation is refused with ``ConfigError`` (the two parts
can no longer be told apart), unless it is zeroed. ``AVG`` needs none of this: averaging keeps a
part that is the same on every rank as it is.

**Replaced parameters.** ``load_state_dict(..., assign=True)`` (the ``torch.load(mmap=True)``
resume), or a parameter or submodule set as an attribute, gives the module new ``Parameter``
objects, while the gradient hooks are on the old ones: nothing would be reduced again and the
replicas would drift apart silently. :meth:`DistributedDataParallel.load_state_dict` and the next
``forward`` notice it and lay out the buckets and hooks for the new parameters (every rank that
does the same gets the same layout). The new values must be the same on every rank (one
checkpoint): nothing is broadcast (call :meth:`DistributedDataParallel.broadcast_parameters`
otherwise). New parameters unlike the old in name, order, shape, dtype or device, or a trainable
one replaced by one that does not require gradients, are refused with ``ConfigError`` (build the
wrapper again, or load with ``assign=False``, which copies into the existing parameters); a
parameter frozen when the wrapper was built that requires gradients now is refused as before, and
so is a trainable parameter changed in place (``module.double()``, ``.half()``, ``.to(device)``,
``requires_grad_(False)`` after wrapping), at the next ``forward``.

**Several forwards before their backwards.** A backward synchronises the gradients of the
synchronising forward before it. When a second forward ran before the first backward (micro-
batches without ``no_sync``), the second backward's gradient would stay on its rank and the
replicas would diverge (torch DDP lets them): that backward raises ``ConfigError`` instead.
Accumulate with :meth:`no_sync`, or run all forwards under it and call :meth:`sync_gradients`
after the last backward (pipeline schedules do this for a replicated stage).

**After a failed step.** When a bucket's all-reduce fails (``PeerLostError`` after a rank died,
``CollectiveTimeout``), ``loss.backward()`` raises that error and the module is left usable: the
next ``forward`` starts a clean round (call :meth:`DistributedDataParallel.reset` to do it
explicitly). Buckets whose all-reduce may still be in flight are replaced by fresh memory, so a late
write of an aborted collective cannot touch the next step. ``param.grad`` holds unreduced or
partially reduced values after a failure: zero the gradients before retrying the step (parameters
are untouched, because ``optimizer.step()`` was never reached). The world size is never cached: a
step uses the world the process group has at its synchronising ``forward`` (or at
:meth:`DistributedDataParallel.sync_gradients`), so the world may shrink or grow between steps.
Every collective of the step goes to that world: if the membership changes after the forward
(its batch was chosen for the old world, e.g. by :class:`rtxnet.sampler.ElasticDistributedSampler`)
or while the backward is launching buckets, no bucket runs in the new world (every rank would then
run a different number of collectives there, or reduce a batch meant for another world size)
and ``loss.backward()`` raises ``PeerLostError``. A synchronising ``forward`` in a world below
``min_ranks`` raises the ``PeerLostError`` its collectives would.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import structlog
import torch

from rtxnet.collectives import ReduceOp
from rtxnet.config import is_seconds, shown_list
from transport.errors import ConfigError, PeerLostError

from ._world import (
    StepWorld,
    broadcastable,
    check_group,
    check_same_layout,
    check_still_frozen,
    check_unchanged,
    graph_task,
    group_size,
    skip_init_sync,
)

__all__ = ["DistributedDataParallel", "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_MB"]

log = structlog.get_logger(__name__)

DEFAULT_BUCKET_CAP_MB = 25.0       # torch DDP's default bucket_cap_mb
DEFAULT_FIRST_BUCKET_MB = 1.0      # torch DDP's _DEFAULT_FIRST_BUCKET_BYTES: start comms early
# The broadcasts of parameters and buffers (init_sync, broadcast_parameters, broadcast_buffers)
# go in pieces of at most this many bytes (a tensor larger than that alone), so a rank holds at
# most this much beyond its model: torch DDP's broadcast_bucket_size (250 MiB) for
# _sync_module_states. Before, each dtype went as one buffer: a copy of the whole model.
BROADCAST_BUCKET_NBYTES = 250 * 1024 * 1024
_MB = 1024 * 1024


class _Bucket:
    """Parameters of one dtype whose gradients are reduced together.

    ``flat`` holds the gradients (``grads_N``) followed by one "has a gradient" flag per parameter
    (``[N + P]``), on the module's device. ``seen`` mirrors the flags on the host, so deciding
    what to fill never reads device memory.
    """

    __slots__ = ("index", "params", "offsets", "numel", "dtype", "flat", "ready", "work",
                 "launched", "seen")

    def __init__(self, index: int, params: list[torch.nn.Parameter], device: torch.device):
        self.index = index
        self.params = params
        self.dtype = params[0].dtype
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.flat = torch.zeros(n + len(params), dtype=self.dtype, device=device)
        self.seen = [False] * len(params)
        self.ready = 0
        self.work: Any = None
        self.launched = False

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        off = self.offsets[i]
        return self.flat[off:off + p.numel()].view(p.shape)

    def flags(self) -> torch.Tensor:
        return self.flat[self.numel:]

    def fresh(self) -> None:
        """New memory for ``flat``: an aborted collective may still write the old one."""
        self.flat = torch.zeros_like(self.flat)

    def clear(self) -> None:
        self.ready = 0
        self.work = None
        self.launched = False
        self.seen = [False] * len(self.params)
        self.flags().zero_()


class DistributedDataParallel(torch.nn.Module):
    """Replicate ``module`` over the ranks of ``pg`` and average (or sum) its gradients.

    Use it like ``torch.nn.parallel.DistributedDataParallel``::

        model = DistributedDataParallel(net, pg)
        loss = criterion(model(x), y)
        loss.backward()          # gradients are synchronised when this returns
        optimizer.step()

    Args:
        module: a ``torch.nn.Module`` whose parameters and buffers are all on the CPU or all on
            one CUDA device (see "Devices" in the module notes). Parameters with
            ``requires_grad=False`` are not reduced.
        pg: a :class:`rtxnet.BlockingProcessGroup` (``rtxnet.init()``), or a subgroup of one
            (``pg.new_group``, a :class:`rtxnet.parallel.DeviceMesh` dimension: data parallel
            over that subgroup only, e.g. across tensor-parallel replicas). A subgroup belongs to
            one epoch: after a membership change its collectives raise ``PeerLostError``.
        bucket_cap_mb: bucket size in MiB (default 25, as torch). Larger buckets mean fewer
            collectives, smaller ones earlier overlap.
        first_bucket_mb: size in MiB of the first bucket (the last layers' gradients, ready first),
            so communication starts early in backward (default 1, as torch).
        reduce_op: ``ReduceOp.AVG`` (mean over ranks) or ``ReduceOp.SUM`` (see the module notes
            on loss scaling for uneven batches).
        broadcast_buffers: broadcast buffers (e.g. BatchNorm running statistics) from rank 0 at
            every forward that will synchronise gradients, as torch does.
        init_sync: broadcast rank 0's parameters and buffers now (a collective: every rank must
            build the module at the same point). Pass False when replicas are already identical
            (same seed) and something else aligns them later, e.g. ``rtxnet.FaultTolerance``,
            which a replacement rank joins mid-run and whose first sync of a job with no
            committed step compares the replicas of the world group (a digest of parameters
            and buffers) and gives every rank rank 0's where they differ.
        timeout_s: deadline in seconds of each bucket's all-reduce; ``None`` uses the group's.

    Raises:
        ConfigError: ``pg`` is not a process group or a subgroup of one (``None``, a name); a
            bad ``bucket_cap_mb``, ``first_bucket_mb`` or ``reduce_op``; parameters and buffers
            on several devices, or on a device that is neither the CPU nor CUDA;
            a trainable parameter not float32/float64/float16/bfloat16 (complex: names it); an
            ``Embedding``/``EmbeddingBag`` with ``sparse=True`` (sparse gradients);
            names the value or the devices. Buffers of any dtype are broadcast (their bytes).
        ConfigError: with ``init_sync``, ranks whose parameters or buffers differ in name,
            shape, dtype or ``requires_grad`` (raised on every rank, naming them).
        PeerLostError, CollectiveTimeout: the initial broadcast failed.

    Later, ``forward`` raises ``ConfigError`` for a parameter frozen at construction that requires
    gradients now, for a trainable one changed in place since (dtype, device, shape or
    ``requires_grad=False``: ``module.double()`` after wrapping), and for parameters replaced by
    ones of another name, order, shape, dtype or
    device, or a trainable one by one with ``requires_grad=False`` (parameters replaced by
    like ones are hooked again: see "Replaced parameters" in the module notes); a backward
    raises it as the module notes say (a second forward or backward, reentrant checkpointing,
    ``param.grad`` changed between accumulating backwards under ``SUM``).

    Attributes:
        module: the wrapped module.
        device: the device of its parameters and of the gradient buckets.
        buckets: bucket layout as lists of parameter names, in launch order.
    """

    def __init__(self, module: torch.nn.Module, pg: Any, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                 first_bucket_mb: float = DEFAULT_FIRST_BUCKET_MB, reduce_op: ReduceOp = ReduceOp.AVG,
                 broadcast_buffers: bool = True, init_sync: bool = True,
                 timeout_s: float | None = None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_group(pg, "DistributedDataParallel")
        for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ConfigError(f"{name}({v!r}) must be a positive, finite number of MiB")
        if reduce_op not in (ReduceOp.AVG, ReduceOp.SUM):
            raise ConfigError(f"reduce_op({reduce_op!r}) must be ReduceOp.AVG or ReduceOp.SUM")
        if timeout_s is not None and not is_seconds(timeout_s):
            raise ConfigError(f"timeout_s({timeout_s!r}) must be a positive, finite number of seconds")
        self.module = module
        self._pg = pg
        self._step_world = StepWorld(pg)
        self.reduce_op = reduce_op
        self.broadcast_buffers = broadcast_buffers
        self.timeout_s = timeout_s
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.first_bucket_mb = float(first_bucket_mb)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        _refuse_unsupported(module, named)
        self.device = _module_device(module)
        # ReduceOp.SUM over gradients accumulated onto an earlier synchronisation's (see
        # _contribution): the p.grad a synchronisation wrote (weakly) while no backward has added
        # to it since, and what p.grad held when a backward first added to it after one, with
        # the _mark of p.grad after autograd's last addition (None between a tensor hook and its
        # post-accumulate hook)
        self._synced: dict[int, weakref.ref] = {}
        self._base: dict[int, tuple[torch.Tensor, tuple | None]] = {}
        self._hooks: list[Any] = []
        self._hooks_removed = False
        self._register(named)

        self._require_sync = True       # toggled by no_sync()
        self._sync_armed = False        # set by forward: the next backward synchronises
        self._round_open = False        # a backward of a synchronising step is under way
        self._round_epoch: int | None = None      # epoch of the world the step began in
        self._round_broken: PeerLostError | None = None   # the world changed mid-round
        self._next_launch = 0
        self._last_world_size: int | None = None
        # synchronising forwards since the last synchronisation, and how many of them were left
        # with a backward still to come when it ran (two forwards before their backwards)
        self._armed_since_sync = 0
        self._late_forwards = 0
        self._grads_synced = True   # no backward since the last synchronisation
        # synchronising forwards run (numbered from 1), the newest whose gradients a finished
        # round synchronised, the newest an output hook saw a backward reach, and those whose
        # outputs no backward has reached yet (see _output_grad)
        self._forward_no = 0
        self._synced_through = 0
        self._grad_reached = 0
        self._awaiting_grad: set[int] = set()
        # epochs of the forwards whose outputs a backward reached since the last synchronisation
        # (no_sync micro-batches included): all must be the synchronisation's, or their batches
        # were chosen for another world
        self._grad_epochs: set[int | None] = set()
        # the autograd graph task of the backward that reached a synchronising forward's output
        # (a gradient of a parameter from another, nested one: reentrant checkpointing)
        self._backward_task: int | None = None
        self.last_comm_wait_s = 0.0
        if init_sync and not skip_init_sync(self._pg, "DDP"):
            check_same_layout(self.module, self._pg, "DDP", list(self._names.values()))
            self.broadcast_parameters(src=0)
        elif not init_sync:
            # FaultTolerance's first sync of a job makes the replicas equal (it compares them)
            from rtxnet.elastic import note_unsynced_replica

            note_unsynced_replica(self, self._pg)
        log.info("ddp_ready", params=len(named), buckets=len(self._buckets), device=str(self.device),
                 nbytes=sum(b.numel * b.flat.element_size() for b in self._buckets),
                 reduce_op=reduce_op.name)

    # -- layout ----------------------------------------------------------------------------------

    def _build_buckets(self, params: list[torch.nn.Parameter]) -> list[_Bucket]:
        cap = int(self.bucket_cap_mb * _MB)
        first_cap = int(min(self.first_bucket_mb, self.bucket_cap_mb) * _MB)
        open_: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        sizes: dict[torch.dtype, int] = {}
        done: list[list[torch.nn.Parameter]] = []
        for p in reversed(params):
            lst = open_.setdefault(p.dtype, [])
            lst.append(p)
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
            limit = first_cap if not done else cap
            if sizes[p.dtype] >= limit:
                done.append(lst)
                open_[p.dtype] = []
                sizes[p.dtype] = 0
        done.extend(lst for lst in open_.values() if lst)
        return [_Bucket(i, ps, self.device) for i, ps in enumerate(done)]

    def _register(self, named: list[tuple[str, torch.nn.Parameter]],
                  frozen: list[tuple[str, torch.nn.Parameter]] | None = None) -> None:
        """Lay the buckets out for the trainable parameters ``named`` and hook them; remember the
        module's parameters (``frozen``: those registered as frozen, by default the ones with
        ``requires_grad=False``) and where each parameter and submodule sits, for
        :meth:`_follow_parameters`."""
        if frozen is None:
            frozen = [(n, p) for n, p in self.module.named_parameters() if not p.requires_grad]
        self._names = {id(p): n for n, p in named}
        self._frozen = frozen
        trainable = {id(p) for _, p in named}
        self._registered = [(n, p, id(p) in trainable, tuple(p.shape), p.dtype, p.device)
                            for n, p in self.module.named_parameters()]
        # the trainable ones' rows, as check_unchanged takes them at each forward
        self._laid_out = [(n, p, *rest) for n, p, tr, *rest in self._registered if tr]
        self._places = self._where_everything_sits()
        self._buckets = self._build_buckets([p for _, p in named])
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in named]
        if self.reduce_op is ReduceOp.SUM:
            self._hooks += [p.register_hook(functools.partial(self._before_accumulate, p)) for _, p in named]

    def _where_everything_sits(self) -> list[tuple[torch.nn.Module, tuple, tuple]]:
        """Each module (this wrapper first) with its submodules and parameters by name."""
        return [(self, (("module", self.module),), ())] + [
            (m, tuple(m._modules.items()), tuple(m._parameters.items())) for m in self.module.modules()]

    def _replaced(self) -> bool:
        """Whether a parameter or submodule of the module is not the one :meth:`_register` saw
        (replaced, added or removed): dict look-ups, no walk of the module tree."""
        for m, children, params in self._places:
            mods, ps = m._modules, m._parameters
            if len(ps) != len(params) or (m is not self and len(mods) != len(children)):
                return True
            for k, c in children:
                if mods.get(k) is not c:
                    return True
            for k, q in params:
                if ps.get(k) is not q:
                    return True
        return False

    def _follow_parameters(self) -> None:
        """Re-register the module's parameters when some were replaced since the buckets were
        laid out (``load_state_dict(..., assign=True)``, a parameter or submodule set as an
        attribute): the hooks were on the old ones, whose gradients nothing computes any more.

        Raises:
            ConfigError: the new parameters differ from the old in name, order, shape, dtype or
                device, or a trainable one was replaced by one with ``requires_grad=False``.
        """
        if self._hooks_removed or not self._replaced():
            return
        current = list(self.module.named_parameters())
        before = {n: rest for n, *rest in self._registered}
        names = [n for n, _ in current]
        problems = []
        if names != [n for n, *_ in self._registered]:
            added = [n for n in names if n not in before]
            gone = [n for n in before if n not in set(names)]
            problems += [f"new parameter {n!r}" for n in added] + [f"no parameter {n!r}" for n in gone]
            if not problems:
                problems.append("the parameters are in another order")
        else:
            for n, p in current:
                _, trainable, shape, dtype, device = before[n]
                if tuple(p.shape) != shape:
                    problems.append(f"{n!r} has shape {tuple(p.shape)}, was {shape}")
                if p.dtype != dtype:
                    problems.append(f"{n!r} is {p.dtype}, was {dtype}")
                if p.device != device:
                    problems.append(f"{n!r} is on {p.device}, was on {device}")
                if trainable and not p.requires_grad:
                    problems.append(f"{n!r} has requires_grad=False, was trainable")
        if problems:
            shown = shown_list(problems, 8, "; ")
            raise ConfigError(
                f"DistributedDataParallel: the module's parameters were replaced (load_state_dict("
                f"..., assign=True), or set as attributes) by ones unlike those its gradient "
                f"buckets are laid out for: {shown}. Load with assign=False (copies into the "
                f"parameters), make the new ones match, or build the wrapper again")
        trainable = [(n, p) for n, p in current if before[n][1]]
        _refuse_unsupported(self.module, trainable)
        now = dict(current)
        replaced = sum(1 for n, p, *_ in self._registered if now[n] is not p)
        if not replaced:   # a submodule without parameters replaced: the buckets still hold
            self._places = self._where_everything_sits()
            return
        if self._round_open:
            self.reset()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._register(trainable, [(n, p) for n, p in current if not before[n][1]])
        self._base.clear()
        self._synced.clear()
        log.info("ddp_parameters_replaced", replaced=replaced, params=len(trainable),
                 buckets=len(self._buckets))

    @property
    def buckets(self) -> list[list[str]]:
        return [[self._names[id(p)] for p in b.params] for b in self._buckets]

    # -- public API ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._follow_parameters()
        check_still_frozen(self._frozen, "DistributedDataParallel")
        check_unchanged(self._laid_out, "DistributedDataParallel")
        if self._round_open:
            # The previous backward never finished (an error, or no backward at all after hooks
            # fired): start this step clean.
            self.reset()
        # A world of one has nothing to reduce: its gradients are already the result.
        several = torch.is_grad_enabled() and group_size(self._pg) > 1
        self._sync_armed = self._require_sync and several
        self._late_forwards = 0
        self._backward_task = None
        if not several:
            self._grad_epochs.clear()
        if self._sync_armed:
            self._armed_since_sync += 1
            self._begin_step()
        if self._sync_armed and self.broadcast_buffers:
            with self._step_world.pinned():
                self._broadcast_buffers()
        out = self.module(*args, **kwargs)
        if several:
            outputs = [t for t in _tensors_in(out) if t.requires_grad]
        if self._sync_armed:
            self._forward_no += 1
            if outputs:
                if len(self._awaiting_grad) >= 64:   # forwards never backwarded (an eval with grad)
                    self._awaiting_grad.discard(min(self._awaiting_grad))
                self._awaiting_grad.add(self._forward_no)
                for t in outputs:
                    t.register_hook(functools.partial(self._output_grad, self._forward_no,
                                                      self._round_epoch))
        elif several:   # a no_sync micro-batch: its gradient joins a later synchronisation
            epoch = self._pg.epoch
            for t in outputs:
                t.register_hook(functools.partial(self._accumulated_grad, epoch))
        return out

    def _accumulated_grad(self, epoch: int | None, grad: torch.Tensor) -> None:
        """A backward reached an output of a forward run under :meth:`no_sync` in ``epoch``."""
        self._grad_epochs.add(epoch)

    def _output_grad(self, k: int, epoch: int | None, grad: torch.Tensor) -> None:
        """A backward reached an output of synchronising forward ``k`` (a tensor hook: before any
        gradient of the parameters). Raises ``ConfigError`` when the gradients of that forward
        were synchronised already: a second backward through it (``retain_graph=True``) would
        leave its gradient on this rank, the replicas diverging (torch DDP does that
        silently). The late forwards of :meth:`_grad_ready` keep their own message."""
        self._awaiting_grad.discard(k)
        self._grad_reached = max(self._grad_reached, k)
        self._grad_epochs.add(epoch)
        self._backward_task = graph_task()
        if self._require_sync and k <= self._synced_through and not self._late_forwards:
            raise ConfigError(
                "DistributedDataParallel: a second backward through a forward whose gradients the "
                "first backward already synchronised (retain_graph=True): its gradient would stay "
                "on this rank and the replicas would diverge. Sum the losses and run one backward "
                "per forward, or run the forward and every backward under ddp.no_sync() and call "
                "ddp.sync_gradients() after the last")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation for the backward passes of forwards run in this block.

        Gradients accumulate locally in ``param.grad``; the first synchronising step after the
        block reduces the accumulated sum (gradient accumulation over micro-batches).
        """
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old

    def reset(self) -> None:
        """Abandon a half-done gradient synchronisation so the next step starts clean.

        Called automatically by the next ``forward`` after a failed backward. Buckets whose
        all-reduce was launched get fresh memory (the aborted operation may still write the old
        one); nothing is waited for. ``param.grad`` is left as it is: zero it before retrying.
        """
        replaced = 0
        for b in self._buckets:
            if b.launched:
                b.fresh()
                replaced += 1
            b.clear()
        self._next_launch = 0
        self._round_open = False
        self._sync_armed = False
        self._round_broken = None
        self._grad_epochs.clear()
        self._base.clear()
        log.info("ddp_reset", buckets_replaced=replaced)

    def broadcast_parameters(self, src: int = 0) -> None:
        """Copy parameters and buffers of rank ``src`` to every rank, in place.

        Used at construction; call it again after the world re-formed with a rank whose state
        must be brought in line (e.g. a replacement that joined).

        Raises:
            PeerLostError, CollectiveTimeout: the broadcast failed.
        """
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        self._broadcast_coalesced(tensors, src)

    def finish_gradient_sync(self) -> None:
        """Launch the buckets not launched yet, wait for all and write ``param.grad``.

        Runs automatically at the end of ``loss.backward()``; calling it when no round is open
        does nothing.

        Raises:
            PeerLostError: a peer was lost during the step (``exc.ranks`` names it); the module
                resets at the next forward.
            CollectiveTimeout: a rank did not contribute in time.
        """
        if not self._round_open:
            return
        try:
            for b in self._buckets:
                if not b.launched:
                    self._fill_missing(b)
                    b.ready = len(b.params)
            self._launch_ready()
            if self._round_broken is not None:
                raise self._round_broken
            t0 = time.perf_counter()
            for b in self._buckets:
                b.work.wait()
            self.last_comm_wait_s = time.perf_counter() - t0
            if self.device.type == "cuda":
                _order_current_stream(self.device)
            for b in self._buckets:
                self._write_back(b)
        except BaseException as exc:
            log.warning("ddp_sync_failed", error=type(exc).__name__, detail=str(exc))
            raise
        for b in self._buckets:
            b.clear()
        self._next_launch = 0
        self._round_open = False
        self._synced_through = self._forward_no
        # forwards older than the newest this round's backward went through, which no backward
        # reached: this rank skipped their backward (the others, running theirs, wait for it)
        skipped = sum(1 for k in self._awaiting_grad if k < self._grad_reached)
        if skipped:
            log.warning("ddp_forward_without_backward", forwards=skipped,
                        hint="a forward with grad enabled that no backward reached: run an "
                             "evaluation under torch.no_grad() (or ddp.no_sync()); a training "
                             "step's backward must run on every rank, even with an empty batch")
        self._awaiting_grad = {k for k in self._awaiting_grad if k > self._grad_reached}
        # A second backward over the same forward (retain_graph) is refused (_output_grad).
        self._sync_armed = False
        self._late_forwards = max(0, self._armed_since_sync - 1)
        self._armed_since_sync = 0
        self._grads_synced = True
        self._grad_epochs.clear()

    def sync_gradients(self) -> None:
        """Reduce the gradients accumulated in ``param.grad`` over the group now, in place
        (blocking): for schedules that run several micro-batches' forwards before their
        backwards (a pipeline stage; :class:`~rtxnet.parallel.PipelineSchedule` does this
        itself). Run the forwards under :meth:`no_sync`, every backward, then this. A parameter
        no rank has a gradient for keeps ``grad = None``. Does nothing in a world of one, or when
        no backward ran since the last synchronisation (a second call would reduce again: with
        ``ReduceOp.SUM`` that multiplied the gradients by the world size).

        Raises:
            ConfigError: a backward's synchronisation is under way.
            PeerLostError, CollectiveTimeout: as :meth:`finish_gradient_sync`.
        """
        if self._round_open:
            raise ConfigError("sync_gradients: a backward's gradient synchronisation is under way")
        if group_size(self._pg) <= 1 or self._grads_synced:
            self._grad_epochs.clear()
            return   # nothing accumulated since the last synchronisation (a second call: no-op)
        self._begin_step()
        self._round_open = True
        self._round_broken = None
        self.finish_gradient_sync()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's ``state_dict`` (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load into the wrapped module (keys as :meth:`state_dict` gives them); clears any
        half-done synchronisation.

        With ``assign=True`` (e.g. after ``torch.load(path, mmap=True)``) the module's parameters
        become new ``Parameter`` objects: the gradient buckets and hooks are laid out for them
        again (every rank loading the same state does the same), so gradients stay reduced. The
        loaded values must be the same on every rank: nothing is broadcast (call
        :meth:`broadcast_parameters` if they are not). The next ``forward`` does the same for
        parameters replaced another way (``module.load_state_dict(..., assign=True)`` on the
        wrapped module, a parameter or submodule set as an attribute).

        Raises:
            ConfigError: the new parameters differ from the ones the wrapper was built with in
                name, order, shape, dtype or device, or a trainable one was replaced by one with
                ``requires_grad=False`` (the loaded module is left as it is; every later
                ``forward`` raises the same until the wrapper is built again). Load with
                ``assign=False`` to copy into the existing parameters instead.
            RuntimeError: as ``torch.nn.Module.load_state_dict`` (missing or unexpected keys,
                shapes that differ).
        """
        if self._round_open:
            self.reset()
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        self._follow_parameters()
        return result

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module goes back to plain local training; replaced
        parameters are not hooked again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooks_removed = True

    # -- backward machinery ----------------------------------------------------------------------

    def _grad_ready(self, p: torch.Tensor) -> None:
        self._grads_synced = False
        base = self._base.get(id(p))
        if base is not None:   # autograd added to p.grad: it holds the part and this rank's own
            self._base[id(p)] = (base[0], _mark(p.grad))
        if not self._sync_armed:
            if self._late_forwards and self._require_sync:
                # Two forwards ran before their backwards: the first backward synchronised, this
                # one's gradient would stay on this rank and the replicas would drift apart
                # (torch DDP does that silently).
                self._late_forwards = 0
                raise ConfigError(
                    "DistributedDataParallel: this backward belongs to a forward that ran before "
                    "the previous backward synchronised the gradients, so its gradient would stay "
                    "on this rank and the replicas would diverge. Run every micro-batch but the "
                    "last under ddp.no_sync() (forward and backward), or all forwards under "
                    "no_sync() and call ddp.sync_gradients() after the last backward")
            return
        if not self._round_open:
            task = graph_task()
            if self._backward_task is not None and task != self._backward_task:
                # a backward inside the backward (torch.utils.checkpoint with use_reentrant=True):
                # the synchronisation would end with the inner one, and the gradients the outer
                # one computes after it would stay on this rank
                raise ConfigError(
                    "DistributedDataParallel: a parameter's gradient came from a backward run "
                    "inside the backward that reached the module's output (activation "
                    "checkpointing with torch.utils.checkpoint(..., use_reentrant=True)): the "
                    "synchronisation would end with that inner backward and later gradients would "
                    "stay on this rank. Use use_reentrant=False")
            self._round_open = True
            self._round_broken = None
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_sync)
        b, i = self._where[id(p)]
        if b.launched:
            return  # defensive: a bucket is reduced at most once per round
        b.view(i).copy_(self._contribution(p))
        b.flags()[i] = 1
        b.seen[i] = True
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _fill_missing(self, b: _Bucket) -> None:
        # Parameters whose hook did not fire this step: their accumulated gradient (no_sync
        # steps) or zeros, so every rank still contributes the whole bucket.
        flags = b.flags()
        for i, p in enumerate(b.params):
            if b.seen[i]:
                continue
            if p.grad is not None:
                b.view(i).copy_(self._contribution(p))
                flags[i] = 1
                b.seen[i] = True
            else:
                b.view(i).zero_()
                flags[i] = 0

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if b.ready < len(b.params):
                return
            if self._pg.epoch != self._round_epoch or self._grad_epochs - {self._round_epoch}:
                # The world changed since the step's forward (or a micro-batch's, or another
                # forward this backward reached): launching buckets in the new one would leave
                # this rank with more collectives there than ranks that failed sooner, and reduce
                # a batch chosen for the old world. Launch nothing more.
                if self._round_broken is None:
                    m = getattr(self._pg, "membership", None)
                    first = min((e for e in self._grad_epochs | {self._round_epoch}
                                 if e is not None), default=None)
                    self._round_broken = PeerLostError(
                        f"membership changed between the step's forward and its gradient "
                        f"synchronisation (epoch {first} -> {self._pg.epoch}); retry the step "
                        f"(its forwards too) in the new world",
                        ranks=getattr(m, "lost", ()), epoch=self._pg.epoch)
                return
            kw = {} if self.timeout_s is None else {"timeout": self.timeout_s}
            if self.device.type == "cuda":
                _order_default_stream(self.device)
            with self._step_world.pinned():   # every bucket of the round in one world
                b.work = self._pg.all_reduce(b.flat, op=self.reduce_op, async_op=True, **kw)
            b.launched = True
            self._next_launch += 1

    def _write_back(self, b: _Bucket) -> None:
        flags = b.flags().tolist()   # one device-to-host read per bucket, not one per parameter
        for i, p in enumerate(b.params):
            self._base.pop(id(p), None)
            if flags[i] <= 0:
                self._synced.pop(id(p), None)
                continue  # no rank had a gradient for it: leave grad None, as one process would
            v = b.view(i)
            if p.grad is None:
                p.grad = v.clone()
            else:
                p.grad.copy_(v)
            if self.reduce_op is ReduceOp.SUM:
                self._synced[id(p)] = weakref.ref(p.grad)

    def _before_accumulate(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """A tensor hook (before autograd adds ``grad`` into ``p.grad``), with ``ReduceOp.SUM``:
        at the first addition since a synchronisation wrote ``p.grad``, keep what that tensor
        holds now (the synchronised part, for :meth:`_contribution`); at a later one, check that
        nothing but autograd changed ``p.grad`` since its last addition (:meth:`_part_lost`)."""
        pid = id(p)
        synced = self._synced.pop(pid, None)
        if synced is not None:
            if p.grad is not None and synced() is p.grad:
                self._base[pid] = (p.grad.detach().clone(), None)
            return
        rec = self._base.get(pid)
        if rec is not None and not _unchanged(rec[1], p.grad):
            self._part_lost(p, rec[1])

    def _part_lost(self, p: torch.Tensor, mark: tuple | None) -> None:
        """``p.grad`` is not what autograd's last addition to the part an earlier synchronisation
        wrote left (``ReduceOp.SUM``): forget the part if ``p.grad`` was set to ``None``, replaced
        by another tensor (which counts as this rank's own) or zeroed; if it was changed in place
        otherwise, the part can no longer be told from this rank's own gradient and the sum would
        count it once per rank: raise ``ConfigError``."""
        self._base.pop(id(p), None)
        g = p.grad
        if (g is None or mark is None or mark[0]() is not g or group_size(self._pg) <= 1
                or not bool(g.any())):
            return
        raise ConfigError(
            f"DistributedDataParallel (ReduceOp.SUM): the gradient of "
            f"{self._names.get(id(p), 'a parameter')!r} was changed in place after a backward "
            f"added this rank's gradient to the one an earlier synchronisation wrote: the "
            f"synchronised part, the same on every rank, can no longer be told from this rank's "
            f"own, and the sum would count it once per rank. Zero the gradients after each step "
            f"(optimizer.zero_grad()), change them only between a synchronising backward and the "
            f"next backward, or use ReduceOp.AVG")

    def _contribution(self, p: torch.Tensor) -> torch.Tensor:
        """What ``p.grad`` puts into its bucket. With ``ReduceOp.SUM``, the part an earlier
        synchronisation wrote (gradients accumulated over several synchronised backwards, or
        no_sync micro-batches after one) enters divided by the world size, so the sum counts it
        once: reduced whole, it was counted world-size times (a tester's find: 0.79 off one
        process with 2 ranks). That part is what the tensor the synchronisation wrote held when
        a backward first added to it, or all of it if none did: the synchronised gradient as the
        step left it, changed in place included (clipped, scaled: the same on every rank;
        counted whole after such a change, it was 15% to 64% off one process, a tester's find).
        A tensor assigned to ``p.grad`` since counts as this rank's own. AVG, linear in what
        every rank holds, keeps the part as it is.

        Raises:
            ConfigError: ``p.grad`` changed in place after a backward added to the part (see
                :meth:`_part_lost`).
        """
        g = p.grad
        if self.reduce_op is not ReduceOp.SUM:
            return g
        pid = id(p)
        share = 1.0 / (self._last_world_size or 1)
        synced = self._synced.pop(pid, None)
        if synced is not None and synced() is g:   # no backward added to it since it was written
            return g * share
        rec = self._base.pop(pid, None)
        if rec is None:
            return g
        if not _unchanged(rec[1], g):
            self._part_lost(p, rec[1])   # raises unless p.grad holds nothing of the part any more
            return g
        return g - rec[0] * (1.0 - share)

    def _begin_step(self) -> None:
        # The world the step's collectives go to: taken where its batch is used (the forward),
        # not where the first bucket is launched, which a membership change may come between.
        self._note_world()
        self._round_epoch = self._step_world.begin()

    def _note_world(self) -> None:
        ws = group_size(self._pg)
        if ws != self._last_world_size:
            if self._last_world_size is not None:
                log.info("ddp_world_changed", world_size=ws, previous=self._last_world_size,
                         epoch=self._pg.epoch)
            self._last_world_size = ws

    def _broadcast_buffers(self) -> None:
        bufs = list(self.module.buffers())
        if bufs:
            self._broadcast_coalesced(bufs, 0)

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        pieces = [piece for dtype in sorted(by_dtype, key=str)   # the same order on every rank
                  for piece in broadcast_pieces(by_dtype[dtype], BROADCAST_BUCKET_NBYTES)]
        for ts in pieces:
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            if self.device.type == "cuda":
                _order_default_stream(self.device)   # after the cat that fills flat
            self._pg.broadcast(broadcastable(flat), src=src)
            if self.device.type == "cuda":
                _order_current_stream(self.device)
            off = 0
            with torch.no_grad():
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[off:off + n].view(t.shape))
                    off += n


def broadcast_pieces(tensors: list[torch.Tensor], cap_nbytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` (one dtype), in order, cut into consecutive runs of at most ``cap_nbytes``
    bytes together; a tensor larger than ``cap_nbytes`` is a run of its own. Every tensor is in
    exactly one run.

    Raises:
        ValueError: ``cap_nbytes`` is not positive (names it)."""
    if cap_nbytes <= 0:
        raise ValueError(f"cap_nbytes must be positive, got {cap_nbytes!r}")
    pieces: list[list[torch.Tensor]] = []
    nbytes = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if not pieces or nbytes + size > cap_nbytes:
            pieces.append([])
            nbytes = 0
        pieces[-1].append(t)
        nbytes += size
    return pieces


def _mark(t: torch.Tensor) -> tuple:
    """``t`` as it is now: a weak reference to it and its version counter (see :func:`_unchanged`)."""
    return weakref.ref(t), t._version


def _unchanged(mark: tuple | None, t: torch.Tensor | None) -> bool:
    """Whether ``t`` is the tensor ``mark`` was taken of, not modified in place since."""
    return mark is not None and t is not None and mark[0]() is t and t._version == mark[1]


def _tensors_in(out: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: itself, or inside tuples, lists and dicts (values)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors_in(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors_in(o)]
    return []


def _refuse_unsupported(module: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ``ConfigError`` for a trainable parameter of ``named`` whose gradient DDP cannot
    reduce: a dtype other than float32/float64/float16/bfloat16 (complex: names it), or the
    weight of an ``Embedding``/``EmbeddingBag`` with ``sparse=True`` (sparse gradients)."""
    for n, p in named:
        if p.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise ConfigError(f"DDP: parameter {n!r} has dtype {p.dtype}; DDP reduces float32, "
                              f"float64, float16 and bfloat16 gradients (hold a complex one as "
                              f"torch.view_as_real, or freeze it)")
    for mn, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True and isinstance(
                sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.weight.requires_grad:
            raise ConfigError(f"DDP: {mn or 'the module'} ({type(sub).__name__}) has "
                              f"sparse=True; DDP reduces dense gradients only: build it with "
                              f"sparse=False")


def _module_device(module: torch.nn.Module) -> torch.device:
    """The one device of ``module``'s parameters and buffers (the CPU for an empty module).

    Raises:
        ConfigError: several devices (names each with a parameter or buffer on it), or a device
            type other than ``cpu`` and ``cuda``.
    """
    where: dict[torch.device, str] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        where.setdefault(t.device, name)
    if len(where) > 1:
        listed = ", ".join(f"{d} ({n})" for d, n in sorted(where.items(), key=lambda kv: str(kv[0])))
        raise ConfigError(f"the module is on {len(where)} devices: {listed}; rtxnet DDP takes a "
                          "module whose parameters and buffers are all on the CPU or all on one "
                          "CUDA device (move it with module.to(device))")
    device = next(iter(where), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{where[device]} is on {device}; rtxnet DDP takes CPU or CUDA modules")
    return device


def _order_default_stream(device: torch.device) -> None:
    """Make ``device``'s default stream wait for the work queued so far on this thread's current
    stream.

    Autograd runs the gradient hooks, and so the copies into the buckets, on the stream that ran
    the forward (the current stream of the thread that called ``backward``), while the collective
    is built on rtxnet's event-loop thread, whose current stream is the default stream. The event
    makes that stream see the copies without blocking the host. Nothing to do when the two are the
    same stream (the usual case).
    """
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        default.wait_stream(current)


def _order_current_stream(device: torch.device) -> None:
    """The converse of :func:`_order_default_stream`, after a collective completed: this thread's
    current stream waits for the default stream, which rtxnet ordered after its writes."""
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        current.wait_stream(default)
