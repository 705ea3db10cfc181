"""The user-facing Trainer: plan, start every rank's role under MPI, train under WSP, report.

Every rank of ``mpiexec -n N python train.py`` builds the same Trainer (same model seed, same data)
and calls :meth:`Trainer.fit`. Rank 0 plans (or the given plan is used) and broadcasts the plan; each
rank then runs its role — a pipeline stage of a virtual worker or a parameter-server shard — and at
the end every rank receives the final global weights, loaded into its copy of the model.
:meth:`Trainer.replay` runs the same spec in one process (the reference).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.job import failure
from hetpipe.job.roles import LaunchError, Role, check_world, resolve_device, role_of
from hetpipe.job.rundir import RUN_DIR_ENV, register_rank
from hetpipe.job.world import gather_hosts, world
from hetpipe.loader import as_source
from hetpipe.model.contract import as_layers, infer_boundaries
from hetpipe.model.layout import ModelLayout, local_buffers
from hetpipe.model.names import model_names, param_names
from hetpipe.model.tree import batch_of
from hetpipe.model.weights import load_layer_weights
from hetpipe.outputs import check_file
from hetpipe.plan.types import Plan
from hetpipe.precision import check_precision
from hetpipe.ps.core_plane import choose_plane
from hetpipe.ps.shard import ShardLog
from hetpipe.loader.check import DataMismatch, compare
from hetpipe.run.build import build_shard, build_stage, data_reading, shard_pool, stage_pairs, stage_pool
from hetpipe.run.drive import drive
from hetpipe.run.callbacks import Callbacks
from hetpipe.run.record import RunRecord
from hetpipe.run.report import Reporter
from hetpipe.run.replay import ReplayResult, replay_run
from hetpipe.run.spec import RunSpec, merge_outcomes, part_outcome
from hetpipe.schedule.registry import ScheduleOptions, generate, get_schedule
from hetpipe.schedule.trace import TraceEvent
from hetpipe.stage.executor import StageExecutor
from hetpipe.stage.loss_scale import LossScale
from hetpipe.transport import registry as transports


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
    # VW 0's evaluation points: {"wave", "samples", "loss", "metric"} each (Trainer(eval_every=)).
    evals: List[Dict[str, Any]] = field(default_factory=list)
    # An early stop: {"after_wave": the last wave trained, "asked_by": which callback, when}; {} without.
    stopped: Dict[str, Any] = field(default_factory=dict)
    # "fp16": per VW, the final loss scale, its growth tracker, and the minibatches whose step was skipped.
    loss_scale: Dict[int, Dict[str, Any]] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def final_loss(self, last: int = 4) -> float:
        vals = [v for per in self.losses.values() for _, v in sorted(per.items())[-last:]]
        return float(np.mean(vals)) if vals else float("nan")


def override(plan: Plan, nm: Optional[int], d: Optional[int]) -> Plan:
    """``plan`` with ``nm`` / ``d`` replaced where given and different.

    The stage boundaries and memory verdict were made for the plan's own Nm: a larger ``nm`` keeps
    more activations in flight, so it is refused when the plan's stages carry a memory capacity (the
    plan has no layer profile to re-check it with). The cost model's prediction no longer applies:
    the plan's and its VWs' throughputs become 0 and ``meta["prediction"]`` says why."""
    changes: Dict[str, Any] = {}
    if nm is not None and nm != plan.nm:
        changes["nm"] = nm
    if d is not None and d != plan.d:
        changes["d"] = d
    if not changes:
        return plan
    if changes.get("nm", 0) > plan.nm:
        for vw in plan.virtual_workers:
            for k, st in enumerate(vw.stages):
                if st.memory_capacity > 0:
                    raise LaunchError(
                        f"hetpipe: nm = {nm} exceeds the plan's nm = {plan.nm}, for which VW {vw.index} stage {k} "
                        f"on {st.device} was sized to {st.memory_bytes} of its {st.memory_capacity} bytes; more "
                        "minibatches in flight may not fit: re-plan with this nm instead of overriding it")
    what = ", ".join(f"{k} {getattr(plan, k)} -> {v}" for k, v in changes.items())
    vws = tuple(dataclasses.replace(vw, throughput=0.0) for vw in plan.virtual_workers)
    meta = {**plan.meta, "prediction": f"none: the plan's predicted throughput was for other settings ({what})"}
    return dataclasses.replace(plan, virtual_workers=vws, throughput=0.0, meta=meta, **changes)


def with_precision(plan: Plan, precision: str) -> Plan:
    """``plan`` training in ``precision`` ("fp32" or "bf16"). Its stages' send times were predicted
    for its own wire bytes, which the precision halves or doubles: when it changes, the plan's and
    its VWs' throughputs become 0 and ``meta["prediction"]`` says why (re-plan to predict)."""
    check_precision(precision, "hetpipe")
    if precision == plan.precision:
        return plan
    vws = tuple(dataclasses.replace(vw, throughput=0.0) for vw in plan.virtual_workers)
    meta = {**plan.meta, "prediction": f"none: the plan's predicted throughput was for precision {plan.precision}"}
    return dataclasses.replace(plan, virtual_workers=vws, throughput=0.0, meta=meta, precision=precision)


class Trainer:
    """Train ``model`` with HetPipe: pipelined virtual workers synchronised by WSP through PS shards.

    model: an ``nn.Sequential`` or a list of modules (the layers the plan partitions), built
        identically (same seed) on every rank, following the layer contract (docs/design.md): layers
        pass any pytree of tensors; ``hetpipe_side_inputs`` names keys of the inputs dict a layer also
        takes; a parameter shared by several layers stays one (tied) parameter; BatchNorm running
        statistics are averaged across VWs at wave boundaries. loss_fn(output, labels) -> scalar tensor.
    optimizer: a factory ``params -> torch.optim.Optimizer``; each stage builds its own over its layers.
        Marked with :func:`hetpipe.named_params` it gets ``(name, parameter)`` pairs under the model's
        own names instead, to build parameter groups by name.
    data: where the minibatches come from (:mod:`hetpipe.loader`, README "Data"): a
        :class:`~hetpipe.loader.DatasetSource` (a map-style Dataset sharded by VW with a seeded sampler),
        a ``DataLoader`` (over a map-style dataset with an ordinary sampler it becomes one, shuffled with
        ``seed`` when it shuffles), a :class:`~hetpipe.loader.StreamSource` or any re-iterable of
        ``(inputs, labels)`` minibatches yielding the same sequence on every rank (checked at start-up),
        or a factory ``(vw, num_vws, epoch) -> iterable`` of a VW's own minibatches.
    plan: a :class:`Plan` or a plan JSON path; else rank 0 plans with ``policy`` on ``cluster``
        (default: the ``cpu-emulated`` preset) from a profile of the model.
    nm, d: minibatches in flight per VW and the staleness bound (override the plan's when given: the
        plan's predicted throughput is then dropped, and an nm larger than that of a plan sized
        against device memory is refused; see :func:`override`).
    schedule: the registered schedule every VW runs (:mod:`hetpipe.schedule.registry`; default
        "hetpipe", the WSP schedule); one that does not take an option the run sets (the plan's nm or
        d, recomputation, split_startup) is refused naming it.
    split_startup: run the first ``split_startup`` minibatches of each VW as two half micro-batches
        (AutoPipe-H's split start-up); the loss must be a mean over samples, so that the halves'
        losses weighted by their share of the samples sum to the minibatch's.
    timeout: seconds a rank may wait for a peer before the job fails (default HETPIPE_TIMEOUT or 120).
    emulate: pad stages to their device type's profile (None: when the device is emulated on this host).
    copy_stream: move stage-to-stage tensors through a copy stream overlapping compute (None: on CUDA
        devices only; True also on CPU, where the inline copy is faster).
    metrics / trace: paths of the JSON-lines metrics file and of a Chrome trace of the run.
    audit: PS shards also keep, per layer, the float64 sum of every delta pushed to them, as applied
        (``TrainResult.shard_logs[k].pushed_sum``, to check that the final weights moved by exactly
        the pushes); off by default, since it adds a float64 pass over every push.
    aggregate: how the PS combines the VWs' deltas, "mean" or "sum" (None: the plan's, by default
        "mean"). With "mean" a wave moves the weights by the VWs' average change, so learning rates
        tuned on one GPU carry over (as with DDP); "sum" is HetPipe's rule, which with N VWs takes
        N times the step: scale the learning rate by 1/N to get the same.
    precision: "fp32", "bf16" or "fp16" (None: the plan's; a plan made here is "fp32"). With "bf16" or
        "fp16" each stage computes its forward and the loss under ``torch.autocast`` to that half type
        while its weights, the optimizer and the PS stay float32, and float32 activations and their
        gradients cross stages in the half type (docs/design.md, "Mixed precision"); a plan made here
        then predicts half the transfer bytes. "fp16" adds dynamic loss scaling, one scale per VW
        (:mod:`hetpipe.stage.loss_scale`; ``TrainResult.loss_scale`` counts the skipped steps).
        Overriding a given plan's precision drops its prediction (:func:`with_precision`).
    accumulate: gradient accumulation: each stage steps every ``accumulate`` minibatches of its VW (and
        after its last one) with the mean of their gradients, as a one-process loop dividing each loss
        by ``accumulate``; clipping, the loss-scale verdict and the LR scheduler act at those steps.
    loss_scale: "fp16"'s options, as ``torch.amp.GradScaler``'s: init_scale (2**16), growth_factor
        (2), backoff_factor (0.5), growth_interval (2000 steps).
    checkpoint_dir, checkpoint_every: write a checkpoint every ``checkpoint_every`` waves (default 1)
        into ``checkpoint_dir`` (seen by every rank), and on SIGTERM; asynchronous and atomic, see
        :mod:`hetpipe.checkpoint.state` and docs/design.md, "Checkpoints and restart". Default:
        ``HETPIPE_CHECKPOINT_DIR`` / ``HETPIPE_CHECKPOINT_EVERY`` (set by ``hetpipe launch``).
    resume: a checkpoint directory (its latest complete checkpoint) or one checkpoint to resume from
        (default ``HETPIPE_RESUME``, set by ``hetpipe launch --resume``). With the checkpoint's own plan
        the run goes on exactly (bitwise at D = 0); with another plan (VW count, cuts, Nm) it starts
        from the checkpoint's global weights, each stage's optimizer state taken per parameter from
        the stages of VW ``v % old VW count``, the data going on from the cut.
    checkpoint_on_sigterm: keep a host copy of this rank's state at each of the last D + 2 wave
        boundaries, so that SIGTERM writes the newest clock every rank holds (the cost: one copy of
        the optimizer state, or of a shard's weights, per wave; bench/checkpoint.py). False: copies
        only at due clocks, and SIGTERM only lets the checkpoint in flight finish.
    seed: seeds every stage's random draws (dropout): micro-batch ``mb`` of stage ``s`` of VW ``v``
        draws from its own generator state, derived from (seed, v, s, mb), in the run and the replay.
    record: path of the run's record (JSON, written by rank 0 at the end): per PS shard, the order it
        applied pushes and the global-weights version every pull got, the only things timing decides;
        ``Trainer(...).replay(record=path)`` then reproduces the run bitwise for any D (see
        :mod:`hetpipe.run.record`).
    lr_scheduler: a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``; every stage of every
        VW builds one over its optimizer and steps it once per local optimizer step (once per
        minibatch), so all stages follow the same schedule by the VW's minibatch count (the PS applies
        the deltas those steps made, under "sum" or "mean" alike). Its state is in checkpoints and
        restored on resume (README "LR schedules, clipping, non-finite values").
    clip_grad_norm: clip each minibatch's gradient to this norm, the norm taken over all the VW's
        stages (each tied parameter once), as ``torch.nn.utils.clip_grad_norm_`` does on one process;
        per VW and minibatch, on the weight versions the pipeline used for it. Every minibatch's loss
        and gradient are checked finite either way: a NaN/inf stops the run naming VW, stage,
        minibatch and wave, before it reaches the weights.
    transport: the transport backend of the stage ranks ("torch-p2p", "mpi-host"; default
        HETPIPE_TRANSPORT, set by ``hetpipe launch --transport``); None: chosen per pair of stages
        (torch-p2p between GPUs with NCCL, else mpi-host; PS shards always use mpi-host). A forced
        backend that cannot serve a stage rank fails the job naming the rank, its device and why.
        ``TrainResult.transport`` and the metrics summary report the choice.
    """

    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]], loss_fn: Callable,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], data: Iterable, *,
                 plan: Union[Plan, str, Path, None] = None, policy: str = "auto", cluster: Any = None,
                 nm: Optional[int] = None, d: Optional[int] = None, epochs: int = 1, split_startup: int = 0,
                 timeout: Optional[float] = None, emulate: Optional[bool] = None, emulation_scale: float = 1.0,
                 copy_stream: Optional[bool] = None, audit: bool = False,
                 checkpoint_dir: Union[str, Path, None] = None, checkpoint_every: Optional[int] = None,
                 resume: Union[str, Path, None] = None, checkpoint_on_sigterm: bool = True,
                 metrics: Union[str, Path, None] = None, trace: Union[str, Path, None] = None,
                 progress: bool = True, comm: Any = None, plan_callback: Optional[Callable[[Plan], None]] = None,
                 aggregate: Optional[str] = None, seed: int = 0, precision: Optional[str] = None,
                 record: Union[str, Path, None] = None, schedule: str = "hetpipe",
                 transport: Optional[str] = None, lr_scheduler: Optional[Callable] = None,
                 clip_grad_norm: Optional[float] = None, eval_data: Any = None, eval_every: Optional[int] = None,
                 eval_metric: Optional[Callable] = None, callbacks: Sequence[object] = (),
                 tensorboard: Union[str, Path, None] = None, loss_scale: Optional[Dict[str, Any]] = None,
                 accumulate: int = 1):
        self.model = model
        self.layers = as_layers(model)
        self.names = model_names(model, self.layers)
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.data = as_source(data, seed)
        self.plan_arg, self.policy, self.cluster = plan, policy, cluster
        self.nm, self.d, self.epochs = nm, d, epochs
        self.split_startup = split_startup
        self.schedule = get_schedule(schedule).name
        self.timeout = failure.timeout_s(timeout)
        self.emulate, self.emulation_scale = emulate, emulation_scale
        self.copy_stream = copy_stream
        self.audit = audit
        checkpoint_dir = checkpoint_dir or os.environ.get(ckfmt.DIR_ENV) or None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        every = checkpoint_every if checkpoint_every is not None else os.environ.get(ckfmt.EVERY_ENV)
        self.checkpoint_every = int(every) if every else 1
        if self.checkpoint_every < 1:
            raise ValueError(f"hetpipe: checkpoint_every must be >= 1 wave, got {self.checkpoint_every}")
        resume = resume or os.environ.get(ckfmt.RESUME_ENV) or None
        self.resume_from = Path(resume) if resume else None
        self.checkpoint_on_sigterm = checkpoint_on_sigterm
        self.metrics = Path(metrics) if metrics else None
        self.trace_path = Path(trace) if trace else None
        self.progress = progress
        self.comm = comm
        self.plan_callback = plan_callback
        self.aggregate, self.seed = aggregate, seed
        self.precision = check_precision(precision, "Trainer") if precision is not None else None
        self.record_path = Path(record) if record else None
        self.transport = transport or os.environ.get(transports.TRANSPORT_ENV) or None
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError(f"hetpipe: lr_scheduler must be a factory optimizer -> LR scheduler, got {lr_scheduler!r}")
        self.lr_scheduler = lr_scheduler
        if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))
                                           or not clip_grad_norm > 0 or clip_grad_norm == float("inf")):
            raise ValueError(f"hetpipe: clip_grad_norm must be a finite number > 0, got {clip_grad_norm!r}")
        self.clip_grad_norm = float(clip_grad_norm) if clip_grad_norm is not None else None
        if eval_every is not None and (isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1):
            raise ValueError(f"hetpipe: eval_every must be a whole number of waves >= 1, got {eval_every!r}")
        if eval_data is not None and eval_every is None:
            raise ValueError("hetpipe: eval_data needs eval_every (how many waves between evaluation points)")
        if eval_metric is not None and not callable(eval_metric):
            raise TypeError(f"hetpipe: eval_metric must be a function (output, labels) -> float, got {eval_metric!r}")
        self.eval_every, self.eval_metric = eval_every, eval_metric
        self.eval_data = as_source(eval_data, seed) if eval_data is not None else None
        self.callbacks = list(callbacks)
        Callbacks(self.callbacks, eval_every is not None)       # checks them now, on every rank
        self.tensorboard = Path(tensorboard) if tensorboard else None
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"hetpipe: accumulate must be a whole number of minibatches >= 1, got {accumulate!r}")
        self.accumulate = accumulate
        self.loss_scale = dict(loss_scale or {})
        LossScale(**self.loss_scale)                            # checks the options now
        self._describe = "rank ?"

    # --- planning ----------------------------------------------------------------------------
    def _make_plan(self) -> Plan:
        plan = self._plan()
        if self.aggregate is not None and self.aggregate != plan.aggregate:
            plan = dataclasses.replace(plan, aggregate=self.aggregate)
        if self.precision is not None:
            plan = with_precision(plan, self.precision)
        return plan

    def _plan(self) -> Plan:
        if os.environ.get(ckfmt.PLAN_ENV):
            # A restarting launcher replanned without a failed device: its plan replaces the script's.
            return self._check_layers(Plan.load(os.environ[ckfmt.PLAN_ENV]))
        if isinstance(self.plan_arg, Plan):
            plan = self.plan_arg
        elif self.plan_arg is not None:
            plan = Plan.load(self.plan_arg)
        else:
            from hetpipe.cluster import load_cluster
            from hetpipe.plan import make_plan
            from hetpipe.model.measure import profile_model

            cluster = self.cluster if self.cluster is not None else load_cluster("cpu-emulated")
            if isinstance(cluster, str):
                cluster = load_cluster(cluster)
            x, y = self.data.sample()
            profile = profile_model(self.model, x, cluster, loss_fn=lambda out: self.loss_fn(out, y))
            plan = make_plan(cluster, profile, policy=self.policy, nm=self.nm, d=self.d or 0,
                             minibatch_size=batch_of(x), precision=self.precision or "fp32")
            return self._check_layers(plan)
        return self._check_layers(override(plan, self.nm, self.d))

    def _check_layers(self, plan: Plan) -> Plan:
        if plan.num_layers != len(self.layers):
            raise LaunchError(f"hetpipe: the plan has {plan.num_layers} layers, the model {len(self.layers)}")
        return plan

    def spec(self, plan: Plan, resume: Optional[ckpt.Resume] = None) -> RunSpec:
        """The run's :class:`RunSpec` for ``plan`` (schedules, activation shapes) on this rank; a resumed
        run trains what is left after the checkpoint's cut."""
        num_vws = len(plan.virtual_workers)
        per_epoch = self.data.minibatches_per_epoch(num_vws)
        per_vw = per_epoch // num_vws
        if per_vw < 1:
            raise ValueError(f"hetpipe: one epoch has fewer minibatches than the {num_vws} VWs")
        total, split = per_vw * self.epochs, self.split_startup
        if resume is not None:
            total = resume.start.per_vw(per_epoch, num_vws, self.epochs)
            split = max(0, split - resume.minibatches) if resume.same_plan else 0
            if total < 1:
                raise ValueError(f"hetpipe: the checkpoint {resume.checkpoint.path} is at epoch "
                                 f"{resume.start.epoch} minibatch {resume.start.index}: nothing is left of the "
                                 f"{self.epochs} epoch(s) to train")
        x, _ = self.data.sample()
        schedules = []
        for vw in plan.virtual_workers:
            recompute = any(st.recompute for st in vw.stages)
            schedules.append(generate(self.schedule, ScheduleOptions(len(vw.stages), total, plan.nm, plan.d,
                                                                     recompute=recompute, split_startup=split)))
        return RunSpec(plan, self.layers, self.loss_fn, self.optimizer, self.data, self.epochs, schedules,
                       infer_boundaries(self.layers, x), batch_of(x), copy_stream=self.copy_stream, audit=self.audit,
                       seed=self.seed, resume=resume, lr_scheduler=self.lr_scheduler,
                       clip_grad_norm=self.clip_grad_norm, param_names=param_names(self.names),
                       eval_every=self.eval_every, eval_data=self.eval_data, eval_metric=self.eval_metric,
                       loss_scale=self.loss_scale, accumulate=self.accumulate)

    # --- checkpoints -------------------------------------------------------------------------
    def _resume(self, plan: Plan) -> Optional[ckpt.Resume]:
        """What this run resumes from (None: from the start); loads the global weights into the model."""
        if self.resume_from is None:
            return None
        found = ckpt.Checkpoint.find(self.resume_from)
        old = Plan.from_dict(found.manifest["plan"])
        if old.num_layers != plan.num_layers:
            raise LaunchError(f"hetpipe: the checkpoint {found.path} is of a model of {old.num_layers} layers, "
                              f"this run's has {plan.num_layers}")
        weights, buffers = found.global_weights()
        lay = ModelLayout(self.layers)
        for l, w in weights.items():
            if w.size != lay.numel(l):
                raise LaunchError(f"hetpipe: the checkpoint {found.path} holds {w.size} weights of layer {l}, "
                                  f"the model's layer {l} has {lay.numel(l)}")
        load_layer_weights(self.layers, weights, buffers)
        data = found.manifest["data"]
        q = int(data["minibatches_per_vw"])
        same = same_layout(old, plan)
        split = int(found.manifest.get("split_startup", 0))
        return ckpt.Resume(found, same, ckfmt.DataPosition(**data["position"]), q + min(split, q) if same else 0,
                           q if same else 0)

    def _manifest(self, plan: Plan, spec: RunSpec, clock: int) -> Dict[str, Any]:
        """The manifest of the checkpoint at ``clock`` (identical on every rank)."""
        resume = spec.resume
        clock0 = resume.checkpoint.clock if resume is not None else 0
        start = resume.start if resume is not None else ckfmt.DataPosition()
        total = spec.schedules[0].num_minibatches
        k = min(total, (clock - clock0) * plan.nm)
        per_epoch = self.data.minibatches_per_epoch(len(plan.virtual_workers))
        pos = start.advance(k, per_epoch, len(plan.virtual_workers))
        return {"format": ckfmt.FORMAT, "clock": clock, "plan": plan.to_dict(),
                "parts": [ckfmt.part_name(r) for r in range(plan.num_ranks)],
                "data": {"position": {"epoch": pos.epoch, "index": pos.index},
                         "minibatches_per_vw": (resume.minibatches if resume is not None else 0) + k,
                         "minibatches_per_epoch": per_epoch, "epochs": self.epochs},
                "rng": {"seed": self.seed, "rule": "micro-batch j of stage s of VW v draws from a generator "
                                                  "seeded by (seed, v, s, j); no other random state"},
                "split_startup": self.split_startup, "checkpoint_every": self.checkpoint_every,
                "names": self.names,
                "resumed_from": {"path": str(resume.checkpoint.path), "clock": clock0} if resume else None}

    def _checkpointer(self, plan: Plan, spec: RunSpec, role: Role, part) -> Optional[ckpt.Checkpointer]:
        """This rank's checkpointer, hooked to its part's wave boundaries (None: no checkpoints)."""
        if self.checkpoint_dir is None:
            return None
        run_dir = os.environ.get(RUN_DIR_ENV)
        progress = Path(run_dir, f"clock-of-rank-{role.rank}") if run_dir else None
        writer = ckpt.Checkpointer(self.checkpoint_dir, self.checkpoint_every, role.rank,
                                   lambda clock: self._manifest(plan, spec, clock),
                                   keep=plan.d + 2 if self.checkpoint_on_sigterm else 0,
                                   progress=progress)
        clock0 = spec.resume.checkpoint.clock if spec.resume is not None else 0
        if role.kind == "stage":
            part.model.on_pushed = lambda wave: writer.boundary(clock0 + wave,
                                                                lambda: self._stage_snapshot(plan, spec, part, role))
        else:
            state = part.state
            state.on_applied = lambda applied: writer.boundary(clock0 + applied,
                                                               lambda: self._shard_snapshot(state, role, clock0))
        return writer

    def _stage_snapshot(self, plan: Plan, spec: RunSpec, ex: StageExecutor, role: Role) -> ckpt.Snapshot:
        model = ex.model
        tensors, opt = ckpt.optimizer_snapshot(model.optimizer, ckpt.param_keys(model, spec.layout))
        for name, b in local_buffers(model, spec.layout).items():
            tensors[f"buf/{name}"] = b.detach().to("cpu", copy=True)
        if not plan.ps_shards and role.vw == 0:
            for l, (w, b) in model.layer_weights(spec.layout).items():
                tensors.update({f"w/{l}": torch.from_numpy(w), f"b/{l}": torch.from_numpy(b)})
        part: Dict[str, Any] = {"role": "stage", "vw": role.vw, "stage": role.stage, "optimizer": opt}
        if model.scheduler is not None:
            part["lr_scheduler"] = ckpt.scheduler_snapshot(model.scheduler)
        if ex.scaler is not None:
            part["loss_scale"] = ex.scaler.state()
        if ex.is_last:
            resume = spec.resume
            q0 = resume.minibatches if resume is not None else 0
            before = resume.checkpoint.losses().get(role.vw, {}) if resume is not None and resume.same_plan else {}
            part["losses"] = {**{str(p): v for p, v in before.items()},
                              **{str(q0 + p): v for p, v in ex.losses.items()}}
        return tensors, part

    @staticmethod
    def _shard_snapshot(state, role: Role, clock0: int) -> ckpt.Snapshot:
        tensors = {}
        for l in state.layers:
            for kind, values in (("w", state.W), ("b", state.B)):
                if values[l].size:
                    tensors[f"{kind}/{l}"] = torch.from_numpy(values[l].copy())
        clocks = [clock0 + int(state.clock.clock(v)) for v in range(state.num_vws)]
        return tensors, {"role": "ps", "shard": role.shard, "clocks": clocks, "applied": clock0 + state.applied}

    # --- single process ----------------------------------------------------------------------
    def replay(self, record: Union[str, Path, RunRecord, None] = None) -> ReplayResult:
        """Run the whole plan in this process over a loopback transport (the reference; no padding).

        Equal to a run bitwise at D = 0; at D >= 1 only given that run's ``record`` (a
        :class:`RunRecord` or its file), whose versions and apply order the PS shards then follow
        (``ReplayResult.reproduced`` says whether the outcome is bitwise the recorded one)."""
        torch.set_num_threads(1)
        if record is not None and not isinstance(record, RunRecord):
            record = RunRecord.load(record)
        plan = self._make_plan()
        spec = self.spec(plan, self._resume(plan))
        reporter = None
        if self.eval_every is not None or self.callbacks or self.metrics is not None or self.tensorboard is not None:
            reporter = self._reporter(plan, spec)
        result = replay_run(spec, record, reporter)
        if reporter is not None:
            reporter.finish(result, None, "")
        if spec.resume is not None:
            result.losses = resumed_losses(result.losses, spec.resume)
        load_layer_weights(self.layers, result.weights, result.buffers, result.local_buffers)
        return result

    # --- multi-process -----------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Train under MPI (every rank calls this); returns the run's result on every rank."""
        torch.set_num_threads(1)
        comm = self.comm if self.comm is not None else world()
        rank, size = comm.Get_rank(), comm.Get_size()
        self._describe = f"rank {rank}"
        failure.install_excepthook(comm, lambda: self._describe)
        try:
            return self._fit(comm, rank, size)
        except LaunchError as e:
            # Every rank reaches the same verdict: rank 0 says it once (no traceback), the job ends.
            failure.verdict(comm, "job" if rank == 0 else self._describe, e)
        except BaseException as e:  # noqa: BLE001 - any failure must bring the job down, naming this rank
            failure.report(self._describe, e)
            failure.abort(comm)
        raise AssertionError("unreachable")

    def _fit(self, comm, rank: int, size: int) -> TrainResult:
        hosts = gather_hosts(comm)
        plan_text, error = None, None
        if rank == 0:
            try:
                if self.record_path is not None:
                    self.record_path.parent.mkdir(parents=True, exist_ok=True)
                    check_file("record", self.record_path)
                plan_text = self._make_plan().to_json()
            except Exception as e:  # noqa: BLE001 - relayed to every rank below
                error = f"planning on rank 0 failed: {type(e).__name__}: {e}"
        plan_text, error = comm.bcast((plan_text, error), root=0)
        if error:
            raise LaunchError(f"hetpipe: {error}")
        plan = Plan.from_json(plan_text)
        if self.plan_callback is not None and rank == 0:
            self.plan_callback(plan)
        if rank == 0 and os.environ.get(RUN_DIR_ENV):
            # For a restarting launcher: which device each rank ran, and where the checkpoints are.
            plan.save(Path(os.environ[RUN_DIR_ENV], "plan.json"))
            if self.checkpoint_dir is not None:
                Path(os.environ[RUN_DIR_ENV], "checkpoints.txt").write_text(f"{self.checkpoint_dir.resolve()}\n")
        check_world(plan, size)
        role = role_of(plan, rank)
        self._describe = role.describe()
        register_rank(rank, self._describe)
        spec, problem = None, None
        try:
            spec = self.spec(plan, self._resume(plan))
            if role.kind == "stage":
                st = plan.virtual_workers[role.vw].stages[role.stage]
                dev, emulated = resolve_device(st, emulate=self.emulate, cuda_count=hosts[rank]["cuda_count"])
                spec.devices[rank], spec.emulated[rank] = dev, emulated
                spec.emulation_scale = self.emulation_scale
        except (LaunchError, ValueError, TypeError, ckfmt.CheckpointError) as e:
            problem = f"{role.describe()}: {e}"
        problems = [p for p in comm.allgather(problem) if p]
        if problems:
            raise LaunchError("; ".join(problems))
        emulated_any = any(comm.allgather(spec.emulated.get(rank, False)))
        return self._run_role(comm, plan, spec, role, emulated_any)

    def _run_role(self, comm, plan: Plan, spec: RunSpec, role: Role, emulated: bool) -> TrainResult:
        trace: Optional[List[TraceEvent]] = [] if self.trace_path else None
        if role.kind == "stage":
            device = spec.devices[role.rank]
            if device.type == "cuda":
                torch.cuda.set_device(device)    # before this rank's first CUDA call: nothing lands on GPU 0
            pool = stage_pool(spec, role.vw, role.stage)
            plane, plane_reason = "", ""
        else:
            plane, plane_reason = choose_plane(comm)
            pool = shard_pool(spec, role.shard, plane)
        try:
            opened = transports.open_rank(comm, pool, device if role.kind == "stage" else None, stage_pairs(spec),
                                          forced=self.transport, timeout_s=self.timeout, who=role.describe())
        except transports.TransportChoiceError as e:
            raise LaunchError(str(e)) from None
        transport, reason = opened.transport, opened.reason
        comm.Barrier()
        t0 = time.perf_counter()
        reporter = None
        if role.kind == "stage":
            if role.vw == 0 and role.stage == len(plan.virtual_workers[0].stages) - 1:
                reporter = self._reporter(plan, spec)
            part = build_stage(spec, role.vw, role.stage, transport, pool, trace=trace, t0=t0,
                               decide=reporter.evaluated if reporter is not None else None)
            if reporter is not None:
                reporter.attach(part, t0)
        else:
            part = build_shard(spec, role.shard, transport, pool, trace=trace, t0=t0,
                               comm=comm if plane == "core" else None)
        self._check_data(comm, spec, part, role)
        writer = self._checkpointer(plan, spec, role, part)
        previous = self._on_sigterm(writer)
        # A shard idles legitimately while stages compute; it waits twice as long, so that a stuck
        # peer is reported by the stage that waits on it directly.
        limit = self.timeout if role.kind == "stage" else 2 * self.timeout
        try:
            drive(part, limit, f"hetpipe: {role.describe()}", reporter.update if reporter else None)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if writer is not None:
            writer.close()
        elapsed = time.perf_counter() - t0
        transport.close()
        mine = {**part_outcome(part, plan, spec.layout), "elapsed": elapsed, "trace": trace or [],
                "transport": opened.name, "ps_plane": (plane, plane_reason)}
        everyone = comm.allgather(mine)
        if self.record_path is not None and role.rank == 0:
            RunRecord.of_run(spec, merge_outcomes(everyone)).save(self.record_path)
        outcome = merge_outcomes(everyone)
        losses, resumed = outcome.losses, {}
        if spec.resume is not None:
            losses = resumed_losses(outcome.losses, spec.resume)
            resumed = {"path": str(spec.resume.checkpoint.path), "clock": spec.resume.checkpoint.clock,
                       "same_plan": spec.resume.same_plan, "losses": spec.resume.checkpoint.losses()}
        result = TrainResult(plan, role.rank, role.describe(), losses, outcome.weights, outcome.shard_logs,
                             max(m["elapsed"] for m in everyone), outcome.samples,
                             [e for m in everyone for e in m["trace"]], emulated, outcome.buffers, resumed,
                             "+".join(sorted({m["transport"] for m in everyone})), outcome.local_buffers,
                             "+".join(sorted({m["ps_plane"][0] for m in everyone} - {""})),
                             "; ".join(sorted({m["ps_plane"][1] for m in everyone} - {""})),
                             outcome.evals, stopped_of(outcome, comm.allgather(
                                 reporter.callbacks.stop_asked if reporter is not None else None)),
                             outcome.loss_scale)
        load_layer_weights(self.layers, result.weights, result.buffers, result.local_buffers)
        if reporter is not None:
            reporter.finish(result, self.trace_path, reason)
        return result


    @staticmethod
    def _check_data(comm, spec: RunSpec, part, role: Role) -> None:
        """Every rank reads the same data (hetpipe.loader.check); a mismatch is one verdict on every rank."""
        mine, problem = None, None
        try:
            mine = data_reading(spec, part, role.describe())
        except Exception as e:  # noqa: BLE001 - relayed to every rank below
            problem = f"{role.describe()}: reading the first minibatches failed: {type(e).__name__}: {e}"
        everyone = comm.allgather((mine, problem))
        problems = [p for _, p in everyone if p]
        if problems:
            raise LaunchError("hetpipe: " + "; ".join(problems))
        try:
            compare([r for r, _ in everyone])
        except DataMismatch as e:
            raise LaunchError(str(e)) from None

    def _reporter(self, plan: Plan, spec: RunSpec) -> Reporter:
        return Reporter(plan, self.metrics, self.tensorboard, self.progress, spec.schedules[0].num_minibatches,
                        self.epochs, self.callbacks, self.eval_every is not None)

    def _on_sigterm(self, writer: Optional[ckpt.Checkpointer]):
        """On SIGTERM, write the kept wave-boundary snapshots not yet on disk, wait until a clock this
        rank holds is complete (every rank's part; at most ``HETPIPE_TERM_GRACE``), then exit 128 + 15;
        returns the previous handler (None: nothing installed)."""
        if writer is None or threading.current_thread() is not threading.main_thread():
            return None

        def handler(sig, _frame) -> None:
            writer.on_signal(failure.signal_grace_s())
            sys.stderr.write(f"hetpipe: {self._describe}: SIGTERM; checkpoint(s) at clock(s) {writer.written} in "
                             f"{self.checkpoint_dir}\n")
            sys.stderr.flush()
            os._exit(128 + sig)

        return signal.signal(signal.SIGTERM, handler)


def stopped_of(outcome, asked: Sequence[Optional[str]]) -> Dict[str, Any]:
    """``TrainResult.stopped`` from the run's outcome and who asked for the stop (one rank knows)."""
    if outcome.stopped_after is None:
        return {}
    return {"after_wave": outcome.stopped_after, "asked_by": next((a for a in asked if a), "")}


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same VWs, stages, Nm, D and shards (devices and predictions aside)."""
    def shape(p: Plan):
        return (p.nm, p.d, p.aggregate, tuple(tuple((s.start, s.stop, tuple(s.recompute)) for s in vw.stages)
                                              for vw in p.virtual_workers),
                tuple(tuple(sh.layers) for sh in p.ps_shards))
    return shape(a) == shape(b)


def resumed_losses(losses: Dict[int, Dict[int, float]], resume: ckpt.Resume) -> Dict[int, Dict[int, float]]:
    """A resumed run's losses by minibatch of the whole run: with the same plan, the checkpoint's
    losses before the cut, then this run's, shifted by the minibatches before it."""
    if not resume.same_plan:
        return losses
    before = resume.checkpoint.losses()
    return {vw: {**before.get(vw, {}), **{resume.minibatches + p: v for p, v in per.items()}}
            for vw, per in losses.items()}
