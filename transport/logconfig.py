"""structlog set-up for entry points (daemons, launcher, CLIs); never called on import.

Logs go to stderr: JSON lines when ``json`` is true (or ``RTXNET_LOG_JSON=1``), a readable console
rendering otherwise. Context bound with :func:`structlog.contextvars.bind_contextvars` (rank,
epoch, job) follows into asyncio tasks.
"""

from __future__ import annotations

import errno
import logging
import os
import sys

import structlog

__all__ = ["configure_logging", "LOG_LEVELS"]

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Stderr:
    """``sys.stderr`` for log lines, silent once its reader is gone: a daemon whose launcher was
    SIGKILLed writes into a pipe nobody reads, and a ``BrokenPipeError`` from a log call must not
    turn its clean stop (a temporary journal removed) into a crash."""

    def __init__(self) -> None:
        self.gone = False

    def write(self, text: str) -> int:
        self._guarded(sys.stderr.write, text)
        return len(text)

    def flush(self) -> None:
        self._guarded(sys.stderr.flush)

    def _guarded(self, fn, *args) -> None:
        if self.gone:
            return
        try:
            fn(*args)
        except OSError as exc:   # BrokenPipeError is EPIPE
            if exc.errno not in (errno.EPIPE, errno.EBADF):
                raise
            self.gone = True


def configure_logging(*, level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog for this process.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``; default ``RTXNET_LOG_LEVEL`` or info.
        json: JSON lines instead of the console renderer; default ``RTXNET_LOG_JSON``.
    """
    level = (level or os.environ.get("RTXNET_LOG_LEVEL") or "info").lower()
    if json is None:
        json = os.environ.get("RTXNET_LOG_JSON", "") not in ("", "0", "false")
    lvl = getattr(logging, level.upper(), None)
    if not isinstance(lvl, int):
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # one write per line (PrintLogger's print() writes the text and its newline apart: a
        # Ctrl-C raised between the two, or another thread's line, was glued to it)
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
