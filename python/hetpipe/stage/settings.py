"""What a stage executor is built from, besides its stream, model and link: where the stage sits
(:class:`StageContext`), what it reads and what crosses its boundaries (:class:`StageIO`), the run's
settings it follows (:class:`StageRun`) and how its time is paced and traced (:class:`StageTiming`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from hetpipe.model.tree import Boundary
from hetpipe.schedule.ir import Schedule
from hetpipe.schedule.trace import TraceEvent
from hetpipe.stage.evaluate import Evaluation
from hetpipe.stage.feed import MinibatchFeed
from hetpipe.stage.loss_scale import LossScale
from hetpipe.stage.pacer import Pacer


@dataclass
class StageContext:
    """Where this stage sits: its VW and index, the ranks of its neighbours and PS shards."""

    vw: int
    stage: int
    num_stages: int
    rank_of_stage: Callable[[int], int]         # stage index in this VW -> rank
    shard_ranks: Dict[int, int]                 # PS shard index -> rank (shards owning this stage's layers)
    all_shard_ranks: Dict[int, int] = field(default_factory=dict)   # every PS shard (DONE goes to all)
    # How to name a rank in messages, where it is not just "rank R": its world rank and host, when
    # ranks were renumbered in plan order or the world spans several hosts.
    rank_names: Dict[int, str] = field(default_factory=dict)

    def who(self, stage: Optional[int] = None) -> str:
        s = self.stage if stage is None else stage
        r = self.rank_of_stage(s)
        return f"VW {self.vw} stage {s} ({self.rank_names.get(r, f'rank {r}')})"


@dataclass
class StageIO:
    """What the stage reads and what crosses its boundaries: the loss (last stage), its feeds of inputs
    (stage 0, and stages taking side inputs) and labels (last stage), and the wire form of the value
    entering it (``expect_in``, stages > 0) and leaving it (``expect_out``, all but the last)."""

    loss_fn: Optional[Callable] = None
    inputs: Optional[MinibatchFeed] = None
    labels: Optional[MinibatchFeed] = None
    expect_in: Optional[Boundary] = None
    expect_out: Optional[Boundary] = None


@dataclass
class StageRun:
    """The run's settings the stage follows: the staleness bound ``d``; ``layout``, the schedule whose
    micro-batch arithmetic its stream follows (None: micro-batch j is minibatch j); clipping by the
    VW's gradient norm; VW 0's evaluation points; fp16's loss scale; a step every ``accumulate``
    minibatches; ``pull_ahead``: request each pull as soon as WSP lets the shards answer it, not at its
    Pull instruction (``ps.client``)."""

    d: int = 0
    layout: Optional[Schedule] = None
    clip_grad_norm: Optional[float] = None
    evaluation: Optional[Evaluation] = None
    loss_scale: Optional[LossScale] = None
    accumulate: int = 1
    pull_ahead: bool = True


@dataclass
class StageTiming:
    """Emulated speed (``pacer`` pads each Fwd and Bwd to ``fwd_time`` / ``bwd_time`` seconds) and the
    trace (events appended to ``trace`` when given, times since ``t0``)."""

    pacer: Optional[Pacer] = None
    fwd_time: float = 0.0
    bwd_time: float = 0.0
    trace: Optional[List[TraceEvent]] = None
    t0: float = 0.0
