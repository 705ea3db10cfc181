"""What defines a run (identical on every rank) and what its parts produce."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import numpy as np
import torch
from torch import nn

from hetpipe.model.contract import LayerFailure
from hetpipe.model.layout import ModelLayout, local_buffers
from hetpipe.model.tree import Boundary
from hetpipe.plan.types import Plan
from hetpipe.ps.server import ShardServerBase
from hetpipe.ps.shard import ShardLog
from hetpipe.schedule.ir import Schedule
from hetpipe.stage.executor import StageExecutor

Steppable = Union[StageExecutor, ShardServerBase]


@dataclass
class RunSpec:
    """Everything that defines a run, identical on every rank (each rank holds its own model copy)."""

    plan: Plan
    layers: List[nn.Module]
    loss_fn: Callable
    optimizer_factory: Callable
    data: Iterable
    epochs: int
    schedules: List[Schedule]                   # per VW
    boundaries: List[Union[Boundary, "LayerFailure", None]]   # what enters layer i (i = L: the output)
    sample_batch: int                           # batch size of the first minibatch (sizes the pool slots)
    emulation_scale: Optional[float] = None     # None: no padding
    devices: Dict[int, torch.device] = field(default_factory=dict)   # stage rank -> torch device
    emulated: Dict[int, bool] = field(default_factory=dict)          # stage rank -> pad to the profile?
    rank_names: Dict[int, str] = field(default_factory=dict)         # rank -> "rank W on host H" (see StageContext)
    # Stage-to-stage tensors through a copy stream (transport.device_copy)? None: on CUDA devices only.
    copy_stream: Optional[bool] = None
    audit: bool = False                         # PS shards log float64 sums of the pushed deltas
    seed: int = 0                               # of every stage's random draws (stage.params.minibatch_seed)
    layout: Optional[ModelLayout] = None        # None: computed from ``layers``
    # A resumed run (checkpoint.state.Resume): where its data starts, the seeds' micro-batch offset,
    # and the optimizer states each stage restores once built. None: a run from the start.
    resume: Any = None
    lr_scheduler: Optional[Callable] = None     # optimizer -> LR scheduler, built and stepped by every stage
    lr_stride: int = 1                          # scheduler steps per optimizer step (stage.optim)
    clip_grad_norm: Optional[float] = None      # clip each minibatch's gradient to this VW-wide norm
    param_names: Dict[Any, str] = field(default_factory=dict)   # (layer, local name) -> the model's name
    # VW 0's evaluation points (stage.evaluate): every eval_every waves (None: none), on eval_data (a
    # DataSource; None: the points only decide), with eval_metric(output, labels) besides the loss.
    eval_every: Optional[int] = None
    eval_data: Any = None
    eval_metric: Optional[Callable] = None
    loss_scale: Dict[str, Any] = field(default_factory=dict)   # "fp16": stage.loss_scale.LossScale's options
    accumulate: int = 1                         # a step every `accumulate` minibatches (their mean gradient)

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = ModelLayout(self.layers)


@dataclass
class Outcome:
    """What the parts of a run produced, merged: losses, final weights, PS logs, samples trained."""

    losses: Dict[int, Dict[int, float]] = field(default_factory=dict)    # vw -> minibatch -> loss
    weights: Dict[int, np.ndarray] = field(default_factory=dict)         # layer -> final global weights
    shard_logs: Dict[int, ShardLog] = field(default_factory=dict)
    samples: int = 0
    buffers: Dict[int, np.ndarray] = field(default_factory=dict)         # layer -> final synced buffers
    local_buffers: Dict[str, torch.Tensor] = field(default_factory=dict)  # "layer.name" -> VW 0's value
    evals: List[Dict[str, Any]] = field(default_factory=list)            # VW 0's evaluation points
    stopped_after: Optional[int] = None                                  # an early stop's last wave
    loss_scale: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # "fp16": vw -> final scale, skipped steps


def part_outcome(part: Steppable, plan: Plan, layout: ModelLayout) -> Dict[str, Any]:
    """What one finished part contributes to the run's :class:`Outcome` (picklable)."""
    mine: Dict[str, Any] = {}
    if isinstance(part, StageExecutor):
        if part.is_last:
            mine["losses"] = (part.ctx.vw, dict(part.losses))
            if part.ctx.vw == 0:
                mine["evals"] = list(part.eval_results)
            if part.scaler is not None:
                mine["loss_scale"] = (part.ctx.vw, {**part.scaler.state(), "skipped_minibatches": part.scaler.skipped})
        if part.stopped_after is not None:
            mine["stopped_after"] = part.stopped_after
        if part.is_first:
            mine["samples"] = sum(part.batch_sizes.values())
        if part.ctx.vw == 0:
            # Buffers the PS does not synchronise (num_batches_tracked, ...): VW 0's, as its weights
            # would be without PS shards; a data-parallel user gets one replica's counters too.
            mine["local_buffers"] = {n: b.detach().to("cpu", copy=True)
                                     for n, b in local_buffers(part.model, layout).items()}
        # Without PS shards the final weights are VW 0's live weights.
        if not plan.ps_shards and part.ctx.vw == 0:
            live = part.model.layer_weights(layout)
            mine["weights"] = {l: w for l, (w, _) in live.items()}
            mine["buffers"] = {l: b for l, (_, b) in live.items()}
    else:
        mine["weights"] = {l: w.copy() for l, w in part.weights.items()}
        mine["buffers"] = {l: b.copy() for l, b in part.state.B.items()}
        mine["log"] = (part.state.index, part.state.log)
    return mine


def merge_outcomes(parts: Iterable[Dict[str, Any]]) -> Outcome:
    """The run's :class:`Outcome` from every part's :func:`part_outcome`."""
    out = Outcome()
    for m in parts:
        if "losses" in m:
            out.losses[m["losses"][0]] = m["losses"][1]
        out.samples += m.get("samples", 0)
        out.weights.update(m.get("weights", {}))
        out.buffers.update(m.get("buffers", {}))
        out.local_buffers.update(m.get("local_buffers", {}))
        if "log" in m:
            out.shard_logs[m["log"][0]] = m["log"][1]
        out.evals.extend(m.get("evals", []))
        if "loss_scale" in m:
            out.loss_scale[m["loss_scale"][0]] = m["loss_scale"][1]
        if "stopped_after" in m:
            out.stopped_after = m["stopped_after"]
    return out
