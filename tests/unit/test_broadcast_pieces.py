"""DDP's broadcasts of parameters and buffers cut into pieces (``rtxnet.parallel.ddp.broadcast_pieces``).

The pieces are checked on real tensors here; ``tests/parallel/test_ddp.py`` runs the broadcasts
themselves in pieces of 1 KiB across 4 ranks (``ddp_worker.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from rtxnet.parallel.ddp import broadcast_pieces  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), max_size=30), cap=st.integers(1, 1200))
def test_every_tensor_once_in_order_and_pieces_within_the_cap(sizes, cap):
    ts = [torch.zeros(n, dtype=torch.float32) for n in sizes]
    pieces = broadcast_pieces(ts, cap)
    flat = [t for piece in pieces for t in piece]
    assert len(flat) == len(ts) and all(a is b for a, b in zip(flat, ts, strict=True))
    for piece in pieces:
        nbytes = sum(t.numel() * 4 for t in piece)
        assert piece and (nbytes <= cap or len(piece) == 1), (piece, cap)
    # no two neighbouring pieces could have been one (the cut is greedy)
    for a, b in zip(pieces, pieces[1:], strict=False):
        assert sum(t.numel() * 4 for t in a) + b[0].numel() * 4 > cap


def test_a_cap_that_is_not_positive_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"cap_nbytes must be positive, got 0"):
        broadcast_pieces([torch.zeros(1)], 0)
