"""Parallelism strategies for PyTorch modules, one module each: ``ddp``, ``fsdp``, ``tensor``,
``pipeline``.

Importing this package imports torch; ``import rtxnet`` alone does not.
"""

from .ddp import DistributedDataParallel
from .fsdp import FullyShardedDataParallel
from .pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from .tensor import ColumnParallelLinear, RowParallelLinear, shard_mlp

DDP = DistributedDataParallel
FSDP = FullyShardedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "FSDP", "FullyShardedDataParallel", "ColumnParallelLinear", "RowParallelLinear",
           "shard_mlp", "PipelineStage", "ScheduleGPipe", "Schedule1F1B"]
