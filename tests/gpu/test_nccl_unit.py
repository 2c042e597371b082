"""``rtxnet.collectives.gpu.nccl``: unique id bytes, GPU topology check, dtype/op mapping, and
``NcclState`` against a fake ``cupy.cuda.nccl`` (all without a GPU); then, marked ``gpu``, a real
NCCL world of 1 and the error for two processes on one GPU.

The fakes record every NCCL call as a tuple, so the tests pin argument order
(``allReduce(send, recv, count, datatype, op, stream)`` as CuPy's signature has it).
"""

from __future__ import annotations

import asyncio
import struct
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from collectives.harness import run_world
from procs import wait_until

from rtxnet.collectives.gpu import nccl as nccl_mod
from rtxnet.collectives.gpu.nccl import (
    NcclState,
    NcclUnavailableError,
    check_distinct_gpus,
    nccl_types,
    nccl_version,
    uid_from_bytes,
    uid_to_bytes,
)
from rtxnet.collectives.reduce_ops import BFLOAT16, ReduceOp
from transport.errors import CollectiveError, CollectiveTimeout


def _real_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"cupy.cuda.nccl is not importable: {exc}")
    if not getattr(nccl, "available", True):
        pytest.skip("cupy.cuda.nccl has no NCCL library")
    return nccl


# -- unique id -----------------------------------------------------------------------------------

def _ids():
    """256 ids; position p of id j holds (j + 7p) % 256: every value at every position."""
    return [bytes((j + 7 * p) % 256 for p in range(128)) for j in range(256)]


@pytest.mark.timeout(30)
def test_uid_round_trip_every_byte_at_every_position():
    for b in _ids():
        assert uid_from_bytes(b, form="bytes") == b
        signed = uid_from_bytes(b, form="signed")
        assert signed == struct.unpack("128b", b)          # C signed char, as CuPy < 14 on x86
        assert uid_to_bytes(signed) == b
        unsigned = uid_from_bytes(b, form="unsigned")
        assert unsigned == tuple(b) and uid_to_bytes(unsigned) == b
        assert uid_to_bytes(list(signed)) == b and uid_to_bytes(bytearray(b)) == b
        assert uid_to_bytes(tuple(np.int8(v) for v in signed)) == b


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [b"", b"\0" * 127, b"\0" * 129, (0,) * 127, (0,) * 129,
                                 (256,) + (0,) * 127, (-129,) + (0,) * 127, (1.0,) + (0,) * 127,
                                 (True,) + (0,) * 127, ("a",) + (0,) * 127, None, 5, "x" * 128])
def test_uid_rejects_wrong_length_and_values(bad):
    with pytest.raises(ValueError):
        uid_to_bytes(bad)


@pytest.mark.timeout(10)
def test_uid_from_bytes_rejects():
    with pytest.raises(ValueError, match="128"):
        uid_from_bytes(b"\0" * 64, form="bytes")
    with pytest.raises(ValueError, match="form"):
        uid_from_bytes(b"\0" * 128, form="hex")


@pytest.mark.timeout(30)
def test_uid_of_real_cupy_is_accepted_by_communicator():
    nccl = _real_nccl()
    raw = nccl.get_unique_id()
    b = uid_to_bytes(raw)
    assert uid_from_bytes(b) == raw and type(uid_from_bytes(b)) is type(raw)
    try:  # without a GPU NCCL fails after the argument check; a TypeError would be ours
        nccl.NcclCommunicator(1, uid_from_bytes(b), 0).destroy()
    except nccl.NcclError:
        pass


@pytest.mark.timeout(10)
def test_nccl_version():
    v = nccl_version()
    assert v is None or v >= 20000


# -- topology ------------------------------------------------------------------------------------

@pytest.mark.timeout(10)
def test_check_distinct_gpus_accepts_distinct():
    check_distinct_gpus({0: {"host": "a", "uuid": "GPU-1"}, 1: {"host": "a", "uuid": "GPU-2"},
                         2: {"host": "b", "uuid": "GPU-1", "bus": 3}})
    check_distinct_gpus({})


@pytest.mark.timeout(10)
def test_check_distinct_gpus_names_ranks_sharing_a_gpu():
    topo = {0: {"host": "h0", "uuid": "GPU-a"}, 1: {"host": "h0", "uuid": "GPU-b"},
            3: {"host": "h0", "uuid": "GPU-a"}, 4: {"host": "h1", "uuid": "GPU-c"},
            5: {"host": "h1", "uuid": "GPU-c"}}
    with pytest.raises(NcclUnavailableError) as ei:
        check_distinct_gpus(topo)
    msg = str(ei.value)
    assert "ranks [0, 3] share GPU GPU-a on h0" in msg and "ranks [4, 5] share GPU GPU-c on h1" in msg
    assert "Duplicate GPU detected" in msg and '"ipc"' in msg
    assert ei.value.ranks == [0, 3, 4, 5] and isinstance(ei.value, CollectiveError)
    with pytest.raises(ValueError, match="rank 2"):
        check_distinct_gpus({2: {"host": "h"}})


# -- dtype / op mapping --------------------------------------------------------------------------

_TABLE = [("float16", 6), ("bfloat16", 9), ("float32", 7), ("float64", 8), ("int8", 0),
          ("int32", 2), ("int64", 4), ("uint8", 1), ("bool", 1)]
_CUPY_NAME = {"float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
              "float64": "NCCL_FLOAT64", "int8": "NCCL_INT8", "int32": "NCCL_INT32",
              "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "bool": "NCCL_UINT8"}


def _dt(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name,code", _TABLE)
def test_dtype_table(name, code):
    assert nccl_types(_dt(name)) == (code, None)


@pytest.mark.timeout(10)
def test_ops_table_int16_and_bool():
    f32 = np.dtype(np.float32)
    assert [nccl_types(f32, op)[1] for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MAX,
                                              ReduceOp.MIN, ReduceOp.AVG)] == [0, 1, 2, 3, 4]
    assert nccl_types(f32, "sum") == (7, 0)
    b = np.dtype(np.bool_)
    assert nccl_types(b, ReduceOp.SUM) == (1, 2)      # logical or: MAX of 0/1 bytes
    assert nccl_types(b, ReduceOp.MIN) == (1, 3)
    assert nccl_types(b, ReduceOp.MAX) == (1, 2)
    for op in (ReduceOp.PROD, ReduceOp.AVG):
        with pytest.raises(ValueError, match="bool"):
            nccl_types(b, op)
    with pytest.raises(ValueError, match="AVG"):
        nccl_types(np.dtype(np.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match="int16"):
        nccl_types(np.dtype(np.int16))
    with pytest.raises(ValueError, match="int16"):
        nccl_types(np.dtype(np.int16), ReduceOp.SUM)


@pytest.mark.timeout(10)
def test_codes_match_cupy_constants():
    nccl = _real_nccl()
    for name, code in _TABLE:
        assert getattr(nccl, _CUPY_NAME[name]) == code, name
    assert [nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN, nccl.NCCL_AVG] == \
        [0, 1, 2, 3, 4]
    assert nccl.NcclError(5).status == nccl_mod._INVALID_USAGE


# -- NcclState against a fake cupy.cuda.nccl -----------------------------------------------------

class FakeNcclError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"NCCL_ERROR status {status}")
        self.status = status


class FakeComm:
    def __init__(self, calls, ndev, uid, rank):
        self.calls, self.ndev, self.uid, self.rank = calls, ndev, uid, rank
        self.fail_on = None

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            if name == self.fail_on:
                raise FakeNcclError(2)
        return call


class FakeNccl:
    NcclError = FakeNcclError

    def __init__(self, uid=bytes(range(128)), init_error=None, gate=None):
        self.calls, self.comms, self.uid = [], [], uid
        self.init_error, self.gate = init_error, gate

    def get_unique_id(self):
        return self.uid

    def NcclCommunicator(self, ndev, uid, rank):  # noqa: N802 - CuPy's name
        if self.gate is not None:
            self.gate.wait(10)
        if self.init_error is not None:
            raise FakeNcclError(self.init_error)
        comm = FakeComm(self.calls, ndev, uid, rank)
        self.comms.append(comm)
        return comm

    def groupStart(self):  # noqa: N802
        self.calls.append(("groupStart",))

    def groupEnd(self):  # noqa: N802
        self.calls.append(("groupEnd",))


class _Device:
    def __init__(self, n):
        self.n = n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


FAKE_CUPY = SimpleNamespace(cuda=SimpleNamespace(Device=_Device))


class FakeKV:
    def __init__(self):
        self.data, self.changed = {}, asyncio.Event()

    async def set(self, key, value):
        self.data[key] = value
        self.changed.set()

    async def wait(self, keys, timeout):
        async def until():
            while not all(k in self.data for k in keys):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(until(), timeout)
        return {k: self.data[k] for k in keys}


def _op(kv=None, timeout_s=5.0):
    return SimpleNamespace(engine=SimpleNamespace(kv=kv), error=None, timeout_s=timeout_s,
                           t0=time.monotonic(), name="test_op")


def _group(rank, size=3):
    return SimpleNamespace(gid="w", ranks=list(range(10, 10 + size)), rank=rank, size=size, epoch=4)


STREAM = SimpleNamespace(device=0, ptr=77, record=lambda: SimpleNamespace(done=True))
TOPO = {r: {"host": "h", "uuid": f"GPU-{r}"} for r in range(10, 13)}
F32 = np.dtype(np.float32)


async def _ready(fake, rank=1, size=3):
    nccl_mod._cupy_nccl = lambda: (FAKE_CUPY, fake)
    st = NcclState(_group(rank, size), 0)
    states = [st if r == rank else NcclState(_group(r, size), 0) for r in range(size)]
    kv = FakeKV()
    await asyncio.gather(*(s.setup(_op(kv), TOPO) for s in states))
    fake.calls.clear()
    return st


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(nccl_mod, "_cupy_nccl", nccl_mod._cupy_nccl)  # restored afterwards
    return FakeNccl()


@pytest.mark.timeout(20)
def test_setup_shares_uid_through_store(fake):
    async def main():
        kv = FakeKV()
        nccl_mod._cupy_nccl = lambda: (FAKE_CUPY, fake)
        states = [NcclState(_group(r), 0) for r in range(3)]
        await asyncio.gather(*(s.setup(_op(kv), TOPO) for s in reversed(states)))
        await states[1].setup(_op(kv), TOPO)          # idempotent: no second communicator
        return kv
    kv = asyncio.run(main())
    assert list(kv.data) == ["rtxnet/nccl/4/w"] and kv.data["rtxnet/nccl/4/w"] == fake.uid
    assert sorted((c.ndev, c.uid, c.rank) for c in fake.comms) == \
        [(3, fake.uid, 0), (3, fake.uid, 1), (3, fake.uid, 2)]


async def _setup_over_mailbox(engine):
    fake = FakeNccl(uid=bytes(range(255, 127, -1)))
    nccl_mod._cupy_nccl = lambda: (FAKE_CUPY, fake)
    st = NcclState(engine.world, 0)
    topo = {r: {"host": "h", "uuid": f"GPU-{r}"} for r in range(engine.view.world_size)}
    await engine.world._collective("nccl_setup", 10, lambda op: st.setup(op, topo))
    # the fake init does not wait for the peers as NCCL's does: keep the engine open (its close
    # drops unsent messages) until every rank has its id
    await engine.world.barrier(timeout=10)
    return [(c.ndev, c.uid, c.rank) for c in fake.comms]


@pytest.mark.timeout(60)
def test_setup_shares_uid_through_mailbox():
    uid = bytes(range(255, 127, -1))
    assert run_world(3, _setup_over_mailbox) == [[(3, uid, r)] for r in range(3)]


@pytest.mark.timeout(20)
def test_operations_call_nccl_with_cupy_argument_order(fake):
    async def main():
        st = await _ready(fake)                       # group rank 1 of 3
        await st.all_reduce(_op(), 100, 200, 5, F32, ReduceOp.AVG, STREAM)
        await st.all_reduce(_op(), 100, 200, 5, np.dtype(np.bool_), ReduceOp.SUM, STREAM)
        await st.broadcast(_op(), 100, 5, BFLOAT16, 2, STREAM)
        await st.reduce(_op(), 100, 200, 5, F32, ReduceOp.MIN, 0, STREAM)
        await st.all_gather(_op(), 100, 200, 5, F32, STREAM)
        await st.reduce_scatter(_op(), 100, 200, 5, np.dtype(np.float16), ReduceOp.SUM, STREAM)
        for call in (st.all_reduce(_op(), 1, 2, 0, F32, ReduceOp.SUM, STREAM),
                     st.broadcast(_op(), 1, 0, F32, 0, STREAM)):
            await call                                # count 0: no NCCL call
        return fake.calls
    assert asyncio.run(main()) == [
        ("allReduce", 100, 200, 5, 7, 4, 77), ("allReduce", 100, 200, 5, 1, 2, 77),
        ("broadcast", 100, 100, 5, 9, 2, 77), ("reduce", 100, 200, 5, 7, 3, 0, 77),
        ("allGather", 100, 200, 5, 7, 77), ("reduceScatter", 100, 200, 5, 6, 0, 77)]


@pytest.mark.timeout(20)
def test_grouped_point_to_point(fake):
    async def main():
        st = await _ready(fake)                       # group rank 1 of 3
        out = []
        await st.gather(_op(), 100, None, 4, F32, 0, STREAM)
        await st.gather(_op(), 100, [300, 301, 302], 4, F32, 1, STREAM)
        await st.gather(_op(), 301, [300, 301, 302], 4, F32, 1, STREAM)   # own part in place
        await st.scatter(_op(), None, 100, 4, F32, 2, STREAM)
        await st.scatter(_op(), [300, 301, 302], 100, 4, F32, 1, STREAM)
        await st.all_to_all(_op(), [10, 11, 12], [1, 0, 3], [20, 11, 22], [2, 0, 0], F32, STREAM)
        await st.all_to_all(_op(), [10, 11, 12], [0, 0, 0], [20, 21, 22], [0, 0, 0], F32, STREAM)
        out.append(fake.calls)
        return out[0]
    s, r, g0, g1 = "send", "recv", ("groupStart",), ("groupEnd",)
    assert asyncio.run(main()) == [
        g0, (s, 100, 4, 7, 0, 77), g1,
        g0, (s, 100, 4, 7, 1, 77), (r, 300, 4, 7, 0, 77), (r, 301, 4, 7, 1, 77),
        (r, 302, 4, 7, 2, 77), g1,
        g0, (r, 300, 4, 7, 0, 77), (r, 302, 4, 7, 2, 77), g1,
        g0, (r, 100, 4, 7, 2, 77), g1,
        g0, (s, 300, 4, 7, 0, 77), (s, 301, 4, 7, 1, 77), (s, 302, 4, 7, 2, 77),
        (r, 100, 4, 7, 1, 77), g1,
        g0, (s, 10, 1, 7, 0, 77), (s, 12, 3, 7, 2, 77), (r, 20, 2, 7, 0, 77), g1]


@pytest.mark.timeout(20)
def test_bad_arguments_raise_before_nccl(fake):
    async def main():
        st = await _ready(fake)
        for call, match in ((st.broadcast(_op(), 1, 4, F32, 3, STREAM), "root"),
                            (st.all_reduce(_op(), 1, 2, -1, F32, ReduceOp.SUM, STREAM), "count"),
                            (st.all_reduce(_op(), 1, 2, 4, np.dtype(np.int16), ReduceOp.SUM,
                                           STREAM), "int16"),
                            (st.gather(_op(), 1, [1, 2], 4, F32, 1, STREAM), "3 entries"),
                            (st.all_gather(_op(), 1, 2, 4, F32, SimpleNamespace(device=1)),
                             "device")):
            with pytest.raises(ValueError, match=match):
                await call
        return fake.calls, st._dead
    assert asyncio.run(main()) == ([], None)


@pytest.mark.timeout(20)
def test_nccl_error_aborts_once_and_later_calls_raise(fake):
    async def main():
        st = await _ready(fake)
        fake.comms[1].fail_on = "allReduce"
        with pytest.raises(CollectiveError, match="NCCL test_op failed") as ei:
            await st.all_reduce(_op(), 1, 2, 4, F32, ReduceOp.SUM, STREAM)
        assert isinstance(ei.value.__cause__, FakeNcclError)
        with pytest.raises(CollectiveError, match="unusable"):
            await st.all_gather(_op(), 1, 2, 4, F32, STREAM)
        with pytest.raises(CollectiveError, match="unusable"):
            await st.setup(_op(), TOPO)
        st.abort()
        st.close()
        return fake.calls
    assert asyncio.run(main()) == [("allReduce", 1, 2, 4, 7, 0, 77), ("abort",)]


@pytest.mark.timeout(20)
def test_op_failure_while_waiting_for_the_gpu_aborts(fake):
    async def main():
        st = await _ready(fake)
        op = _op()
        never = SimpleNamespace(device=0, ptr=77, record=lambda: SimpleNamespace(done=False))
        err = CollectiveTimeout("deadline", ranks=[12], op="all_reduce")
        asyncio.get_running_loop().call_later(0.05, setattr, op, "error", err)
        with pytest.raises(CollectiveTimeout) as ei:
            await st.all_reduce(op, 1, 2, 4, F32, ReduceOp.SUM, never)
        return ei.value is err, fake.calls
    assert asyncio.run(main()) == (True, [("allReduce", 1, 2, 4, 7, 0, 77), ("abort",)])


@pytest.mark.timeout(20)
def test_close_destroys_once(fake):
    async def main():
        st = await _ready(fake)
        st.close()
        st.close()
        st.abort()
        with pytest.raises(CollectiveError, match="closed"):
            await st.all_gather(_op(), 1, 2, 4, F32, STREAM)
        return fake.calls
    assert asyncio.run(main()) == [("destroy",)]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("status,cls", [(5, NcclUnavailableError), (3, CollectiveError)])
def test_init_errors(monkeypatch, status, cls):
    fake = FakeNccl(init_error=status)
    monkeypatch.setattr(nccl_mod, "_cupy_nccl", lambda: (FAKE_CUPY, fake))
    st = NcclState(_group(0, 1), 0)
    with pytest.raises(cls, match="NCCL") as ei:
        asyncio.run(st.setup(_op(), {10: {"host": "h", "uuid": "u"}}))
    assert type(ei.value) is cls
    assert ("Duplicate GPU" in str(ei.value)) == (status == 5)


@pytest.mark.timeout(20)
def test_setup_deadline_abandons_init_and_aborts_its_communicator(monkeypatch):
    gate = threading.Event()
    fake = FakeNccl(gate=gate)
    monkeypatch.setattr(nccl_mod, "_cupy_nccl", lambda: (FAKE_CUPY, fake))
    st = NcclState(_group(0, 1), 0)

    async def main():
        op = _op()
        err = CollectiveTimeout("deadline", ranks=[], op="setup")
        asyncio.get_running_loop().call_later(0.1, setattr, op, "error", err)
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout):
            await st.setup(op, {10: {"host": "h", "uuid": "u"}})
        return time.monotonic() - t0
    assert asyncio.run(main()) < 2.0
    gate.set()                                        # ncclCommInitRank returns late ...
    wait_until(lambda: fake.calls, 2.0, "the late communicator's abort")
    assert fake.calls == [("abort",)]                 # ... and is aborted by its own thread


@pytest.mark.timeout(20)
def test_duplicate_topology_raises_before_nccl_is_touched(monkeypatch):
    def touched():
        raise AssertionError("NCCL touched")
    monkeypatch.setattr(nccl_mod, "_cupy_nccl", touched)
    st = NcclState(_group(0, 2), 0)
    with pytest.raises(NcclUnavailableError, match=r"ranks \[10, 11\] share GPU"):
        asyncio.run(st.setup(_op(), {10: {"host": "h", "uuid": "u"}, 11: {"host": "h", "uuid": "u"}}))


# -- processes (gpu-marked ones need the device) -------------------------------------------------

async def _setup_two(engine, same_uuid: bool):
    st = NcclState(engine.world, 0)
    topo = {r: {"host": engine.hostname, "uuid": "GPU-0" if same_uuid else f"not-GPU-{r}"}
            for r in range(engine.view.world_size)}
    t0 = time.monotonic()
    try:
        await engine.world._collective("nccl_setup", 30, lambda op: st.setup(op, topo))
        out = ["ok", ""]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out = [type(exc).__name__, str(exc)]
    finally:
        st.close()
    return out + [time.monotonic() - t0, "cupy" in sys.modules]


@pytest.mark.timeout(60)
def test_two_processes_same_gpu_refused_by_topology():
    """Every rank raises NcclUnavailableError, or the CollectiveError of the peer's abort when
    that arrived first (Group._collective prefers op.error), with the same message."""
    for name, msg, took, cupy_loaded in run_world(2, _setup_two, True):
        assert name in ("NcclUnavailableError", "CollectiveError"), (name, msg)
        assert "ranks [0, 1] share GPU GPU-0" in msg and "Duplicate GPU detected" in msg, msg
        assert not cupy_loaded and took < 5


@pytest.mark.gpu
@pytest.mark.timeout(90)
def test_two_processes_same_gpu_nccl_refuses_without_hanging():
    """Topology check bypassed: NCCL itself refuses (INVALID_USAGE). A rank whose peer failed
    first may get that peer's abort instead; either way within 30 s, never a hang."""
    for name, msg, took, _ in run_world(2, _setup_two, False, timeout_s=75):
        assert name in ("NcclUnavailableError", "CollectiveError"), (name, msg)
        assert "Duplicate GPU" in msg and took < 30, (name, msg, took)


async def _one_rank_step(st, op, stream, name, s, r, n, dt):
    if name == "broadcast":
        await st.broadcast(op, s, n, dt, 0, stream)
    elif name == "reduce":
        await st.reduce(op, s, r, n, dt, ReduceOp.SUM, 0, stream)
    elif name == "all_gather":
        await st.all_gather(op, s, r, n, dt, stream)
    elif name == "reduce_scatter":
        await st.reduce_scatter(op, s, r, n, dt, ReduceOp.SUM, stream)
    elif name == "gather":
        await st.gather(op, s, [r], n, dt, 0, stream)
    elif name == "scatter":
        await st.scatter(op, [s], r, n, dt, 0, stream)
    else:
        await st.all_to_all(op, [s], [n], [r], [n], dt, stream)


async def _world_of_one(engine):
    import cupy

    from rtxnet.collectives.gpu.stream import DeviceStream

    st, stream, n, guard = NcclState(engine.world, 0), DeviceStream(0), 1000, 16
    topo = {0: {"host": engine.hostname, "uuid": "GPU-0"}}
    bad = []
    rng = np.random.default_rng(0)

    def dev(host):                                    # raw bytes on the GPU, guard bytes after
        return cupy.asarray(np.concatenate([host.view(np.uint8), np.full(guard, 0xA5, np.uint8)]))

    def check(what, d, want):
        got = d.get()
        if got[:want.nbytes].tobytes() != want.tobytes() or (got[want.nbytes:] != 0xA5).any():
            bad.append(what)

    async def body(op):
        await st.setup(op, topo)
        stream.after(cupy.cuda.get_current_stream().ptr)
        for dt in (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32)):
            x = rng.standard_normal(n).astype(dt)
            zeros = np.zeros(n, dt)
            for rop in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
                s, r = dev(x), dev(zeros)
                stream.after(cupy.cuda.get_current_stream().ptr)
                await st.all_reduce(op, s.data.ptr, r.data.ptr, n, dt, rop, stream)
                check(f"all_reduce {rop.name} {dt}", r, x)
            for name in ("broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
                         "scatter", "all_to_all"):
                s, r = dev(x), dev(zeros)
                stream.after(cupy.cuda.get_current_stream().ptr)
                await _one_rank_step(st, op, stream, name, s.data.ptr, r.data.ptr, n, dt)
                check(f"{name} {dt}", s if name == "broadcast" else r, x)
        flags = np.array([0, 1, 1, 0], np.bool_)
        s = dev(flags)
        stream.after(cupy.cuda.get_current_stream().ptr)
        await st.all_reduce(op, s.data.ptr, s.data.ptr, 4, np.dtype(np.bool_), ReduceOp.SUM, stream)
        check("all_reduce bool", s, flags)

    await engine.world._collective("nccl_world_of_one", 60, body)
    st.close()
    return bad


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_world_of_one_matches_cupy():
    """With one rank every collective is a copy: byte-exact output, guard bytes untouched
    (a wrong dtype code or count in elements vs bytes would show), for float16/bfloat16/float32."""
    assert run_world(1, _world_of_one, timeout_s=100) == [[]]
