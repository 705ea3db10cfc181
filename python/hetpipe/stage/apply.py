"""``Apply(p)`` on a stage: minibatch ``p``'s gradients gathered (with the tied peers' gradients),
accumulated, checked finite, unscaled or skipped (fp16), clipped by the VW's norm, stepped
(docs/design.md, "Gradient norm, clipping, accumulation and fp16 loss scaling").

The gradients are gathered once, by the first of the minibatch's ``SendNorm`` and its ``Apply``.
When the VW's gradient norm is needed (clipping, fp16), the stream's ``SendNorm`` and ``RecvNorm``
before the Apply exchange the stages' shares (:class:`~hetpipe.stage.grad_norm.NormExchange`); the
Apply sums them. With accumulation the step comes every ``accumulate`` minibatches (and after the
last one) with the mean of their gradients; only those minibatches exchange shares.

Every step checks that the gradients are finite. When the run needs the norm on the host anyway
(clipping, fp16's verdicts), at the step; otherwise the squared norm stays on the device and is read
at the wave boundary with the stage's other readings (:mod:`hetpipe.stage.readings`): a non-finite
gradient then stops the run before the wave's update leaves the stage (its Push).
Thread role: the stage's executor thread.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

from hetpipe.stage.grad_norm import NormExchange, clip_coef
from hetpipe.stage.loss import LossHead
from hetpipe.stage.params import StageModel
from hetpipe.stage.readings import WaveReadings
from hetpipe.stage.settings import StageContext, StageRun
from hetpipe.stage.tied_exchange import TiedExchange
from hetpipe.stage.traffic import Blocked
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import StageError


class MinibatchStep:
    """The Apply of each minibatch on this stage. ``head``: the stage's losses (on the last stage, an
    overflowed fp16 loss skips the step even if the gradients look finite) and its fp16 verdicts;
    ``readings``: where a finiteness check waits for the wave boundary."""

    def __init__(self, ctx: StageContext, model: StageModel, run: StageRun, tied: TiedExchange, link: StageLink,
                 head: LossHead, blocked: Blocked, readings: WaveReadings) -> None:
        self.ctx, self.model, self.tied, self.losses, self.blocked = ctx, model, tied, head.losses, blocked
        self.readings = readings
        self.clip = run.clip_grad_norm
        self.verdicts = head.verdicts
        exchange = self.clip is not None or self.verdicts is not None
        self.norms = (NormExchange(ctx.vw, ctx.stage, [ctx.rank_of_stage(k) for k in range(ctx.num_stages)],
                                   link.transport, ctx.who()) if exchange and ctx.num_stages > 1 else None)
        self.grad_norms: Dict[int, float] = {}      # minibatch -> the VW's gradient norm (with clipping)
        # Minibatches gathered since the last step, and the last minibatch (a step follows it).
        self.accumulate, self._group = run.accumulate, 0
        self.last_minibatch = run.layout.num_minibatches - 1 if run.layout is not None else None
        self._gathered: Optional[Tuple[int, float]] = None     # (minibatch, own sum of squares) awaiting its step

    def stop_after(self, last_wave: int) -> None:
        """The run ends after wave ``last_wave``: its last minibatch takes the last step."""
        if self.last_minibatch is not None:
            self.last_minibatch = min(self.last_minibatch, (last_wave + 1) * self.model.nm - 1)

    def send_norm(self, p: int, micros: Sequence[int], peer: int) -> bool:
        """Send stage ``peer`` this stage's share of minibatch ``p``'s squared norm (gathering ``p``'s
        gradients first, once); never blocks (True)."""
        if self.norms is None:
            raise StageError(f"hetpipe: {self.ctx.who()}: its stream exchanges gradient-norm shares, but the run "
                             "neither clips by the VW's norm nor scales the loss")
        if self._gathered is None and not self._gather(p, micros, p // self.model.nm):
            raise StageError(f"hetpipe: {self.ctx.who()}: its stream exchanges gradient-norm shares at minibatch "
                             f"{p}, whose Apply only accumulates (accumulate={self.accumulate})")
        self.norms.send(p, peer, self._gathered[1])
        return True

    def recv_norm(self, p: int, peer: int) -> bool:
        """Receive stage ``peer``'s share of minibatch ``p``'s squared norm; False while it has not arrived."""
        if self.norms is None:
            raise StageError(f"hetpipe: {self.ctx.who()}: its stream exchanges gradient-norm shares, but the run "
                             "neither clips by the VW's norm nor scales the loss")
        if self.norms.recv(p, peer):
            return True
        self.blocked.on = f"the gradient-norm share of minibatch {p} from {self.ctx.who(peer)}"
        return False

    def apply(self, p: int, micros: Sequence[int]) -> bool:
        """Apply minibatch ``p`` (micro-batches ``micros``), its peers' tied gradients and norm shares
        received before (the stream's ``RecvTied`` and ``RecvNorm``); never blocks (True)."""
        wave = p // self.model.nm
        if self._gathered is None and not self._gather(p, micros, wave):
            return True                         # accumulating: the step comes with a later minibatch
        if self.clip is not None or self.verdicts is not None:
            own = self._gathered[1]
            norm = self.norms.norm(p, own) if self.norms is not None else math.sqrt(own)
            if self.verdicts is not None:
                scale = self.verdicts.verdict(p, wave, norm)
                if scale is None:
                    self._gathered = None
                    return True                 # skipped on every stage of the VW
                norm /= scale
            if self.clip is not None:
                self.grad_norms[p] = norm
                coef = clip_coef(self.clip, norm)
                if coef < 1.0:
                    self.model.scale_grads(coef)
        self._gathered = None
        self.model.step(wave)
        return True

    def _gather(self, p: int, micros: Sequence[int], wave: int) -> bool:
        """Gather ``p``'s gradients; True when a step follows now (with this stage's share of the norm)."""
        self.model.gather(micros, wave, self.tied.take(micros), accumulate=self._group > 0)
        self._group += 1
        if (p + 1) % self.accumulate and p != self.last_minibatch:
            return False
        if self._group > 1:
            self.model.scale_grads(1.0 / self._group)
        self._group = 0
        if self.clip is None and self.verdicts is None:
            # Nothing needs the norm on the host before the step (no share is exchanged): only its
            # finiteness is checked, at the wave boundary.
            self.readings.add(self.model.grad_sumsq(on_host=False), lambda own: self._check_finite(p, wave, own))
            self._gathered = (p, 0.0)
            return True
        own = self.model.grad_sumsq()
        if self.verdicts is None:
            self._check_finite(p, wave, own)
        is_last = self.ctx.stage == self.ctx.num_stages - 1
        if self.verdicts is not None and is_last and not math.isfinite(self.losses.get(p, 0.0)):
            own = math.inf                      # an overflowed loss skips the step even if its gradients look finite
        self._gathered = (p, own)
        return True

    def _check_finite(self, p: int, wave: int, own: float) -> None:
        if not math.isfinite(own):
            raise StageError(f"hetpipe: {self.ctx.who()}: the gradient of VW {self.ctx.vw}'s minibatch {p} "
                             f"(wave {wave}) is not finite (its squared norm on this stage is {own}); stopping "
                             "at the end of the wave, before its update leaves the stage")
