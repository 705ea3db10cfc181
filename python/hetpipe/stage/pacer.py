"""Emulated heterogeneity: make a fast host device take the time a slower device type would.

A rank that emulates a device type runs the real computation, then pads the instruction to the time
the device's profile gives. The schedule, transport and WSP stay real; only the speed is emulated.
Real devices are never padded (``Pacer(None)`` pads nothing).
"""

from __future__ import annotations

import time
from typing import Optional

from hetpipe.model.measure import sleep_until


class Pacer:
    """Pads timed sections to a target duration.

    Thread role: owned by one rank's main thread. ``scale`` multiplies every target (1.0 = the
    profile's time); ``None`` disables padding entirely (real device).
    """

    def __init__(self, scale: Optional[float] = 1.0) -> None:
        if scale is not None and scale <= 0:
            raise ValueError(f"emulation scale must be > 0, got {scale}")
        self.scale = scale
        self.padded_s = 0.0      # total time spent padding
        self.overrun_s = 0.0     # total time the real work exceeded its target (emulation too slow)

    @property
    def enabled(self) -> bool:
        return self.scale is not None

    def pad(self, started_at: float, target_s: float) -> None:
        """Sleep until ``target_s * scale`` seconds have passed since ``started_at`` (time.perf_counter)."""
        if self.scale is None:
            return
        deadline = started_at + target_s * self.scale
        now = time.perf_counter()
        if now >= deadline:
            self.overrun_s += now - deadline
            return
        self.padded_s += deadline - now
        sleep_until(deadline)
