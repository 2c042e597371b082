"""Test processes only (``tests/procs.py`` puts this folder on ``PYTHONPATH``): a process that
imported torch skips the garbage collection of torch's object graph at interpreter exit.

CPython collects every tracked object at finalization; with torch (and ``torch._dynamo``, which
``torch.optim`` imports) loaded that took 0.6 to 1.2 s of CPU per process here, for nothing: the
memory goes back with the process. The suite starts about a hundred such processes on two
cores. ``gc.freeze()`` in the last ``atexit`` handler (registered first, so run last: after
rtxnet's and the script's own exit handlers) moves those objects out of the collector's reach.
Objects are still freed by reference counting as modules are torn down; only cyclic garbage left
at exit is not collected. Processes without torch are left as they are.
"""

import atexit
import gc
import sys


def _skip_the_final_collection() -> None:
    if "torch" in sys.modules:
        gc.freeze()


atexit.register(_skip_the_final_collection)
