"""A device mesh: the ranks of one world laid out as an n-dimensional grid, with one subgroup per
dimension, for hybrid parallelism (data parallel across tensor-parallel replicas, say), as
``torch.distributed.device_mesh.init_device_mesh`` lays it out.

Ranks fill the grid in row-major order (the last dimension varies fastest), so with
``DeviceMesh(pg, (2, 2), ("dp", "tp"))`` on 4 ranks the tensor-parallel groups are ``[0, 1]`` and
``[2, 3]`` (neighbouring ranks, on one host under ``rtxnet-run``) and the data-parallel groups
``[0, 2]`` and ``[1, 3]``. Each rank belongs to exactly one group per dimension: the ranks whose
coordinates equal its own in every other dimension.

Hybrid data x tensor parallelism::

    mesh = DeviceMesh(pg, (-1, 2), ("dp", "tp"))        # -1: whatever the world size allows
    net = shard_mlp(MLP(), mesh.get_group("tp"), up="fc1", down="fc2")
    model = DistributedDataParallel(net, mesh.get_group("dp"))
    # feed replica mesh.get_local_rank("dp") its slice of the global batch, the same on every
    # rank of one tensor-parallel group

**Epochs.** The subgroups belong to the epoch the mesh was built in: after a membership change
their collectives raise ``PeerLostError``. Build a new mesh for the new world (with ``-1`` in the
data-parallel dimension, the same code fits any world size that the other dimensions divide),
e.g. in ``FaultTolerance``'s ``on_world(rank, world_size)`` hook, which runs on every rank after
each sync. Building the same mesh again in the same epoch returns the same subgroups, so the
hook may rebuild unconditionally, also on a replacement that built its mesh at start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from transport.errors import ConfigError

from ._world import check_group, group_size

__all__ = ["DeviceMesh"]

# attribute of a process group (or subgroup) holding ``(epoch, {(shape, dim_names): groups})``:
# the subgroups of the meshes built on it in that epoch
_BUILT = "_rtxnet_meshes"


class DeviceMesh:
    """The ranks of ``pg`` as a grid of ``shape``, one subgroup per named dimension.

    Building it creates the subgroups (``pg.new_group``, no communication); every rank of ``pg``
    must build the same meshes in the same order, as with ``new_group``, except that a mesh of
    the same ``shape`` and ``dim_names`` built again on ``pg`` in the same epoch takes the
    subgroups of the first one (no new groups): building it at start and again in a recovery
    hook (``FaultTolerance``'s ``on_world``) gives a replacement, which does both in the epoch
    it joined, the groups of the survivors, which rebuild once in that epoch. A new epoch makes
    new subgroups.

    Args:
        pg: a :class:`rtxnet.BlockingProcessGroup` (``rtxnet.init()``) or a subgroup of one.
        shape: the grid's size in each dimension, positive ints whose product is the group's
            size; one entry may be ``-1``, meaning the size left over (the group's size divided by
            the product of the others).
        dim_names: one distinct name per dimension, e.g. ``("dp", "tp")``.

    Raises:
        ConfigError: ``shape`` is not a sequence of ints >= 1 (one ``-1`` allowed); its product
            differs from the group's size, or the group's size is not a multiple of the other
            dimensions' product (names both); ``dim_names`` are not distinct strings, one per
            dimension.

    Attributes:
        shape: the grid's size per dimension (``-1`` resolved).
        dim_names: the names, in dimension order.
        epoch: the epoch of ``pg`` when the mesh was built (its subgroups belong to it).
    """

    def __init__(self, pg: Any, shape: Sequence[int], dim_names: Sequence[str]):
        check_group(pg, "DeviceMesh")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape or any(
                isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1) for n in shape):
            raise ConfigError(f"DeviceMesh shape({shape!r}) must be a non-empty sequence of ints "
                              ">= 1 (one -1 allowed)")
        if list(shape).count(-1) > 1:
            raise ConfigError(f"DeviceMesh shape({tuple(shape)!r}) may have at most one -1")
        if (isinstance(dim_names, str) or not isinstance(dim_names, Sequence)
                or len(dim_names) != len(shape)
                or not all(isinstance(n, str) and n for n in dim_names)
                or len(set(dim_names)) != len(dim_names)):
            raise ConfigError(f"DeviceMesh dim_names({dim_names!r}) must be {len(shape)} distinct, "
                              f"non-empty strings, one per dimension of shape({tuple(shape)!r})")
        size = group_size(pg)
        known = math.prod(n for n in shape if n != -1)
        if -1 in shape:
            if size % known:
                raise ConfigError(f"DeviceMesh shape({tuple(shape)!r}): the group's size({size}) "
                                  f"is not a multiple of {known}")
            shape = [size // known if n == -1 else n for n in shape]
        if math.prod(shape) != size:
            raise ConfigError(f"DeviceMesh shape({tuple(shape)!r}) holds {math.prod(shape)} ranks, "
                              f"the group has size({size})")
        self.shape = tuple(shape)
        self.dim_names = tuple(dim_names)
        self.epoch = pg.epoch
        self._rank = pg.rank
        # a subgroup's new_group takes world ranks: map grid positions (group ranks) to them
        ranks = getattr(pg, "ranks", None)   # (a world group has none: its ranks are the positions)
        self._coord = _unravel(self._rank, self.shape)
        # A mesh of this layout built on ``pg`` earlier in this epoch: take its subgroups. Ids of
        # new_group count the groups of one rank set made in the epoch, so a replacement that
        # built its mesh at start and again in FaultTolerance's on_world, in the epoch where the
        # survivors rebuilt theirs once, ran '2,3#1' against their '2,3#0' and its first step
        # waited out the whole op timeout (a tester's find).
        built = vars(pg).get(_BUILT)
        key = (self.shape, self.dim_names)
        if built is not None and built[0] == self.epoch and key in built[1] and all(
                getattr(g, "_dead", None) is None for g in built[1][key].values()):
            self._groups: dict[str, Any] = dict(built[1][key])
            return
        self._groups = {}
        for d, name in enumerate(self.dim_names):
            members = []
            for i in range(self.shape[d]):
                c = list(self._coord)
                c[d] = i
                g = _ravel(c, self.shape)
                members.append(ranks[g] if ranks is not None else g)
            self._groups[name] = pg.new_group(members)
        # keyed by the subgroups' own epoch: the world may have moved on since pg.epoch was read
        made_in = getattr(next(iter(self._groups.values())), "epoch", self.epoch)
        if made_in != self.epoch:
            self.epoch = made_in
        if built is None or built[0] != made_in:
            built = (made_in, {})
            vars(pg)[_BUILT] = built
        built[1][key] = dict(self._groups)

    def _dim(self, name: str) -> int:
        if name not in self.dim_names:
            raise ConfigError(f"DeviceMesh has no dimension {name!r}; it has {list(self.dim_names)}")
        return self.dim_names.index(name)

    def get_group(self, name: str) -> Any:
        """This rank's subgroup along dimension ``name`` (blocking or async, as ``pg`` is):
        ``size(name)`` ranks, ordered by world rank (``new_group`` sorts them): by their
        coordinate in that dimension when ``pg`` is the world or a subgroup whose ranks increase
        with the world's (as ``split`` with the default key gives); on a subgroup ordered
        otherwise (``split(color, key=-rank)``) a rank's place in it is ``get_group(name).rank``,
        not its coordinate.

        Raises:
            ConfigError: no dimension ``name`` (names the known ones).
        """
        self._dim(name)
        return self._groups[name]

    def size(self, name: str | None = None) -> int:
        """The grid's size along ``name``, or the number of ranks in the mesh (``None``).

        Raises:
            ConfigError: no dimension ``name``.
        """
        return math.prod(self.shape) if name is None else self.shape[self._dim(name)]

    def get_local_rank(self, name: str) -> int:
        """This rank's coordinate along ``name``: its rank in ``get_group(name)`` unless ``pg``
        is a subgroup whose ranks do not increase with the world's (see :meth:`get_group`).

        Raises:
            ConfigError: no dimension ``name``.
        """
        return self._coord[self._dim(name)]

    def get_coordinate(self) -> dict[str, int]:
        """This rank's coordinate in every dimension, by name."""
        return dict(zip(self.dim_names, self._coord, strict=True))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        return f"DeviceMesh({dims}; rank {self._rank} at {self.get_coordinate()}, epoch {self.epoch})"


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return tuple(reversed(out))


def _ravel(coord: Sequence[int], shape: tuple[int, ...]) -> int:
    index = 0
    for c, n in zip(coord, shape, strict=True):
        index = index * n + c
    return index
