"""A VW's global gradient norm: each stage's share exchanged among the VW's stages, per minibatch.

Contract: before Apply(p), after gathering minibatch ``p``'s gradients, every stage of the VW sends its
sum of squares (``StageModel.grad_sumsq``: a tied parameter counted once) to every other stage, as a
payload-free NORM message whose ``aux`` word carries the float64's bits, and receives theirs (the
stream's ``SendNorm`` and ``RecvNorm`` instructions, :mod:`hetpipe.schedule.messages`); the norm is
``sqrt`` of the sum, added in stage order so that every stage computes the same float. The sends
come after the stage's own Bwd(p); Bwd(p) never waits for another stage's Apply, so the wait has no
cycle (the argument of the tied gradients, docs/design.md).
Thread role: the stage's executor thread only.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import numpy as np

from hetpipe.transport.base import Transport
from hetpipe.transport.protocol import NORM, Header, StageError


def float_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float64).view(np.int64))


def bits_float(word: int) -> float:
    return float(np.array(word, dtype=np.int64).view(np.float64))


def clip_coef(max_norm: float, norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s factor: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (norm + 1e-6))


class NormExchange:
    """This stage's end of the per-minibatch exchange (see the module docstring), one message per peer
    as the stream's ``SendNorm`` / ``RecvNorm`` instructions say; each peer's shares arrive in
    minibatch order."""

    def __init__(self, vw: int, stage: int, ranks: Sequence[int], transport: Transport, who: str) -> None:
        self.vw, self.stage, self.ranks, self.transport, self.who = vw, stage, list(ranks), transport, who
        self._in: Dict[Tuple[int, int], float] = {}          # (peer stage, minibatch) -> its sum of squares

    def send(self, p: int, peer: int, sumsq: float) -> None:
        """Send stage ``peer`` this stage's share ``sumsq`` of minibatch ``p``'s squared norm."""
        self.transport.send(self.ranks[peer], Header(NORM, self.vw, self.stage, p, float_bits(sumsq)))

    def recv(self, p: int, peer: int) -> bool:
        """Receive stage ``peer``'s share of minibatch ``p``; False while it has not arrived."""
        msg = self.transport.try_recv(self.ranks[peer], NORM)
        if msg is None:
            return False
        if msg.header.mb != p:
            raise StageError(f"hetpipe: {self.who} expected the gradient-norm share of minibatch {p} from stage "
                             f"{peer}, got one of minibatch {msg.header.mb}")
        self._in[(peer, p)] = bits_float(msg.header.aux)
        return True

    def norm(self, p: int, own: float) -> float:
        """The VW's gradient norm of minibatch ``p``: every stage's share, ``own`` included, summed in
        stage order (the peers' received already)."""
        missing = [s for s in range(len(self.ranks)) if s != self.stage and (s, p) not in self._in]
        if missing:
            raise StageError(f"hetpipe: {self.who}: the Apply of minibatch {p} has no gradient-norm share from "
                             f"stage(s) {missing}; its stream must receive them (RecvNorm) first")
        shares = [own if s == self.stage else self._in.pop((s, p)) for s in range(len(self.ranks))]
        return math.sqrt(sum(shares))
