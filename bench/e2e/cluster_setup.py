"""The cluster, device model and plan of a run, from hetpipe's own cluster preset, profiler and planner.

``make_device_model`` (the MLP) and ``profile_device_model`` (any list of layers) profile a model on
this host with ``hetpipe.model.measure.profile_model`` on the ``cpu-emulated-6`` preset (types derived by
speed ratio) and turn it into the ``DeviceModel`` every system pads to. ``make_plan`` calls ``hetpipe.plan.make_plan`` on that same
profile. Labels name each source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from devices import DeviceModel
from hetpipe.model.measure import profile_model
from hetpipe.plan import make_plan as hetpipe_make_plan
from hetpipe.plan.cluster import load_cluster
from hetpipe.plan.profile import ModelProfile
from hetpipe.plan.types import Plan
from model import ModelSpec, build_layers, loss_fn, synthetic_batches

CLUSTER = "cpu-emulated-6"


def make_device_model(spec: ModelSpec) -> Tuple[DeviceModel, ModelProfile, Any]:
    """(device model, the hetpipe profile it came from, the cluster spec) of the benchmark MLP."""
    x, y = synthetic_batches(spec, 1, spec.minibatch)[0]
    return profile_device_model(build_layers(spec), x, lambda out: loss_fn(out, y), f"mlp{spec.depth}x{spec.width}")


def profile_device_model(layers: Sequence[Any], x: Any, loss: Callable[[Any], Any], name: str,
                         optimizer_factor: float = 1.0, trials: int = 1,
                         slowdown: float = 1.0, cluster: Any = CLUSTER,
                         profile_file: Optional[Path] = None) -> Tuple[DeviceModel, ModelProfile, Any]:
    """Profile ``layers`` on one minibatch ``x`` (``loss(output)`` drives the backward) on this host, one
    thread, on ``cluster`` (an emulated cluster: a preset name, dict or spec; default the ``CLUSTER``
    preset): (device model, the hetpipe profile it came from, the cluster spec).

    ``trials`` > 1 profiles that many times and keeps each layer's fastest forward and backward: on a
    host shared with other work, a layer whose time was inflated by preemption in one profile is not
    emulated at that inflated time. ``slowdown`` multiplies every time (profile and device model alike):
    emulated devices that much slower than the preset's speeds, leaving the host room for the real
    work of every rank when other work loads it.

    ``profile_file``: where the measured profile (each layer's fastest of the trials, before
    ``slowdown``) is kept. When the file exists it is used instead of profiling, so that runs made at
    different times (under different loads) share one device model and their times compare; it must be
    this model's (name, layer count, minibatch size) on this cluster's device types, else ValueError
    naming what differs. When it does not exist, the profile is measured and written there."""
    where = f"cluster preset {cluster}" if isinstance(cluster, str) else f"cluster {load_cluster(cluster).name}"
    cluster = load_cluster(cluster)
    if profile_file is not None and Path(profile_file).exists():
        measured = ModelProfile.load(profile_file)
        check_saved_profile(measured, profile_file, name, len(layers), x.shape[0], sorted(cluster.device_types))
        how = f"loaded from {Path(profile_file).name} (measured by an earlier run), "
    else:
        measured = measure_profile(layers, x, loss, name, optimizer_factor, trials, cluster)
        if profile_file is not None:
            Path(profile_file).parent.mkdir(parents=True, exist_ok=True)
            measured.save(profile_file)
        how = f"fastest of {trials} profiles per layer, " if trials > 1 else ""
    prof = dataclasses.replace(measured, layers=tuple(
        dataclasses.replace(l, fwd_time={t: slowdown * v for t, v in l.fwd_time.items()},
                            bwd_time={t: slowdown * v for t, v in l.bwd_time.items()})
        for l in measured.layers))
    types = sorted(cluster.device_types)
    ref = types[0]
    speed = cluster.device_types[ref].speed
    how += f"times x {slowdown:g}, " if slowdown != 1 else ""
    dm = DeviceModel(devices=[(d.id, d.type) for d in cluster.devices], minibatch=prof.minibatch_size,
                     fwd={t: prof.fwd(t) for t in types}, bwd={t: prof.bwd(t) for t in types},
                     source=f"hetpipe.model.measure.profile_model on this host, {how}{where}",
                     host_fwd=[v * speed / slowdown for v in prof.fwd(ref)],
                     host_bwd=[v * speed / slowdown for v in prof.bwd(ref)])
    return dm, prof, cluster


def measure_profile(layers: Sequence[Any], x: Any, loss: Callable[[Any], Any], name: str, optimizer_factor: float,
                    trials: int, cluster: Any) -> ModelProfile:
    """``layers`` profiled ``trials`` times on this host (one thread), each layer's fastest forward and
    backward kept (a layer inflated by preemption in one trial is not kept at that time)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    profs = [profile_model(nn.Sequential(*layers), x, cluster, loss_fn=loss, optimizer_factor=optimizer_factor,
                           name=name) for _ in range(trials)]
    return dataclasses.replace(profs[0], layers=tuple(
        dataclasses.replace(l, fwd_time={t: min(p.layers[i].fwd_time[t] for p in profs) for t in l.fwd_time},
                            bwd_time={t: min(p.layers[i].bwd_time[t] for p in profs) for t in l.bwd_time})
        for i, l in enumerate(profs[0].layers)))


def check_saved_profile(prof: ModelProfile, path: Path, name: str, num_layers: int, minibatch: int,
                        types: Sequence[str]) -> None:
    """ValueError naming the file and what differs when a saved profile is not this model's on this cluster."""
    have = {t for l in prof.layers for t in l.fwd_time}
    for what, saved, wanted in (("model", prof.name, name), ("layer count", len(prof.layers), num_layers),
                                ("minibatch size", prof.minibatch_size, minibatch),
                                ("device types", sorted(have), sorted(types))):
        if saved != wanted:
            raise ValueError(f"profile file {path}: its {what} is {saved!r}, this run's is {wanted!r} (a profile of "
                             f"another model or cluster; remove the file to profile again)")


def memory_notes(dm: DeviceModel, prof: ModelProfile, cluster: Any, share: int) -> Dict[str, str]:
    """Per device type: does the whole model (weights, gradients, optimizer state, stashed activations
    of ``share`` samples) fit its memory? DDP and the standalone limit need that; they run regardless."""
    need = sum(l.param_bytes * 2 + l.optimizer_bytes + l.stash * share // prof.minibatch_size for l in prof.layers)
    out = {}
    for t in dm.types:
        cap = cluster.device_types[t].memory_bytes
        if need > cap:
            out[t] = f"whole model needs {need / 2**20:.0f} MiB > {t}'s {cap / 2**20:.0f} MiB"
    return out


def make_plan(dm: DeviceModel, prof: ModelProfile, cluster: Any, *, nm: int, policy: str) -> Tuple[Plan, str]:
    """hetpipe's planner on the profile (D = 0; the benchmark sets D per row), and a label naming it."""
    plan = hetpipe_make_plan(cluster, prof, policy=policy, nm=nm, d=0, minibatch_size=dm.minibatch)
    return plan, f"hetpipe.plan.make_plan (policy {plan.policy})"
