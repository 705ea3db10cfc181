"""The stage executor: runs one stage's instruction stream, in order, over a transport.

``step()`` executes instructions until one cannot proceed yet (a receive whose message has not
arrived, a Pull whose reply has not come) and returns whether it made progress. The multi-process
driver polls ``step()`` with a back-off and a deadline; the single-process replay round-robins the
``step()`` of every stage and shard. Both run exactly this code, so both compute the same numbers.

Thread role: one thread per executor. Lifetime: built once per run, ``finished`` after its stream,
its pushes' completion and its DONE messages to the PS shards.

Every message goes through the stage's :class:`StageLink` (``transport.link``), which moves tensors
device to device or through pinned slots as the rank's transport backend allows. The wire codec
lives in ``transport.codec``, the parameter-server client side in ``ps.client``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from hetpipe.model.tree import Boundary, batch_of, check_message, flatten, pack, to_device, unpack
from hetpipe.schedule.ir import (Apply, Bwd, Fwd, Instr, Pull, Push, Recompute, RecvAct, RecvGrad, Schedule, SendAct,
                                 SendGrad)
from hetpipe.schedule.trace import TraceEvent
from hetpipe.stage.evaluate import EvalPass, Evaluation
from hetpipe.stage.feed import MinibatchFeed
from hetpipe.stage.grad_norm import NormExchange, clip_coef
from hetpipe.stage.loss_scale import TINY, LossScale
from hetpipe.stage.pacer import Pacer
from hetpipe.stage.params import StageModel
from hetpipe.ps.client import PSClient
from hetpipe.transport.codec import to_wire, value_header
from hetpipe.transport.protocol import StageError
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import ACT, EVAL, GRAD, KIND_NAMES, TIED, Header


@dataclass
class StageContext:
    """Where this stage sits: its VW and index, the ranks of its neighbours and PS shards."""

    vw: int
    stage: int
    num_stages: int
    rank_of_stage: Callable[[int], int]         # stage index in this VW -> rank
    shard_ranks: Dict[int, int]                 # PS shard index -> rank (shards owning this stage's layers)
    all_shard_ranks: Dict[int, int] = field(default_factory=dict)   # every PS shard (DONE goes to all)
    # How to name a rank in messages, where it is not just "rank R": its world rank and host, when
    # ranks were renumbered in plan order or the world spans several hosts.
    rank_names: Dict[int, str] = field(default_factory=dict)

    def who(self, stage: Optional[int] = None) -> str:
        s = self.stage if stage is None else stage
        r = self.rank_of_stage(s)
        return f"VW {self.vw} stage {s} ({self.rank_names.get(r, f'rank {r}')})"


class StageExecutor:
    """Executes one stage's stream. See the module docstring for the stepping contract."""

    def __init__(self, ctx: StageContext, stream: Sequence[Instr], model: StageModel, link: StageLink, *,
                 loss_fn: Optional[Callable] = None, inputs: Optional[MinibatchFeed] = None,
                 labels: Optional[MinibatchFeed] = None, expect_in: Optional[Boundary] = None,
                 expect_out: Optional[Boundary] = None, pacer: Optional[Pacer] = None,
                 fwd_time: float = 0.0, bwd_time: float = 0.0, trace: Optional[List[TraceEvent]] = None,
                 t0: float = 0.0, d: int = 0, layout: Optional[Schedule] = None,
                 clip_grad_norm: Optional[float] = None, evaluation: Optional[Evaluation] = None,
                 loss_scale: Optional[LossScale] = None, accumulate: int = 1) -> None:
        self.ctx, self.stream, self.model = ctx, list(stream), model
        # Micro-batch arithmetic of the stream (split start-up); None: micro-batch j is minibatch j.
        self.layout = layout
        self.link = link
        self.loss_fn, self.inputs, self.labels = loss_fn, inputs, labels
        self.expect_in, self.expect_out = expect_in, expect_out
        self._grad_boundary = expect_out.grad_boundary() if expect_out is not None else None
        self.pacer = pacer if pacer is not None else Pacer(None)
        self.fwd_time, self.bwd_time = fwd_time, bwd_time
        self.trace, self.t0 = trace, t0
        self.d = d
        self.is_first = ctx.stage == 0
        self.is_last = ctx.stage == ctx.num_stages - 1
        if self.is_last and loss_fn is None:
            raise ValueError(f"hetpipe: {ctx.who()} is the last stage and needs a loss function")
        self.pc = 0
        self.losses: Dict[int, float] = {}          # last stage: minibatch -> loss (set once all its halves ran)
        self.batch_sizes: Dict[int, int] = {}       # minibatch -> samples (set on every stage)
        self.lrs: Dict[int, float] = {}             # last stage: minibatch -> its step's learning rate
        self._partial_loss: Dict[int, float] = {}   # split minibatch -> weighted loss of its first half
        self._shares: Dict[int, float] = {}         # last stage: micro-batch -> its share of its minibatch
        self.ps = PSClient(ctx, model.ledger, link, d)
        self.finished = False
        self.blocked_on = ""
        self._recv_act: Dict[int, torch.Tensor] = {}
        self._recv_grad: Dict[int, torch.Tensor] = {}
        self._outputs: Dict[int, torch.Tensor] = {}
        self._losses_t: Dict[int, torch.Tensor] = {}
        self._in_grads: Dict[int, Optional[torch.Tensor]] = {}
        self._labels: Dict[int, torch.Tensor] = {}
        self._bwd_started: Dict[int, float] = {}
        self._done_sent = False
        # Tied parameters: per peer stage of this VW sharing some, their gradients of each minibatch,
        # sent after its Bwd and summed at its Apply (see StageModel.apply).
        self._tied_peers = sorted({s for k in model.tied_keys for s in model.tied_stages[k]} - {ctx.stage})
        self._tied_out: List[Tuple[int, int, torch.Tensor]] = []      # (peer, mb, flat) not yet sent
        self._tied_in: Dict[Tuple[int, int], torch.Tensor] = {}       # (peer, mb) -> flat received
        # Clipping by the VW's global gradient norm (stage.grad_norm); every Apply checks its gradients
        # are finite. _gathered: (minibatch, this stage's sum of squares) gathered, awaiting its step.
        self.clip_grad_norm = clip_grad_norm
        # "fp16": the VW's loss scale (stage.loss_scale); its overflow verdicts ride on the norm shares.
        self.scaler = loss_scale
        self._scaled_by: Dict[int, float] = {}     # last stage: minibatch -> the scale its loss was multiplied by
        exchange = clip_grad_norm is not None or loss_scale is not None
        self.norms = (NormExchange(ctx.vw, ctx.stage, [ctx.rank_of_stage(k) for k in range(ctx.num_stages)],
                                   link.transport) if exchange and ctx.num_stages > 1 else None)
        self._gathered: Optional[Tuple[int, float]] = None
        # Gradient accumulation: a step every ``accumulate`` minibatches (and after the last one) with the
        # mean of their gradients; _group: minibatches gathered since the last step.
        self.accumulate, self._group = accumulate, 0
        self._last_minibatch = layout.num_minibatches - 1 if layout is not None else None
        self.grad_norms: Dict[int, float] = {}      # minibatch -> the VW's gradient norm (with clipping)
        # VW 0's evaluation points (stage.evaluate): the pass in progress, the last stage's results, and
        # an early stop's last wave once known (from the verdict, or from a STOPPED pull reply).
        self.evaluation = evaluation if ctx.vw == 0 else None
        self._eval: Optional[EvalPass] = None
        self.eval_results: List[Dict[str, float]] = []
        self.stopped_after: Optional[int] = None

    @property
    def global_clock(self) -> int:
        """g of the latest Pull (the minimum over the shards pulled from)."""
        return self.ps.global_clock

    @property
    def pushes_sent(self) -> Dict[int, int]:
        """PS shard -> the pushes this stage sent to it."""
        return self.ps.pushes_sent

    # --- driver interface ---------------------------------------------------------------------
    def step(self) -> bool:
        """Run instructions until blocked or finished; True if anything happened."""
        progressed = self.link.progress()
        progressed = self._send_tied() or progressed
        while self.pc < len(self.stream):
            if self._eval is not None:
                progressed = self._eval.step() or progressed
                if not self._eval.done:
                    return self.link.progress() or progressed
                self._end_eval()
                continue
            instr = self.stream[self.pc]
            started = time.perf_counter()
            if not self._execute(instr):
                return self.link.progress() or progressed
            if self.trace is not None:
                self._record(instr, started)
            self.pc += 1
            progressed = True
            if isinstance(instr, Push) and self.evaluation is not None and self.evaluation.due(instr.wave):
                self._eval = EvalPass(self, self.evaluation, instr.wave)
            elif isinstance(instr, Pull) and self.ps.stopped:
                self._stop_after(instr.wave - 1)
            self.link.progress()
        if self.link.copies_pending():
            self.blocked_on = "its device copies"
            return self.link.progress() or progressed
        if self._tied_out:
            self.blocked_on = f"{self.link.waiting_for} to send tied gradients"
            return progressed
        if not self._done_sent:
            self.ps.send_done()
            self._done_sent = True
            progressed = True
        self.link.progress()
        if self.link.pending_sends():
            self.blocked_on = "completion of its outgoing messages"
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
        self.trace.append(TraceEvent(self.ctx.vw, self.ctx.stage, instr.code, started - self.t0,
                                     time.perf_counter() - started, mb, wave))

    # --- instructions ---------------------------------------------------------------------------
    def _execute(self, instr: Instr) -> bool:
        if isinstance(instr, Fwd):
            self._fwd(instr.mb)
        elif isinstance(instr, Bwd):
            self._bwd(instr.mb)
        elif isinstance(instr, Recompute):
            self._recompute(instr.mb)
        elif isinstance(instr, Apply):
            return self._apply(instr.mb)
        elif isinstance(instr, SendAct):
            leaves, spec = flatten(self._outputs[instr.mb], f"layer {self.model.stop - 1}")
            if self.expect_out is not None and spec != self.expect_out.spec:
                raise StageError(f"hetpipe: {self.ctx.who()}: layer {self.model.stop - 1} returned {spec} for "
                                 f"minibatch {instr.mb}, but {self.expect_out.spec} on the first minibatch")
            if self.model.precision != "fp32" and self.expect_out is not None:
                leaves = to_wire(leaves, self.expect_out)
            if not self._send_value(ACT, instr.peer, instr.mb, leaves):
                return False
            del self._outputs[instr.mb]
        elif isinstance(instr, SendGrad):
            g = self._in_grads.get(instr.mb)
            if g is None:
                raise StageError(f"hetpipe: {self.ctx.who()} has no input gradient for minibatch {instr.mb}")
            if not self._send_value(GRAD, instr.peer, instr.mb, g):
                return False
            del self._in_grads[instr.mb]
        elif isinstance(instr, RecvAct):
            return self._recv(ACT, instr.peer, instr.mb, self._recv_act, self.expect_in, "activation")
        elif isinstance(instr, RecvGrad):
            return self._recv(GRAD, instr.peer, instr.mb, self._recv_grad, self._grad_boundary, "gradient")
        elif isinstance(instr, Push):
            return self._ps_step(self.ps.push(instr.wave))
        elif isinstance(instr, Pull):
            return self._ps_step(self.ps.pull(instr.wave))
        else:
            raise StageError(f"hetpipe: {self.ctx.who()} cannot execute {instr!r}")
        return True

    def _minibatch(self, mb: int) -> int:
        return self.layout.minibatch_of(mb) if self.layout is not None else mb

    def _fwd(self, mb: int) -> None:
        started = time.perf_counter()
        data = to_device(self.inputs.get(mb), self.model.device) if self.inputs is not None else None
        side = data if isinstance(data, dict) else {}
        x = data if self.is_first else self._recv_act.pop(mb)
        p = self._minibatch(mb)
        self.batch_sizes[p] = self.batch_sizes.get(p, 0) + batch_of(x)
        out = self.model.forward(mb, x, needs_input_grad=not self.is_first, side=side)
        if self.is_last:
            self._labels[mb] = to_device(self.labels.get(mb), self.model.device)
            self._shares[mb] = self.labels.share(mb)
            loss = self._loss(mb, out)
            if not self.model.recomputes_output:
                self._losses_t[mb] = loss
            self._record_loss(mb, p, loss)
        else:
            self._outputs[mb] = out
        self.pacer.pad(started, self.fwd_time)

    def _loss(self, mb: int, out: torch.Tensor) -> torch.Tensor:
        """The loss micro-batch ``mb`` back-propagates: a half's (mean) loss weighted by its share of the
        minibatch's samples, so that the halves' gradients sum to the whole minibatch's. It is computed
        where the forward was (under autocast with "bf16"), as in a single-process autocast loop."""
        with self.model.compute_context():
            loss = self.loss_fn(out, self._labels[mb])
        share = self._shares[mb]
        return loss if share == 1.0 else loss * share

    def _record_loss(self, mb: int, p: int, loss: torch.Tensor) -> None:
        value = float(loss.detach())
        if not math.isfinite(value) and self.scaler is None:
            raise StageError(f"hetpipe: {self.ctx.who()}: the loss of VW {self.ctx.vw}'s minibatch {p} (wave "
                             f"{p // self.model.nm}) is {value}; stopping before its gradient reaches the weights")
        opt = self.model.optimizer
        if opt is not None and opt.param_groups:
            # The rate minibatch p's step takes (the scheduler stepped after the previous Apply).
            self.lrs[p] = float(opt.param_groups[0]["lr"])
        if self._shares[mb] == 1.0:
            self.losses[p] = value
        elif p in self._partial_loss:
            self.losses[p] = self._partial_loss.pop(p) + value
        else:
            self._partial_loss[p] = value

    def _recompute(self, mb: int) -> None:
        """Rebuild ``mb``'s recomputed segments (a no-op on a stage that recomputes no layer); the
        last stage takes its loss from the rebuilt output. Its time counts towards ``Bwd(mb)``'s."""
        self._bwd_started[mb] = time.perf_counter()
        out = self.model.recompute_forward(mb)
        if self.is_last and mb not in self._losses_t:
            self._losses_t[mb] = self._loss(mb, out)

    def _bwd(self, mb: int) -> None:
        started = self._bwd_started.pop(mb, None) or time.perf_counter()
        if self.is_last:
            if mb not in self._losses_t:
                raise StageError(f"hetpipe: {self.ctx.who()}: Recompute({mb}) must precede Bwd({mb})")
            root, grad = self._losses_t.pop(mb), None
            if self.scaler is not None:
                self._scaled_by[self._minibatch(mb)] = self.scaler.scale
                root = root * self.scaler.scale
            self._labels.pop(mb, None)
            self._shares.pop(mb, None)
        else:
            root = self.model.output_of(mb)
            grad = self._recv_grad.pop(mb)
            self._outputs.pop(mb, None)
        grads = self.model.backward(mb, root, grad)
        if not self.is_first:
            # An input without floating leaves (token ids) still gets its (empty) gradient message.
            self._in_grads[mb] = grads if grads is not None else []
        for peer in self._tied_peers:
            self._tied_out.append((peer, mb, self.model.tied_grad(mb, self.model.keys_shared_with(peer))))
        self._send_tied()
        self.pacer.pad(started, self.bwd_time)

    # --- tied parameters ----------------------------------------------------------------------
    def _send_tied(self) -> bool:
        """Send the queued tied gradients, in order, while pool slots are free; True if any was sent."""
        sent = False
        while self._tied_out:
            peer, mb, flat = self._tied_out[0]
            header = Header(TIED, self.ctx.vw, self.ctx.stage, mb, -1, "float32", tuple(flat.shape), flat.numel() * 4)
            if not self.link.send(self.ctx.rank_of_stage(peer), header, flat):
                return sent
            self._tied_out.pop(0)
            sent = True
        return sent

    def _apply(self, mb: int) -> bool:
        """Apply(mb) once every peer's tied gradients of the minibatch's micro-batches arrived (they
        were sent after each peer's own Bwd, which no stage's Apply precedes: no wait cycle), and,
        when clipping, every peer's share of the gradient norm (stage.grad_norm, the same argument).
        The gradients are gathered once and checked finite; a retry only waits for the shares."""
        p = self._minibatch(mb)
        micros = tuple(self.layout.micros_of(p)) if self.layout is not None else (p,)
        for peer in self._tied_peers if self._gathered is None else ():
            while any((peer, m) not in self._tied_in for m in micros):
                got = self.link.try_recv(self.ctx.rank_of_stage(peer), TIED)
                if got is None:
                    self.blocked_on = f"the tied-parameter gradients of minibatch {p} from {self.ctx.who(peer)}"
                    return False
                h, flat = got
                self._tied_in[(peer, h.mb)] = flat
        wave = p // self.model.nm
        if self._gathered is None:
            peer_grads = {peer: [self._tied_in.pop((peer, m)) for m in micros] for peer in self._tied_peers}
            self.model.gather(micros, wave, peer_grads, accumulate=self._group > 0)
            self._group += 1
            if (p + 1) % self.accumulate and p != self._last_minibatch:
                return True                     # accumulating: the step comes with a later minibatch
            if self._group > 1:
                self.model.scale_grads(1.0 / self._group)
            self._group = 0
            own = self.model.grad_sumsq()
            if self.scaler is None and not math.isfinite(own):
                raise StageError(f"hetpipe: {self.ctx.who()}: the gradient of VW {self.ctx.vw}'s minibatch {p} "
                                 f"(wave {wave}) is not finite (its squared norm on this stage is {own}); the "
                                 "weights were not updated with it")
            if self.scaler is not None and self.is_last and not math.isfinite(self.losses.get(p, 0.0)):
                own = math.inf                  # an overflowed loss skips the step even if its gradients look finite
            self._gathered = (p, own)
            if self.norms is not None:
                self.norms.send(p, own)
        if self.clip_grad_norm is not None or self.scaler is not None:
            own = self._gathered[1]
            norm = self.norms.norm(p, own) if self.norms is not None else math.sqrt(own)
            if norm is None:
                self.blocked_on = self.norms.waiting_for(p)
                return False
            if self.scaler is not None:
                scale = self._verdict(p, wave, norm)
                if scale is None:
                    return True                 # skipped on every stage of the VW
                norm /= scale
            if self.clip_grad_norm is not None:
                self.grad_norms[p] = norm
                coef = clip_coef(self.clip_grad_norm, norm)
                if coef < 1.0:
                    self.model.scale_grads(coef)
        self._gathered = None
        self.model.step(wave)
        return True

    def _verdict(self, p: int, wave: int, norm: float) -> Optional[float]:
        """fp16: minibatch ``p``'s verdict from the VW's (scaled) gradient norm. Overflow: the step is
        skipped (None); else the gradients are unscaled and the scale they had is returned. Either way
        the scale then follows GradScaler's rule."""
        scale = self.scaler.scale
        used = self._scaled_by.pop(p, scale)
        if used != scale:
            raise StageError(f"hetpipe: {self.ctx.who()}: minibatch {p}'s loss was scaled by {used}, but the VW's "
                             f"verdicts give {scale}")
        finite = math.isfinite(norm)
        self.scaler.update(p, finite)
        if finite:
            self.model.scale_grads(1.0 / scale)
            return scale
        self._gathered = None
        self.model.skip_step(wave)
        if self.scaler.scale < TINY:
            raise StageError(f"hetpipe: {self.ctx.who()}: VW {self.ctx.vw}'s gradients overflowed at every loss "
                             f"scale down to {self.scaler.scale} (minibatch {p}, wave {wave}, "
                             f"{len(self.scaler.skipped)} steps skipped): the model diverged, not only fp16's range")
        return None

    # --- evaluation and early stopping ------------------------------------------------------------
    def _end_eval(self) -> None:
        done, self._eval = self._eval, None
        if done.result is not None:
            self.eval_results.append(done.result)
        if done.stop_after is not None:
            self.ps.stop_after = done.stop_after
            self._stop_after(done.stop_after)

    def _stop_after(self, last: int) -> None:
        """End the stream after wave ``last``: drop what belongs to later waves (every stage of every
        VW drops the same minibatches, so no message is left unsent or unreceived)."""
        self.stopped_after = last
        self._last_minibatch = min(self._last_minibatch, (last + 1) * self.model.nm - 1) \
            if self._last_minibatch is not None else None

        def kept(instr: Instr) -> bool:
            if isinstance(instr, (Push, Pull)):
                return instr.wave <= last
            mb = getattr(instr, "mb", None)
            return mb is None or self._minibatch(mb) // self.model.nm <= last

        self.stream = self.stream[:self.pc] + [i for i in self.stream[self.pc:] if kept(i)]

    # --- stage-to-stage traffic -------------------------------------------------------------------
    def _send_value(self, kind: int, peer: int, mb: int, leaves: Sequence[torch.Tensor]) -> bool:
        """Start sending the tensor ``leaves`` of a value to stage ``peer`` as one message (see
        ``model.tree``); False (nothing sent) while no pool slot is free."""
        t = pack(leaves, self.model.device)
        header, nbytes = value_header(kind, self.ctx.vw, self.ctx.stage, mb, leaves, t)
        dest = self.ctx.rank_of_stage(peer)
        limit = self.link.slot_limit(dest)
        if limit is not None and nbytes > limit:
            p = self._minibatch(mb)
            raise StageError(f"hetpipe: {self.ctx.who()}: the {KIND_NAMES[kind]} of minibatch {p} of VW "
                             f"{self.ctx.vw} is {list(t.shape)} ({nbytes} bytes) but the stage's pinned slots hold "
                             f"{limit} bytes, sized by the first minibatch: minibatches must not "
                             "exceed the first one's size")
        sent = self.link.send(dest, header, t)
        if not sent:
            self.blocked_on = (f"{self.link.waiting_for} to send the {KIND_NAMES[kind]} of minibatch {mb} "
                               f"to {self.ctx.who(peer)}")
        return sent

    def _recv(self, kind: int, peer: int, mb: int, into: Dict[int, Any], expect: Boundary, what: str) -> bool:
        got = self.link.try_recv(self.ctx.rank_of_stage(peer), kind)
        if got is None:
            self.blocked_on = f"the {what} of minibatch {mb} from {self.ctx.who(peer)}"
            if self.link.waiting_for:
                self.blocked_on += f", blocked on {self.link.waiting_for}"
            return False
        h, buf = got
        if h.vw != self.ctx.vw or h.stage != peer or h.mb != mb:
            raise StageError(f"hetpipe: {self.ctx.who()} expected the {what} of minibatch {mb} from "
                             f"{self.ctx.who(peer)}, got one for minibatch {h.mb} from VW {h.vw} stage {h.stage}")
        problem = check_message(expect, h.dtype, h.shape, h.aux, h.nbytes)
        if problem is not None:
            raise StageError(f"hetpipe: shape mismatch between {self.ctx.who(peer)} and {self.ctx.who()}: the "
                             f"{what} of minibatch {mb} {problem}")
        leaves = unpack(buf, expect, h.shape[0] if len(expect.leaves) == 1 else h.aux)
        into[mb] = pytree.tree_unflatten(leaves, expect.spec) if kind in (ACT, EVAL) else leaves
        return True

    # --- parameter servers ------------------------------------------------------------------------
    def _ps_step(self, done: bool) -> bool:
        """A Push or Pull's outcome (see :class:`PSClient`): when it cannot proceed yet, why."""
        if not done:
            self.blocked_on = self.ps.blocked_on
        return done
