"""Stepping a rank's part to its end: back-off while blocked, a peer timeout instead of a hang."""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from hetpipe.transport.backoff import Backoff
from hetpipe.util.errors import HetpipeError


class Steppable(Protocol):
    """A rank's part (a stage executor, a PS shard server, a front end's worker): ``step()`` never blocks
    and says whether it progressed; ``blocked_on`` says what it waits for when it did not."""

    finished: bool
    blocked_on: str

    def step(self) -> bool: ...


class PeerTimeout(HetpipeError, TimeoutError):
    """A rank waited longer than the run's timeout for a peer. A peer's fault, not this rank's code's:
    reported in one line, without a traceback (``hetpipe.job.failure.report``)."""

    one_line = True


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
