"""rtxnet: a distributed training runtime where a failure costs seconds and at most one step.

Start here::

    import rtxnet
    pg = rtxnet.init()            # blocking; reads the environment rtxnet-run sets
    pg.store.set("hello", b"world")
    pg.close()

or, with asyncio::

    async with rtxnet.connect() as pg:
        await pg.store.set("hello", b"world")
"""

from transport.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ClosedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveRefusedError,
    CollectiveTimeout,
    ConfigError,
    ConnectError,
    CoordinatorLostError,
    JobFinishedError,
    JobFullError,
    JournalCorruptError,
    JournalError,
    LinkBrokenError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    RtxError,
    RtxTimeoutError,
    StateLayoutError,
    TransportError,
)

from . import errorfile as _errorfile

_errorfile.install()   # under rtxnet-run only (RTXNET_ERROR_FILE): what ended this rank, for it

# Imported on first use (PEP 562), so `import rtxnet.launcher` / `rtxnet status` start in a
# tenth of a second instead of half (NumPy, ZeroMQ, the collectives), and the torch ones only
# when asked for: `import rtxnet` must not import torch.
_LAZY = {
    "Membership": ("rtxnet.agent", "Membership"),
    "ReduceOp": ("rtxnet.collectives", "ReduceOp"),
    "Timeouts": ("rtxnet.config", "Timeouts"),
    "FaultTolerance": ("rtxnet.elastic", "FaultTolerance"),
    "Work": ("rtxnet.portal", "Work"),
    "BlockingProcessGroup": ("rtxnet.process_group", "BlockingProcessGroup"),
    "ProcessGroup": ("rtxnet.process_group", "ProcessGroup"),
    "Store": ("rtxnet.process_group", "Store"),
    "connect": ("rtxnet.process_group", "connect"),
    "init": ("rtxnet.process_group", "init"),
    "ElasticDistributedSampler": ("rtxnet.sampler", "ElasticDistributedSampler"),
    "StepBatch": ("rtxnet.sampler", "StepBatch"),
    "parallel": ("rtxnet.parallel", None),
    "checkpoint": ("rtxnet.checkpoint", None),
    "DistributedDataParallel": ("rtxnet.parallel.ddp", "DistributedDataParallel"),
    "FullyShardedDataParallel": ("rtxnet.parallel.fsdp", "FullyShardedDataParallel"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != "torch":
                raise
            raise ModuleNotFoundError(
                f"rtxnet.{name} needs PyTorch, which is not installed: pip install 'rtxnet[torch]' "
                f"(or torch itself)", name="torch") from exc
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value   # found directly from now on
        return value
    raise AttributeError(f"module 'rtxnet' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"

__all__ = [
    "BlockingProcessGroup",
    "CheckpointCorruptError",
    "CheckpointError",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "ElasticDistributedSampler",
    "StepBatch",
    "checkpoint",
    "parallel",
    "ClosedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveRefusedError",
    "CollectiveTimeout",
    "FaultTolerance",
    "JobFinishedError",
    "JobFullError",
    "ConfigError",
    "ConnectError",
    "JournalCorruptError",
    "JournalError",
    "LinkBrokenError",
    "Membership",
    "PeerLostError",
    "CoordinatorLostError",
    "ProcessGroup",
    "ProtocolError",
    "ReduceOp",
    "StateLayoutError",
    "RendezvousError",
    "RendezvousTimeout",
    "RtxError",
    "RtxTimeoutError",
    "Store",
    "Timeouts",
    "TransportError",
    "Work",
    "connect",
    "init",
]
