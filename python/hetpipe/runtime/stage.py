"""One pipeline stage's model state: live weights, per-minibatch weight stashes, and WSP wave deltas.

The stage owns layers ``[start, stop)``. Its parameters, flattened layer by layer (each layer's
``named_parameters()`` order), form the stage's flat vector; the slice owned by PS shard ``k`` is the
concatenation of the layers shard ``k`` owns, in layer order — the byte layout of every Push and Pull.

Weight versions (our WSP specification):
* ``forward(p)`` stashes a clone of the live weights and differentiates that clone, so ``backward(p)``
  uses the version ``forward(p)`` used, whatever was applied in between.

Recomputation (per layer): the stage's layers form maximal runs ("segments") of consecutive layers
that are all kept or all recomputed. ``forward(p)`` keeps the graph of kept segments and only the
input of recomputed ones (run under ``no_grad``); ``recompute_forward(p)`` rebuilds the recomputed
segments from those inputs with the same stash, and ``backward(p)`` back-propagates segment by
segment, last to first. The same ops run on the same weights, so the numbers equal those of a run
without recomputation bitwise (on CPU).
* ``apply(micros, w)`` takes one optimizer step on the live weights with the summed gradients of one
  minibatch's micro-batches (one, or the two halves of a split minibatch) and adds ``after - before``
  to the delta of its wave ``w``; it raises once ``w`` was pushed (``mark_pushed``).
* ``merge_pull(k, g, W_g)`` sets the shard-``k`` slice of the live weights to
  ``W_g + sum(delta_c for c >= g)`` (increasing c) and forgets the shard-``k`` deltas of waves < g.
Thread role: used by one thread (the rank's main thread, or the replay loop).
"""

from __future__ import annotations

import copy

from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn


def layer_numels(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def check_float32(layers: Sequence[nn.Module], first: int) -> None:
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"hetpipe: layer {first + i} parameter {name!r} is {p.dtype}; "
                                "the parameter servers hold float32 weights")


def check_no_buffers(layers: Sequence[nn.Module], first: int) -> None:
    """Raise ValueError naming the first layer that holds a module buffer (e.g. BatchNorm running
    statistics): buffers are neither stashed, pushed, pulled nor gathered, so a run would silently
    train them inconsistently (and ``Recompute`` would update them twice)."""
    for i, layer in enumerate(layers):
        for name, _ in layer.named_buffers():
            raise ValueError(f"hetpipe: layer {first + i} has buffer {name!r} ({type(layer).__name__}); module "
                             "buffers such as BatchNorm running statistics are not synchronised yet: use layers "
                             "without buffers (e.g. LayerNorm or GroupNorm instead of BatchNorm)")


def segments(start: int, stop: int, recompute: Sequence[int]) -> List[Tuple[bool, range]]:
    """Maximal runs of layers ``[start, stop)`` that are all recomputed or all kept, as
    ``(recomputed, local layer indices)``; e.g. layers 0..4 recomputing {1, 2} give
    ``[(False, range(0, 1)), (True, range(1, 3)), (False, range(3, 5))]``."""
    out: List[Tuple[bool, range]] = []
    a = start
    for i in range(start + 1, stop + 1):
        if i == stop or (i in recompute) != (a in recompute):
            out.append((a in recompute, range(a - start, i - start)))
            a = i
    return out


class StageModel:
    """Layers ``[start, stop)`` of the model with the bookkeeping the WSP executor needs."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, *, nm: int,
                 shard_layers: Dict[int, Sequence[int]], optimizer_factory: Callable,
                 device: torch.device, recompute: Sequence[int] = ()) -> None:
        self.start, self.stop, self.nm = start, stop, nm
        self.device = device
        outside = sorted(set(recompute) - set(range(start, stop)))
        if outside:
            raise ValueError(f"hetpipe: stage layers [{start}, {stop}) cannot recompute layers {outside}")
        self.recompute = tuple(sorted(set(recompute)))
        self.segments = segments(start, stop, self.recompute)
        # The stage owns private copies: nn.Module.to moves in place, so without them stages of
        # different VWs in one process (the replay) would share live weights, and the caller's
        # model would end up on the device.
        self.layers: List[nn.Module] = [copy.deepcopy(layers[i]).to(device) for i in range(start, stop)]
        check_float32(self.layers, start)
        check_no_buffers(self.layers, start)
        self.params: List[nn.Parameter] = [p for layer in self.layers for p in layer.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        # Every parameter's data is a view into one flat buffer, in the stage's flat order, so the
        # vector of Push, Pull and the wave deltas is read and written in place, never concatenated
        # (a per-minibatch torch.cat of the stage's weights cost more than its forward on big layers).
        self._flat = torch.empty(self.numel, dtype=torch.float32, device=device)
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                self._flat[off:off + n].copy_(p.reshape(-1))
                p.data = self._flat[off:off + n].view_as(p)
                off += n
        # Buffers of the stage's flat size, reused rather than allocated per minibatch or wave (a
        # fresh allocation this large is fresh pages, and faulting them in costs as much as a copy).
        self._scratch = torch.empty_like(self._flat)                    # apply's "before", then change
        self._spare_snapshots: List[torch.Tensor] = []                  # of minibatches already applied
        self._spare_deltas: List[torch.Tensor] = []                     # of waves already merged
        self._snapshots: Dict[int, torch.Tensor] = {}                   # mb -> the storage of its stash
        # Flat offsets of each layer, then, per PS shard, the flat positions of its layers (layer order).
        spans, off = {}, 0
        for i, layer in enumerate(self.layers):
            n = layer_numels(layer)
            spans[start + i] = (off, n)
            off += n
        self.shard_index: Dict[int, torch.Tensor] = {}
        self.shard_span: Dict[int, Tuple[int, int]] = {}    # shards whose slice is one contiguous range
        for k, owned in shard_layers.items():
            mine = sorted(layer for layer in owned if start <= layer < stop and spans[layer][1] > 0)
            if mine:
                idx = torch.cat([torch.arange(spans[l][0], spans[l][0] + spans[l][1]) for l in mine])
                self.shard_index[k] = idx.to(device)
                if all(spans[a][0] + spans[a][1] == spans[b][0] for a, b in zip(mine, mine[1:])):
                    self.shard_span[k] = (spans[mine[0]][0], spans[mine[-1]][0] + spans[mine[-1]][1])
        self.optimizer = optimizer_factory(self.params) if self.params else None
        self.stash: Dict[int, List[Dict[str, torch.Tensor]]] = {}
        # mb -> per segment [input, output]; output None while a recomputed segment awaits Recompute(mb)
        self.saved: Dict[int, List[List[Optional[torch.Tensor]]]] = {}
        self.deltas: Dict[int, torch.Tensor] = {}                                   # wave -> flat delta
        self.floor: Dict[int, int] = {k: 0 for k in self.shard_index}               # shard -> last pulled g
        self.pushed: Set[int] = set()                                               # waves whose delta was sent

    # --- weights -----------------------------------------------------------------------------
    def shard_slice(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """The shard's part of a flat vector: a view where it is contiguous, else a gathered copy."""
        span = self.shard_span.get(shard)
        if span is not None:
            return flat[span[0]:span[1]]
        return flat.index_select(0, self.shard_index[shard])

    # --- compute -----------------------------------------------------------------------------
    @property
    def recomputes_output(self) -> bool:
        """Whether the stage's output has no graph until ``Recompute`` (its last segment is recomputed)."""
        return self.segments[-1][0]

    def _run(self, stash: List[Dict[str, torch.Tensor]], x: torch.Tensor, layers: range) -> torch.Tensor:
        for i in layers:
            x = torch.func.functional_call(self.layers[i], stash[i], (x,))
        return x

    def forward(self, mb: int, x: torch.Tensor, needs_input_grad: bool) -> torch.Tensor:
        """Forward of minibatch ``mb`` on a stash of the live weights; returns the output (attached
        unless ``recomputes_output``)."""
        # One copy of the live weights; the stash's parameters are views into it.
        snapshot = self._spare_snapshots.pop() if self._spare_snapshots else torch.empty_like(self._flat)
        snapshot.copy_(self._flat)
        self._snapshots[mb] = snapshot
        stash, off = [], 0
        for layer in self.layers:
            views = {}
            for n, p in layer.named_parameters():
                views[n] = snapshot[off:off + p.numel()].view_as(p).requires_grad_(True)
                off += p.numel()
            stash.append(views)
        self.stash[mb] = stash
        saved: List[List[Optional[torch.Tensor]]] = []
        for k, (recomputed, layers) in enumerate(self.segments):
            if (k > 0 or needs_input_grad) and x.is_floating_point():
                x = x.detach().requires_grad_(True)
            if recomputed:
                with torch.no_grad():
                    out = self._run(stash, x, layers)
                saved.append([x, None])
            else:
                out = self._run(stash, x, layers)
                saved.append([x, out])
            x = out
        self.saved[mb] = saved
        return x

    def recompute_forward(self, mb: int) -> torch.Tensor:
        """Rebuild the recomputed segments of minibatch ``mb`` from their saved inputs and the same
        stash; returns the stage's (attached) output."""
        saved, stash = self.saved[mb], self.stash[mb]
        for (recomputed, layers), seg in zip(self.segments, saved):
            if recomputed:
                seg[1] = self._run(stash, seg[0], layers)
        return saved[-1][1]

    def output_of(self, mb: int) -> torch.Tensor:
        out = self.saved[mb][-1][1]
        if out is None:
            raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for minibatch "
                               f"{mb}: Recompute({mb}) must precede Bwd({mb})")
        return out

    def backward(self, mb: int, root: torch.Tensor, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Back-propagate ``root`` (the loss, or the output with ``grad``) through every segment, last
        first; returns the stage input's gradient."""
        saved = self.saved.pop(mb)
        for k in range(len(saved) - 1, -1, -1):
            if k < len(saved) - 1:
                root, grad = saved[k][1], saved[k + 1][0].grad
                if root is None:
                    raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for "
                                       f"minibatch {mb}: Recompute({mb}) must precede Bwd({mb})")
                if grad is None:
                    continue
            if root.requires_grad:
                root.backward(grad)
        x = saved[0][0]
        return x.grad if x.requires_grad else None

    def apply(self, micros: Sequence[int], wave: int) -> None:
        """One optimizer step with the summed stashed gradients of ``micros`` (the micro-batches of one
        minibatch, in order); accumulate the change into the delta of ``wave``."""
        if wave in self.pushed:
            raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}): Apply of micro-batch(es) "
                               f"{list(micros)} after Push({wave}): wave {wave}'s delta was already sent, "
                               "so this update would be lost")
        stashes = [self.stash.pop(mb) for mb in micros]
        # Their graphs were freed by backward; once the gradients below are summed, nothing reads
        # the snapshots, so they are recycled for the next forwards.
        snapshots = [self._snapshots.pop(mb) for mb in micros]
        if self.optimizer is None:
            return
        for i, layer in enumerate(self.layers):
            for name, p in layer.named_parameters():
                grads = [s[i][name].grad for s in stashes if s[i][name].grad is not None]
                p.grad = sum(grads[1:], grads[0]) if grads else None
        del stashes
        self._spare_snapshots.extend(snapshots)
        # delta(wave) += (after - before): the same float32 operations whether or not the wave
        # already has a delta (a fresh one starts at zero).
        delta = self.deltas.get(wave)
        if delta is None:
            delta = self._spare_deltas.pop().zero_() if self._spare_deltas else torch.zeros_like(self._flat)
            self.deltas[wave] = delta
        with torch.no_grad():
            self._scratch.copy_(self._flat)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            torch.sub(self._flat, self._scratch, out=self._scratch)
            delta += self._scratch

    # --- WSP ---------------------------------------------------------------------------------
    def mark_pushed(self, wave: int) -> None:
        """Record that wave ``wave``'s delta was sent: a later ``apply`` to that wave is an error."""
        self.pushed.add(wave)

    def wave_delta(self, wave: int, shard: int) -> torch.Tensor:
        if wave not in self.deltas:
            return torch.zeros(len(self.shard_index[shard]), dtype=torch.float32, device=self.device)
        return self.shard_slice(self.deltas[wave], shard)

    def merge_pull(self, pulled: Dict[int, Tuple[int, torch.Tensor]]) -> None:
        """Live weights of each shard's slice ← W_g + own deltas of waves ≥ g; drop deltas all shards hold."""
        for k, (g, w) in sorted(pulled.items()):
            merged = w.clone()
            for c in sorted(self.deltas):
                if c >= g:
                    merged += self.shard_slice(self.deltas[c], k)
            with torch.no_grad():
                span = self.shard_span.get(k)
                if span is not None:
                    self._flat[span[0]:span[1]].copy_(merged)
                else:
                    self._flat.index_copy_(0, self.shard_index[k], merged)
            self.floor[k] = g
        if self.floor:
            low = min(self.floor.values())
            # Every shard's W_g holds these waves, so their pushes were received: no send reads them.
            for c in [c for c in self.deltas if c < low]:
                self._spare_deltas.append(self.deltas.pop(c))
