"""A budget of log lines per kind of event, for events a remote client can trigger at will.

Shared by the coordinator's control channel (:mod:`transport.channel`) and the ranks' data ports
(:mod:`transport.peer`, :mod:`transport.bulk`): whoever can reach a port can make it log, and one
line per garbage message filled disks (26 MB in 15 s at the daemon; 6 MB for 50,000 messages at a
rank's data port: a breaker's find).
"""

from __future__ import annotations

import time

__all__ = ["LogBudget"]


class LogBudget:
    """At most ``per_window`` log lines every ``window_s`` seconds for one kind of event (a client
    flooding the daemon with garbage must not fill its disk: 26 MB in 15 s was seen); the first
    line after a quiet spell carries how many were suppressed."""

    def __init__(self, per_window: int = 20, window_s: float = 1.0, clock=time.monotonic):
        self.per_window, self.window_s, self._clock = per_window, window_s, clock
        self._start, self._used, self.suppressed = 0.0, 0, 0

    def allow(self) -> tuple[bool, int]:
        """``(log this one?, lines suppressed since the last one logged)``."""
        now = self._clock()
        if now - self._start >= self.window_s:
            self._start, self._used = now, 0
        if self._used >= self.per_window:
            self.suppressed += 1
            return False, 0
        self._used += 1
        dropped, self.suppressed = self.suppressed, 0
        return True, dropped
