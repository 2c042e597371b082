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

from transport.errors import ConfigError

__all__ = ["configure_logging", "ensure_standard_fds", "LOG_LEVELS"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def ensure_standard_fds() -> None:
    """Open ``/dev/null`` on each of descriptors 0, 1 and 2 that is closed (a command started
    with ``<&-``, by a daemon manager, or under ``nohup`` without a terminal), as daemons do:
    the next descriptor opened (an event loop's, a socket) would take that number, and libuv
    aborts when it closes one below 3 (``uv__close: Assertion `fd > STDERR_FILENO'``: rtxnet-run
    with its standard input closed exited 134, a fresh user's find). Called first by each entry
    point."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:   # (a lower one was closed too: opened there first, in this loop)
                os.dup2(opened, fd)
                os.close(opened)


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


FLAG_VALUES = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False}


def env_flag(name: str, default: bool) -> bool:
    """The on/off environment variable ``name``: ``1``, ``true``, ``yes``, ``on`` or ``0``,
    ``false``, ``no``, ``off`` (any case, spaces around ignored); unset or empty: ``default``.

    Raises:
        ConfigError: any other value (names the variable and the value: ``RTXNET_SHM=off`` was
            read as "on" before, as anything but ``0`` and ``false`` was, a fresh user's find).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return FLAG_VALUES[raw.strip().lower()]
    except KeyError:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(FLAG_VALUES)}") from None


def configure_logging(*, level: str | None = None, json: bool | None = None) -> None:
    """Configure structlog for this process.

    Args:
        level: ``debug``, ``info``, ``warning`` or ``error``; default ``RTXNET_LOG_LEVEL`` or info.
        json: JSON lines instead of the console renderer; default ``RTXNET_LOG_JSON``.

    Raises:
        ConfigError: an unknown ``level`` or ``RTXNET_LOG_LEVEL`` (a ``ValueError``), or
            ``RTXNET_LOG_JSON`` not an on/off value (:func:`env_flag`); the message names which.
    """
    given = level or os.environ.get("RTXNET_LOG_LEVEL") or "info"
    if given.lower() not in LOG_LEVELS:
        # (each message names its source: callers print it as it is)
        raise ConfigError(f"{'log level ' if level else 'RTXNET_LOG_LEVEL='}{given!r} is not one of "
                          f"{', '.join(LOG_LEVELS)}")
    if json is None:
        json = env_flag("RTXNET_LOG_JSON", False)
    lvl = getattr(logging, given.upper())
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
