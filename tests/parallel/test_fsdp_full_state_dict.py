"""FSDP's load_full_state_dict without rank processes: a world of one on a stand-in group (with
``init_sync=False`` and one rank, building, loading and gathering run no collective)."""

from __future__ import annotations

import pytest
import torch

from rtxnet.parallel import FullyShardedDataParallel
from tests.parallel.fsdp_worker import D_IN, Calibrated

pytestmark = pytest.mark.timeout(30)


class _Pg:
    world_size = 1
    rank = 0
    epoch = 0


class _Tied(torch.nn.Module):
    """An embedding and an output layer sharing one weight (as language models tie them)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i):
        return self.head(self.emb(i))


def test_a_tied_weight_given_under_its_second_name_alone_is_loaded_as_torch_does():
    # checkpoints often keep one name of a tied weight (safetensors drops the duplicate); before,
    # strict=False loaded it only under the name registered first and silently kept the old
    # values when the dict had the other (torch loads it; a breaker's find)
    torch.manual_seed(0)
    ref = _Tied()
    fsdp = FullyShardedDataParallel(_Tied(), _Pg(), init_sync=False)
    new = {"head.weight": torch.full((5, 3), 7.0)}
    ref.load_state_dict(new, strict=False)
    fsdp.load_full_state_dict(new, strict=False)
    full = fsdp.full_state_dict()
    assert torch.equal(full["emb.weight"], ref.emb.weight.detach())
    assert torch.equal(full["head.weight"], ref.head.weight.detach())
    with pytest.raises(Exception, match=r"missing keys \['emb\.weight'\]"):
        fsdp.load_full_state_dict(new)    # strict: the other name is missing, as torch says


def test_a_tied_weight_given_under_both_names_takes_the_last_as_torch_does():
    # torch copies emb.weight, then head.weight, into the one tensor: the second name's values
    # stand; FSDP read the first name's alone
    ref = _Tied()
    fsdp = FullyShardedDataParallel(_Tied(), _Pg(), init_sync=False)
    both = {"emb.weight": torch.full((5, 3), 1.0), "head.weight": torch.full((5, 3), 2.0)}
    ref.load_state_dict(both)
    fsdp.load_full_state_dict(both)
    assert torch.equal(fsdp.full_state_dict()["emb.weight"], ref.emb.weight.detach())


def test_a_module_with_extra_state_is_saved_and_loaded_as_torch_does():
    # before: AttributeError: 'dict' object has no attribute 'detach' from full_state_dict and
    # sharded_state_dict ('numel' at construction with init_sync on several ranks; a breaker's find)
    from rtxnet.parallel import FSDPState

    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(Calibrated(), _Pg(), init_sync=False)
    fsdp(torch.randn(2, D_IN)).sum().backward()
    full = fsdp.full_state_dict()
    assert list(full) == list(Calibrated().state_dict())
    assert full["_extra_state"] == {"calib": 5}
    sharded = fsdp.sharded_state_dict()
    assert sharded["replicated"]["_extra_state"] == {"calib": 5}
    FSDPState(fsdp, torch.optim.SGD(fsdp.parameters(), lr=0.1)).layout_digest()
    fsdp.module.calib = 7
    fsdp.load_sharded_state_dicts([sharded])
    assert fsdp.module.calib == 5
    fsdp.load_full_state_dict({**full, "_extra_state": {"calib": 9}})
    assert fsdp.module.calib == 9
