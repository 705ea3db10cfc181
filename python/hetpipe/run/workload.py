"""What a run trains (:class:`Workload`) and the plan and spec it trains it with.

A :class:`Workload` is built the same on every rank from the Trainer's four essentials. The functions
below turn it and a resolved :class:`~hetpipe.run.config.RunConfig` into the plan every rank runs
(given, the launcher's, or made here from a profile of the model) and into the run's
:class:`~hetpipe.run.spec.RunSpec`. Rank 0 makes the plan; :mod:`hetpipe.run.world_plan` makes it on the
world's own devices instead.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from hetpipe.checkpoint import state as ckpt
from hetpipe.job.roles import LaunchError
from hetpipe.loader import as_source
from hetpipe.loader.source import too_few
from hetpipe.model.contract import as_layers, infer_boundaries
from hetpipe.model.layout import ModelLayout
from hetpipe.model.names import model_names, param_names
from hetpipe.model.tree import batch_of
from hetpipe.plan.types import Plan
from hetpipe.plan.waves import deal_for
from hetpipe.plan.precision import check_precision, speed_precision
from hetpipe.run.build import vw_schedule
from hetpipe.run.callbacks import run_steps
from hetpipe.run.config import MAX_MINIBATCH_STAGES, Reporting, RunConfig, as_path
from hetpipe.run.optimizer import as_factory
from hetpipe.run.plan_cache import PlanCache, plan_key, planning_inputs
from hetpipe.run.report import Reporter
from hetpipe.run.shape import RunShape, sized
from hetpipe.run.spec import RunSpec
from hetpipe.run.world_plan import on_world, tf32_matmuls
from hetpipe.util.errors import ArgumentError


@dataclass
class Workload:
    """The model (as the plan's layers, and their names), the loss, the optimizer factory and the data.

    Built identically on every rank (same seed): the start-up checks compare the layers' digests and the
    first minibatches across ranks."""

    model: Any
    layers: List[nn.Module]
    sequence: Any                   # what the profiler measures: the model, or its adapter's named layer list
    names: Dict[str, Any]
    loss_fn: Callable
    optimizer: Callable
    data: Any
    eval_data: Any

    @classmethod
    def of(cls, model: Any, loss_fn: Optional[Callable], optimizer: Any, data: Any, config: RunConfig) -> "Workload":
        sequence, loss_fn = _layers_and_loss(model, loss_fn)
        layers = as_layers(sequence)
        names = model_names(model, layers)
        seed = config.numerics.seed
        eval_data = config.reporting.eval_data
        return cls(model, layers, sequence, names, loss_fn, as_factory(optimizer, layers, names), as_source(data, seed),
                   as_source(eval_data, seed) if eval_data is not None else None)

    def check_layers(self, plan: Plan) -> Plan:
        if plan.num_layers != len(self.layers):
            raise LaunchError(f"hetpipe: the plan has {plan.num_layers} layers, the model {len(self.layers)}")
        return plan


def _layers_and_loss(model: Any, loss_fn: Optional[Callable]) -> Tuple[Any, Callable]:
    """The layer sequence the plan partitions and the loss: a sequence as given, or a model of a family
    :func:`hetpipe.adapters.adapt` knows (a Hugging Face causal LM, a ResNet, a VGG) cut by its adapter,
    whose loss (the model's own) is used when ``loss_fn`` is None."""
    sequence = model
    if isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        from hetpipe.adapters import AdapterError, adapt

        try:
            adapted = adapt(model)
        except AdapterError as e:
            raise TypeError(f"hetpipe: the model must be an nn.Sequential, a list of modules or a model of a family "
                            f"hetpipe.adapters.adapt knows; {e}") from None
        loss_fn = loss_fn if loss_fn is not None else adapted.loss_fn
        sequence = adapted.layers
    if loss_fn is None:
        raise TypeError(f"hetpipe: loss_fn is None, and the model ({type(model).__name__}) has no loss of its own "
                        "that hetpipe knows: give loss_fn(output, labels)")
    if not callable(loss_fn):
        raise TypeError(f"hetpipe: loss_fn must be a function (output, labels) -> scalar tensor, got {loss_fn!r}")
    return sequence, loss_fn


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


def given_plan(work: Workload, config: RunConfig) -> Optional[Plan]:
    """The plan the config names (the script's, or the launcher's), None when one is to be made."""
    if config.plan is None:
        return None
    plan = config.plan if isinstance(config.plan, Plan) else Plan.load(config.plan)
    if config.plan_source == "script":
        plan = override(plan, config.planning.nm, config.planning.d)
    return work.check_layers(plan)


def with_rule(plan: Plan, config: RunConfig) -> Plan:
    """``plan`` with the config's PS rule (aggregate, outer optimizer) and precision where they are set."""
    ps = config.ps
    if ps.aggregate is not None and ps.aggregate != plan.aggregate:
        plan = dataclasses.replace(plan, aggregate=ps.aggregate)
    outer = ps.outer_overrides
    if any(plan.outer_options[k] != v for k, v in outer.items()):
        plan = dataclasses.replace(plan, **outer)
    if config.numerics.precision is not None:
        plan = with_precision(plan, config.numerics.precision)
    return plan


def resolve_plan(work: Workload, config: RunConfig) -> Tuple[Plan, Optional[Dict[str, Any]]]:
    """The plan this run trains (what rank 0 broadcasts), and the planning inputs of one made here (None
    for a given plan): what a restarting launcher re-plans the surviving devices with."""
    given = given_plan(work, config)
    if given is not None:
        return with_rule(given, config), None
    cluster = config.planning.cluster
    if on_world(cluster):
        raise LaunchError(f"hetpipe: cluster={cluster!r} is planned on the devices of an MPI world "
                          f"(Trainer.fit under mpiexec); give an emulated cluster or a plan to replay")
    plan, planning = _plan_here(work, config)
    return with_rule(plan, config), planning


def _plan_here(work: Workload, config: RunConfig) -> Tuple[Plan, Dict[str, Any]]:
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.model.measure import profile_model
    from hetpipe.plan import make_plan
    from hetpipe.run.pilot import planning_arguments

    p = config.planning
    precision = config.numerics.precision or "fp32"
    cluster = load_cluster(p.cluster if p.cluster is not None else "cpu-emulated")
    x, y = work.data.sample()
    cache, key, plan = None, None, None
    tf32 = tf32_matmuls()
    if config.plan_cache is not None:
        cache = PlanCache(config.plan_cache)
        key = plan_key(work.layers, (x, y), cluster, speed_precision(precision, tf32), p)
        plan, why = cache.lookup(key)
        sys.stderr.write(f"hetpipe: plan cache: {why}\n")
    if plan is not None:
        profile_data = cache.profile()
    else:
        profile = profile_model(work.sequence, x, cluster, loss_fn=lambda out: work.loss_fn(out, y))
        plan = make_plan(cluster, profile, policy=p.policy, nm=p.nm, d=p.d or 0, minibatch_size=batch_of(x),
                         precision=precision, tf32=tf32, **planning_arguments(work, p))
        if cache is not None:
            cache.store(key, plan, profile, cluster)
        profile_data = profile.to_dict()
    return work.check_layers(plan), planning_inputs(cluster, profile_data, p, batch_of(x), precision,
                                                    tf32=tf32)


def run_spec(work: Workload, config: RunConfig, plan: Plan, resume: Optional[ckpt.Resume] = None) -> RunSpec:
    """The run's :class:`RunSpec` for ``plan`` (schedules, activation shapes) on this rank; a resumed
    run trains what is left after the checkpoint's cut."""
    num_vws = len(plan.virtual_workers)
    deal = deal_for(plan.wave_minibatches)          # equal waves: one slot per VW, the round-robin deal
    if not deal.equal:
        unequal_waves_supported(config)
    per_epoch = work.data.minibatches_per_epoch(deal.num_slots)
    per_slot = per_epoch // deal.num_slots
    if per_slot < 1:
        raise ValueError(too_few(per_epoch, deal.num_slots, plan.nm))
    epochs, num = config.epochs, config.numerics
    totals = [per_slot * q * epochs for q in deal.shares]         # each VW's minibatches: its slots' share
    splits = [config.planning.split_startup] * num_vws
    if resume is not None:
        left = resume.start.per_vw(per_epoch, deal.num_slots, epochs)     # per slot, from the cut
        totals = [left * q for q in deal.shares]
        splits = [max(0, split - resume.minibatches_of(v)) if resume.same_plan else 0
                  for v, split in enumerate(splits)]
        if left < 1:
            raise ValueError(f"hetpipe: the checkpoint {resume.checkpoint.path} is at epoch "
                             f"{resume.start.epoch} minibatch {resume.start.index}: nothing is left of the "
                             f"{epochs} epoch(s) to train")
    held = max(totals) * plan.num_stage_ranks
    if held > MAX_MINIBATCH_STAGES:
        per_vw = per_slot * max(deal.shares)
        raise ValueError(f"hetpipe: epochs={epochs} gives a VW {max(totals)} minibatches ({per_vw} per epoch), so "
                         f"the schedules of the plan's {plan.num_stage_ranks} stage(s) hold {held} minibatch-stages, "
                         f"more than the {MAX_MINIBATCH_STAGES} a run builds up front; train at most "
                         f"{max(1, MAX_MINIBATCH_STAGES // (per_vw * plan.num_stage_ranks))} epoch(s) per run and "
                         "resume the next run from its checkpoint")
    x, _ = work.data.sample()
    rep = config.reporting
    clip = float(num.clip_grad_norm) if num.clip_grad_norm is not None else None
    layout = ModelLayout(work.layers)
    eval_every = eval_interval(rep, plan, num.accumulate)
    offset = resume.checkpoint.clock if resume is not None else 0
    schedules = [vw_schedule(config.planning.schedule, plan, layout, vw.index, totals[vw.index], splits[vw.index],
                             clip, num.accumulate, eval_every, offset) for vw in plan.virtual_workers]
    return RunSpec(plan, work.layers, work.loss_fn, work.optimizer, work.data, epochs, schedules,
                   infer_boundaries(work.layers, x), batch_of(x), copy_stream=config.runtime.copy_stream,
                   audit=config.ps.audit, seed=num.seed, resume=resume,
                   lr_scheduler=sized(num.lr_scheduler, RunShape(num_vws, per_epoch,
                                                                 per_slot * deal.num_slots, epochs, num.accumulate,
                                                                 num.lr_scheduler_steps)),
                   lr_stride=num_vws if num.lr_scheduler_steps == "run" else 1,
                   clip_grad_norm=clip, param_names=param_names(work.names), eval_every=eval_every,
                   eval_data=work.eval_data, eval_metric=rep.eval_metric, loss_scale=dict(num.loss_scale or {}), accumulate=num.accumulate)


def unequal_waves_supported(config: RunConfig) -> None:
    """ArgumentError naming the setting a run with waves of unequal length does not support: a
    learning-rate schedule stepped by the run's minibatches (it counts an equal share per VW)."""
    if config.numerics.lr_scheduler is not None and config.numerics.lr_scheduler_steps == "run":
        raise ArgumentError("hetpipe: lr_scheduler_steps='run' counts an equal share of minibatches per VW; with "
                            "waves of unequal length use lr_scheduler_steps='vw'")


def eval_interval(rep: Reporting, plan: Plan, accumulate: int) -> Optional[int]:
    """The waves between VW 0's evaluation points: ``eval_every``, or ``eval_every_steps`` of the run's
    optimizer steps (:func:`~hetpipe.run.callbacks.run_steps`) rounded to whole waves, at least one."""
    if rep.eval_every_steps is None:
        return rep.eval_every
    per_wave = run_steps(0, plan.minibatches_per_wave, accumulate)
    return max(1, round(rep.eval_every_steps / max(1, per_wave)))


def reporter(config: RunConfig, plan: Plan, spec: RunSpec) -> Reporter:
    """The reporter of the last stage of VW 0 (progress bar, metrics, TensorBoard, callbacks)."""
    rep = config.reporting
    return Reporter(plan, as_path(rep.metrics), as_path(rep.tensorboard), rep.progress,
                    spec.schedules[0].num_minibatches, config.epochs, list(rep.callbacks), spec.eval_every is not None,
                    accumulate=config.numerics.accumulate, resume=spec.resume)


def wants_reporter(config: RunConfig) -> bool:
    """Whether a single-process replay needs a reporter (evaluation, callbacks or an output file)."""
    rep = config.reporting
    return rep.evaluates or bool(rep.callbacks) or rep.metrics is not None or rep.tensorboard is not None
