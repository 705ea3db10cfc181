"""Validation-loss curves from recorded snapshots, and the two figures read off them.

A curve is a list of ``(t, loss)``, ``t`` in seconds of training wall time, in increasing ``t``.
Between two snapshots the loss is taken as linear in time: time to target is where that line first
crosses the target, the loss at the budget is the line's value there (the last snapshot's loss when
a run ended before the budget: that run's result carries its end time, so a table can say so).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

import snapshots
from hetpipe.model.weights import load_layer_weights
from task import TaskSpec, build_layers, evaluate

Curve = List[Tuple[float, float]]


def validation_curve(task: TaskSpec, seed: int, path: Path, x: torch.Tensor, y: torch.Tensor) -> Curve:
    """The validation loss of every snapshot in ``path`` (weights loaded into a fresh model of ``seed``)."""
    layers = build_layers(task, seed)
    out = []
    for t, weights in snapshots.load(path):
        if len(weights) != len(layers):
            raise ValueError(f"{path}: a snapshot at {t:.2f} s holds {len(weights)} of {len(layers)} layers")
        load_layer_weights(layers, weights)
        out.append((t, evaluate(layers, x, y)))
    return out


def time_to_target(curve: Curve, target: float) -> Optional[float]:
    """First time the piecewise-linear curve reaches ``target`` (None if it never does)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l0 <= target:
            return t0
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    if curve and curve[-1][1] <= target:
        return curve[-1][0]
    return None


def loss_at(curve: Curve, t: float) -> float:
    """The curve's value at time ``t`` (its last point's if it ends earlier)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def best_within(curve: Curve, t: float) -> float:
    """The lowest loss the curve reaches by time ``t`` (interpolated at ``t``)."""
    return min([l for s, l in curve if s <= t] + [loss_at(curve, t)])


def on_grid(curve: Curve, grid: Sequence[float]) -> np.ndarray:
    """The curve at each time of ``grid`` (NaN past its end), for averaging curves over seeds."""
    end = curve[-1][0]
    return np.array([loss_at(curve, t) if t <= end else np.nan for t in grid])
