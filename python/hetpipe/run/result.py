"""What a run returns on every rank (:class:`TrainResult`), and the pieces of it a resumed or stopped
run adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from hetpipe.checkpoint import state as ckpt
from hetpipe.plan.types import Plan
from hetpipe.ps.shard import ShardLog
from hetpipe.schedule.trace import TraceEvent


@dataclass
class TrainResult:
    """What a run produced; identical on every rank (``rank``/``role`` aside)."""

    plan: Plan
    rank: int
    role: str
    losses: Dict[int, Dict[int, float]]             # vw -> minibatch -> loss
    weights: Dict[int, np.ndarray]                  # layer -> final global weights (flat float32)
    shard_logs: Dict[int, ShardLog]
    elapsed_s: float
    samples: int                                    # samples trained, all VWs
    trace: List[TraceEvent] = field(default_factory=list)
    emulated: bool = False
    buffers: Dict[int, np.ndarray] = field(default_factory=dict)   # layer -> final synced buffers (flat float32)
    # A resumed run: the checkpoint's path, clock, whether the plan changed, and the losses before the
    # cut (vw -> minibatch -> loss; already merged into ``losses`` when the plan is the same).
    resumed: Dict[str, Any] = field(default_factory=dict)
    transport: str = ""                             # the transport backend(s) the ranks chose, "+"-joined
    # Buffers the PS does not synchronise (num_batches_tracked, ...): VW 0's, by "layer.name".
    local_buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    # The PS shards' data plane(s), "+"-joined ("core", "python"; "" without shards), and why.
    ps_plane: str = ""
    ps_plane_reason: str = ""
    # VW 0's evaluation points: {"wave", "samples", "loss", "metric"} each (reporting.eval_every).
    evals: List[Dict[str, Any]] = field(default_factory=list)
    # An early stop: {"after_wave": the last wave trained, "asked_by": which callback, when}; {} without.
    stopped: Dict[str, Any] = field(default_factory=dict)
    # "fp16": per VW, the final loss scale, its growth tracker, and the minibatches whose step was skipped.
    loss_scale: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    # Per rank, in rank order: the CPU seconds of all the process's threads over the window ``elapsed_s``
    # measures on that rank (building its part, then stepping it to its end).
    cpu_s: List[float] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def final_loss(self, last: int = 4) -> float:
        vals = [v for per in self.losses.values() for _, v in sorted(per.items())[-last:]]
        return float(np.mean(vals)) if vals else float("nan")


def stopped_of(outcome, asked: Sequence[Optional[str]]) -> Dict[str, Any]:
    """``TrainResult.stopped`` from the run's outcome and who asked for the stop (one rank knows)."""
    if outcome.stopped_after is None:
        return {}
    return {"after_wave": outcome.stopped_after, "asked_by": next((a for a in asked if a), "")}


def resumed_losses(losses: Dict[int, Dict[int, float]], resume: ckpt.Resume) -> Dict[int, Dict[int, float]]:
    """A resumed run's losses by minibatch of the whole run: with the same plan, the checkpoint's
    losses before the cut, then this run's, shifted by the minibatches before it."""
    if not resume.same_plan:
        return losses
    before = resume.checkpoint.losses()
    return {vw: {**before.get(vw, {}), **{resume.minibatches_of(vw) + p: v for p, v in per.items()}}
            for vw, per in losses.items()}
