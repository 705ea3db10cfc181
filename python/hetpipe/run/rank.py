"""One rank's part of a multi-process run: the plan from rank 0, this rank's role (a stage or a PS
shard), its transport, data check, checkpoints and reporter, the stepping loop, and the result every
rank receives. The Trainer (:mod:`hetpipe.run.trainer`) is the user API; this is what its ``fit`` runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hetpipe.checkpoint import format as ckfmt
from hetpipe.job import failure
from hetpipe.job.roles import LaunchError, Role, check_world, resolve_device, role_of
from hetpipe.job.placement import launcher_placement, placement_problems, plan_problems
from hetpipe.job.rundir import RUN_DIR_ENV, WORLD_RANKS_FILE, mark_phase, register_rank
from hetpipe.job.world import gather_hosts
from hetpipe.loader.check import DataMismatch, compare
from hetpipe.model.fingerprint import first_difference, layer_digests
from hetpipe.model.weights import load_layer_weights
from hetpipe.util.outputs import check_file
from hetpipe.plan.types import Plan
from hetpipe.ps.core_plane import choose_plane
from hetpipe.run.checkpoints import RunCheckpoints
from hetpipe.run.config import RunConfig, as_path
from hetpipe.run.explain import update_rule
from hetpipe.run.build import (build_shard, build_stage, data_reading, say_dropped, shard_pool, stage_pairs,
                              stage_pool)
from hetpipe.transport.drive import drive
from hetpipe.run.record import RunRecord
from hetpipe.run.result import TrainResult, resumed_losses, stopped_of
from hetpipe.run.spec import RunSpec, merge_outcomes, part_outcome
from hetpipe.run.workload import Workload, given_plan, resolve_plan, run_spec
from hetpipe.run.workload import reporter as make_reporter
from hetpipe.run.world_plan import on_world, plan_on_world
from hetpipe.schedule.trace import TraceEvent
from hetpipe.transport import registry as transports


class RankRun:
    """The run of ``work`` under ``config`` on this rank; ``describe`` names the rank (its role once known)
    for failures. ``checkpoints``: the run's checkpoint settings and state (:mod:`hetpipe.run.checkpoints`)."""

    def __init__(self, work: Workload, config: RunConfig, checkpoints: RunCheckpoints, rank: int) -> None:
        self.work, self.config, self.checkpoints = work, config, checkpoints
        self.planning: Optional[Dict[str, Any]] = None     # the inputs of a plan made in this run
        self.describe = f"rank {rank}"
        self.order: List[int] = []          # the world rank of each plan rank (empty: the same)
        self.emulated_world = False         # the world's devices were discovered as emulated types
        self.hosts: List[str] = []          # the host of each plan rank
        self.part: Any = None               # this rank's stage executor or shard server, once built
        self.clock0 = 0                     # the clock the run resumed from

    def run(self, comm, rank: int, size: int) -> TrainResult:
        """Plan on rank 0, take this rank's role, train, gather the result (see :meth:`Trainer.fit`).

        On a world planned from its own devices (:mod:`hetpipe.run.world_plan`) the ranks are first
        renumbered in plan order (``comm.Split``), so that the rank holding each stage's device runs it.
        Each phase is recorded in the run directory (``job.rundir.mark_phase``): outside "training" the
        launcher ends a rank that makes no progress (``launch.supervisor``)."""
        mark_phase("start-up: planning")
        hosts = gather_hosts(comm)
        problems = placement_problems([h["host"] for h in hosts], launcher_placement())
        if problems:
            raise LaunchError("hetpipe: " + "; ".join(problems))
        emulating = any(h["emulate"] for h in hosts)
        cluster = self.config.planning.cluster
        world = cluster == "auto" or on_world(cluster, emulating)
        given = given_plan(self.work, self.config) if world else None
        if cluster == "auto" or (world and given is None):
            plan, self.order, discovery, self.planning = plan_on_world(self.work, self.config, comm, given)
            self.emulated_world = discovery.cluster.emulated
            world_rank = rank
            rank = self.order.index(world_rank)
            comm = comm.Split(0, rank)
            failure.set_world_ranks(self.order)
            hosts = [hosts[w] for w in self.order]
            return self._run_plan(comm, rank, size, hosts, plan.to_json(), None, world_rank)
        plan_text, error = None, None
        if rank == 0:
            try:
                record = self.config.record_path
                if record is not None:
                    record.parent.mkdir(parents=True, exist_ok=True)
                    check_file("record", record)
                plan, self.planning = resolve_plan(self.work, self.config)
                plan_text = plan.to_json()
            except Exception as e:  # noqa: BLE001 - relayed to every rank below
                error = f"planning on rank 0 failed: {type(e).__name__}: {e}"
        return self._run_plan(comm, rank, size, hosts, plan_text, error, rank)

    def _role(self, plan: Plan, rank: int) -> Role:
        host = self.hosts[rank] if len(set(self.hosts)) > 1 else ""
        return role_of(plan, rank, self.order[rank] if self.order else rank, host)

    def _run_plan(self, comm, rank: int, size: int, hosts: List[Any], plan_text: Optional[str],
                  error: Optional[str], world_rank: int) -> TrainResult:
        # The run's identity (checkpoint ownership): rank 0's; a resumed run takes its checkpoint's.
        # A restart from the start continues its failed predecessor's run (the run file's run_id), whose
        # incomplete checkpoints are then this run's own, not another run's that would stop it at start-up.
        drawn = (self.config.run_id or uuid.uuid4().hex[:16]) if rank == 0 else None
        mark_phase("start-up: receiving the plan")
        plan_text, error, run_id = comm.bcast((plan_text, error, drawn), root=0)
        mark_phase("start-up: building this rank's part")
        self.checkpoints.run_id = run_id
        if error:
            raise LaunchError(f"hetpipe: {error}")
        plan = Plan.from_json(plan_text)
        if rank == 0 and self.config.plan_source == "restart":
            sys.stderr.write("hetpipe: the restarting launcher's plan replaces the script's plan= "
                             f"({self.config.plan})\n")
        on_plan = self.config.planning.on_plan
        if on_plan is not None and rank == 0:
            on_plan(plan)
        if rank == 0 and os.environ.get(RUN_DIR_ENV):
            # For a restarting launcher: which device each rank ran, and where the checkpoints are.
            plan.save(Path(os.environ[RUN_DIR_ENV], "plan.json"))
            if self.order:
                # The world rank of each plan rank: a restarting launcher names failed ranks by world rank.
                Path(os.environ[RUN_DIR_ENV], WORLD_RANKS_FILE).write_text(json.dumps(self.order) + "\n")
            if self.planning is not None:
                Path(os.environ[RUN_DIR_ENV], "planning.json").write_text(json.dumps(self.planning))
            if self.checkpoints.directory is not None:
                Path(os.environ[RUN_DIR_ENV], "checkpoints.txt").write_text(f"{self.checkpoints.directory.resolve()}\n")
        check_world(plan, size)
        self.hosts = [h["host"] for h in hosts]
        if not self.order:
            # Ranks in plan order by number: in a world of several hosts each must sit on its part's node.
            problems = plan_problems(plan, self.hosts, lambda r: self._role(plan, r).describe())
            if problems:
                raise LaunchError("hetpipe: " + "; ".join(problems))
        role = self._role(plan, rank)
        self.describe = role.describe()
        register_rank(world_rank, self.describe)
        spec, problem = None, None
        try:
            spec = run_spec(self.work, self.config, plan, self.checkpoints.resume(plan))
            self.checkpoints.claim()
            if role.kind == "stage":
                st = plan.virtual_workers[role.vw].stages[role.stage]
                dev, emulated = resolve_device(st, emulate=True if self.emulated_world else self.config.runtime.emulate,
                                              cuda_count=hosts[rank]["cuda_count"])
                spec.devices[rank], spec.emulated[rank] = dev, emulated
                spec.emulation_scale = self.config.runtime.emulation_scale
        except (LaunchError, ValueError, TypeError, ckfmt.CheckpointError) as e:
            problem = f"{role.describe()}: {e}"
        problems = [p for p in comm.allgather(problem) if p]
        if problems:
            raise LaunchError("; ".join(problems))
        if self.order or len(set(self.hosts)) > 1:
            spec.rank_names = {r: _name(self._role(plan, r)) for r in range(size)}
        if rank == 0:
            self.checkpoints.discard_newer(spec.resume.checkpoint.clock if spec.resume is not None else 0)
            sys.stderr.write(update_rule(plan, spec.sample_batch, self.config.numerics.accumulate) + "\n")
            say_dropped(spec)
        if rank == 0 and os.environ.get(RUN_DIR_ENV) and spec.resume is not None:
            # Where this attempt really resumed: the checkpoint it loaded after verification and any
            # fallback, which may be older than the latest complete one. Renamed into place, so that a
            # reader polling the run directory never sees half of it.
            found, tmp = spec.resume.checkpoint, Path(os.environ[RUN_DIR_ENV], ".resumed.json.tmp")
            tmp.write_text(json.dumps({"path": str(found.path), "clock": found.clock,
                                       "same_plan": spec.resume.same_plan}) + "\n")
            os.replace(tmp, tmp.with_name("resumed.json"))
        emulated_any = any(comm.allgather(spec.emulated.get(rank, False)))
        return self._run_role(comm, plan, spec, role, emulated_any)

    def _run_role(self, comm, plan: Plan, spec: RunSpec, role: Role, emulated: bool) -> TrainResult:
        trace_path = as_path(self.config.reporting.trace)
        trace: Optional[List[TraceEvent]] = [] if trace_path else None
        if role.kind == "stage":
            device = spec.devices[role.rank]
            if device.type == "cuda":
                torch.cuda.set_device(device)    # before this rank's first CUDA call: nothing lands on GPU 0
            pool = stage_pool(spec, role.vw, role.stage)
            plane, plane_reason = "", ""
        else:
            plane, plane_reason = choose_plane(comm)
            pool = shard_pool(spec, role.shard, plane)
        mark_phase("start-up: opening the transport")
        try:
            opened = transports.open_rank(comm, pool, device if role.kind == "stage" else None, stage_pairs(spec),
                                          forced=self.config.runtime.transport,
                                          timeout_s=self.config.timeout_s, who=role.describe())
        except transports.TransportChoiceError as e:
            raise LaunchError(str(e)) from None
        transport, reason = opened.transport, opened.reason
        comm.Barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        reporter = None
        if role.kind == "stage":
            if role.vw == 0 and role.stage == len(plan.virtual_workers[0].stages) - 1:
                reporter = make_reporter(self.config, plan, spec)
            part = build_stage(spec, role.vw, role.stage, transport, pool, trace=trace, t0=t0,
                               decide=reporter.evaluated if reporter is not None else None)
            if reporter is not None:
                reporter.attach(part, t0)
        else:
            part = build_shard(spec, role.shard, transport, pool, trace=trace, t0=t0,
                               comm=comm if plane == "core" else None)
        self.part, self.clock0 = part, spec.resume.checkpoint.clock if spec.resume is not None else 0
        mark_phase("start-up: checking the weights and data agree")
        self._check_agreement(comm, spec, part, role)
        writer = self.checkpoints.checkpointer(plan, spec, role, part, reporter)
        previous = self.checkpoints.on_sigterm(writer, lambda: self.describe, self.config.timeout_s)
        # A shard idles legitimately while stages compute; it waits twice as long, so that a stuck
        # peer is reported by the stage that waits on it directly.
        limit = self.config.timeout_s if role.kind == "stage" else 2 * self.config.timeout_s
        mark_phase("training")
        try:
            drive(part, limit, f"hetpipe: {role.describe()}", reporter.update if reporter else None)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if writer is not None:
            # The run's final checkpoint: every rank's part of its last clock (see Checkpointer.close). Its
            # wait for the peers' parts is bounded by the run's timeout, as training's waits are.
            writer.close(final=True, wait_s=self.config.timeout_s)
        mark_phase("shutdown: gathering the result")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        transport.close()
        mine = {**part_outcome(part, plan, spec.layout), "elapsed": elapsed, "cpu": cpu, "trace": trace or [],
                "transport": opened.name, "ps_plane": (plane, plane_reason)}
        everyone = comm.allgather(mine)
        if self.config.record_path is not None and role.rank == 0:
            RunRecord.of_run(spec, merge_outcomes(everyone)).save(self.config.record_path)
        outcome = merge_outcomes(everyone)
        losses, resumed = outcome.losses, {}
        if spec.resume is not None:
            losses = resumed_losses(outcome.losses, spec.resume)
            resumed = {"path": str(spec.resume.checkpoint.path), "clock": spec.resume.checkpoint.clock,
                       "same_plan": spec.resume.same_plan, "losses": spec.resume.checkpoint.losses()}
        asked = comm.allgather(reporter.callbacks.stop_asked if reporter is not None else None)
        result = TrainResult(
            plan=plan, rank=role.rank, role=role.describe(), losses=losses, weights=outcome.weights,
            shard_logs=outcome.shard_logs, elapsed_s=max(m["elapsed"] for m in everyone), samples=outcome.samples,
            trace=[e for m in everyone for e in m["trace"]], emulated=emulated, buffers=outcome.buffers,
            resumed=resumed, transport="+".join(sorted({m["transport"] for m in everyone})),
            local_buffers=outcome.local_buffers,
            ps_plane="+".join(sorted({m["ps_plane"][0] for m in everyone} - {""})),
            ps_plane_reason="; ".join(sorted({m["ps_plane"][1] for m in everyone} - {""})),
            evals=outcome.evals, stopped=stopped_of(outcome, asked), loss_scale=outcome.loss_scale,
            cpu_s=[m["cpu"] for m in everyone])
        load_layer_weights(self.work.layers, result.weights, result.buffers, result.local_buffers)
        if reporter is not None:
            reporter.finish(result, trace_path, reason)
        mark_phase("done")
        return result


    def interruption(self) -> str:
        """The line a Ctrl-C of the run prints: how far this rank got (the waves it pushed, or its shard
        applied) and the last complete checkpoint on disk."""
        part, where = self.part, " before training started"
        if part is not None:
            ledger = getattr(getattr(part, "model", None), "ledger", None)
            done = len(ledger.pushed) if ledger is not None else getattr(getattr(part, "state", None), "applied", 0)
            where = f" at wave {self.clock0 + done}"
        directory = self.checkpoints.directory
        if directory is None:
            return f"hetpipe: interrupted (SIGINT){where}; the run writes no checkpoints"
        found = ckfmt.latest(directory)
        return f"hetpipe: interrupted (SIGINT){where}; " + (f"last complete checkpoint: {found}" if found is not None
                                                            else f"no complete checkpoint in {directory} yet")

    def _check_agreement(self, comm, spec: RunSpec, part, role: Role) -> None:
        """Every rank holds the same initial weights of the layers it holds (model.fingerprint) and reads
        the same data (loader.check); a mismatch is one verdict on every rank, before training."""
        plan = spec.plan
        if role.kind == "stage":
            st = plan.virtual_workers[role.vw].stages[role.stage]
            held = range(st.start, st.stop)
        else:
            held = plan.ps_shards[role.shard].layers
        mine, digests, problem = None, layer_digests(spec.layout, held), None
        try:
            mine = data_reading(spec, part, role.describe())
        except Exception as e:  # noqa: BLE001 - relayed to every rank below
            problem = f"{role.describe()}: reading the first minibatches failed: {type(e).__name__}: {e}"
        everyone = comm.allgather((mine, digests, problem))
        problems = [p for _, _, p in everyone if p]
        if problems:
            raise LaunchError("hetpipe: " + "; ".join(problems))
        who = [self._role(plan, r).describe() for r in range(len(everyone))]
        differ = first_difference(list(zip(who, (d for _, d, _ in everyone))), plan.layer_names or None)
        if differ:
            raise LaunchError(differ)
        try:
            compare([r for r, _, _ in everyone])
        except DataMismatch as e:
            raise LaunchError(str(e)) from None


def _name(role: Role) -> str:
    """``rank W on host H``: how a peer is named in a world renumbered in plan order or of several hosts."""
    who = role.rank if role.world < 0 else role.world
    return f"rank {who}" + (f" on {role.host}" if role.host else "")
