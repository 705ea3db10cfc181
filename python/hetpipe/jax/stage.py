"""One JAX pipeline stage executing its instruction stream (hetpipe.schedule) under WSP.

The stream is the same one the torch runtime executes (``hetpipe_schedule``: Nm minibatches in
flight, waves, Push and Pull placed for D). Each instruction runs to completion, waiting (with
back-off, never longer than the rank's timeout) for what it needs: a received activation or gradient,
a free pool slot, a pull's reply. Weight versions follow the spec (docs/design.md, "WSP semantics"):
``Fwd(p)`` keeps the weights it used, ``Bwd(p)`` differentiates those, ``Apply(p)`` steps the live
weights and tells the ledger, ``Pull(w)`` merges ``W_g`` with the stage's own later deltas.
Thread role: the rank's main thread.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from hetpipe.jax.model import FlatLayers, StageMath, jitted_step
from hetpipe.ps.client import PSClient
from hetpipe.ps.ledger import LedgerLayout, WaveLedger
from hetpipe.ps.worker import WorkerRank
from hetpipe.schedule.ir import Apply, Bwd, Fwd, Pull, Push, RecvAct, RecvGrad, SendAct, SendGrad
from hetpipe.transport.protocol import ACT, GRAD, Header, StageError


class JaxStage:
    """Stage ``rank.stage`` of VW ``rank.vw``: layers ``[start, stop)`` of ``flat``, trained on
    ``minibatches`` (this VW's ``(x, y)`` pairs) by ``stream``."""

    def __init__(self, rank: WorkerRank, flat: FlatLayers, stream: Sequence, minibatches: Sequence[Tuple[Any, Any]],
                 loss, optimizer, shapes: List[Tuple[Tuple[int, ...], str]]) -> None:
        plan = rank.plan
        st = plan.virtual_workers[rank.vw].stages[rank.stage]
        self.rank, self.stream, self.minibatches = rank, list(stream), minibatches
        self.start, self.stop, self.nm = st.start, st.stop, plan.nm
        self.first, self.last = rank.stage == 0, rank.stage == rank.num_stages - 1
        self.math = StageMath(flat, st.start, st.stop, loss if self.last else None, input_grad=not self.first)
        self.shape_in, self.shape_out = shapes[st.start], shapes[st.stop]
        for where, (shape, dtype) in (("enters", self.shape_in), ("leaves", self.shape_out)):
            crosses = (where == "enters" and not self.first) or (where == "leaves" and not self.last)
            if crosses and dtype != "float32":
                raise ValueError(f"hetpipe: {rank.who()}: the value that {where} it is {dtype}{list(shape)}; values "
                                 "between stages travel as float32")
        weights = jnp.asarray(np.concatenate(flat.vectors[st.start:st.stop]))
        layout = LedgerLayout.of_layers(st.start, st.stop, {l: flat.sizes[l] for l in range(st.start, st.stop)},
                                        {sh.index: sh.layers for sh in plan.ps_shards})
        self.ledger = WaveLedger(layout, weights, jnp.zeros(0, jnp.float32), who=rank.who())
        self.client = PSClient(rank, self.ledger, rank.link, plan.d)
        self.step_fn = jitted_step(optimizer)
        self.opt_state = optimizer.init(weights)
        self.losses: Dict[int, float] = {}
        self._inputs: Dict[int, Any] = {}           # mb -> received activation
        self._stash: Dict[int, Tuple[Any, Any]] = {}    # mb -> (weights, input) its forward used
        self._outputs: Dict[int, Any] = {}          # mb -> output to send
        self._grads_in: Dict[int, Any] = {}         # mb -> gradient of the output, received
        self._grads_out: Dict[int, Any] = {}        # mb -> gradient of the input, to send
        self._grads_w: Dict[int, Any] = {}          # mb -> gradient of the weights, for Apply

    def run(self) -> None:
        """Execute the whole stream, then tell the shards this stage is done."""
        for instr in self.stream:
            getattr(self, f"_{type(instr).__name__}")(instr)
        self.client.send_done()
        self.rank.close()

    # --- compute -------------------------------------------------------------------------------
    def _Fwd(self, i: Fwd) -> None:
        x = jnp.asarray(self.minibatches[i.mb][0]) if self.first else self._inputs.pop(i.mb)
        w = self.ledger.weights
        self._stash[i.mb] = (w, x)
        if self.last:
            self.losses[i.mb] = float(self.math.loss(w, x, jnp.asarray(self.minibatches[i.mb][1])))
            return
        y = self.math.forward(w, x)
        if (tuple(y.shape), str(y.dtype)) != self.shape_out:
            raise StageError(f"hetpipe: {self.rank.who()}: layers [{self.start}, {self.stop}) returned "
                             f"{y.dtype}{list(y.shape)} for minibatch {i.mb}, the model's shapes say "
                             f"{self.shape_out[1]}{list(self.shape_out[0])}")
        self._outputs[i.mb] = y

    def _Bwd(self, i: Bwd) -> None:
        w, x = self._stash.pop(i.mb)
        if self.last:
            gw, gx = self.math.loss_backward(w, x, jnp.asarray(self.minibatches[i.mb][1]))
        else:
            gw, gx = self.math.backward(w, x, self._grads_in.pop(i.mb))
        self._grads_w[i.mb] = gw
        if not self.first:
            self._grads_out[i.mb] = gx

    def _Apply(self, i: Apply) -> None:
        wave = i.mb // self.nm
        self.ledger.check_open(wave, lambda: f"Apply of minibatch {i.mb}")
        before = self.ledger.weights
        after, self.opt_state = self.step_fn(before, self._grads_w.pop(i.mb), self.opt_state)
        self.ledger.record_step(wave, after, before)
        self.ledger.weights = after

    # --- stage to stage ------------------------------------------------------------------------
    def _send(self, kind: int, mb: int, peer: int, value: Any) -> None:
        data = np.asarray(value, dtype=np.float32)
        header = Header(kind, self.rank.vw, self.rank.stage, mb, -1, "float32", tuple(data.shape), data.nbytes)
        dest = self.rank.rank_of_stage(peer)
        self.rank.wait(lambda: self.rank.link.send(dest, header, data),
                       lambda: f"{self.rank.link.waiting_for} to send minibatch {mb} to {self.rank.who(peer)}")

    def _recv(self, kind: int, mb: int, peer: int, shape: Tuple[int, ...]) -> Any:
        got: List[Tuple[Header, np.ndarray]] = []
        src = self.rank.rank_of_stage(peer)

        def attempt() -> bool:
            message = self.rank.link.try_recv(src, kind)
            if message is not None:
                got.append(message)
            return message is not None

        self.rank.wait(attempt, lambda: f"minibatch {mb}'s {'activation' if kind == ACT else 'gradient'} from "
                                        f"{self.rank.who(peer)}")
        h, payload = got[0]
        if h.mb != mb or tuple(h.shape) != tuple(shape):
            raise StageError(f"hetpipe: {self.rank.who()} expected minibatch {mb} as float32{list(shape)} from "
                             f"{self.rank.who(peer)}, got minibatch {h.mb} as {h.dtype}{list(h.shape)}")
        return jnp.asarray(payload)

    def _SendAct(self, i: SendAct) -> None:
        self._send(ACT, i.mb, i.peer, self._outputs.pop(i.mb))

    def _RecvAct(self, i: RecvAct) -> None:
        self._inputs[i.mb] = self._recv(ACT, i.mb, i.peer, self.shape_in[0])

    def _SendGrad(self, i: SendGrad) -> None:
        self._send(GRAD, i.mb, i.peer, self._grads_out.pop(i.mb))

    def _RecvGrad(self, i: RecvGrad) -> None:
        self._grads_in[i.mb] = self._recv(GRAD, i.mb, i.peer, self.shape_out[0])

    # --- parameter servers ---------------------------------------------------------------------
    def _Push(self, i: Push) -> None:
        self.rank.wait(lambda: self.client.push(i.wave), lambda: self.client.blocked_on)

    def _Pull(self, i: Pull) -> None:
        self.rank.wait(lambda: self.client.pull(i.wave), lambda: self.client.blocked_on)
