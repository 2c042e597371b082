"""Durable file writes shared by the coordinator's journal and rtxnet's checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a folder, so a rename or unlink inside it survives a power cut (POSIX).

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(Path(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
