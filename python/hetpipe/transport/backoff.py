"""Polling pause for a rank waiting on messages."""

from __future__ import annotations

import time


class Backoff:
    """Polling pause for a rank waiting on messages: 20 µs doubling up to 1 ms; reset on progress.

    Never busy-waits: several ranks share few cores, and a spinning rank would starve its peers."""

    def __init__(self, first_s: float = 20e-6, max_s: float = 1e-3) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.delay = first_s

    def reset(self) -> None:
        self.delay = self.first_s

    def wait(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.max_s)
