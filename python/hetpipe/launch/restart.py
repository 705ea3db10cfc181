"""Restart a failed run from its last checkpoint, without the failed device: ``hetpipe launch --max-restarts N``.

MPI ends a job when one of its ranks dies, so elasticity here is a fast restart (docs/design.md,
"Checkpoints and restart"). After a run ends with a rank that died or stopped answering (the
supervisor's ``outcome.json`` names it), the launcher looks up the device that rank ran in the plan
the run recorded (``plan.json`` in its run directory), leaves that device out unless it answers
again, drops the virtual worker that held it, and starts the job again on the remaining ranks,
resuming from the latest complete checkpoint. A device is the plan's device id: a GPU of a host, or,
for an emulated device, the rank process that emulates it; only a real CUDA device can be probed, so an
emulated device whose rank failed stays out. A user marks devices failed with ``--exclude-device``.
A run whose checkpoint write found its disk full, or one of whose ranks was ended by a SIGTERM from
outside the run (a preemption), is restarted too, with the same devices.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set

from hetpipe.checkpoint import format as ckpt
from hetpipe.job.launch_file import LaunchSettings
from hetpipe.job.rundir import WORLD_RANKS_FILE, reached_clock
from hetpipe.plan.types import Plan

RESTARTABLE = ("died", "stopped")       # faults of a rank or its device; a rank that raised is a bug
TERMINATED = "terminated"               # a rank stopped by a SIGTERM from outside the run: its device is sound
STUCK = "stuck"                         # a rank idle outside training (blocked in its data, say): its device is sound
PROBE_TIMEOUT_S = 30.0
# A checkpoint write that failed for lack of space: checkpoint.format.write_error names the file and the
# error, and marks the errno behind it, whatever layer raised it (Python's I/O: its OSError's; safetensors,
# whose own error carries none: the filesystem's answer to reserving the bytes), as "[errno ENOSPC]".
# A fault of the disk, not of the program or a device.
NO_SPACE = re.compile(r"hetpipe: writing .* failed: .*\[errno (ENOSPC|EDQUOT)\]")


def out_of_space(outcome) -> bool:
    """Whether a rank reported that a checkpoint write found no space left."""
    return outcome.cause == "reported" and any(NO_SPACE.search(r) for r in (outcome.message, *outcome.reports))


def restartable(outcome) -> bool:
    """Whether a failed run is worth restarting: a rank died or stopped, one was ended by a SIGTERM from
    outside the run (after writing its checkpoint), one was stuck outside training (a hung read), a
    peer gave up waiting on one that never answered (its report is a ``PeerTimeout``), or a
    checkpoint write ran out of disk space (the restart resumes from the last complete checkpoint,
    whose files the failed write left whole; space freed meanwhile lets it go on, a disk still full
    fails the same way and uses up the restarts). Any other error would happen again."""
    if outcome.cause in RESTARTABLE or outcome.cause in (TERMINATED, STUCK) or out_of_space(outcome):
        return True
    return outcome.cause == "reported" and any("PeerTimeout" in r for r in (outcome.message, *outcome.reports))


def device_of(plan: Plan, rank: Optional[int], world_ranks: Optional[List[int]] = None) -> Optional[str]:
    """The plan's device of stage rank ``rank`` (None for a PS rank, or no rank); ``world_ranks``: the
    world rank of each plan rank, when the run renumbered them (``rank`` is then a world rank)."""
    if rank is not None and world_ranks is not None:
        rank = world_ranks.index(rank) if rank in world_ranks else None
    if rank is None or not 0 <= rank < plan.num_stage_ranks:
        return None
    kind, vw, stage = plan.role_of(rank)
    return plan.virtual_workers[vw].stages[stage].device


def plan_without(plan: Plan, devices: Iterable[str]) -> Plan:
    """``plan`` without the virtual workers holding any of ``devices`` (the others renumbered in order).

    Each remaining VW keeps its stages, and the PS shards their layers: the pipelines are unchanged,
    only fewer of them run. Raises ValueError naming the devices when no VW would be left."""
    out = set(devices)
    unknown = sorted(out - {st.device for vw in plan.virtual_workers for st in vw.stages})
    if unknown:
        raise ValueError(f"hetpipe: device(s) {unknown} are not in the plan (its devices: "
                         f"{[st.device for vw in plan.virtual_workers for st in vw.stages]})")
    kept = [vw for vw in plan.virtual_workers if not out & set(vw.devices)]
    if not kept:
        raise ValueError(f"hetpipe: without device(s) {sorted(out)} no virtual worker of the plan is left")
    vws = tuple(dataclasses.replace(vw, index=i) for i, vw in enumerate(kept))
    # The planner's form of meta["left_out"] (hetpipe.plan.format reads it): each VW left out, and why.
    gone = [{"devices": list(vw.devices), "reason": f"device(s) {sorted(out & set(vw.devices))} failed"}
            for vw in plan.virtual_workers if out & set(vw.devices)]
    meta = {**plan.meta, "left_out": [*plan.meta.get("left_out", []), *gone],
            "prediction": f"none: the plan's prediction was for all its VWs; device(s) {sorted(out)} were left out"}
    return dataclasses.replace(plan, virtual_workers=vws, throughput=0.0, meta=meta)


def replan(plan: Plan, devices: Iterable[str], planning: Dict) -> Plan:
    """A new plan of the devices left after ``devices`` failed: the planner run again on the run's own
    cluster without them, with its profile and settings (``planning``, saved by the run that planned),
    so that a VW that lost a device can go on over the others. Device ids are kept (a GPU stays the
    GPU it was: ``n0.g2`` does not become ``n0.g1``). Raises ValueError when nothing fits."""
    from hetpipe.plan import make_plan

    out = set(devices)
    cluster = dict(planning["cluster"])
    nodes, ids = [], {}
    for node in cluster["nodes"]:
        kept = [(j, t) for j, t in enumerate(node["devices"]) if f"{node['name']}.g{j}" not in out]
        if kept:
            nodes.append({"name": node["name"], "devices": [t for _, t in kept]})
            ids.update({f"{node['name']}.g{k}": f"{node['name']}.g{j}" for k, (j, _) in enumerate(kept)})
    if not nodes:
        raise ValueError(f"hetpipe: without device(s) {sorted(out)} no device of the cluster is left")
    cluster["nodes"] = nodes
    # A plan made for time to accuracy is re-planned for it, with the noise scale it was made with; one
    # whose waves follow the VWs' speed gets waves by the new VWs' speed.
    tta = plan.meta.get("time_to_accuracy")
    objective = {} if not tta else {"objective": "time-to-accuracy", "noise_scale": tta["noise_scale"],
                                    "base_batch": tta["base_batch"]}
    new = make_plan(cluster, planning["profile"], policy=planning["policy"], nm=planning["nm"], d=planning["d"],
                    minibatch_size=planning["minibatch_size"], precision=planning["precision"],
                    ps_nodes=planning.get("ps_nodes"), tf32=bool(planning.get("tf32", False)),
                    waves=plan.meta.get("waves", {}).get("rule", "equal"), **objective)
    vws = tuple(dataclasses.replace(vw, stages=tuple(dataclasses.replace(st, device=ids.get(st.device, st.device))
                                                     for st in vw.stages)) for vw in new.virtual_workers)
    meta = {**new.meta, "replanned_without": sorted(out)}
    return dataclasses.replace(new, virtual_workers=vws, aggregate=plan.aggregate, meta=meta, **plan.outer_options)


def _planning_inputs(here: Path) -> Optional[Path]:
    """The run's planning inputs (``planning.json``): the attempt ``here``'s own, else those of the
    latest earlier attempt of the run that saved them (an attempt that resumed a given or re-planned
    plan plans nothing itself, and a device it loses must still be planned around)."""
    if (here / "planning.json").exists():
        return here / "planning.json"
    earlier = sorted((p for p in here.parent.glob("attempt-*/planning.json") if p.parent != here),
                     key=lambda p: int(p.parent.name.split("-")[1]), reverse=True)
    return earlier[0] if earlier else None


def _next_plan(plan: Plan, failed: Set[str], here: Path) -> "tuple[Plan, str]":
    """The plan of the next attempt and how it was chosen: re-planned over the surviving devices when
    the run saved its planning inputs (and the planner fits the model on them), else the plan without
    the VWs that held a failed device."""
    gone = failed & {st.device for vw in plan.virtual_workers for st in vw.stages}
    dropped = plan_without(plan, gone) if gone and any(not gone & set(vw.devices) for vw in plan.virtual_workers) \
        else None
    inputs = _planning_inputs(here)
    if gone and inputs is not None:
        import json

        try:
            # Every device failed so far is left out: the inputs describe the run's whole cluster.
            new = replan(plan, failed, json.loads(inputs.read_text()))
        except (ValueError, OSError) as e:
            if dropped is None:
                raise
            return dropped, f"re-planning failed ({e}); dropped the VW(s) that held them"
        return new, (f"re-planned the {sum(len(vw.stages) for vw in new.virtual_workers)} remaining device(s): "
                     f"{len(new.virtual_workers)} VW(s) of {[len(vw.stages) for vw in new.virtual_workers]} "
                     f"stage(s), predicted {new.throughput:.3g} minibatches/s (before: {plan.throughput:.3g})")
    if dropped is None:
        dropped = plan_without(plan, gone)          # raises, naming the devices
    return dropped, "dropped the VW(s) that held them (the run saved no planning inputs to re-plan with)"


def answers(device: str) -> bool:
    """Whether ``device`` works again: a CUDA device (``cuda:i``, or a cluster id ``...g<i>`` on a GPU
    host) if a fresh process can compute on it within ``PROBE_TIMEOUT_S``; an emulated device never
    (its rank process was the device, and it failed)."""
    import re

    m = re.match(r"^cuda(?::(\d+))?$", device) or re.search(r"g(\d+)$", device)
    if m is None:
        return False
    index = int(m.group(1) or 0)
    probe = (f"import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > {index} "
             f"and float(torch.ones(4, device='cuda:{index}').sum()) == 4.0 else 1)")
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=PROBE_TIMEOUT_S,
                              capture_output=True).returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def _say(text: str) -> None:
    sys.stderr.write(f"hetpipe: {text}\n")
    sys.stderr.flush()


def launch_with_restarts(n: int, argv: List[str], *, run_dir: Optional[str], max_restarts: int,
                         settings: LaunchSettings, exclude: Iterable[str] = (), placement=None,
                         mpi_args: Iterable[str] = ()) -> int:
    """Run ``argv`` on ``n`` ranks (see :func:`hetpipe.job.world.launch`), restarting it up to
    ``max_restarts`` times after a rank died or stopped answering; returns the last run's exit status.

    Attempt ``k`` runs in ``<run_dir>/attempt-k``. ``resume``: a checkpoint directory the first attempt
    resumes from; ``exclude``: devices to leave out of its plan (needs ``resume``: the plan is the
    checkpoint's). ``settings``: what the launch asks of the ranks (its run file); each attempt's run
    file adds the checkpoint it resumes from and the plan it runs."""
    from hetpipe.launch.mpiexec import launch
    from hetpipe.launch.supervisor import Outcome

    resume = settings.resume
    failed: Set[str] = set(exclude)
    if failed and not resume:
        raise ValueError(f"hetpipe launch: --exclude-device {', '.join(sorted(failed))} needs --resume DIR (the "
                         "plan left out of is the checkpoint's)")
    made = not run_dir or not Path(run_dir).exists()
    base = Path(run_dir).resolve() if run_dir else Path(tempfile.mkdtemp(prefix="hetpipe-run-"))
    base.mkdir(parents=True, exist_ok=True)
    if failed:
        try:
            plan = plan_without(Plan.from_dict(ckpt.read_manifest(ckpt.find(Path(resume)))["plan"]), failed)
            settings = _use_plan(plan, base / "plan-0.json", settings, f"without device(s) {sorted(failed)}")
        except BaseException:
            # Refused before any attempt started: no run directory is left behind.
            if made:
                shutil.rmtree(base, ignore_errors=True)
            raise
        n = plan.num_ranks
        _say(f"device(s) {sorted(failed)} marked failed: {len(plan.virtual_workers)} VW(s), {n} ranks")
    attempt = 0
    while True:
        here = base / f"attempt-{attempt}"
        rc = launch(n, argv, run_dir=str(here), placement=placement, mpi_args=list(mpi_args), settings=settings)
        outcome = Outcome.read(str(here))
        if outcome.status == "ok":
            if run_dir is None:
                shutil.rmtree(base, ignore_errors=True)
            return rc
        if not restartable(outcome):
            if max_restarts > 0 and outcome.status != "interrupted":     # an interrupt is said in its own line
                _say(f"not restarting: the run ended with cause '{outcome.cause}' (restarts follow a rank that "
                     "died or stopped answering; one that raised for another reason would raise again)")
            return rc
        if attempt >= max_restarts:
            if max_restarts > 0:
                _say(f"not restarting: all {max_restarts} restart(s) used")
            return rc
        directory = settings.checkpoint_dir
        if directory is None and (here / "checkpoints.txt").exists():
            directory = (here / "checkpoints.txt").read_text().strip()
        if not (here / "plan.json").exists():
            _say("not restarting: the run failed before it had a plan")
            return rc
        plan = Plan.load(here / "plan.json")
        renumbered = (here / WORLD_RANKS_FILE).exists()
        world_ranks = json.loads((here / WORLD_RANKS_FILE).read_text()) if renumbered else None
        # A peer's timeout names the rank that waited, not the one that hung: no device to leave out.
        device = device_of(plan, outcome.rank, world_ranks) if outcome.cause in RESTARTABLE else None
        if renumbered and device is not None and not answers(device):
            # The restarted ranks discover their devices again, rank k of a host holding its GPU k: no
            # way yet to tell them which one to leave out. Restarting with it would fail on it again.
            _say(f"not restarting: {outcome.role} failed on device {device} of a world planned on its discovered "
                 "devices, and a restart cannot leave one of them out yet: relaunch on the hosts without it")
            return rc
        why = (outcome.message or f"{outcome.role} failed ({outcome.cause})").removeprefix("hetpipe: ")
        if device is not None and answers(device):
            left = f"device {device} of {outcome.role} answers again: it stays in the plan"
        elif device is not None:
            failed.add(device)
            left = f"device {device} of {outcome.role} is left out"
        elif outcome.cause in RESTARTABLE:
            left = f"{outcome.role} holds no device of the plan (a PS shard of this host): restarting it"
        elif outcome.cause == TERMINATED:
            left = "a SIGTERM from outside the run is no fault of a device: restarting with the same devices"
        elif outcome.cause == STUCK:
            left = "a rank stuck outside training is no fault of its device: restarting with the same devices"
        elif out_of_space(outcome):
            left = "a checkpoint write found no space left on its disk: restarting with the same devices"
        else:
            left = "the rank that stopped answering is not known: restarting with the same devices"
        try:
            new_plan, chosen = _next_plan(plan, failed, here)
        except ValueError as e:
            _say(f"not restarting: {e}")
            return rc
        how = f" ({chosen})" if failed & {st.device for vw in plan.virtual_workers for st in vw.stages} else ""
        reached = reached_clock(str(here))
        found = ckpt.latest(Path(directory)) if directory else None
        sound, failing = _verified(Path(directory)) if found is not None else (None, [])
        if found is not None:
            settings = dataclasses.replace(settings, resume=str(found.parent), restarting=True)
            start = sound if sound is not None else found
            clock = int(start.name.split("-")[1])
            # The ranks verify what they resume from; a run with resume_fallback goes back past a checkpoint
            # that fails, one without stops on it: the line names both, and counts the loss from the former.
            lost = (f"resuming from the checkpoint at clock {clock} ({start})" if not failing else
                    f"the latest complete checkpoint fails verification ({failing[0]}): " +
                    (f"resuming from the checkpoint at clock {clock} ({start}), the newest that passes, if the run "
                     "falls back (resume_fallback), else the run stops on it" if sound is not None else
                     "no checkpoint passes: the run stops on it"))
            lost += (f"; the ranks had reached clock {max(reached, clock)}: the work of waves "
                     f"{clock}..{max(reached, clock) - 1} is lost ({max(reached, clock) - clock} wave(s))")
        else:
            settings = dataclasses.replace(settings, resume=resume, restarting=True)
            # The attempt's incomplete checkpoints carry its run's id; the next attempt continues that
            # run instead of drawing a new id and refusing the directory as another run's.
            runs = list(ckpt.run_ids(Path(directory))) if directory else []
            if len(runs) == 1:
                settings = dataclasses.replace(settings, run_id=runs[0])
            lost = (f"no complete checkpoint{' in ' + directory if directory else ' (no checkpoint directory)'}: "
                    f"restarting from the start; the work of {max(reached, 0)} wave(s) is lost")
        attempt += 1
        settings = _use_plan(new_plan, base / f"plan-{attempt}.json", settings, chosen)
        n = new_plan.num_ranks
        _say(f"restart {attempt} of {max_restarts}: {why}; {left}; {len(new_plan.virtual_workers)} VW(s) on "
             f"{n} ranks{how}; {lost}")


def _verified(directory: Path) -> "tuple[Optional[Path], List[str]]":
    """The newest complete checkpoint in ``directory`` that passes verification (:func:`ckpt.verify`: the
    digests and clocks a resume checks, torch-free), and the errors of the newer ones that fail."""
    failing: List[str] = []
    for path in ckpt.complete_clocks(directory):
        try:
            ckpt.verify(path)
        except (ckpt.CheckpointError, OSError, ValueError, KeyError) as e:
            failing.append(str(e).removeprefix("hetpipe: "))
            continue
        return path, failing
    return None, failing


def _use_plan(plan: Plan, path: Path, settings: LaunchSettings, why: str) -> LaunchSettings:
    """``settings`` running ``plan``, saved at ``path``, as a restart's (``why``: how it was chosen)."""
    plan.save(path)
    return dataclasses.replace(settings, plan=str(path), plan_reason=why, restarting=True)
