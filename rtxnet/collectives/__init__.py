"""CPU collectives over rtxnet's own transport (ZeroMQ between hosts, shared memory within one).

::

    engine = await Engine.create()            # one per process; binds its data socket
    engine.set_view(WorldView(...))           # at every epoch, from the coordinator
    await engine.world.all_reduce(x)          # x: NumPy array or torch CPU tensor, in place
    sub = engine.world.new_group([0, 2])
"""

from rtxnet.collectives.engine import Engine, WorldView
from rtxnet.collectives.group import ALGORITHMS, Group
from rtxnet.collectives.reduce_ops import SUPPORTED_DTYPES, ReduceOp
from rtxnet.collectives.work import Work

__all__ = ["ALGORITHMS", "Engine", "Group", "ReduceOp", "SUPPORTED_DTYPES", "Work", "WorldView"]
