"""A run's checkpoints: what it resumes from, each checkpoint's manifest, each rank's snapshot at its
wave boundaries, and SIGTERM (docs/design.md, "Checkpoints and restart"). The format on disk and the
writer are :mod:`hetpipe.checkpoint`; this module decides what a run of hetpipe puts in them."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from hetpipe.checkpoint import format as ckfmt
from hetpipe.checkpoint import state as ckpt
from hetpipe.job import failure
from hetpipe.job.roles import LaunchError, Role
from hetpipe.job.rundir import RUN_DIR_ENV, launcher_ending, launcher_interrupting, mark_terminated
from hetpipe.model.layout import ModelLayout, local_buffers
from hetpipe.model.weights import load_layer_weights
from hetpipe.plan.types import Plan
from hetpipe.plan.waves import deal_for
from hetpipe.run.callbacks import run_steps
from hetpipe.run.spec import RunSpec
from hetpipe.schedule.messages import eval_waves
from hetpipe.stage.executor import StageExecutor
from hetpipe.util.errors import ArgumentError

# How long a SIGTERM'd rank waits for a clock it holds to complete before concluding that the signal
# reached it alone (see RunCheckpoints.on_sigterm); its peers, blocked on it meanwhile, must not time out.
TERM_SETTLE_S = 2.0


@dataclass
class RunCheckpoints:
    """The checkpoint settings of a Trainer, and what a run does with them.

    directory / every: where and every how many waves (None: no checkpoints); resume_from: the
    checkpoint (directory) the run resumes from, or None; keep_on_sigterm: keep the last D + 2 wave
    boundaries' snapshots so that SIGTERM writes the newest clock every rank holds; keep_last: how many
    complete checkpoints of the run stay on disk; resume_fallback: resume from the previous complete
    checkpoint when the latest fails verification. run_id: the run's identity in every manifest (set
    at start-up: rank 0's, or the resumed checkpoint's, so that a resumed run continues its run)."""

    layers: List[nn.Module]
    data: Any
    epochs: int
    seed: int
    split_startup: int
    names: Dict[str, Any]
    directory: Optional[Path]
    every: int
    resume_from: Optional[Path]
    keep_on_sigterm: bool
    keep_last: int = 1
    resume_fallback: bool = False
    run_id: str = ""
    # Checkpointing.every_steps and the run's accumulation: ``every`` is set from them, in waves, once
    # the plan is known (:meth:`checkpointer`). None: ``every`` stands as given.
    every_steps: Optional[int] = None
    accumulate: int = 1

    @classmethod
    def of(cls, work: Any, config: Any) -> "RunCheckpoints":
        """The checkpoints of a run of ``work`` (a :class:`~hetpipe.run.workload.Workload`) under
        ``config`` (a resolved :class:`~hetpipe.run.config.RunConfig`)."""
        c = config.checkpointing
        if c.resume and not Path(c.resume).exists():
            raise ArgumentError(f"hetpipe: checkpointing.resume {str(c.resume)!r} does not exist (give a checkpoint "
                                "directory, or one checkpoint of it)")
        return cls(work.layers, work.data, config.epochs, config.numerics.seed, config.planning.split_startup,
                   work.names, Path(c.dir) if c.dir else None, config.checkpoint_every,
                   Path(c.resume) if c.resume else None, c.on_sigterm, c.keep, bool(c.fallback),
                   every_steps=c.every_steps, accumulate=config.numerics.accumulate)

    def waves_between(self, plan: Plan) -> int:
        """Waves between checkpoints on ``plan``: ``every``, or ``every_steps`` of the run's optimizer steps
        (:func:`~hetpipe.run.callbacks.run_steps`) rounded to whole waves, at least one."""
        if self.every_steps is None:
            return self.every
        per_wave = run_steps(0, plan.minibatches_per_wave, self.accumulate)
        return max(1, round(self.every_steps / max(1, per_wave)))

    def resume(self, plan: Plan) -> Optional[ckpt.Resume]:
        """What this run resumes from (None: from the start); loads the global weights into the model."""
        if self.resume_from is None:
            return None
        found = ckpt.Checkpoint.find(self.resume_from, fallback=self.resume_fallback)
        self.run_id = str(found.manifest.get("run_id") or self.run_id)
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
        q = int(data["minibatches_per_vw"])             # per slot of the deal (per VW with equal waves)
        same = same_layout(old, plan)
        split = int(found.manifest.get("split_startup", 0))
        deal = deal_for(plan.wave_minibatches)
        return ckpt.Resume(found, same, ckfmt.DataPosition(**data["position"]), q + min(split, q) if same else 0,
                           q if same else 0, () if deal.equal or not same else deal.shares, split if same else 0)

    def manifest(self, plan: Plan, spec: RunSpec, clock: int) -> Dict[str, Any]:
        """The manifest of the checkpoint at ``clock`` (identical on every rank)."""
        resume = spec.resume
        clock0 = resume.checkpoint.clock if resume is not None else 0
        start = resume.start if resume is not None else ckfmt.DataPosition()
        # Counted per slot of the deal (docs/design.md, "Waves of unequal length"): a wave is gcd(waves)
        # minibatches of every slot; with equal waves a slot is a VW and a wave Nm minibatches of it.
        deal = deal_for(plan.wave_minibatches)
        total = spec.schedules[0].num_minibatches // deal.shares[0]
        k = min(total, (clock - clock0) * deal.per_slot)
        per_epoch = self.data.minibatches_per_epoch(deal.num_slots)
        pos = start.advance(k, per_epoch, deal.num_slots)
        return {"format": ckfmt.FORMAT, "run_id": self.run_id, "clock": clock, "plan": plan.to_dict(),
                "parts": [ckfmt.part_name(r) for r in range(plan.num_ranks)],
                "data": {"position": {"epoch": pos.epoch, "index": pos.index},
                         "minibatches_per_vw": (resume.minibatches if resume is not None else 0) + k,
                         "minibatches_per_epoch": per_epoch, "epochs": self.epochs,
                         "segments": self.segments(plan, resume, clock0, per_epoch)},
                "rng": {"seed": self.seed, "rule": "micro-batch j of stage s of VW v draws from a generator "
                                                  "seeded by (seed, v, s, j); no other random state"},
                "split_startup": self.split_startup, "checkpoint_every": self.every,
                "names": self.names,
                "resumed_from": {"path": str(resume.checkpoint.path), "clock": clock0} if resume else None}

    def segments(self, plan: Plan, resume: Optional[ckpt.Resume], clock0: int, per_epoch: int) -> List[Dict[str, Any]]:
        """The run's stretches up to this one (:func:`~hetpipe.checkpoint.format.segment`), from which a
        resume checks the data position a manifest records (:func:`~hetpipe.checkpoint.format.check_data`):
        the resumed checkpoint's, then this run's, which began at ``clock0``."""
        same = resume.same_plan if resume is not None else False
        # A stretch counts slots of the deal, each training gcd(waves) minibatches a wave (VWs and Nm with
        # equal waves), so that its arithmetic is the round-robin one.
        deal = deal_for(plan.wave_minibatches)
        if resume is None:
            before: List[Dict[str, Any]] = []
        elif "segments" in resume.checkpoint.manifest["data"]:
            before = list(resume.checkpoint.manifest["data"]["segments"])
        else:
            # A checkpoint written before stretches were recorded: this run's history starts at its cut.
            start = {"epoch": resume.start.epoch, "index": resume.start.index, "minibatches_per_vw": resume.minibatches}
            return [ckfmt.segment(clock0, deal.num_slots, deal.per_slot, per_epoch, self.epochs, same, start)]
        return before + [ckfmt.segment(clock0, deal.num_slots, deal.per_slot, per_epoch, self.epochs, same)]

    def claim(self) -> None:
        """Refuse a checkpoint directory that holds another run's checkpoints (call after :meth:`resume`):
        a run never deletes from, nor mixes its clocks with, a run it does not continue."""
        if self.directory is None:
            return
        others = {rid: clocks for rid, clocks in ckfmt.run_ids(self.directory).items() if rid != self.run_id}
        if others:
            what = "; ".join(f"run {rid or '(no id)'}: clock(s) {clocks[0]}..{clocks[-1]}" for rid, clocks in
                             sorted(others.items()))
            raise LaunchError(f"hetpipe: the checkpoint directory {self.directory} holds checkpoints of another run "
                              f"({what}): resume it (resume= / --resume {self.directory}) to continue that run, or "
                              "give this run a directory of its own")

    def discard_newer(self, clock: int) -> None:
        """Remove this run's checkpoints (complete or not) of clocks after ``clock``, the cut this run goes
        on from (0: the start). They are left by an attempt that failed after that cut (a part written
        halfway, a disk that filled up, a checkpoint that failed verification), and this run writes those
        clocks again: left in place, a rank writing clock c into the old directory kept the old manifest
        (so its part never verified against it), and the old parts made the clock look complete before
        every rank of this run had written its own. Also removes the incomplete checkpoints a killed run
        left before the cut (:func:`~hetpipe.checkpoint.state.remove_incomplete`), and says in one line
        what went. Called on rank 0 before the start-up barrier, which every rank passes before it writes
        a checkpoint; another run's checkpoints are never touched."""
        if self.directory is None or not self.directory.is_dir():
            return
        removed = []
        for path in sorted(self.directory.glob("clock-*")):
            if ckpt.clock_of(path) > clock and ckpt.run_of(path) == self.run_id:
                if not ckfmt.is_complete(path):
                    removed.append(path.name)
                shutil.rmtree(path, ignore_errors=True)
        removed += [p.name for p in ckpt.remove_incomplete(self.directory, self.run_id, clock)]
        if removed:
            sys.stderr.write(f"hetpipe: removed {len(removed)} incomplete checkpoint(s) that a run which ended "
                             f"mid-write left in {self.directory}: {', '.join(sorted(removed))}\n")

    def checkpointer(self, plan: Plan, spec: RunSpec, role: Role, part, reporter: Any = None
                     ) -> Optional[ckpt.Checkpointer]:
        """This rank's checkpointer, hooked to its part's wave boundaries (None: no checkpoints).
        ``reporter``: this rank's (VW 0's last stage), whose callbacks' state its parts hold."""
        if self.directory is None:
            return None
        self.every = self.waves_between(plan)
        if role.kind == "stage" and part.model.scheduler is not None:
            # A scheduler whose state a checkpoint cannot hold is refused at start-up, not at the first checkpoint.
            ckpt.scheduler_snapshot(part.model.scheduler)
        run_dir = os.environ.get(RUN_DIR_ENV)
        progress = Path(run_dir, f"clock-of-rank-{role.rank}") if run_dir else None
        writer = ckpt.Checkpointer(self.directory, self.every, role.rank,
                                   lambda clock: self.manifest(plan, spec, clock),
                                   keep=plan.d + 2 if self.keep_on_sigterm else 0,
                                   progress=progress, run_id=self.run_id, keep_last=self.keep_last)
        clock0 = spec.resume.checkpoint.clock if spec.resume is not None else 0
        if role.kind == "stage":
            def capture() -> ckpt.Snapshot:
                return self.stage_snapshot(plan, spec, part, role, reporter)

            evals = set(eval_waves(spec.schedules[0], spec.eval_every or 0, clock0)) if reporter is not None else set()

            def pushed(clock: int) -> None:
                if clock - 1 in evals:
                    # VW 0 evaluates right after this Push, with no step between: the boundary is taken
                    # once the callbacks have decided, so that their state in it holds that evaluation.
                    reporter.after_eval[clock - 1] = lambda: writer.boundary(clock0 + clock, capture)
                else:
                    writer.boundary(clock0 + clock, capture)

            part.model.ledger.on_pushed = pushed
        else:
            state = part.state
            state.on_applied = lambda applied: writer.boundary(clock0 + applied,
                                                               lambda: self.shard_snapshot(state, role, clock0))
        return writer

    def stage_snapshot(self, plan: Plan, spec: RunSpec, ex: StageExecutor, role: Role, reporter: Any = None
                       ) -> ckpt.Snapshot:
        model = ex.model
        tensors, opt = ckpt.optimizer_snapshot(model.optimizer, model.params, model.param_names)
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
        if reporter is not None:
            part["callbacks"] = reporter.callbacks.state()
        if ex.is_last:
            resume = spec.resume
            q0 = resume.minibatches_of(role.vw) if resume is not None else 0
            before = resume.checkpoint.losses().get(role.vw, {}) if resume is not None and resume.same_plan else {}
            part["losses"] = {**{str(p): v for p, v in before.items()},
                              **{str(q0 + p): v for p, v in ex.losses.items()}}
        return tensors, part

    @staticmethod
    def shard_snapshot(state, role: Role, clock0: int) -> ckpt.Snapshot:
        tensors = {}
        counts = state.outer_counts()
        for l in state.layers:
            for kind, values in (("w", state.W), ("b", state.B), ("m", state.M), ("a", state.A)):
                if values[l].size:
                    tensors[f"{kind}/{l}"] = torch.from_numpy(values[l].copy())
            if state.A[l].size:                 # delayed-nesterov: the pushes a/<layer> holds
                tensors[f"n/{l}"] = torch.tensor([counts[l]], dtype=torch.int64)
        clocks = [clock0 + int(state.clock.clock(v)) for v in range(state.num_vws)]
        return tensors, {"role": "ps", "shard": role.shard, "clocks": clocks, "applied": clock0 + state.applied}

    def on_sigterm(self, writer: Optional[ckpt.Checkpointer], describe: Callable[[], str],
                   timeout_s: float = failure.DEFAULT_TIMEOUT_S):
        """On SIGTERM, write the kept wave-boundary snapshots not yet on disk, wait until a clock this
        rank holds is complete (every rank's part; at most ``HETPIPE_TERM_GRACE``), say which clocks it
        wrote and mark the run directory (``terminated-PID``: the launcher restarts a run one of whose ranks
        was stopped so, with the same devices) unless its launcher was interrupted and says it for the run,
        then exit 128 + 15; returns the previous handler (None: nothing installed). A run without
        checkpoints (``writer`` None) says and marks the same, having nothing to write: the launcher then
        knows the rank ended on a SIGTERM from outside, not of a fault.

        A SIGTERM that reached this rank alone (none of its clocks completes within ``TERM_SETTLE_S``, at
        most a quarter of the peer timeout ``timeout_s``: its peers did not write the clocks it holds) does
        not end it there, which would make its peers time out and lose the checkpoint being written: the
        rank trains on to the next due clock, which every rank writes, and ends once that is complete."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def finish(what: str) -> None:
            if not launcher_interrupting():     # else the launcher says it once for the run, naming the checkpoint
                sys.stderr.write(f"hetpipe: {describe()}: SIGTERM; {what}\n")
                sys.stderr.flush()
                mark_terminated(what)
            os._exit(128 + signal.SIGTERM)

        def handler(sig, _frame) -> None:
            # A second SIGTERM (the launcher's and mpiexec's both arrive) while the first is being handled
            # must not start a second write over the first's half-written files: it is ignored.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if writer is None and launcher_ending():
                os._exit(128 + sig)             # the launcher's teardown after a fault it named: nothing to say
            grace = failure.signal_grace_s()
            started = time.monotonic()
            try:
                if writer is None:
                    finish("the run writes no checkpoints")
                settle = None if launcher_interrupting() else min(TERM_SETTLE_S, timeout_s / 4)
                if not writer.on_signal(grace, settle) and settle is not None:
                    def at_due(clock: Optional[int]) -> None:
                        got = "" if clock is not None else f"no checkpoint completed within {grace:g} s; "
                        finish(f"{got}checkpoint(s) at clock(s) {writer.written} in {self.directory}")

                    writer.end_at_next_due(started + grace, at_due)
                    sys.stderr.write(f"hetpipe: {describe()}: SIGTERM; training on to the next checkpoint, "
                                     f"which every rank writes (every {writer.every} wave(s))\n")
                    sys.stderr.flush()
                    return
                what = f"checkpoint(s) at clock(s) {writer.written} in {self.directory}"
            except BaseException as e:  # noqa: BLE001 - the rank still ends as terminated, saying why
                # A write that failed here (a full disk) is said, and the rank ends on SIGTERM all the
                # same: raising from the handler would turn a stop from outside into this rank's error.
                what = (f"writing the checkpoint it held failed ({type(e).__name__}: {e}); checkpoint(s) at "
                        f"clock(s) {writer.written} in {self.directory}")
            finish(what)

        return signal.signal(signal.SIGTERM, handler)


def same_layout(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same VWs, stages, Nm (each VW's), D and shards (devices and predictions aside)."""
    def shape(p: Plan):
        return (p.wave_minibatches, p.d, p.aggregate, tuple(tuple((s.start, s.stop, tuple(s.recompute)) for s in vw.stages)
                                              for vw in p.virtual_workers),
                tuple(tuple(sh.layers) for sh in p.ps_shards))
    return shape(a) == shape(b)
