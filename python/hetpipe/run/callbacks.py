"""User callbacks of a run: called on the last stage of VW 0 at each wave's end and at each
evaluation point; returning True asks for an early stop.

A stop asked at an evaluation point after wave ``w`` ends the run after wave ``w + D + 1`` (every VW
trains the same waves: docs/design.md, "Evaluation and early stopping"); one asked by
``on_wave_end`` takes effect at the next evaluation point (``Reporting(eval_every=)``), so without
evaluation points it only warns.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class WaveInfo:
    """VW 0's wave ``wave`` as its last stage saw it complete."""

    wave: int
    loss: float                     # mean loss of the wave's minibatches
    lr: Optional[float]             # the learning rate of the wave's last step (last stage, first group)
    grad_norm: Optional[float]      # mean VW gradient norm of the wave's minibatches (with clipping)
    samples_per_s: float            # estimate for the whole run (VW 0's rate x VWs)
    global_clock: int               # the global clock of VW 0's latest pull
    time_s: float


@dataclass(frozen=True)
class EvalInfo:
    """An evaluation point of VW 0, after wave ``wave``."""

    wave: int
    loss: Optional[float]           # mean over the evaluation samples (None without evaluation data)
    metric: Optional[float]         # the evaluation metric's mean, if one was given
    samples: int
    time_s: float


class Callback:
    """Base class (optional: any object with these methods works). Return True to ask for a stop."""

    def on_wave_end(self, info: WaveInfo) -> Optional[bool]:
        return None

    def on_eval(self, info: EvalInfo) -> Optional[bool]:
        return None


class Callbacks:
    """The run's callbacks, called in order; remembers a stop asked between evaluation points."""

    def __init__(self, callbacks: Sequence[object], evaluates: bool) -> None:
        for cb in callbacks:
            if not (hasattr(cb, "on_wave_end") or hasattr(cb, "on_eval")):
                raise TypeError(f"hetpipe: callback {cb!r} has neither on_wave_end nor on_eval")
        self.callbacks, self.evaluates = list(callbacks), evaluates
        self.stop_asked: Optional[str] = None
        self._warned = False

    def wave_end(self, info: WaveInfo) -> None:
        for cb in self.callbacks:
            if getattr(cb, "on_wave_end", None) is not None and cb.on_wave_end(info) and self.stop_asked is None:
                self.stop_asked = f"{type(cb).__name__}.on_wave_end at wave {info.wave}"
        if self.stop_asked and not self.evaluates and not self._warned:
            self._warned = True
            sys.stderr.write(f"hetpipe: {self.stop_asked} asked to stop, but the run has no evaluation points "
                             "(reporting.eval_every) where a stop can take effect; training goes on\n")

    def evaluated(self, info: EvalInfo) -> bool:
        """Whether to stop: asked now by an ``on_eval``, or earlier by an ``on_wave_end``."""
        for cb in self.callbacks:
            if getattr(cb, "on_eval", None) is not None and cb.on_eval(info) and self.stop_asked is None:
                self.stop_asked = f"{type(cb).__name__}.on_eval at wave {info.wave}"
        return self.stop_asked is not None
