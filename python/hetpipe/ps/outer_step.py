"""A Python shard's outer optimizer (:mod:`hetpipe.plan.outer`): how each push of a wave reaches the
shard's weights, and the state it keeps (docs/design.md, "Outer optimizer").

``outer="sgd"`` adds each push's ``delta / k`` times ``outer_lr`` to the weights as it is applied
(``hetpipe_core.apply_delta``; lr 1, no staleness scale: exactly the plain WSP rule); ``"nesterov"``
sums the wave's ``delta / k`` into ``A`` (in apply order) and, once the wave's pushes are in, takes
DiLoCo's outer step on the pseudo-gradient ``g = -A`` with the momentum buffer ``M`` (float32, one
per layer, part of the shard's state). ``k`` is the VW count with ``aggregate="mean"`` (else 1),
times ``1 + s`` with ``outer_staleness="inverse"``, ``s = c - v`` where ``v`` is the version the
pushing stage's pull of wave ``c`` got (wave 0 has no pull: ``s = 0``).
Thread role: the shard's one thread (part of :class:`~hetpipe.ps.shard.ShardState`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

import hetpipe_core


def initial_momentum(index: int, weights: Dict[int, np.ndarray], momentum: Optional[Dict[int, np.ndarray]],
                     nesterov: bool) -> Dict[int, np.ndarray]:
    """Per layer, the outer momentum buffer a shard starts with: ``momentum``'s (a checkpoint's) where it has
    the layer, else zeros; empty arrays unless ``nesterov``. ValueError naming the layer for a wrong size."""
    momentum = momentum or {}
    out = {}
    for l, w in weights.items():
        if not nesterov or l not in momentum:
            out[l] = np.zeros(w.size if nesterov else 0, dtype=np.float32)
            continue
        m = np.ascontiguousarray(momentum[l], dtype=np.float32).reshape(-1)
        if m.size != w.size:
            raise ValueError(f"PS shard {index}: the outer momentum of layer {l} has {m.size} elements, "
                             f"its weights {w.size}")
        out[l] = m.copy()
    return out


class OuterStep:
    """The outer optimizer of shard ``index`` over its weights ``W`` (layer -> flat float32, updated in
    place); ``options`` as :func:`hetpipe.plan.outer.check_outer` returns them."""

    def __init__(self, index: int, W: Dict[int, np.ndarray], num_vws: int, aggregate: str, options: Dict[str, Any],
                 momentum: Optional[Dict[int, np.ndarray]] = None) -> None:
        self.index, self.W, self.options = index, W, options
        self.nesterov = options["outer"] == "nesterov"
        self.scale = num_vws if aggregate == "mean" else 1     # every VW's divisor before the staleness scale
        self.M = initial_momentum(index, W, momentum, self.nesterov)
        # nesterov: per layer, the wave's aggregated delta A, summed before the outer step (reused).
        self.aggregated = {l: np.zeros_like(m) for l, m in self.M.items()}
        # outer_staleness "inverse": (vw, stage, wave) -> the version its pull got, until the wave is applied.
        self.pulled: Dict[Tuple[int, int, int], int] = {}

    def pulled_at(self, vw: int, stage: int, wave: int, version: int) -> None:
        """The pull of ``wave`` by VW ``vw`` stage ``stage`` got ``version`` (kept for its push's divisor)."""
        if self.options["outer_staleness"] == "inverse":
            self.pulled[(vw, stage, wave)] = version

    def version_of(self, vw: int, stage: int, wave: int) -> int:
        """The version the stage's pull of ``wave`` got (forgotten now; ``wave`` itself when none was
        kept: wave 0, or a staleness rule that needs none)."""
        return self.pulled.pop((vw, stage, wave), wave)

    def divisor(self, wave: int, version: int) -> int:
        """``k`` of a push of ``wave`` whose stage pulled ``version`` (module docstring)."""
        if self.options["outer_staleness"] != "inverse":
            return self.scale
        return self.scale * (1 + wave - version)

    def add(self, layer: int, delta: np.ndarray, k: int) -> None:
        """One push's ``delta`` of ``layer``, divided in place by ``k``: into the weights (sgd) or into
        the wave's aggregate (nesterov)."""
        if k > 1:
            np.divide(delta, np.float32(k), out=delta)
        if self.nesterov:
            self.aggregated[layer] += delta
        else:
            hetpipe_core.apply_delta(self.W[layer], delta, self.options["outer_lr"])

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
