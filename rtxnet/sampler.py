"""An elastic distributed sampler: one seeded global order of samples, split among whoever is there.

Unlike ``torch.utils.data.DistributedSampler``, which fixes each rank's share of an epoch when the
epoch starts, this sampler advances a **global** position: every step takes the next
``global_batch`` indices of the epoch's permutation and splits them among the ranks of the
current world. When the world re-forms with another size at a step boundary
(:meth:`ElasticDistributedSampler.set_world`), the remaining samples are simply split among the new
ranks, so no sample of the epoch is skipped or repeated. The position ``(epoch, consumed)`` is
plain integers in :meth:`ElasticDistributedSampler.state_dict`, part of the committed state.

The permutation of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(num_samples)``
(PCG64 seeded with the pair), identical on every rank and every platform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from transport.errors import ConfigError

__all__ = ["ElasticDistributedSampler", "StepBatch"]

log = structlog.get_logger(__name__)


def _pos_int(name: str, v: Any, *, zero: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < (0 if zero else 1):
        bound = ">= 0" if zero else ">= 1"
        raise ConfigError(f"{name}({v!r}) must be an integer {bound}")
    return int(v)


@dataclass(frozen=True)
class StepBatch:
    """One step's samples as seen by one rank.

    Attributes:
        indices: this rank's sample indices, int64, shape ``[local_n]`` (may be empty when the
            last batch of an epoch has fewer samples than ranks); a read-only view of the
            epoch's order (``.copy()`` it to edit).
        global_n: samples of this step over all ranks; scale a mean loss by
            ``len(indices) / global_n`` and sum gradients for exact equivalence with one process.
        epoch: the data epoch these samples belong to.
        start: position of the step's first sample in the epoch's permutation.
    """

    indices: np.ndarray
    global_n: int
    epoch: int
    start: int

    @property
    def local_n(self) -> int:
        return int(self.indices.shape[0])

    @property
    def loss_weight(self) -> float:
        """``local_n / global_n``: the factor for a mean loss under ``ReduceOp.SUM``."""
        return self.local_n / self.global_n if self.global_n else 0.0


class ElasticDistributedSampler:
    """Global-position sampler whose split among ranks may change at any step boundary.

    Args:
        num_samples: size of the data set (> 0).
        global_batch: samples per step over all ranks (> 0).
        rank, world_size: this rank and the world size (0 <= rank < world_size); change them
            with :meth:`set_world`.
        seed: seed of the permutations.
        shuffle: False keeps the order ``0 .. num_samples-1`` every epoch.
        drop_last: drop an epoch's last step when it has fewer than ``global_batch`` samples.

    Raises:
        ConfigError: a value out of range; names it.

    Each step, the global slice is split in contiguous, nearly equal parts
    (``numpy.array_split``): rank ``r`` of ``W`` gets part ``r``; the first ``global_n % W`` ranks
    get one sample more.
    """

    def __init__(self, num_samples: int, global_batch: int, *, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False):
        self.num_samples = _pos_int("num_samples", num_samples)
        self.global_batch = _pos_int("global_batch", global_batch)
        self.seed = _pos_int("seed", seed, zero=True)
        if self.seed >= 2**63:   # saved in states as an int64 (a torch checkpoint, FaultTolerance)
            raise ConfigError(f"seed({seed!r}) must be an integer in 0..2**63-1")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if drop_last and global_batch > num_samples:
            raise ConfigError(f"drop_last with global_batch({global_batch}) > num_samples({num_samples}) "
                              "leaves no step")
        self.epoch = 0
        self.consumed = 0
        self.rank = 0
        self.world_size = 1
        self.set_world(rank, world_size)
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    # -- world -----------------------------------------------------------------------------------

    def set_world(self, rank: int, world_size: int) -> None:
        """Split the following steps among ``world_size`` ranks, this one being ``rank``.

        Call it at a step boundary whenever the world re-formed (``pg.rank``, ``pg.world_size``).

        Raises:
            ConfigError: ``rank`` not in ``0 .. world_size-1``; names both.
        """
        world_size = _pos_int("world_size", world_size)
        rank = _pos_int("rank", rank, zero=True)
        if rank >= world_size:
            raise ConfigError(f"rank({rank}) must be < world_size({world_size})")
        if (rank, world_size) != (self.rank, self.world_size):
            log.debug("sampler_world_set", rank=rank, world_size=world_size, epoch=self.epoch,
                      consumed=self.consumed)
        self.rank, self.world_size = rank, world_size

    # -- order -----------------------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """The global order of epoch ``epoch``: int64, shape ``[num_samples]``."""
        if self._perm_epoch != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            perm = perm.astype(np.int64)
            # read-only: a batch's indices are views of it, and an edit of them in place changed
            # the order of the epoch, of a step redone after a rollback too (a tester's find)
            perm.flags.writeable = False
            self._perm, self._perm_epoch = perm, epoch
        return self._perm

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return -(-self.num_samples // self.global_batch)

    def _epoch_end(self) -> int:
        if self.drop_last:
            return self.steps_per_epoch * self.global_batch
        return self.num_samples

    def peek(self) -> StepBatch:
        """This rank's share of the next step, without advancing."""
        epoch, start = self.epoch, self.consumed
        if start >= self._epoch_end():
            epoch, start = epoch + 1, 0
        stop = min(start + self.global_batch, self._epoch_end())
        g = self.permutation(epoch)[start:stop]
        part = np.array_split(g, self.world_size)[self.rank]
        return StepBatch(indices=part, global_n=int(g.shape[0]), epoch=epoch, start=start)

    def next_batch(self) -> StepBatch:
        """This rank's share of the next step; advances the global position past the whole
        step (every rank's share)."""
        b = self.peek()
        self.epoch, self.consumed = b.epoch, b.start + b.global_n
        return b

    def __len__(self) -> int:
        return self.steps_per_epoch

    # -- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """Plain ints: ``epoch``, ``consumed`` (global samples of that epoch already taken) and
        the settings that must match when loading."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch": self.global_batch,
                "shuffle": int(self.shuffle), "drop_last": int(self.drop_last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (the rank and world are not part of
        it: call :meth:`set_world` for the current world).

        Raises:
            ConfigError: the saved settings differ from this sampler's (names the value), or the
                position is out of range.
        """
        if not isinstance(state, dict):
            raise ConfigError(f"sampler state must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("epoch", "consumed") if k not in state]
        if missing:
            raise ConfigError(f"sampler state has no {' and no '.join(map(repr, missing))}: "
                              f"not a state_dict() of ElasticDistributedSampler ({sorted(state)!r:.200})")
        for key in ("num_samples", "seed", "global_batch", "shuffle", "drop_last"):
            mine = int(getattr(self, key))
            theirs = state.get(key, mine)
            if not isinstance(theirs, int | np.integer):   # (bool is an int)
                raise ConfigError(f"sampler state has {key}={theirs!r}: not an integer")
            if int(theirs) != mine:
                raise ConfigError(f"sampler state has {key}={int(theirs)}, this sampler has {key}={mine}")
        # (int() of 1.7 or "1" or True took them as positions before: a tester's find)
        epoch = _pos_int("epoch", state["epoch"], zero=True)
        consumed = _pos_int("consumed", state["consumed"], zero=True)
        if consumed > self.num_samples:
            raise ConfigError(f"consumed({consumed}) > num_samples({self.num_samples})")
        self.epoch, self.consumed = epoch, consumed
