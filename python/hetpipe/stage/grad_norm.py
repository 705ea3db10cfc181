"""A VW's global gradient norm: each stage's share exchanged among the VW's stages, per minibatch.

Contract: at Apply(p), after gathering minibatch ``p``'s gradients, every stage of the VW sends its
sum of squares (``StageModel.grad_sumsq``: a tied parameter counted once) to every other stage, as a
payload-free NORM message whose ``aux`` word carries the float64's bits, and waits for theirs; the
norm is ``sqrt`` of the sum, added in stage order so that every stage computes the same float. The
sends happen at Apply(p), which no stage reaches before its own Bwd(p); Bwd(p) never waits for
another stage's Apply, so the wait has no cycle (the argument of the tied gradients, docs/design.md).
Thread role: the stage's executor thread only.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import NORM, Header


def float_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float64).view(np.int64))


def bits_float(word: int) -> float:
    return float(np.array(word, dtype=np.int64).view(np.float64))


def clip_coef(max_norm: float, norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


class NormExchange:
    """This stage's end of the per-minibatch exchange (see the module docstring)."""

    def __init__(self, vw: int, stage: int, ranks: Sequence[int], transport: Transport) -> None:
        self.vw, self.stage, self.ranks, self.transport = vw, stage, list(ranks), transport
        self._in: Dict[Tuple[int, int], float] = {}          # (peer stage, minibatch) -> its sum of squares

    def send(self, p: int, sumsq: float) -> None:
        header = Header(NORM, self.vw, self.stage, p, float_bits(sumsq))
        for s, rank in enumerate(self.ranks):
            if s != self.stage:
                self.transport.send(rank, header)

    def norm(self, p: int, own: float) -> Optional[float]:
        """The VW's gradient norm of minibatch ``p`` once every peer's share arrived, else None."""
        for s, rank in enumerate(self.ranks):
            while s != self.stage and (s, p) not in self._in:
                msg = self.transport.try_recv(rank, NORM)
                if msg is None:
                    return None
                self._in[(s, msg.header.mb)] = bits_float(msg.header.aux)
        shares = [own if s == self.stage else self._in.pop((s, p)) for s in range(len(self.ranks))]
        return math.sqrt(sum(shares))

    def waiting_for(self, p: int) -> str:
        missing = [s for s in range(len(self.ranks)) if s != self.stage and (s, p) not in self._in]
        return f"the gradient-norm shares of minibatch {p} from stage(s) {missing}"
