"""A rank killed while its peers wait inside an IPC all_reduce (run by tests/gpu/test_ipc_fault.py
through the launcher, one GPU shared by every rank).

Rank 1 SIGKILLs itself 0.5 s after the warm-up, without entering the second all_reduce; the
others are inside it by then. Each survivor writes OUT/survivor-<rank>.json: the error it got, how
long after the kill, whether its GPU memory still works, and the result of an all_reduce in the
re-formed world.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import cupy

    import rtxnet
    from tests.procs import wait_until

    cupy.cuda.Device(0).use()
    pg = rtxnet.init()
    rank, n, epoch0 = pg.rank, pg.world_size, pg.epoch
    x = cupy.full(1 << 22, rank + 1, cupy.float32)          # 16 MiB
    pg.all_reduce(x)
    warm_ok = bool(cupy.all(x == n * (n + 1) / 2))
    if rank == 1:
        time.sleep(0.5)
        (out / "kill.json").write_text(json.dumps({"t": time.time()}))
        os.kill(os.getpid(), signal.SIGKILL)
    x[...] = rank + 1
    err, t_err = None, None
    try:
        pg.all_reduce(x)
    except rtxnet.PeerLostError as exc:
        err, t_err = f"PeerLostError: {exc}", time.time()
    except Exception as exc:  # noqa: BLE001 - the test reports what it was
        err, t_err = f"{type(exc).__name__}: {exc}", time.time()
    # this rank's GPU memory still works
    x[...] = 2.0
    mem_ok = float(x.sum()) == 2.0 * x.size
    cupy.cuda.Device(0).synchronize()
    wait_until(lambda: pg.epoch != epoch0 and pg.world_size == n - 1, 20, "the re-formed world")
    y = cupy.full(1 << 20, pg.rank + 1, cupy.float32)
    pg.all_reduce(y)
    m = pg.world_size
    x[...] = pg.rank + 1
    pg.all_reduce(x)                                         # the same buffer, new group
    res = {"rank": rank, "warm_ok": warm_ok, "error": err, "t_err": t_err, "mem_ok": mem_ok,
           "new_world": m, "new_epoch": pg.epoch,
           "after_ok": bool(cupy.all(y == m * (m + 1) / 2)) and bool(cupy.all(x == m * (m + 1) / 2))}
    (out / f"survivor-{rank}.json").write_text(json.dumps(res))
    pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
