"""The user-facing Trainer: what to train and how, planning, and the two ways to run it.

Every rank of ``mpiexec -n N python train.py`` builds the same Trainer (same model seed, same data)
and calls :meth:`Trainer.fit`: rank 0 plans (or the given plan is used) and broadcasts the plan, each
rank runs its role (:mod:`hetpipe.run.rank`: a pipeline stage of a virtual worker or a PS shard), and
at the end every rank receives the final global weights, loaded into its copy of the model.
:meth:`Trainer.replay` runs the same spec in one process (the reference). Checkpoints:
:mod:`hetpipe.run.checkpoints`; what a run returns: :mod:`hetpipe.run.result`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.job import failure
from hetpipe.job.roles import LaunchError
from hetpipe.job.world import world
from hetpipe.loader import as_source
from hetpipe.model.contract import as_layers, infer_boundaries
from hetpipe.model.names import model_names, param_names
from hetpipe.model.tree import batch_of
from hetpipe.model.weights import load_layer_weights
from hetpipe.plan.types import Plan
from hetpipe.util.numbers import seconds, whole
from hetpipe.plan.outer import OUTER_DEFAULTS, check_outer
from hetpipe.plan.precision import check_precision
from hetpipe.run.callbacks import Callbacks
from hetpipe.run.checkpoints import RunCheckpoints
from hetpipe.run.plan_cache import PLAN_CACHE_ENV, PlanCache, model_key, sample_key
from hetpipe.run.rank import RankRun
from hetpipe.run.record import RunRecord
from hetpipe.run.report import Reporter
from hetpipe.run.replay import ReplayResult, replay_run
from hetpipe.run.result import TrainResult, resumed_losses
from hetpipe.run.spec import RunSpec
from hetpipe.run.world_plan import CLUSTER_ENV, on_world
from hetpipe.schedule.registry import ScheduleOptions, generate, get_schedule
from hetpipe.stage.loss_scale import LossScale
from hetpipe.transport import registry as transports


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
    cluster: a preset, cluster JSON path, dict or ClusterSpec; ``"auto"`` discovers the world's devices
        (every rank's host, GPU or ``HETPIPE_EMULATE`` type; :mod:`hetpipe.job.discovery`). Under
        ``"auto"`` or a cluster of real devices (not emulated), each device type is profiled on a rank
        that holds it, ranks without a device serve the PS shards, and each rank runs the part of
        the plan on the device it holds (:mod:`hetpipe.run.world_plan`); the cluster is printed and
        written as ``cluster.json`` to the run directory and the plan cache. Default:
        ``HETPIPE_CLUSTER`` (``hetpipe launch --cluster``), else the ``cpu-emulated`` preset.
    plan_cache: a directory where that plan, its profile and cluster are kept and reused by the next run
        of the same model (structure), sample shapes, cluster, precision, policy, Nm and D, so that
        identical launches train identical cuts; rank 0 says whether it reuses or re-plans, and why
        (:mod:`hetpipe.run.plan_cache`; default ``HETPIPE_PLAN_CACHE``, set by ``hetpipe launch
        --plan-cache``).
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
    outer, outer_lr, outer_momentum, outer_staleness: the PS's outer optimizer (:mod:`hetpipe.plan.outer`;
        docs/design.md, "Outer optimizer"); each None: the plan's (by default "sgd", 1.0, 0.9, "none",
        the plain rule). ``outer="nesterov"`` treats each wave's aggregated delta as a pseudo-gradient
        and takes a Nesterov momentum step with ``outer_lr`` and ``outer_momentum`` (DiLoCo's outer
        step; the momentum buffer is in checkpoints); ``outer="sgd"`` with ``outer_lr`` scales the
        aggregated delta. ``outer_staleness="inverse"`` divides a push computed on weights ``s`` waves
        old by ``1 + s`` (nothing changes at D = 0). They are plan fields, so a run's record and its
        checkpoints carry them.
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
    checkpoint_keep: how many complete checkpoints of the run stay on disk (default 1; 2 or more lets
        ``resume_fallback`` go back one). A checkpoint directory holding another run's checkpoints is
        refused at start-up (a resumed run continues its checkpoint's run); every part records digests
        of its tensors and of the manifest, and resuming verifies them, naming the file that differs.
    resume_fallback: when the latest checkpoint fails verification, resume from the previous
        complete one (said on stderr) instead of stopping.
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
                 aggregate: Optional[str] = None, outer: Optional[str] = None, outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None, outer_staleness: Optional[str] = None,
                 seed: int = 0, precision: Optional[str] = None,
                 record: Union[str, Path, None] = None, schedule: str = "hetpipe",
                 transport: Optional[str] = None, lr_scheduler: Optional[Callable] = None,
                 clip_grad_norm: Optional[float] = None, eval_data: Any = None, eval_every: Optional[int] = None,
                 eval_metric: Optional[Callable] = None, callbacks: Sequence[object] = (),
                 tensorboard: Union[str, Path, None] = None, loss_scale: Optional[Dict[str, Any]] = None,
                 accumulate: int = 1, checkpoint_keep: int = 1, resume_fallback: bool = False,
                 plan_cache: Union[str, Path, None] = None):
        self.model = model
        self.layers = as_layers(model)
        self.names = model_names(model, self.layers)
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.data = as_source(data, seed)
        self.plan_arg, self.policy = plan, policy
        self.cluster = cluster if cluster is not None else (os.environ.get(CLUSTER_ENV) or None)
        self.planning: Optional[Dict[str, Any]] = None      # the inputs of the plan made here, if one was
        plan_cache = plan_cache or os.environ.get(PLAN_CACHE_ENV) or None
        self.plan_cache = Path(plan_cache) if plan_cache else None
        self.nm = whole("nm", nm) if nm is not None else None
        self.d = whole("d", d, 0) if d is not None else None
        self.epochs = whole("epochs", epochs)
        self.split_startup = whole("split_startup", split_startup, 0)
        whole("seed", seed, 0)
        emulation_scale = seconds("emulation_scale", emulation_scale)
        self.schedule = get_schedule(schedule).name
        self.timeout = failure.timeout_s(timeout)
        self.emulate, self.emulation_scale = emulate, emulation_scale
        self.copy_stream = copy_stream
        self.audit = audit
        checkpoint_dir = checkpoint_dir or os.environ.get(ckfmt.DIR_ENV) or None
        every = checkpoint_every if checkpoint_every is not None else os.environ.get(ckfmt.EVERY_ENV)
        every = int(every) if every else 1
        if every < 1:
            raise ValueError(f"hetpipe: checkpoint_every must be >= 1 wave, got {every}")
        resume = resume or os.environ.get(ckfmt.RESUME_ENV) or None
        self.checkpoints = RunCheckpoints(self.layers, self.data, epochs, seed, split_startup, self.names,
                                          Path(checkpoint_dir) if checkpoint_dir else None, every,
                                          Path(resume) if resume else None, checkpoint_on_sigterm,
                                          whole("checkpoint_keep", checkpoint_keep), bool(resume_fallback))
        self.metrics = Path(metrics) if metrics else None
        self.trace_path = Path(trace) if trace else None
        self.progress = progress
        self.comm = comm
        self.plan_callback = plan_callback
        self.aggregate, self.seed = aggregate, seed
        given = {"outer": outer, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
                 "outer_staleness": outer_staleness}
        self.outer = {k: v for k, v in given.items() if v is not None}        # overrides of the plan's
        check_outer("Trainer", **{**OUTER_DEFAULTS, **self.outer})
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
        if eval_every is not None:
            whole("eval_every (waves)", eval_every)
        if eval_data is not None and eval_every is None:
            raise ValueError("hetpipe: eval_data needs eval_every (how many waves between evaluation points)")
        if eval_metric is not None and not callable(eval_metric):
            raise TypeError(f"hetpipe: eval_metric must be a function (output, labels) -> float, got {eval_metric!r}")
        self.eval_every, self.eval_metric = eval_every, eval_metric
        self.eval_data = as_source(eval_data, seed) if eval_data is not None else None
        self.callbacks = list(callbacks)
        Callbacks(self.callbacks, eval_every is not None)       # checks them now, on every rank
        self.tensorboard = Path(tensorboard) if tensorboard else None
        self.accumulate = whole("accumulate (minibatches)", accumulate)
        self.loss_scale = dict(loss_scale or {})
        LossScale(**self.loss_scale)                            # checks the options now

    # --- planning ----------------------------------------------------------------------------
    def resolve_plan(self) -> Plan:
        """The plan this Trainer runs: the restarting launcher's, the given one, or one made now from a
        profile of the model (what rank 0 broadcasts), with the Trainer's aggregate, outer optimizer and
        precision."""
        plan = self._plan()
        if self.aggregate is not None and self.aggregate != plan.aggregate:
            plan = dataclasses.replace(plan, aggregate=self.aggregate)
        if any(plan.outer_options[k] != v for k, v in self.outer.items()):
            plan = dataclasses.replace(plan, **self.outer)
        if self.precision is not None:
            plan = with_precision(plan, self.precision)
        return plan

    def given_plan(self) -> Optional[Plan]:
        """The plan this Trainer was given (or a restarting launcher's), None when it makes one."""
        if os.environ.get(ckfmt.PLAN_ENV):
            # A restarting launcher replanned without a failed device: its plan replaces the script's.
            return self._check_layers(Plan.load(os.environ[ckfmt.PLAN_ENV]))
        if self.plan_arg is None:
            return None
        plan = self.plan_arg if isinstance(self.plan_arg, Plan) else Plan.load(self.plan_arg)
        return self._check_layers(override(plan, self.nm, self.d))

    def _plan(self) -> Plan:
        given = self.given_plan()
        if given is not None:
            return given
        if on_world(self.cluster):
            raise LaunchError(f"hetpipe: cluster={self.cluster!r} is planned on the devices of an MPI world "
                              f"(Trainer.fit under mpiexec); give an emulated cluster or a plan to replay")
        else:
            from hetpipe.plan.cluster import load_cluster
            from hetpipe.plan import make_plan
            from hetpipe.model.measure import profile_model

            cluster = self.cluster if self.cluster is not None else load_cluster("cpu-emulated")
            if isinstance(cluster, str):
                cluster = load_cluster(cluster)
            x, y = self.data.sample()
            cache, key, plan = None, None, None
            if self.plan_cache is not None:
                cache = PlanCache(self.plan_cache)
                key = {"model": model_key(self.layers), "sample": sample_key((x, y)), "cluster": cluster.to_dict(),
                       "precision": self.precision or "fp32", "policy": self.policy, "nm": self.nm, "d": self.d or 0}
                plan, why = cache.lookup(key)
                sys.stderr.write(f"hetpipe: plan cache: {why}\n")
            if plan is not None:
                profile_data = cache.profile()
            else:
                profile = profile_model(self.model, x, cluster, loss_fn=lambda out: self.loss_fn(out, y))
                plan = make_plan(cluster, profile, policy=self.policy, nm=self.nm, d=self.d or 0,
                                 minibatch_size=batch_of(x), precision=self.precision or "fp32")
                if cache is not None:
                    cache.store(key, plan, profile, cluster)
                profile_data = profile.to_dict()
            # What a restarting launcher re-plans the surviving devices with (run/rank.py saves it).
            self.planning = {"cluster": cluster.to_dict(), "profile": profile_data, "policy": self.policy,
                             "nm": self.nm, "d": self.d or 0, "minibatch_size": batch_of(x),
                             "precision": self.precision or "fp32"}
            return self._check_layers(plan)

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

    # --- single process ----------------------------------------------------------------------
    def replay(self, record: Union[str, Path, RunRecord, None] = None) -> ReplayResult:
        """Run the whole plan in this process over a loopback transport (the reference; no padding).

        Equal to a run bitwise at D = 0; at D >= 1 only given that run's ``record`` (a
        :class:`RunRecord` or its file), whose versions and apply order the PS shards then follow
        (``ReplayResult.reproduced`` says whether the outcome is bitwise the recorded one)."""
        torch.set_num_threads(1)
        if record is not None and not isinstance(record, RunRecord):
            record = RunRecord.load(record)
        plan = self.resolve_plan()
        spec = self.spec(plan, self.checkpoints.resume(plan))
        reporter = None
        if self.eval_every is not None or self.callbacks or self.metrics is not None or self.tensorboard is not None:
            reporter = self.reporter(plan, spec)
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
        run = RankRun(self, rank)
        failure.install_excepthook(comm, lambda: run.describe)
        try:
            return run.run(comm, rank, size)
        except LaunchError as e:
            # Every rank reaches the same verdict: rank 0 says it once (no traceback), the job ends.
            failure.verdict(comm, "job" if rank == 0 else run.describe, e)
        except BaseException as e:  # noqa: BLE001 - any failure must bring the job down, naming this rank
            failure.report(run.describe, e)
            failure.abort(comm)
        raise AssertionError("unreachable")

    def reporter(self, plan: Plan, spec: RunSpec) -> Reporter:
        """The reporter of the last stage of VW 0 (progress bar, metrics, TensorBoard, callbacks)."""
        return Reporter(plan, self.metrics, self.tensorboard, self.progress, spec.schedules[0].num_minibatches,
                        self.epochs, self.callbacks, self.eval_every is not None)

