"""rtxnet-run's guard of its ranks' process groups, for when rtxnet-run itself dies.

A rank gets SIGTERM when rtxnet-run dies, even by SIGKILL (``PR_SET_PDEATHSIG``), but what the
rank started in its process group (a DataLoader worker, a ``subprocess``) does not: that signal
is not inherited, and once rtxnet-run is gone nothing is left to signal the group. This small
process, started by rtxnet-run in a session of its own, is told each rank's process group and
does it: when its standard input ends without ``done`` (rtxnet-run died: SIGKILL, the OOM
killer), each group still holding a process gets SIGTERM and SIGCONT, and SIGKILL after the
grace period, as rtxnet-run itself does when it ends in order (``launcher._end_leftovers``).

It runs as a script with the standard library only (``python -I -S _groupguard.py GRACE_S
LAUNCHER_PID``), so it starts in milliseconds and imports nothing of rtxnet. Its input, one
line each: ``+PGID`` a rank's new process group, ``-PGID`` a group that has ended (or was
killed), ``done`` rtxnet-run ends in order (nothing to do).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _signal(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:   # the number is another user's group now: not ours to signal
        return False
    return True


def main(argv: list[str]) -> int:
    grace, launcher = float(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is rtxnet-run's to handle
    groups: set[int] = set()
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"done":
            return 0
        if line[:1] in (b"+", b"-") and line[1:].isdigit():
            (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
    alive = sorted(g for g in groups if _signal(g, signal.SIGTERM))
    if not alive:
        return 0
    for g in alive:
        _signal(g, signal.SIGCONT)   # a frozen process would hold SIGTERM pending
    sys.stderr.write(f"[rtxnet-run] launcher pid {launcher} is gone: SIGTERM to the process "
                     f"group{'s' if len(alive) > 1 else ''} of its rank{'s' if len(alive) > 1 else ''} "
                     f"(pgid {', '.join(map(str, alive))}), SIGKILL after {grace:g} s\n")
    sys.stderr.flush()
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [g for g in alive if _signal(g, 0)]
    for g in alive:
        _signal(g, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
