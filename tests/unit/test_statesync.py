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


def test_ints_beyond_64_bits_round_trip_exactly_as_keys_and_values():
    # a NumPy Generator's state holds 128-bit ints; before, msgpack raised a bare
    # OverflowError ("Python int too large to convert to C unsigned long") naming no key
    rng = np.random.default_rng(0)
    rng.random()
    state = {"rng": rng.bit_generator.state, "edges": [2**64 - 1, -2**63, 2**64, -2**63 - 1],
             "big": (2**100, -2**200), 2**70: "big key", -5: "small key", True: "bool key",
             "flag": False, "u64": np.uint64(2**64 - 1)}
    back = unpack_state(pack_state(state))
    assert back == {**state, "u64": 2**64 - 1}
    assert type(back["flag"]) is bool and type(back["big"][0]) is int and type(back[True]) is str
    restored = np.random.default_rng(1)
    restored.bit_generator.state = back["rng"]
    assert restored.random() == rng.random()


def test_a_blob_with_an_unknown_extension_type_is_malformed():
    import msgpack
    header = msgpack.packb(msgpack.ExtType(7, b"\x01"), use_bin_type=True)
    with pytest.raises(ValueError, match="unknown msgpack extension type 7"):
        unpack_state(len(header).to_bytes(8, "little") + header)


def test_a_state_that_contains_itself_is_refused_naming_the_key_path():
    # before: a bare RecursionError
    d = {"a": {"b": []}}
    d["a"]["b"].append(d["a"])
    with pytest.raises(ValueError, match=r"^state\.a\.b\[0\]: a dict that contains itself \(it is state\.a\) "
                                         r"cannot be part of a synced state$"):
        pack_state(d)
    loop: list = [1]
    loop.append((loop,))
    with pytest.raises(ValueError, match=r"^state\.x\[1\]\[0\]: a list that contains itself \(it is state\.x\)"):
        pack_state({"x": loop})
    shared = [1, 2]   # the same container twice, not inside itself, is fine
    assert unpack_state(pack_state({"a": shared, "b": (shared, shared)})) == {"a": shared, "b": (shared, shared)}


def test_a_state_nested_too_deep_is_refused_naming_the_key_path():
    from rtxnet.statesync import MAX_DEPTH

    def nest(levels: int) -> dict:
        d: dict = {"leaf": 1}
        for _ in range(levels - 1):
            d = {"k": d}
        return d

    assert unpack_state(pack_state(nest(MAX_DEPTH))) == nest(MAX_DEPTH)   # at the limit: fine
    with pytest.raises(ValueError, match=rf"^state\.k\.k\.k.*\.k\.k: containers nested more than "
                                         rf"{MAX_DEPTH} deep cannot be part of a synced state$") as info:
        pack_state(nest(MAX_DEPTH + 1))   # before: fine at 101, a bare RecursionError at ~330
    assert "\n" not in str(info.value) and len(str(info.value)) < 300
    with pytest.raises(ValueError, match="nested more than"):
        pack_state(nest(2000))


def test_a_numpy_scalar_that_has_no_python_value_is_refused_not_recursed_on():
    with pytest.raises(TypeError, match=r"^state\.v: values of type longdouble cannot be part of a synced state$"):
        pack_state({"v": np.longdouble(1.5)})   # before: a bare RecursionError


class BigInts:
    """A FaultTolerance state with a NumPy Generator, and an int that outgrows 64 bits later."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.counter = 1

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state, "counter": self.counter}

    def load_state_dict(self, d):
        self.rng.bit_generator.state = d["rng"]
        self.counter = d["counter"]


def test_fault_tolerance_takes_a_numpy_generator_and_an_int_that_outgrows_64_bits(coordinator):
    # before: FaultTolerance() raised OverflowError from msgpack, and a commit's snapshot too
    with rtxnet.init(coordinator.address, job="snapshot-bigint", world_size=1) as pg:
        state = BigInts()
        ft = rtxnet.FaultTolerance(pg, state)
        while ft.step < 4:
            with ft.guard() as step:
                state.rng.random()
                state.counter <<= 40 * step
        assert state.counter == 2**(40 * 6) and state.counter > 2**64
        assert unpack_state(ft._snapshot) == state.state_dict()
