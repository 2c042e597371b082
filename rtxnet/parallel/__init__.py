"""Parallelism strategies for PyTorch modules, one module each (``ddp``; later ``fsdp``, ...).

Importing this package imports torch; ``import rtxnet`` alone does not.
"""

from .ddp import DistributedDataParallel

DDP = DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
