"""The world group one step of a wrapper (DDP's buckets, FSDP's gathers) began in.

A step that calls several collectives at different times must call all of them in one world.
Reading ``pg.epoch`` and then calling ``pg.all_reduce`` is not atomic: the agent's thread may
enter a new epoch between the two, and the collective then runs in the new world on this rank
alone, one operation ahead of every other rank there (each later collective pairs with the wrong
one). :class:`StepWorld` takes the world group once and sends every collective of the step to it;
after a membership change that group raises ``PeerLostError`` instead.
"""

from __future__ import annotations

import contextlib
from typing import Any


def group_size(pg: Any) -> int:
    """The size of a world group (``world_size``) or of a subgroup (``size``)."""
    ws = getattr(pg, "world_size", None)
    return int(pg.size if ws is None else ws)


class StepWorld:
    """The world group of the current step of ``pg`` (a process group, blocking or async, or a
    subgroup: a subgroup belongs to one epoch already and is used as it is)."""

    def __init__(self, pg: Any):
        self._apg = getattr(pg, "async_pg", pg)
        self.world: Any = None

    def begin(self) -> int | None:
        """Take the world group collectives go to now; returns its epoch (``None`` if unknown)."""
        current = getattr(self._apg, "current_world", None)
        self.world = current() if current is not None else None
        if self.world is not None:
            return self.world.epoch
        return getattr(self._apg, "epoch", None)

    def pinned(self) -> contextlib.AbstractContextManager:
        """A block whose collectives go to the step's world group (nothing to pin before
        :meth:`begin` or for a subgroup)."""
        if self.world is None:
            return contextlib.nullcontext()
        return self._apg.pinned(self.world)
