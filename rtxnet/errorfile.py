"""The error file through which a rank tells ``rtxnet-run`` what ended it, as torchelastic's
``@record`` error files tell torchrun (its "Root Cause (first observed failure)").

The launcher cannot tell from exit codes which rank failed first: a rank that raises spends
a while ending (its ``atexit`` handlers leave the job, flush logs), and a peer that its loss
made fail may exit sooner and be taken for the cause. So each rank started by ``rtxnet-run``
gets ``RTXNET_ERROR_FILE``; ``import rtxnet`` then installs a ``sys.excepthook`` that writes,
when an exception ends the process, one JSON object there: ``{"time": <wall clock, s since the
epoch>, "pid": int, "type": "ValueError", "message": "..."}``. Python calls the hook before its
``atexit`` handlers, so ``time`` is when the exception reached the top. ``KeyboardInterrupt``
(a stop) is not recorded, nor is ``SystemExit``, which Python handles without the hook. A script
that catches an exception and ends with an exit code of its own calls :func:`record` first.
JSON, never pickle: the launcher reads it as data.

Next to it, ``rtxnet.init`` (and ``rtxnet.connect``) creates ``<error file>.init`` as it starts
joining (:func:`mark_init`): the launcher tells by it a rank that never reached ``init`` (stuck
before it: a hung data download), which it stops once the job has finished without it and every
other rank ended, from one still ending its own work after the job, which it leaves alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

ENV = "RTXNET_ERROR_FILE"
INIT_SUFFIX = ".init"   # <error file>.init: this rank's process reached rtxnet.init (mark_init)
MAX_MESSAGE = 2000   # characters of the exception's message kept
# Errors a rank raises because another rank (or its link) went: the launcher looks past them for
# the first failure (rtxnet.launcher._root_cause).
CONSEQUENCES = frozenset({"PeerLostError", "LinkBrokenError", "ClosedError"})


def record(exc: BaseException) -> None:
    """Write ``exc`` to this rank's error file, when rtxnet-run gave it one, for a script that
    catches an exception and exits with a code of its own (``print(...); sys.exit(1)``): the
    launcher then names it as it names an uncaught one. Does nothing without
    ``RTXNET_ERROR_FILE``; never raises (an unwritable file is skipped)."""
    path = os.environ.get(ENV)
    if path:
        try:
            write(path, exc)
        except OSError:
            pass


def mark_init() -> None:
    """Tell rtxnet-run that this rank's process reached ``rtxnet.init`` (or ``connect``): create
    ``<error file>.init``. Does nothing without ``RTXNET_ERROR_FILE``; never raises (a file that
    cannot be made is skipped: the launcher then takes the rank for one that never joined only
    once the job finished without it and every other rank ended)."""
    path = os.environ.get(ENV)
    if path:
        try:
            with open(path + INIT_SUFFIX, "a", encoding="utf-8"):
                pass
        except OSError:
            pass


def reached_init(path: str | None) -> bool:
    """Whether a process given ``path`` as its error file reached ``rtxnet.init`` (see
    :func:`mark_init`); True when ``path`` is None (nothing to tell by: taken as joined)."""
    return path is None or os.path.exists(path + INIT_SUFFIX)


def install() -> None:
    """Install the hook when ``RTXNET_ERROR_FILE`` is set (rtxnet-run sets it for each rank);
    once per process. The hook calls the one it replaces, so the traceback is still printed."""
    path = os.environ.get(ENV)
    if not path or getattr(sys.excepthook, "_rtxnet_error_file", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)):
            try:
                write(path, exc)
            except Exception:   # noqa: BLE001 - the traceback below matters more than the file
                pass
        previous(kind, exc, tb)

    hook._rtxnet_error_file = True
    sys.excepthook = hook


def write(path: str, exc: BaseException) -> None:
    """Write ``exc``'s record to ``path`` (a temporary file renamed over it: a reader sees the
    whole record or none).

    Raises:
        OSError: the file cannot be written.
    """
    record = {"time": time.time(), "pid": os.getpid(), "type": type(exc).__name__,
              "message": str(exc)[:MAX_MESSAGE]}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def read(path: str | None, pid: int | None = None) -> dict[str, Any] | None:
    """The record at ``path``, or None when there is none, or it is not one (not JSON, fields
    of other types), or (``pid`` given) another process wrote it (a child of the rank, which
    inherited ``RTXNET_ERROR_FILE``): a rank killed by a signal, or one that exited by
    ``sys.exit``, writes none."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(rec, dict) and isinstance(rec.get("time"), (int, float))
            and isinstance(rec.get("type"), str) and isinstance(rec.get("message"), str)):
        return None
    if pid is not None and rec.get("pid") != pid:
        return None
    return rec


def summary(rec: dict[str, Any], limit: int = 200) -> str:
    """``"ValueError: boom"``: the type and the first line of the message, at most ``limit``
    characters of it, control characters escaped (it is printed on a terminal)."""
    # imported here: `import rtxnet` installs the hook and stays light
    from .cli import _shown as shown

    lines = rec["message"].strip().splitlines()
    first = lines[0] if lines else ""
    more = len(first) > limit or len(lines) > 1
    kind = shown(rec["type"][:limit])   # a class name may hold anything too
    return f"{kind}: {shown(first[:limit])}{' [...]' if more else ''}" if first else kind
