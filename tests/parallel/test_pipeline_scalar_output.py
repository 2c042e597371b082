"""A last stage whose module returns its own loss (a 0-d tensor per micro-batch), without rank
processes: a one-stage pipeline on a stand-in group of one rank (a step's only collective is the
closing all_reduce, a no-op for one rank)."""

from __future__ import annotations

import pytest
import torch

from rtxnet.parallel import PipelineStage, Schedule1F1B, ScheduleGPipe

pytestmark = pytest.mark.timeout(30)


class _Pg:
    world_size = 1
    rank = 0
    epoch = 0

    def all_reduce(self, t, op=None, **kw):
        return None


class _OwnLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.l(x).pow(2).mean()     # 0-d: the stage computes the loss itself


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_a_last_stage_returning_a_scalar_per_micro_batch_matches_one_process(schedule):
    # before: RuntimeError "zero-dimensional tensor (at position 0) cannot be concatenated" on
    # the last stage only, after every stage had finished the step (the others returned), its
    # gradients already accumulated (a breaker's find)
    torch.manual_seed(0)
    mod = _OwnLoss()
    ref = _OwnLoss()
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(6, 3)
    sched = schedule(PipelineStage(mod, _Pg()), 3, lambda y, t: y)
    loss = sched.step(x, torch.zeros(6))
    want = sum(ref(c) for c in x.split(2)) / 3
    want.backward()
    assert torch.allclose(loss, want.detach())
    assert torch.allclose(mod.l.weight.grad, ref.l.weight.grad)
    assert sched.last_output.shape == (3,)    # one 0-d output per micro-batch
    assert torch.allclose(sched.last_output, torch.stack([ref(c) for c in x.split(2)]).detach())


class _Ragged(torch.nn.Module):
    """Returns each micro-batch's rows up to its largest index: another width each time."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(3, 3)

    def forward(self, x):
        y = self.l(x)
        return y[:, : 1 + int(x.abs().argmax()) % 3]


def test_outputs_of_other_widths_per_micro_batch_are_kept_as_a_list():
    # before: torch.cat's "Sizes of tensors must match" on the last stage alone, after every
    # stage had finished the step (a breaker's find, from reading)
    torch.manual_seed(0)
    mod = _Ragged()
    x = torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 2.0, 0], [0, 0, 0]])
    sched = ScheduleGPipe(PipelineStage(mod, _Pg()), 2, lambda y, t: y.sum())
    sched.step(x, torch.zeros(4))
    assert [tuple(o.shape) for o in sched.last_output] == [(2, 1), (2, 2)]


class _LM(torch.nn.Module):
    """[b, T] token ids -> [b*T, V] logits, flattened for cross_entropy."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(11, 4)
        self.h = torch.nn.Linear(4, 11)

    def forward(self, x):
        return self.h(self.e(x)).reshape(-1, 11)


@pytest.mark.parametrize("schedule", [ScheduleGPipe, Schedule1F1B])
def test_a_target_flattened_like_the_output_matches_one_process(schedule):
    # a [B*T] target for [b*T, V] outputs of a [B, T] input is split right by M: refused since
    # the target's batch size had to be the input's ("target has 20 rows, the input 4")
    torch.manual_seed(0)
    mod, ref = _LM(), _LM()
    ref.load_state_dict(mod.state_dict())
    x, t = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (20,))
    ce = torch.nn.functional.cross_entropy
    loss = schedule(PipelineStage(mod, _Pg()), 2, ce).step(x, t)
    want = sum(ce(ref(xc), tc) for xc, tc in zip(x.split(2), t.split(10), strict=True)) / 2
    want.backward()
    assert torch.allclose(loss, want.detach())
    assert torch.allclose(mod.h.weight.grad, ref.h.weight.grad)


def test_a_target_of_neither_the_inputs_nor_the_outputs_rows_is_refused():
    stage = PipelineStage(torch.nn.Linear(3, 3), _Pg())
    with pytest.raises(Exception, match="target has 2 rows, the input 6"):
        ScheduleGPipe(stage, 2, torch.nn.functional.mse_loss).step(torch.randn(6, 3), torch.zeros(2, 3))
