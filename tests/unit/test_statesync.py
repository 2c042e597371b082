"""rtxnet.statesync: the blobs of FaultTolerance's snapshots, and the reuse of their memory."""

from __future__ import annotations

import numpy as np
import pytest

import rtxnet
from rtxnet.statesync import pack_state, unpack_state

pytestmark = pytest.mark.timeout(60)


def _state(n: int, fill: float) -> dict:
    return {"w": np.full(n, fill, dtype=np.float32), "step": int(fill), "name": "mlp",
            "nested": ({"b": np.arange(3, dtype=np.int64) + int(fill)}, None)}


def _same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["name"] == b["name"] and a["nested"][1] is None
    np.testing.assert_array_equal(a["w"], b["w"])
    np.testing.assert_array_equal(a["nested"][0]["b"], b["nested"][0]["b"])


def test_a_blob_of_the_same_layout_is_written_over_in_place_and_reads_back_the_new_state():
    first = pack_state(_state(1000, 1.0))
    arr = first.obj
    second = pack_state(_state(1000, 2.0), into=arr)
    assert second.obj is arr and second.readonly and not arr.flags.writeable
    assert bytes(second) == bytes(pack_state(_state(1000, 2.0)))   # the bytes a fresh blob holds
    _same(unpack_state(second), _state(1000, 2.0))
    _same(unpack_state(first), _state(1000, 2.0))    # the old view sees the new bytes: the caller's to vouch


def test_a_blob_of_another_size_or_not_its_own_memory_is_left_alone():
    arr = pack_state(_state(1000, 1.0)).obj
    before = arr.copy()
    other = pack_state(_state(500, 2.0), into=arr)       # another layout: a new array
    assert other.obj is not arr and np.array_equal(arr, before)
    _same(unpack_state(other), _state(500, 2.0))
    backing = np.zeros(arr.size * 2, dtype=np.uint8)
    view = backing[:arr.size]                             # a view: not its own memory
    assert pack_state(_state(1000, 3.0), into=view).obj is not view and not backing.any()
    with pytest.raises(TypeError, match=r"state\.x: values of type object cannot be part of a synced state"):
        pack_state({"w": np.zeros(1000, np.float32), "x": object()}, into=arr)
    assert np.array_equal(arr, before)                    # a refused state changes nothing


class Arrays:
    """A FaultTolerance state of NumPy arrays that the steps change in place."""

    def __init__(self, n: int):
        self.w = np.zeros(n, dtype=np.float64)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, d):
        self.w[...] = d["w"]


def test_each_commit_snapshots_into_the_last_snapshots_memory_and_holds_that_step(coordinator):
    with rtxnet.init(coordinator.address, job="snapshot-reuse", world_size=1) as pg:
        state = Arrays(1 << 16)
        ft = rtxnet.FaultTolerance(pg, state)
        arrays = []
        while ft.step < 5:
            with ft.guard() as step:
                state.w += step + 1
            arrays.append(ft._snapshot.obj)
            np.testing.assert_array_equal(unpack_state(ft._snapshot)["w"], state.w)
        # one allocation for the first commit's snapshot, then the same memory every step
        assert all(a is arrays[0] for a in arrays), [id(a) for a in arrays]
        assert state.w[0] == 1 + 2 + 3 + 4 + 5
