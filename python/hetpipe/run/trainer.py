"""The user-facing Trainer: what to train, the settings in six sections, and the two ways to run it.

Every rank of ``mpiexec -n N python train.py`` (or ``hetpipe launch -n N train.py``) builds the same
Trainer (same model seed, same data) and calls :meth:`Trainer.fit`: rank 0 plans (or the given plan is
used) and broadcasts the plan, each rank runs its role (:mod:`hetpipe.run.rank`: a pipeline stage of
a virtual worker or a PS shard), and at the end every rank receives the final global weights, loaded
into its copy of the model. :meth:`Trainer.replay` runs the same spec in one process (the reference).
The settings: :mod:`hetpipe.run.config`; what a run returns: :mod:`hetpipe.run.result`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from hetpipe.checkpoint import state as ckpt
from hetpipe.job import failure
from hetpipe.job.environment import check_rank
from hetpipe.job.roles import LaunchError
from hetpipe.job.rundir import current_phase, log_signals
from hetpipe.job.world import world
from hetpipe.model.weights import load_layer_weights
from hetpipe.plan.types import Plan
from hetpipe.run import workload as wl
from hetpipe.run.build import say_dropped
from hetpipe.run.checkpoints import RunCheckpoints
from hetpipe.run.config import (SECTIONS, Checkpointing, Numerics, Planning, PSRule, Reporting, RunConfig, Runtime,
                                fold_legacy, resolve, section)
from hetpipe.run.rank import RankRun
from hetpipe.run.record import RunRecord
from hetpipe.run.replay import ReplayResult, replay_run
from hetpipe.run.result import TrainResult, resumed_losses
from hetpipe.run.spec import RunSpec

Section = Union[Mapping[str, Any], None]


class Trainer:
    """Train ``model`` with HetPipe: pipelined virtual workers synchronised by WSP through PS shards.

    The four essentials:

    model: an ``nn.Sequential`` or a list of modules (the layers the plan partitions), built identically
        (same seed) on every rank, following the layer contract (docs/design.md, "Layer contract").
    loss_fn: ``loss_fn(output, labels) -> scalar tensor``.
    optimizer: a factory ``params -> torch.optim.Optimizer``; each stage builds its own over its layers
        (marked with :func:`hetpipe.named_params` it gets ``(name, parameter)`` pairs, for groups by name).
    data: the minibatches (docs/training.md, "Data"): a ``DataLoader``, a
        :class:`~hetpipe.loader.DatasetSource` or :class:`~hetpipe.loader.StreamSource`, any re-iterable of
        ``(inputs, labels)`` yielding the same sequence on every rank, or a factory
        ``(vw, num_vws, epoch) -> iterable`` of a VW's own minibatches.

    Then: ``epochs``; ``plan`` (a :class:`Plan` or a plan JSON path; None: rank 0 plans as ``planning``
    says); and six sections, each a dataclass of :mod:`hetpipe.run.config` or a dict of its fields:
    ``planning`` (:class:`Planning`), ``ps`` (:class:`PSRule`), ``numerics`` (:class:`Numerics`),
    ``checkpointing`` (:class:`Checkpointing`), ``reporting`` (:class:`Reporting`) and ``runtime``
    (:class:`Runtime`). What ``hetpipe launch`` asks for (its run file) fills what the script leaves unset;
    a setting both give differently is refused with one line naming both.

    The flat keywords of earlier releases (``nm=``, ``checkpoint_dir=``, ...) still work in this release:
    each warns once (:class:`~hetpipe.run.config.HetpipeDeprecationWarning`), naming its section field.
    """

    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]], loss_fn: Callable,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], data: Iterable, *,
                 epochs: int = 1, plan: Union[Plan, str, Path, None] = None,
                 planning: Union[Planning, Section] = None, ps: Union[PSRule, Section] = None,
                 numerics: Union[Numerics, Section] = None, checkpointing: Union[Checkpointing, Section] = None,
                 reporting: Union[Reporting, Section] = None, runtime: Union[Runtime, Section] = None,
                 **deprecated: Any):
        check_rank()            # the HETPIPE_* variables this rank reads, before anything is built
        given = {"planning": planning, "ps": ps, "numerics": numerics, "checkpointing": checkpointing,
                 "reporting": reporting, "runtime": runtime}
        if deprecated:
            given = fold_legacy(given, deprecated)
        sections = {name: section(name, value, SECTIONS[name]) for name, value in given.items()}
        self.config: RunConfig = resolve(epochs, plan, sections)
        self.work = wl.Workload.of(model, loss_fn, optimizer, data, self.config)
        self.checkpoints = RunCheckpoints.of(self.work, self.config)

    @property
    def model(self) -> Any:
        return self.work.model

    @property
    def layers(self):
        return self.work.layers

    def resolve_plan(self) -> Plan:
        """The plan this Trainer runs: the launcher's, the given one, or one made now from a profile of the
        model (what rank 0 broadcasts), with the config's PS rule and precision."""
        return wl.resolve_plan(self.work, self.config)[0]

    def spec(self, plan: Plan, resume: Optional[ckpt.Resume] = None) -> RunSpec:
        """The run's :class:`RunSpec` for ``plan`` on this rank (see :func:`hetpipe.run.workload.run_spec`)."""
        return wl.run_spec(self.work, self.config, plan, resume)

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
        say_dropped(spec)
        reporter = wl.reporter(self.config, plan, spec) if wl.wants_reporter(self.config) else None
        result = replay_run(spec, record, reporter)
        if reporter is not None:
            reporter.finish(result, None, "")
        if spec.resume is not None:
            result.losses = resumed_losses(result.losses, spec.resume)
        load_layer_weights(self.work.layers, result.weights, result.buffers, result.local_buffers)
        return result

    def fit(self) -> TrainResult:
        """Train under MPI (every rank calls this); returns the run's result on every rank."""
        torch.set_num_threads(1)
        try:
            comm = self.config.runtime.comm if self.config.runtime.comm is not None else world()
        except KeyboardInterrupt:
            # A Ctrl-C during MPI start-up, before this rank can reach its peers: one line, status 130.
            failure.interrupted(None, "hetpipe: interrupted (SIGINT) during MPI start-up", "this rank")
        rank, size = comm.Get_rank(), comm.Get_size()
        run = RankRun(self.work, self.config, self.checkpoints, rank)
        failure.install_excepthook(comm, lambda: run.describe)
        failure.install_sigterm(lambda: run.describe, current_phase)
        log_signals()
        try:
            return run.run(comm, rank, size)
        except LaunchError as e:
            # Every rank reaches the same verdict: rank 0 says it once (no traceback), the job ends.
            failure.verdict(comm, "job" if rank == 0 else run.describe, e)
        except KeyboardInterrupt:
            # Ctrl-C: mpiexec gave every rank the SIGINT; one line for the job, exit status 130.
            failure.interrupted(comm, run.interruption(), run.describe)
        except BaseException as e:  # noqa: BLE001 - any failure must bring the job down, naming this rank
            failure.report(run.describe, e)
            failure.abort(comm)
        raise AssertionError("unreachable")
