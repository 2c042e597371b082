"""Pipeline parallelism for PyTorch modules over an rtxnet process group's ``send``/``recv``.

Shapes legend: ``B`` batch, ``M`` micro-batches, ``b = B / M`` micro-batch size, ``S`` stages.

The model is cut into ``S`` consecutive parts; rank ``s`` of the group (``S`` ranks) holds part
``s`` in a :class:`PipelineStage`. A schedule splits the batch into ``M`` equal micro-batches along
dimension 0; stage ``s`` receives each micro-batch's activation from stage ``s-1``, runs its part
and sends the result to stage ``s+1``; the last stage computes the loss; gradients of the
activations travel back the same way. Two schedules:

- :class:`ScheduleGPipe` (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", NeurIPS 2019): all ``M`` forwards, then all ``M`` backwards. A stage holds
  the activations of all ``M`` micro-batches at once.
- :class:`Schedule1F1B` (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021, the PipeDream-Flush schedule; also Megatron-LM's default): stage ``s`` runs
  ``min(S-s-1, M)`` warm-up forwards, then alternates one forward and one backward, then drains
  the remaining backwards. The same bubble as GPipe, but a stage holds at most ``min(S-s, M)``
  micro-batches' activations.

Both leave, in every stage's parameters, the gradients one process would get by running the whole
model on the whole batch with the loss averaged over the micro-batches: each micro-batch's loss is
scaled by ``1/M`` before its backward. For a loss that is a mean over the batch (the default
``reduction="mean"``) and equal micro-batches, that is the whole batch's loss. Gradients are
accumulated into ``param.grad`` (zero them between steps, as with ``loss.backward()``), and the
optimizer step is the caller's. A parameter no gradient reaches keeps its ``.grad`` as it was
(``None`` after ``zero_grad()``), as in one process: a stage whose module detaches its input
(``x.detach()``, or an output not depending on it) sends no gradient back, and the stages before
it run no backward for that micro-batch (before, they ran one with a gradient of zeros, and
momentum, Adam or weight decay then moved parameters one process leaves alone; a tester's find),
except a replicated stage (below). The loss is returned on the last stage (``None`` elsewhere).
Every stage must run the same schedule class with the same ``n_microbatches``: a step whose stages
differ fails at once on every stage with ``ConfigError`` naming each stage's schedule and count
(before, a GPipe stage next to a 1F1B one waited for a message its neighbour would send only after
one it waited for, and every stage timed out naming a raw tag).

**Wire.** Activations are exchanged with a header, so no stage needs to know the shapes in advance
and they may change from step to step (e.g. sequence length): before each activation, stage ``s``
sends an int64 header ``[dtype code, requires_grad, ndim, d0, ..., d7, schedule, M]`` (at most 8
dimensions; dtypes in ``_DTYPES``; ``schedule`` 1 GPipe, 2 1F1B), and stage ``s+1`` checks the
schedule and ``M`` against its own before it computes anything. The gradient coming back has the
activation's shape and dtype, known to the stage that sent it, so it travels without a header; it
is sent only when the activation required a gradient (a stage that gets an input not requiring one
sends nothing back), and when no gradient reached that input an empty ``uint8`` tensor goes in its
place (a gradient is never ``uint8``): the stage receiving it skips that micro-batch's backward.
Tags encode ``(step, micro-batch, message kind)``, the step counting the schedule calls made on the
group object (by any stage built on it): every stage must call ``step`` the same number of times. A
message a failed step left behind is never taken for one of a later step. A stage that fails a step
with an error of its own (bad input or target, an exception from its module or the loss function:
anything but a peer loss or a timeout, which the others meet by themselves) tells its neighbours in
place of the message each waits for next: downstream an activation header with code ``-2`` and the
failing stage, upstream an empty ``bool`` tensor on the gradient's tag (a gradient is never
``bool``, so it cannot be mistaken for one). Each stage that gets such a message passes it on in
the same direction and raises ``ConfigError``: every stage fails the step at once, not at its
deadline. Every step ends with one all_reduce (MAX) of a few flags over the pipeline group (``S+2``
int64: the failing stage, a stale stage, each stage's schedule and ``M``), so a stage that had
finished its part when another failed (the last stage, when a stage before it fails in its
backward) raises ``ConfigError`` naming that stage too, and every stage of a step whose stages run
different schedules raises the same ``ConfigError`` naming them all: a step fails on every stage or
on none.

**Deadlines and failures.** Every ``send`` and ``recv`` carries a deadline (``timeout_s``, else
the group's ``Timeouts.op_s``). A lost peer raises :class:`~transport.errors.PeerLostError` and a
stage that waits too long :class:`~transport.errors.CollectiveTimeout` (``exc.ranks`` names the
stage it waited for); nothing hangs. Input checks run before anything is sent, on the rank that
sees the bad value (stage 0 checks the input, the last stage the target), and the other stages
then fail at once with ``ConfigError`` (see the wire above). After a failure the step's gradients are
partial: zero them before retrying. The number of stages is fixed at construction: a stage whose
group no longer has ``S`` ranks raises ``ConfigError`` at the next step (re-partition the model).
So is the stage index: after a membership change the world's ranks are renumbered while its size
may stay the same (a replacement took the lost rank's place), and a stage built on the world
before it is then stage ``s`` on a process that is rank ``r != s`` now. Its next step fails at
once with ``ConfigError`` on every stage, naming the stage and its rank (the stale stage tells the
ranks next to its new rank, and the closing all_reduce carries it to the rest): rebuild every
stage after a membership change, as stage ``pg.rank``. Before, such a stage sent to itself or to
the wrong stage, and the step failed 20 s later with ``ValueError: recv from self``, which
``FaultTolerance`` does not retry (a tester's find). A subgroup belongs to one epoch and keeps
its numbering: its collectives raise ``PeerLostError`` after a membership change instead.

**Replicated stages.** A stage whose module is a :class:`~rtxnet.parallel.DistributedDataParallel`
(data parallel across pipeline replicas, e.g. on a :class:`~rtxnet.parallel.DeviceMesh`) runs its
micro-batches under ``no_sync()`` and reduces the accumulated gradients once with
``sync_gradients()`` after the last backward: a DDP backward reduces one forward's gradients, and
the schedules run several forwards before their backwards. A replicated stage that gets no
gradient for a micro-batch (a later stage detached its input) still runs that backward, with a
gradient of zeros: DDP reduces only on the replicas a backward ran on, and another replica may
have got a gradient (skipped, the replicas that got one waited for the others until their
deadline, while the others returned). Its parameters then hold zeros where one process would
leave ``None`` if no replica got a gradient; the stages before it are told that none came.

**Devices.** CPU modules and tensors (the group's CPU send/recv). One tensor flows between stages:
the input of stage 0, each stage's output, and the target of the last stage are single tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import structlog
import torch

from rtxnet.collectives import ReduceOp
from rtxnet.config import is_seconds
from transport.errors import (
    CollectiveError,
    CollectiveMismatchError,
    ConfigError,
    ProtocolError,
    RtxError,
    RtxTimeoutError,
    TransportError,
)

from ..elastic import RECOVERABLE
from ._world import StepWorld, check_group, group_size, step_size
from .ddp import DistributedDataParallel

__all__ = ["PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "MAX_NDIM"]

log = structlog.get_logger(__name__)

MAX_NDIM = 8   # dimensions an activation may have (the header's fixed size)

# Header codes of the dtypes an activation may have; the order is the wire contract.
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

# Message kinds (low bits of the tag).
_FWD_HEADER, _FWD_DATA, _BWD_GRAD = 0, 1, 2
_ABORT = -2   # header dtype code: the stage named in header[1] failed the step (see _abort)
# header[2] of an abort: the process of rank header[1] holds stage header[3], built before a
# membership change renumbered the ranks (PipelineStage._abort_stale)
_STALE = 2
# header[2] of an abort: the stage failed of an error FaultTolerance answers by re-forming and
# redoing the step (a lost message's LinkBrokenError, a peer's abort): the others raise a
# CollectiveError too, so every stage redoes it (a re-verifier's find: a lost send made the
# others raise ConfigError, which ended the job)
_TRANSIENT = 3
# _abort_up's tensor dtype for such a failure (a gradient is never int8, nor uint8, nor bool)
_TRANSIENT_UP_DTYPE = torch.int8
_STALE_BASE = 1 << 31   # _agree's stale flag: (rank + 1) * _STALE_BASE + stage
_MAX_MICRO = 1 << 20
# An activation header: [dtype code, requires_grad, ndim, d0, ..., d7, rows, schedule kind, M],
# rows: the first stage's micro-batch's size (dimension 0 of its input), passed on by every stage
# so that the last one checks its target's against it
_HEADER_LEN = 6 + MAX_NDIM
# Schedule kinds on the wire (PipelineSchedule._KIND): a stage checks its neighbour's
_KIND_NAMES = {0: "a PipelineSchedule subclass", 1: "ScheduleGPipe", 2: "Schedule1F1B"}
# Sent on a gradient's tag in place of the gradient: no gradient reached this micro-batch's input
# on the next stage (it detached it), so the stage runs no backward for it (a gradient is never
# uint8, nor is an abort: that is an empty bool tensor)
_NO_GRAD_DTYPE = torch.uint8


def _header() -> torch.Tensor:
    return torch.full((_HEADER_LEN,), -1, dtype=torch.int64)


def _plan_name(kind: int, M: int) -> str:
    return f"{_KIND_NAMES.get(kind, f'schedule kind {kind}')} with n_microbatches({M})"


def _tag(step: int, micro: int, kind: int) -> int:
    return ((step % (1 << 36)) * _MAX_MICRO + micro) * 4 + kind


def _flat_rows(y: torch.Tensor) -> set[int]:
    """The row counts of ``y`` with its leading dimensions flattened: ``{b, b*T, b*T*V}`` for
    ``[b, T, V]`` (none for a 0-d ``y``)."""
    rows, n = set(), 1
    for d in y.shape:
        n *= d
        rows.add(n)
    return rows


class PipelineStage:
    """This rank's part of a model cut into ``S`` consecutive stages; stage ``s`` = rank ``s`` of
    ``pg``.

    Args:
        module: the part: takes one tensor (the previous stage's output, or the model input on
            stage 0) and returns one tensor. CPU parameters.
        pg: the pipeline group: a :class:`rtxnet.BlockingProcessGroup` or a subgroup from its
            ``new_group`` (stage ``s`` is the subgroup's rank ``s``).
        num_stages: the number of parts the model was cut into; checked against the group size
            (``None``: the group size).

    Raises:
        ConfigError: ``module`` is not a ``torch.nn.Module``; ``num_stages`` differs from the
            group size (names both).

    Attributes:
        module, stage_index, num_stages, is_first, is_last.
    """

    def __init__(self, module: torch.nn.Module, pg: Any, *, num_stages: int | None = None):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_group(pg, "PipelineStage")
        size = group_size(pg)
        if num_stages is not None and (isinstance(num_stages, bool) or num_stages != size):
            raise ConfigError(f"num_stages({num_stages!r}) != pipeline group size({size}): "
                              "stage s runs on rank s of the group, one stage per rank")
        self.module = module
        self._pg = pg
        self.num_stages = size
        self.stage_index = int(pg.rank)
        self.is_first = self.stage_index == 0
        self.is_last = self.stage_index == size - 1
        # each rank holds its own stage: FaultTolerance without sharded_state would hand one
        # rank's state to another after a failure, so it refuses a process holding one
        from rtxnet.elastic import note_rank_specific

        note_rank_specific(self, pg, "pipeline stage")

    def _next_step_no(self) -> int:
        """The number of this step in the tags: pipeline steps run on this group object in its
        current epoch, by any stage object. A new PipelineStage on the same group goes on
        counting, so a message an earlier one's failed step left behind is never taken for one of
        its own; a new epoch (a rank lost or added: its replacement counts from 0) starts again at
        0, and the old epoch's messages are dropped anyway."""
        counts = vars(self._pg)
        epoch = getattr(self._pg, "epoch", None)
        seen, n = counts.get("_rtxnet_pipeline_steps", (epoch, 0))
        if seen != epoch:
            n = 0
        counts["_rtxnet_pipeline_steps"] = (epoch, n + 1)
        return n

    def parameters(self):
        return self.module.parameters()

    def check_world(self) -> None:
        """Raises ``ConfigError`` when the group (inside a step that pinned its world, that
        world: a loss during the step fails it with ``PeerLostError`` instead, which
        ``FaultTolerance`` recovers from) no longer has ``num_stages`` ranks. (A group
        of the same size whose ranks were renumbered fails the step on every stage instead:
        see the module notes.)"""
        now = step_size(self._pg)
        if now != self.num_stages:
            raise ConfigError(f"pipeline built for {self.num_stages} stages; its group now has "
                              f"{now} ranks: re-partition the model")

    # -- wire --------------------------------------------------------------------------------

    def _send_activation(self, y: torch.Tensor, step: int, m: int, timeout_s: float | None,
                         plan: tuple[int, int], rows: int) -> None:
        if not isinstance(y, torch.Tensor):
            raise ConfigError(f"stage {self.stage_index} returned {type(y).__name__}; a pipeline "
                              "stage returns one tensor")
        if y.dtype not in _CODE or y.dim() > MAX_NDIM:
            raise ConfigError(f"stage {self.stage_index} output dtype({y.dtype}) / ndim({y.dim()}): "
                              f"the pipeline carries {len(_DTYPES)} dtypes ({_DTYPES}) and at most "
                              f"{MAX_NDIM} dimensions")
        header = _header()
        header[0], header[1], header[2] = _CODE[y.dtype], int(y.requires_grad), y.dim()
        header[3:3 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
        header[-3] = rows
        header[-2], header[-1] = plan
        dst = self.stage_index + 1
        kw = _kw(timeout_s)
        self._pg.send(header, dst, _tag(step, m, _FWD_HEADER), **kw)
        self._pg.send(y.detach().contiguous(), dst, _tag(step, m, _FWD_DATA), **kw)

    def _abort_down(self, step: int, m: int, origin: int, *, refused_input: bool = False,
                    transient: bool = False) -> None:
        """Tell the next stage, waiting for micro-batch ``m``'s activation, that stage ``origin``
        failed this step (``transient``: of an error the step's retry answers; best effort: the
        caller raises its own error whatever happens)."""
        if self.is_last:
            return
        header = _header()
        header[0], header[1] = _ABORT, origin
        header[2] = _TRANSIENT if transient else int(refused_input)
        self._best_effort(self.stage_index + 1, header, _tag(step, m, _FWD_HEADER))

    def _abort_up(self, step: int, m: int, *, transient: bool = False) -> None:
        """Tell the previous stage, waiting for micro-batch ``m``'s gradient, that a later stage
        failed this step: an empty bool tensor on the gradient's tag, int8 when ``transient``
        (best effort)."""
        if self.is_first:
            return
        self._best_effort(self.stage_index - 1,
                          torch.zeros(0, dtype=_TRANSIENT_UP_DTYPE if transient else torch.bool),
                          _tag(step, m, _BWD_GRAD))

    def _rank_in(self, world: StepWorld) -> int:
        """This process's rank in the step's group now (the world group the step began in, or
        the subgroup), which a membership change may have moved away from ``stage_index``."""
        return int(world.world.rank if world.world is not None else self._pg.rank)

    def _abort_stale(self, step: int, rank: int) -> None:
        """This stage was built as stage ``stage_index`` but its process is rank ``rank`` now:
        tell the ranks next to ``rank`` (not to the stage's index: that may be this very rank),
        in place of what each waits for first from it, so that they fail the step at once and
        meet this stage in the closing agreement (best effort)."""
        size = group_size(self._pg)
        if rank + 1 < size:
            header = _header()
            header[0], header[1], header[2], header[3] = _ABORT, rank, _STALE, self.stage_index
            self._best_effort(rank + 1, header, _tag(step, 0, _FWD_HEADER))
        if rank > 0:
            self._best_effort(rank - 1, torch.zeros(0, dtype=torch.bool), _tag(step, 0, _BWD_GRAD))

    def _best_effort(self, dst: int, t: torch.Tensor, tag: int) -> None:
        try:
            self._pg.send(t, dst, tag, timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the caller raises the step's error itself
            log.warning("pipeline_abort_not_sent", stage=self.stage_index, to=dst, error=str(exc))

    def _recv_activation(self, step: int, m: int, timeout_s: float | None,
                         plan: tuple[int, int]) -> tuple[torch.Tensor, int]:
        """Micro-batch ``m``'s activation from the previous stage, and the size of the first
        stage's micro-batch it came from. Raises ``ConfigError`` when that stage runs another
        schedule or another number of micro-batches (``plan``: this stage's ``(kind, M)``), or
        told that an earlier stage failed the step."""
        src = self.stage_index - 1
        kw = _kw(timeout_s)
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        self._pg.recv(header, src, _tag(step, m, _FWD_HEADER), **kw)
        code, needs_grad, ndim = (int(v) for v in header[:3])
        if code == _ABORT and int(header[2]) == _STALE:
            # rank header[1] holds a stage built for an older numbering: pass it on as it came
            if not self.is_last:
                self._best_effort(self.stage_index + 1, header, _tag(step, m, _FWD_HEADER))
            exc = _stale(int(header[3]), int(header[1]), here=self.stage_index)
            exc.pipeline_abort_passed_on = True
            raise exc
        if code == _ABORT:
            # an earlier stage failed the step: pass it on, fail now instead of at the deadline
            origin, refused_input = int(header[1]), int(header[2]) == 1
            transient = int(header[2]) == _TRANSIENT
            self._abort_down(step, m, origin, refused_input=refused_input, transient=transient)
            what = ("refused the input of this step (its ConfigError names the value)"
                    if refused_input else "failed this step (its own error says why)")
            done = "did not run it" if m == 0 else "did not finish it"
            raise _aborted(f"stage {origin} {what}; stage {self.stage_index} {done}", transient=transient)
        if not (0 <= code < len(_DTYPES) and 0 <= ndim <= MAX_NDIM):
            raise ProtocolError(f"stage {self.stage_index}: malformed activation header "
                              f"{header.tolist()} from stage {src}")
        theirs = (int(header[-2]), int(header[-1]))
        if theirs != tuple(plan):
            # the two would wait for each other's messages until the deadline (a GPipe stage
            # next to a 1F1B one), or split the batch differently: refuse before computing
            raise ConfigError(f"stage {src} runs {_plan_name(*theirs)}, stage {self.stage_index} "
                              f"{_plan_name(*plan)}: every stage must run the same schedule "
                              f"with the same n_microbatches")
        x = torch.empty(header[3:3 + ndim].tolist(), dtype=_DTYPES[code])
        self._pg.recv(x, src, _tag(step, m, _FWD_DATA), **kw)
        return x.requires_grad_(bool(needs_grad)), int(header[-3])

    def _send_grad(self, g: torch.Tensor | None, step: int, m: int,
                   timeout_s: float | None) -> None:
        """Send the gradient of micro-batch ``m``'s input back; ``None``: none reached it (the
        module detached it), said with an empty uint8 tensor instead of a gradient of zeros."""
        g = torch.zeros(0, dtype=_NO_GRAD_DTYPE) if g is None else g.contiguous()
        self._pg.send(g, self.stage_index - 1, _tag(step, m, _BWD_GRAD), **_kw(timeout_s))

    def _recv_grad(self, like: torch.Tensor, step: int, m: int,
                   timeout_s: float | None) -> torch.Tensor | None:
        """The gradient of micro-batch ``m``'s output (``like``), or ``None`` when none reached
        the next stage's input (see ``_send_grad``)."""
        g = torch.empty(like.shape, dtype=like.dtype)
        try:
            self._pg.recv(g, self.stage_index + 1, _tag(step, m, _BWD_GRAD), **_kw(timeout_s))
        except CollectiveMismatchError as exc:
            sent = set(exc.values.values()) if exc.field == "dtype" else set()
            if "uint8" in sent:     # _NO_GRAD_DTYPE: the expected gradient is never uint8
                return None
            transient = "int8" in sent
            if "bool" not in sent and not transient:
                raise
            # a later stage failed the step (see _abort_up): pass it on, fail now
            self._abort_up(step, m, transient=transient)
            raise _aborted(f"a later stage (after stage {self.stage_index}) failed this step (its "
                           f"own error says why); stage {self.stage_index} did not finish it",
                           transient=transient) from None
        return g


def _aborted(message: str, *, transient: bool = False) -> ConfigError | CollectiveError:
    """The error of a stage told that another stage failed the step (it passed it on already):
    ``ConfigError``, or ``CollectiveError`` when that stage's error is one the step's retry answers
    (``transient``: :class:`rtxnet.FaultTolerance` then redoes the step on every stage)."""
    exc = CollectiveError(message) if transient else ConfigError(message)
    exc.pipeline_abort_passed_on = True
    return exc


def _mismatch(plans: list[tuple[int, int]]) -> ConfigError:
    """The error of a step whose stages run different schedules or numbers of micro-batches
    (``plans[s]``: stage ``s``'s ``(kind, M)``), the same on every stage."""
    groups: dict[tuple[int, int], list[int]] = {}
    for s, plan in enumerate(plans):
        groups.setdefault(plan, []).append(s)
    parts = [f"stage{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))} {_plan_name(*plan)}"
             for plan, ss in groups.items()]
    return ConfigError(f"pipeline stages run different schedules: {'; '.join(parts)}; every stage "
                       f"must run the same schedule with the same n_microbatches (this step failed "
                       f"on every stage)")


def _stale(stage: int, rank: int, *, here: int | None = None) -> ConfigError:
    """The error of a step run with a stage built before a membership change renumbered the
    ranks (``stage`` runs on rank ``rank`` now); ``here``: the stage that raises it, when it is
    another one. Attributes ``stage_index`` and ``rank`` name the stale stage."""
    where = "" if here is None or here == stage else f" (stage {here} fails this step too)"
    exc = ConfigError(
        f"pipeline stage {stage} runs on rank {rank} of its group: it was built before a "
        f"membership change renumbered the ranks (stage s must run on rank s){where}; rebuild "
        f"every PipelineStage and its schedule after a membership change, as stage pg.rank "
        f"(e.g. in FaultTolerance's on_world)")
    exc.stage_index, exc.rank = stage, rank
    return exc


def _kw(timeout_s: float | None) -> dict[str, float]:
    return {} if timeout_s is None else {"timeout": timeout_s}


class PipelineSchedule:
    """What both schedules share: micro-batching, one forward, one backward, the loss.

    Args:
        stage: this rank's :class:`PipelineStage`.
        n_microbatches: ``M >= 1``; may be smaller than the number of stages (more bubble).
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` of one micro-batch, used on the last
            stage (e.g. ``torch.nn.functional.cross_entropy``); a mean over the micro-batch gives
            the one-process result (module notes).
        timeout_s: deadline in seconds of each send and recv; ``None`` uses the group's.

    Raises:
        ConfigError: ``n_microbatches`` not an int in ``1 .. 2**20``, ``loss_fn`` not callable, a bad
            ``timeout_s``; names the value.

    Attributes:
        trace: after a step, this stage's operations in order, ``"F3"`` the forward and ``"B3"``
            the backward of micro-batch 3.
        peak_in_flight: after a step, the most micro-batches whose activations this stage held at
            once (``M`` for GPipe, ``min(S - s, M)`` for 1F1B).
        last_output: on the last stage after a step, its outputs of every micro-batch concatenated
            along dimension 0, detached (``[B, ...]``; ``[M]`` when it returns a 0-d tensor per
            micro-batch, its own loss; the list of the ``M`` outputs when their dimensions
            after the first differ); None elsewhere.

    Every stage of a pipeline must run the same schedule class with the same ``n_microbatches``;
    a step whose stages differ is refused on every stage (see :meth:`step`).
    """

    _KIND = 0   # on the wire: neighbouring stages check they run the same schedule (_KIND_NAMES)

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 timeout_s: float | None = None):
        if not isinstance(stage, PipelineStage):
            raise ConfigError(f"stage must be a PipelineStage, got {type(stage).__name__}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or not 1 <= n_microbatches <= _MAX_MICRO:
            raise ConfigError(f"n_microbatches({n_microbatches!r}) must be an int in 1..{_MAX_MICRO}")
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn({loss_fn!r}) must be callable")
        if timeout_s is not None and not is_seconds(timeout_s):
            raise ConfigError(f"timeout_s({timeout_s!r}) must be a positive number of seconds")
        self.stage = stage
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        self.trace: list[str] = []
        self.peak_in_flight = 0
        self.last_output: torch.Tensor | None = None
        # State of the step under way: micro-batch -> (input, output or loss) held for backward.
        self._held: dict[int, tuple[Any, Any]] = {}
        self._losses: list[torch.Tensor] = []
        self._outputs: list[torch.Tensor] = []
        self._xs: list[Any] = []
        self._ts: list[Any] = []
        self._step_no = 0

    def step(self, input: torch.Tensor | None = None, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run forward and backward of one batch through the pipeline.

        Call it on every stage, the same number of times.

        Args:
            input: stage 0: the batch ``[B, ...]``, ``B > 0`` divisible by ``M``; ignored
                elsewhere.
            target: last stage: ``[B, ...]`` (the input's ``B``), or with as many rows as the
                output's leading dimensions flattened (``[B*T]`` for ``[b*T, V]`` logits of a
                ``[B, T]`` input, as ``cross_entropy`` takes it); split like the input into
                ``M``; ignored elsewhere.

        Returns:
            On the last stage, the loss averaged over the micro-batches (a detached 0-d tensor);
            None on the others. ``param.grad`` of this stage's parameters is accumulated in place
            (left as it is where no gradient reaches them, as in one process; a replicated stage
            gets zeros there, see the module notes).

        Raises:
            ConfigError: a missing input (stage 0) or target (last stage), an empty batch
                (``B == 0``; raised on the stage given it, the others told as for any refused
                input), a batch not divisible by ``M`` (names both), a target of neither the
                input's batch size nor the output's rows (on the last stage; names both), stages running different
                schedule classes or ``n_microbatches`` (on every stage, at once; names each
                stage's), a stage output that is not one tensor of a carried dtype,
                a group whose size changed, a stage (this one or another) built before a
                membership change renumbered the ranks (on every stage, at once; names that
                stage and its rank, ``exc.stage_index`` and ``exc.rank``), or another stage failed
                the step with an error of its own (names that stage, or says it was a later one;
                raised at once, not at the deadline).
            Exception: whatever this stage's module or ``loss_fn`` raised (every other stage
                raises ``ConfigError`` naming this stage, at once).
            PeerLostError: a stage was lost during the step.
            CollectiveTimeout: a stage did not send in time (``exc.ranks`` names it).
            CollectiveMismatchError: a message of the wrong shape or dtype arrived.
            ProtocolError: a malformed activation header arrived.
            CollectiveError: a send was not flushed within the deadline, or another stage
                failed the step of an error :class:`rtxnet.FaultTolerance` answers by redoing
                the step (a lost message's ``LinkBrokenError``, raised there), so that every
                stage redoes it.
        """
        st = self.stage
        # Counted before any check: a step that fails on one stage still counts on all of them,
        # so their tags stay aligned for the next step.
        step_no = st._next_step_no()
        st.check_world()
        world = StepWorld(st._pg)      # every send/recv of the step in the world it began in
        world.begin()
        rank = st._rank_in(world)
        M = self.n_microbatches
        # a refused input or target is this stage's failure of the step like any other: the
        # neighbours are told (below) and every stage takes part in the closing agreement
        failure: Exception | None = None
        xs, ts = [], []
        try:
            if rank != st.stage_index:
                raise _stale(st.stage_index, rank)
            if not torch.is_grad_enabled():
                # forward and backward: under no_grad the last stage's backward failed with
                # torch's "element 0 of tensors does not require grad" (a tester's find)
                raise ConfigError(f"{type(self).__name__}.step() trains (each micro-batch's forward "
                                  f"and backward): it cannot run under torch.no_grad() or "
                                  f"torch.inference_mode(); evaluate by running each stage's module "
                                  f"forward yourself, sending activations with pg.send/recv")
            xs = self._split("input", input, M) if st.is_first else [None] * M
            ts = self._split("target", target, M) if st.is_last else [None] * M
        except ConfigError as exc:
            failure = exc
        self.trace = []
        self.peak_in_flight = 0
        self._held = {}
        self._losses = []
        self._outputs = []
        self._xs, self._ts, self._step_no = xs, ts, step_no
        if rank != st.stage_index:
            with world.pinned():
                st._abort_stale(step_no, rank)
        elif failure is not None:
            self._abort_neighbours(failure, refused_input=True)
        # A stage replicated by DistributedDataParallel: its micro-batches' gradients accumulate
        # locally and are reduced once, after the last backward (a DDP backward synchronises only
        # one forward's gradient; the others' would stay on each replica)
        ddp = st.module if isinstance(st.module, DistributedDataParallel) else None
        interrupted: BaseException | None = None
        try:
            with world.pinned():
                if failure is None:
                    try:
                        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
                            self._run(M)
                    except Exception as exc:
                        failure = exc
                        self._abort_neighbours(exc)
                    except BaseException as exc:
                        # KeyboardInterrupt (Ctrl-C on this rank alone), SystemExit in a module:
                        # the other stages are told and the step ends on every stage, then it is
                        # raised here (a breaker's find: they waited out their timeout, and this
                        # stage's next step timed out too)
                        interrupted = exc
                        failure = RtxError(f"stage {st.stage_index} was interrupted "
                                           f"({type(exc).__name__})")
                        self._abort_neighbours(failure)
                if failure is None and ddp is not None:
                    try:
                        ddp.sync_gradients()
                    except Exception as exc:
                        failure = exc
                try:
                    self._agree(failure, rank)
                except Exception:
                    if interrupted is not None:
                        raise interrupted from None
                    raise
        except BaseException as exc:
            log.warning("pipeline_step_failed", stage=st.stage_index, step=step_no,
                        error=type(exc).__name__, detail=str(exc))
            raise
        finally:
            self._held = {}
            self._xs = self._ts = []
        if not st.is_last:
            self.last_output = None
            return None
        # a 0-d output (a last stage computing its own loss) is one element per micro-batch: it
        # failed torch.cat on this stage alone, after every stage had finished the step; so did
        # outputs whose other dimensions differ (sequences of another length per micro-batch):
        # kept as the list of them
        outs = [o.reshape(1) if o.dim() == 0 else o for o in self._outputs]
        same = len({o.shape[1:] for o in outs}) == 1
        self.last_output = torch.cat(outs) if same else outs
        self._outputs = []
        return torch.stack(self._losses).sum()

    def _run(self, M: int) -> None:
        raise NotImplementedError

    def _agree(self, failure: Exception | None, rank: int) -> None:
        """End the step with the same outcome on every stage: one all_reduce (MAX) of flags
        over the pipeline group, so a stage that finished its part (the last stage, when a stage
        before it fails in its backward) learns that the step failed elsewhere, and every stage
        learns of a stage built before the ranks were renumbered (``rank`` is this process's rank
        in the step's group) and of every stage's schedule and ``M``. Raises, when no stage is
        stale and the stages' schedules or ``M`` differ, the same ``ConfigError`` naming them on
        every stage (the stage that saw it in a header failed the step at once, and told the
        others); else ``failure`` when there is one of this stage's own;
        ``ConfigError`` naming the stale stage and its rank when there is one; else ``failure``
        (an abort passed on), or ``ConfigError`` naming the failing stage when only another stage
        failed. A lost peer or a timeout is raised at once: the group cannot agree, and every
        stage meets it by itself."""
        if isinstance(failure, TransportError | RtxTimeoutError):
            raise failure
        st = self.stage
        stale = rank != st.stage_index
        own = failure is not None and not getattr(failure, "pipeline_abort_passed_on", False)
        # [failing stage + 1, the stale stage's (rank + 1) * 2**31 + stage, then one slot per
        # rank: its schedule kind * (2**20 + 1) + M]: MAX keeps one stale stage's pair whole
        flag = torch.zeros(2 + st.num_stages, dtype=torch.int64)
        # (a failure the step's retry does not answer counts above any that it does: MAX keeps it)
        flag[0] = (st.stage_index + 1 + (0 if isinstance(failure, RECOVERABLE) else _STALE_BASE)
                   if own and not stale else 0)
        flag[1] = (rank + 1) * _STALE_BASE + st.stage_index if stale else 0
        kind, M = self._plan()
        if 0 <= rank < st.num_stages:
            flag[2 + rank] = kind * (_MAX_MICRO + 1) + M
        try:
            st._pg.all_reduce(flag, op=ReduceOp.MAX, **_kw(self.timeout_s))
        except Exception:
            if failure is not None:
                raise failure from None
            raise
        plans = [divmod(int(c), _MAX_MICRO + 1) for c in flag[2:]]
        if len(set(plans)) > 1 and int(flag[1]) == 0:
            raise _mismatch(plans) from failure
        if own:
            raise failure
        if int(flag[1]) > 0:
            r, s = divmod(int(flag[1]), _STALE_BASE)
            raise _stale(s, r - 1, here=st.stage_index) from failure
        if failure is not None:
            raise failure
        if int(flag[0]) > 0:
            lasting, origin = divmod(int(flag[0]), _STALE_BASE)
            raise _aborted(f"stage {origin - 1} failed this step (its own error says why); "
                           f"stage {st.stage_index} finished its part, but the step failed",
                           transient=not lasting)

    def _abort_neighbours(self, exc: Exception, *, refused_input: bool = False) -> None:
        """This stage failed the step with ``exc``: tell both neighbours, in place of the messages
        they wait for next (the next stage: the activation of the first micro-batch not sent; the
        previous: the gradient of the first micro-batch whose backward did not finish here). Not
        for a lost peer or a timeout, which the others meet by themselves, nor for an abort this
        stage received and passed on. ``refused_input``: it refused its input or target (stage 0's
        refusal is named so downstream)."""
        if getattr(exc, "pipeline_abort_passed_on", False) or isinstance(
                exc, TransportError | RtxTimeoutError):
            return
        st = self.stage
        forwards = sum(t.startswith("F") for t in self.trace)
        backwards = len(self.trace) - forwards
        transient = isinstance(exc, RECOVERABLE)
        st._abort_down(self._step_no, forwards, st.stage_index, refused_input=refused_input,
                       transient=transient)
        st._abort_up(self._step_no, backwards, transient=transient)

    def _split(self, what: str, t: torch.Tensor | None, M: int) -> list[torch.Tensor]:
        s = self.stage.stage_index
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"stage {s} needs the {what} tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] % M:
            B = t.shape[0] if t.dim() else "0-d"
            raise ConfigError(f"{what} batch({B}) is not divisible by n_microbatches({M})")
        if t.shape[0] == 0:
            raise ConfigError(f"{what} batch(0) is empty: a step needs at least one sample per "
                              f"micro-batch, a multiple of n_microbatches({M})")
        return list(t.split(t.shape[0] // M))

    def _plan(self) -> tuple[int, int]:
        """This stage's ``(schedule kind, M)``, which its neighbours check in each header."""
        return type(self)._KIND, self.n_microbatches

    def _forward(self, m: int) -> None:
        st, kw = self.stage, self.timeout_s
        if st.is_first:
            x, rows = self._xs[m], len(self._xs[m])
        else:
            x, rows = st._recv_activation(self._step_no, m, kw, self._plan())
        y = st.module(x)
        if st.is_last:
            if not isinstance(y, torch.Tensor):
                raise ConfigError(f"stage {st.stage_index} returned {type(y).__name__}; a "
                                  "pipeline stage returns one tensor")
            t_rows = len(self._ts[m])
            if t_rows != rows and t_rows not in _flat_rows(y):
                # split by M like the input but of another batch size: the loss broadcast the
                # two (mse_loss of [2, 3] against [1, 3]) and the step returned a wrong loss and
                # gradients with torch's warning alone (a breaker's find); a target with the
                # output's rows flattened ([b*T] for a [b*T, V] or [b, T, V] output of a [b, T]
                # input, as cross_entropy takes it) is split right and was trained before
                raise ConfigError(f"target has {t_rows * self.n_microbatches} rows, the input "
                                  f"{rows * self.n_microbatches}: the last stage's target must "
                                  f"be [B, ...] with the first stage's batch size B, or have "
                                  f"as many rows as its output's leading dimensions flattened")
            self._outputs.append(y.detach())
            loss = self.loss_fn(y, self._ts[m])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ConfigError(f"loss_fn returned {what}; it must return one number per "
                                  f"micro-batch (a scalar tensor: reduction='mean' or 'sum')")
            loss = loss / self.n_microbatches
            self._losses.append(loss.detach())
            self._held[m] = (x, loss)
        else:
            st._send_activation(y, self._step_no, m, kw, self._plan(), rows)
            self._held[m] = (x, y)
        self.peak_in_flight = max(self.peak_in_flight, len(self._held))
        self.trace.append(f"F{m}")

    def _backward(self, m: int) -> None:
        st, kw = self.stage, self.timeout_s
        x, y = self._held.pop(m)
        absent = False
        if st.is_last:
            y.backward()
        elif y.requires_grad:
            g = st._recv_grad(y, self._step_no, m, kw)
            # None: no gradient reached the next stage's input (it detached it): as in one
            # process, nothing flows back through this stage, its .grad stay as they are ...
            absent = g is None
            if absent and isinstance(st.module, DistributedDataParallel):
                # ... except on a replicated stage: another replica may have got a gradient,
                # and DDP reduces only on the replicas a backward ran on (see module notes)
                g = torch.zeros_like(y)
            if g is not None:
                torch.autograd.backward(y, g)
        if not st.is_first and x.requires_grad:
            # None: this stage's output did not depend on its input, or got no gradient
            st._send_grad(None if absent else x.grad, self._step_no, m, kw)
        self.trace.append(f"B{m}")


class ScheduleGPipe(PipelineSchedule):
    """GPipe: the forwards of all ``M`` micro-batches, then their backwards, in order.

    Arguments, returns and errors as :class:`PipelineSchedule`. Holds ``M`` micro-batches'
    activations at once.
    """

    _KIND = 1

    def _run(self, M: int) -> None:
        for m in range(M):
            self._forward(m)
        for m in range(M):
            self._backward(m)


class Schedule1F1B(PipelineSchedule):
    """1F1B (PipeDream-Flush): ``min(S-s-1, M)`` warm-up forwards on stage ``s``, then one forward
    and one backward in turn, then the remaining backwards.

    Arguments, returns and errors as :class:`PipelineSchedule`. Holds at most ``min(S-s, M)``
    micro-batches' activations. Sends do not wait for the receiver (the group queues them), so the
    order cannot deadlock.
    """

    _KIND = 2

    def _run(self, M: int) -> None:
        st = self.stage
        warmup = min(st.num_stages - st.stage_index - 1, M)
        for m in range(warmup):
            self._forward(m)
        for m in range(M - warmup):
            self._forward(m + warmup)
            self._backward(m)
        for m in range(M - warmup, M):
            self._backward(m)
