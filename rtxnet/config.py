"""Timeouts and job settings, read from arguments or the ``RTXNET_*`` environment.

The defaults follow ``../shared/DESIGN.md``: heartbeats every 0.2 s, a rank declared lost after
2 s of silence (at once when its process dies and the TCP connection drops), collectives time out
after 60 s, a rendezvous after 300 s.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass, fields
from pathlib import Path

from transport.errors import ConfigError

__all__ = ["CHECKPOINT_STORE_KEY", "Timeouts", "env_float", "env_int", "int_in", "ipv6_bind_error", "is_seconds", "output_file",
           "timeout_seconds"]

# The job's store key where rtxnet.checkpoint.save records the newest committed checkpoint (JSON:
# step, root) and FaultTolerance reads it back. Here, not in rtxnet.checkpoint, so that reading it
# does not import torch: a recovery runs on the agent's event loop, and an import of torch there
# (seconds on a loaded machine, holding the GIL) starved the heartbeats until the coordinator
# declared the recovering ranks lost.
CHECKPOINT_STORE_KEY = "rtxnet/checkpoint/latest"


def shown_list(items: list, first: int, sep: str = ", ") -> str:
    """The first ``first`` of ``items`` (strings) joined by ``sep``, then "and N more" for the
    rest, for an error message that names what it refuses without growing without bound."""
    more = len(items) - first
    if more <= 0:
        return sep.join(items)
    return sep.join(items[:first]) + (f" and {more} more" if sep == ", " else f"{sep}and {more} more")


def is_seconds(v: object) -> bool:
    """Whether ``v`` is a duration rtxnet accepts: a real number (an int or float, or a NumPy
    scalar such as ``np.float32(5)``; not a bool, and ``np.bool_`` is no ``numbers.Real``) above
    0 and finite (not NaN, not infinite). Callers keep ``float(v)``."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < math.inf


def timeout_seconds(timeout: object, default_s: float, what: str = "") -> float:
    """A call's ``timeout`` argument as float seconds (``default_s`` for None), refused before
    the call sends anything: the one check the collectives and ``ProcessGroup.reform`` share.
    ``what``: the call, put before the message (``"reform"``).

    Raises:
        ValueError: ``timeout`` is not None and not :func:`is_seconds` (names the value).
    """
    if timeout is None:
        return default_s
    if not is_seconds(timeout):
        raise ValueError(f"{what + ': ' if what else ''}timeout must be a positive number of seconds, "
                         f"got {timeout!r}")
    return float(timeout)


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


# 100 heartbeats a second per rank at most; 1e-9 s made one 300-step job's coordinator use 9 times
# its CPU and the job take 1.8 times as long (a fresh user's trial)
MIN_HEARTBEAT_INTERVAL_S = 0.01
# the variables Timeouts.from_env reads
TIMEOUT_VARS = ("RTXNET_HEARTBEAT_INTERVAL", "RTXNET_HEARTBEAT_TIMEOUT", "RTXNET_OP_TIMEOUT",
                "RTXNET_RENDEZVOUS_TIMEOUT", "RTXNET_REQUEST_TIMEOUT", "RTXNET_COORDINATOR_TIMEOUT")


@dataclass(frozen=True)
class Timeouts:
    """Every deadline of an agent, in seconds.

    Must satisfy ``heartbeat_interval_s < heartbeat_timeout_s < op_s < rendezvous_s``, and
    ``heartbeat_interval_s >= MIN_HEARTBEAT_INTERVAL_S`` (0.01 s).

    Attributes:
        heartbeat_interval_s: period of heartbeats to the coordinator.
        heartbeat_timeout_s: silence after which the coordinator declares a rank lost.
        op_s: default deadline of a collective.
        rendezvous_s: how long to wait for the world to form.
        request_s: deadline of one control request (key-value, join, leave).
        coordinator_s: how long the coordinator may stay unreachable (no heartbeat answered)
            before a step's commit gives up with ``CoordinatorLostError`` instead of waiting on;
            above ``heartbeat_timeout_s``, and long enough for a restart (``rtxnet-run``
            restarts its coordinator within about a second).

    Raises:
        ConfigError: a value is not a finite positive number, or the order above is broken;
            names the values.
    """

    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 2.0
    op_s: float = 60.0
    rendezvous_s: float = 300.0
    request_s: float = 10.0
    coordinator_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not is_seconds(v):
                raise ConfigError(f"{f.name}({v!r}) must be a finite positive number of seconds")
            object.__setattr__(self, f.name, float(v))   # (np.float32 is not msgpack's)
        hi, ht, op, rv = self.heartbeat_interval_s, self.heartbeat_timeout_s, self.op_s, self.rendezvous_s
        if hi < MIN_HEARTBEAT_INTERVAL_S:
            raise ConfigError(f"heartbeat_interval_s({hi!r}) must be at least {MIN_HEARTBEAT_INTERVAL_S} s: "
                              f"every heartbeat is a message to the coordinator, which serves every "
                              f"rank of every job")
        if not (hi < ht < op < rv):
            raise ConfigError(
                "timeouts must satisfy heartbeat_interval_s < heartbeat_timeout_s < op_s < rendezvous_s, "
                f"got heartbeat_interval_s({hi}) heartbeat_timeout_s({ht}) op_s({op}) rendezvous_s({rv})"
            )
        if not self.coordinator_s > ht:
            raise ConfigError(f"coordinator_s({self.coordinator_s}) must exceed "
                              f"heartbeat_timeout_s({ht})")

    @classmethod
    def from_env(cls, **overrides: float | None) -> Timeouts:
        """Defaults, overridden by ``RTXNET_HEARTBEAT_INTERVAL``, ``RTXNET_HEARTBEAT_TIMEOUT``,
        ``RTXNET_OP_TIMEOUT``, ``RTXNET_RENDEZVOUS_TIMEOUT``, ``RTXNET_REQUEST_TIMEOUT``,
        ``RTXNET_COORDINATOR_TIMEOUT``, then by
        non-None keyword arguments.

        Raises:
            ConfigError: a variable is not a number (naming it), or the values break a rule of
                :class:`Timeouts` (naming the fields, then the variables that were set).
        """
        d = cls()
        vals = {
            "heartbeat_interval_s": env_float("RTXNET_HEARTBEAT_INTERVAL", d.heartbeat_interval_s),
            "heartbeat_timeout_s": env_float("RTXNET_HEARTBEAT_TIMEOUT", d.heartbeat_timeout_s),
            "op_s": env_float("RTXNET_OP_TIMEOUT", d.op_s),
            "rendezvous_s": env_float("RTXNET_RENDEZVOUS_TIMEOUT", d.rendezvous_s),
            "request_s": env_float("RTXNET_REQUEST_TIMEOUT", d.request_s),
            "coordinator_s": env_float("RTXNET_COORDINATOR_TIMEOUT", d.coordinator_s),
        }
        vals.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**vals)
        except ConfigError as exc:
            given = " ".join(f"{n}={os.environ[n]!r}" for n in TIMEOUT_VARS if os.environ.get(n))
            if not given:
                raise
            raise ConfigError(f"{exc} (from {given})") from None


def _init_naming_the_fields(init):
    """``Timeouts.__init__`` whose ``TypeError`` for a keyword it does not take lists the fields it
    does (a fresh user guessed ``heartbeat_timeout=`` and was told only that it is unexpected)."""
    names = [f.name for f in fields(Timeouts)]   # once, not at every construction
    known = set(names)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if unknown := sorted(set(kwargs) - known):
            raise TypeError(f"Timeouts() got an unexpected keyword argument {unknown[0]!r} (it "
                            f"takes {', '.join(names)}, in seconds)")
        init(self, *args, **kwargs)
    return __init__


Timeouts.__init__ = _init_naming_the_fields(Timeouts.__init__)


def ipv6_bind_error(host: str, where: str) -> str | None:
    """Why the ranks' data sockets cannot listen on ``host``, if it is an IPv6 address (they
    listen on IPv4 only; the coordinator's ``--bind`` takes ``tcp://[::1]:PORT``), else None.
    ``where`` names the setting (``--bind-host``, ``RTXNET_BIND_HOST``)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6:
        return (f"{where} {host} is an IPv6 address; the ranks' data sockets listen on IPv4 only: "
                f"give an IPv4 address of this host")
    return None


def output_file(text: str) -> Path:
    """An ``argparse`` type for a file a tool writes when it ends (``--json``, ``--plot``): refused
    at once, naming it, when it is a folder, or when its nearest existing folder cannot be
    written (read-only, no permission, not a folder), so a long run does not end in a traceback
    with its result lost. Missing folders in between are for the tool to create.

    Raises:
        argparse.ArgumentTypeError: as above (argparse turns it into exit code 2).
    """
    import argparse
    import tempfile

    path = Path(text)
    try:   # (a name too long raises from the look-ups themselves: ENAMETOOLONG)
        if not text or path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file to write")
        folder = path.absolute().parent
        while not folder.exists():
            folder = folder.parent
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {str(folder)!r} is not a folder")
    try:   # what a write would meet (a read-only mount, permissions, a pseudo file system)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        parent = path.absolute().parent
        what = (f"no file can be made in folder {str(folder)!r}" if parent == folder else
                f"its folder {str(parent)!r} does not exist and cannot be made in {str(folder)!r}")
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {what} ({exc.strerror})") from None
    return path


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a finite number of seconds above 0; anything else (NaN, inf, 0, a
    word) is refused naming the value (argparse turns it into exit code 2)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:   # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def int_in(lo: int, hi: int):
    """An ``argparse`` type: an integer in ``lo..hi`` (both included); anything else is refused
    naming the value and the range (argparse turns it into exit code 2)."""
    import argparse

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}, got {n}")
        return n

    parse.__name__ = f"int in {lo}..{hi}"
    return parse


def ints_in(lo: int, hi: int):
    """An ``argparse`` type: a comma-separated list of integers, each in ``lo..hi`` (``--worlds
    1,2,4``); anything else is refused naming the value (argparse turns it into exit code 2)."""
    import argparse

    one = int_in(lo, hi)

    def parse(text: str) -> list[int]:
        try:
            return [one(part.strip()) for part in text.split(",")]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    parse.__name__ = f"comma-separated ints in {lo}..{hi}"
    return parse


def existing_folder(text: str) -> Path:
    """An ``argparse`` type: a folder that exists and takes a new file (``--dir``; a file is
    made and removed there); refused naming it otherwise (``/proc`` was a traceback at the
    first write: a tester's find)."""
    import argparse
    import tempfile

    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write a file there ({exc.strerror or exc})") from None
    return path


def memory_for(what: str, nbytes: int) -> str | None:
    """None, or why ``nbytes`` of memory (what a benchmark's sizes need) are more than this
    machine has available now (``psutil``): a size within a benchmark's bounds was a
    MemoryError traceback on a smaller machine (a tester's find)."""
    import psutil

    avail = psutil.virtual_memory().available
    if nbytes <= avail:
        return None
    return (f"{what} needs about {nbytes / 2**30:.1f} GiB of memory; this machine has "
            f"{avail / 2**30:.1f} GiB available")
