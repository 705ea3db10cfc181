"""The user-facing Trainer: plan, start every rank's role under MPI, train under WSP, report.

Every rank of ``mpiexec -n N python train.py`` builds the same Trainer (same model seed, same data)
and calls :meth:`Trainer.fit`. Rank 0 plans (or the given plan is used) and broadcasts the plan; each
rank then runs its role — a pipeline stage of a virtual worker or a parameter-server shard — and at
the end every rank receives the final global weights, loaded into its copy of the model.
:meth:`Trainer.replay` runs the same spec in one process (the reference).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from hetpipe.launch import failure
from hetpipe.launch.deaths import register_rank
from hetpipe.launch.mpi import gather_hosts, world
from hetpipe.launch.roles import LaunchError, Role, check_world, resolve_device, role_of
from hetpipe.outputs import check_file
from hetpipe.plan.types import Plan
from hetpipe.runtime.build import (RunSpec, as_layers, build_shard, build_stage, drive, infer_boundaries,
                                   load_layer_weights, merge_outcomes, part_outcome, shard_pool, stage_pool)
from hetpipe.runtime.data import first_minibatch, minibatches_per_epoch
from hetpipe.runtime.executor import StageExecutor
from hetpipe.runtime.ps import ShardLog
from hetpipe.runtime.record import RunRecord
from hetpipe.runtime.replay import ReplayResult, replay_run
from hetpipe.runtime.transport import MPITransport
from hetpipe.runtime.tree import batch_of
from hetpipe.schedule.trace import TraceEvent, write_chrome_trace


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


class Trainer:
    """Train ``model`` with HetPipe: pipelined virtual workers synchronised by WSP through PS shards.

    model: an ``nn.Sequential`` or a list of modules (the layers the plan partitions), built
        identically (same seed) on every rank, following the layer contract (docs/design.md): layers
        pass any pytree of tensors; ``hetpipe_side_inputs`` names keys of the inputs dict a layer also
        takes; a parameter shared by several layers stays one (tied) parameter; BatchNorm running
        statistics are averaged across VWs at wave boundaries. loss_fn(output, labels) -> scalar tensor.
    optimizer: a factory ``params -> torch.optim.Optimizer``; each stage builds its own over its layers.
    data: re-iterable ``(inputs, labels)`` minibatches, the same on every rank (see runtime.data).
    plan: a :class:`Plan` or a plan JSON path; else rank 0 plans with ``policy`` on ``cluster``
        (default: the ``cpu-emulated`` preset) from a profile of the model.
    nm, d: minibatches in flight per VW and the staleness bound (override the plan's when given: the
        plan's predicted throughput is then dropped, and an nm larger than that of a plan sized
        against device memory is refused; see :func:`override`).
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
    seed: seeds every stage's random draws (dropout): micro-batch ``mb`` of stage ``s`` of VW ``v``
        draws from its own generator state, derived from (seed, v, s, mb), in the run and the replay.
    record: path of the run's record (JSON, written by rank 0 at the end): per PS shard, the order it
        applied pushes and the global-weights version every pull got, the only things timing decides;
        ``Trainer(...).replay(record=path)`` then reproduces the run bitwise for any D (see
        :mod:`hetpipe.runtime.record`).
    """

    def __init__(self, model: Union[nn.Module, Sequence[nn.Module]], loss_fn: Callable,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], data: Iterable, *,
                 plan: Union[Plan, str, Path, None] = None, policy: str = "auto", cluster: Any = None,
                 nm: Optional[int] = None, d: Optional[int] = None, epochs: int = 1, split_startup: int = 0,
                 timeout: Optional[float] = None, emulate: Optional[bool] = None, emulation_scale: float = 1.0,
                 copy_stream: Optional[bool] = None, audit: bool = False,
                 metrics: Union[str, Path, None] = None, trace: Union[str, Path, None] = None,
                 progress: bool = True, comm: Any = None, plan_callback: Optional[Callable[[Plan], None]] = None,
                 aggregate: Optional[str] = None, seed: int = 0, record: Union[str, Path, None] = None):
        self.model = model
        self.layers = as_layers(model)
        self.loss_fn, self.optimizer, self.data = loss_fn, optimizer, data
        self.plan_arg, self.policy, self.cluster = plan, policy, cluster
        self.nm, self.d, self.epochs = nm, d, epochs
        self.split_startup = split_startup
        self.timeout = failure.timeout_s(timeout)
        self.emulate, self.emulation_scale = emulate, emulation_scale
        self.copy_stream = copy_stream
        self.audit = audit
        self.metrics = Path(metrics) if metrics else None
        self.trace_path = Path(trace) if trace else None
        self.progress = progress
        self.comm = comm
        self.plan_callback = plan_callback
        self.aggregate, self.seed = aggregate, seed
        self.record_path = Path(record) if record else None
        self._describe = "rank ?"

    # --- planning ----------------------------------------------------------------------------
    def _make_plan(self) -> Plan:
        plan = self._plan()
        if self.aggregate is not None and self.aggregate != plan.aggregate:
            plan = dataclasses.replace(plan, aggregate=self.aggregate)
        return plan

    def _plan(self) -> Plan:
        if isinstance(self.plan_arg, Plan):
            plan = self.plan_arg
        elif self.plan_arg is not None:
            plan = Plan.load(self.plan_arg)
        else:
            from hetpipe.cluster import load_cluster
            from hetpipe.plan import make_plan
            from hetpipe.profile import profile_model

            cluster = self.cluster if self.cluster is not None else load_cluster("cpu-emulated")
            if isinstance(cluster, str):
                cluster = load_cluster(cluster)
            x, y = first_minibatch(self.data)
            profile = profile_model(list(self.layers), x, cluster, loss_fn=lambda out: self.loss_fn(out, y))
            plan = make_plan(cluster, profile, policy=self.policy, nm=self.nm, d=self.d or 0,
                             minibatch_size=batch_of(x))
            return self._check_layers(plan)
        return self._check_layers(override(plan, self.nm, self.d))

    def _check_layers(self, plan: Plan) -> Plan:
        if plan.num_layers != len(self.layers):
            raise LaunchError(f"hetpipe: the plan has {plan.num_layers} layers, the model {len(self.layers)}")
        return plan

    def spec(self, plan: Plan) -> RunSpec:
        """The run's :class:`RunSpec` for ``plan`` (schedules, activation shapes) on this rank."""
        from hetpipe.schedule import hetpipe_schedule

        per_vw = minibatches_per_epoch(self.data) // len(plan.virtual_workers)
        if per_vw < 1:
            raise ValueError(f"hetpipe: one epoch has fewer minibatches than the {len(plan.virtual_workers)} VWs")
        total = per_vw * self.epochs
        x, _ = first_minibatch(self.data)
        schedules = []
        for vw in plan.virtual_workers:
            recompute = any(st.recompute for st in vw.stages)
            schedules.append(hetpipe_schedule(len(vw.stages), total, plan.nm, plan.d, recompute=recompute,
                                              split_startup=self.split_startup))
        return RunSpec(plan, self.layers, self.loss_fn, self.optimizer, self.data, self.epochs, schedules,
                       infer_boundaries(self.layers, x), batch_of(x), copy_stream=self.copy_stream, audit=self.audit,
                       seed=self.seed)

    # --- single process ----------------------------------------------------------------------
    def replay(self, record: Union[str, Path, RunRecord, None] = None) -> ReplayResult:
        """Run the whole plan in this process over a loopback transport (the reference; no padding).

        Equal to a run bitwise at D = 0; at D >= 1 only given that run's ``record`` (a
        :class:`RunRecord` or its file), whose versions and apply order the PS shards then follow
        (``ReplayResult.reproduced`` says whether the outcome is bitwise the recorded one)."""
        torch.set_num_threads(1)
        if record is not None and not isinstance(record, RunRecord):
            record = RunRecord.load(record)
        result = replay_run(self.spec(self._make_plan()), record)
        load_layer_weights(self.layers, result.weights, result.buffers)
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
        check_world(plan, size)
        role = role_of(plan, rank)
        self._describe = role.describe()
        register_rank(rank, self._describe)
        spec, problem = None, None
        try:
            spec = self.spec(plan)
            if role.kind == "stage":
                st = plan.virtual_workers[role.vw].stages[role.stage]
                dev, emulated = resolve_device(st, emulate=self.emulate, cuda_count=len(hosts[rank]["cuda"]))
                spec.devices[rank], spec.emulated[rank] = dev, emulated
                spec.emulation_scale = self.emulation_scale
        except (LaunchError, ValueError, TypeError) as e:
            problem = f"{role.describe()}: {e}"
        problems = [p for p in comm.allgather(problem) if p]
        if problems:
            raise LaunchError("; ".join(problems))
        emulated_any = any(comm.allgather(spec.emulated.get(rank, False)))
        return self._run_role(comm, plan, spec, role, emulated_any)

    def _run_role(self, comm, plan: Plan, spec: RunSpec, role: Role, emulated: bool) -> TrainResult:
        trace: Optional[List[TraceEvent]] = [] if self.trace_path else None
        if role.kind == "stage":
            pool = stage_pool(spec, role.vw, role.stage)
        else:
            pool = shard_pool(spec, role.shard)
        transport = MPITransport(comm, pool)
        comm.Barrier()
        t0 = time.perf_counter()
        reporter = None
        if role.kind == "stage":
            part = build_stage(spec, role.vw, role.stage, transport, pool, trace=trace, t0=t0)
            if role.vw == 0 and part.is_last:
                reporter = _Reporter(part, plan, self.metrics, self.progress, t0, spec.schedules[0].num_minibatches,
                                     self.epochs)
        else:
            part = build_shard(spec, role.shard, transport, pool, trace=trace, t0=t0)
        # A shard idles legitimately while stages compute; it waits twice as long, so that a stuck
        # peer is reported by the stage that waits on it directly.
        limit = self.timeout if role.kind == "stage" else 2 * self.timeout
        drive(part, limit, f"hetpipe: {role.describe()}", reporter.update if reporter else None)
        elapsed = time.perf_counter() - t0
        transport.close()
        mine = {**part_outcome(part, plan, spec.layout), "elapsed": elapsed, "trace": trace or []}
        everyone = comm.allgather(mine)
        if self.record_path is not None and role.rank == 0:
            RunRecord.of_run(spec, merge_outcomes(everyone)).save(self.record_path)
        outcome = merge_outcomes(everyone)
        result = TrainResult(plan, role.rank, role.describe(), outcome.losses, outcome.weights, outcome.shard_logs,
                             max(m["elapsed"] for m in everyone), outcome.samples,
                             [e for m in everyone for e in m["trace"]], emulated, outcome.buffers)
        load_layer_weights(self.layers, result.weights, result.buffers)
        if reporter is not None:
            reporter.finish(result, self.trace_path)
        return result


class _Reporter:
    """Progress bar and metrics file, on the last stage of VW 0 (the rank that sees VW 0's losses).

    Per completed wave: one JSON line ``{"event": "wave", ...}``; at the end per epoch and a summary."""

    def __init__(self, ex: StageExecutor, plan: Plan, metrics: Optional[Path], progress: bool, t0: float,
                 total: int, epochs: int) -> None:
        self.ex, self.plan, self.t0, self.total, self.epochs = ex, plan, t0, total, epochs
        self.file = None
        if metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(metrics, "w")
        self.bar = None
        if progress:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="hetpipe VW 0", unit="mb", dynamic_ncols=True, mininterval=0.5)
        self.seen = 0
        self.wave = 0
        self.samples = 0

    def update(self) -> None:
        losses = self.ex.losses
        while self.seen in losses:
            self.samples += self.ex.batch_sizes.get(self.seen, 0)
            self.seen += 1
            if self.bar is not None:
                self.bar.update(1)
        nm = self.plan.nm
        while (self.wave + 1) * nm <= self.seen or (self.seen == self.total and self.wave * nm < self.total):
            mbs = range(self.wave * nm, min((self.wave + 1) * nm, self.total))
            loss = float(np.mean([losses[p] for p in mbs]))
            now = time.perf_counter() - self.t0
            rate = self.samples * len(self.plan.virtual_workers) / now if now > 0 else 0.0
            if self.file is not None:
                self.file.write(json.dumps({"event": "wave", "vw": 0, "wave": self.wave, "loss": loss,
                                            "time_s": now, "samples_per_s_est": rate,
                                            "global_clock": self.ex.global_clock}) + "\n")
                self.file.flush()
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}", clock=self.ex.global_clock,
                                     refresh=False)
            self.wave += 1

    def finish(self, result: TrainResult, trace_path: Optional[Path]) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            per_vw = {vw: sorted(l.items()) for vw, l in result.losses.items()}
            epochs = max(1, self.epochs)
            n = len(next(iter(per_vw.values()))) if per_vw else 0
            per_epoch = max(1, n // epochs)
            for e in range(epochs):
                by_vw = {str(vw): float(np.mean([v for p, v in items if p // per_epoch == e]))
                         for vw, items in per_vw.items()}
                self.file.write(json.dumps({"event": "epoch", "epoch": e, "loss": float(np.mean(list(by_vw.values()))),
                                            "loss_by_vw": by_vw}) + "\n")
            clocks = {str(k): [c for c in log.clocks[-len(self.plan.virtual_workers):]]
                      for k, log in result.shard_logs.items()}
            self.file.write(json.dumps({"event": "summary", "samples": result.samples, "elapsed_s": result.elapsed_s,
                                        "samples_per_s": result.samples_per_s, "emulated_devices": result.emulated,
                                        "nm": self.plan.nm, "d": self.plan.d, "final_clocks": clocks}) + "\n")
            self.file.close()
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            write_chrome_trace(result.trace, trace_path, emulated=result.emulated)
