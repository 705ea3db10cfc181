"""Weights recorded during training at wall-clock times, evaluated only after training ends.

A snapshot is ``(t, {layer index: flat float32 weights})`` with ``t`` in seconds since the run's
training start (``time.perf_counter`` is the system-wide monotonic clock on Linux, so times taken by
different ranks of one host compare). Recording costs a copy of the weights on the recording rank
(microseconds for this model); validation runs after the run, in the driver, so it never takes
wall-clock time from training. A system that records its model in parts (pipeline stages, PS shards)
records the same snapshot index on every part; :func:`merge` joins the parts, taking the latest time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import numpy as np

Snapshot = Tuple[float, Dict[int, np.ndarray]]


def merge(parts: Iterable[Dict[int, Snapshot]]) -> List[Snapshot]:
    """Snapshots ``{index: (t, weights of some layers)}`` of every part, joined per index (time: the latest
    part's); indices some part lacks are dropped."""
    parts = list(parts)
    common = set.intersection(*(set(p) for p in parts)) if parts else set()
    out = []
    for k in sorted(common):
        t = max(p[k][0] for p in parts)
        weights: Dict[int, np.ndarray] = {}
        for p in parts:
            weights.update(p[k][1])
        out.append((t, weights))
    return out


def save(path: Path, snaps: List[Snapshot]) -> None:
    arrays = {"times": np.array([t for t, _ in snaps], dtype=np.float64)}
    for k, (_, weights) in enumerate(snaps):
        for layer, w in weights.items():
            arrays[f"s{k}_l{layer}"] = w
    np.savez(path, **arrays)


def load(path: Path) -> List[Snapshot]:
    with np.load(path) as z:
        times = z["times"]
        per: List[Dict[int, np.ndarray]] = [{} for _ in times]
        for key in z.files:
            if key != "times":
                k, layer = key[1:].split("_l")
                per[int(k)][int(layer)] = z[key]
    return list(zip(times.tolist(), per))
