"""Rendezvous demo: N ranks meet through the coordinator, use the key-value store, and report.

    rtxnet-run --nproc 4 examples/rendezvous_demo.py

Each rank publishes its pid under ``pid/<rank>``, waits for every other rank's entry, checks it
reads back what the others wrote, and prints rank, world size and epoch.
"""

import os
import sys

import rtxnet


def main() -> int:
    try:
        pg = rtxnet.init()
    except rtxnet.RtxError as exc:   # refused or timed out: one line, not a traceback
        print(f"rendezvous_demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    rank, world_size, epoch = pg.rank, pg.world_size, pg.epoch
    try:
        pg.store.set(f"pid/{rank}", str(os.getpid()))
        values = pg.store.wait([f"pid/{r}" for r in range(world_size)], timeout=30)
        pids = {int(k.split("/")[1]): int(v) for k, v in values.items()}
        if pids[rank] != os.getpid():
            print(f"rank={rank}: the store returned {pids[rank]}, not this rank's pid {os.getpid()}", file=sys.stderr)
            return 1
        print(f"rank={rank} world_size={world_size} epoch={epoch} peers_pids={pids}", flush=True)
        if world_size > 1 and hasattr(pg.async_pg, "engine") and pg.async_pg.engine is not None:
            import numpy as np

            x = np.full(4, rank + 1, dtype=np.float32)
            pg.all_reduce(x)
            expected = world_size * (world_size + 1) / 2
            print(f"rank={rank} all_reduce={x.tolist()} expected={expected}", flush=True)
            if not np.all(x == expected):
                return 1
        # Leave only after everyone has read the store: a leave opens a new epoch for the others.
        pg.store.set(f"done/{rank}", b"1")
        pg.store.wait([f"done/{r}" for r in range(world_size)], timeout=30)
    finally:
        pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
