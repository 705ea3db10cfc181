"""Builds a rank's part of a run — a stage executor or a PS shard server — and drives it to the end.

Shared by the multi-process trainer and the single-process replay: both build every part with these
functions, so the replay executes the same code as the real run, only over a loopback transport.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

import hetpipe_core
from hetpipe.plan.types import Plan
from hetpipe.runtime.data import select, vw_minibatches
from hetpipe.runtime.device_copy import CopyStager
from hetpipe.runtime.emulation import Pacer
from hetpipe.runtime.link import StageLink
from hetpipe.runtime.executor import MinibatchFeed, StageContext, StageExecutor
from hetpipe.runtime.layout import ModelLayout, local_buffers
from hetpipe.runtime.ps import ShardLog, ShardServer, ShardState
from hetpipe.runtime.stage_model import StageModel, TiedKey
from hetpipe.runtime.tree import Boundary, boundary_of, on_wire
from hetpipe.runtime.transport import Backoff, Transport
from hetpipe.schedule.ir import Schedule
from hetpipe.schedule.trace import TraceEvent

Steppable = Union[StageExecutor, ShardServer]


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
    # Stage-to-stage tensors through a copy stream (runtime.device_copy)? None: on CUDA devices only.
    copy_stream: Optional[bool] = None
    audit: bool = False                         # PS shards log float64 sums of the pushed deltas
    seed: int = 0                               # of every stage's random draws (runtime.stage_model.minibatch_seed)
    layout: Optional[ModelLayout] = None        # None: computed from ``layers``
    # A resumed run (runtime.checkpoint.Resume): where its data starts, the seeds' micro-batch offset,
    # and the optimizer states each stage restores once built. None: a run from the start.
    resume: Any = None

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = ModelLayout(self.layers)


def as_layers(model: Union[nn.Module, Sequence[nn.Module]]) -> List[nn.Module]:
    """The ordered layers of an ``nn.Sequential`` (or of a list of modules)."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple, nn.ModuleList)):
        return list(model)
    raise TypeError(f"hetpipe: the model must be an nn.Sequential or a list of modules, got {type(model).__name__}")


@dataclass(frozen=True)
class LayerFailure:
    """Layer ``layer`` raised during shape inference on this rank; the boundaries after it are unknown."""

    layer: int
    error: str

    def explain(self) -> str:
        return f"layer {self.layer} failed on the first minibatch during shape inference: {self.error}"


def side_inputs_of(layer: nn.Module, i: int, inputs: Any) -> Dict[str, Any]:
    """The side inputs layer ``i`` declares (``hetpipe_side_inputs``), taken from the minibatch inputs."""
    keys = tuple(getattr(layer, "hetpipe_side_inputs", ()))
    if not keys:
        return {}
    if not isinstance(inputs, dict):
        raise ValueError(f"hetpipe: layer {i} ({type(layer).__name__}) declares side inputs {list(keys)}, but the "
                         f"minibatch inputs are a {type(inputs).__name__}, not a dict")
    missing = [k for k in keys if k not in inputs]
    if missing:
        raise ValueError(f"hetpipe: layer {i} ({type(layer).__name__}) declares side inputs {missing} that the "
                         f"minibatch inputs lack (their keys: {sorted(inputs)})")
    return {k: inputs[k] for k in keys}


FALLBACK_SAMPLES = 2


def infer_boundaries(layers: Sequence[nn.Module], x: Any) -> List[Union[Boundary, LayerFailure, None]]:
    """What enters each layer (and leaves the last), as :class:`Boundary` pytree specs.

    ``x`` is the first minibatch's inputs (a tensor or a dict of tensors). Runs on the meta device (no
    real compute), falling back to a real no-grad pass, on a copy of the layer and with the caller's
    random state restored, for layers meta cannot run (e.g. a causal-mask builder that reads the
    attention mask's values). The real pass takes the first ``FALLBACK_SAMPLES`` samples only: a
    boundary is per sample (batch on dim 0), and a whole minibatch of a large model would cost every
    rank minutes of CPU at start-up; two, not one, so that a training-mode BatchNorm still has a
    batch to normalise over. A layer returning a non-tensor leaf is a
    TypeError naming it. A layer that raises on this rank's copy of the model gives a
    :class:`LayerFailure` for every later boundary: only a stage that needs one of them fails (see
    :func:`build_stage`), with that layer's own error."""
    out: List[Union[Boundary, LayerFailure, None]] = [boundary_of(x, "the data loader's inputs")]
    to_meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    cur = pytree.tree_map(to_meta, x)
    meta_inputs = pytree.tree_map(to_meta, x)
    real: Any = None
    few = pytree.tree_map(lambda t: t[:FALLBACK_SAMPLES] if isinstance(t, torch.Tensor) and t.dim() else t, x)
    for i, layer in enumerate(layers):
        side = side_inputs_of(layer, i, few)
        where = f"layer {i} ({type(layer).__name__})"
        try:
            with torch.random.fork_rng(devices=[]):
                if real is None:
                    try:
                        tensors = {k: to_meta(v) for k, v in (*layer.named_parameters(), *layer.named_buffers())}
                        cur = torch.func.functional_call(layer, tensors, (cur,),
                                                         side_inputs_of(layer, i, meta_inputs))
                    except (NotImplementedError, RuntimeError):
                        real = pytree.tree_map(lambda t: torch.zeros((min(t.shape[0], FALLBACK_SAMPLES),
                                                                      *t.shape[1:]), dtype=t.dtype), cur)
                if real is not None:
                    with torch.no_grad():
                        real = copy.deepcopy(layer)(real, **side)
        except Exception as e:  # noqa: BLE001 - this rank's copy cannot run layer i; later shapes are unknown
            out.extend([LayerFailure(i, f"{type(e).__name__}: {e}")] * (len(layers) - i))
            break
        out.append(boundary_of(cur if real is None else real, where))
    return out


def boundary_bytes(b: Union[Boundary, LayerFailure, None], batch: int) -> int:
    return b.nbytes(batch) if isinstance(b, Boundary) else 0


def _round_slot(nbytes: int) -> int:
    return max(4096, -(-nbytes // 4096) * 4096)


def _pin_device(device: Optional[torch.device]) -> int:
    """The CUDA device whose context pins a pool's slots; -1 (ordinary host memory, no CUDA call) off CUDA."""
    if device is None or device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def stage_pool(spec: RunSpec, vw: int, stage: int):
    """A stage's slots, page-locked through its own device's context when it runs on CUDA."""
    st = spec.plan.virtual_workers[vw].stages[stage]
    lay = spec.layout
    param_bytes = 4 * (sum(lay.numel(l) + lay.buffer_numel(l) for l in range(st.start, st.stop))
                       + sum(r.numel for r in lay.stage_replicas(st.start, st.stop)))
    act = max(boundary_bytes(spec.boundaries[st.start], spec.sample_batch),
              boundary_bytes(spec.boundaries[st.stop], spec.sample_batch))
    slots = 2 * spec.plan.nm + 2 * len(spec.plan.ps_shards) + 8
    device = _pin_device(spec.devices.get(spec.plan.rank_of(vw, stage)))
    return hetpipe_core.PinnedBufferPool(slots, _round_slot(max(act, param_bytes)), device)


def shard_pool(spec: RunSpec, shard: int, plane: str = "python"):
    """A PS shard's slots: ordinary host memory (device -1), so a PS rank opens no CUDA context. The
    core plane receives and sends in place, so its Python side (DONE messages only) needs one small slot."""
    if plane == "core":
        return hetpipe_core.PinnedBufferPool(1, 4096, -1)
    owned = spec.plan.ps_shards[shard].layers
    lay = spec.layout
    biggest = max((4 * (sum(lay.numel(l) + lay.buffer_numel(l) for l in owned if st.start <= l < st.stop)
                        + sum(r.numel for r in lay.stage_replicas(st.start, st.stop) if r.owner in owned))
                   for vw in spec.plan.virtual_workers for st in vw.stages), default=0)
    return hetpipe_core.PinnedBufferPool(2 * spec.plan.num_stage_ranks + 8, _round_slot(biggest), -1)


def shard_layers(plan: Plan) -> Dict[int, Sequence[int]]:
    return {sh.index: tuple(sh.layers) for sh in plan.ps_shards}


def build_stage(spec: RunSpec, vw: int, stage: int, transport: Transport, pool, *,
                trace: Optional[List[TraceEvent]] = None, t0: float = 0.0) -> StageExecutor:
    plan = spec.plan
    st = plan.virtual_workers[vw].stages[stage]
    num_stages = len(plan.virtual_workers[vw].stages)
    rank = plan.rank_of(vw, stage)
    for i in (st.start, st.stop):
        b = spec.boundaries[i]
        if isinstance(b, LayerFailure):
            raise ValueError(f"hetpipe: VW {vw} stage {stage} (rank {rank}) needs what enters layer {i}, but "
                             f"{b.explain()}")
    device = spec.devices.get(rank, torch.device("cpu"))
    model = StageModel(spec.layers, st.start, st.stop, nm=plan.nm, shard_layers=shard_layers(plan),
                       optimizer_factory=spec.optimizer_factory, device=device, recompute=tuple(st.recompute),
                       layout=spec.layout, tied_stages=tied_stages(spec, vw), seed=spec.seed, vw=vw, stage=stage,
                       precision=plan.precision,
                       micro_offset=spec.resume.micro_offset if spec.resume is not None else 0)
    if spec.resume is not None:
        spec.resume.restore_stage(model, spec.layout, vw, stage)
    owning = {sh.index: plan.ps_rank(sh.index) for sh in plan.ps_shards
              if any(st.start <= l < st.stop for l in sh.layers)}
    ctx = StageContext(vw, stage, num_stages, lambda s: plan.rank_of(vw, s), owning,
                       {sh.index: plan.ps_rank(sh.index) for sh in plan.ps_shards})
    inputs = labels = None
    layout = spec.schedules[vw]
    start = (spec.resume.start.epoch, spec.resume.start.index) if spec.resume is not None else (0, 0)
    if stage == 0 or model.needs_side_inputs:
        inputs = MinibatchFeed(select(vw_minibatches(spec.data, vw, len(plan.virtual_workers), spec.epochs, *start),
                                      0), layout)
    if stage == num_stages - 1:
        labels = MinibatchFeed(select(vw_minibatches(spec.data, vw, len(plan.virtual_workers), spec.epochs, *start),
                                      1), layout)
    staged = spec.copy_stream if spec.copy_stream is not None else device.type == "cuda"
    emulated = spec.emulated.get(rank, False) and spec.emulation_scale is not None
    pacer = Pacer(spec.emulation_scale if emulated else None)
    link = StageLink(transport, pool, device, CopyStager(pool, device) if staged else None)
    return StageExecutor(ctx, layout.streams[stage], model, link, loss_fn=spec.loss_fn,
                         inputs=inputs, labels=labels,
                         expect_in=on_wire(spec.boundaries[st.start], plan.precision) if stage > 0 else None,
                         expect_out=on_wire(spec.boundaries[st.stop], plan.precision) if stage < num_stages - 1
                         else None,
                         pacer=pacer, fwd_time=st.fwd_time, bwd_time=st.bwd_time, trace=trace, t0=t0, d=plan.d,
                         layout=layout)


def tied_stages(spec: RunSpec, vw: int) -> Dict[TiedKey, Tuple[int, ...]]:
    """Per tied parameter, the stages of VW ``vw`` holding it (the parameter's owner first in layers)."""
    stages = spec.plan.virtual_workers[vw].stages
    stage_of = {l: k for k, st in enumerate(stages) for l in range(st.start, st.stop)}
    out: Dict[TiedKey, Tuple[int, ...]] = {}
    for reps in spec.layout.replicas:
        for r in reps:
            key = (r.owner, r.owner_name)
            out[key] = tuple(sorted({stage_of[l] for l in spec.layout.holders(*key)}))
    return out


def stage_pairs(spec: RunSpec) -> List[Tuple[int, int]]:
    """The ranks of the stages that exchange messages: neighbours in a VW, and stages sharing tied parameters."""
    pairs = set()
    for vw in spec.plan.virtual_workers:
        rank = [spec.plan.rank_of(vw.index, k) for k in range(len(vw.stages))]
        pairs.update(zip(rank, rank[1:]))
        for holders in tied_stages(spec, vw.index).values():
            pairs.update((rank[a], rank[b]) for a in holders for b in holders if a < b)
    return sorted(pairs)


def flat_weights(layer: nn.Module) -> np.ndarray:
    """A private flat float32 copy of one layer's parameters (its ``named_parameters`` order)."""
    ps = [p.detach().to("cpu").reshape(-1) for p in layer.parameters()]
    return (torch.cat(ps) if ps else torch.zeros(0)).numpy().astype(np.float32, copy=True)


def initial_weights(layers: Sequence[nn.Module], first: int) -> Dict[int, np.ndarray]:
    """Flat float32 weights of consecutive layers, keyed by model layer index (``layers[0]`` is ``first``)."""
    return {first + i: flat_weights(layer) for i, layer in enumerate(layers)}


def build_shard(spec: RunSpec, shard: int, transport: Transport, pool, *,
                trace: Optional[List[TraceEvent]] = None, t0: float = 0.0, comm: Any = None) -> ShardServer:
    """The shard's server: the compiled core's data plane served over ``comm`` (an mpi4py communicator)
    when given (see :mod:`hetpipe.runtime.ps_core`), else the Python shard over ``transport``."""
    plan, lay = spec.plan, spec.layout
    owned = plan.ps_shards[shard].layers
    weights = {l: lay.flat(l) for l in owned}
    buffers = {l: lay.flat_buffers(l) for l in owned}
    stage_layers = [[(s.start, s.stop) for s in vw.stages] for vw in plan.virtual_workers]
    replicas = {(vw.index, k): [(r.owner, r.offset, r.numel) for r in lay.stage_replicas(st.start, st.stop)
                                if r.owner in owned]
                for vw in plan.virtual_workers for k, st in enumerate(vw.stages)}
    if comm is not None:
        from hetpipe.runtime.ps_core import CoreShardServer, CoreShardState

        core = CoreShardState(shard, weights, stage_layers, plan.d, log_sums=spec.audit, buffers=buffers,
                              replicas=replicas, aggregate=plan.aggregate)
        return CoreShardServer(core, transport, pool, plan.num_stage_ranks, comm, trace=trace, t0=t0)
    state = ShardState(shard, weights, stage_layers, plan.d, log_sums=spec.audit, buffers=buffers,
                       replicas=replicas, aggregate=plan.aggregate)
    return ShardServer(state, transport, pool, plan.num_stage_ranks, trace=trace, t0=t0)


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


def stage_layer_weights(ex: StageExecutor, layout: ModelLayout) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    """The live weights and synced buffers of a stage's layers (flat float32 per layer)."""
    return ex.model.layer_weights(layout)


@dataclass
class Outcome:
    """What the parts of a run produced, merged: losses, final weights, PS logs, samples trained."""

    losses: Dict[int, Dict[int, float]] = field(default_factory=dict)    # vw -> minibatch -> loss
    weights: Dict[int, np.ndarray] = field(default_factory=dict)         # layer -> final global weights
    shard_logs: Dict[int, ShardLog] = field(default_factory=dict)
    samples: int = 0
    buffers: Dict[int, np.ndarray] = field(default_factory=dict)         # layer -> final synced buffers
    local_buffers: Dict[str, torch.Tensor] = field(default_factory=dict)  # "layer.name" -> VW 0's value


def part_outcome(part: Steppable, plan: Plan, layout: ModelLayout) -> Dict[str, Any]:
    """What one finished part contributes to the run's :class:`Outcome` (picklable)."""
    mine: Dict[str, Any] = {}
    if isinstance(part, StageExecutor):
        if part.is_last:
            mine["losses"] = (part.ctx.vw, dict(part.losses))
        if part.is_first:
            mine["samples"] = sum(part.batch_sizes.values())
        if part.ctx.vw == 0:
            # Buffers the PS does not synchronise (num_batches_tracked, ...): VW 0's, as its weights
            # would be without PS shards; a data-parallel user gets one replica's counters too.
            mine["local_buffers"] = {n: b.detach().to("cpu", copy=True)
                                     for n, b in local_buffers(part.model, layout).items()}
        # Without PS shards the final weights are VW 0's live weights.
        if not plan.ps_shards and part.ctx.vw == 0:
            live = stage_layer_weights(part, layout)
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
    return out


def load_layer_weights(layers: Sequence[nn.Module], weights: Dict[int, np.ndarray],
                       buffers: Optional[Dict[int, np.ndarray]] = None,
                       local: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write flat per-layer weights (the parameters each layer owns, see ``runtime.layout``), synced
    buffers and the unsynchronised buffers ``local`` (by ``"layer.name"``) into the model's layers, in
    place; a tied parameter stays one tensor."""
    layout = ModelLayout(layers)
    for l, flat in weights.items():
        layout.load(l, flat, (buffers or {}).get(l))
    with torch.no_grad():
        for key, value in (local or {}).items():
            l, name = key.split(".", 1)
            layers[int(l)].get_buffer(name).copy_(value)
