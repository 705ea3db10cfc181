"""Profiling a model on every device type of a world, each type on a rank that holds one, in parallel.

A collective: every rank of ``comm`` calls :func:`profile_on_devices` with the same discovery. The
lowest rank holding each device type measures the model there (:func:`hetpipe.model.measure.measure_layers`:
a real GPU one layer at a time, so a device too small for the whole model still measures it; an
emulated type on the host CPU, stretched to the type's speed as its pacer stretches training). Types
of the cluster that no rank holds are derived from the measured ones by speed ratio and marked
``derived``. Every rank returns the same profile; a rank whose measurement fails is named on all.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from hetpipe.job.discovery import Discovery
from hetpipe.model.measure import ModelMeasure, measure_layers
from hetpipe.plan.profile import ModelProfile
from hetpipe.util.errors import HetpipeError


class ProfilingError(HetpipeError, RuntimeError):
    """A rank could not measure the model on its device."""


def profilers(discovery: Discovery) -> Dict[str, int]:
    """Device type -> the rank that measures it (the lowest holding one)."""
    return {t: ranks[0] for t, ranks in sorted(discovery.type_holders().items())}


def profile_on_devices(comm: Any, model: Any, sample: Tuple[Any, Any], loss_fn: Callable, discovery: Discovery,
                       precision: str = "fp32", repeats: int = 5, name: str = "model") -> ModelProfile:
    """The model's profile on every device type of ``discovery.cluster`` (see the module docstring).

    ``sample`` is one minibatch ``(inputs, labels)``; ``loss_fn(output, labels)`` the training loss."""
    rank = comm.Get_rank()
    mine = [t for t, r in profilers(discovery).items() if r == rank]
    results: List[Tuple[str, Optional[ModelMeasure], str]] = []
    for t in mine:
        try:
            results.append((t, _measure_type(model, sample, loss_fn, discovery, t, rank, precision, repeats), ""))
        except Exception as e:  # noqa: BLE001 - relayed to every rank below
            results.append((t, None, f"{type(e).__name__}: {e}"))
    quiet_barrier(comm)
    everyone = [entry for part in comm.allgather(results) for entry in part]
    failed = [f"rank {profilers(discovery)[t]} could not profile {t}: {err}" for t, m, err in everyone if err]
    if failed:
        raise ProfilingError("hetpipe: " + "; ".join(failed))
    return merge(dict((t, m) for t, m, _ in everyone), discovery, name, precision=precision)


def quiet_barrier(comm: Any, poll_s: float = 0.005) -> None:
    """Wait for every rank without spinning: MPI's blocking collectives busy-poll, and a waiting rank
    sharing cores with a measuring one (emulated types, PS slots) would slow the measurement."""
    import time

    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


def _measure_type(model: Any, sample: Tuple[Any, Any], loss_fn: Callable, discovery: Discovery, type_name: str,
                  rank: int, precision: str, repeats: int) -> ModelMeasure:
    import torch

    holder = discovery.holders[rank]
    x, y = sample
    if holder.gpu is not None:
        device = torch.device("cuda", holder.gpu)
        y = y.to(device) if isinstance(y, torch.Tensor) else y
        # Measured on a copy, one layer on the device at a time: the rank's own model stays untouched.
        return measure_layers(copy.deepcopy(model), x, loss_fn=lambda out: loss_fn(out, y), repeats=repeats,
                              precision=precision, device=device)
    speed = discovery.cluster.device_types[type_name].speed
    return measure_layers(model, x, loss_fn=lambda out: loss_fn(out, y), repeats=repeats, precision=precision,
                          speed=speed)


def merge(measured: Dict[str, ModelMeasure], discovery: Discovery, name: str = "model",
          optimizer_factor: float = 1.0, precision: str = "fp32") -> ModelProfile:
    """One profile from per-type measurements: each measured type's own times (``derived`` false), the
    bytes of the first measured type with the largest workspace any type saw, and the cluster's other
    types derived by their speed ratio for ``precision`` (the one the types were measured at)."""
    cluster = discovery.cluster
    types = sorted(measured)
    first = measured[types[0]]
    layers = []
    for i, base in enumerate(first.layers):
        fwd = {t: measured[t].layers[i].fwd_s for t in types}
        bwd = {t: measured[t].layers[i].bwd_s for t in types}
        work = max(measured[t].layers[i].workspace_bytes for t in types)
        layers.append(replace(base, workspace_bytes=work).profile(fwd, bwd, {t: False for t in types}, optimizer_factor))
    peaks = ", ".join(f"{t} by rank {profilers(discovery)[t]}"
                      + (f" (peak {measured[t].peak_bytes} B)" if measured[t].peak_bytes else "") for t in types)
    unheld = sorted(set(cluster.device_types) - set(types))
    source = f"measured on each device type: {peaks}" + (
        f"; derived by speed ratio: {', '.join(unheld)}" if unheld else "")
    profile = ModelProfile(name=name, minibatch_size=first.minibatch_size, layers=tuple(layers),
                           input_bytes=first.input_bytes, source=source)
    if unheld:
        profile = profile.derive_types({t: dt.speed_for(precision) for t, dt in cluster.device_types.items()})
    return profile
