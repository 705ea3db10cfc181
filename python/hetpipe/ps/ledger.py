"""The wave ledger: the worker half of WSP's state, on a stage's flat float32 weight and buffer vectors.

A stage (of any front end: torch, JAX, NumPy) holds its layers' weights as one flat float32 vector:
each layer's weights in layer order, then replicas of tied parameters owned by layers outside the
stage (never pushed). Synced buffers (BatchNorm statistics) form a second flat vector. The ledger
(docs/design.md, "WSP semantics") keeps what the PS protocol needs of them:

* the delta of each wave not yet merged: ``record_step(w, after, before)`` adds ``after - before``
  to wave ``w``'s delta (an error once ``w`` was pushed, the update would be lost);
* the push layout: what Push(w) sends shard ``k`` (:meth:`push_payload`): the wave's delta of the
  shard's layers (their flat positions in layer order), then the current values of the shard's
  synced buffers, remembered for the merge of a later pull;
* the merge of a pull (:meth:`merge_pull`): shard ``k``'s weights and replicas become
  ``W_g + sum(delta_c for c >= g)`` (increasing ``c``), its synced buffers ``B_g`` plus this stage's
  own change since it pushed wave ``g - 1``; deltas every shard's ``W_g`` holds are dropped.

The arrays belong to the front end's family (:mod:`hetpipe.ps.arrays`): NumPy, torch and CuPy are
updated in place (``weights`` stays the same object, deltas are recycled); JAX's are immutable, so
``weights`` and ``buffers`` are rebound to new arrays after a merge and the front end reads them back.
Thread role: one thread (the stage's executor). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple


from hetpipe.ps.arrays import ArrayOps, ops_for


Runs = Tuple[Tuple[int, int], ...]      # (start, stop) ranges of a flat vector, in order, none adjacent


def runs_numel(runs: Runs) -> int:
    """The elements ``runs`` cover."""
    return sum(b - a for a, b in runs)


def _runs(pairs: Sequence[Tuple[int, int]]) -> Runs:
    """``(start, numel)`` pairs (in order) as ranges, adjacent ones merged."""
    out: List[Tuple[int, int]] = []
    for a, n in pairs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + n)
        else:
            out.append((a, a + n))
    return tuple(out)


@dataclass(frozen=True)
class LedgerLayout:
    """Where each PS shard's part lies in a stage's flat vectors, as ranges (a few per shard: one per
    run of the shard's layers, one per replica), never as per-element positions: a stage's index
    arrays would cost 8 bytes per weight, on the weights' device, beside the 4 of the weight itself.

    ``weights[k]``: the ranges of shard ``k``'s layers' weights (layer order); ``spans[k]`` the one
    ``(start, stop)`` of those when they are contiguous; ``replicas[k]``: the ranges of the replicas of
    parameters owned by shard ``k``'s layers; ``buffers[k]``: the ranges of shard ``k``'s synced
    buffers in the buffer vector."""

    numel: int
    buffer_numel: int
    weights: Mapping[int, Runs] = field(default_factory=dict)
    spans: Mapping[int, Tuple[int, int]] = field(default_factory=dict)
    replicas: Mapping[int, Runs] = field(default_factory=dict)
    buffers: Mapping[int, Runs] = field(default_factory=dict)

    @classmethod
    def of_layers(cls, start: int, stop: int, numels: Mapping[int, int], shard_layers: Mapping[int, Sequence[int]],
                  buffer_numels: Optional[Mapping[int, int]] = None,
                  replicas: Sequence[Tuple[int, int]] = ()) -> "LedgerLayout":
        """The layout of a stage holding layers ``[start, stop)``: ``numels[l]`` weights and
        ``buffer_numels[l]`` synced buffer elements of layer ``l``, then ``replicas`` as ``(owner layer,
        numel)`` in flat order; ``shard_layers[k]``: the layers PS shard ``k`` owns."""
        buffer_numels = buffer_numels or {}
        spans, bspans, off, boff = {}, {}, 0, 0
        for layer in range(start, stop):
            spans[layer] = (off, int(numels[layer]))
            bspans[layer] = (boff, int(buffer_numels.get(layer, 0)))
            off += spans[layer][1]
            boff += bspans[layer][1]
        rep_pos, roff = [], off
        for owner, n in replicas:
            rep_pos.append((owner, roff, int(n)))
            roff += int(n)

        weights, contiguous, reps, bufs = {}, {}, {}, {}
        for k, owned in shard_layers.items():
            mine = sorted(layer for layer in owned if start <= layer < stop and spans[layer][1] > 0)
            if mine:
                weights[k] = _runs([spans[layer] for layer in mine])
                if len(weights[k]) == 1:
                    contiguous[k] = weights[k][0]
            held = [(a, n) for owner, a, n in rep_pos if owner in owned and n > 0]
            if held:
                reps[k] = _runs(held)
            bl = sorted(layer for layer in owned if start <= layer < stop and bspans[layer][1] > 0)
            if bl:
                bufs[k] = _runs([bspans[layer] for layer in bl])
        return cls(roff, boff, weights, contiguous, reps, bufs)

    @property
    def pulled_shards(self) -> List[int]:
        """The PS shards the stage pulls from: those owning its layers' weights, buffers or replicas."""
        return sorted(set(self.weights) | set(self.replicas) | set(self.buffers))

    @property
    def pushed_shards(self) -> List[int]:
        return sorted(set(self.weights) | set(self.buffers))

    def pull_sizes(self, shard: int) -> Tuple[int, int, int]:
        """Elements of a Pull reply from ``shard``: weights, replicas, buffers (in that order)."""
        return tuple(runs_numel(d[shard]) if shard in d else 0 for d in (self.weights, self.replicas, self.buffers))

    def push_size(self, shard: int) -> int:
        nw, _, nb = self.pull_sizes(shard)
        return nw + nb


class WaveLedger:
    """The wave deltas, push payloads and pull merges of one stage over ``weights`` and ``buffers``
    (flat float32 vectors of one array family, laid out as ``layout`` says)."""

    def __init__(self, layout: LedgerLayout, weights: Any, buffers: Any, who: str = "stage") -> None:
        self.layout, self.who = layout, who
        self.ops: ArrayOps = ops_for(weights)
        for name, x, n in (("weights", weights, layout.numel), ("buffers", buffers, layout.buffer_numel)):
            if tuple(x.shape) != (n,) or "float32" not in str(x.dtype):
                raise ValueError(f"hetpipe: {who}'s {name} must be a flat float32 vector of {n} elements (the "
                                 f"parameter servers hold float32 weights), got {x.dtype}{list(x.shape)}")
        self.weights, self.buffers = weights, buffers
        self._weights, self._replicas, self._buffers = layout.weights, layout.replicas, layout.buffers
        self.deltas: Dict[int, Any] = {}                 # wave -> flat delta
        self._spare: List[Any] = []                      # deltas of merged waves, for reuse (in-place families)
        self.pushed: Set[int] = set()                    # waves whose delta was sent
        self._pushed_buffers: Dict[int, Any] = {}        # wave -> the synced buffers Push(wave) sent
        self.floor: Dict[int, int] = {k: 0 for k in layout.pulled_shards}     # shard -> last pulled g
        self.merges = 0                                  # pulls that changed the weights (a new version each)
        # Called with ``wave + 1`` after Push(wave) was sent (checkpoints: the optimizer holds waves <= wave).
        self.on_pushed: Optional[Callable[[int], None]] = None

    @property
    def pulled_shards(self) -> List[int]:
        return self.layout.pulled_shards

    @property
    def pushed_shards(self) -> List[int]:
        return self.layout.pushed_shards

    def pull_sizes(self, shard: int) -> Tuple[int, int, int]:
        return self.layout.pull_sizes(shard)

    # --- steps ---------------------------------------------------------------------------------
    def check_open(self, wave: int, what: Callable[[], str]) -> None:
        """RuntimeError naming ``what()`` once wave ``wave`` was pushed: an update to it would be lost.
        (``what`` is only called then: the check runs once per minibatch.)"""
        if wave in self.pushed:
            raise RuntimeError(f"hetpipe: {self.who}: {what()} after Push({wave}): wave {wave}'s delta was already "
                               "sent, so this update would be lost")

    def record_step(self, wave: int, after: Any, before: Any, scratch: Any = None) -> None:
        """Add ``after - before`` (the weights after and before one optimizer step) to wave ``wave``'s
        delta: the same float32 operations whether or not the wave already has one (a fresh one starts
        at zero). ``scratch``: a flat vector the subtraction may use on a device (no allocation)."""
        self.check_open(wave, lambda: "a step")
        delta = self.deltas.get(wave)
        if delta is None:
            delta = self.ops.reset(self._spare.pop()) if self._spare else self.ops.zeros(self.weights, self.layout.numel)
        self.deltas[wave] = self.ops.accumulate_change(delta, after, before, scratch)

    # --- push ----------------------------------------------------------------------------------
    def shard_slice(self, flat: Any, shard: int) -> Any:
        """The shard's part of a flat vector: a view where it is contiguous, else a gathered copy."""
        span = self.layout.spans.get(shard)
        if span is not None:
            return flat[span[0]:span[1]]
        if shard not in self._weights:
            return flat[:0]
        return self.ops.take(flat, self._weights[shard])

    def push_payload(self, wave: int, shard: int) -> Any:
        """What Push(wave) sends shard ``shard``: the wave's delta of its weights, then the current
        values of its synced buffers (remembered, to merge the shard's average at a later Pull).

        The payload may be a view of the wave's delta, which stays unchanged until a pull drops it; a
        pull drops it only once every shard's clock passed the wave, i.e. after this push arrived."""
        if wave not in self._pushed_buffers:
            self._pushed_buffers[wave] = self.ops.clone(self.buffers)
        if wave in self.deltas:
            delta = self.shard_slice(self.deltas[wave], shard)
        else:
            delta = self.ops.zeros(self.weights, runs_numel(self.layout.weights.get(shard, ())))
        if shard not in self._buffers:
            return delta
        return self.ops.concat([delta, self.ops.take(self.buffers, self._buffers[shard])])

    def mark_pushed(self, wave: int) -> None:
        """Record that wave ``wave``'s delta was sent: a later step of that wave is an error."""
        self.pushed.add(wave)
        if self.on_pushed is not None:
            self.on_pushed(wave + 1)

    # --- pull ----------------------------------------------------------------------------------
    def merge_pull(self, pulled: Mapping[int, Tuple[int, Any]]) -> None:
        """Per shard ``k`` with ``(g, reply)``: its weights and replicas ← W_g + own deltas of waves ≥ g;
        its synced buffers ← the shard's average B_g plus this stage's own change since it pushed wave
        g - 1; then drop the deltas every shard holds. ``reply``: a flat float32 array of the family."""
        ops = self.ops
        w, b = self.weights, self.buffers
        for k, (g, reply) in sorted(pulled.items()):
            nw, nr, nb = self.pull_sizes(k)
            later = [self.deltas[c] for c in sorted(self.deltas) if c >= g]
            if nw:
                span = self.layout.spans.get(k)
                if span is not None:
                    # A contiguous slice is merged in place (same additions, same order as a copy would).
                    w = ops.set_span(w, span[0], span[1], reply[:nw])
                    for d in later:
                        w = ops.add_span(w, span[0], span[1], self.shard_slice(d, k))
                else:
                    merged = ops.clone(reply[:nw])
                    for d in later:
                        merged = ops.iadd(merged, self.shard_slice(d, k))
                    w = ops.put(w, self._weights[k], merged)
            if nr:
                idx = self._replicas[k]
                merged = ops.clone(reply[nw:nw + nr])
                for d in later:
                    merged = ops.iadd(merged, ops.take(d, idx))
                w = ops.put(w, idx, merged)
            if nb and g >= 1 and (g - 1) in self._pushed_buffers:
                idx = self._buffers[k]
                mine = ops.take(self._pushed_buffers[g - 1], idx)
                b = ops.add_at(b, idx, reply[nw + nr:nw + nr + nb] - mine)
            if nw or nr:
                self.merges += 1
            self.floor[k] = g
        self.weights, self.buffers = w, b
        if self.floor:
            low = min(self.floor.values())
            # Every shard's W_g holds these waves, so their pushes were received: no send reads them.
            for c in [c for c in self.deltas if c < low]:
                d = self.deltas.pop(c)
                if not ops.functional:
                    self._spare.append(d)
            for c in [c for c in self._pushed_buffers if c < low - 1]:
                del self._pushed_buffers[c]

    @property
    def spare_deltas(self) -> int:
        """Deltas kept for reuse (the memory a stage holds beyond the live waves' deltas)."""
        return len(self._spare)
