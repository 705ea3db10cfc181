"""The Plan: what HetPipe runs — virtual workers, their stages, Nm, D, PS shards — as plain data.

A Plan round-trips through JSON unchanged (``Plan.from_json(plan.to_json()) == plan``). Rank layout
under MPI (the runtime's contract): ranks ``0 .. S-1`` are the stages, VW by VW and stage by stage
(VW 0 stage 0, VW 0 stage 1, ..., VW 1 stage 0, ...); the PS shards follow, shard by shard.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from hetpipe.plan.outer import OUTER_FIELDS, check_outer
from hetpipe.plan.precision import check_precision
from hetpipe.util.files import read_text

PLAN_FORMAT = 1
# the most minibatches in flight per VW a plan may ask for: past a few times the pipeline depth a
# larger Nm buys nothing, and the runtime and simulator work per wave grows with it
MAX_NM = 1024


def check_integer(where: str, name: str, value: Any, lo: int, hi: Optional[int] = None, why: str = "") -> None:
    """Raise one ValueError naming ``name`` unless ``value`` is an integer in [lo, hi] (None passes)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{where}: {name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{where}: {name} must be <= {hi}{f' ({why})' if why else ''}, got {value}")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: layers ``[start, stop)`` on one device, with predicted per-minibatch costs."""

    device: str                 # device id from the cluster spec, e.g. "n0.g1"
    device_type: str            # key into the cluster's device types, e.g. "titan_v"
    start: int
    stop: int
    fwd_time: float             # predicted forward seconds per minibatch on this device
    bwd_time: float             # predicted backward seconds per minibatch (recomputation included)
    send_time: float = 0.0      # predicted seconds to send the output activation to the next stage
    memory_bytes: int = 0       # predicted peak memory of this stage
    memory_capacity: int = 0    # the device's memory
    recompute: Tuple[int, ...] = ()  # layers whose activations are recomputed in backward

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class VirtualWorkerPlan:
    """A virtual worker: an ordered list of stages (one device each) forming one pipeline."""

    index: int
    stages: Tuple[StagePlan, ...]
    throughput: float = 0.0     # predicted minibatches per second of this VW alone
    # Minibatches per wave (and in flight) of this VW; 0: the plan's Nm. A faster VW may train more
    # minibatches per wave than a slower one (docs/design.md, "Waves of unequal length").
    nm: int = 0

    @property
    def devices(self) -> Tuple[str, ...]:
        return tuple(s.device for s in self.stages)


@dataclass(frozen=True)
class ShardPlan:
    """A parameter-server shard: the layers whose parameters it owns, and where it runs."""

    index: int
    node: str
    layers: Tuple[int, ...]
    param_bytes: int = 0


AGGREGATES = ("mean", "sum")


@dataclass(frozen=True)
class Plan:
    """A complete HetPipe plan for one model on one cluster."""

    num_layers: int
    nm: int
    d: int
    policy: str
    virtual_workers: Tuple[VirtualWorkerPlan, ...]
    ps_shards: Tuple[ShardPlan, ...]
    throughput: float = 0.0             # predicted minibatches per second, whole cluster, under WSP
    minibatch_size: int = 0
    layer_names: Tuple[str, ...] = ()
    meta: Dict[str, Any] = field(default_factory=dict, compare=True)
    # How the PS combines the VWs' wave deltas: "mean" (each divided by the number of VWs: the step of
    # one GPU, as with DDP) or "sum" (HetPipe's rule). Plans written before the field read as "mean".
    aggregate: str = "mean"
    # "fp32", or "bf16": stages compute under autocast on float32 master weights and send bfloat16
    # activations (hetpipe.plan.precision). Plans written before the field read as "fp32".
    precision: str = "fp32"
    # The PS's outer optimizer (hetpipe.plan.outer, docs/design.md "Outer optimizer"): "sgd" adds each
    # aggregated push times outer_lr (lr 1: the plain rule); "nesterov" takes DiLoCo's outer step with
    # momentum outer_momentum on the wave's aggregated delta; "delayed-nesterov" adds each push at once and
    # takes a momentum step every outer_delay pushes (0: the VW count). outer_staleness "inverse" ("sqrt")
    # divides a push whose pull lagged by s versions by 1 + s (sqrt(1 + s)); outer_gain "sqrt" divides each
    # push by sqrt(N) instead of the aggregate's N or 1. Plans written before these fields read as the
    # plain rule.
    outer: str = "sgd"
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    outer_staleness: str = "none"
    outer_gain: str = "none"
    outer_delay: int = 0

    def __post_init__(self) -> None:
        self.check()

    # --- structure -------------------------------------------------------------------------
    def check(self) -> None:
        """Raise ValueError naming the culprit if the plan is not self-consistent."""
        check_integer("plan", "nm", self.nm, 1, MAX_NM)
        check_integer("plan", "d", self.d, 0)
        check_integer("plan", "num_layers", self.num_layers, 1)
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"plan: aggregate must be one of {list(AGGREGATES)}, got {self.aggregate!r}")
        check_precision(self.precision, "plan")
        check_outer("plan", **self.outer_options)
        if not self.virtual_workers:
            raise ValueError("plan: no virtual workers")
        for i, vw in enumerate(self.virtual_workers):
            if vw.index != i:
                raise ValueError(f"plan: virtual worker at position {i} has index {vw.index!r}; "
                                 f"VW indices must be 0, 1, ... in order")
            check_integer("plan", f"VW {i} nm", vw.nm, 0, MAX_NM, "0: the plan's Nm")
            for k, st in enumerate(vw.stages):
                for name in ("start", "stop"):
                    v = getattr(st, name)
                    if isinstance(v, bool) or not isinstance(v, int):
                        raise ValueError(f"plan: VW {i} stage {k} on {st.device}: {name} must be an integer, "
                                         f"got {v!r}")
        for i, sh in enumerate(self.ps_shards):
            if sh.index != i:
                raise ValueError(f"plan: PS shard at position {i} has index {sh.index!r}; "
                                 f"shard indices must be 0, 1, ... in order")
            bad = [x for x in sh.layers if isinstance(x, bool) or not isinstance(x, int)]
            if bad:
                raise ValueError(f"plan: PS shard {i} on {sh.node}: layers must be integers, got {bad[0]!r}")
        if len(self.virtual_workers) > 1 and not self.ps_shards:
            raise ValueError(f"plan: {len(self.virtual_workers)} virtual workers but no PS shards; without a "
                             f"parameter server the VWs would train unrelated replicas")
        for vw in self.virtual_workers:
            if not vw.stages:
                raise ValueError(f"plan: virtual worker {vw.index} has no stages")
            pos = 0
            for k, st in enumerate(vw.stages):
                if st.start != pos or st.stop <= st.start:
                    raise ValueError(
                        f"plan: VW {vw.index} stage {k} on {st.device} covers layers [{st.start}, {st.stop}), "
                        f"expected to start at layer {pos} and be non-empty")
                pos = st.stop
            if pos != self.num_layers:
                raise ValueError(f"plan: VW {vw.index} covers {pos} layers, the model has {self.num_layers}")
        owned = sorted(layer for sh in self.ps_shards for layer in sh.layers)
        if self.ps_shards and owned != list(range(self.num_layers)):
            raise ValueError(f"plan: PS shards must own every layer exactly once, they own {owned}")

    def nm_of(self, vw: int) -> int:
        """Minibatches per wave (and in flight) of VW ``vw``: its own Nm, else the plan's."""
        return self.virtual_workers[vw].nm or self.nm

    @property
    def wave_minibatches(self) -> Tuple[int, ...]:
        """Minibatches per wave of each VW (:meth:`nm_of`), VW by VW."""
        return tuple(self.nm_of(v) for v in range(len(self.virtual_workers)))

    @property
    def equal_waves(self) -> bool:
        """Whether every VW's wave is the plan's Nm minibatches long (HetPipe's waves)."""
        return all(n == self.nm for n in self.wave_minibatches)

    @property
    def minibatches_per_wave(self) -> int:
        """Minibatches the VWs train together in one wave (``N x Nm`` with equal waves)."""
        return sum(self.wave_minibatches)

    @property
    def outer_options(self) -> Dict[str, Any]:
        """The outer optimizer's fields (``outer``, ``outer_lr``, ``outer_momentum``, ``outer_staleness``,
        ``outer_gain``, ``outer_delay``), as the PS shards take them."""
        return {name: getattr(self, name) for name in OUTER_FIELDS}

    @property
    def num_stage_ranks(self) -> int:
        return sum(len(vw.stages) for vw in self.virtual_workers)

    @property
    def num_ranks(self) -> int:
        return self.num_stage_ranks + len(self.ps_shards)

    def rank_of(self, vw: int, stage: int) -> int:
        return sum(len(v.stages) for v in self.virtual_workers[:vw]) + stage

    def ps_rank(self, shard: int) -> int:
        return self.num_stage_ranks + shard

    def role_of(self, rank: int) -> Tuple[str, int, int]:
        """``("stage", vw, stage)`` or ``("ps", shard, -1)`` for an MPI rank."""
        r = rank
        for vw in self.virtual_workers:
            if r < len(vw.stages):
                return ("stage", vw.index, r)
            r -= len(vw.stages)
        if r < len(self.ps_shards):
            return ("ps", r, -1)
        raise ValueError(f"plan: rank {rank} has no role; the plan needs {self.num_ranks} ranks")

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["format"] = PLAN_FORMAT
        for vw in d["virtual_workers"]:
            if not vw["nm"]:
                del vw["nm"]        # equal waves: the JSON of plans written before the field
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"plan: a plan is a JSON object (virtual_workers, ps_shards, ...), got a "
                             f"{type(d).__name__}: {str(d)[:60]}")
        d = dict(d)
        fmt = d.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"plan: format {fmt} is not supported (this hetpipe reads format {PLAN_FORMAT})")
        try:
            vws = tuple(
                VirtualWorkerPlan(
                    index=v["index"],
                    stages=tuple(StagePlan(**{**s, "recompute": tuple(s.get("recompute", ()))}) for s in v["stages"]),
                    throughput=v.get("throughput", 0.0), nm=v.get("nm", 0))
                for v in d.pop("virtual_workers"))
            shards = tuple(ShardPlan(**{**s, "layers": tuple(s["layers"])}) for s in d.pop("ps_shards"))
            return cls(virtual_workers=vws, ps_shards=shards,
                       layer_names=tuple(d.pop("layer_names", ())), **d)
        except (KeyError, TypeError) as e:
            raise ValueError(f"plan: malformed plan data: {e}") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan: not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Plan":
        p = Path(path)
        text = read_text(p, "plan")
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise ValueError(f"{e} (in {p})") from None
