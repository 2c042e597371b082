"""A rank of the tensor- and pipeline-parallel tests, run under ``python -m rtxnet.launcher``.

    mp_worker.py OUT_DIR          (4 ranks, --min-ranks 3: rank 3 dies at the end)

One launch serves both test files (``mp_launch.py``): starting 4 ranks (Python, torch) costs far
more than the scenarios. Every rank builds the whole model from the same seed and computes the
single-process reference itself, so the launch checks equivalence without a second process. Each
scenario runs on the world (4 ranks) and on two pairs from ``new_group`` (2 ranks each, ranks
{0, 1} and {2, 3}). Each rank writes ``OUT_DIR/mp-rank<r>.json`` (``r`` the rank as launched):
``{"tp": {...}, "pp": {...}}`` with the measured relative differences, schedule traces and error
messages.

Parts, in this order:
    tp   column-then-row MLP (``shard_mlp``), a column layer with and without ``gather_output``,
         a row layer taking the full input, layers built from sizes under a seed, bad sizes.
    dpxtp  a (2, 2) ``DeviceMesh`` ("dp", "tp"): the MLP 2-way tensor parallel inside each
         replica, DDP across the 2 replicas, 3 SGD steps against one process on the global batch;
         the mesh's groups and coordinates; bad shapes and names.
    pp   GPipe and 1F1B for several micro-batch counts (fewer than the stages included), a
         second step after an optimizer update, bad arguments, stages failing a step (a refused
         input or target, an empty batch, a module raising), a stage detaching its input, stages
         running different schedules, a peer that never sends (CollectiveTimeout), and last
         rank 3 dying while rank 2 waits for it (PeerLostError; launch with --min-ranks 3).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import rtxnet
from rtxnet.parallel import (
    ColumnParallelLinear,
    DeviceMesh,
    DistributedDataParallel,
    FullyShardedDataParallel,
    PipelineStage,
    RowParallelLinear,
    Schedule1F1B,
    ScheduleGPipe,
    clip_grad_norm_,
    shard_mlp,
)

D_IN, D_H, D_OUT = 6, 8, 5
LOSS = torch.nn.functional.cross_entropy


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element-wise difference relative to the reference's largest magnitude (max-norm
    relative error). Element-wise ratios are meaningless for elements near zero: a sum of
    products of O(1) terms summed in another order differs by ~1e-8 absolute wherever it lands."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def data(shape, n_classes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, n_classes, shape[:-1], generator=g)
    return x, y


def error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 - the test asserts on the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# -- tensor parallel ----------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, D_H)
        self.fc2 = torch.nn.Linear(D_H, D_OUT)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _aliased(m: MLP) -> MLP:
    """``m`` with its fc1 under a second name too."""
    m.alias = m.fc1
    return m


def tp_case(pg, tag: str) -> dict:
    W, r = tp_size(pg), pg.rank
    res: dict = {}
    x, y = data((3, 4, D_IN), D_OUT, seed=10)        # batch dims [3, 4]: any leading shape

    # Column-then-row MLP against the unsharded module.
    torch.manual_seed(1)
    ref = MLP()
    net = shard_mlp(copy.deepcopy(ref), pg, up="fc1", down="fc2")
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(xr), net(xt)
    loss_ref = LOSS(out_ref.reshape(-1, D_OUT), y.reshape(-1))
    loss = LOSS(out.reshape(-1, D_OUT), y.reshape(-1))
    loss_ref.backward()
    loss.backward()
    h = D_H // W
    rows, cols = slice(r * h, (r + 1) * h), slice(r * h, (r + 1) * h)
    res["mlp"] = {
        "types": [type(net.fc1).__name__, type(net.fc2).__name__],
        "out": rel(out, out_ref), "loss": rel(loss, loss_ref), "x_grad": rel(xt.grad, xr.grad),
        "fc1.weight": rel(net.fc1.weight.grad, ref.fc1.weight.grad[rows]),
        "fc1.bias": rel(net.fc1.bias.grad, ref.fc1.bias.grad[rows]),
        "fc2.weight": rel(net.fc2.weight.grad, ref.fc2.weight.grad[:, cols]),
        "fc2.bias": rel(net.fc2.bias.grad, ref.fc2.bias.grad),
        "shapes": [list(net.fc1.weight.shape), list(net.fc2.weight.shape)],
    }

    # A column layer alone, output gathered or left split; a row layer taking the full input.
    torch.manual_seed(2)
    full = torch.nn.Linear(D_IN, D_H)
    row_full = torch.nn.Linear(D_H, D_OUT)
    for gather in (True, False):
        col = ColumnParallelLinear.from_linear(full, pg, gather_output=gather)
        full.zero_grad()
        xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        o_ref, o = full(xr), col(xt)
        w = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(3))
        (o_ref * w).sum().backward()
        if gather:
            (o * w).sum().backward()
            d_out = rel(o, o_ref)
        else:   # each rank holds its slice of the output: its part of the same objective
            (o * w[..., rows]).sum().backward()
            d_out = rel(o, o_ref[..., rows])
        res[f"column_gather_{gather}"] = {
            "out": d_out, "x_grad": rel(xt.grad, xr.grad), "shape": list(o.shape),
            "weight": rel(col.weight.grad, full.weight.grad[rows]),
            "bias": rel(col.bias.grad, full.bias.grad[rows])}
    row = RowParallelLinear.from_linear(row_full, pg, input_is_parallel=False)
    xh = torch.randn(3, 4, D_H, generator=torch.Generator().manual_seed(4))
    xr, xt = xh.clone().requires_grad_(), xh.clone().requires_grad_()
    o_ref, o = row_full(xr), row(xt)
    w = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(5))
    (o_ref * w).sum().backward()
    (o * w).sum().backward()
    res["row_full_input"] = {"out": rel(o, o_ref), "x_grad": rel(xt.grad, xr.grad),
                             "weight": rel(row.weight.grad, row_full.weight.grad[:, cols]),
                             "bias": rel(row.bias.grad, row_full.bias.grad)}

    # Built from sizes: the same slices a seeded nn.Linear has in one process.
    torch.manual_seed(7)
    c = ColumnParallelLinear(D_IN, D_H, pg, gather_output=False)
    rw = RowParallelLinear(D_H, D_OUT, pg, input_is_parallel=True)
    torch.manual_seed(7)
    c_ref, r_ref = torch.nn.Linear(D_IN, D_H), torch.nn.Linear(D_H, D_OUT)
    res["init_from_seed_equal"] = bool(
        torch.equal(c.weight, c_ref.weight[rows]) and torch.equal(c.bias, c_ref.bias[rows])
        and torch.equal(rw.weight, r_ref.weight[:, cols]) and torch.equal(rw.bias, r_ref.bias))

    # Bad sizes and inputs: refused before any communication, naming the values.
    res["errors"] = {
        "column_out_features": error_of(lambda: ColumnParallelLinear(D_IN, 4 * W + 1, pg)),
        "row_in_features": error_of(lambda: RowParallelLinear(4 * W + 1, D_OUT, pg)),
        "from_linear_not_linear": error_of(lambda: ColumnParallelLinear.from_linear(torch.nn.ReLU(), pg)),
        "column_input_dim": error_of(lambda: c(torch.zeros(2, D_IN + 1))),
        "row_input_dim": error_of(lambda: rw(torch.zeros(2, D_H))),
        "shard_mlp_name": error_of(lambda: shard_mlp(MLP(), pg, up="fc1", down="nope")),
        "shard_mlp_swapped": error_of(lambda: shard_mlp(MLP(), pg, up="fc2", down="fc1")),
        # (a breaker's finds: the same name twice was accepted, then a forward naming neither
        # failed; a 0-d input raised IndexError, a NumPy one AttributeError)
        "shard_mlp_same": error_of(lambda: shard_mlp(MLP(), pg, up="fc1", down="fc1")),
        "shard_mlp_alias": error_of(lambda: shard_mlp(_aliased(MLP()), pg, up="fc1", down="alias")),
        "shard_mlp_not_str": error_of(lambda: shard_mlp(MLP(), pg, up=0, down="fc2")),
        "column_input_0d": error_of(lambda: c(torch.tensor(1.0))),
        "row_input_numpy": error_of(lambda: rw(torch.zeros(2, D_H).numpy())),
    }
    return {f"{tag}/{k}": v for k, v in res.items()}


def tp_size(pg) -> int:
    return pg.world_size if hasattr(pg, "world_size") else pg.size


def run_tp(pg, pair) -> dict:
    res = tp_case(pg, "w4")
    res.update(tp_case(pair, "w2"))
    return res


# -- hybrid: data parallel x tensor parallel over a device mesh ---------------------------------

def hybrid_case(pg, wrap: str = "ddp", steps: int = 3, B: int = 8) -> dict:
    """``wrap`` "ddp": DDP over "dp", clipped by ``rtxnet.parallel.clip_grad_norm_``; "fsdp":
    FSDP over "dp", clipped by its own method. Every step is clipped to half the reference's
    norm, so a rank that took the norm of its slices alone would scale by another factor."""
    mesh = DeviceMesh(pg, (-1, 2), ("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    torch.manual_seed(1)
    ref = MLP()
    net = shard_mlp(copy.deepcopy(ref), tp, up="fc1", down="fc2")
    if wrap == "ddp":
        model = DistributedDataParallel(net, dp)
        clip = functools.partial(clip_grad_norm_, list(model.parameters()))
    else:
        model = FullyShardedDataParallel(net, dp)
        clip = model.clip_grad_norm_
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y = data((B * steps, D_IN), D_OUT, seed=30)
    i, n = mesh.get_local_rank("dp"), B // mesh.size("dp")
    norm_rel = 0.0
    for s in range(steps):
        ref_opt.zero_grad()
        LOSS(ref(x[s * B:(s + 1) * B]), y[s * B:(s + 1) * B]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)   # measures only
        cap = 0.5 * float(ref_norm)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cap)
        ref_opt.step()
        lo = s * B + i * n        # this replica's slice; both ranks of a tp group feed the same
        opt.zero_grad()
        LOSS(model(x[lo:lo + n]), y[lo:lo + n]).backward()
        norm_rel = max(norm_rel, abs(float(clip(cap)) / float(ref_norm) - 1))
        opt.step()
    if wrap == "fsdp":
        full = model.full_state_dict(rank0_only=False)
        net = MLP()
        net.fc1 = torch.nn.Linear(D_IN, D_H // mesh.size("tp"))
        net.fc2 = torch.nn.Linear(D_H // mesh.size("tp"), D_OUT)
        net.load_state_dict(full)
    h = D_H // mesh.size("tp")
    t = mesh.get_local_rank("tp")
    rows = slice(t * h, (t + 1) * h)
    return {
        "shape": list(mesh.shape), "coordinate": mesh.get_coordinate(),
        "tp_ranks": list(tp.ranks), "dp_ranks": list(dp.ranks), "size": mesh.size(),
        "moved": rel(ref.fc1.weight, _seeded_mlp().fc1.weight),     # training changed them
        "norm_rel": norm_rel,
        "rel": {"fc1.weight": rel(net.fc1.weight, ref.fc1.weight[rows]),
                "fc1.bias": rel(net.fc1.bias, ref.fc1.bias[rows]),
                "fc2.weight": rel(net.fc2.weight, ref.fc2.weight[:, rows]),
                "fc2.bias": rel(net.fc2.bias, ref.fc2.bias)},
        "errors": {
            "product": error_of(lambda: DeviceMesh(pg, (3, 2), ("dp", "tp"))),
            "not_multiple": error_of(lambda: DeviceMesh(pg, (-1, 3), ("dp", "tp"))),
            "names": error_of(lambda: DeviceMesh(pg, (2, 2), ("dp", "dp"))),
            "dim": error_of(lambda: mesh.get_group("pp")),
        },
    }


def _seeded_mlp() -> MLP:
    torch.manual_seed(1)
    return MLP()


# -- pipeline parallel --------------------------------------------------------------------------

P_D, P_C, P_B = 6, 4, 24      # width, classes, batch (divisible by 1, 2, 3, 4, 8)


def full_model(seed: int) -> torch.nn.Sequential:
    """Four parts; stage s of S holds parts s*4/S .. (s+1)*4/S."""
    torch.manual_seed(seed)
    parts = [torch.nn.Sequential(torch.nn.Linear(P_D, P_D), torch.nn.Tanh()) for _ in range(3)]
    parts.append(torch.nn.Sequential(torch.nn.Linear(P_D, P_D), torch.nn.Tanh(),
                                     torch.nn.Linear(P_D, P_C)))
    return torch.nn.Sequential(*parts)


def stage_of(model: torch.nn.Sequential, s: int, S: int) -> torch.nn.Sequential:
    k = 4 // S
    return copy.deepcopy(torch.nn.Sequential(*model[s * k:(s + 1) * k]))


class _BackwardRaises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("user bug in backward")


class _FailsInBackward(torch.nn.Module):
    """``inner``, whose backward raises RuntimeError."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return _BackwardRaises.apply(self.inner(x))


class _DetachesInput(torch.nn.Module):
    """``inner`` run on its input detached (``on``): no gradient flows back through this stage."""

    def __init__(self, inner: torch.nn.Module, on: bool = True):
        super().__init__()
        self.inner, self.on = inner, on

    def forward(self, x):
        return self.inner(x.detach() if self.on else x)


class _FailsOnCall(torch.nn.Module):
    """``inner``, except that its ``n``-th call raises RuntimeError (or ``exc``)."""

    def __init__(self, inner: torch.nn.Module, n: int, exc: BaseException | None = None):
        super().__init__()
        self.inner, self.n, self.calls, self.exc = inner, n, 0, exc

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise self.exc or RuntimeError(f"user bug on call {self.n}")
        return self.inner(x)


def pp_case(pg, S: int, sched_cls, M: int, *, steps: int = 1, seed: int = 20) -> dict:
    s = pg.rank
    ref = full_model(seed)
    stage = PipelineStage(stage_of(ref, s, S), pg, num_stages=S)
    sched = sched_cls(stage, M, LOSS)
    d_loss = d_out = 0.0
    for i in range(steps):
        x, y = data((P_B, P_D), P_C, seed=30 + i)
        ref.zero_grad()
        stage.module.zero_grad()
        out_ref = ref(x)
        loss_ref = LOSS(out_ref, y)
        loss_ref.backward()
        loss = sched.step(x if stage.is_first else None, y if stage.is_last else None)
        if stage.is_last:
            d_loss = max(d_loss, rel(loss, loss_ref))
            d_out = max(d_out, rel(sched.last_output, out_ref))
        elif loss is not None:
            d_loss = float("inf")       # only the last stage returns a loss
        if i < steps - 1:
            sgd(ref.parameters())
            sgd(stage.parameters())
    k = 4 // S     # the reference's own parameters of stage s
    mine = [p for part in ref[s * k:(s + 1) * k] for p in part.parameters()]
    grads = [rel(p.grad, q.grad) for p, q in zip(stage.parameters(), mine, strict=True)]
    params = [rel(p, q) for p, q in zip(stage.parameters(), mine, strict=True)]
    return {"loss": d_loss, "out": d_out, "grad": max(grads), "param": max(params),
            "n_grads": len(grads), "trace": " ".join(sched.trace), "peak": sched.peak_in_flight}


def dp_pp_case(pg, sched_cls, M: int, steps: int = 2, wrap: str = "ddp") -> dict:
    """2 replicas x 2 stages on a mesh: each stage wrapped in DistributedDataParallel (``wrap``
    "ddp") or FullyShardedDataParallel ("fsdp") over "dp", each replica fed its half of the
    batch, against one process on the whole batch. Before, a DDP stage reduced only one
    micro-batch's gradient and the replicas drifted apart (M > 1)."""
    mesh = DeviceMesh(pg, (-1, 2), ("dp", "pp"))
    s, i = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    ref = full_model(22)
    wrapper = DistributedDataParallel if wrap == "ddp" else FullyShardedDataParallel
    stage = PipelineStage(wrapper(stage_of(ref, s, 2), mesh.get_group("dp")), mesh.get_group("pp"))
    sched = sched_cls(stage, M, LOSS)
    n = P_B // 2
    for k in range(steps):
        x, y = data((P_B, P_D), P_C, seed=40 + k)
        ref.zero_grad()
        stage.module.zero_grad()
        LOSS(ref(x), y).backward()
        sched.step(x[i * n:(i + 1) * n] if stage.is_first else None,
                   y[i * n:(i + 1) * n] if stage.is_last else None)
        sgd(ref.parameters())
        sgd(stage.parameters())
    if wrap == "fsdp":      # the stage's parameters are its shards: compare the gathered ones
        mine = stage_of(ref, s, 2).state_dict()
        full = stage.module.full_state_dict(rank0_only=False)
        assert list(full) == list(mine), (list(full), list(mine))
        return {"param": max(rel(full[k], v) for k, v in mine.items())}
    mine = [p for part in ref[s * 2:(s + 1) * 2] for p in part.parameters()]
    return {"param": max(rel(p, q) for p, q in zip(stage.parameters(), mine, strict=True))}


def dp_pp_detach_case(pg, sched_cls) -> dict:
    """2 replicas x 2 stages as ``dp_pp_case``, stage 1 of replica 0 alone detaching its input:
    stage 0 of replica 0 gets no gradient, replica 1's does. Every replica must still take part
    in DDP's reduction (skipped on replica 0, replica 1 waited for it until its deadline while
    replica 0 returned), and stage 0's gradient is then half replica 1's, as in one process."""
    mesh = DeviceMesh(pg, (-1, 2), ("dp", "pp"))
    s, i = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    ref = full_model(22)
    parts = [stage_of(ref, k, 2) for k in range(2)]
    part = parts[0] if s == 0 else _DetachesInput(parts[1], on=i == 0)   # same names: DDP
    stage = PipelineStage(DistributedDataParallel(part, mesh.get_group("dp")), mesh.get_group("pp"))
    x, y = data((P_B, P_D), P_C, seed=40)
    n = P_B // 2
    t0 = time.monotonic()
    err = error_of(lambda: sched_cls(stage, 2, LOSS, timeout_s=20).step(
        x[i * n:(i + 1) * n] if stage.is_first else None, y[i * n:(i + 1) * n] if stage.is_last else None))
    seconds = time.monotonic() - t0
    a, b = copy.deepcopy(parts[0]), copy.deepcopy(parts[1])    # one process, both halves
    ((LOSS(b(a(x[:n]).detach()), y[:n]) + LOSS(b(a(x[n:])), y[n:])) / 2).backward()
    theirs = list((a if s == 0 else b).parameters())
    return {"error": err, "seconds": seconds,
            "grad": max(rel(p.grad, q.grad) if p.grad is not None else math.inf
                        for p, q in zip(part.parameters(), theirs, strict=True))}


def ddp_two_forwards_error(pg) -> str:
    """Two forwards before their backwards without no_sync: the second backward is refused
    (its gradient would stay on this rank) instead of letting the replicas diverge."""
    torch.manual_seed(3)
    m = DistributedDataParallel(torch.nn.Linear(4, 2), pg)
    x = torch.randn(4, 4)
    l1, l2 = m(x[:2]).sum(), m(x[2:]).sum()
    l1.backward()
    err = error_of(l2.backward)
    # sync_gradients twice (or after a synchronising backward) reduces once: with SUM a second
    # reduction multiplied the gradients by the world size
    s = DistributedDataParallel(torch.nn.Linear(4, 2), pg, reduce_op=rtxnet.ReduceOp.SUM)
    with s.no_sync():
        s(x).sum().backward()
    s.sync_gradients()
    once = s.module.weight.grad.clone()
    s.sync_gradients()
    return err if torch.equal(once, s.module.weight.grad) else "sync_gradients reduced twice"


def sgd(params, lr: float = 0.3) -> None:
    """Plain SGD by hand: ``torch.optim``'s first use imports torch._dynamo (3 s per rank)."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad


SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def run_pp(pg, pair, out: Path, launch_rank: int, whole: dict) -> None:
    res = whole["pp"] = {}
    for S, group, counts in ((4, pg, (1, 3, 4, 8)), (2, pair, (1, 3, 4))):
        for name, cls in SCHEDULES.items():
            for M in counts:
                res[f"S{S}/{name}/M{M}"] = pp_case(group, S, cls, M)
        for name, cls in SCHEDULES.items():
            res[f"S{S}/{name}/train"] = pp_case(group, S, cls, 4, steps=2, seed=21)

    # Bad arguments, refused before anything is sent.
    part = stage_of(full_model(20), pg.rank, 4)
    st = PipelineStage(part, pg)
    errs = {"num_stages": error_of(lambda: PipelineStage(part, pg, num_stages=3)),
            "micro_zero": error_of(lambda: ScheduleGPipe(st, 0, LOSS)),
            "micro_float": error_of(lambda: Schedule1F1B(st, 2.0, LOSS))}
    # Bad input or target: every stage calls step (as it must); the stage that sees the bad value
    # raises it, the others are told (see the abort cases below).
    x, y = data((10, P_D), P_C, seed=1)
    x12, y12 = data((12, P_D), P_C, seed=1)
    first, last = st.is_first, st.is_last
    errs["batch"] = error_of(lambda: ScheduleGPipe(st, 4, LOSS, timeout_s=20).step(
        x if first else None, y12 if last else None))
    errs["no_input"] = error_of(lambda: ScheduleGPipe(st, 2, LOSS, timeout_s=20).step(
        None, y if last else None))
    errs["target"] = error_of(lambda: Schedule1F1B(st, 4, LOSS, timeout_s=20).step(
        x12 if first else None, y if last else None))
    res["errors"] = errs

    # Stage 0 refuses a batch its 4 micro-batches cannot split: every other stage fails at once
    # with ConfigError (passed down the pipeline), not CollectiveTimeout at its 20 s deadline.
    g4 = pg.new_group([0, 1, 2, 3])
    st4 = PipelineStage(stage_of(full_model(20), g4.rank, 4), g4)
    xb, _ = data((10, P_D), P_C, seed=2)
    _, yb = data((12, P_D), P_C, seed=2)
    t0 = time.monotonic()
    res["abort"] = {"error": error_of(lambda: ScheduleGPipe(st4, 4, LOSS, timeout_s=20).step(
        xb if st4.is_first else None, yb if st4.is_last else None)), "seconds": time.monotonic() - t0}

    # The last stage refuses a target its micro-batches cannot split: the earlier stages fail at
    # once too (told upstream, on the gradient's tag), not at their 20 s deadline.
    xt, _ = data((12, P_D), P_C, seed=2)
    t0 = time.monotonic()
    res["abort_target"] = {"error": error_of(lambda: Schedule1F1B(st4, 4, LOSS, timeout_s=20).step(
        xt if st4.is_first else None, yb[:10] if st4.is_last else None)),
        "seconds": time.monotonic() - t0}

    # Under torch.no_grad() (an evaluation): refused on every stage, naming it (the last stage
    # failed with torch's "does not require grad"); a loss_fn with reduction="none": refused
    # on the last stage naming the shape (torch's "grad can be implicitly created only for
    # scalar outputs")
    with torch.no_grad():
        res["abort_no_grad"] = error_of(lambda: ScheduleGPipe(st4, 4, LOSS, timeout_s=20).step(
            xt if st4.is_first else None, yb if st4.is_last else None))
    per_element = functools.partial(torch.nn.functional.mse_loss, reduction="none")
    res["abort_loss_shape"] = error_of(lambda: ScheduleGPipe(st4, 4, per_element, timeout_s=20).step(
        xt if st4.is_first else None, torch.zeros(12, P_C) if st4.is_last else None))
    # A target of another batch size than the input's, divisible by M: mse_loss broadcast each
    # micro-batch's [3, C] output against its [1, C] target, and the step returned a wrong loss
    # and gradients with torch's warning alone; refused on the last stage, naming both sizes
    t0 = time.monotonic()
    res["abort_target_rows"] = {"error": error_of(lambda: ScheduleGPipe(
        st4, 4, torch.nn.functional.mse_loss, timeout_s=20).step(
        xt if st4.is_first else None, torch.zeros(4, P_C) if st4.is_last else None)),
        "seconds": time.monotonic() - t0}

    # Stage 1's module raises on its second micro-batch (a user bug): every stage fails at once,
    # both directions, then the next step runs and matches one process.
    for name, cls in SCHEDULES.items():
        part = stage_of(full_model(20), g4.rank, 4)
        if g4.rank == 1:
            part = _FailsOnCall(part, 2)
        st_f = PipelineStage(part, g4)
        sched = cls(st_f, 4, LOSS, timeout_s=20)
        x, y = data((P_B, P_D), P_C, seed=30)
        t0 = time.monotonic()
        err = error_of(lambda: sched.step(x if st_f.is_first else None, y if st_f.is_last else None))  # noqa: B023
        seconds = time.monotonic() - t0
        for p in part.parameters():
            p.grad = None
        loss = sched.step(x if st_f.is_first else None, y if st_f.is_last else None)
        res[f"abort_module/{name}"] = {"error": err, "seconds": seconds,
                                       "next_loss": None if loss is None else float(loss),
                                       "ref_loss": float(LOSS(full_model(20)(x), y))}

    # The same with a KeyboardInterrupt (Ctrl-C on that rank alone): the others were not told and
    # waited out their timeout, and stage 1's next step timed out too (a breaker's find)
    part = stage_of(full_model(20), g4.rank, 4)
    if g4.rank == 1:
        part = _FailsOnCall(part, 2, KeyboardInterrupt())
    st_k = PipelineStage(part, g4)
    sched = ScheduleGPipe(st_k, 4, LOSS, timeout_s=20)
    x, y = data((P_B, P_D), P_C, seed=30)
    t0 = time.monotonic()
    try:
        sched.step(x if st_k.is_first else None, y if st_k.is_last else None)
        err = "no error"
    except BaseException as exc:   # noqa: BLE001 - the test asserts on the type and message
        err = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    for p in part.parameters():
        p.grad = None
    loss = sched.step(x if st_k.is_first else None, y if st_k.is_last else None)
    res["abort_module_interrupt"] = {"error": err, "seconds": seconds,
                                     "next_loss": None if loss is None else float(loss),
                                     "ref_loss": float(LOSS(full_model(20)(x), y))}

    # Stage 2's backward raises: the last stage had finished its part (it returned the loss
    # before); the step's closing agreement makes it raise too.
    for name, cls in SCHEDULES.items():
        part = stage_of(full_model(20), g4.rank, 4)
        if g4.rank == 2:
            part = _FailsInBackward(part)
        st_b = PipelineStage(part, g4)
        x, y = data((P_B, P_D), P_C, seed=30)
        t0 = time.monotonic()
        err = error_of(lambda: cls(st_b, 4, LOSS, timeout_s=20).step(  # noqa: B023
            x if st_b.is_first else None, y if st_b.is_last else None))  # noqa: B023
        res[f"abort_backward/{name}"] = {"error": err, "seconds": time.monotonic() - t0}

    # An empty batch (B = 0): stage 0 refuses its input naming it (it raised IndexError, the others
    # "stage 0 failed"), the last stage its target; stages 1 and 2 are told; the next step runs.
    for name, cls in SCHEDULES.items():
        st_e = PipelineStage(stage_of(full_model(20), g4.rank, 4), g4)
        sched = cls(st_e, 4, LOSS, timeout_s=20)
        t0 = time.monotonic()
        err = error_of(lambda: sched.step(  # noqa: B023
            torch.zeros(0, P_D) if st_e.is_first else None,  # noqa: B023
            torch.zeros(0, dtype=torch.int64) if st_e.is_last else None))  # noqa: B023
        seconds = time.monotonic() - t0
        x, y = data((P_B, P_D), P_C, seed=30)
        loss = sched.step(x if st_e.is_first else None, y if st_e.is_last else None)
        res[f"empty/{name}"] = {"error": err, "seconds": seconds,
                                "next_loss": None if loss is None else float(loss),
                                "ref_loss": float(LOSS(full_model(20)(x), y))}

    # Stage 2 detaches its input: no gradient reaches stages 0 and 1, whose .grad stay None as in
    # one process (they got zeros, which momentum or weight decay turned into an update).
    for name, cls in SCHEDULES.items():
        ref = full_model(20)
        ref[2] = _DetachesInput(ref[2])
        part = copy.deepcopy(ref[g4.rank])
        st_d = PipelineStage(part, g4)
        x, y = data((P_B, P_D), P_C, seed=30)
        cls(st_d, 4, LOSS, timeout_s=20).step(x if st_d.is_first else None,
                                              y if st_d.is_last else None)
        LOSS(ref(x), y).backward()
        mine, theirs = list(part.parameters()), list(ref[g4.rank].parameters())
        res[f"detach/{name}"] = {
            "none": [p.grad is None for p in mine], "ref_none": [q.grad is None for q in theirs],
            "grad": max((rel(p.grad, q.grad) for p, q in zip(mine, theirs, strict=True)
                         if p.grad is not None and q.grad is not None), default=0.0)}

    for name, cls in SCHEDULES.items():
        res[f"detach_dp/{name}"] = dp_pp_detach_case(pg, cls)

    # Stages running different schedules (GPipe on stages 0 and 2, 1F1B on 1 and 3) or different
    # micro-batch counts (stage 3 4, the others 2): every stage refuses the step at once naming
    # each stage's (a GPipe stage next to a 1F1B one waited for a message its neighbour sends
    # later: every stage timed out naming a raw tag); the next step runs.
    mixed = {"kinds": (ScheduleGPipe if g4.rank % 2 == 0 else Schedule1F1B, 4),
             "counts": (Schedule1F1B, 4 if g4.rank == 3 else 2)}
    for name, (cls, M) in mixed.items():
        st_m = PipelineStage(stage_of(full_model(20), g4.rank, 4), g4)
        x, y = data((P_B, P_D), P_C, seed=30)
        t0 = time.monotonic()
        err = error_of(lambda: cls(st_m, M, LOSS, timeout_s=20).step(  # noqa: B023
            x if st_m.is_first else None, y if st_m.is_last else None))  # noqa: B023
        seconds = time.monotonic() - t0
        for p in st_m.parameters():
            p.grad = None
        loss = Schedule1F1B(st_m, 4, LOSS, timeout_s=20).step(x if st_m.is_first else None,
                                                              y if st_m.is_last else None)
        res[f"mixed/{name}"] = {"error": err, "seconds": seconds,
                                "next_loss": None if loss is None else float(loss),
                                "ref_loss": float(LOSS(full_model(20)(x), y))}

    # A peer that never answers: each rank of a pair runs a step in a group where the other does
    # not, so both wait out a 0.5 s deadline (stage 0 for a gradient, stage 1 for an activation).
    mine = [pg.rank - pg.rank % 2, pg.rank - pg.rank % 2 + 1]
    groups = [pg.new_group(mine), pg.new_group(mine)]
    g = groups[pg.rank % 2]
    stage = PipelineStage(stage_of(full_model(20), g.rank, 2), g)
    t0 = time.monotonic()
    x, y = data((P_B, P_D), P_C, seed=1)
    try:
        ScheduleGPipe(stage, 2, LOSS, timeout_s=0.5).step(x, y)
        res["timeout"] = {"error": "no error"}
    except rtxnet.CollectiveTimeout as exc:
        res["timeout"] = {"error": type(exc).__name__, "ranks": list(exc.ranks),
                          "seconds": time.monotonic() - t0}

    # Rank 3 dies while rank 2 (stage 0 of pair {2, 3}) waits for its gradients; only once every
    # rank is past its last collective with it, told through the store (a barrier would not do:
    # rank 3 returning from one does not mean its own last message reached the others).
    pg.store.set(f"mp/ready/{launch_rank}", b"1")
    if launch_rank == 3:
        (out / f"mp-rank{launch_rank}.json").write_text(json.dumps(whole))
        pg.store.wait([f"mp/ready/{q}" for q in range(3)], timeout=30)
        os._exit(0)
    if launch_rank == 2:
        stage = PipelineStage(stage_of(full_model(20), 0, 2), pair)
        t0 = time.monotonic()
        try:
            Schedule1F1B(stage, 4, LOSS).step(x, None)
            res["peer_lost"] = {"error": "no error"}
        except rtxnet.PeerLostError as exc:
            res["peer_lost"] = {"error": type(exc).__name__, "ranks": list(exc.ranks),
                                "seconds": time.monotonic() - t0}


def main() -> int:
    out = Path(sys.argv[1])
    launch_rank = int(os.environ["RANK"])
    timeouts = rtxnet.Timeouts(heartbeat_timeout_s=5.0, op_s=30, rendezvous_s=120)
    pg = rtxnet.init(timeouts=timeouts)
    torch.set_num_threads(1)
    pair = pg.new_group([0, 1] if pg.rank < 2 else [2, 3])
    res: dict = {"rank": pg.rank, "world_size": pg.world_size}
    res["tp"] = run_tp(pg, pair)
    res["dpxtp"] = hybrid_case(pg)
    res["fsdpxtp"] = hybrid_case(pg, "fsdp")
    res["dpxpp"] = {f"{name}/M{M}": dp_pp_case(pg, cls, M)
                    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)) for M in (1, 2, 4)}
    res["fsdpxpp"] = {f"{name}/M{M}": dp_pp_case(pg, cls, M, wrap="fsdp")
                      for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)) for M in (1, 4)}
    res["ddp_two_forwards"] = ddp_two_forwards_error(pg)
    run_pp(pg, pair, out, launch_rank, res)     # rank 3 does not come back
    (out / f"mp-rank{launch_rank}.json").write_text(json.dumps(res))
    # Leave together (as procs.leave_together), over the ranks that survive: 0, 1, 2.
    pg.store.set(f"mp/done/{launch_rank}", b"1")
    pg.store.wait([f"mp/done/{q}" for q in range(3)], timeout=30)
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
