"""Parallelism strategies for PyTorch modules, one module each: ``ddp``, ``fsdp``, ``tensor``,
``pipeline``; ``mesh`` lays the ranks out as a grid of subgroups to combine them.

Importing this package imports torch; ``import rtxnet`` alone does not.
"""

from .ddp import DistributedDataParallel
from .fsdp import FSDPState, FullyShardedDataParallel
from .mesh import DeviceMesh
from .pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from .tensor import ColumnParallelLinear, RowParallelLinear, clip_grad_norm_, shard_mlp, tp_group_of

DDP = DistributedDataParallel
FSDP = FullyShardedDataParallel

__all__ = ["DDP", "DeviceMesh", "DistributedDataParallel", "FSDP", "FSDPState", "FullyShardedDataParallel", "ColumnParallelLinear", "RowParallelLinear",
           "shard_mlp", "clip_grad_norm_", "tp_group_of", "PipelineStage", "ScheduleGPipe", "Schedule1F1B"]
