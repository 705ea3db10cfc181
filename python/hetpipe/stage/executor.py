"""The stage executor: runs one stage's instruction stream, in order, over a transport.

``step()`` executes instructions until one cannot proceed yet (a receive whose message has not
arrived, a Pull whose reply has not come) and returns whether it made progress. Between instructions
it also sends the next Pull's requests as soon as WSP lets the shards answer them (:func:`pull_points`)
and takes the replies that arrived, so that the Pull instruction itself only merges them. The multi-process
driver polls ``step()`` with a back-off and a deadline; the single-process replay round-robins the
``step()`` of every stage and shard. Both run exactly this code, so both compute the same numbers.

Thread role: one thread per executor. Lifetime: built once per run, ``finished`` after its stream
(which ends with ``Done``: the DONE messages to the PS shards) and the completion of its sends.

Every message the stage sends or receives is an instruction of its stream (``schedule.ir``; the run's
messages besides activations and gradients are inserted by ``schedule.messages``). The executor
dispatches each instruction to the collaborator owning it: the stage's values to and from its
neighbours (``stage.traffic``), its tied-gradient exchange (``stage.tied_exchange``), each
minibatch's norm exchange and Apply with clipping and fp16 verdicts (``stage.apply``), VW 0's
evaluation points and verdicts (``stage.evaluate``) and the early stop (``stage.early_stop``).
Every message goes through the stage's :class:`StageLink` (``transport.link``), which moves tensors device to device or
through pinned slots as the rank's transport backend allows. The wire codec lives in
``transport.codec``, the parameter-server client side in ``ps.client``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hetpipe.model.tree import batch_of, flatten, to_device
from hetpipe.schedule.ir import (Apply, Bwd, Done, Eval, Fwd, Instr, Pull, Push, Recompute, RecvAct, RecvGrad,
                                 RecvNorm, RecvTied, RecvVerdict, SendAct, SendGrad, SendNorm, SendTied, SendVerdict)
from hetpipe.schedule.messages import norm_exchange
from hetpipe.schedule.trace import TraceEvent
from hetpipe.stage.apply import MinibatchStep
from hetpipe.stage.early_stop import EarlyStop
from hetpipe.stage.evaluate import EvalPoints
from hetpipe.stage.loss import LossHead
from hetpipe.stage.loss_scale import LossScaleVerdict
from hetpipe.stage.pacer import Pacer
from hetpipe.stage.params import StageModel
from hetpipe.stage.readings import WaveReadings
from hetpipe.stage.settings import StageContext, StageIO, StageRun, StageTiming
from hetpipe.stage.tied_exchange import TiedExchange
from hetpipe.stage.traffic import Blocked, ValueChannel
from hetpipe.ps.client import PSClient
from hetpipe.transport.codec import rounded_by_wire, to_wire
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import ACT, GRAD, StageError

__all__ = ["StageContext", "StageError", "StageExecutor", "StageIO", "StageRun", "StageTiming", "pull_points"]


def pull_points(stream: Sequence[Instr], d: int) -> Dict[int, int]:
    """Where each Pull's requests may leave ahead of it: instruction index -> the wave whose pull is
    requested once that instruction ran (-1: before the first one).

    ``Pull(w)`` is answered once every VW pushed the waves ``< w - D`` (docs/design.md, "WSP semantics"),
    so its request leaves right after this stage's own ``Push(w - D - 1)``, and not before the previous
    Pull merged (one pull in flight). A Pull with nothing between that point and itself is requested by
    its own instruction. VW 0's evaluation points come right after a Push: a stop decided at the point
    after wave ``x`` cuts the waves above ``x + D + 1``, whose requests would follow ``Push(x + 1)``, so
    no request leaves for a Pull the stop removes."""
    pushed = {ins.wave: i for i, ins in enumerate(stream) if isinstance(ins, Push)}
    out: Dict[int, int] = {}
    previous = -1
    for j, ins in enumerate(stream):
        if not isinstance(ins, Pull):
            continue
        at = max(previous, pushed.get(ins.wave - d - 1, -1))
        if at < j - 1:
            out[at] = ins.wave
        previous = j
    return out


class StageExecutor:
    """Executes one stage's stream. See the module docstring for the stepping contract."""

    def __init__(self, ctx: StageContext, stream: Sequence[Instr], model: StageModel, link: StageLink,
                 io: StageIO, run: StageRun, timing: Optional[StageTiming] = None) -> None:
        self.ctx, self.stream, self.model, self.link = ctx, list(stream), model, link
        self.io, self.run = io, run
        self.timing = timing if timing is not None else StageTiming()
        self.pacer = self.timing.pacer if self.timing.pacer is not None else Pacer(None)
        self.layout = run.layout            # the stream's micro-batch arithmetic; None: micro-batch j is minibatch j
        self._grad_boundary = io.expect_out.grad_boundary() if io.expect_out is not None else None
        self._grad_in = io.expect_in.grad_boundary() if io.expect_in is not None and model.precision != "fp32" \
            else None
        self.is_first = ctx.stage == 0
        self.is_last = ctx.stage == ctx.num_stages - 1
        if self.is_last and io.loss_fn is None:
            raise ValueError(f"hetpipe: {ctx.who()} is the last stage and needs a loss function")
        self.pc = 0
        self.batch_sizes: Dict[int, int] = {}       # minibatch -> samples (set on every stage)
        self.ps = PSClient(ctx, model.ledger, link, run.d)
        self.finished = False
        self.blocked = Blocked()
        self.values = ValueChannel(ctx, link, model.device, self._minibatch, self.blocked)
        self.tied = TiedExchange(ctx, model, link, self.blocked)
        # What the stage reads of the device only at its wave boundaries (Push, Done): losses, finiteness.
        self.readings = WaveReadings()
        verdicts = LossScaleVerdict(run.loss_scale, model, ctx) if run.loss_scale is not None else None
        self.head = LossHead(ctx, model, io, verdicts, self._minibatch, self.readings)     # the last stage's losses
        self.steps = MinibatchStep(ctx, model, run, self.tied, link, self.head, self.blocked, self.readings)
        # VW 0's evaluation points, and the early stop they (or a STOPPED pull reply) may decide.
        self.evals = EvalPoints(run.evaluation if ctx.vw == 0 else None, ctx, model, io, self.values, link,
                                self.blocked)
        exchange = (lambda mb: norm_exchange(ctx.stage, ctx.num_stages, mb)) if self.steps.norms is not None else None
        self.early_stop = EarlyStop(self._minibatch, model.nm, exchange)
        self._recv_act: Dict[int, torch.Tensor] = {}
        self._recv_grad: Dict[int, torch.Tensor] = {}
        self._outputs: Dict[int, torch.Tensor] = {}
        self._in_grads: Dict[int, Optional[torch.Tensor]] = {}
        self._bwd_started: Dict[int, float] = {}
        # Instruction index -> the wave whose pull to request once it ran (empty: at the Pull instructions).
        self._ahead: Dict[int, int] = pull_points(self.stream, run.d) if run.pull_ahead else {}
        # Each instruction kind's handler: True once it ran, False while it cannot proceed yet.
        self._handlers: Dict[type, Callable[[Any], bool]] = {
            Fwd: self._fwd, Bwd: self._bwd, Recompute: self._recompute, Apply: self._apply,
            SendAct: self._send_act, SendGrad: self._send_grad,
            RecvAct: lambda i: self.values.recv(ACT, i.peer, i.mb, self._recv_act, io.expect_in, "activation"),
            RecvGrad: lambda i: self.values.recv(GRAD, i.peer, i.mb, self._recv_grad, self._grad_boundary, "gradient"),
            Push: self._push,
            Pull: lambda i: self._ps_step(self.ps.pull(i.wave)),
            SendTied: lambda i: self.tied.send(i.mb, i.peer),
            RecvTied: lambda i: self.tied.recv(i.mb, i.peer),
            SendNorm: lambda i: self.steps.send_norm(self._minibatch(i.mb), self._micros_of(self._minibatch(i.mb)),
                                                     i.peer),
            RecvNorm: lambda i: self.steps.recv_norm(self._minibatch(i.mb), i.peer),
            Eval: lambda i: self.evals.run(i.wave),
            SendVerdict: lambda i: self.evals.send_verdict(i.wave, i.peer),
            RecvVerdict: lambda i: self.evals.recv_verdict(i.wave, i.peer),
            Done: self._done,
        }

    # --- what the run reads of a stage ---------------------------------------------------------
    @property
    def blocked_on(self) -> str:
        """What the stage waits for when ``step()`` made no progress."""
        return self.blocked.on

    @property
    def losses(self) -> Dict[int, float]:
        """Last stage: minibatch -> its loss (set at the end of its wave: the losses are read from the
        device once per wave, ``stage.readings``; under "fp16" at its forward)."""
        return self.head.losses

    @property
    def lrs(self) -> Dict[int, float]:
        """Last stage: minibatch -> its step's learning rate."""
        return self.head.lrs

    @property
    def scaler(self) -> Any:
        """fp16: the VW's loss scale (this stage's copy), else None."""
        return self.run.loss_scale

    @property
    def clip_grad_norm(self) -> Optional[float]:
        return self.run.clip_grad_norm

    @property
    def grad_norms(self) -> Dict[int, float]:
        """Minibatch -> the VW's gradient norm (with clipping)."""
        return self.steps.grad_norms

    @property
    def eval_results(self) -> List[Dict[str, float]]:
        return self.evals.results

    @property
    def stopped_after(self) -> Optional[int]:
        """An early stop's last wave, once this stage knows it."""
        return self.early_stop.after

    @property
    def global_clock(self) -> int:
        """g of the latest Pull (the minimum over the shards pulled from)."""
        return self.ps.global_clock

    # --- driver interface ---------------------------------------------------------------------
    def step(self) -> bool:
        """Run instructions until blocked or finished; True if anything happened."""
        progressed = self.link.progress()
        progressed = self.tied.flush() or progressed
        progressed = self._pull_ahead(self.pc - 1) or progressed
        while self.pc < len(self.stream):
            instr = self.stream[self.pc]
            started = time.perf_counter()
            handler = self._handlers.get(type(instr))
            if handler is None:
                raise StageError(f"hetpipe: {self.ctx.who()} cannot execute {instr!r}")
            if not handler(instr):
                return self.link.progress() or self.evals.moved() or progressed
            if self.timing.trace is not None:
                self._record(instr, started)
            self.pc += 1
            progressed = True
            stop = self.evals.take_stop()
            if stop is not None:
                self.ps.stop_after = stop
                self._stop_after(stop)
            elif isinstance(instr, Pull) and self.ps.stopped:
                self._stop_after(instr.wave - 1)
            self._pull_ahead(self.pc - 1)
            self.link.progress()
        self.link.progress()
        if self.link.pending_sends():
            self.blocked.on = "completion of its outgoing messages"
            return progressed
        if not self.finished:
            self.finished = True
            progressed = True
        return progressed

    def wait_for_copies(self) -> bool:
        """Block (without spinning) until this stage's enqueued copies completed; False if there were none."""
        return self.link.wait_for_copies()

    def _record(self, instr: Instr, started: float) -> None:
        mb = getattr(instr, "mb", -1)
        wave = getattr(instr, "wave", -1)
        if mb >= 0:
            wave = self._minibatch(mb) // self.model.nm
        t0 = self.timing.t0
        if isinstance(instr, Pull) and self.ps.waits.get(wave, 0.0) > 0:
            # The time the Pull instruction waited for replies, before its last attempt found them all.
            wait = self.ps.waits[wave]
            self.timing.trace.append(TraceEvent(self.ctx.vw, self.ctx.stage, "WAIT", started - wait - t0, wait, -1,
                                                wave, f"wait for pull w{wave}"))
        self.timing.trace.append(TraceEvent(self.ctx.vw, self.ctx.stage, instr.code, started - t0,
                                            time.perf_counter() - started, mb, wave))

    def _stop_after(self, last: int) -> None:
        """End the stream after wave ``last`` (stage.early_stop)."""
        self.steps.stop_after(last)
        p = self.steps.last_minibatch
        self.stream = self.early_stop.truncate(self.stream, self.pc, last,
                                               None if p is None else self._micros_of(p)[-1])
        asked = self.ps.requested
        if asked is not None and Pull(asked) not in self.stream[self.pc:]:
            raise StageError(f"hetpipe: {self.ctx.who()} requested the pull of wave {asked}, which the stop "
                             f"after wave {last} removed")
        if self.run.pull_ahead:
            self._ahead = pull_points(self.stream, self.run.d)

    def _pull_ahead(self, ran: int) -> bool:
        """Once instruction ``ran`` ran: send the pull requests due after it, take the replies that
        arrived (module docstring). True if a reply was taken."""
        wave = self._ahead.get(ran)
        if wave is not None:
            self.ps.request(wave)
        return self.ps.poll()

    # --- instructions ---------------------------------------------------------------------------
    def _apply(self, instr: Apply) -> bool:
        p = self._minibatch(instr.mb)
        return self.steps.apply(p, self._micros_of(p))

    def _send_grad(self, instr: SendGrad) -> bool:
        g = self._in_grads.get(instr.mb)
        if g is None:
            raise StageError(f"hetpipe: {self.ctx.who()} has no input gradient for minibatch {instr.mb}")
        if self._grad_in is not None:
            # The gradient of a leaf widened on receipt is float32: it crosses back in the wire's half
            # type, as autograd rounds the gradient of a cast to it (the sender widens it again).
            g = to_wire(g, self._grad_in)
        if not self.values.send(GRAD, instr.peer, instr.mb, g):
            return False
        del self._in_grads[instr.mb]
        return True

    def _done(self, instr: Done) -> bool:
        """DONE to every shard, once the stage's device copies and queued tied gradients are out (and
        what is left of its readings was read)."""
        self.readings.read()
        if self.link.copies_pending():
            self.blocked.on = "its device copies"
            return False
        if self.tied.unsent:
            self.blocked.on = f"{self.link.waiting_for} to send tied gradients"
            return False
        self.ps.send_done()
        return True

    def _micros_of(self, p: int) -> Sequence[int]:
        """The micro-batches of minibatch ``p``."""
        return tuple(self.layout.micros_of(p)) if self.layout is not None else (p,)

    def _minibatch(self, mb: int) -> int:
        return self.layout.minibatch_of(mb) if self.layout is not None else mb

    def _fwd(self, instr: Fwd) -> bool:
        mb, started = instr.mb, time.perf_counter()
        data = to_device(self.io.inputs.get(mb), self.model.device) if self.io.inputs is not None else None
        side = data if isinstance(data, dict) else {}
        x = data if self.is_first else self._recv_act.pop(mb)
        p = self._minibatch(mb)
        self.batch_sizes[p] = self.batch_sizes.get(p, 0) + batch_of(x)
        out = self.model.forward(mb, x, needs_input_grad=not self.is_first, side=side)
        if self.is_last:
            self.head.forward(mb, out)
        else:
            self._outputs[mb] = out
        self.pacer.pad(started, self.timing.fwd_time)
        return True

    def _recompute(self, instr: Recompute) -> bool:
        """Rebuild ``mb``'s recomputed segments (a no-op on a stage that recomputes no layer); the
        last stage takes its loss from the rebuilt output. Its time counts towards ``Bwd(mb)``'s."""
        mb = instr.mb
        self._bwd_started[mb] = time.perf_counter()
        out = self.model.recompute_forward(mb)
        if self.is_last:
            self.head.recomputed(mb, out)
        return True

    def _bwd(self, instr: Bwd) -> bool:
        mb = instr.mb
        started = self._bwd_started.pop(mb, None) or time.perf_counter()
        if self.is_last:
            root, grad = self.head.root(mb), None
        else:
            root = self.model.output_of(mb)
            grad = self._recv_grad.pop(mb)
            self._outputs.pop(mb, None)
        grads = self.model.backward(mb, root, grad)
        if not self.is_first:
            # An input without floating leaves (token ids) still gets its (empty) gradient message.
            self._in_grads[mb] = grads if grads is not None else []
        self.pacer.pad(started, self.timing.bwd_time)
        return True

    def _send_act(self, instr: SendAct) -> bool:
        mb, peer = instr.mb, instr.peer
        leaves, spec = flatten(self._outputs[mb], f"layer {self.model.stop - 1}")
        expect = self.io.expect_out
        if expect is not None and spec != expect.spec:
            raise StageError(f"hetpipe: {self.ctx.who()}: layer {self.model.stop - 1} returned {spec} for "
                             f"minibatch {mb}, but {expect.spec} on the first minibatch")
        rounded: Sequence[int] = ()
        if self.model.precision != "fp32" and expect is not None:
            rounded, leaves = rounded_by_wire(leaves, expect), to_wire(leaves, expect)
        if not self.values.send(ACT, peer, mb, leaves, rounded):
            return False
        del self._outputs[mb]
        return True

    # --- parameter servers ------------------------------------------------------------------------
    def _push(self, instr: Push) -> bool:
        """``Push(w)``, the stage's wave boundary: its readings first (losses, finiteness checks: a
        non-finite value stops the run before the wave's update leaves the stage), then the push."""
        self.readings.read()
        return self._ps_step(self.ps.push(instr.wave))

    def _ps_step(self, done: bool) -> bool:
        """A Push or Pull's outcome (see :class:`PSClient`): when it cannot proceed yet, why."""
        if not done:
            self.blocked.on = self.ps.blocked_on
        return done
