"""The plant's clock: wall time, or simulated time at a stated ratio to it, or a clock set by hand.

The plant flows in its own time τ while the model's token clock t runs beside it. With
`WallClock(speed)` τ = speed · (wall seconds since start): speed 1 is real time, speed X
is X simulated seconds per wall second (a slow model on a fast plant, or a fast replay).
`ManualClock` is moved by the caller (tests, offline studies): τ does not depend on how
long anything takes.
"""

from __future__ import annotations

import math
import threading
import time

from hybridlm.errors import InputError


class WallClock:
    def __init__(self, speed: float = 1.0) -> None:
        if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
            raise InputError(f"plant speed {speed!r}: expected a finite number > 0 (simulated s per wall s)")
        self.speed = float(speed)
        self._start = time.perf_counter()

    def restart(self) -> None:
        """τ = 0 now (a supervisor starts the clock when its run starts, not when the plant was built)."""
        self._start = time.perf_counter()

    def time(self) -> float:
        return self.speed * (time.perf_counter() - self._start)

    def sleep_until(self, tau: float, stop: threading.Event | None = None) -> None:
        """Wait until plant time τ (or until `stop` is set)."""
        wait = (tau - self.time()) / self.speed
        if wait > 0:
            (stop or threading.Event()).wait(wait)

    def describe(self) -> dict:
        return {"clock": "wall", "speed": self.speed}


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def restart(self) -> None:
        """A clock set by hand stays where it was set."""

    def time(self) -> float:
        return self.now

    def sleep_until(self, tau: float, stop: threading.Event | None = None) -> None:
        self.now = max(self.now, float(tau))

    def advance(self, seconds: float) -> float:
        self.now += float(seconds)
        return self.now

    def describe(self) -> dict:
        return {"clock": "manual"}
