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
from typing import Any, Dict, List, Optional, Sequence


@dataclass(frozen=True)
class WaveInfo:
    """VW 0's wave ``wave`` as its last stage saw it complete (waves and clocks count on from a resumed
    checkpoint's clock)."""

    wave: int
    loss: float                     # mean loss of the wave's minibatches
    lr: Optional[float]             # the learning rate of the wave's last step (last stage, first group)
    grad_norm: Optional[float]      # mean VW gradient norm of the wave's minibatches (with clipping)
    samples_per_s: float            # estimate for the whole run (VW 0's rate x VWs)
    global_clock: int               # the global clock of VW 0's latest pull
    time_s: float
    step: int = 0                   # the run's optimizer steps by the wave's end, all VWs (see run_steps)


@dataclass(frozen=True)
class EvalInfo:
    """An evaluation point of VW 0, after wave ``wave`` (counted on from a resumed checkpoint's clock)."""

    wave: int
    loss: Optional[float]           # mean over the evaluation samples (None without evaluation data)
    metric: Optional[float]         # the evaluation metric's mean, if one was given
    samples: int
    time_s: float
    step: int = 0                   # the run's optimizer steps at the point, all VWs (see run_steps)


def run_steps(wave: int, per_wave: int, accumulate: int = 1) -> int:
    """The optimizer steps the run has taken when every VW has finished wave ``wave``, counted as one
    process training on all the data would take them: ``per_wave`` minibatches per wave, all VWs
    together (``Plan.minibatches_per_wave``), one step per ``accumulate`` of them."""
    return (wave + 1) * per_wave // accumulate


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

    def state(self) -> List[Optional[Dict[str, Any]]]:
        """Each callback's ``state_dict()`` (None for one without), as a checkpoint holds them."""
        return [cb.state_dict() if hasattr(cb, "state_dict") else None for cb in self.callbacks]

    def load(self, states: List[Optional[Dict[str, Any]]]) -> None:
        """Give each callback with a ``state_dict`` its saved state (a resumed run's, saved by :meth:`state`),
        in order; callbacks without state (a logger, say) may be added or dropped on resume."""
        saved = [state for state in states if state is not None]
        stateful = [cb for cb in self.callbacks if hasattr(cb, "state_dict")]
        if len(saved) != len(stateful):
            raise ValueError(f"hetpipe: the checkpoint holds the state of {len(saved)} callback(s), the run has "
                             f"{len(stateful)} with a state_dict: "
                             f"{', '.join(type(cb).__name__ for cb in stateful) or 'none'}")
        for cb, state in zip(stateful, saved):
            if hasattr(cb, "load_state_dict"):
                cb.load_state_dict(state)

    def evaluated(self, info: EvalInfo) -> bool:
        """Whether to stop: asked now by an ``on_eval``, or earlier by an ``on_wave_end``."""
        for cb in self.callbacks:
            if getattr(cb, "on_eval", None) is not None and cb.on_eval(info) and self.stop_asked is None:
                self.stop_asked = f"{type(cb).__name__}.on_eval at wave {info.wave}"
        return self.stop_asked is not None


class EarlyStopping:
    """Stop when the evaluation loss (``monitor="loss"``) or metric (``monitor="metric"``) has not
    improved on its best by more than ``min_delta`` for ``patience`` evaluation points in a row
    (``mode="max"`` for a metric that grows, such as accuracy). Its state is in the run's checkpoints
    (``state_dict``), so a resumed run counts on where the killed one was."""

    def __init__(self, patience: int = 3, min_delta: float = 0.0, monitor: str = "loss", mode: str = "min") -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"hetpipe: EarlyStopping(patience=) must be a whole number >= 1, got {patience!r}")
        if not min_delta >= 0:
            raise ValueError(f"hetpipe: EarlyStopping(min_delta=) must be >= 0, got {min_delta!r}")
        if monitor not in ("loss", "metric") or mode not in ("min", "max"):
            raise ValueError(f"hetpipe: EarlyStopping monitors 'loss' or 'metric' in mode 'min' or 'max', got "
                             f"monitor={monitor!r}, mode={mode!r}")
        self.patience, self.min_delta, self.monitor, self.mode = patience, float(min_delta), monitor, mode
        self.best: Optional[float] = None
        self.bad = 0                            # evaluation points in a row without an improvement

    def on_eval(self, info: EvalInfo) -> bool:
        value = info.loss if self.monitor == "loss" else info.metric
        if value is None:
            raise ValueError(f"hetpipe: EarlyStopping monitors the evaluation {self.monitor}, which the run does not "
                             "compute (reporting.eval_data" + (" and eval_metric)" if self.monitor == "metric" else ")"))
        if self.best is None or (self.best - value if self.mode == "min" else value - self.best) > self.min_delta:
            self.best, self.bad = float(value), 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.bad = state["best"], int(state["bad"])


class BestEvaluation:
    """Remembers the best evaluation point of the run: its wave and its loss (``monitor="loss"``) or
    metric, lowest (``mode="min"``) or highest. Its state is in the run's checkpoints, so a resumed run
    compares with the killed one's points too. It never asks for a stop."""

    def __init__(self, monitor: str = "loss", mode: str = "min") -> None:
        if monitor not in ("loss", "metric") or mode not in ("min", "max"):
            raise ValueError(f"hetpipe: BestEvaluation monitors 'loss' or 'metric' in mode 'min' or 'max', got "
                             f"monitor={monitor!r}, mode={mode!r}")
        self.monitor, self.mode = monitor, mode
        self.best: Optional[float] = None
        self.wave: Optional[int] = None         # the wave after which the best point evaluated

    def on_eval(self, info: EvalInfo) -> bool:
        value = info.loss if self.monitor == "loss" else info.metric
        if value is None:
            raise ValueError(f"hetpipe: BestEvaluation monitors the evaluation {self.monitor}, which the run does "
                             "not compute")
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best, self.wave = float(value), int(info.wave)
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "wave": self.wave}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.wave = state["best"], state["wave"]
