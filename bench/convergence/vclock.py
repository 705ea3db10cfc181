"""One system of the convergence benchmark on the virtual clock: exact numerics in one process, time from the model.

Usage: python bench/convergence/vclock.py --system hetpipe --d 1 --aggregate mean --steps 200 --out points.json

Every system's updates are computed here, in this process, at the host's speed; its time axis comes
from the device and cluster model (the profile of ``run.prepare``, the ``cpu-emulated-6`` preset),
not from a clock. Each validation point is ``(virtual seconds, samples trained, validation loss)``.

* ``hetpipe``: the run's schedules are simulated on the cluster (``hetpipe.run.simulated``), which
  writes the record of that run (the version each pull gets, each shard's apply order); the
  single-process replay follows it (``hetpipe.run.replay``), so the numerics are bitwise those of a
  hetpipe run with the cluster's staleness. The model at version ``g`` is the PS's global ``W_g``, at
  the simulated time every shard has applied wave ``g - 1``. ``--steps``: minibatches per VW (each
  VW's optimizer steps), rounded down to whole waves.
* ``ddp``, ``ddp-fast``, ``hetero-dp``, ``pipelining``: the update all of them apply, the mean loss over
  the step's windows through the plain model (the windows ``train_ddp.py`` and ``train_pipelining.py``
  read, in order), one Adam step; its time is ``steptimes``' model of the system. ``--steps``: optimizer
  steps. The data-parallel baselines use only the devices whose memory holds the whole model with its
  Adam state (``ddp-fast``: the fastest of them; ``hetero-dp``: all of them, one minibatch each, split
  by speed). ``fsdp`` (every device, one minibatch each, the weights sharded) applies DDP's update over
  all devices; its step adds FSDP's all-gathers and reduce-scatter (``steptimes``).

:func:`staleness_table` prints a simulated record's staleness beside a measured one's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from baselines import batch_split, fast_subset  # noqa: E402
from cluster_setup import memory_notes  # noqa: E402
from hetpipe.model.weights import initial_weights, load_layer_weights  # noqa: E402
from hetpipe.run.record import RunRecord  # noqa: E402
from split import uniform_split  # noqa: E402
from steptimes import (boundary_transfers, dp_step_s, fsdp_bytes_per_device, fsdp_comm_s,  # noqa: E402
                       pipeline_step_s, ring_link)
from task import MinibatchStream, TaskSpec, build_layers, evaluate, loss_fn, optimizer  # noqa: E402

SYSTEMS = ("ddp", "ddp-fast", "hetero-dp", "fsdp", "pipelining", "hetpipe")
Point = Tuple[float, int, float]          # (virtual seconds, samples trained, validation loss)


@dataclass
class Setting:
    """What every system on the virtual clock reads: the task, its data and validation set, the device
    model, the profile, the cluster and hetpipe's plan (as ``run.prepare`` makes them)."""

    task: TaskSpec
    text: np.ndarray
    val: Tuple[torch.Tensor, torch.Tensor]
    dm: object                    # bench/e2e's DeviceModel
    prof: object                  # hetpipe's ModelProfile
    cluster: object               # hetpipe's ClusterSpec
    plan: object                  # hetpipe's Plan (D = 0; a run sets its own)


@dataclass
class Baseline:
    """A synchronous baseline: windows per step and the modelled seconds of one step (with its parts)."""

    system: str
    windows: int
    step_s: float
    parts: Dict[str, float] = field(default_factory=dict)
    note: str = ""
    fits: bool = True             # whether every member's memory holds what the system keeps there


def grad_bytes(prof) -> float:
    """Bytes of the gradient every data-parallel member all-reduces (float32, every parameter)."""
    return float(sum(l.param_bytes for l in prof.layers))


def fitting(s: Setting, share: Optional[int] = None) -> List[bool]:
    """Per device (cluster order): whether its memory holds the whole model with its optimizer state and
    the stashed activations of ``share`` windows (default: one minibatch), ``cluster_setup.memory_notes``."""
    misfit = memory_notes(s.dm, s.prof, s.cluster, share or s.task.minibatch)
    return [t not in misfit for _, t in s.dm.devices]


def baseline(s: Setting, system: str) -> Baseline:
    """The step of ``system`` (one of ``SYSTEMS`` but hetpipe) on the setting's device model."""
    dm, mb = s.dm, s.task.minibatch
    ids = [d for d, _ in dm.devices]
    times = [dm.minibatch_time(t) for _, t in dm.devices]
    if system in ("ddp", "hetero-dp", "ddp-fast", "fsdp"):
        fits = fitting(s)
        if system in ("ddp", "fsdp"):
            members, windows = list(range(len(ids))), [mb] * len(ids)
        elif system == "hetero-dp":
            members = [i for i, f in enumerate(fits) if f]
            windows = batch_split([times[i] for i in members], len(members) * mb) if members else []
        else:
            sub = fast_subset(times, fits, mb)
            members, windows = list(sub.devices), [mb] * len(sub.devices)
        if not members:
            return Baseline(system, 0, float("inf"), note="no device's memory holds the model", fits=False)
        link = ring_link(s.cluster, [ids[i] for i in members])
        compute, reduce = dp_step_s([times[i] for i in members], windows, mb, grad_bytes(s.prof), link)
        note = f"devices {[ids[i] for i in members]}, windows {windows}"
        if system == "fsdp":
            comm = fsdp_comm_s(grad_bytes(s.prof), len(members), link)
            held = fsdp_bytes_per_device([l.param_bytes for l in s.prof.layers],
                                         [l.optimizer_bytes for l in s.prof.layers], len(members),
                                         sum(l.stash for l in s.prof.layers))
            cap = min(s.cluster.device_types[dm.devices[i][1]].memory_bytes for i in members)
            return Baseline(system, sum(windows), compute + comm, {"compute": compute, "gather+scatter": comm},
                            note + f", {held / 2**20:.1f} MiB per device (smallest memory {cap / 2**20:.1f} MiB)",
                            fits=held <= cap)
        ok = system == "ddp-fast" or all(fitting(s, w)[i] for i, w in zip(members, windows))
        return Baseline(system, sum(windows), compute + reduce, {"compute": compute, "all-reduce": reduce}, note,
                        fits=ok)
    if system == "pipelining":
        split = uniform_split(len(s.prof.layers), len(ids))
        fb = [dm.scaled_times(t, range(a, b), mb) for (_, t), (a, b) in zip(dm.devices, split)]
        act = [s.prof.layers[b - 1].activation_bytes for _, b in split[:-1]]
        micro = len(ids)
        step = pipeline_step_s([f for f, _ in fb], [b for _, b in fb], micro, boundary_transfers(s.cluster, ids, act))
        return Baseline(system, micro * mb, step, {"pipeline": step}, f"uniform split {split}, {micro} micro-batches")
    raise ValueError(f"vclock: unknown baseline {system!r} (known: {', '.join(SYSTEMS[:-1])})")


def eval_steps(steps: int, evals: int) -> List[int]:
    """The steps (0 .. steps) after which the model is validated: ``evals`` about evenly, the last included."""
    every = max(1, steps // max(1, evals))
    return sorted(set(range(0, steps + 1, every)) | {steps})


def run_baseline(s: Setting, system: str, steps: int, lr: float, seed: int, evals: int = 20,
                 progress: Optional[Callable[[str], None]] = None,
                 on_point: Optional[Callable[[Point, List[nn.Module]], None]] = None) -> Tuple[List[Point], Baseline]:
    """``steps`` optimizer steps of a baseline in one process; validation points on the virtual clock
    (``on_point(point, layers)`` is called at each, the layers holding the weights it validated)."""
    b = baseline(s, system)
    layers = build_layers(s.task, seed)
    model = nn.Sequential(*layers)
    opt = optimizer(model.parameters(), lr)
    stream = MinibatchStream(s.text, s.task, seed, count=0)
    due = set(eval_steps(steps, evals))
    points: List[Point] = [(0.0, 0, evaluate(layers, *s.val))]
    if on_point:
        on_point(points[-1], layers)
    for k in range(steps):
        x, y = stream.windows(k * b.windows, b.windows)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if k + 1 in due:
            points.append(((k + 1) * b.step_s, (k + 1) * b.windows, evaluate(layers, *s.val)))
            if on_point:
                on_point(points[-1], layers)
            if progress:
                progress(f"{system} step {k + 1}: t {points[-1][0]:.1f} s, val loss {points[-1][2]:.3f}")
    return points, b


def run_hetpipe(s: Setting, steps: int, lr: float, seed: int, d: int, aggregate: str = "mean", evals: int = 20,
                progress: Optional[Callable[[str], None]] = None,
                outer: Optional[Dict[str, object]] = None) -> Tuple[List[Point], object]:
    """hetpipe's plan under D and ``aggregate`` (and ``outer``: :class:`hetpipe.PSRule`'s outer-optimizer
    fields, and ``waves``: the plan's wave rule, :func:`hetpipe.plan.waves.with_waves`) for ``steps // Nm``
    waves, replayed on the simulated record; validation
    points at the global versions ``W_g``. Returns the points and the
    :class:`hetpipe.run.simulated.SimulatedRun`."""
    from hetpipe import PSRule, Reporting
    from hetpipe.run.replay import replay_run
    from hetpipe.run.simulated import simulated_record
    from hetpipe.plan.waves import with_waves
    from hetpipe.run.trainer import Trainer

    options = dict(outer or {})
    plan = with_waves(dataclasses.replace(s.plan, d=d), str(options.pop("waves", "equal")))
    waves = steps // plan.nm
    if waves < 1:
        raise ValueError(f"vclock: {steps} steps per VW is less than one wave of Nm = {plan.nm}")
    data = MinibatchStream(s.text, s.task, seed, count=waves * plan.minibatches_per_wave)
    layers = build_layers(s.task, seed)
    trainer = Trainer(layers, loss_fn, lambda p: optimizer(p, lr), data, plan=plan,
                      ps=PSRule(aggregate=aggregate, **options), reporting=Reporting(progress=False))
    plan = trainer.resolve_plan()           # the plan with the PS rule (aggregate, outer optimizer) applied
    spec = trainer.spec(plan)
    run = simulated_record(spec, cluster=s.cluster, param_bytes=[l.param_bytes for l in s.prof.layers])
    due = set(eval_steps(waves, evals))
    snaps: Dict[int, Dict[int, np.ndarray]] = {0: initial_weights(layers, 0)}

    def on_applied(state) -> None:
        if state.applied in due:
            snaps.setdefault(state.applied, {}).update({l: w.copy() for l, w in state.W.items()})

    replay_run(spec, run.record, on_applied=on_applied)
    model = build_layers(s.task, seed)
    per_wave = plan.minibatches_per_wave * s.task.minibatch
    points: List[Point] = []
    for g in sorted(snaps):
        load_layer_weights(model, snaps[g])
        points.append((run.version_s[g], g * per_wave, evaluate(model, *s.val)))
        if progress and g:
            progress(f"hetpipe D={d} ({aggregate}) wave {g}: t {points[-1][0]:.1f} s, val loss {points[-1][2]:.3f}")
    return points, run


def same_versions(simulated: RunRecord, measured: RunRecord) -> Tuple[int, int]:
    """(pulls of ``measured`` answered at the version ``simulated`` answered them, all its pulls), every shard."""
    got = {(sh, v, k, w): g for sh, rec in simulated.shards.items() for v, k, w, g, _ in rec.pulls}
    pulls = [(sh, v, k, w, g) for sh, rec in measured.shards.items() for v, k, w, g, _ in rec.pulls]
    return sum(got.get((sh, v, k, w)) == g for sh, v, k, w, g in pulls), len(pulls)


def staleness_table(simulated: RunRecord, measured: RunRecord) -> str:
    """The staleness ``w - g`` of every pull, as a histogram (count and share), of a simulated record
    beside a measured one (a record written by a run)."""
    a, b = simulated.staleness(), measured.staleness()
    na, nb = sum(a.values()), sum(b.values())
    lines = [f"{'w - g':>5} | {'simulated':>16} | {'measured':>16}"]
    for k in sorted(set(a) | set(b)):
        ca, cb = a.get(k, 0), b.get(k, 0)
        lines.append(f"{k:>5} | {ca:>6} ({100 * ca / max(na, 1):5.1f}%) | {cb:>6} ({100 * cb / max(nb, 1):5.1f}%)")
    lines.append(f"{'pulls':>5} | {na:>16} | {nb:>16}")
    return "\n".join(lines)


def setting(task: str = "small", profile_trials: int = 1, slowdown: float = 1.5, nm: Optional[int] = None,
            policy: str = "auto", work: Optional[Path] = None, profile_file: Optional[Path] = None) -> Setting:
    """The benchmark's setting (``run.prepare``: the model profiled on this host, or its profile loaded from
    ``profile_file`` when that exists, see ``cluster_setup.profile_device_model``; the plan made on it)."""
    import tempfile

    from run import prepare
    from task import corpus

    args = argparse.Namespace(task=task, profile_trials=profile_trials, slowdown=slowdown, profile_file=profile_file)
    work = Path(work or tempfile.mkdtemp(prefix="hetpipe-vclock-"))
    work.mkdir(parents=True, exist_ok=True)
    spec, _, val, dm, plan, _, prof, cluster = prepare(args, work, nm, policy)
    return Setting(spec, corpus(spec)[0], val, dm, prof, cluster, plan)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=SYSTEMS, required=True)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (hetpipe: minibatches per VW)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d", type=int, default=1, help="hetpipe's staleness bound")
    ap.add_argument("--aggregate", default="mean", help="hetpipe's PS rule (sum or mean)")
    ap.add_argument("--evals", type=int, default=20, help="validation points (about evenly spaced)")
    ap.add_argument("--task", default="small")
    ap.add_argument("--profile-trials", type=int, default=1)
    ap.add_argument("--slowdown", type=float, default=1.5)
    ap.add_argument("--nm", type=int)
    ap.add_argument("--out", type=Path, help="where the points go (JSON)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = setting(args.task, args.profile_trials, args.slowdown, args.nm)
    say = lambda line: print(line, flush=True)  # noqa: E731
    about: Dict[str, object] = {"system": args.system, "lr": args.lr, "seed": args.seed, "steps": args.steps}
    if args.system == "hetpipe":
        points, run = run_hetpipe(s, args.steps, args.lr, args.seed, args.d, args.aggregate, args.evals, say)
        about.update(d=args.d, aggregate=args.aggregate, staleness=run.staleness(), nm=s.plan.nm,
                     vws=len(s.plan.virtual_workers))
        print(f"staleness (w - g: pulls): {run.staleness()}")
    else:
        points, b = run_baseline(s, args.system, args.steps, args.lr, args.seed, args.evals, say)
        about.update(step_s=b.step_s, parts=b.parts, windows=b.windows, note=b.note)
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in b.parts.items())
        print(f"{args.system}: {b.note}; step {b.step_s * 1e3:.1f} ms ({parts})")
    if args.out:
        args.out.write_text(json.dumps({**about, "points": [list(p) for p in points]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
