"""Parallelism strategies for PyTorch modules, one module each (``ddp``; later ``fsdp``, ...).

Importing this package imports torch; ``import rtxnet`` alone does not.
"""

from .ddp import DistributedDataParallel
from .pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from .tensor import ColumnParallelLinear, RowParallelLinear, shard_mlp

DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel", "ColumnParallelLinear", "RowParallelLinear",
           "shard_mlp", "PipelineStage", "ScheduleGPipe", "Schedule1F1B"]
