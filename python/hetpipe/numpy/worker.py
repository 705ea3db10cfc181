"""``WSPWorker``: one NumPy virtual worker of one stage, training under WSP through the PS shards.

The program owns the arithmetic; the worker owns the protocol (docs/design.md, "WSP semantics").
Minibatch ``p`` belongs to wave ``p // nm``; for each wave ``w`` the program calls::

    if w > 0:
        worker.pull(w)            # waits for global clock >= w - D, then weights <- W_g + own deltas >= g
    for each minibatch of wave w:
        worker.step(w, new)       # the weights after one optimizer step (a flat float32 vector)
    worker.push(w)                # the wave's delta to the shards
    ...
    worker.done()

``worker.weights`` is the live flat vector (layer by layer); ``worker.layer(l)`` a view of layer ``l``.
Thread role: one thread (the rank's main thread).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hetpipe.plan.types import Plan
from hetpipe.ps.client import PSClient
from hetpipe.ps.ledger import LedgerLayout, WaveLedger
from hetpipe.ps.serve import layer_vectors
from hetpipe.ps.worker import WorkerRank


class WSPWorker:
    """This rank's VW of ``plan`` (one stage holding every layer) over ``comm``, from ``layer_weights``
    (each layer's initial weights, the same on every rank, as PS ranks give ``serve_shard``)."""

    def __init__(self, comm, plan: Plan, layer_weights: Sequence, *, layer_buffers: Optional[Sequence] = None,
                 timeout: float = 60.0) -> None:
        weights = layer_vectors(plan, layer_weights, "weights")
        buffers = layer_vectors(plan, layer_buffers, "buffers") if layer_buffers is not None else \
            [np.zeros(0, np.float32)] * plan.num_layers
        nbytes = 4 * (sum(w.size for w in weights) + sum(b.size for b in buffers))
        self.rank = WorkerRank(comm, plan, nbytes, timeout=timeout)
        if self.rank.num_stages != 1:
            raise ValueError(f"hetpipe: the NumPy front end runs one-stage virtual workers; VW {self.rank.vw} has "
                             f"{self.rank.num_stages} stages (the JAX and torch front ends pipeline)")
        st = plan.virtual_workers[self.rank.vw].stages[0]
        self.start, self.stop = st.start, st.stop
        self.nm, self.d = plan.nm, plan.d
        self._offsets = np.cumsum([0] + [weights[l].size for l in range(st.start, st.stop)])
        self.weights = np.concatenate([weights[l] for l in range(st.start, st.stop)])
        self.buffers = np.concatenate([buffers[l] for l in range(st.start, st.stop)])
        layout = LedgerLayout.of_layers(st.start, st.stop, {l: weights[l].size for l in range(st.start, st.stop)},
                                        {sh.index: sh.layers for sh in plan.ps_shards},
                                        {l: buffers[l].size for l in range(st.start, st.stop)})
        self.ledger = WaveLedger(layout, self.weights, self.buffers, who=self.rank.who())
        self.client = PSClient(self.rank, self.ledger, self.rank.link, plan.d)
        self._next_push = 0

    @property
    def vw(self) -> int:
        return self.rank.vw

    def layer(self, layer: int) -> np.ndarray:
        """A view of layer ``layer``'s weights in the live vector."""
        i = layer - self.start
        return self.weights[self._offsets[i]:self._offsets[i + 1]]

    def step(self, wave: int, new_weights: np.ndarray) -> None:
        """The weights become ``new_weights`` (one optimizer step of wave ``wave``); the change joins the
        wave's delta. A ValueError names the VW when the shape or dtype differs from the weights'."""
        new = np.asarray(new_weights)
        if new.dtype != np.float32 or new.shape != self.weights.shape:
            raise ValueError(f"hetpipe: {self.rank.who()}: a step gave {new.dtype}{list(new.shape)}, the weights "
                             f"are float32{list(self.weights.shape)}")
        if np.shares_memory(new, self.weights):
            raise ValueError(f"hetpipe: {self.rank.who()}: a step's new weights must be a new array, not the live "
                             "weights changed in place (their change would be lost)")
        self.ledger.record_step(wave, new, self.weights)
        self.weights[...] = new

    def push(self, wave: int) -> None:
        """Send wave ``wave``'s delta to the shards (waves in order); returns once the payloads are copied out."""
        if wave != self._next_push:
            raise ValueError(f"hetpipe: {self.rank.who()} pushed wave {wave}; the next wave to push is "
                             f"{self._next_push}")
        self.rank.wait(lambda: self.client.push(wave), lambda: self.client.blocked_on)
        self._next_push += 1

    def pull(self, wave: int) -> int:
        """Wait until the global clock is at least ``wave - D``, merge the global weights; returns ``g``."""
        if wave > self._next_push:
            raise ValueError(f"hetpipe: {self.rank.who()} pulled wave {wave} before pushing wave {wave - 1}")
        self.rank.wait(lambda: self.client.pull(wave), lambda: self.client.blocked_on)
        return self.client.global_clock

    def done(self) -> None:
        """Tell every shard this worker finished; returns once every message left."""
        self.client.send_done()
        self.rank.close()
