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

import math
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


# --- What the efficiency leaves out: a plan's own staleness and the averaging of separate VWs ------------
#
# ``E(M)`` prices a batch of ``M`` samples per update as if every update were one synchronous step on
# the current weights. A HetPipe plan is not: (1) a pipeline's forward runs on weights lacking the
# updates of the minibatches still in flight; (2) each wave averages ``N`` separate trajectories of
# ``Nm`` local steps (each VW with its own optimizer state), not ``Nm`` steps of the mean gradient;
# (3) under WSP a VW's pull may lack up to ``D`` waves of the other VWs. Each costs samples on top of
# ``1 / E(M)``. :func:`sample_cost` is that factor, one term per cause:
#
#     cost = (1 + pipeline * tau) * (1 + averaging * (N - 1) / N * sqrt(Nm)) * (1 + wsp * D * (N - 1) / N * Nm)
#
# ``tau``: the plan's mean local staleness in updates, from the schedule (:func:`local_staleness`);
# ``(N - 1) / N``: the share of a wave's delta that comes from other VWs; ``sqrt(Nm)``: the averaged
# trajectories drift apart with the local steps between averages (sublinearly: the two measured points,
# Nm 1 and 4, give an exponent near 0.5); ``D * Nm``: the other VWs' local steps a pull may lack. The
# coefficients are empirical: :data:`FITTED_STALENESS_COSTS` were fitted on the time-to-accuracy
# benchmark's regime where every device holds the model and checked on the other regime's runs
# (bench/convergence/staleness_fit.py, docs/performance.md); :data:`NO_STALENESS_COSTS` gives 1 for
# every plan (Pollux's efficiency alone).


@dataclass(frozen=True)
class StalenessCosts:
    """The coefficients of :func:`sample_cost`, each >= 0: per update of local (pipeline) staleness,
    for the averaging of separate VWs, and per other-VW local step a pull may lack under WSP."""

    pipeline: float = 0.0
    averaging: float = 0.0
    wsp: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pipeline", "averaging", "wsp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ValueError(f"hetpipe: StalenessCosts.{name} must be a finite number >= 0, got {value!r}")

    @property
    def none(self) -> bool:
        return self.pipeline == 0 and self.averaging == 0 and self.wsp == 0

    def text(self) -> str:
        return f"pipeline {self.pipeline:g}, averaging {self.averaging:g}, wsp {self.wsp:g}"


NO_STALENESS_COSTS = StalenessCosts()
# Fitted by bench/convergence/staleness_fit.py on the committed 2,000-step runs of the regime where every
# device holds the model (byte-level GPT, Adam); a test refits them from those results.
FITTED_STALENESS_COSTS = StalenessCosts(pipeline=0.127, averaging=0.194, wsp=0.111)
STALENESS_COSTS = {"none": NO_STALENESS_COSTS, "fitted": FITTED_STALENESS_COSTS}


def staleness_costs(value) -> StalenessCosts:
    """A :class:`StalenessCosts` from itself, a name of :data:`STALENESS_COSTS` or ``"P,A,W"``."""
    if isinstance(value, StalenessCosts):
        return value
    if isinstance(value, str):
        if value in STALENESS_COSTS:
            return STALENESS_COSTS[value]
        parts = value.split(",")
        if len(parts) == 3:
            try:
                return StalenessCosts(*(float(p) for p in parts))
            except ValueError as e:
                if "StalenessCosts" in str(e):
                    raise
    raise ValueError(f"hetpipe: staleness costs are one of {', '.join(STALENESS_COSTS)} or three numbers "
                     f"'PIPELINE,AVERAGING,WSP' (each >= 0), got {value!r}")


def local_staleness(stage_counts: Sequence[int], nm: int) -> float:
    """The mean over a plan's stages of the updates a forward's weights lack: stage ``s`` of a VW of ``S``
    stages runs ``min(Nm, S - s)`` forwards before its first backward (the schedule's warm-up), so its
    forward of minibatch ``p`` follows the Apply of ``p - min(Nm, S - s)``: ``min(Nm, S - s) - 1`` of
    its own updates are missing. The mean over each VW's stages, averaged over the VWs."""
    if nm < 1 or not stage_counts or any(s < 1 for s in stage_counts):
        raise ValueError(f"hetpipe: local_staleness needs Nm >= 1 and stage counts >= 1, got {nm}, "
                         f"{list(stage_counts)}")
    per_vw = [sum(min(nm, s - k) - 1 for k in range(s)) / s for s in stage_counts]
    return sum(per_vw) / len(per_vw)


def sample_cost(stage_counts: Sequence[int], nm: int, d: int, costs: StalenessCosts) -> float:
    """How many times the samples of a synchronous step at the same batch per update a plan of VWs of
    ``stage_counts`` stages, ``nm`` minibatches per wave and staleness bound ``d`` needs (the formula
    above); exactly 1.0 under :data:`NO_STALENESS_COSTS`."""
    if costs.none:
        return 1.0
    n = len(stage_counts)
    others = (n - 1) / n
    tau = local_staleness(stage_counts, nm)
    return ((1 + costs.pipeline * tau) * (1 + costs.averaging * others * math.sqrt(nm))
            * (1 + costs.wsp * d * others * nm))
