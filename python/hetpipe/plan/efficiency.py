"""Statistical efficiency: how much progress a sample buys at a batch size, from the gradient noise scale.

McCandlish et al. ("An Empirical Model of Large-Batch Training", 2018) model SGD's progress per step
at batch ``B`` through the *gradient noise scale* ``B_noise = tr(Sigma) / |G|^2`` (``G``: the true
gradient, ``Sigma``: the per-sample gradient covariance): below ``B_noise`` a larger batch buys almost
proportionally fewer steps, above it almost nothing. Its *simple estimator* needs only the squared
norms of two gradient estimates of one model, at batch sizes ``b_small < b_big``:

    |G|^2   ~  (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)
    tr(S)   ~  (|g_small|^2 - |g_big|^2) / (1 / b_small - 1 / b_big)

both unbiased; their ratio is biased and noisy, so (as Pollux/adaptdl do) each is averaged over many
measurements before dividing (:class:`NoiseScale`). ``b_small`` is typically one worker's batch and
``b_big`` the all-reduced one; here it is a minibatch and the mean over several.

Pollux (Qiao et al., OSDI'21) turns it into an *efficiency* of a batch ``M`` relative to a base batch
``M0``: ``E(M) = (B_noise + M0) / (B_noise + M)``, the fraction of the base batch's per-sample progress a
sample keeps at ``M`` (1 at ``M0``, falling as ``M`` passes ``B_noise``). Time to a target is then
predicted as ``samples_to_target(M0) / (E(M) x throughput(M))``: the *goodput* ``E(M) x throughput``
is what a plan should maximise.

No torch import: gradients come in as NumPy arrays (or anything ``np.asarray`` takes) or squared norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


def _check_batches(b_small: float, b_big: float) -> None:
    if not (0 < b_small < b_big):
        raise ValueError(f"hetpipe: the noise scale needs 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")


def gradient_estimates(small_sq: float, big_sq: float, b_small: float, b_big: float) -> "tuple[float, float]":
    """The simple estimator's unbiased ``(|G|^2, tr(Sigma))`` from the squared norms of a gradient at batch
    ``b_small`` and one at batch ``b_big`` of the same weights (see the module docstring)."""
    _check_batches(b_small, b_big)
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return float(g2), float(trace)


@dataclass
class NoiseScale:
    """Running means of the simple estimator's ``|G|^2`` and ``tr(Sigma)`` over measurements (each from
    two gradients of one set of weights), and their ratio ``B_noise`` in samples."""

    g2_sum: float = 0.0
    trace_sum: float = 0.0
    count: int = 0

    def add(self, small: Sequence, big, b_small: float, b_big: float) -> None:
        """One measurement: ``small`` (one gradient at batch ``b_small``, or several, each at ``b_small``:
        their squared norms are averaged) and ``big`` (the gradient at batch ``b_big``), flat or any shape."""
        smalls = [np.asarray(g, dtype=np.float64).ravel() for g in small]
        if not smalls:
            raise ValueError("hetpipe: a noise-scale measurement needs at least one small-batch gradient")
        small_sq = float(np.mean([g @ g for g in smalls]))
        b = np.asarray(big, dtype=np.float64).ravel()
        if any(g.size != b.size for g in smalls):
            raise ValueError(f"hetpipe: the gradients of one noise-scale measurement differ in size: "
                             f"{sorted({g.size for g in smalls})} and {b.size}")
        self.add_norms(small_sq, float(b @ b), b_small, b_big)

    def add_norms(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> None:
        g2, trace = gradient_estimates(small_sq, big_sq, b_small, b_big)
        self.g2_sum += g2
        self.trace_sum += trace
        self.count += 1

    @property
    def value(self) -> float:
        """``B_noise = tr(Sigma) / |G|^2`` of the means, in samples; inf while the mean ``|G|^2`` is not
        positive (the gradient is all noise at this precision: any batch is below the noise scale)."""
        if self.count == 0:
            raise ValueError("hetpipe: no noise-scale measurement yet")
        if self.g2_sum <= 0:
            return float("inf")
        return max(self.trace_sum, 0.0) / self.g2_sum


def noise_scale_of(pairs: Iterable["tuple[Sequence, object]"], b_small: float, b_big: float) -> float:
    """``B_noise`` from measurements ``(smalls, big)`` (see :meth:`NoiseScale.add`)."""
    acc = NoiseScale()
    for small, big in pairs:
        acc.add(small, big, b_small, b_big)
    return acc.value


def efficiency(batch: float, noise_scale: float, base_batch: float) -> float:
    """Pollux's statistical efficiency of a batch of ``batch`` samples per update relative to
    ``base_batch``: ``(B_noise + base) / (B_noise + batch)``, in (0, 1] for ``batch >= base_batch``."""
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"hetpipe: batch sizes must be positive, got batch={batch}, base_batch={base_batch}")
    if noise_scale < 0:
        raise ValueError(f"hetpipe: a noise scale is >= 0, got {noise_scale}")
    if noise_scale == float("inf"):
        return 1.0
    return (noise_scale + base_batch) / (noise_scale + batch)


def goodput(throughput: float, batch: float, noise_scale: float, base_batch: float) -> float:
    """Samples per second weighted by their efficiency: the base batch's samples per second it is worth."""
    return throughput * efficiency(batch, noise_scale, base_batch)
