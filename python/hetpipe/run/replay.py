"""Single-process replay: every stage of every VW and every PS shard, stepped in one process.

The reference for the multi-process runtime: the same executor and PS code, connected by a loopback
transport and stepped round-robin in rank order (each part runs until it blocks). Per-stage
instruction order is the schedule's, so with ``D = 0`` the numbers equal a real run's bitwise. With
``D >= 1`` the version of the global weights each pull gets depends on timing: given the run's
record (:mod:`hetpipe.run.record`) every shard gives each pull the recorded version and applies
pushes in the recorded order, so the numbers equal that run's bitwise; without it, they are those of
one timing (this loop's), not of any particular run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from hetpipe.loader.check import compare
from hetpipe.ps.shard import ShardLog, ShardState
from hetpipe.run.build import build_shard, build_stage, data_reading, shard_pool, stage_pool
from hetpipe.run.record import RunRecord, ShardScript
from hetpipe.run.spec import RunSpec, Steppable, merge_outcomes, part_outcome
from hetpipe.stage.executor import StageExecutor
from hetpipe.transport import registry as transports
from hetpipe.transport.loopback import LoopbackHub
from hetpipe.transport.registry import LoopbackPort
from hetpipe.util.errors import HetpipeError


class ReplayDeadlock(HetpipeError, RuntimeError):
    """No part of the replay can make progress, yet not all have finished."""


@dataclass
class ReplayResult:
    losses: Dict[int, Dict[int, float]]                 # vw -> minibatch -> loss
    weights: Dict[int, np.ndarray]                      # layer -> final global weights (flat float32)
    shard_logs: Dict[int, ShardLog]
    buffers: Dict[int, np.ndarray] = field(default_factory=dict)     # layer -> final synced buffers (float32)
    # Replaying a record: whether the losses and final weights are bitwise the recorded run's (None without a
    # record, or with one that holds no outcome digests: a simulated one).
    reproduced: Optional[bool] = None
    # Buffers the PS does not synchronise (num_batches_tracked, ...), VW 0's, by "layer.name".
    local_buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    evals: List[Dict[str, Any]] = field(default_factory=list)          # VW 0's evaluation points
    stopped_after: Optional[int] = None                                 # an early stop's last wave
    loss_scale: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # "fp16": vw -> final scale, skips


def _endpoint(hub: LoopbackHub, rank: int, pool):
    """``rank``'s endpoint on ``hub``, opened through the transport registry (the loopback backend)."""
    port = LoopbackPort(hub, rank)
    backend, _ = transports.choose([], port)
    return backend.open(port, pool, None)


def replay_run(spec: RunSpec, record: Optional[RunRecord] = None, reporter: Any = None,
               on_applied: Optional[Callable[[ShardState], None]] = None) -> ReplayResult:
    """Run ``spec`` to the end in this process (no padding, no MPI), following ``record`` if given;
    ``reporter`` (:class:`hetpipe.run.report.Reporter`) follows VW 0's last stage as in a run;
    ``on_applied(state)`` is called each time a shard has applied a wave (``state.W`` is then the
    global ``W_g`` of its layers, ``g = state.applied``)."""
    if record is not None:
        record.check(spec)
    hub = LoopbackHub()
    plan = spec.plan
    scripted: List[ShardState] = []
    parts: List[Tuple[str, Steppable]] = []
    for vw in plan.virtual_workers:
        for s in range(len(vw.stages)):
            pool = stage_pool(spec, vw.index, s)
            endpoint = _endpoint(hub, plan.rank_of(vw.index, s), pool)
            watched = reporter is not None and vw.index == 0 and s == len(vw.stages) - 1
            part = build_stage(spec, vw.index, s, endpoint, pool, decide=reporter.evaluated if watched else None)
            if watched:
                reporter.attach(part, time.perf_counter())
            parts.append((f"VW {vw.index} stage {s}", part))
    for sh in plan.ps_shards:
        pool = shard_pool(spec, sh.index)
        endpoint = _endpoint(hub, plan.ps_rank(sh.index), pool)
        server = build_shard(spec, sh.index, endpoint, pool)
        if record is not None:
            server.state.gate = ShardScript(record.shards[sh.index], server.state, record.where)
            scripted.append(server.state)
        if on_applied is not None:
            server.state.on_applied = lambda _, state=server.state: on_applied(state)
        parts.append((f"PS shard {sh.index}", server))
    compare([data_reading(spec, part, name) for name, part in parts])
    while not all(p.finished for _, p in parts):
        progressed = False
        for _, part in parts:
            if not part.finished and part.step():
                progressed = True
        if reporter is not None and progressed:
            reporter.update()
        if not progressed and not any(isinstance(p, StageExecutor) and p.wait_for_copies() for _, p in parts):
            stuck = "; ".join(f"{name} waits for {p.blocked_on}" for name, p in parts if not p.finished)
            raise ReplayDeadlock(f"replay: no progress possible: {stuck}")
    for state in scripted:
        state.gate.check_done(state)
    outcome = merge_outcomes(part_outcome(part, plan, spec.layout) for _, part in parts)
    # A record without outcome digests (synthesised, not written by a run) has nothing to compare with.
    reproduced = None
    if record is not None and record.outcome:
        reproduced = record.matches(outcome.losses, outcome.weights)
    return ReplayResult(outcome.losses, outcome.weights, outcome.shard_logs, outcome.buffers, reproduced,
                        outcome.local_buffers, outcome.evals, outcome.stopped_after, outcome.loss_scale)
