"""The Trainer's settings in six typed sections, and the one resolved configuration a run follows.

A section is a frozen dataclass that checks its fields when built, so a bad value fails on every rank
before any MPI start-up, naming the section and the field. :class:`RunConfig` is what the run reads:
the sections as the script gave them, completed by what ``hetpipe launch`` asked for
(:mod:`hetpipe.job.launch_file`). Where both set a field and disagree, :func:`resolve` refuses with
one line naming both; nothing the launcher says replaces what the script says without that line.

Sections (docs/training.md, "Settings"):

- :class:`Planning`: how a plan is made when none is given (cluster, policy, Nm, D, schedule, cache);
- :class:`PSRule`: how the parameter servers combine the VWs' deltas (aggregate, outer optimizer, audit);
- :class:`Numerics`: what each stage computes (precision, seed, accumulation, clipping, LR schedule);
- :class:`Checkpointing`: where and how often checkpoints are written, and what a run resumes from;
- :class:`Reporting`: what the run reports (progress, metrics, trace, TensorBoard, record, evaluation,
  callbacks);
- :class:`Runtime`: how the ranks run (peer timeout, transport, device emulation, copy stream, comm).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple, Type, TypeVar, Union

from hetpipe.job import failure
from hetpipe.job.launch_file import LaunchSettings
from hetpipe.job.roles import LaunchError
from hetpipe.util.arguments import directory_path, file_path, flag, path_of
from hetpipe.util.errors import ArgumentError
from hetpipe.util.numbers import seconds, whole
from hetpipe.plan.outer import OUTER_DEFAULTS, check_outer
from hetpipe.plan.precision import check_precision

PathLike = Union[str, Path]

# The most minibatch-stages (minibatches per VW x the plan's stages, over every VW) a run's schedules
# hold: every rank builds every VW's schedule before training, about 1 KB and 20 us per
# minibatch-stage, so this bound is ~16 GB and minutes on every rank. Past it a run would look hung
# while its memory grew; a longer training is several runs, each resuming from the last one's checkpoint.
MAX_MINIBATCH_STAGES = 1 << 24


def as_path(value: Optional[PathLike]) -> Optional[Path]:
    return Path(value) if value else None


@dataclass(frozen=True)
class Planning:
    """How rank 0 makes the plan when the Trainer is given none.

    cluster: a preset, cluster JSON path, dict or ClusterSpec; ``"auto"`` discovers the world's devices
        (docs/clusters.md). None: ``hetpipe launch --cluster``'s, else the ``cpu-emulated`` preset.
    policy: the planner's policy ("auto", "ed", "np", "hd", ...; :func:`hetpipe.plan.make_plan`).
    nm, d: minibatches in flight per VW and the staleness bound; given with a plan they override the
        plan's (its predicted throughput is then dropped; an nm larger than a plan sized against device
        memory is refused).
    schedule: the registered schedule every VW runs (default "hetpipe", the WSP schedule).
    split_startup: the first ``split_startup`` minibatches of each VW run as two half micro-batches
        (AutoPipe-H); the loss must be a mean over samples.
    plan_cache: a directory keeping the plan, profile and cluster for the next run of the same model,
        sample shapes, cluster and settings (None: ``hetpipe launch --plan-cache``'s, else none).
    on_plan: called on rank 0 with the plan every rank runs, before training starts.
    objective: what the plan maximises (:func:`hetpipe.plan.make_plan`): "throughput" (default), or
        "time-to-accuracy": goodput, samples/s x the statistical efficiency of the plan's batch per update,
        from the gradient noise scale (the chosen plan may leave slow devices out: see docs/clusters.md).
    noise_scale: time-to-accuracy: the gradient noise scale in samples; None: rank 0 measures it before
        planning by a short pilot on the model and the first minibatches of the data
        (:func:`hetpipe.run.pilot.job_noise_scale`).
    waves: minibatches per wave of each VW (:func:`hetpipe.plan.make_plan`): "equal" (default, Nm each)
        or "speed" (proportional to the VW's predicted speed; the PS weighs the deltas by their samples).
    """

    cluster: Any = None
    policy: str = "auto"
    nm: Optional[int] = None
    d: Optional[int] = None
    schedule: str = "hetpipe"
    split_startup: int = 0
    plan_cache: Optional[PathLike] = None
    on_plan: Optional[Callable[[Any], None]] = None
    objective: str = "throughput"
    noise_scale: Optional[float] = None
    waves: str = "equal"

    def __post_init__(self) -> None:
        from hetpipe.plan.formation import POLICIES
        from hetpipe.plan.types import MAX_NM
        from hetpipe.schedule.registry import get_schedule

        if self.cluster is not None and not (isinstance(self.cluster, str) and self.cluster == "auto"):
            from hetpipe.plan.cluster import load_cluster

            try:
                load_cluster(self.cluster)
            except (ValueError, TypeError) as e:
                raise ArgumentError(f"hetpipe: planning.cluster: {e}") from None
        if not isinstance(self.policy, str) or self.policy.upper() not in (*POLICIES, "AUTO"):
            raise ArgumentError(f"hetpipe: planning.policy must be one of auto, {', '.join(POLICIES)} (any case), "
                                f"got {self.policy!r}")
        if self.nm is not None:
            whole("planning.nm", self.nm, 1, MAX_NM, " (minibatches in flight per VW)")
        if self.d is not None:
            whole("planning.d", self.d, 0)
        if self.waves not in ("equal", "speed"):
            raise ArgumentError(f"hetpipe: planning.waves must be 'equal' or 'speed', got {self.waves!r}")
        whole("planning.split_startup", self.split_startup, 0)
        try:
            get_schedule(self.schedule)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"hetpipe: planning.schedule: {e}") from None
        directory_path("planning.plan_cache", self.plan_cache)
        if self.on_plan is not None and not callable(self.on_plan):
            raise TypeError(f"hetpipe: planning.on_plan must be a function plan -> None, got {self.on_plan!r}")
        from hetpipe.plan.planner import OBJECTIVES, TIME_TO_ACCURACY

        if self.objective not in OBJECTIVES:
            raise ArgumentError(f"hetpipe: planning.objective must be one of {', '.join(OBJECTIVES)}, "
                                f"got {self.objective!r}")
        if self.noise_scale is not None:
            if self.objective != TIME_TO_ACCURACY:
                raise ArgumentError(f"hetpipe: planning.noise_scale is for objective={TIME_TO_ACCURACY!r}, "
                                    f"not {self.objective!r}")
            ns = self.noise_scale
            if isinstance(ns, bool) or not isinstance(ns, (int, float)) or not math.isfinite(ns) or ns < 0:
                raise ArgumentError(f"hetpipe: planning.noise_scale must be a finite number >= 0 (samples), "
                                    f"got {ns!r}")


@dataclass(frozen=True)
class PSRule:
    """How the PS shards combine the VWs' deltas into the global weights (docs/design.md, "WSP").

    aggregate: "mean" (a wave moves the weights by the VWs' average change, so learning rates tuned on
        one GPU carry over) or "sum" (HetPipe's rule: N VWs take N times the step). None: the plan's.
    outer, outer_lr, outer_momentum, outer_staleness, outer_gain, outer_delay: the outer optimizer ("sgd",
        "nesterov" or "delayed-nesterov", its learning rate and momentum; staleness decay "none", "inverse"
        or "sqrt"; gain "none" or "sqrt"; delayed-nesterov's pushes per momentum step, 0: the VW count;
        hetpipe.plan.outer). Each None: the plan's.
    audit: each shard also keeps the float64 sum of every delta pushed to it, as applied
        (``TrainResult.shard_logs[k].pushed_sum``); a float64 pass over every push.
    """

    aggregate: Optional[str] = None
    outer: Optional[str] = None
    outer_lr: Optional[float] = None
    outer_momentum: Optional[float] = None
    outer_staleness: Optional[str] = None
    outer_gain: Optional[str] = None
    outer_delay: Optional[int] = None
    audit: bool = False

    def __post_init__(self) -> None:
        if self.aggregate is not None and self.aggregate not in ("mean", "sum"):
            raise ArgumentError(f"hetpipe: ps.aggregate must be 'mean' or 'sum', got {self.aggregate!r}")
        flag("ps.audit", self.audit)
        check_outer("ps", **{**OUTER_DEFAULTS, **self.outer_overrides})

    @property
    def outer_overrides(self) -> Dict[str, Any]:
        """The outer-optimizer fields this rule sets (those replace the plan's)."""
        given = {"outer": self.outer, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                 "outer_staleness": self.outer_staleness, "outer_gain": self.outer_gain,
                 "outer_delay": self.outer_delay}
        return {k: v for k, v in given.items() if v is not None}


@dataclass(frozen=True)
class Numerics:
    """What each stage computes, as a one-process loop would.

    precision: "fp32", "bf16" or "fp16" (None: the plan's; a plan made here is "fp32"); the half types run
        the forward and the loss under autocast, weights, optimizer and PS stay float32, and "fp16" adds
        dynamic loss scaling with ``loss_scale``'s options (as ``torch.amp.GradScaler``'s).
    seed: seeds the data order and every stage's random draws (dropout), per (seed, VW, stage, minibatch).
    accumulate: each stage steps every ``accumulate`` minibatches with the mean of their gradients.
    clip_grad_norm: clip each minibatch's gradient to this norm, taken over all of its VW's stages.
    lr_scheduler: a factory ``optimizer -> LRScheduler`` (any of ``torch.optim.lr_scheduler``'s or
        transformers' ``get_*_schedule*``), built by every stage over its optimizer; a factory
        ``(optimizer, run)`` is also given the run's :class:`~hetpipe.run.shape.RunShape` (the VWs,
        ``steps_per_epoch`` and ``total_steps`` as the scheduler counts them).
    lr_scheduler_steps: what the scheduler counts. "run" (the default): the optimizer steps of the whole
        run, as one process training on all the data would take them: each VW's scheduler steps once for
        every VW's step, so a schedule sized for a plain loop (``epochs * len(loader)`` steps) spans the
        run at any number of VWs. "vw": the VW's own steps (once per step; a VW takes about
        ``1 / num_vws`` of the run's).
    """

    precision: Optional[str] = None
    seed: int = 0
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    lr_scheduler: Optional[Callable] = None
    loss_scale: Optional[Mapping[str, Any]] = None
    lr_scheduler_steps: str = "run"

    def __post_init__(self) -> None:
        from hetpipe.stage.loss_scale import LossScale

        if self.precision is not None:
            check_precision(self.precision, "hetpipe: numerics")
        whole("numerics.seed", self.seed, 0)
        whole("numerics.accumulate (minibatches)", self.accumulate)
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
                                 or clip == float("inf")):
            raise ArgumentError(f"hetpipe: numerics.clip_grad_norm must be a finite number > 0, got {clip!r}")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError("hetpipe: numerics.lr_scheduler must be a factory optimizer -> LR scheduler, "
                            f"got {self.lr_scheduler!r}")
        if self.lr_scheduler_steps not in ("run", "vw"):
            raise ArgumentError(f"hetpipe: numerics.lr_scheduler_steps must be 'run' or 'vw', got "
                                f"{self.lr_scheduler_steps!r}")
        LossScale(**dict(self.loss_scale or {}))             # checks the options now


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoints: asynchronous, atomic, verified on resume (docs/faults.md).

    dir: where every rank writes (seen by all); None: ``hetpipe launch --checkpoint-dir``'s, else none.
    every: waves between checkpoints (None: ``--checkpoint-every``'s, else 1).
    every_steps: or every so many of the run's optimizer steps, all VWs together as one process counts
        them, rounded to whole waves once the plan is known (at least one; not with ``every``).
    keep: complete checkpoints kept on disk (2 or more lets ``fallback`` go back one).
    resume: a checkpoint directory (its latest complete checkpoint) or one checkpoint to resume from
        (None: ``hetpipe launch --resume``'s, or the one a restarting launcher picks).
    fallback: when the latest checkpoint fails verification, resume from the previous complete one.
    on_sigterm: keep host copies of the last D + 2 wave boundaries, so that SIGTERM writes the newest
        clock every rank holds; False: SIGTERM only lets the checkpoint in flight finish.
    """

    dir: Optional[PathLike] = None
    every: Optional[int] = None
    keep: int = 1
    resume: Optional[PathLike] = None
    fallback: bool = False
    on_sigterm: bool = True
    every_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if self.every is not None:
            whole("checkpointing.every (waves)", self.every)
        if self.every_steps is not None:
            whole("checkpointing.every_steps (optimizer steps)", self.every_steps)
            if self.every is not None:
                raise ArgumentError("hetpipe: give checkpointing.every (waves) or every_steps (steps), not both")
        whole("checkpointing.keep", self.keep)
        directory_path("checkpointing.dir", self.dir)
        path_of("checkpointing.resume", self.resume)
        flag("checkpointing.fallback", self.fallback)
        flag("checkpointing.on_sigterm", self.on_sigterm)


@dataclass(frozen=True)
class Reporting:
    """What the run reports, and its evaluation.

    progress: a progress bar on the last stage of VW 0. metrics / trace / tensorboard: paths of the
    JSON-lines metrics file, a Chrome trace and a TensorBoard log directory. record: where rank 0 writes
    the run's record (which version each pull got, the order each shard applied pushes), from which
    ``Trainer.replay(record=...)`` reproduces the run bitwise. eval_data / eval_every / eval_metric:
    evaluate the global weights every ``eval_every`` waves on ``eval_data`` (loss, and
    ``eval_metric(output, labels)`` when given); or every ``eval_every_steps`` optimizer steps of the
    run, all VWs together as one process counts them (rounded to whole waves). callbacks: objects with ``on_wave_end`` and/or ``on_eval`` hooks
    (:mod:`hetpipe.run.callbacks`), run on the reporting rank.
    """

    progress: bool = True
    metrics: Optional[PathLike] = None
    trace: Optional[PathLike] = None
    tensorboard: Optional[PathLike] = None
    record: Optional[PathLike] = None
    eval_data: Any = None
    eval_every: Optional[int] = None
    eval_metric: Optional[Callable] = None
    callbacks: Sequence[object] = ()
    eval_every_steps: Optional[int] = None

    @property
    def evaluates(self) -> bool:
        return self.eval_every is not None or self.eval_every_steps is not None

    def __post_init__(self) -> None:
        from hetpipe.run.callbacks import Callbacks

        flag("reporting.progress", self.progress)
        for name in ("metrics", "trace", "record"):
            file_path(f"reporting.{name}", getattr(self, name))
        directory_path("reporting.tensorboard", self.tensorboard)
        if self.eval_every is not None:
            whole("reporting.eval_every (waves)", self.eval_every)
        if self.eval_every_steps is not None:
            whole("reporting.eval_every_steps (optimizer steps)", self.eval_every_steps)
            if self.eval_every is not None:
                raise ArgumentError("hetpipe: give reporting.eval_every (waves) or eval_every_steps (steps), not both")
        if self.eval_data is not None and not self.evaluates:
            raise ArgumentError("hetpipe: reporting.eval_data needs reporting.eval_every_steps or eval_every (how "
                                "often to evaluate)")
        if self.eval_metric is not None and not callable(self.eval_metric):
            raise TypeError("hetpipe: reporting.eval_metric must be a function (output, labels) -> float, "
                            f"got {self.eval_metric!r}")
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        Callbacks(list(self.callbacks), self.evaluates)       # checks them now, on every rank


@dataclass(frozen=True)
class Runtime:
    """How the ranks run.

    timeout: seconds a rank waits for a peer before the job fails (None: ``hetpipe launch --timeout``'s,
        else ``HETPIPE_TIMEOUT``, else 120).
    transport: the stage ranks' backend ("torch-p2p", "mpi-host"; None: ``--transport``'s, else chosen
        per pair of stages).
    emulate: pad stages to their device type's profile (None: when the device is emulated on this host);
        emulation_scale multiplies the padding.
    copy_stream: move stage-to-stage tensors through a copy stream overlapping compute (None: on CUDA).
    comm: the MPI communicator of the run (None: the world).
    """

    timeout: Optional[float] = None
    transport: Optional[str] = None
    emulate: Optional[bool] = None
    emulation_scale: float = 1.0
    copy_stream: Optional[bool] = None
    comm: Any = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            seconds("runtime.timeout", self.timeout)
        seconds("runtime.emulation_scale", self.emulation_scale)
        flag("runtime.emulate", self.emulate, optional=True)
        flag("runtime.copy_stream", self.copy_stream, optional=True)
        if self.transport is not None:
            from hetpipe.transport import registry as transports

            if self.transport not in transports.names():
                raise ArgumentError(f"hetpipe: runtime.transport must be one of {', '.join(transports.names())}, "
                                    f"got {self.transport!r}")


SECTIONS: Dict[str, type] = {"planning": Planning, "ps": PSRule, "numerics": Numerics,
                             "checkpointing": Checkpointing, "reporting": Reporting, "runtime": Runtime}
S = TypeVar("S")


def section(name: str, value: Union[S, Mapping[str, Any], None], kind: Type[S]) -> S:
    """``value`` as the section ``kind``: the dataclass itself, a mapping of its fields, or None (defaults).
    An unknown field is refused naming it and the section's fields."""
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(kind)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"hetpipe: {name} has no field {unknown[0]!r}; its fields are {', '.join(sorted(known))}")
        return kind(**value)
    raise TypeError(f"hetpipe: {name} must be a hetpipe.{kind.__name__} or a dict of its fields, got {value!r}")


# The flat keywords of earlier releases, and the section field each now is (they work for one release).
LEGACY: Dict[str, Tuple[str, str]] = {
    "policy": ("planning", "policy"), "cluster": ("planning", "cluster"), "nm": ("planning", "nm"),
    "d": ("planning", "d"), "schedule": ("planning", "schedule"), "split_startup": ("planning", "split_startup"),
    "plan_cache": ("planning", "plan_cache"), "plan_callback": ("planning", "on_plan"),
    "aggregate": ("ps", "aggregate"), "outer": ("ps", "outer"), "outer_lr": ("ps", "outer_lr"),
    "outer_momentum": ("ps", "outer_momentum"), "outer_staleness": ("ps", "outer_staleness"),
    "audit": ("ps", "audit"),
    "precision": ("numerics", "precision"), "seed": ("numerics", "seed"), "accumulate": ("numerics", "accumulate"),
    "clip_grad_norm": ("numerics", "clip_grad_norm"), "lr_scheduler": ("numerics", "lr_scheduler"),
    "loss_scale": ("numerics", "loss_scale"),
    "checkpoint_dir": ("checkpointing", "dir"), "checkpoint_every": ("checkpointing", "every"),
    "checkpoint_keep": ("checkpointing", "keep"), "resume": ("checkpointing", "resume"),
    "resume_fallback": ("checkpointing", "fallback"), "checkpoint_on_sigterm": ("checkpointing", "on_sigterm"),
    "progress": ("reporting", "progress"), "metrics": ("reporting", "metrics"), "trace": ("reporting", "trace"),
    "tensorboard": ("reporting", "tensorboard"), "record": ("reporting", "record"),
    "eval_data": ("reporting", "eval_data"), "eval_every": ("reporting", "eval_every"),
    "eval_metric": ("reporting", "eval_metric"), "callbacks": ("reporting", "callbacks"),
    "timeout": ("runtime", "timeout"), "transport": ("runtime", "transport"), "emulate": ("runtime", "emulate"),
    "emulation_scale": ("runtime", "emulation_scale"), "copy_stream": ("runtime", "copy_stream"),
    "comm": ("runtime", "comm"),
}


class HetpipeDeprecationWarning(FutureWarning):
    """A keyword or setting that still works in this release and goes in the next (shown by default)."""


def fold_legacy(given: Dict[str, Any], legacy: Dict[str, Any]) -> Dict[str, Any]:
    """The sections of ``given`` (name -> section value) with the flat keywords of ``legacy`` folded in,
    each warned about once, naming what replaces it. A keyword that is not a setting, or one that is
    also set in its section, is refused."""
    import warnings

    out = dict(given)
    for key, value in legacy.items():
        if key not in LEGACY:
            raise TypeError(f"hetpipe: Trainer() got an unexpected keyword argument {key!r}")
        name, attr = LEGACY[key]
        kind = SECTIONS[name]
        warnings.warn(f"hetpipe: Trainer({key}=...) is deprecated and goes in the next release: use "
                      f"{name}=hetpipe.{kind.__name__}({attr}=...)", HetpipeDeprecationWarning, stacklevel=3)
        current = out.get(name)
        if isinstance(current, kind):
            current = {f.name: getattr(current, f.name) for f in fields(kind)
                       if getattr(current, f.name) != getattr(kind(), f.name)}
        current = dict(current or {})
        if attr in current:
            raise TypeError(f"hetpipe: Trainer({key}=...) and {name}.{attr} both given: keep {name}.{attr}")
        current[attr] = value
        out[name] = current
    return out


@dataclass(frozen=True)
class RunConfig:
    """The settings a run follows: the script's sections completed by ``hetpipe launch``'s run file.

    plan: the plan given to the Trainer (a Plan or a path) or the launcher's (``plan_source`` says
    which), None when rank 0 makes one. Every rank resolves the same config from the same script and run
    file, so every rank refuses a conflict alike, before any collective."""

    epochs: int
    plan: Any
    plan_source: str
    planning: Planning
    ps: PSRule
    numerics: Numerics
    checkpointing: Checkpointing
    reporting: Reporting
    runtime: Runtime
    timeout_s: float = field(default=0.0)
    run_id: Optional[str] = None

    @property
    def checkpoint_every(self) -> int:
        return self.checkpointing.every or 1

    @property
    def record_path(self) -> Optional[Path]:
        return as_path(self.reporting.record)

    @property
    def plan_cache(self) -> Optional[Path]:
        return as_path(self.planning.plan_cache)


def _merge(script: Any, launcher: Any, what: str, flag: str) -> Any:
    """The script's value, else the launcher's; both given and different: one line naming both."""
    if launcher is None or launcher == script:
        return script
    if script is None:
        return launcher
    raise LaunchError(f"hetpipe: the script sets {what}={script!r} but hetpipe launch {flag} asks for "
                      f"{launcher!r}: give it in one place")


def _same_path(script: Optional[PathLike], launcher: Optional[str]) -> Optional[PathLike]:
    if script is not None and launcher is not None and Path(script).resolve() == Path(launcher).resolve():
        return script
    return launcher


def resolve(epochs: int, plan: Any, sections: Dict[str, Any], launch: Optional[LaunchSettings] = None) -> RunConfig:
    """The run's :class:`RunConfig`: ``sections`` completed by ``launch`` (default: the run file of this
    launch, :meth:`LaunchSettings.current`). A plan from a restarting launcher (which re-planned without a
    failed device) replaces the script's, and rank 0 says so; a ``--plan`` that differs from the script's
    plan is refused."""
    whole("epochs", epochs, 1, MAX_MINIBATCH_STAGES, ", the most minibatch-stages a run's schedules hold (each epoch "
          "adds one at least); train longer as several runs, each resuming from the last one's checkpoint")
    _check_plan(plan)
    launch = LaunchSettings.current() if launch is None else launch
    planning, ps = sections["planning"], sections["ps"]
    numerics, checkpointing = sections["numerics"], sections["checkpointing"]
    reporting, runtime = sections["reporting"], sections["runtime"]
    cluster = _merge(planning.cluster, launch.cluster, "planning.cluster", "--cluster")
    cache = _merge(planning.plan_cache, _same_path(planning.plan_cache, launch.plan_cache), "planning.plan_cache",
                   "--plan-cache")
    planning = dataclasses.replace(planning, cluster=cluster, plan_cache=cache)
    checkpointing = dataclasses.replace(
        checkpointing,
        dir=_merge(checkpointing.dir, _same_path(checkpointing.dir, launch.checkpoint_dir), "checkpointing.dir",
                   "--checkpoint-dir"),
        every=_merge(checkpointing.every, launch.checkpoint_every, "checkpointing.every", "--checkpoint-every"),
        resume=_resume(checkpointing.resume, launch))
    runtime = dataclasses.replace(
        runtime, timeout=_merge(runtime.timeout, launch.timeout, "runtime.timeout", "--timeout"),
        transport=_merge(runtime.transport, launch.transport, "runtime.transport", "--transport"))
    plan_source = "script" if plan is not None else "planned"
    if launch.plan is not None:
        plan, plan_source = _launch_plan(plan, launch)
    return RunConfig(epochs, plan, plan_source, planning, ps, numerics, checkpointing, reporting,
                     runtime, failure.timeout_s(runtime.timeout), launch.run_id)


def _check_plan(plan: Any) -> None:
    """The Trainer's ``plan=``: None, a Plan, or a plan JSON file that loads."""
    from hetpipe.plan.types import Plan

    if plan is None or isinstance(plan, Plan):
        return
    if isinstance(plan, bool) or not isinstance(plan, (str, Path)):
        raise ArgumentError(f"hetpipe: plan must be a hetpipe.Plan, a plan JSON path or None, got {plan!r}")
    try:
        Plan.load(plan)
    except ValueError as e:
        raise ArgumentError(f"hetpipe: plan={str(plan)!r}: {e}") from None


def _resume(script: Optional[PathLike], launch: LaunchSettings) -> Optional[PathLike]:
    if launch.resume is None:
        return script
    if launch.restarting:
        # A restart resumes from the newest checkpoint of this run, which is what the script's own
        # resume= led to on the first attempt: the restart's checkpoint is the later one.
        return launch.resume
    return _merge(script, _same_path(script, launch.resume), "checkpointing.resume", "--resume")


def _launch_plan(script_plan: Any, launch: LaunchSettings) -> Tuple[Any, str]:
    from hetpipe.plan.types import Plan

    if script_plan is None:
        return launch.plan, "launch"
    if launch.restarting:
        return launch.plan, "restart"        # said on rank 0 at start-up (hetpipe.run.rank)
    mine = script_plan if isinstance(script_plan, Plan) else Plan.load(script_plan)
    if mine.to_json() != Plan.load(launch.plan).to_json():
        raise LaunchError(f"hetpipe: the script's plan= and hetpipe launch --plan {launch.plan} are different "
                          "plans: give the plan in one place")
    return script_plan, "script"
