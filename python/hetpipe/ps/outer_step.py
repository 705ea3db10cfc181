"""A Python shard's outer optimizer (:mod:`hetpipe.plan.outer`): how each push of a wave reaches the
shard's weights, and the state it keeps (docs/design.md, "Outer optimizer").

Each push's delta is divided by its divisor ``k`` (:func:`push_divisor`: the gain times the staleness
decay, one float32 product) into ``u``. ``outer="sgd"`` adds ``u`` times ``outer_lr`` to the weights as
it is applied (``hetpipe_core.apply_delta``; lr 1, no decay, no gain: exactly the plain WSP rule);
``"nesterov"`` sums the wave's ``u`` into ``A`` (in apply order) and, once the wave's pushes are in,
takes DiLoCo's outer step on the pseudo-gradient ``g = -A`` with the momentum buffer ``M``;
``"delayed-nesterov"`` adds each ``u`` times ``outer_lr`` at once and sums it into ``A``, and every
``delay``-th push of a layer takes the momentum step ``M <- mu * M - A``, ``W <- W - lr * mu * M``.
``M`` (both), ``A`` and the count of pushes in it (delayed-nesterov) are float32 / integers per layer,
part of the shard's state (a checkpoint keeps them).
Thread role: the shard's one thread (part of :class:`~hetpipe.ps.shard.ShardState`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

import hetpipe_core
from hetpipe.plan.outer import has_momentum


def mean_divisor(num_vws: int, wave_minibatches: Optional[Sequence[int]], vw: int) -> np.float32:
    """VW ``vw``'s divisor under ``aggregate="mean"``: ``float32(N)``, or with waves of unequal length
    ``float32(S / n_v)`` (``n_v`` its minibatches per wave, ``S`` their sum; the quotient rounded to a
    double, then to float32, as the core's ``ShardPlane``): the VWs' deltas weighted by the samples
    behind them. With equal waves ``S / n_v`` is exactly ``N``."""
    if not wave_minibatches:
        return np.float32(num_vws)
    return np.float32(sum(wave_minibatches) / wave_minibatches[vw])


def push_divisor(num_vws: int, aggregate: str, options: Dict[str, Any], lag: int,
                 mean: Optional[np.float32] = None) -> np.float32:
    """``k`` of a push whose stage's pull lagged ``lag`` versions: ``float32(gain * decay)``, one rounding, where
    gain is ``mean`` (the pushing VW's :func:`mean_divisor`; default ``float32(N)``) with ``aggregate="mean"``
    (else 1), or ``sqrt(float32(N))`` (correctly rounded) with ``outer_gain="sqrt"``; decay is 1,
    ``float32(1 + lag)`` ("inverse") or ``sqrt(float32(1 + lag))`` ("sqrt"). The compiled core's
    ``push_divisor`` computes the same bits; with integer factors (the rules before the sqrt ones) ``k``
    is the exact integer ``N * (1 + lag)``."""
    n = np.float32(num_vws)
    if options["outer_gain"] == "sqrt":
        gain = np.sqrt(n)
    else:
        gain = (n if mean is None else mean) if aggregate == "mean" else np.float32(1)
    staleness = options["outer_staleness"]
    if staleness == "none":
        return gain
    decay = np.float32(1 + lag)
    if staleness == "sqrt":
        decay = np.sqrt(decay)
    return np.float32(gain * decay)


def _initial(index: int, what: str, weights: Dict[int, np.ndarray], given: Optional[Dict[int, np.ndarray]],
             kept: bool) -> Dict[int, np.ndarray]:
    """Per layer, a float32 buffer of the weights' size starting as ``given``'s (a checkpoint's) where it has
    the layer, else zeros; empty arrays unless ``kept``. ValueError naming the layer for a wrong size."""
    given = given or {}
    out = {}
    for l, w in weights.items():
        if not kept or l not in given:
            out[l] = np.zeros(w.size if kept else 0, dtype=np.float32)
            continue
        m = np.ascontiguousarray(given[l], dtype=np.float32).reshape(-1)
        if m.size != w.size:
            raise ValueError(f"PS shard {index}: the {what} of layer {l} has {m.size} elements, its weights {w.size}")
        out[l] = m.copy()
    return out


def initial_momentum(index: int, weights: Dict[int, np.ndarray], momentum: Optional[Dict[int, np.ndarray]],
                     kept: bool) -> Dict[int, np.ndarray]:
    """Per layer, the outer momentum buffer a shard starts with: ``momentum``'s (a checkpoint's) where it has
    the layer, else zeros; empty arrays unless ``kept`` (a rule with momentum). ValueError naming the
    layer for a wrong size."""
    return _initial(index, "outer momentum", weights, momentum, kept)


def initial_delayed(index: int, weights: Dict[int, np.ndarray], delayed: Optional[Tuple[Dict, Dict]],
                    kept: bool) -> Tuple[Dict[int, np.ndarray], Dict[int, int]]:
    """Per layer, delayed-nesterov's buffer ``A`` and its count of pushes a shard starts with: ``delayed``'s
    (a checkpoint's ``(buffers, counts)``) where it has the layer, else zeros; empty buffers unless ``kept``.
    ValueError naming the layer for a wrong size or a negative count."""
    buffers, counts = delayed or ({}, {})
    out = _initial(index, "outer buffer", weights, buffers, kept)
    count = {}
    for l in weights:
        n = int(counts.get(l, 0)) if kept else 0
        if n < 0:
            raise ValueError(f"PS shard {index}: the outer buffer of layer {l} counts {n} pushes")
        count[l] = n
    return out, count


class OuterStep:
    """The outer optimizer of shard ``index`` over its weights ``W`` (layer -> flat float32, updated in
    place); ``options`` as :func:`hetpipe.plan.outer.check_outer` returns them; ``momentum`` and
    ``delayed`` (``(buffers, counts)``): the state a checkpoint kept."""

    def __init__(self, index: int, W: Dict[int, np.ndarray], num_vws: int, aggregate: str, options: Dict[str, Any],
                 momentum: Optional[Dict[int, np.ndarray]] = None, delayed: Optional[Tuple[Dict, Dict]] = None,
                 wave_minibatches: Optional[Sequence[int]] = None) -> None:
        self.index, self.W, self.options = index, W, options
        self.num_vws, self.aggregate_rule = num_vws, aggregate
        self.nesterov = options["outer"] == "nesterov"
        self.delayed = options["outer"] == "delayed-nesterov"
        self.delay = options["outer_delay"] or num_vws          # delayed-nesterov: pushes per momentum step
        # per VW, its divisor under "mean" (N, or S / n_v with waves of unequal length)
        self.mean = [mean_divisor(num_vws, wave_minibatches, v) for v in range(num_vws)]
        # per VW, the audit's divisor (the pushes, not the step)
        self.scale = self.mean if aggregate == "mean" else [1] * num_vws
        self.M = initial_momentum(index, W, momentum, has_momentum(options))
        # delayed-nesterov: per layer, the pushes since its last momentum step (A) and how many they are.
        self.A, self.count = initial_delayed(index, W, delayed, self.delayed)
        # nesterov: per layer, the wave's aggregated delta A, summed before the outer step (reused).
        self.aggregated = self.A if self.delayed else {l: np.zeros_like(m) for l, m in self.M.items()}
        # a staleness decay: (vw, stage, wave) -> the version its pull got, until the wave is applied.
        self.pulled: Dict[Tuple[int, int, int], int] = {}

    def pulled_at(self, vw: int, stage: int, wave: int, version: int) -> None:
        """The pull of ``wave`` by VW ``vw`` stage ``stage`` got ``version`` (kept for its push's divisor)."""
        if self.options["outer_staleness"] != "none":
            self.pulled[(vw, stage, wave)] = version

    def version_of(self, vw: int, stage: int, wave: int) -> int:
        """The version the stage's pull of ``wave`` got (forgotten now; ``wave`` itself when none was
        kept: wave 0, or a staleness rule that needs none)."""
        return self.pulled.pop((vw, stage, wave), wave)

    def divisor(self, vw: int, wave: int, version: int) -> np.float32:
        """``k`` of VW ``vw``'s push of ``wave`` whose stage pulled ``version`` (:func:`push_divisor`)."""
        return push_divisor(self.num_vws, self.aggregate_rule, self.options, wave - version, self.mean[vw])

    def add(self, layer: int, delta: np.ndarray, k: np.float32) -> None:
        """One push's ``delta`` of ``layer``, divided in place by ``k``: into the weights (sgd), into
        the wave's aggregate (nesterov), or both (delayed-nesterov, then its momentum step when due)."""
        if k > 1:
            np.divide(delta, k, out=delta)
        if self.nesterov:
            self.aggregated[layer] += delta
            return
        hetpipe_core.apply_delta(self.W[layer], delta, self.options["outer_lr"])
        if self.delayed:
            self.A[layer] += delta
            self.count[layer] += 1
            if self.count[layer] >= self.delay:
                self._delayed_momentum(layer)

    def _delayed_momentum(self, layer: int) -> None:
        """delayed-nesterov's momentum step on ``layer`` (``A`` then zeroed, its count 0): ``M <- mu * M - A``,
        ``W <- W - lr * (mu * M)``, every operation one float32 rounding in this order (the core's
        ``outer_delayed_momentum`` computes the same bits)."""
        mu = np.float32(self.options["outer_momentum"])
        lr = np.float32(self.options["outer_lr"])
        a, m = self.A[layer], self.M[layer]
        self.count[layer] = 0
        if not a.size:
            return
        np.multiply(m, mu, out=m)
        m -= a
        step = np.multiply(m, mu)
        step *= lr
        self.W[layer] -= step
        a.fill(0)

    def end_wave(self) -> None:
        """Every push of the wave was added: nesterov's outer step on each layer's aggregate ``A`` (then
        zeroed for the next wave): ``g = -A``, ``M <- mu * M + g``, ``W <- W - lr * (g + mu * M)``, every
        operation one float32 rounding in this order (the core's ``outer_nesterov`` computes the same bits)."""
        if not self.nesterov:
            return
        mu = np.float32(self.options["outer_momentum"])
        lr = np.float32(self.options["outer_lr"])
        for l in self.W:
            a, m = self.aggregated[l], self.M[l]
            if not a.size:
                continue
            g = np.negative(a)
            np.multiply(m, mu, out=m)
            m += g
            step = np.multiply(m, mu)
            step += g
            step *= lr
            self.W[l] -= step
            a.fill(0)
