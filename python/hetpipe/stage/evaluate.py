"""Evaluation points of VW 0: a forward-only pipelined pass over the evaluation data on VW 0's live
weights, and the verdict (go on, or stop early) that every stage of VW 0 waits for.

Contract (docs/design.md, "Evaluation and early stopping"). After Push(w) of each wave ``w`` with
``(w + 1) % every == 0`` (the last wave excepted), the streams of VW 0's stages hold ``Eval(w)``
(:mod:`hetpipe.schedule.messages`), which runs an :class:`EvalPass`: the stages that read inputs
(stage 0, and stages taking side inputs) read the evaluation minibatches; each stage runs its layers
forward on its live weights (no gradient, modules in eval mode, the run's precision) and sends the
output to the next stage as an EVAL message; the last stage computes the loss (and the metric) of
each minibatch, then asks ``decide`` (the run's callbacks). Its ``SendVerdict(w, s)`` instructions
then send the VERDICT to the other stages of VW 0, whose ``RecvVerdict`` wait for it: the wave after
which the run stops, or -1. A stop after wave ``w`` takes effect after wave ``w + D + 1``: under the
staleness bound another VW may have started waves up to that one, and every VW trains the same waves.

No wait cycle: a stage reaches its evaluation point after its Push(w), which needs from its
neighbours only what they send before their own Push(w) (activations, gradients, tied gradients and
norm shares of wave ``w``'s minibatches); evaluation messages flow forward only, and the verdict
flows from the last stage, which waits for nobody once its evaluation activations arrived.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from hetpipe.loader.source import INPUTS, LABELS
from hetpipe.model.tree import batch_of, flatten, to_device
from hetpipe.transport.codec import rounded_by_wire, to_wire
from hetpipe.transport.protocol import StageError
from hetpipe.transport.protocol import EVAL, VERDICT, Header


@dataclass
class Evaluation:
    """How VW 0 evaluates at the points its streams hold (``Eval``): on ``source`` (a DataSource; None:
    the evaluation point only decides), with ``metric(output, labels) -> float`` besides the loss;
    ``decide(wave, result) -> bool`` (on the last stage) says whether to stop; ``last_wave`` is the
    run's last wave and ``d`` its staleness bound (a stop takes effect ``d + 1`` waves later)."""

    source: Any
    last_wave: int
    d: int
    metric: Optional[Callable] = None
    decide: Optional[Callable[[int, Dict[str, float]], bool]] = None


class EvalPoints:
    """VW 0's evaluation points on one stage: the pass in progress, the results (last stage), the
    verdicts, and what the stage needs to run a pass: its context, model, feeds and loss (``io``, a
    ``StageIO``), its value messages (``values``, a ``ValueChannel``), its link and its ``blocked``."""

    def __init__(self, evaluation: Optional[Evaluation], ctx, model, io, values, link, blocked) -> None:
        self.evaluation = evaluation
        self.ctx, self.model, self.io, self.values, self.link, self.blocked = ctx, model, io, values, link, blocked
        self.is_first, self.is_last = ctx.stage == 0, ctx.stage == ctx.num_stages - 1
        self.results: List[Dict[str, float]] = []
        self._pass: Optional[EvalPass] = None
        self._moved = False                                  # a pass progressed without ending
        self._decided: Dict[int, Optional[int]] = {}         # last stage: wave -> the verdict (a stop, or None)
        self._stop: Optional[int] = None

    def run(self, wave: int) -> bool:
        """``Eval(wave)``: run the pass of wave ``wave`` until it blocks (False) or ends (True)."""
        if self.evaluation is None:
            raise StageError(f"hetpipe: {self.ctx.who()}: its stream evaluates after wave {wave}, but only VW 0's "
                             "stages of a run with eval_every have evaluation points")
        if self._pass is None:
            self._pass = EvalPass(self, self.evaluation, wave)
        progressed = self._pass.step()
        if not self._pass.done:
            self._moved = self._moved or progressed
            return False
        done, self._pass = self._pass, None
        if done.result is not None:
            self.results.append(done.result)
        if self.is_last:
            self._decided[wave] = self._stop = done.stop_after
        return True

    def moved(self) -> bool:
        """Whether a pass progressed without ending since the last call."""
        moved, self._moved = self._moved, False
        return moved

    def send_verdict(self, wave: int, peer: int) -> bool:
        """``SendVerdict(wave, peer)``: the last stage's verdict of wave ``wave`` to stage ``peer``."""
        stop = self._decided[wave]
        self.link.send_header(self.ctx.rank_of_stage(peer), Header(VERDICT, self.ctx.vw, self.ctx.stage, wave,
                                                                   -1 if stop is None else stop))
        return True

    def recv_verdict(self, wave: int, peer: int) -> bool:
        """``RecvVerdict(wave, peer)``: the verdict of wave ``wave`` from the last stage ``peer``; False
        while it has not arrived."""
        msg = self.link.transport.try_recv(self.ctx.rank_of_stage(peer), VERDICT)
        if msg is None:
            self.blocked.on = f"the evaluation verdict of wave {wave} from {self.ctx.who(peer)}"
            return False
        if msg.header.mb != wave:
            raise StageError(f"hetpipe: {self.ctx.who()} waits for the evaluation verdict of wave {wave}, got "
                             f"one of wave {msg.header.mb}")
        self._stop = msg.header.aux if msg.header.aux >= 0 else None
        return True

    def take_stop(self) -> Optional[int]:
        """The early stop the last ``Eval`` (last stage) or ``RecvVerdict`` decided, once; None: go on."""
        stop, self._stop = self._stop, None
        return stop


class EvalPass:
    """One evaluation point of one stage of VW 0 (see the module docstring); ``step()`` never blocks."""

    def __init__(self, points: EvalPoints, evaluation: Evaluation, wave: int) -> None:
        self.points, self.ev, self.wave = points, evaluation, wave
        src = evaluation.source
        self.count = src.minibatches_per_epoch() if src is not None else 0
        self.inputs: Optional[Iterator[Any]] = src.vw_stream(0, 1, 1, part=INPUTS) \
            if src is not None and points.io.inputs is not None else None
        self.labels: Optional[Iterator[Any]] = src.vw_stream(0, 1, 1, part=LABELS) \
            if src is not None and points.is_last else None
        self.next = 0                               # the next evaluation minibatch to run
        self._received: Dict[int, Any] = {}
        self._data: Any = None                      # the inputs read for minibatch ``next``
        self._unsent: Optional[Any] = None          # (leaves, rounded) of minibatch next - 1 waiting for a slot
        self.loss_sum = self.metric_sum = 0.0
        self.samples = 0
        self.result: Optional[Dict[str, float]] = None
        self.stop_after: Optional[int] = None       # the verdict: the last wave trained, None: go on
        self.done = False
        self._was_training = [m.training for layer in points.model.layers for m in layer.modules()]

    def step(self) -> bool:
        pt = self.points
        progressed = False
        if self._unsent is not None:
            if not pt.values.send(EVAL, pt.ctx.stage + 1, self.next - 1, *self._unsent):
                return False
            self._unsent, progressed = None, True
        while self.next < self.count:
            got = self._input()
            if got is None:
                return progressed
            out = self._forward(*got)
            if pt.is_last:
                self._score(out)
            else:
                leaves, _ = flatten(out, f"layer {pt.model.stop - 1}")
                rounded: Sequence[int] = ()
                if pt.model.precision != "fp32" and pt.io.expect_out is not None:
                    rounded, leaves = rounded_by_wire(leaves, pt.io.expect_out), to_wire(leaves, pt.io.expect_out)
                self.next += 1
                if not pt.values.send(EVAL, pt.ctx.stage + 1, self.next - 1, leaves, rounded):
                    self._unsent = (leaves, rounded)
                    return True
                progressed = True
                continue
            self.next += 1
            progressed = True
        return self._conclude() or progressed

    def _input(self) -> Any:
        """``(x, side inputs)`` of minibatch ``next``, or None while its activation has not arrived."""
        pt, i = self.points, self.next
        if self.inputs is not None and self._data is None:
            self._data = to_device(next(self.inputs), pt.model.device)
        if pt.is_first:
            x = self._data
        elif i in self._received or pt.values.recv(EVAL, pt.ctx.stage - 1, i, self._received,
                                                  pt.io.expect_in, "evaluation activation"):
            x = self._received.pop(i)
        else:
            return None
        side = self._data if isinstance(self._data, dict) else {}
        self._data = None
        return x, side

    def _forward(self, x: Any, side: Dict[str, Any]) -> Any:
        model = self.points.model
        for layer in model.layers:
            layer.eval()
        try:
            with torch.no_grad(), model.compute_context():
                for i, layer in enumerate(model.layers):
                    x = layer(x, **{k: side[k] for k in model.side_inputs[i]})
        finally:
            for m, training in zip((m for layer in model.layers for m in layer.modules()), self._was_training):
                m.train(training)
        return x

    def _score(self, out: Any) -> None:
        pt = self.points
        y = to_device(next(self.labels), pt.model.device)
        n = batch_of(y)
        with torch.no_grad(), pt.model.compute_context():
            loss = float(pt.io.loss_fn(out, y))
            metric = float(self.ev.metric(out, y)) if self.ev.metric is not None else 0.0
        self.loss_sum += loss * n
        self.metric_sum += metric * n
        self.samples += n

    def _conclude(self) -> bool:
        """After the last minibatch: the last stage scores the point and decides (its verdict goes out
        with the stream's SendVerdict instructions)."""
        if self.points.is_last:
            self.result = {"wave": self.wave, "samples": self.samples}
            if self.samples:
                self.result["loss"] = self.loss_sum / self.samples
                if self.ev.metric is not None:
                    self.result["metric"] = self.metric_sum / self.samples
            stop = bool(self.ev.decide(self.wave, self.result)) if self.ev.decide is not None else False
            after = self.wave + self.ev.d + 1
            self.stop_after = after if stop and after < self.ev.last_wave else None
        self.done = True
        return True
