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
    TransportError,
)

from .agent import Membership
from .collectives import ReduceOp
from .config import Timeouts
from .elastic import FaultTolerance
from .portal import Work
from .process_group import BlockingProcessGroup, ProcessGroup, Store, connect, init
from .sampler import ElasticDistributedSampler, StepBatch

# These import torch; `import rtxnet` must not.
_LAZY = {
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
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'rtxnet' has no attribute {name!r}")

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
