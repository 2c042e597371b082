"""Timeouts and job settings, read from arguments or the ``RTXNET_*`` environment.

The defaults follow ``../shared/DESIGN.md``: heartbeats every 0.2 s, a rank declared lost after
2 s of silence (at once when its process dies and the TCP connection drops), collectives time out
after 60 s, a rendezvous after 300 s.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from transport.errors import ConfigError

__all__ = ["Timeouts", "env_float", "env_int", "is_seconds"]


def is_seconds(v: object) -> bool:
    """Whether ``v`` is a duration rtxnet accepts: an int or float (not a bool) above 0 and
    finite (not NaN, not infinite)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf


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


@dataclass(frozen=True)
class Timeouts:
    """Every deadline of an agent, in seconds.

    Must satisfy ``heartbeat_interval_s < heartbeat_timeout_s < op_s < rendezvous_s``.

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
        hi, ht, op, rv = self.heartbeat_interval_s, self.heartbeat_timeout_s, self.op_s, self.rendezvous_s
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
        non-None keyword arguments."""
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
        return cls(**vals)
