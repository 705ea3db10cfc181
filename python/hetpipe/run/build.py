"""Builds a rank's part of a run: a stage executor or a PS shard server, with its pinned pool.

Shared by the multi-process trainer and the single-process replay: both build every part with these
functions, so the replay executes the same code as the real run, only over a loopback transport.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetpipe.model.contract import LayerFailure, boundary_bytes
from hetpipe.model.layout import ModelLayout
from hetpipe.model.tree import on_wire
from hetpipe.plan.types import Plan
from hetpipe.ps.client import pull_ahead
from hetpipe.ps.serve import shard_server
from hetpipe.ps.server import ShardServerBase
from hetpipe.run.spec import RunSpec
from hetpipe.schedule.ir import Schedule
from hetpipe.schedule.messages import MessageOptions, with_messages, without_messages
from hetpipe.schedule.registry import ScheduleOptions, generate
from hetpipe.schedule.trace import TraceEvent
from hetpipe.stage.evaluate import Evaluation
from hetpipe.stage.executor import StageExecutor
from hetpipe.stage.loss_scale import LossScale
from hetpipe.loader.check import Reading, reading
from hetpipe.loader.deal import deal_stream
from hetpipe.loader.source import CHECKED, INPUTS, LABELS, dealt, dropped_note
from hetpipe.plan.waves import deal_for
from hetpipe.stage.feed import MinibatchFeed
from hetpipe.stage.pacer import Pacer
from hetpipe.stage.settings import StageContext, StageIO, StageRun, StageTiming
from hetpipe.stage.params import StageModel, TiedKey
from hetpipe.transport import slots
from hetpipe.transport.base import Transport
from hetpipe.transport.device_copy import CopyStager
from hetpipe.transport.link import StageLink


def _pin_device(device: Optional[torch.device]) -> int:
    """The CUDA device whose context pins a pool's slots; -1 (ordinary host memory, no CUDA call) off CUDA."""
    if device is None or device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def stage_pool(spec: RunSpec, vw: int, stage: int):
    """A stage's slots (:func:`hetpipe.transport.slots.stage_slot_classes`): values sized by the larger of
    its boundaries' activations and its tied-gradient messages, PS payloads by each shard's part of its
    layers; page-locked through its own device's context when it runs on CUDA."""
    plan, lay = spec.plan, spec.layout
    st = plan.virtual_workers[vw].stages[stage]
    act = max(boundary_bytes(spec.boundaries[st.start], spec.sample_batch),
              boundary_bytes(spec.boundaries[st.stop], spec.sample_batch))
    tied = tied_message_bytes(plan, lay, vw, stage)
    replicas = lay.stage_replicas(st.start, st.stop)
    shard_bytes = [4 * (sum(lay.numel(l) + lay.buffer_numel(l) for l in sh.layers if st.start <= l < st.stop)
                        + sum(r.numel for r in replicas if r.owner in sh.layers)) for sh in plan.ps_shards]
    neighbours = (stage > 0) + (stage < len(plan.virtual_workers[vw].stages) - 1)
    classes = slots.stage_slot_classes(plan.nm_of(vw), plan.d, max([act, *tied.values()]), shard_bytes,
                                       value_peers=neighbours + len(tied), tied_peers=len(tied))
    device = _pin_device(spec.devices.get(plan.rank_of(vw, stage)))
    return slots.stage_pool(classes, device, f"VW {vw} stage {stage} (rank {plan.rank_of(vw, stage)})")


def tied_message_bytes(plan: Plan, layout: ModelLayout, vw: int, stage: int) -> Dict[int, int]:
    """Per stage of VW ``vw`` sharing tied parameters with ``stage``: the bytes of one tied-gradient
    message between them (the float32 gradients of every parameter both hold)."""
    out: Dict[int, int] = {}
    for (owner, name), holders in tied_holders(plan, layout, vw).items():
        if stage not in holders:
            continue
        numel = dict(layout.owned[owner])[name].numel()
        for peer in holders:
            if peer != stage:
                out[peer] = out.get(peer, 0) + 4 * numel
    return out


def shard_pool(spec: RunSpec, shard: int, plane: str = "python"):
    """A PS shard's slots (:func:`hetpipe.transport.slots.shard_pool`), sized for its largest push."""
    if plane == "core":
        return slots.shard_pool(spec.plan.num_stage_ranks, 0, plane)
    owned = spec.plan.ps_shards[shard].layers
    lay = spec.layout
    biggest = max((4 * (sum(lay.numel(l) + lay.buffer_numel(l) for l in owned if st.start <= l < st.stop)
                        + sum(r.numel for r in lay.stage_replicas(st.start, st.stop) if r.owner in owned))
                   for vw in spec.plan.virtual_workers for st in vw.stages), default=0)
    return slots.shard_pool(spec.plan.num_stage_ranks, biggest)


def shard_layers(plan: Plan) -> Dict[int, Sequence[int]]:
    return {sh.index: tuple(sh.layers) for sh in plan.ps_shards}


def build_stage(spec: RunSpec, vw: int, stage: int, transport: Transport, pool, *,
                trace: Optional[List[TraceEvent]] = None, t0: float = 0.0,
                decide: Optional[Callable[[int, Dict[str, float]], bool]] = None) -> StageExecutor:
    """The executor of VW ``vw``'s stage ``stage``; ``decide``: the evaluation points' decision hook
    (the last stage of VW 0's reporter, :mod:`hetpipe.run.report`)."""
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
    model = StageModel(spec.layers, st.start, st.stop, nm=plan.nm_of(vw), shard_layers=shard_layers(plan),
                       optimizer_factory=spec.optimizer_factory, device=device, recompute=tuple(st.recompute),
                       layout=spec.layout, tied_stages=tied_stages(spec, vw), seed=spec.seed, vw=vw, stage=stage,
                       precision=plan.precision,
                       micro_offset=spec.resume.micro_offset_of(vw) if spec.resume is not None else 0,
                       lr_scheduler=spec.lr_scheduler, param_names=spec.param_names,
                       lr_stride=spec.lr_stride)
    if spec.resume is not None:
        spec.resume.restore_stage(model, spec.layout, vw, stage)
    check_messages(spec, vw, stage)
    owning = {sh.index: plan.ps_rank(sh.index) for sh in plan.ps_shards
              if any(st.start <= l < st.stop for l in sh.layers)}
    ctx = StageContext(vw, stage, num_stages, lambda s: plan.rank_of(vw, s), owning,
                       {sh.index: plan.ps_rank(sh.index) for sh in plan.ps_shards}, spec.rank_names)
    inputs = labels = None
    layout = spec.schedules[vw]
    start = (spec.resume.start.epoch, spec.resume.start.index) if spec.resume is not None else (0, 0)
    deal = deal_for(plan.wave_minibatches)
    if stage == 0 or model.needs_side_inputs:
        inputs = MinibatchFeed(deal_stream(spec.data, deal, vw, spec.epochs, *start, part=INPUTS), layout)
    if stage == num_stages - 1:
        labels = MinibatchFeed(deal_stream(spec.data, deal, vw, spec.epochs, *start, part=LABELS), layout)
    staged = spec.copy_stream if spec.copy_stream is not None else device.type == "cuda"
    emulated = spec.emulated.get(rank, False) and spec.emulation_scale is not None
    pacer = Pacer(spec.emulation_scale if emulated else None)
    link = StageLink(transport, pool, device, CopyStager(pool, device) if staged else None)
    scaler = LossScale(**spec.loss_scale) if plan.precision == "fp16" else None
    if scaler is not None and spec.resume is not None:
        saved = spec.resume.loss_scale(vw, stage)
        if saved is not None:
            scaler.load(saved)
    evaluation = None
    if spec.eval_every is not None and vw == 0:
        evaluation = Evaluation(spec.eval_data, layout.num_waves - 1, plan.d, spec.eval_metric, decide)
    io = StageIO(spec.loss_fn, inputs, labels,
                 expect_in=on_wire(spec.boundaries[st.start], plan.precision) if stage > 0 else None,
                 expect_out=on_wire(spec.boundaries[st.stop], plan.precision) if stage < num_stages - 1 else None)
    run = StageRun(plan.d, layout, spec.clip_grad_norm, evaluation, scaler, spec.accumulate, pull_ahead())
    timing = StageTiming(pacer, st.fwd_time, st.bwd_time, trace, t0)
    return StageExecutor(ctx, layout.streams[stage], model, link, io, run, timing)


def tied_holders(plan: Plan, layout: ModelLayout, vw: int) -> Dict[TiedKey, Tuple[int, ...]]:
    """Per tied parameter, the stages of VW ``vw`` holding it (the parameter's owner first in layers)."""
    stages = plan.virtual_workers[vw].stages
    stage_of = {l: k for k, st in enumerate(stages) for l in range(st.start, st.stop)}
    out: Dict[TiedKey, Tuple[int, ...]] = {}
    for reps in layout.replicas:
        for r in reps:
            key = (r.owner, r.owner_name)
            out[key] = tuple(sorted({stage_of[l] for l in layout.holders(*key)}))
    return out


def tied_stages(spec: RunSpec, vw: int) -> Dict[TiedKey, Tuple[int, ...]]:
    """:func:`tied_holders` of the run's plan and model."""
    return tied_holders(spec.plan, spec.layout, vw)


def vw_messages(plan: Plan, layout: ModelLayout, vw: int, clip_grad_norm: Optional[float], accumulate: int,
                eval_every: Optional[int], eval_offset: int = 0) -> MessageOptions:
    """What VW ``vw``'s streams exchange besides activations and gradients (schedule.messages): tied
    gradients between the stages holding a tied parameter together, norm shares when clipping by the
    VW's norm or scaling fp16's loss, VW 0's evaluation points (a resumed run's waves counted from the
    checkpoint's clock ``eval_offset``, so that it evaluates where the uninterrupted run does)."""
    pairs = {(a, b) for holders in tied_holders(plan, layout, vw).values() for a in holders for b in holders if a < b}
    norm = clip_grad_norm is not None or plan.precision == "fp16"
    return MessageOptions(tuple(sorted(pairs)), norm, accumulate, (eval_every or 0) if vw == 0 else 0, eval_offset)


def vw_schedule(name: str, plan: Plan, layout: ModelLayout, vw: int, minibatches: int, split: int,
                clip_grad_norm: Optional[float], accumulate: int, eval_every: Optional[int],
                eval_offset: int = 0) -> Schedule:
    """The streams VW ``vw``'s stages execute: registered schedule ``name`` over ``minibatches`` (the first
    ``split`` run as halves), recomputing where the plan's stages do, with the run's messages."""
    stages = plan.virtual_workers[vw].stages
    messages = vw_messages(plan, layout, vw, clip_grad_norm, accumulate, eval_every, eval_offset)
    return generate(name, ScheduleOptions(len(stages), minibatches, plan.nm_of(vw), plan.d, any(st.recompute for st in stages),
                                          split, messages))


def check_messages(spec: RunSpec, vw: int, stage: int) -> None:
    """ValueError unless stage ``stage`` of VW ``vw`` has in its stream exactly the messages the run needs
    (:func:`vw_messages`, where :func:`vw_schedule` puts them): a stream without them would compute other
    numbers (a clip by one stage's share of the norm) or wait forever."""
    layout = spec.schedules[vw]
    want = vw_messages(spec.plan, spec.layout, vw, spec.clip_grad_norm, spec.accumulate, spec.eval_every,
                       spec.resume.checkpoint.clock if spec.resume is not None else 0)
    if with_messages(without_messages(layout), want).streams[stage] != layout.streams[stage]:
        raise ValueError(f"hetpipe: the stream of VW {vw} stage {stage} does not carry the messages the run needs "
                         f"({want}); build the schedules with run.build.vw_schedule")


def stage_pairs(spec: RunSpec) -> List[Tuple[int, int]]:
    """The ranks of the stages that exchange tensors: neighbours in a VW, and stages sharing tied
    parameters (gradient-norm shares are payload-free headers, which every backend sends over MPI)."""
    pairs = set()
    for vw in spec.plan.virtual_workers:
        rank = [spec.plan.rank_of(vw.index, k) for k in range(len(vw.stages))]
        pairs.update(zip(rank, rank[1:]))
        for holders in tied_stages(spec, vw.index).values():
            pairs.update((rank[a], rank[b]) for a in holders for b in holders if a < b)
    return sorted(pairs)


def build_shard(spec: RunSpec, shard: int, transport: Transport, pool, *,
                trace: Optional[List[TraceEvent]] = None, t0: float = 0.0, comm: Any = None) -> ShardServerBase:
    """The shard's server: the compiled core's data plane served over ``comm`` (an mpi4py communicator)
    when given (see :mod:`hetpipe.ps.core_plane`), else the Python shard over ``transport``."""
    plan, lay = spec.plan, spec.layout
    owned = plan.ps_shards[shard].layers
    weights = {l: lay.flat(l) for l in owned}
    buffers = {l: lay.flat_buffers(l) for l in owned}
    replicas = {(vw.index, k): [(r.owner, r.offset, r.numel) for r in lay.stage_replicas(st.start, st.stop)
                                if r.owner in owned]
                for vw in plan.virtual_workers for k, st in enumerate(vw.stages)}
    # The outer momentum and delayed-nesterov's buffer a resumed run continues from (a checkpoint without
    # them: zeros).
    momentum, delayed, counts = {}, {}, {}
    if spec.resume is not None:
        momentum = spec.resume.checkpoint.global_momentum()
        delayed, counts = spec.resume.checkpoint.global_delayed()
    momentum = {l: m for l, m in momentum.items() if l in owned}
    delayed = ({l: a for l, a in delayed.items() if l in owned}, {l: n for l, n in counts.items() if l in owned})
    return shard_server(plan, shard, weights, buffers, transport, pool, comm=comm, replicas=replicas,
                        momentum=momentum, delayed=delayed, audit=spec.audit, trace=trace, t0=t0)




def data_reading(spec: RunSpec, part: Any, who: str) -> Reading:
    """What ``part`` (a built stage or shard) reads of the data, for the start-up data check
    (:mod:`hetpipe.loader.check`); a stage reads its first minibatches ahead."""
    io = getattr(part, "io", None)        # a stage's (StageIO); a shard reads no data
    feeds = [f for f in (io.inputs, io.labels) if f is not None] if io is not None else []
    slots = deal_for(spec.plan.wave_minibatches).num_slots
    return reading(who, spec.data.minibatches_per_epoch(slots), spec.data.identity(),
                   [f.source for f in feeds], CHECKED)


def say_dropped(spec: RunSpec) -> None:
    """Say on stderr, in one line, which minibatches the run leaves unused and what to change
    (:func:`hetpipe.loader.source.dropped_note`); nothing when it trains them all. Called once, on rank 0."""
    plan = spec.plan
    slots = deal_for(plan.wave_minibatches).num_slots
    start = (spec.resume.start.epoch, spec.resume.start.index) if spec.resume is not None else (0, 0)
    per_epoch = spec.data.minibatches_per_epoch(slots)
    if plan.equal_waves:
        note = dropped_note(per_epoch, slots, plan.nm, spec.epochs, *start)
    else:
        trained, dropped = dealt(per_epoch, slots, spec.epochs, *start)
        note = None if not dropped else (
            f"hetpipe: the data has {per_epoch} minibatches per epoch; {trained} are trained and {dropped} dropped: "
            f"with waves of {list(plan.wave_minibatches)} minibatches the VWs take an epoch in rounds of {slots} "
            f"(docs/design.md, 'Waves of unequal length'); give an epoch a multiple of {slots} minibatches")
    if note is not None:
        sys.stderr.write(note + "\n")
        sys.stderr.flush()
