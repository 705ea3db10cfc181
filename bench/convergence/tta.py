"""Time to accuracy on the virtual clock: hetpipe beside data-parallel baselines, FSDP and 1F1B, in two regimes.

Usage: python bench/convergence/tta.py [--quick] [--regimes r1,r2] [--steps 2000] [--seeds 0,1,2] [--out DIR]

* **R1, capacity-bound**: the HetPipe testbed's 16 devices of 4 types (``hetpipe-testbed``: 4 nodes x 4),
  emulated: each type's speed is its peak FP32 rate's share of the fastest type's, the fastest at 1/8 of
  this host's speed (as ``cpu-emulated-6``'s ``emu_fast``), the links ``cpu-emulated-6``'s, and every
  memory the testbed's scaled by one factor: the one that puts the whole model with its Adam state and
  one minibatch's activations at 10 GiB on the testbed's scale, between the Quadro P4000's 8 GiB and
  the Titan V's 12 GiB. So the RTX 2060 and Quadro P4000 devices cannot hold the model: the
  data-parallel baselines run on the Titan V and Titan RTX devices only, hetpipe, FSDP and 1F1B on all 16.
  The model is the byte-level GPT of ``task.py`` grown to 8.04M parameters (``R1_TASK``).
* **R2, all-fit** (the negative control): ``cpu-emulated-6`` and ``run.py``'s task, as ``vclock.py`` runs
  them; every device holds the model.

Every system runs on the virtual clock (``vclock.py``): its exact numerics in this process, its time from
the device and cluster model. Each system's learning rate is the best of one sweep (seed 0, the same
rates and so the same number of runs for every system, lowest validation loss at the budget); the best is
run on the other seeds. The budget (virtual seconds) is ``--steps`` optimizer steps of the fastest
baseline (the shortest step). Targets: see :func:`choose_targets`; the gradient noise scale is measured
on the reference run (``ddp-fast``, seed 0) where it reaches each target (:func:`noise_scale`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path[1:1] = [str(HERE), str(HERE.parent / "e2e")]

import numpy as np  # noqa: E402

from curves import best_within, loss_at, on_grid, time_to_target  # noqa: E402
from hetpipe.plan.cluster import load_cluster  # noqa: E402
from hetpipe.plan.efficiency import NoiseScale, efficiency  # noqa: E402
from report import fmt, table  # noqa: E402
from task import TaskSpec  # noqa: E402

GIB = 2 ** 30
MEMORY_POINT = 10 * GIB      # where R1's model with Adam sits on the testbed's memory scale
TOP_SPEED = 0.125            # R1's fastest type at 1/8 of the host's speed (cpu-emulated-6's emu_fast)
SLOWDOWN = 1.5               # every emulated time x 1.5, as run.py and vclock.py
R1_SYSTEMS = ("ddp-fast", "hetero-dp", "fsdp", "pipelining")
R2_SYSTEMS = ("ddp-fast", "hetero-dp", "pipelining")
LABELS = {"ddp": "DDP, all devices", "ddp-fast": "DDP, best k fastest fitting",
          "hetero-dp": "hetero-aware DP, fitting devices", "fsdp": "FSDP, all devices",
          "pipelining": "torch 1F1B, all devices"}
R1_TASK = TaskSpec(width=256, blocks=10)      # 8,037,632 parameters, 22 layers
REFERENCE = "ddp-fast"       # the run the noise scale is measured along
NOISE_SEED = 1 << 20         # the noise scale's minibatches: a stream no run reads
VALIDATION = ("validation against real emulated runs (bench/convergence/README.md, 'Virtual clock'): "
              "vclock_staleness.py, 3-rank runs, pulls at the simulated version: 78/78 (D 2, VW 1 3x slower), "
              "74/78 (D 4, 1.5x), 78/78 (D 1, 2x); 4 ranks (a 2-stage VW), D 2: 91/117; vclock_check.py, "
              "cpu-emulated-6, 30 s: DDP (2 and 6 devices), hetero DP and 1F1B within one seed sd at every point; "
              "hetpipe D 0 and D 1 equal at every point; D 4 within one seed sd at 25 of 29")


# --- regimes -----------------------------------------------------------------------------------------

def model_bytes(prof, share: int) -> int:
    """Bytes one device holds to train the whole model with its optimizer state: weights, gradients,
    optimizer state and the stashed activations of ``share`` windows (``cluster_setup.memory_notes``)."""
    return int(sum(l.param_bytes * 2 + l.optimizer_bytes + l.stash * share // prof.minibatch_size
                   for l in prof.layers))


def testbed_emulated(need: float, top_speed: float = TOP_SPEED, point: float = MEMORY_POINT) -> Tuple[dict, float]:
    """R1's cluster (file format) and its memory scale: ``hetpipe-testbed`` with emulated speeds (peak FP32
    over the fastest type's, times ``top_speed``), ``cpu-emulated-6``'s links and every memory scaled by
    ``need / point`` (the model needing ``need`` bytes sits at ``point`` on the testbed's scale)."""
    tb = load_cluster("hetpipe-testbed").to_dict()
    links = load_cluster("cpu-emulated-6").to_dict()
    scale = need / point
    top = max(t["peak_flops"] for t in tb["device_types"].values())
    types = {n: {"memory_bytes": max(1, int(t["memory_bytes"] * scale)), "speed": top_speed * t["peak_flops"] / top}
             for n, t in tb["device_types"].items()}
    return {"name": "hetpipe-testbed-emulated", "emulated": True, "device_types": types, "nodes": tb["nodes"],
            "intra_node": links["intra_node"], "inter_node": links["inter_node"]}, scale


def memory_verdicts(cluster, need: int) -> Dict[str, Tuple[int, int, bool]]:
    """Per device type: (bytes needed, bytes it has, whether they fit)."""
    return {t: (need, dt.memory_bytes, need <= dt.memory_bytes) for t, dt in cluster.device_types.items()}


# --- statistics --------------------------------------------------------------------------------------

def mean_sd(xs: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (``ddof = 1``; None with one value); (None, None) when any
    value is missing (a seed that never reached the target)."""
    if not xs or any(x is None for x in xs):
        return None, None
    a = np.asarray(xs, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else None)


def choose_targets(curves: Sequence[List[Tuple[float, float]]], budget: float, reference: List[Tuple[float, float]],
                   fractions: Sequence[float] = (0.25, 0.5, 1.0), step: float = 0.01) -> List[float]:
    """Targets spread along the curves, hardest last. The hardest is the lowest loss (rounded up to
    ``step``) that every curve reaches within ``budget``; the others are the losses the ``reference`` curve
    has reached at each of ``fractions`` of its time to the hardest (rounded up). Where two coincide, the
    targets are spaced evenly between the first and the hardest instead, as many as ``fractions``."""
    up = lambda x: math.ceil(x / step - 1e-9) * step  # noqa: E731
    hard = up(max(best_within(c, budget) for c in curves))
    t_hard = time_to_target(reference, hard)
    if t_hard is None:
        raise ValueError(f"choose_targets: the reference curve never reaches {hard:.2f}")
    levels = [max(up(best_within(reference, f * t_hard)), hard) for f in fractions]
    if len(set(round(x / step) for x in levels)) < len(levels):
        levels = [up(levels[0] + (hard - levels[0]) * k / (len(levels) - 1)) for k in range(len(levels))]
    return sorted({round(x, 6) for x in levels}, reverse=True)


def samples_at(points: Sequence[Tuple[float, int, float]], t: float) -> float:
    """Samples trained by virtual time ``t`` (linear between points)."""
    for (t0, s0, _), (t1, s1, _) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return float(points[-1][1])


def speedup_bound(thr: float, thr_base: float, batch: float, batch_base: float, noise: float) -> float:
    """Pollux's prediction of a speed-up in time to a target: the throughput ratio times the statistical
    efficiency ratio ``E(batch) / E(batch_base)`` at the gradient noise scale ``noise`` (staleness and
    every other difference in the updates ignored)."""
    return thr / thr_base * efficiency(batch, noise, 1.0) / efficiency(batch_base, noise, 1.0)


# --- runs --------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One system of a regime: a baseline, or hetpipe under one (aggregate, D)."""

    key: str
    label: str
    system: str
    d: int = 0
    aggregate: str = "mean"
    outer: Dict[str, object] = field(default_factory=dict)     # hetpipe: PSRule's outer-optimizer fields set
    batch: int = 0                 # windows per update (hetpipe: see batch_note)
    batch_note: str = ""
    step_s: float = 0.0            # virtual seconds per step (hetpipe: per wave, steady)
    steps: int = 0                 # steps (hetpipe: minibatches per VW) to cover the budget
    note: str = ""
    plan: object = None            # hetpipe: the row's own plan (``plan=tta``); None: the regime's
    runs: List[dict] = field(default_factory=list)


def noise_scale(layers, s, groups: int, per: int) -> float:
    """The gradient noise scale (windows) of ``layers``' weights: ``groups`` measurements, each ``per``
    minibatch gradients (batch ``minibatch``) and their mean (batch ``per x minibatch``), from a stream
    no run reads (:class:`hetpipe.plan.efficiency.NoiseScale`)."""
    import torch
    from torch import nn

    from task import MinibatchStream, loss_fn

    model = nn.Sequential(*layers)
    stream = MinibatchStream(s.text, s.task, NOISE_SEED, count=0)
    acc = NoiseScale()
    mb = s.task.minibatch
    for g in range(groups):
        grads = []
        for j in range(per):
            x, y = stream[g * per + j]
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).numpy()
                         .astype(np.float64))
        acc.add(grads, np.mean(grads, axis=0), mb, per * mb)
    model.zero_grad(set_to_none=True)
    return acc.value


def host_seconds(s, repeats: int = 3) -> Dict[str, float]:
    """Host seconds of the plain model on this host, one thread: a step of one minibatch (forward,
    backward, Adam) and a step of 8 minibatches, and the forward and backward of a minibatch in it."""
    from torch import nn

    from task import MinibatchStream, build_layers, loss_fn, optimizer

    model = nn.Sequential(*build_layers(s.task, 0))
    opt = optimizer(model.parameters(), 1e-3)
    stream = MinibatchStream(s.text, s.task, NOISE_SEED + 1, count=0)
    out = {}
    for n in (1, 8):
        best = math.inf
        for k in range(repeats + 1):
            x, y = stream.concat(k * n, n)
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            best = min(best, time.perf_counter() - t) if k else math.inf
        out[f"step_{n}"] = best
    out["per_minibatch"] = (out["step_8"] - out["step_1"]) / 7
    out["adam"] = max(out["step_1"] - out["per_minibatch"], 0.0)
    return out


def estimate_host_s(rows: Sequence[Row], s, host: Dict[str, float], runs_per_row: int, evals: int,
                    eval_s: float, replay_factor: float = 1.5, replay_overhead_s: float = 0.045) -> float:
    """Host seconds the regime's runs take: a baseline step is its windows' forward and backward plus
    one Adam step; hetpipe's replay costs ``replay_factor`` x a one-minibatch step plus
    ``replay_overhead_s`` per minibatch (fitted on this host to the 0.1M- and 8M-parameter models: the
    stages' stashes and flat copies, the PS's arithmetic, Python per instruction); plus the validations."""
    mb = s.task.minibatch
    per_run = 0.0
    for r in rows:
        if r.system == "hetpipe":
            per_run += r.steps * len(s.plan.virtual_workers) * (replay_factor * host["step_1"] + replay_overhead_s)
        else:
            per_run += r.steps * (r.batch / mb * host["per_minibatch"] + host["adam"])
        per_run += (evals + 1) * eval_s
    return per_run * runs_per_row


def hetpipe_steps(s, d: int, budget: float, margin: float = 1.1, waves_rule: str = "equal") -> Tuple[int, float]:
    """(waves x the plan's Nm, steady seconds per wave) of a hetpipe run whose simulated length passes
    ``budget x margin``: whole waves, from the steady wave time of an 8-wave simulation, with the VWs'
    waves of ``waves_rule`` (:func:`hetpipe.plan.waves.with_waves`)."""
    from hetpipe.plan.waves import with_waves
    from hetpipe.schedule import simulate_plan

    plan = with_waves(dataclasses.replace(s.plan, d=d), waves_rule)
    a, b = simulate_plan(plan, waves=4).makespan_s, simulate_plan(plan, waves=8).makespan_s
    wave = (b - a) / 4
    waves = max(1, math.ceil((budget * margin - a) / wave) + 4)
    return waves * plan.nm, wave


OUTER_KEYS = {"outer": "outer", "lr": "outer_lr", "momentum": "outer_momentum", "staleness": "outer_staleness",
              "gain": "outer_gain", "delay": "outer_delay"}


# a row's keys that are not the PS's outer-optimizer fields
ROW_KEYS = ("waves", "plan", "noise", "nm", "policy", "costs")


def parse_variant(text: str) -> Tuple[str, int, Dict[str, object]]:
    """One ``--hetpipe`` row: ``AGG:D`` or ``AGG:D:KEY=VALUE+KEY=VALUE...`` with KEY one of
    :data:`OUTER_KEYS` (the PS's outer optimizer, :mod:`hetpipe.plan.outer`), e.g.
    ``mean:1:outer=delayed-nesterov+lr=0.15+momentum=0.9``, ``waves`` (``equal``, ``speed``: the plan's wave
    rule, :func:`hetpipe.plan.waves.with_waves`), ``plan=tta`` (the row's plan is
    ``make_plan(objective="time-to-accuracy")``'s on the regime's cluster and profile, at the regime's Nm)
    and ``noise`` (with ``plan=tta``: the noise scale in windows it plans with; without it, a pilot on the
    initial model measures one, as a job does), ``nm`` (with ``plan=tta``: the Nm it plans at instead of the
    regime's), ``costs`` (with ``plan=tta``: ``fitted`` prices the plans' staleness, ``none`` by default) and
    ``policy`` (with ``plan=tta``: NP, ED or HD, the only layout it weighs, instead of every
    policy, one-device VWs and one VW of every device). Returns (aggregate, D, PSRule fields, and ``waves``
    when ``speed``, ``plan``, ``noise``, ``nm`` and ``policy`` when given)."""
    from hetpipe.plan.outer import OUTER_DEFAULTS, check_outer

    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("mean", "sum") or not parts[1].isdigit():
        raise SystemExit(f"tta: --hetpipe row {text!r} is not AGG:D[:KEY=VALUE+...] with AGG mean or sum")
    outer: Dict[str, object] = {}
    for item in (parts[2].split("+") if len(parts) == 3 and parts[2] else []):
        key, _, value = item.partition("=")
        if key == "waves":
            if value not in ("equal", "speed"):
                raise SystemExit(f"tta: --hetpipe row {text!r}: waves must be equal or speed, got {value!r}")
            if value == "speed":
                outer["waves"] = value
            continue
        if key == "plan":
            if value != "tta":
                raise SystemExit(f"tta: --hetpipe row {text!r}: plan must be tta, got {value!r}")
            outer["plan"] = value
            continue
        if key == "noise":
            try:
                outer["noise"] = float(value)
            except ValueError:
                raise SystemExit(f"tta: --hetpipe row {text!r}: noise must be a number, got {value!r}") from None
            if not (math.isfinite(outer["noise"]) and outer["noise"] > 0):
                raise SystemExit(f"tta: --hetpipe row {text!r}: noise must be > 0, got {value!r}")
            continue
        if key == "nm":
            if not value.isdigit() or int(value) < 1:
                raise SystemExit(f"tta: --hetpipe row {text!r}: nm must be an integer >= 1, got {value!r}")
            outer["nm"] = int(value)
            continue
        if key == "costs":
            if value not in ("none", "fitted"):
                raise SystemExit(f"tta: --hetpipe row {text!r}: costs must be none or fitted, got {value!r}")
            outer["costs"] = value
            continue
        if key == "policy":
            if value.upper() not in ("NP", "ED", "HD"):
                raise SystemExit(f"tta: --hetpipe row {text!r}: policy must be NP, ED or HD, got {value!r}")
            outer["policy"] = value.upper()
            continue
        if key not in OUTER_KEYS or not value:
            raise SystemExit(f"tta: --hetpipe row {text!r}: {item!r} is not KEY=VALUE with KEY in "
                             f"{sorted([*OUTER_KEYS, *ROW_KEYS])}")
        field_name = OUTER_KEYS[key]
        kind = type(OUTER_DEFAULTS[field_name])
        try:
            outer[field_name] = kind(value)
        except ValueError:
            raise SystemExit(f"tta: --hetpipe row {text!r}: {key} must be a {kind.__name__}, got {value!r}") from None
    for key in ("noise", "nm", "policy", "costs"):
        if key in outer and "plan" not in outer:
            raise SystemExit(f"tta: --hetpipe row {text!r}: {key} is what plan=tta plans with; add plan=tta")
    try:
        check_outer(f"tta: --hetpipe row {text!r}", **{**OUTER_DEFAULTS, **outer_fields(outer)})
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return parts[0], int(parts[1]), outer


def outer_fields(outer: Dict[str, object]) -> Dict[str, object]:
    """A row's options less its wave rule and its planning: the PS's outer-optimizer fields."""
    return {k: v for k, v in outer.items() if k not in ROW_KEYS}


def variant_name(agg: str, d: int, outer: Dict[str, object]) -> Tuple[str, str]:
    """(key, label) of a hetpipe row: ``hetpipe-d1-mean`` and ``hetpipe D=1 (mean)`` under the plain rule,
    the outer optimizer's description added otherwise."""
    from hetpipe.plan.outer import OUTER_DEFAULTS, describe_outer

    shape = "; waves by speed" if outer.get("waves") == "speed" else ""       # the row's plan, not the PS's rule
    if outer.get("plan") == "tta":
        shape += "; plan for time to accuracy" + (f", noise {outer['noise']:g}" if "noise" in outer else "")
        shape += f", Nm {outer['nm']}" if "nm" in outer else ""
        shape += f", {outer['policy']} only" if "policy" in outer else ""
        shape += f", staleness costs {outer['costs']}" if "costs" in outer else ""
    opts = outer_fields(outer)
    if not outer:
        return f"hetpipe-d{d}-{agg}", f"hetpipe D={d} ({agg})"
    slug = "-".join(f"{k.replace('outer_', '')}{v}" for k, v in sorted(outer.items()))
    if not opts:
        return f"hetpipe-d{d}-{agg}-{slug}", f"hetpipe D={d} ({agg}{shape})"
    return f"hetpipe-d{d}-{agg}-{slug}", f"hetpipe D={d} ({agg}; {describe_outer({**OUTER_DEFAULTS, **opts})}{shape})"


def make_rows(s, systems: Sequence[str], variants: Sequence[Tuple[str, int, Dict[str, object]]],
              steps: int) -> Tuple[List[Row], float]:
    """The regime's rows and its budget (virtual seconds): ``steps`` steps of the baseline with the
    shortest step; every other row's steps are sized to cover it."""
    import vclock

    from hetpipe.plan.waves import with_waves

    rows = []
    for sysname in systems:
        b = vclock.baseline(s, sysname)
        if not b.fits:
            raise ValueError(f"{sysname}: {b.note}")
        rows.append(Row(sysname, LABELS[sysname], sysname, batch=b.windows, step_s=b.step_s,
                        batch_note=str(b.windows), note=f"{b.note}; step {b.step_s:.3f} s (" + ", ".join(
                            f"{k} {v:.3f}" for k, v in b.parts.items()) + ")"))
    budget = steps * min(r.step_s for r in rows)
    for r in rows:
        r.steps = math.ceil(budget / r.step_s - 1e-9)
    mb = s.task.minibatch
    for agg, d, outer in variants:
        rule = str(outer.get("waves", "equal"))
        own = (tta_plan(s, rule, outer.get("noise"), outer.get("nm"), d, str(outer.get("policy", "auto")),
                        str(outer.get("costs", "none")))
               if outer.get("plan") == "tta" else None)
        row_s = dataclasses.replace(s, plan=own) if own is not None else s
        nvw = len(row_s.plan.virtual_workers)
        n, wave = hetpipe_steps(row_s, d, budget, waves_rule=rule)
        lengths = with_waves(row_s.plan, rule).wave_minibatches
        batch = nvw * mb if agg == "mean" else mb
        key, label = variant_name(agg, d, outer)
        nm_note = f"Nm {row_s.plan.nm}" if rule == "equal" else f"Nm per VW {list(lengths)} (by speed)"
        planned = ""
        if own is not None:
            chosen = own.meta["time_to_accuracy"]
            planned = (f"; planned for time to accuracy at a noise scale of {chosen['noise_scale']:.4g} windows "
                       f"({chosen['noise_source']}): policy {own.policy}, devices "
                       f"{sorted(st.device for vw in own.virtual_workers for st in vw.stages)}")
        rows.append(Row(key, label, "hetpipe", d, agg, dict(outer), batch, step_s=wave, steps=n,
                        batch_note=(f"{batch} ({nvw} VWs x {mb} averaged)" if agg == "mean"
                                    else f"{mb} (each VW's, summed)"),
                        note=f"{nvw} VWs, {nm_note}, ~{wave:.3f} s per wave, {n // row_s.plan.nm} waves{planned}",
                        plan=own))
    return rows, budget


def tta_plan(s, rule: str, noise: Optional[float], nm: Optional[int] = None, d: int = 0, policy: str = "auto",
             costs: str = "none"):
    """The plan ``make_plan(objective="time-to-accuracy")`` makes on the regime's cluster and profile, at
    ``nm`` (default: the planner's own choice, as a job that sets no Nm gets it: the Nm of the largest goodput,
    the smallest among equals, so that at D >= 1, where a full pipeline's throughput stops growing with Nm,
    no more local staleness than the throughput needs), at the row's staleness bound ``d`` (a pipeline runs
    straight across waves at D >= 1 and fills and drains every wave at D = 0, so D sets the throughput it
    predicts), over ``policy``'s layouts and with the row's wave rule, for a noise scale of ``noise`` windows;
    None: measured as a job measures it (``Planning(objective="time-to-accuracy")``), by a pilot on the
    initial model and the first 128 minibatches of a stream no run reads; ``costs``: the planner's staleness
    costs (``none`` or ``fitted``, :func:`hetpipe.plan.efficiency.sample_cost`). ``meta["time_to_accuracy"]``
    gains the noise scale and where it came from."""
    from hetpipe.plan.planner import make_plan
    from hetpipe.run.pilot import measure_noise_scale
    from task import MinibatchStream, build_layers, loss_fn

    source = "given"
    if noise is None:
        noise = measure_noise_scale(build_layers(s.task, 0), loss_fn,
                                    MinibatchStream(s.text, s.task, NOISE_SEED + 1, count=128))
        source = "pilot on the initial model, 16 x 8 minibatches"
    plan = make_plan(s.cluster, s.prof, policy=policy, nm=nm, d=d, minibatch_size=s.task.minibatch,
                     objective="time-to-accuracy", noise_scale=noise, waves=rule, staleness_costs=costs)
    plan.meta["time_to_accuracy"] = {**plan.meta["time_to_accuracy"], "noise_scale": float(noise),
                                     "noise_source": source}
    return plan


def run_one(s, row: Row, lr: float, seed: int, evals: int, keep: Optional[list] = None) -> dict:
    """One run of ``row`` on the virtual clock; ``keep`` (a list) receives the weights at each point."""
    import vclock

    started = time.perf_counter()
    if row.system == "hetpipe":
        row_s = dataclasses.replace(s, plan=row.plan) if row.plan is not None else s
        outer = {**outer_fields(row.outer), **({"waves": row.outer["waves"]} if "waves" in row.outer else {})}
        points, run = vclock.run_hetpipe(row_s, row.steps, lr, seed, row.d, row.aggregate, evals, outer=outer)
        extra = {"staleness": {str(k): v for k, v in run.staleness().items()}}
    else:
        def on_point(p, layers) -> None:
            keep.append((p, [{k: v.detach().clone() for k, v in l.state_dict().items()} for l in layers]))

        points, _ = vclock.run_baseline(s, row.system, row.steps, lr, seed, evals,
                                        on_point=on_point if keep is not None else None)
        extra = {}
    end = points[-1][0]
    return {"key": row.key, "label": row.label, "lr": lr, "seed": seed, "points": [list(p) for p in points],
            "curve": [(t, l) for t, _, l in points], "end_s": end, "samples_per_s": points[-1][1] / end,
            "host_s": time.perf_counter() - started, **extra}


# --- the campaign ------------------------------------------------------------------------------------

def r1_setting(task, slowdown: float = SLOWDOWN, nm: Optional[int] = None, trials: int = 3,
               profile_file: Optional[Path] = None):
    """R1's setting: the model profiled on the emulated testbed (or its profile loaded from ``profile_file``
    when that exists), its memory scaled (see the module docstring), the plan made on it. Returns (setting,
    memory scale, bytes one device needs)."""
    import vclock
    from cluster_setup import make_plan, profile_device_model
    from task import MinibatchStream, build_layers, corpus, loss_fn, validation_set

    text, val, _ = corpus(task)
    x0, y0 = MinibatchStream(text, task, 0, 1)[0]
    provisional, _ = testbed_emulated(1.0)
    dm, prof, _ = profile_device_model(build_layers(task, 0), x0, lambda out: loss_fn(out, y0),
                                       f"bytegpt{task.blocks}x{task.width}", optimizer_factor=2.0,
                                       trials=trials, slowdown=slowdown, cluster=provisional,
                                       profile_file=profile_file)
    need = model_bytes(prof, task.minibatch)
    spec, scale = testbed_emulated(need)
    cluster = load_cluster(spec)
    plan, _ = make_plan(dm, prof, cluster, nm=nm, policy="auto")
    return vclock.Setting(task, text, validation_set(val, task), dm, prof, cluster, plan), scale, need


def campaign(name: str, s, rows: List[Row], budget: float, lrs: Sequence[float], seeds: Sequence[int], evals: int,
             header: List[str], out: Path, noise_groups: int, say, stamp: str = "full") -> dict:
    """Sweep, seeds, targets, noise scale, tables and figure of one regime."""
    say("\n".join(header))
    ref_keep: Dict[float, list] = {}
    for row in rows:
        for lr in lrs:
            keep = [] if row.key == REFERENCE else None
            r = run_one(s, row, lr, seeds[0], evals, keep)
            if keep is not None:
                ref_keep[lr] = keep
                best = min(ref_keep, key=lambda x: loss_at(next(q for q in row.runs + [r] if q["lr"] == x)["curve"],
                                                           budget))
                ref_keep = {best: ref_keep[best]}        # only the best rate's weights are kept
            row.runs.append(r)
            say(f"  {name} {row.label:<34} seed {seeds[0]} lr {lr:<7.3g} val loss {loss_at(r['curve'], budget):.3f} "
                f"at {budget:.0f} s (virtual), {r['samples_per_s']:.1f} samples/s, host {r['host_s']:.0f} s")
    best_lr = {row.key: min(row.runs, key=lambda r: loss_at(r["curve"], budget))["lr"] for row in rows}
    for seed in seeds[1:]:
        for row in rows:
            r = run_one(s, row, best_lr[row.key], seed, evals)
            row.runs.append(r)
            say(f"  {name} {row.label:<34} seed {seed} lr {r['lr']:<7.3g} val loss {loss_at(r['curve'], budget):.3f}, "
                f"host {r['host_s']:.0f} s")
    final = {row.key: [r for r in row.runs if r["lr"] == best_lr[row.key]] for row in rows}
    ref_run = next(r for r in final[REFERENCE] if r["seed"] == seeds[0])
    targets = choose_targets([r["curve"] for rs in final.values() for r in rs], budget, ref_run["curve"])
    # The gradient noise scale along the reference run: at its first validated point at or below each target.
    from task import build_layers

    noise = {}
    kept = ref_keep[best_lr[REFERENCE]]
    for tg in targets:
        p, states = next(((p, st) for p, st in kept if p[2] <= tg), kept[-1])
        layers = build_layers(s.task, seeds[0])
        for layer, st in zip(layers, states):
            layer.load_state_dict(st)
        noise[tg] = (noise_scale(layers, s, noise_groups, 8), p[0])
    stats = {}
    for row in rows:
        rs = final[row.key]
        thr = float(np.mean([r["samples_per_s"] for r in rs]))
        per = {}
        for tg in targets:
            times = [time_to_target(r["curve"], tg) for r in rs]
            smp = [None if t is None else samples_at(r["points"], t) for t, r in zip(times, rs)]
            per[tg] = {"times": times, "time": mean_sd(times), "samples": mean_sd(smp)}
        fin = [loss_at(r["curve"], budget) for r in rs]
        short = [r["seed"] for r in rs if r["end_s"] < budget * (1 - 1e-9)]
        stats[row.key] = {"thr": thr, "targets": per, "final": mean_sd(fin), "short": short}
    lines = [f"\n[{name}] runs on the VIRTUAL CLOCK (exact numerics, modelled time); {VALIDATION}",
             f"learning-rate sweep, seed {seeds[0]}: validation loss at the budget {budget:.1f} s (* = best)"]
    body = []
    for row in rows:
        cells = []
        for lr in lrs:
            r = next(r for r in row.runs if r["lr"] == lr and r["seed"] == seeds[0])
            cells.append(f"{loss_at(r['curve'], budget):.3f}" + (" *" if lr == best_lr[row.key] else ""))
        body.append([row.label] + cells)
    lines.append(table(["system"] + [f"lr {lr:.3g}" for lr in lrs], body))
    edge = [row.label for row in rows if len(lrs) > 1 and best_lr[row.key] in (min(lrs), max(lrs))]
    if edge:
        lines.append("best learning rate at the edge of the sweep: " + ", ".join(edge))
    l0 = ref_run["curve"][0][1]
    for tg in targets:
        b_noise, at = noise[tg]
        lines.append(f"\n[{name}] target {tg:.2f} nats/byte ({100 * (l0 - tg) / (l0 - targets[-1]):.0f}% of the "
                     f"drop from {l0:.2f} to the hardest target); gradient noise scale {fmt(b_noise, '.0f')} windows "
                     f"(reference {LABELS[REFERENCE]}, seed {seeds[0]}, at {at:.1f} s); times in VIRTUAL seconds, "
                     f"{len(seeds)} seed(s)")
        base = [row for row in rows if row.system != "hetpipe" and stats[row.key]["targets"][tg]["time"][0]]
        best = min(base, key=lambda row: stats[row.key]["targets"][tg]["time"][0]) if base else None
        body = []
        for row in rows:
            st = stats[row.key]["targets"][tg]
            m, sd = st["time"]
            up = (f"{stats[best.key]['targets'][tg]['time'][0] / m:.2f}x" if best and m else "-")
            body.append([row.label, f"{best_lr[row.key]:.3g}",
                         f"{fmt(m)} ± {fmt(sd)}", ", ".join(fmt(t) for t in st["times"]),
                         f"{fmt(st['samples'][0], '.0f')} ± {fmt(st['samples'][1], '.0f')}",
                         f"{stats[row.key]['thr']:.1f}", row.batch_note, fmt(b_noise, ".0f"), up])
        lines.append(table(["system", "lr", "time to target s (mean ± sd)", "per seed", "samples to target",
                            "samples/s", "batch per update", "B_noise", "vs best baseline"], body))
        if best:
            for row in rows:
                if row.system != "hetpipe":
                    continue
                bound = speedup_bound(stats[row.key]["thr"], stats[best.key]["thr"], row.batch, best.batch, b_noise)
                m = stats[row.key]["targets"][tg]["time"][0]
                got = stats[best.key]["targets"][tg]["time"][0] / m if m else None
                lines.append(f"  {row.label} vs {best.label}: bound {bound:.2f}x (throughput "
                             f"{stats[row.key]['thr'] / stats[best.key]['thr']:.2f}x x efficiency "
                             f"{efficiency(row.batch, b_noise, 1.0) / efficiency(best.batch, b_noise, 1.0):.2f}x at "
                             f"batches {row.batch} and {best.batch}), achieved {fmt(got, '.2f')}x")
    lines.append(f"\n[{name}] validation loss at the budget ({budget:.1f} virtual s), mean ± sd over "
                 f"{len(seeds)} seed(s)")
    body = [[row.label, f"{best_lr[row.key]:.3g}", f"{fmt(stats[row.key]['final'][0], '.3f')} ± "
             f"{fmt(stats[row.key]['final'][1], '.3f')}", f"{stats[row.key]['thr']:.1f}",
             ("ended before the budget (seeds %s)" % stats[row.key]["short"]) if stats[row.key]["short"] else ""]
            for row in rows]
    lines.append(table(["system", "lr", "val loss at budget", "samples/s", ""], body))
    say("\n".join(lines))
    png = out / f"tta-{stamp}-{name.lower()}.png"
    plot(final, rows, targets, budget, png, header[0])
    say(f"figure: {png.name}")
    return {"header": header, "budget_s": budget, "lrs": list(lrs), "seeds": list(seeds), "best_lr": best_lr,
            "targets": targets, "noise_scale": {str(k): v for k, v in noise.items()}, "tables": "\n".join(lines),
            "rows": [{**dataclasses.asdict(row), "runs": [{k: v for k, v in r.items() if k != "curve"}
                                                          for r in row.runs]} for row in rows],
            "stats": {k: {**v, "targets": {str(t): x for t, x in v["targets"].items()}} for k, v in stats.items()}}


def plot(final: Dict[str, List[dict]], rows: List[Row], targets: Sequence[float], budget: float, path: Path,
         title: str) -> None:
    """Validation loss against virtual time: per row the mean over seeds (line) and their range (band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, budget, 300)
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        ys = np.array([on_grid(r["curve"], grid) for r in final[row.key]])
        line, = ax.plot(grid, np.nanmean(ys, axis=0), "-" if row.system == "hetpipe" else "--",
                        label=f"{row.label} (lr {final[row.key][0]['lr']:.3g})")
        ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=line.get_color(), alpha=0.15)
    for tg in targets:
        ax.axhline(tg, color="grey", lw=0.7, ls=":")
    lo = min(float(np.nanmin(on_grid(r["curve"], grid))) for rs in final.values() for r in rs)
    ax.set_ylim(lo - 0.05, targets[0] + 1.0)
    ax.set_xlabel("VIRTUAL seconds (device and cluster model)")
    ax.set_ylabel("validation loss, nats/byte")
    ax.set_title(title[:110], fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny models, few steps, 1 seed, 2 learning rates")
    ap.add_argument("--regimes", default="r1,r2")
    ap.add_argument("--steps", help="optimizer steps of the fastest baseline in the budget: one number for every "
                                    "regime, or r1=N,r2=M (default r1=100,r2=1000; --quick: r1=40,r2=60)")
    ap.add_argument("--profile-trials", type=int, default=3,
                    help="profile the model this many times, each layer's fastest kept (--quick: 1)")
    ap.add_argument("--profile-dir", type=Path,
                    help="keep each regime's host profile here (r1-profile.json, r2-profile.json): a file already "
                         "there is used instead of profiling, so that runs made at different times share one "
                         "device model and their rows compare")
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--hetpipe", default="mean:0,mean:4",
                    help="hetpipe's rows, comma-separated: AGG:D, or AGG:D:KEY=VALUE+... to set the PS's outer optimizer "
                         "(KEY outer, lr, momentum, staleness, gain, delay; e.g. mean:1:gain=sqrt) or the VWs' waves "
                         "(waves=speed: each VW's wave proportional to its speed) or its plan (plan=tta: "
                         "make_plan(objective='time-to-accuracy')'s, at the noise scale a pilot measures or at "
                         "noise=B windows)")
    ap.add_argument("--baselines", help="the baselines to run, comma-separated, in every regime that has them "
                                        f"(default: all; {REFERENCE}, the noise scale's reference, is required): "
                                        + ", ".join(dict.fromkeys(R1_SYSTEMS + R2_SYSTEMS)))
    ap.add_argument("--r2-task", default="small", help="R2's task (run.py's --task)")
    ap.add_argument("--evals", type=int, default=16, help="validation points per run")
    ap.add_argument("--noise-groups", type=int, default=8, help="noise-scale measurements (8 gradients each)")
    ap.add_argument("--estimate", action="store_true", help="print the host-time estimate and stop")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    if args.quick:
        args.lrs = "1e-3,3e-3" if args.lrs == ap.get_default("lrs") else args.lrs
        args.seeds = "0" if args.seeds == ap.get_default("seeds") else args.seeds
        args.hetpipe = "mean:1" if args.hetpipe == ap.get_default("hetpipe") else args.hetpipe
        args.evals, args.noise_groups, args.profile_trials = min(args.evals, 8), min(args.noise_groups, 2), 1
    args.steps_of = {"r1": 40, "r2": 60} if args.quick else {"r1": 100, "r2": 1000}
    if args.steps:
        if "=" in args.steps:
            args.steps_of.update({k: int(v) for k, v in (x.split("=") for x in args.steps.split(","))})
        else:
            args.steps_of = {k: int(args.steps) for k in args.steps_of}
    args.baselines = parse_baselines(args.baselines)
    return args


def parse_baselines(text: Optional[str]) -> Optional[Tuple[str, ...]]:
    """``--baselines``: None (every baseline of each regime), else the named ones, refused in one line when a
    name is unknown or the reference run (the noise scale is measured along it) is left out."""
    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    known = list(dict.fromkeys(R1_SYSTEMS + R2_SYSTEMS))     # a name no regime runs would silently give no row
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"tta: --baselines: unknown baseline(s) {', '.join(unknown)} (known: {', '.join(known)})")
    if REFERENCE not in names:
        raise SystemExit(f"tta: --baselines {text}: {REFERENCE} is required (the gradient noise scale at each "
                         f"target is measured along its run)")
    return names


def regime_systems(all_systems: Sequence[str], chosen: Optional[Sequence[str]]) -> Tuple[Tuple[str, ...], List[str]]:
    """The regime's baselines to run (its own order) and those ``--baselines`` leaves out."""
    if chosen is None:
        return tuple(all_systems), []
    return tuple(x for x in all_systems if x in chosen), [x for x in all_systems if x not in chosen]


def profile_file(args, regime: str) -> Optional[Path]:
    """Where ``--profile-dir`` keeps ``regime``'s profile (None without it)."""
    return None if args.profile_dir is None else args.profile_dir / f"{regime}-profile.json"


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)
    import vclock

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = [parse_variant(v) for v in args.hetpipe.split(",") if v]
    say = lambda line: print(line, flush=True)  # noqa: E731
    started = time.time()
    stamp = "quick" if args.quick else "full"
    say(f"load average at start: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    results = {}
    for name in args.regimes.split(","):
        if name == "r1":
            task = TaskSpec(width=32, blocks=7) if args.quick else R1_TASK
            s, scale, need = r1_setting(task, trials=args.profile_trials, profile_file=profile_file(args, name))
            verdict = memory_verdicts(s.cluster, need)
            mem = "; ".join(f"{t} {cap / 2**20:.1f} MiB {'holds' if ok else 'CANNOT hold'}"
                            for t, (_, cap, ok) in verdict.items())
            where = (f"cluster hetpipe-testbed EMULATED (not the real testbed: a model this host can train could "
                     f"not fill a real GPU's memory): 16 devices of 4 types on 4 nodes, speeds by peak FP32 "
                     f"(fastest {TOP_SPEED:g} x host, times x {SLOWDOWN:g}), cpu-emulated-6's links, memories "
                     f"x {scale:.3g} (1/{1 / scale:.0f}): the model with Adam and one minibatch needs "
                     f"{need / 2**20:.1f} MiB: {mem}")
            systems = R1_SYSTEMS
        elif name == "r2":
            work = Path(tempfile.mkdtemp(prefix="hetpipe-tta-"))
            s = vclock.setting("small" if args.quick else args.r2_task, args.profile_trials, SLOWDOWN, work=work,
                               profile_file=profile_file(args, name))
            task = s.task
            need = model_bytes(s.prof, task.minibatch)
            mem = "; ".join(f"{t} {cap / 2**20:.1f} MiB {'holds' if ok else 'CANNOT hold'}"
                            for t, (_, cap, ok) in memory_verdicts(s.cluster, need).items())
            where = (f"cluster cpu-emulated-6 EMULATED (times x {SLOWDOWN:g}); the model with Adam and one minibatch "
                     f"needs {need / 2**20:.2f} MiB: {mem}")
            systems = R2_SYSTEMS
        else:
            raise SystemExit(f"tta: unknown regime {name!r} (r1, r2)")
        systems, left_out = regime_systems(systems, args.baselines)
        rows, budget = make_rows(s, systems, variants, args.steps_of[name])
        from hetpipe.plan.format import format_candidates, format_plan

        host = host_seconds(s)
        from task import build_layers, evaluate

        t0 = time.perf_counter()
        evaluate(build_layers(task, 0), *s.val)
        eval_s = time.perf_counter() - t0
        est = estimate_host_s(rows, s, host, len(lrs) + len(seeds) - 1, args.evals, eval_s)
        nparams = sum(p.numel() for l in build_layers(task, 0) for p in l.parameters())
        steps = args.steps_of[name]
        header = [
            f"[{name.upper()}] {'capacity-bound' if name == 'r1' else 'all-fit (negative control)'}; runs on the "
            f"VIRTUAL CLOCK: exact numerics in one process, times from the device and cluster model",
            f"[{name.upper()}] {where}",
            f"[{name.upper()}] model: byte-level GPT {task.blocks} blocks x {task.width}, {nparams} parameters, "
            f"{2 * task.blocks + 2} layers, minibatch {task.minibatch} windows of {task.context}; Adam",
            f"[{name.upper()}] plan: make_plan policy {s.plan.policy}, {len(s.plan.virtual_workers)} VWs, Nm "
            f"{s.plan.nm}, {len(s.plan.ps_shards)} PS shards",
            f"[{name.upper()}] budget {budget:.1f} virtual s = {steps} steps of the fastest baseline (scale "
            f"{steps / 2000:.3g} of the specified 2,000)",
            *([f"[{name.upper()}] baselines left out (--baselines): "
               + ", ".join(LABELS[x] for x in left_out)] if left_out else []),
            f"[{name.upper()}] host: {1e3 * host['step_1']:.1f} ms per one-minibatch step (forward, backward, Adam), "
            f"{1e3 * host['per_minibatch']:.1f} ms per minibatch in an 8-minibatch step, {eval_s:.2f} s per "
            f"validation; estimated host time of this regime {est / 60:.0f} min",
            *[f"[{name.upper()}]   {r.label}: batch per update {r.batch_note}; {r.steps} "
              f"{'minibatches per VW' if r.system == 'hetpipe' else 'steps'}; {r.note}" for r in rows],
            *[f"[{name.upper()}]   {line}" for r in rows if r.plan is not None
              for line in [f"{r.label}: the planner's candidates", *format_candidates(r.plan).splitlines()]]]
        if args.estimate:
            say("\n".join(header))
            say(format_plan(s.plan))
            continue
        results[name] = campaign(name.upper(), s, rows, budget, lrs, seeds, args.evals, header, out,
                                 args.noise_groups, say, stamp)
        results[name]["plan"] = json.loads(s.plan.to_json())
    if results:
        path = out / f"tta-{stamp}.json"
        path.write_text(json.dumps(results, indent=1, default=str))
        say(f"raw results: {path.name}; whole run {time.time() - started:.0f} s host time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
