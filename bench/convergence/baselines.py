"""The data-parallel baselines a user of a mixed cluster would pick instead of plain DDP: pure choices.

* :func:`fast_subset`: DDP on the fastest devices only. Candidates are the ``k`` fastest devices
  whose memory holds the model, ``k = 1 .. n``; the chosen one has the highest predicted throughput
  ``k x minibatch / (its slowest member's minibatch time)`` (ties: fewer devices). No other subset of
  the fitting devices predicts more: for any subset, the prefix ending at its slowest member is at
  least as large and no slower.
* :func:`batch_split`: heterogeneity-aware data parallelism. Each device's share of a step's windows
  is proportional to its speed (largest-remainder rounding, every device at least one window).
* :func:`weighted_loss`: the loss a rank backpropagates so that DDP's mean of the ranks' gradients is
  the gradient of the mean loss over all the step's windows, whatever each rank's share.

Plain lists of numbers in, plain numbers out: no torch, no device model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class Subset:
    """The chosen devices (indices into the device list, fastest first), their predicted samples/s, and
    every candidate ``(k, samples/s)`` that was compared."""

    devices: Tuple[int, ...]
    rate: float
    candidates: Tuple[Tuple[int, float], ...]


def speed_order(times: Sequence[float]) -> List[int]:
    """Device indices, fastest (shortest minibatch time) first; equal times keep the list's order."""
    return sorted(range(len(times)), key=lambda i: (times[i], i))


def fast_subset(times: Sequence[float], fits: Sequence[bool], minibatch: int) -> Subset:
    """The ``k`` fastest fitting devices with the highest ``k x minibatch / max time`` (see module docstring).

    ``times[i]``: device ``i``'s seconds for one minibatch (forward and backward of the whole model);
    ``fits[i]``: whether its memory holds the whole model. Raises ValueError if none fits."""
    if len(times) != len(fits):
        raise ValueError(f"fast_subset: {len(times)} times but {len(fits)} memory verdicts")
    if any(t <= 0 for t in times):
        raise ValueError(f"fast_subset: minibatch times must be > 0, got {list(times)}")
    order = [i for i in speed_order(times) if fits[i]]
    if not order:
        raise ValueError("fast_subset: no device's memory holds the model")
    cands = tuple((k, k * minibatch / times[order[k - 1]]) for k in range(1, len(order) + 1))
    top = max(r for _, r in cands)
    best_k = min(k for k, r in cands if r >= top * (1 - 1e-9))       # ties (within 1e-9): fewer devices
    return Subset(tuple(order[:best_k]), cands[best_k - 1][1], cands)


def batch_split(times: Sequence[float], total: int) -> List[int]:
    """Windows per device for one step of ``total`` windows, proportional to speed (``1 / times[i]``).

    Devices whose proportional share is below one window get one; the rest of ``total`` is shared
    among the others in proportion to speed, by largest remainder (ties: the faster device, then the
    earlier one). Raises ValueError if ``total`` is smaller than the number of devices."""
    n = len(times)
    if n == 0 or total < n:
        raise ValueError(f"batch_split: {total} windows cannot give each of {n} devices at least one")
    if any(t <= 0 for t in times):
        raise ValueError(f"batch_split: minibatch times must be > 0, got {list(times)}")
    speed = [1.0 / t for t in times]
    floor_one = set()
    while True:
        free = [i for i in range(n) if i not in floor_one]
        left = total - len(floor_one)
        s = sum(speed[i] for i in free)
        low = {i for i in free if left * speed[i] / s < 1}
        if not low:
            break
        floor_one |= low
    out = [1] * n
    share = {i: left * speed[i] / s for i in free}
    for i in free:
        out[i] = math.floor(share[i])
    rest = total - sum(out)
    for i in sorted(free, key=lambda i: (-(share[i] - out[i]), times[i], i))[:rest]:
        out[i] += 1
    return out


def proportional_shares(times: Sequence[float], total: int) -> List[float]:
    """The unrounded shares ``total x speed_i / sum of speeds`` that :func:`batch_split` rounds."""
    s = sum(1.0 / t for t in times)
    return [total / t / s for t in times]


def step_time(times: Sequence[float], windows: Sequence[int], minibatch: int) -> float:
    """Seconds of one data-parallel step: the slowest device's time for its windows (per-window linear)."""
    return max(t * w / minibatch for t, w in zip(times, windows))


def weighted_loss(mean_loss, windows: int, total: int, world: int):
    """The loss a rank holding ``windows`` of the step's ``total`` backpropagates: its windows' mean loss
    times ``windows / total`` (its share of the sum over all windows, over their count) times ``world``
    (DDP divides the summed gradients by the world size). With equal shares it is ``mean_loss`` itself.

    Every window has the same number of positions, so the mean over the step's windows is the mean of
    the per-window means, and the ranks' weighted gradients, averaged by DDP, are its gradient."""
    return mean_loss * (windows * world / total)
