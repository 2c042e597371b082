"""A rank of the DDP tests, run under ``python -m rtxnet.launcher``.

    ddp_worker.py OUT_DIR scenario

Every rank also computes the single-process reference itself (same seed, the whole global batch),
so one launch checks equivalence without a second process. Each rank writes
``OUT_DIR/<scenario>-rank<r>.json`` with the measured differences and a parameter checksum.

Scenarios:
    basic   equivalence (AVG, equal shares), SUM with uneven shares, no_sync accumulation, an
            unused parameter, several buckets, gradients changed in place between accumulating
            backwards, parameters replaced by load_state_dict(assign=True).
    fault   rank 3 dies inside step 2's forward; the survivors' backward raises PeerLostError, they
            retry the step on the 3-rank world with the elastic sampler, and must still match one
            process with the global batch. Rank 1 launches its first bucket of step 2 only once
            the world has changed (a thread descheduled between the round's start and the
            launch): that bucket must fail with the old world, not run alone in the new one.
            Rank 2 runs step 2's backward only once the world has changed after its forward
            (whose batch was chosen for 4 ranks): the backward must fail, not reduce that
            batch with the other ranks' retry in the 3-rank world.
    stale   gradients of batches chosen for the old world are refused after leaves (see stale()).
    held    a step begun while the engine still holds the view of an orderly leave runs in the
            new world (see held()).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

import rtxnet
from rtxnet.parallel import DistributedDataParallel
from rtxnet.parallel import ddp as ddp_module
from rtxnet.sampler import ElasticDistributedSampler
from tests.procs import LateLaunch, leave_together, wait_until

D_IN, D_H, D_OUT = 12, 24, 5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(D_IN, D_H)
        self.l2 = torch.nn.Linear(D_H, D_H)
        self.extra = torch.nn.Linear(D_H, D_OUT)      # used only where use_extra is set
        self.never = torch.nn.Linear(D_H, D_OUT)      # used by no rank
        self.head = torch.nn.Linear(D_H, D_OUT)
        self.use_extra = False

    def forward(self, x):
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        y = self.head(h)
        if self.use_extra:
            y = y + self.extra(h)
        return y


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    return net


def data(n: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = torch.randint(0, D_OUT, (n,), generator=g)
    return x, y


def flat_params(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element-wise relative difference (denominator floored at 1e-3)."""
    return float(((a - b).abs() / b.abs().clamp_min(1e-3)).max())


LOSS = torch.nn.functional.cross_entropy
BUCKETS = dict(bucket_cap_mb=0.002, first_bucket_mb=0.001)   # several buckets on a tiny model
# the broadcasts of parameters and buffers in pieces of at most 1 KiB: several on a tiny model
ddp_module.BROADCAST_BUCKET_NBYTES = 1024


def lockstep(ref, ref_opt, model, opt, x, y, B: int, lo: int, n: int, steps: int) -> None:
    """``steps`` optimizer steps of ``ref`` on whole batches of ``B`` and, in the same order, of
    ``model`` on this rank's slice ``[lo, lo + n)`` of each batch."""
    for s in range(steps):
        xb, yb = x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]
        ref_opt.zero_grad()
        LOSS(ref(xb), yb).backward()
        ref_opt.step()
        opt.zero_grad()
        LOSS(model(xb[lo:lo + n]), yb[lo:lo + n]).backward()
        opt.step()


def equivalence_avg(pg, steps=5, per_rank=4, device="cpu"):
    """DDP (AVG) against one process on the whole global batch, on ``device`` (the GPU test
    runs it on CUDA)."""
    W, r = pg.world_size, pg.rank
    B = per_rank * W
    x, y = (t.to(device) for t in data(B * steps))
    ref = make_net(1).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    net = make_net(1 if r == 0 else 100 + r).to(device)   # others differ: the broadcast fixes it
    ddp = DistributedDataParallel(net, pg, **BUCKETS)
    init_same = rel(flat_params(net), flat_params(make_net(1).to(device)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    lockstep(ref, ref_opt, ddp, opt, x, y, B, r * per_rank, per_rank, steps)
    return {"avg_rel": rel(flat_params(net), flat_params(ref)), "avg_buckets": len(ddp.buckets),
            "avg_sum": float(flat_params(net).double().sum()), "init_broadcast_rel": init_same,
            "avg_bucket_devices": sorted({str(b.flat.device) for b in ddp._buckets}),
            "avg_never_grad_is_none": net.never.weight.grad is None}   # used by no rank


def equivalence_sum_uneven(pg, steps=4, B=10):
    W, r = pg.world_size, pg.rank
    x, y = data(B * steps, seed=7)
    ref = make_net(2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    net = make_net(2)
    ddp = DistributedDataParallel(net, pg, reduce_op=rtxnet.ReduceOp.SUM, **BUCKETS)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sampler = ElasticDistributedSampler(B * steps, B, rank=r, world_size=W, shuffle=False)
    for s in range(steps):
        xb, yb = x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]
        ref_opt.zero_grad()
        LOSS(ref(xb), yb).backward()
        ref_opt.step()
        b = sampler.next_batch()
        idx = torch.tensor(b.indices)
        opt.zero_grad()
        (LOSS(ddp(x[idx]), y[idx]) * b.loss_weight).backward()
        opt.step()
    return {"sum_rel": rel(flat_params(net), flat_params(ref)), "sum_local_n": b.local_n}


def sum_accumulated(pg, per_rank=3):
    """ReduceOp.SUM with gradients accumulated over several synchronised backwards (no
    no_sync): three of them, then one synchronised, one under no_sync, one synchronised, the
    extra layer used only in the first of each (its gradient then rides on untouched), then a
    step after zero_grad(set_to_none=False). Each synchronisation used to sum the gradients an
    earlier one had written again (a tester saw 0.79 off one process with 2 ranks)."""
    W, r = pg.world_size, pg.rank
    x, y = data(per_rank * W * 7, seed=13)
    net, ref = make_net(8), make_net(8)
    ddp = DistributedDataParallel(net, pg, reduce_op=rtxnet.ReduceOp.SUM, **BUCKETS)
    worst, k = 0.0, 0
    for plan in (("sync", "sync", "sync"), ("sync", "no_sync", "sync"), ("zeroed",)):
        if plan == ("zeroed",):
            ddp.zero_grad(set_to_none=False)
            ref.zero_grad(set_to_none=False)
        else:
            ddp.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        for j, how in enumerate(plan):
            net.use_extra = ref.use_extra = j == 0
            B = per_rank * W
            xb, yb = x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]
            k += 1
            LOSS(ref(xb), yb).backward()
            mine = LOSS(ddp(xb[r * per_rank:(r + 1) * per_rank]), yb[r * per_rank:(r + 1) * per_rank]) / W
            if how == "no_sync":
                with ddp.no_sync():
                    mine.backward()
            else:
                mine.backward()
        g = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
        g_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
        # relative to the largest element: float32 rounding of the sums is a few ulp of it, and
        # the element-wise ratio of near-zero elements measures only that
        worst = max(worst, float((g - g_ref).abs().max() / g_ref.abs().max()))
    return {"sum_accumulated_rel": worst}


def accumulated_after_inplace(pg, per_rank=3):
    """Gradients accumulated over synchronised backwards (no zero_grad between) with p.grad
    changed in place between them: clipped (clip_grad_norm_) or halved after a synchronisation,
    zeroed between a no_sync micro-batch and the synchronisation, for AVG and SUM against one
    process; the extra layer, used only in the first backward, carries its changed gradient
    into the next synchronisations untouched. Under SUM the synchronised part, once changed in
    place, was summed whole: 15% to 64% off one process (a tester's find). Halving p.grad after
    a no_sync backward added to that part is refused under SUM on every rank."""
    W, r = pg.world_size, pg.rank
    plans = (("sync", "clip", "sync", "sync"), ("sync", "half", "no_sync", "sync"),
             ("sync", "no_sync", "zero", "sync"))
    x, y = data(per_rank * W * 10, seed=17)
    out: dict = {"inplace_rel": {}}
    B = per_rank * W
    for op in (rtxnet.ReduceOp.AVG, rtxnet.ReduceOp.SUM):
        net, ref = make_net(9), make_net(9)
        ddp = DistributedDataParallel(net, pg, reduce_op=op, **BUCKETS)
        scale = 1.0 / W if op is rtxnet.ReduceOp.SUM else 1.0
        worst = 0.0
        for plan in plans:
            ddp.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            k = 0
            for how in plan:
                if how in ("clip", "half", "zero"):
                    for m in (net, ref):
                        if how == "clip":
                            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                        else:
                            for q in m.parameters():
                                if q.grad is not None:
                                    q.grad.mul_(0.5 if how == "half" else 0.0)
                    continue
                net.use_extra = ref.use_extra = k == 0
                xb, yb = x[k * B:(k + 1) * B], y[k * B:(k + 1) * B]
                k += 1
                LOSS(ref(xb), yb).backward()
                mine = LOSS(ddp(xb[r * per_rank:(r + 1) * per_rank]), yb[r * per_rank:(r + 1) * per_rank]) * scale
                with ddp.no_sync() if how == "no_sync" else contextlib.nullcontext():
                    mine.backward()
            g = torch.cat([q.grad.reshape(-1) for q in net.parameters() if q.grad is not None])
            g_ref = torch.cat([q.grad.reshape(-1) for q in ref.parameters() if q.grad is not None])
            worst = max(worst, float((g - g_ref).abs().max() / g_ref.abs().max()))
        out["inplace_rel"][op.name] = worst
    # SUM: a synchronised gradient, a no_sync backward adding this rank's own, then halved: refused
    ddp.zero_grad(set_to_none=True)
    net.use_extra = False
    xb, yb = x[:per_rank], y[:per_rank]
    LOSS(ddp(xb), yb).backward()
    with ddp.no_sync():
        LOSS(ddp(xb), yb).backward()
    for q in net.parameters():
        if q.grad is not None:
            q.grad.mul_(0.5)
    try:
        LOSS(ddp(xb), yb).backward()
        out["inplace_refused"] = None
    except rtxnet.ConfigError as exc:
        out["inplace_refused"] = str(exc)
    return out


def assign_resume(pg, per_rank=3, steps=3):
    """A checkpoint loaded with load_state_dict(..., assign=True) (the torch.load(mmap=True)
    resume) replaces the module's Parameter objects; DDP's hooks stayed on the old ones and no
    gradient was reduced again (a tester saw the ranks' gradients 0.69 apart after one step,
    silently). Through DDP.load_state_dict, then through the wrapped module's own with a
    submodule set as an attribute (noticed at the next forward), training must match one process;
    a checkpoint of another dtype loaded with assign=True is refused, there and at forward."""
    W, r = pg.world_size, pg.rank
    B = per_rank * W
    x, y = data(B * steps * 2, seed=19)
    net, ref = make_net(10 + r), make_net(10)     # unlike replicas: the checkpoint aligns them
    ddp = DistributedDataParallel(net, pg, init_sync=False, **BUCKETS)
    ckpt = {k: v.clone() for k, v in make_net(11).state_dict().items()}   # as torch.load gives it
    ddp.load_state_dict({k: v.clone() for k, v in ckpt.items()}, assign=True)
    ref.load_state_dict(ckpt)
    out = {}
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ddp, ref))
    lockstep(ref, ref_opt, ddp, opt, x, y, B, r * per_rank, per_rank, steps)
    out["assign_rel"] = rel(flat_params(net), flat_params(ref))
    # the wrapped module's load_state_dict and a submodule replaced by a like one
    ckpt = {k: v.clone() for k, v in ref.state_dict().items()}
    net.load_state_dict(ckpt, assign=True)
    net.head = torch.nn.Linear(D_H, D_OUT)
    net.head.load_state_dict({"weight": ckpt["head.weight"], "bias": ckpt["head.bias"]})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ddp, ref))
    x2, y2 = x[B * steps:], y[B * steps:]
    lockstep(ref, ref_opt, ddp, opt, x2, y2, B, r * per_rank, per_rank, steps)
    out["assign_module_rel"] = rel(flat_params(net), flat_params(ref))
    out["assign_sum"] = float(flat_params(net).double().sum())
    refused = []
    for call in (lambda: ddp.load_state_dict({k: v.double() for k, v in ckpt.items()}, assign=True),
                 lambda: ddp(x[:per_rank])):
        try:
            call()
            refused.append(None)
        except Exception as exc:   # before: torch's dtype error at the forward
            refused.append(f"{type(exc).__name__}: {exc}")
    out["assign_refused"] = refused
    return out


def no_sync_accumulation(pg, per_rank=4, micro=2):
    W, r = pg.world_size, pg.rank
    B = per_rank * W * micro
    x, y = data(B, seed=11)
    ref = make_net(3)
    LOSS(ref(x), y).backward()
    net = make_net(3)
    ddp = DistributedDataParallel(net, pg, **BUCKETS)
    mine = torch.arange(B).view(micro, W, per_rank)[:, r]   # micro-batch m of rank r
    works_before = None
    for m in range(micro):
        xb, yb = x[mine[m]], y[mine[m]]
        if m < micro - 1:
            with ddp.no_sync():
                (LOSS(ddp(xb), yb) / micro).backward()
            works_before = float(net.head.weight.grad.abs().sum())   # local only so far
        else:
            (LOSS(ddp(xb), yb) / micro).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
    g_ref = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
    return {"no_sync_rel": rel(g, g_ref), "no_sync_local_grad_sum": works_before}


def unused_parameters(pg, per_rank=3):
    W, r = pg.world_size, pg.rank
    x, y = data(per_rank * W, seed=5)
    ref = make_net(4)
    total = 0
    for q in range(W):      # rank q's loss, with the extra branch only on rank 0
        ref.use_extra = q == 0
        xb, yb = x[q * per_rank:(q + 1) * per_rank], y[q * per_rank:(q + 1) * per_rank]
        total = total + LOSS(ref(xb), yb) / W
    total.backward()
    net = make_net(4)
    net.use_extra = r == 0
    ddp = DistributedDataParallel(net, pg, **BUCKETS)
    for _ in range(2):      # twice: the second step must not hang or mix up buckets either
        ddp.zero_grad(set_to_none=True)
        LOSS(ddp(x[r * per_rank:(r + 1) * per_rank]), y[r * per_rank:(r + 1) * per_rank]).backward()
    extra_rel = rel(net.extra.weight.grad, ref.extra.weight.grad)
    head_rel = rel(net.head.weight.grad, ref.head.weight.grad)
    return {"unused_extra_rel": extra_rel, "unused_head_rel": head_rel,
            "never_grad_is_none": net.never.weight.grad is None and net.never.bias.grad is None}


def fault(pg, steps=5, B=12):
    """Rank 3 dies in step 2; survivors retry the step on 3 ranks (SUM + loss weight)."""
    r0 = pg.rank
    x, y = data(B * steps, seed=9)
    ref = make_net(6)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    net = make_net(6)
    late = LateLaunch(pg, "all_reduce")
    ddp = DistributedDataParallel(net, late, reduce_op=rtxnet.ReduceOp.SUM, **BUCKETS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticDistributedSampler(B * steps, B, rank=pg.rank, world_size=pg.world_size, shuffle=False)
    if r0 == 3:
        def die(*_):
            if die.step == 2:
                # Only once every survivor finished step 1: a rank that completes a collective
                # and dies at once may take its last sends with it, and one survivor failing
                # step 1 while the others completed it is the disagreement FaultTolerance's
                # commit vote settles, not this raw loop (a CI run had rank 1 retry step 1
                # while ranks 0 and 2 ran step 2).
                pg.store.wait([f"fault/step1/{q}" for q in range(3)], timeout=30)
                os._exit(0)
        die.step = -1
        net.register_forward_pre_hook(die)
    else:
        def began(*_):
            # step 2's forward has begun here (DDP's own forward pinned the world of 4 before the
            # module's hooks run): only then may rank 3 die. Set before the forward, a survivor
            # descheduled on loaded cores began it after rank 3's loss and ran the step in the
            # world of 3 without a failure (a clean-clone run's rank 1)
            if began.step == 2 and not began.told:
                began.told = True
                pg.store.set(f"fault/step1/{r0}", b"1")
        began.step, began.told = -1, False
        net.register_forward_pre_hook(began)
    failures = []
    for s in range(steps):
        xb, yb = x[s * B:(s + 1) * B], y[s * B:(s + 1) * B]
        ref_opt.zero_grad()
        LOSS(ref(xb), yb).backward()
        ref_opt.step()
        snapshot = sampler.state_dict()
        if r0 == 1 and s == 2:
            late.armed = pg.epoch    # before rank 3 may die: armed with the epoch step 2 began in
        while True:
            if r0 == 3:
                die.step = s
            else:
                began.step = s
            sampler.set_world(pg.rank, pg.world_size)
            b = sampler.next_batch()
            idx = torch.tensor(b.indices)
            opt.zero_grad()
            try:
                loss = LOSS(ddp(x[idx]), y[idx]) * b.loss_weight
                if r0 == 2 and s == 2 and not failures:
                    wait_until(lambda: pg.world_size == 3, 30, "the world without rank 3")
                loss.backward()
            except rtxnet.PeerLostError as exc:
                failures.append({"step": s, "ranks": exc.ranks, "world_size_after": pg.world_size})
                sampler.load_state_dict(snapshot)   # roll back this step's data position
                continue
            break
        opt.step()
    return {"fault_rel": rel(flat_params(net), flat_params(ref)), "failures": failures,
            "fault_sum": float(flat_params(net).double().sum()), "final_world": pg.world_size}


def double_backward(pg) -> dict:
    """A second backward through one forward (retain_graph) is refused on every rank: its
    gradient would stay local (a tester saw [[4, 4, 4]] and [[5, 5, 5]] where one process gives
    6). A backward of a loss of the parameters alone after the synchronised one (identical on
    every rank) is not; two forwards and one backward through both give one process's gradient."""
    torch.manual_seed(0)
    m = DistributedDataParallel(torch.nn.Linear(3, 1, bias=False), pg, reduce_op=rtxnet.ReduceOp.SUM)
    out = m(torch.full((1, 3), float(pg.rank + 1))).sum()
    out.backward(retain_graph=True)
    first = m.module.weight.grad.tolist()
    try:
        out.backward()
        refused = None
    except rtxnet.ConfigError as exc:
        refused = str(exc)
    m.module.weight.grad = None
    loss = m(torch.ones(1, 3)).sum()
    loss.backward()
    (m.module.weight ** 2).sum().backward()     # through the parameters only: accepted
    m.module.weight.grad = None
    (m(torch.ones(1, 3)).sum() + m(torch.full((1, 3), 2.0)).sum()).backward()
    return {"double_first": first, "double_refused": refused, "two_forwards_grad": m.module.weight.grad.tolist()}


def reentrant_checkpoint(pg) -> dict:
    """Activation checkpointing of the last layer with use_reentrant=True: its backward runs inside
    the backward, the synchronisation ended with it and the first layer's gradient stayed on each
    rank (a tester saw 0.048 off one process, the replicas 0.14 apart after 3 steps). Refused on
    every rank before any collective; use_reentrant=False gives one process's gradient."""
    from torch.utils.checkpoint import checkpoint

    class Net2(torch.nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.reentrant = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2), reentrant

        def forward(self, x):
            return checkpoint(self.b, torch.tanh(self.a(x)), use_reentrant=self.reentrant)

    W, r = pg.world_size, pg.rank
    x = torch.randn(4 * W, 4, generator=torch.Generator().manual_seed(5))
    out = {}
    for reentrant in (True, False):
        m = DistributedDataParallel(Net2(reentrant), pg, reduce_op=rtxnet.ReduceOp.SUM)
        try:
            m(x[4 * r:4 * (r + 1)]).pow(2).sum().backward()
            out[f"reentrant_{reentrant}"] = None
        except rtxnet.ConfigError as exc:
            out[f"reentrant_{reentrant}"] = str(exc)
    ref = Net2(False)
    ref(x).pow(2).sum().backward()
    out["nonreentrant_rel"] = max(rel(p.grad, q.grad) for p, q in zip(m.module.parameters(), ref.parameters(), strict=True))
    # a layer frozen when the wrapper was built, unfrozen later (staged fine-tuning): its
    # gradient would stay on each rank (a tester saw the replicas 0.035 apart): refused
    frozen = Net2(False)
    frozen.a.requires_grad_(False)
    m = DistributedDataParallel(frozen, pg)
    m(x[:4]).sum().backward()
    frozen.a.requires_grad_(True)
    try:
        m(x[:4])
        out["unfrozen"] = None
    except rtxnet.ConfigError as exc:
        out["unfrozen"] = str(exc)
    # trainable parameters changed in place after wrapping (a breaker's finds: one rank's frozen
    # weight halved the others' gradient, silently; double() left replicas of two dtypes)
    for how in ("double", "frozen"):
        net = Net2(False)
        m = DistributedDataParallel(net, pg)
        m(x[:4]).sum().backward()
        net.double() if how == "double" else net.b.weight.requires_grad_(False)
        try:
            m(x[:4].double() if how == "double" else x[:4])
            out[f"changed_{how}"] = None
        except rtxnet.ConfigError as exc:
            out[f"changed_{how}"] = str(exc)
    return out


def stale(pg) -> dict:
    """4 ranks, --min-ranks 2. Rank 3 leaves after the no_sync micro-batches' backward, before
    sync_gradients; rank 2 leaves between two forwards whose summed loss one backward reduces.
    Both synchronisations would reduce batches chosen for the old world in the new one (a tester
    saw 0.015 off one process, silently): they raise PeerLostError on every survivor. A step
    after them runs in the world of 2."""
    r0 = pg.rank
    torch.manual_seed(3)
    m = DistributedDataParallel(torch.nn.Linear(4, 2), pg, reduce_op=rtxnet.ReduceOp.SUM)
    x = torch.ones(2, 4)
    got = {}

    def leave(name, who, n):
        pg.store.set(f"stale/{name}/{r0}", b"1")
        pg.store.wait([f"stale/{name}/{k}" for k in range(n)], timeout=30)
        if r0 == who:
            os._exit(0)
        wait_until(lambda: pg.world_size == who, 30, f"the world without rank {who}")

    with m.no_sync():
        m(x).sum().backward()
    leave("accum", 3, 4)
    try:
        m.sync_gradients()
        got["sync_gradients"] = None
    except rtxnet.PeerLostError as exc:
        got["sync_gradients"] = str(exc)
    m.module.zero_grad()
    first = m(x).sum()
    leave("two", 2, 3)
    try:
        (first + m(x).sum()).backward()
        got["two_forwards"] = None
    except rtxnet.PeerLostError as exc:
        got["two_forwards"] = str(exc)
    m.module.zero_grad()
    m(x).sum().backward()                       # a whole step in the world of 2
    got["after"] = m.module.bias.grad.tolist()  # 2 rows per rank, SUM of 2 ranks: [4, 4]
    return got


def held(pg) -> dict:
    """4 ranks, --min-ranks 3. Rank 3 closes its group (an orderly leave) while rank 0 has an
    operation in flight, so rank 0's engine holds the new view for its grace while the membership
    already says 3 ranks. A step rank 0 begins then (as the other survivors do) must run in the
    world of 3 once the view is entered: before, its forward took the old world group and its
    backward raised PeerLostError (a CI run: DDP's retry after a loss failed a second time)."""
    r0, w0 = pg.rank, pg.world_size
    torch.manual_seed(3)
    m = DistributedDataParallel(torch.nn.Linear(4, 2), pg, reduce_op=rtxnet.ReduceOp.SUM)
    got = {}
    if r0 == 0:
        # joined by no other rank: in flight when rank 2 leaves
        inflight = pg.barrier(async_op=True, timeout=60)
        pg.store.set("held/inflight", b"1")
    if r0 == 3:
        pg.store.wait(["held/inflight"], timeout=30)
        pg.close()
        os._exit(0)
    wait_until(lambda: pg.world_size == w0 - 1, 30, "the world without rank 3")
    try:
        m(torch.ones(2, 4)).sum().backward()
        got["step"] = None
    except rtxnet.PeerLostError as exc:
        got["step"] = str(exc)
    got["grad"] = m.module.bias.grad.tolist()   # 2 rows per rank, SUM of 3 ranks: [6, 6]
    if r0 == 0:
        try:
            inflight.wait()
            got["inflight"] = None
        except rtxnet.PeerLostError as exc:
            got["inflight"] = type(exc).__name__
    return got


def odd_buffers(pg) -> dict:
    """Buffers of dtypes the collectives do not reduce (a rotary embedding's complex
    ``freqs_cis``, uint16, float8, bool) are broadcast by their bytes, for DDP and FSDP; a
    complex trainable parameter is refused naming it. Before: a ValueError from deep inside."""
    from rtxnet.parallel import FullyShardedDataParallel

    class Rope(torch.nn.Module):
        def __init__(self, seed: int):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("freqs_cis", torch.polar(torch.ones(3, 4), torch.rand(3, 4, generator=g)))
            self.register_buffer("u16", torch.randint(0, 60000, (5,), generator=g).to(torch.uint16))
            self.register_buffer("f8", torch.rand(6, generator=g).to(torch.float8_e4m3fn))
            self.register_buffer("mask", torch.rand(7, generator=g) > 0.5)

    def digest(m) -> list:
        return [m.freqs_cis.view(torch.float32).tolist(), m.u16.to(torch.int64).tolist(),
                m.f8.to(torch.float32).tolist(), m.mask.tolist()]

    out = {}
    for name, wrap in (("ddp", DistributedDataParallel), ("fsdp", FullyShardedDataParallel)):
        m = Rope(seed=pg.rank)
        wrap(m, pg)
        out[f"{name}_buffers"] = digest(m)
        out["buffers_rank0"] = digest(Rope(seed=0))
    m = torch.nn.Linear(2, 2).to(torch.complex64)
    try:
        DistributedDataParallel(m, pg)
        out["complex_param"] = None
    except rtxnet.ConfigError as exc:
        out["complex_param"] = str(exc)
    return out


def different_layouts(pg) -> dict:
    """Ranks freeze different parameters of the same shape (so the buckets have the same size):
    DDP must refuse the replicas on every rank instead of averaging one rank's gradient of ``a``
    with another's of ``b``."""
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)

    m = Two()
    (m.a if pg.rank % 2 == 0 else m.b).weight.requires_grad_(False)
    try:
        DistributedDataParallel(m, pg)
    except rtxnet.ConfigError as exc:
        refused = str(exc)
    else:
        refused = None
    DistributedDataParallel(Two(), pg)   # the same layout everywhere: accepted
    return {"layout_refused": refused}


def main() -> int:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    timeouts = rtxnet.Timeouts(heartbeat_timeout_s=5.0, op_s=30, rendezvous_s=120)
    pg = rtxnet.init(timeouts=timeouts)
    rank = pg.rank
    torch.set_num_threads(1)
    res: dict = {"rank": rank, "world_size": pg.world_size}
    if scenario == "basic":
        res.update(equivalence_avg(pg))
        res.update(equivalence_sum_uneven(pg))
        res.update(sum_accumulated(pg))
        res.update(accumulated_after_inplace(pg))
        res.update(assign_resume(pg))
        res.update(no_sync_accumulation(pg))
        res.update(unused_parameters(pg))
        res.update(different_layouts(pg))
        res.update(odd_buffers(pg))
        res.update(double_backward(pg))
        res.update(reentrant_checkpoint(pg))
    elif scenario == "fault":
        res.update(fault(pg))
    elif scenario == "stale":
        res.update(stale(pg))
    elif scenario == "held":
        res.update(held(pg))
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(res))
    leave_together(pg, scenario, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
