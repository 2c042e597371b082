"""Codec limits and the wire contract, property-based where it pays."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import wire
from transport.codec import Limits, decode, encode, encode_with_packed
from transport.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False), st.text(max_size=50), st.binary(max_size=100),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=8), st.dictionaries(st.text(max_size=10), inner, max_size=8)),
    max_leaves=40,
)
# header values: the fields' types matter to validate, not deep nesting (max_leaves 40 took 6 s)
small_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=6,
)


@given(values)
@settings(max_examples=150, deadline=None)
def test_round_trip_preserves_values_and_keeps_bytes_as_bytes(v):
    assert decode(encode(v)) == v


@given(st.dictionaries(st.text(max_size=10).filter(lambda k: k != "body"), small_values, max_size=20), values)
@settings(max_examples=100, deadline=None)
def test_a_message_with_a_value_encoded_before_is_the_message_encoded_whole(head, body):
    # (a status answer encoded once for many replies: the bytes must be exactly encode's)
    assert encode_with_packed(head, "body", encode(body)) == encode({**head, "body": body})


def test_a_message_with_a_value_encoded_before_keeps_the_size_limit():
    head = {f"k{i}": i for i in range(20)}       # (a map 16 header, past fixmap's 15)
    packed = encode(b"x" * 900)
    assert decode(encode_with_packed(head, "body", packed)) == {**head, "body": b"x" * 900}
    with pytest.raises(ProtocolError, match="exceeds the limit of 1000 bytes"):
        encode_with_packed(head, "body", packed, limits=Limits(max_message_nbytes=1000))


@given(st.one_of(st.integers(max_value=-(2**63) - 1), st.integers(min_value=2**64)))
def test_integers_outside_64_bits_are_protocol_errors(i):
    with pytest.raises(ProtocolError, match="64-bit"):
        encode({"x": i})


@given(st.binary(max_size=200))
@settings(max_examples=200, deadline=None)
def test_arbitrary_bytes_never_crash_decode(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@given(st.integers(min_value=1, max_value=64), st.sampled_from(["bin", "str", "array", "map"]))
@settings(max_examples=100, deadline=None)
def test_each_length_limit_is_enforced(n, kind):
    limits = Limits(max_message_nbytes=1 << 20, max_bin_len=n, max_str_len=n, max_array_len=n, max_map_len=n)
    over = n + 1
    obj = {"bin": b"x" * over, "str": "y" * over, "array": [0] * over, "map": {str(i): 0 for i in range(over)}}[kind]
    data = msgpack.packb(obj, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode(data, limits=limits)
    at = {"bin": b"x" * n, "str": "y" * n, "array": [0] * n, "map": {str(i): 0 for i in range(n)}}[kind]
    assert decode(msgpack.packb(at, use_bin_type=True), limits=limits) == at


def test_oversize_message_refused_both_ways():
    limits = Limits(max_message_nbytes=100)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        encode({"x": b"a" * 200}, limits=limits)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(b"\x00" * 101, limits=limits)


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", encode({"a": 1}) + b"x", b"\xd4\x01\x00", b"\xa2\xff\xfe",
    msgpack.packb({(1, 2): 3}),
])
def test_malformed_inputs(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_unencodable_type_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        encode({"x": object()})


def good_join() -> dict:
    return wire.make("join", rid=1, job="j", identity="i", token="", rank=None, min_ranks=1, max_ranks=2,
                     last_call_s=0.5, heartbeat_timeout_s=2.0, endpoint="tcp://x:1", host="h", pid=3)


def test_validate_accepts_the_contract():
    assert wire.validate(decode(encode(good_join())))["t"] == "join"


@pytest.mark.parametrize("mutate, match", [
    (lambda m: m.update(v=2), "protocol version 2"),
    (lambda m: m.update(t="nope"), "unknown message type 'nope'"),
    (lambda m: m.pop("rid"), "header field 'rid'"),
    (lambda m: m.pop("pid"), "join.pid missing"),
    (lambda m: m.update(min_ranks="1"), "join.min_ranks"),
    (lambda m: m.update(min_ranks=True), "got bool"),
    (lambda m: m.update(rank=1.5), "join.rank"),
])
def test_validate_names_what_is_wrong(mutate, match):
    m = good_join()
    mutate(m)
    with pytest.raises(ProtocolError, match=match):
        wire.validate(m)


def test_validate_rejects_non_maps():
    with pytest.raises(ProtocolError, match="not a map"):
        wire.validate([1, 2])


@given(st.dictionaries(st.sampled_from(list(wire.HEADER) + ["identity", "key", "value"]), small_values, max_size=8))
@settings(max_examples=150, deadline=None)
def test_validate_never_raises_anything_but_protocol_error(m):
    try:
        wire.validate(m)
    except ProtocolError:
        pass


def test_a_large_reply_body_sent_again_is_the_same_bytes_as_encoded_whole():
    # (the control server keeps the last large body's bytes, cut from the message that carried
    # it, and splices them into the next reply holding the same body object)
    import asyncio

    from transport.channel import ControlServer

    async def main():
        srv = ControlServer("tcp://127.0.0.1:0")
        try:
            body = {"jobs": [{"job": f"j{i}", "x": "y" * 100} for i in range(300)]}
            for rid in (1, 2, 3):
                msg = wire.make("reply", rid=rid, job="j", epoch=-1, ok=True, body=body)
                assert srv._encode(msg) == encode(msg)
            assert srv._memo is not None and srv._memo[0] is body
            small = wire.make("reply", rid=4, job="j", epoch=0, ok=True, body={"state": "member"})
            assert srv._encode(small) == encode(small) and srv._memo[0] is body
        finally:
            await srv.aclose()

    asyncio.run(main())
