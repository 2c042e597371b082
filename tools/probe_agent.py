"""A scriptable rank for tests and benchmarks: joins a job and obeys JSON commands on stdin.

    python tools/probe_agent.py '{"coordinator": "tcp://127.0.0.1:PORT", "job": "j", "world_size": 2}'

Prints JSON lines on stdout: ``{"event": "joined", ...}``, ``{"event": "epoch", ...}`` at every new
epoch and ``{"event": "fenced"}``, each with ``t`` = ``time.monotonic()`` (one clock for every
process of the host on Linux, so latencies can be measured across processes), and one
``{"event": "result", "cmd": ..., ...}`` per command. Commands (one JSON object per line):
``kv_set {key, value}``, ``kv_get {key}``, ``kv_wait {keys, timeout}``, ``status``, ``commit
{step}``, ``rejoin``, ``reform {epoch}``, ``mute {seconds}`` (no heartbeats; ``null``: for good),
``all_reduce {value}`` (a SUM of 4 float64 ``value``s, result ``sum``), ``big {op, numel,
algorithm, timeout}`` (``all_reduce``, ``all_gather`` or ``reduce_scatter`` of ``numel`` float32
ones per rank; prints ``{"event": "started"}`` first; result ``ok``), ``leave``, ``exit``. A
failed command's result carries ``error`` (the class), ``message`` and ``ranks`` (when the error
names ranks).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rtxnet  # noqa: E402
from rtxnet.config import Timeouts  # noqa: E402


def emit(**kv) -> None:
    kv.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(kv, default=lambda b: b.decode() if isinstance(b, bytes) else str(b)) + "\n")
    sys.stdout.flush()


async def main(cfg: dict) -> int:
    timeouts = Timeouts.from_env(**cfg.get("timeouts", {}))
    emit(event="joining", pid=os.getpid())
    try:
        pg = await rtxnet.connect(cfg["coordinator"], job=cfg.get("job", "j"), rank=cfg.get("rank"),
                                  world_size=cfg.get("world_size"), min_ranks=cfg.get("min_ranks"),
                                  max_ranks=cfg.get("max_ranks"), last_call_s=cfg.get("last_call_s"),
                                  token=cfg.get("token", ""), timeouts=timeouts)
    except rtxnet.RtxError as exc:
        emit(event="join_failed", error=type(exc).__name__, message=str(exc))
        return 3

    def on_epoch(m, reason):
        if m is None:
            emit(event="fenced")
        else:
            emit(event="epoch", epoch=m.epoch, rank=m.rank, world_size=m.world_size, lost=list(m.lost),
                 added=list(m.added), reason=reason)

    pg.agent.add_listener(on_epoch)
    emit(event="joined", epoch=pg.epoch, rank=pg.rank, world_size=pg.world_size, pid=os.getpid())
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        line = await lines.get()
        if line is None:
            break
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            if name == "exit":
                break
            if name == "kv_set":
                await pg.store.set(cmd["key"], cmd["value"])
                emit(event="result", cmd=name, ok=True)
            elif name == "kv_get":
                emit(event="result", cmd=name, ok=True, value=await pg.store.get(cmd["key"]))
            elif name == "kv_wait":
                emit(event="result", cmd=name, ok=True, values=await pg.store.wait(cmd["keys"], cmd.get("timeout", 10)))
            elif name == "kv_cas":
                swapped, value = await pg.store.compare_set(cmd["key"], cmd["expected"], cmd["value"])
                emit(event="result", cmd=name, ok=True, swapped=swapped, value=value)
            elif name == "kv_del":
                emit(event="result", cmd=name, ok=True, deleted=await pg.store.delete(cmd["key"]))
            elif name == "status":
                emit(event="result", cmd=name, ok=True, jobs=await pg.status())
            elif name == "commit":
                emit(event="result", cmd=name, ok=True, committed=await pg.commit(cmd["step"], timeout=cmd.get("timeout", 10)))
            elif name == "rewind":
                rewound = await pg.agent.rewind(cmd["step"])
                emit(event="result", cmd=name, ok=True, rewound=rewound,
                     committed_step=pg.agent.membership.committed_step)
            elif name == "rejoin":
                m = await pg.rejoin()
                emit(event="result", cmd=name, ok=True, epoch=m.epoch, rank=m.rank)
            elif name == "reform":
                emit(event="result", cmd=name, ok=True, epoch=await pg.reform("probe", epoch=cmd.get("epoch")))
            elif name == "mute":
                pg.agent.mute_heartbeats(cmd.get("seconds"))
                emit(event="result", cmd=name, ok=True)
            elif name == "all_reduce":
                x = np.full(4, float(cmd["value"]))
                await pg.all_reduce(x, timeout=cmd.get("timeout", 10))
                emit(event="result", cmd=name, ok=True, sum=float(x[0]), epoch=pg.epoch)
            elif name == "big":
                n, w = int(cmd["numel"]), pg.world_size
                x = np.ones(n, np.float32)
                kw = {"timeout": cmd.get("timeout", 30), "algorithm": cmd.get("algorithm")}
                emit(event="started", cmd=name)
                if cmd["op"] == "all_reduce":
                    await pg.all_reduce(x, **kw)
                    ok = bool(np.all(x == w))
                elif cmd["op"] == "all_gather":
                    out = [np.zeros(n, np.float32) for _ in range(w)]
                    await pg.all_gather(out, x, **kw)
                    ok = all(bool(np.all(o == 1)) for o in out)
                else:
                    out = np.zeros(n // w, np.float32)
                    await pg.reduce_scatter(out, list(x.reshape(w, -1)), **kw)
                    ok = bool(np.all(out == w))
                emit(event="result", cmd=name, ok=ok, epoch=pg.epoch)
            elif name == "leave":
                await pg.aclose()
                emit(event="result", cmd=name, ok=True)
                return 0
            else:
                emit(event="result", cmd=name, ok=False, error="unknown command")
        except rtxnet.RtxError as exc:
            emit(event="result", cmd=name, ok=False, error=type(exc).__name__, message=str(exc),
                 ranks=getattr(exc, "ranks", None))
    await pg.agent.aclose(leave=False)
    if pg.engine is not None:
        await pg.engine.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]))))
