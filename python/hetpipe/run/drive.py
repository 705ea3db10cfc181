"""Stepping a rank's part to its end: back-off while blocked, a peer timeout instead of a hang."""

from __future__ import annotations

import time
from typing import Callable, Optional

from hetpipe.run.spec import Steppable
from hetpipe.transport.backoff import Backoff


class PeerTimeout(TimeoutError):
    """A rank waited longer than the run's timeout for a peer."""


def drive(part: Steppable, timeout: float, who: str, on_progress: Optional[Callable[[], None]] = None) -> None:
    """Step ``part`` until it finishes; sleep with back-off while blocked; raise after ``timeout`` s idle."""
    backoff = Backoff()
    last = time.monotonic()
    while not part.finished:
        if part.step():
            last = time.monotonic()
            backoff.reset()
            if on_progress is not None:
                on_progress()
            continue
        if time.monotonic() - last > timeout:
            raise PeerTimeout(f"{who} waited {timeout:g} s for {part.blocked_on}")
        backoff.wait()
