"""``GpuGroup``: how one :class:`rtxnet.collectives.Group` runs collectives on GPU arrays.

The backend is chosen per call from the membership every rank sees identically (the hosts the
agents reported, ``WorldView.hosts``), so ranks agree without a message:

================= ===============================================================================
``"ipc"``         every rank of the group on one host (several may share a GPU): CUDA IPC
                  (:mod:`.ipc`). The default there.
``"nccl"``        ranks on several hosts, one GPU each: NCCL (:mod:`.nccl`); the default for every
                  operation but all_reduce across hosts. Refused, with a clear error, when two
                  ranks share a GPU.
``"hierarchical"`` all_reduce across hosts (the default there): reduce within each host over IPC to
                  the host's first rank, all_reduce among those over NCCL, broadcast within each
                  host over IPC. Also available for CPU arrays (shared memory / TCP).
``"local"``       a group of one: copies only (``algorithm="nccl"`` still runs NCCL, a world of 1)
================= ===============================================================================

Every operation runs inside ``Group._collective`` (call-order sequencing, one deadline, the
signature exchange that turns disagreeing ranks into ``CollectiveMismatchError`` on every rank,
aborts on failure) and returns once its result is complete on the GPU and the user's current
stream is ordered after it. send/recv of GPU arrays go through host memory.
"""

from __future__ import annotations

import os

import numpy as np

from rtxnet.collectives.gpu.arrays import GpuBuffer, gpu_buffers
from rtxnet.collectives.gpu.stream import DeviceStream, await_event, foreign_stream
from rtxnet.collectives.reduce_ops import ReduceOp, check_op_dtype, is_bfloat16

__all__ = ["GpuGroup", "GPU_ALGORITHMS"]

GPU_ALGORITHMS = ("ipc", "nccl", "hierarchical")


def _cupy_view(ptr: int, size: int, dtype: np.dtype, device: int):
    """A CuPy array over ``size`` elements at ``ptr`` (bfloat16 seen as uint16), not owning it."""
    import cupy

    dt = np.dtype(np.uint16) if is_bfloat16(dtype) else dtype
    mem = cupy.cuda.UnownedMemory(ptr, size * dt.itemsize, None, device)
    return cupy.ndarray((size,), dt, cupy.cuda.MemoryPointer(mem, 0))


class GpuGroup:
    """GPU side of one group: its device, stream, IPC state and NCCL communicator.

    Created by the group on its first GPU call; the constructor does no CUDA work.
    """

    def __init__(self, group):
        self.group = group
        self.device: int | None = None
        self.stream: DeviceStream | None = None
        self._ipc = None
        self._nccl = None
        self._topo: dict[int, dict] | None = None

    # -- plumbing --------------------------------------------------------------------------------

    def _bind(self, buf: GpuBuffer) -> None:
        if self.device is None:
            self.device = buf.device
            self.stream = DeviceStream(buf.device)
        elif buf.device != self.device:
            raise ValueError(f"group {self.group.gid!r} runs on cuda:{self.device}; got an array "
                             f"on cuda:{buf.device}")

    def choose(self, opname: str, forced: str | None) -> str:
        """The backend for ``opname`` (see the module table).

        Raises:
            ValueError: an unknown algorithm, or ``"ipc"`` for a group spanning hosts.
        """
        g = self.group
        if forced is None and g.algorithm in GPU_ALGORITHMS and (
                g.algorithm != "hierarchical" or opname == "all_reduce"):
            forced = g.algorithm
        if forced is not None and forced not in GPU_ALGORITHMS:
            raise ValueError(f"{opname} on GPU arrays: algorithm {forced!r} not in "
                             f"{GPU_ALGORITHMS}")
        hosts = g.engine.view.hosts
        one_host = len({hosts.get(r) for r in g.ranks}) == 1
        if forced == "ipc" and not one_host:
            raise ValueError(f"{opname}: algorithm 'ipc' needs every rank of group {g.gid!r} on "
                             f"one host")
        if forced == "hierarchical" and opname != "all_reduce":
            raise ValueError(f"{opname}: 'hierarchical' serves all_reduce only")
        if forced is not None:
            return forced
        if g.size == 1:
            return "local"
        if one_host:
            return "ipc"
        return "hierarchical" if opname == "all_reduce" else "nccl"

    def ipc(self):
        if self._ipc is None:
            from rtxnet.collectives.gpu.ipc import IpcState

            self._ipc = IpcState(self.group, self.device, self.stream)
        return self._ipc

    async def nccl(self, op):
        """The group's NCCL communicator, built on first use from the topology exchanged in an
        earlier hello of ``op`` (see :meth:`_hello`)."""
        if self._nccl is None:
            from rtxnet.collectives.gpu.nccl import NcclState

            self._nccl = NcclState(self.group, self.device)
        await self._nccl.setup(op, self._topo)
        return self._nccl

    def _topo_entry(self) -> dict | None:
        if self._topo is not None:
            return None
        from rtxnet.topology import gpu_identity, host_id

        ident = gpu_identity(self.device)
        # without a UUID (no NVML) the PCI bus id names the GPU; without both, nothing can be
        # compared, and NCCL's own refusal of a shared GPU is what the user sees
        uuid = ident.get("uuid") or ident.get("pci_bus_id") or f"unknown:{os.getpid()}"
        return {"host": host_id(), "uuid": uuid, "device": self.device}

    async def _hello(self, op, sig) -> None:
        """NCCL's signature exchange; the first one also carries every rank's GPU identity."""
        mine = self._topo_entry()
        got = await op.hello(sig, mine)
        if self._topo is None:
            self._topo = {self.group.ranks[g]: (got[g][0] or {}) for g in range(op.n)}

    async def _not_ipc(self, op, algo: str, sig, user_stream: int, local, remote) -> None:
        """The body of an operation not over IPC: NCCL's signature exchange (:meth:`_hello`;
        skipped when ``sig`` is None, the caller exchanged its own), rtxnet's stream after the
        user's, then ``local()`` for a group of one (None: nothing to do) or
        ``await remote(communicator)``, and the user's stream after rtxnet's once complete."""
        if algo == "local" and local is None:
            return
        if algo == "nccl" and sig is not None:
            await self._hello(op, sig)
        self.stream.after(user_stream)
        if algo == "local":
            local()
        else:
            await remote(await self.nccl(op))
        await await_event(self.stream.before(user_stream), op)

    def taint(self) -> None:
        if self._ipc is not None:
            self._ipc.taint()

    def close(self) -> None:
        """Unmap IPC memory and destroy/abort the NCCL communicator (the group's epoch ended)."""
        if self._ipc is not None:
            self._ipc.close()
        if self._nccl is not None:
            self._nccl.close()

    async def _run(self, name: str, timeout, body, user_stream: int):
        """``body`` as the group's next collective. On failure the user's stream is still
        ordered after rtxnet's (bounded: that stream never waits on another process), so memory
        freed after the error is not reused by the user's later work while an abandoned kernel
        or copy may still write it."""
        try:
            return await self.group._collective(name, timeout, body)
        except BaseException:
            if self.stream is not None:
                try:
                    self.stream.before(user_stream)
                except Exception:  # noqa: BLE001 - a broken context: the original error matters
                    pass
            raise

    # -- collectives (arguments and errors as the same-named Group methods) ----------------------

    async def all_reduce(self, tensor, op: ReduceOp, timeout, algorithm):
        buf = GpuBuffer(tensor)
        rop = check_op_dtype(op, buf.dtype)
        self._bind(buf)
        algo = self.choose("all_reduce", algorithm)
        g = self.group
        if algo == "hierarchical":
            return await g._hierarchical_all_reduce(tensor, rop, timeout, (buf.dtype, buf.size, buf.shape))
        sig = g._sig("all_reduce", algo, rop, None, buf.dtype, buf.size, buf.shape)

        async def body(op):
            if algo == "ipc":
                await self.ipc().all_reduce(op, sig, buf, rop)
            else:
                await self._not_ipc(op, algo, sig, buf.stream, None, lambda comm: comm.all_reduce(
                    op, buf.ptr, buf.ptr, buf.size, buf.dtype, rop, self.stream))
            buf.commit()
            return tensor

        return await self._run("all_reduce", timeout, body, buf.stream)

    async def broadcast(self, tensor, src: int, timeout, algorithm):
        g = self.group
        src = g._check_root("broadcast", src)
        buf = GpuBuffer(tensor, readonly=(g.rank == src))
        self._bind(buf)
        algo = self.choose("broadcast", algorithm)
        sig = g._sig("broadcast", algo, None, src, buf.dtype, buf.size, buf.shape)

        async def body(op):
            if algo == "ipc":
                await self.ipc().broadcast(op, sig, buf, src)
            else:
                await self._not_ipc(op, algo, sig, buf.stream, None, lambda comm: comm.broadcast(
                    op, buf.ptr, buf.size, buf.dtype, src, self.stream))
            if g.rank != src:
                buf.commit()
            return tensor

        return await self._run("broadcast", timeout, body, buf.stream)

    async def reduce(self, tensor, dst: int, op: ReduceOp, timeout, algorithm=None):
        g = self.group
        dst = g._check_root("reduce", dst)
        buf = GpuBuffer(tensor)
        rop = check_op_dtype(op, buf.dtype)
        self._bind(buf)
        algo = self.choose("reduce", algorithm)
        sig = g._sig("reduce", algo, rop, dst, buf.dtype, buf.size, buf.shape)

        async def body(op):
            if algo == "ipc":
                await self.ipc().reduce(op, sig, buf, dst, rop)
            else:
                await self._not_ipc(op, algo, sig, buf.stream, None, lambda comm: comm.reduce(
                    op, buf.ptr, buf.ptr, buf.size, buf.dtype, rop, dst, self.stream))
            if g.rank == dst:
                buf.commit()
            return tensor

        return await self._run("reduce", timeout, body, buf.stream)

    async def all_gather(self, output, input, timeout, algorithm):
        g = self.group
        n = g.size
        ib = GpuBuffer(input, readonly=True)
        self._bind(ib)
        outs, slots = gpu_buffers("all_gather output", output, n, ib.size, ib.dtype,
                                  readonly=False)
        algo = self.choose("all_gather", algorithm)
        sig = g._sig("all_gather", algo, None, None, ib.dtype, ib.size, ib.shape)
        nbytes = ib.nbytes

        async def body(op):
            async def remote(comm):
                if len(outs) == 1:
                    await comm.all_gather(op, ib.ptr, slots[0], ib.size, ib.dtype, self.stream)
                    return
                # a list of outputs: NCCL needs one contiguous receive buffer
                tmp = self._scratch(n * ib.size, ib.dtype)
                await comm.all_gather(op, ib.ptr, tmp.data.ptr, ib.size, ib.dtype, self.stream)
                for k in range(n):
                    self._copy(slots[k], tmp.data.ptr + k * nbytes, nbytes)

            if algo == "ipc":
                await self.ipc().all_gather(op, sig, ib, slots)
            else:
                await self._not_ipc(op, algo, sig, ib.stream,
                                    lambda: self._copy(slots[0], ib.ptr, nbytes), remote)
            for b in outs:
                b.commit()
            return output

        return await self._run("all_gather", timeout, body, ib.stream)

    async def reduce_scatter(self, output, input, op: ReduceOp, timeout, algorithm):
        g = self.group
        n = g.size
        ob = GpuBuffer(output)
        rop = check_op_dtype(op, ob.dtype)
        self._bind(ob)
        ins, parts = gpu_buffers("reduce_scatter input", input, n, ob.size, ob.dtype,
                                 readonly=True)
        algo = self.choose("reduce_scatter", algorithm)
        sig = g._sig("reduce_scatter", algo, rop, None, ob.dtype, ob.size, ob.shape)
        nbytes = ob.nbytes

        async def body(op):
            async def remote(comm):
                send = parts[0]
                if len(ins) > 1:  # a list of inputs: NCCL needs one contiguous send buffer
                    tmp = self._scratch(n * ob.size, ob.dtype)
                    for k in range(n):
                        self._copy(tmp.data.ptr + k * nbytes, parts[k], nbytes)
                    send = tmp.data.ptr
                await comm.reduce_scatter(op, send, ob.ptr, ob.size, ob.dtype, rop, self.stream)

            if algo == "ipc":
                await self.ipc().reduce_scatter(op, sig, parts, ob, rop)
            else:
                await self._not_ipc(op, algo, sig, ob.stream,
                                    lambda: self._copy(ob.ptr, parts[0], nbytes), remote)
            ob.commit()
            return output

        return await self._run("reduce_scatter", timeout, body, ob.stream)

    async def gather(self, tensor, gather_list, dst: int, timeout, algorithm=None):
        g = self.group
        dst = g._check_root("gather", dst)
        ib = GpuBuffer(tensor, readonly=True)
        self._bind(ib)
        outs, slots = self._root_list("gather", "gather_list", "destination", gather_list, dst,
                                      ib, readonly=False)
        algo = self.choose("gather", algorithm)
        sig = g._sig("gather", algo, None, dst, ib.dtype, ib.size, ib.shape)

        async def body(op):
            if algo == "ipc":
                await self.ipc().gather(op, sig, ib, slots, dst)
            else:
                await self._not_ipc(
                    op, algo, sig, ib.stream, lambda: self._copy(slots[0], ib.ptr, ib.nbytes),
                    lambda comm: comm.gather(op, ib.ptr, slots, ib.size, ib.dtype, dst, self.stream))
            for b in outs or ():
                b.commit()
            return gather_list

        return await self._run("gather", timeout, body, ib.stream)

    async def scatter(self, tensor, scatter_list, src: int, timeout, algorithm=None):
        g = self.group
        src = g._check_root("scatter", src)
        ob = GpuBuffer(tensor)
        self._bind(ob)
        _, parts = self._root_list("scatter", "scatter_list", "source", scatter_list, src, ob,
                                   readonly=True)
        algo = self.choose("scatter", algorithm)
        sig = g._sig("scatter", algo, None, src, ob.dtype, ob.size, ob.shape)

        async def body(op):
            if algo == "ipc":
                await self.ipc().scatter(op, sig, parts, ob, src)
            else:
                await self._not_ipc(
                    op, algo, sig, ob.stream, lambda: self._copy(ob.ptr, parts[0], ob.nbytes),
                    lambda comm: comm.scatter(op, parts, ob.ptr, ob.size, ob.dtype, src, self.stream))
            ob.commit()
            return tensor

        return await self._run("scatter", timeout, body, ob.stream)

    async def all_to_all(self, output, input, timeout, algorithm=None):
        from rtxnet.collectives.group import _check_splits

        g = self.group
        n = g.size
        ins, in_parts, in_counts = self._split("all_to_all input", input, n, readonly=True)
        outs, out_parts, out_counts = self._split("all_to_all output", output, n, readonly=False)
        dtype = ins[0].dtype
        for b in ins + outs:
            if b.dtype != dtype:
                raise ValueError(f"all_to_all mixes dtypes {b.dtype} and {dtype}")
        self._bind(ins[0])
        user_stream = ins[0].stream
        splits = [in_counts, out_counts]
        algo = self.choose("all_to_all", algorithm)
        sig = g._sig("all_to_all", algo, None, None, dtype, None, None, None)
        isz = dtype.itemsize

        def check(extras: dict) -> None:
            _check_splits(g, {k: extras[k] for k in range(n)})

        async def body(op):
            if algo == "ipc":
                await self.ipc().all_to_all(op, sig, user_stream, in_parts, splits, out_parts,
                                            isz, check)
            else:
                if algo == "nccl":   # its own hello: the splits travel with the topology
                    got = await op.hello(sig, [splits, self._topo_entry()])
                    if self._topo is None:
                        self._topo = {g.ranks[k]: (got[k][0][1] or {}) for k in range(n)}
                    check({k: got[k][0][0] for k in range(n)})
                await self._not_ipc(
                    op, algo, None, user_stream,
                    lambda: self._copy(out_parts[0], in_parts[0], in_counts[0] * isz),
                    lambda comm: comm.all_to_all(op, in_parts, in_counts, out_parts, out_counts,
                                                 dtype, self.stream))
            for b in outs:
                b.commit()
            return output

        return await self._run("all_to_all", timeout, body, user_stream)

    def _root_list(self, opname: str, name: str, role: str, lst, root: int, like: GpuBuffer, *,
                   readonly: bool) -> tuple[list[GpuBuffer] | None, list[int] | None]:
        """On the root: the buffers and addresses of ``lst`` (one array per rank, each like
        ``like``); elsewhere ``(None, None)``.

        Raises:
            ValueError: ``lst`` missing on the root, or of the wrong length, size or dtype.
        """
        if self.group.rank != root:
            return None, None
        if lst is None:
            raise ValueError(f"{opname}: {name} is required on the {role} rank")
        return gpu_buffers(name, list(lst), self.group.size, like.size, like.dtype,
                           readonly=readonly)

    def _split(self, name: str, arg, n: int, *, readonly: bool):
        if isinstance(arg, (list, tuple)):
            if len(arg) != n:
                raise ValueError(f"{name} has {len(arg)} entries, group size is {n}")
            bufs = [GpuBuffer(t, readonly=readonly) for t in arg]
            return bufs, [b.ptr for b in bufs], [b.size for b in bufs]
        b = GpuBuffer(arg, readonly=readonly)
        if b.size % n:
            raise ValueError(f"{name} of {b.size} elements not divisible by {n}")
        m = b.size // n
        return [b], [b.at(k * m) for k in range(n)], [m] * n

    # -- point to point, through host memory ---------------------------------------------------

    async def send(self, tensor, dst: int, tag: int, timeout) -> None:
        buf = GpuBuffer(tensor, readonly=True)
        host = await self._to_host(buf, self.group._timeout_s(timeout))
        await self.group._send_host(host, dst, tag, timeout)

    async def recv(self, tensor, src: int, tag: int, timeout) -> int:
        import cupy

        buf = GpuBuffer(tensor)
        self._bind(buf)
        host = np.empty(buf.shape, buf.dtype)
        got = await self.group._recv_host(host, src, tag, timeout)
        if buf.size:
            view = _cupy_view(buf.ptr, buf.size, buf.dtype, buf.device)
            user = foreign_stream(buf.stream, buf.device)
            with cupy.cuda.Device(buf.device), user:
                view.set(host.reshape(-1).view(view.dtype), stream=user)
                ev = cupy.cuda.Event(block=False, disable_timing=True)
                ev.record(user)
            await await_event(ev, timeout_s=self.group._timeout_s(timeout))
        buf.commit()
        return got

    async def _to_host(self, buf: GpuBuffer, timeout_s: float) -> np.ndarray:
        self._bind(buf)
        host = np.empty(buf.size, buf.dtype)
        if buf.size:
            # wait (polling) for the producer's pending work first: a device-to-pageable copy
            # returns only when done, and must not hold the loop while that work runs
            self.stream.after(buf.stream)
            await await_event(self.stream.record(), timeout_s=timeout_s)
            view = _cupy_view(buf.ptr, buf.size, buf.dtype, buf.device)
            with self.stream.use():
                view.get(stream=self.stream.stream, out=host.view(view.dtype), blocking=False)
            await await_event(self.stream.record(), timeout_s=timeout_s)
        return host.reshape(buf.shape)

    # -- helpers ---------------------------------------------------------------------------------

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        from rtxnet.collectives.gpu import kernels

        if nbytes and dst != src:
            kernels.copy(dst, src, nbytes, stream=self.stream.ptr)

    def _scratch(self, count: int, dtype: np.dtype):
        import cupy

        dt = np.dtype(np.uint16) if is_bfloat16(dtype) else dtype
        # allocated with rtxnet's stream current: CuPy's pool hands a freed block out again only
        # to work on that stream, so copies still queued out of it cannot see it reused
        with self.stream.use(), self.stream.stream:
            return cupy.empty(max(count, 1), dt)
