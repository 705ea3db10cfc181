"""One pipeline stage's model state: live weights, per-minibatch weight stashes, and WSP wave deltas.

The stage owns layers ``[start, stop)``. Its parameters, flattened layer by layer (each layer's
``named_parameters()`` order), form the stage's flat vector; the slice owned by PS shard ``k`` is the
concatenation of the layers shard ``k`` owns, in layer order — the byte layout of every Push and Pull.

Weight versions (our WSP specification):
* ``forward(p)`` stashes a clone of the live weights and differentiates that clone, so ``backward(p)``
  uses the version ``forward(p)`` used, whatever was applied in between.
* ``apply(p)`` takes one optimizer step on the live weights with ``p``'s gradients and adds
  ``after - before`` to the delta of wave ``p // nm``.
* ``merge_pull(k, g, W_g)`` sets the shard-``k`` slice of the live weights to
  ``W_g + sum(delta_c for c >= g)`` (increasing c) and forgets the shard-``k`` deltas of waves < g.
Thread role: used by one thread (the rank's main thread, or the replay loop).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

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


class StageModel:
    """Layers ``[start, stop)`` of the model with the bookkeeping the WSP executor needs."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, *, nm: int,
                 shard_layers: Dict[int, Sequence[int]], optimizer_factory: Callable,
                 device: torch.device, recompute: bool = False) -> None:
        self.start, self.stop, self.nm = start, stop, nm
        self.device = device
        self.recompute = recompute
        self.layers: List[nn.Module] = [layers[i].to(device) for i in range(start, stop)]
        check_float32(self.layers, start)
        self.params: List[nn.Parameter] = [p for layer in self.layers for p in layer.parameters()]
        self.numel = sum(p.numel() for p in self.params)
        # Flat offsets of each layer, then, per PS shard, the flat positions of its layers (layer order).
        spans, off = {}, 0
        for i, layer in enumerate(self.layers):
            n = layer_numels(layer)
            spans[start + i] = (off, n)
            off += n
        self.shard_index: Dict[int, torch.Tensor] = {}
        for k, owned in shard_layers.items():
            mine = sorted(layer for layer in owned if start <= layer < stop and spans[layer][1] > 0)
            if mine:
                idx = torch.cat([torch.arange(spans[l][0], spans[l][0] + spans[l][1]) for l in mine])
                self.shard_index[k] = idx.to(device)
        self.optimizer = optimizer_factory(self.params) if self.params else None
        self.stash: Dict[int, List[Dict[str, torch.Tensor]]] = {}
        self.saved: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}   # mb -> (input, output)
        self.deltas: Dict[int, torch.Tensor] = {}                                   # wave -> flat delta
        self.floor: Dict[int, int] = {k: 0 for k in self.shard_index}               # shard -> last pulled g

    # --- weights -----------------------------------------------------------------------------
    def flat(self) -> torch.Tensor:
        if not self.params:
            return torch.zeros(0, device=self.device)
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_flat(self, flat: torch.Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(flat[off:off + n].view_as(p))
                off += n

    def shard_slice(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        return flat.index_select(0, self.shard_index[shard])

    # --- compute -----------------------------------------------------------------------------
    def _run(self, stash: List[Dict[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        for layer, params in zip(self.layers, stash):
            x = torch.func.functional_call(layer, params, (x,))
        return x

    def forward(self, mb: int, x: torch.Tensor, needs_input_grad: bool) -> torch.Tensor:
        """Forward of minibatch ``mb`` on a stash of the live weights; returns the (attached) output."""
        stash = [{n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
                 for layer in self.layers]
        self.stash[mb] = stash
        if needs_input_grad:
            x = x.detach().requires_grad_(True)
        if self.recompute:
            with torch.no_grad():
                out = self._run(stash, x)
            self.saved[mb] = (x, None)
        else:
            out = self._run(stash, x)
            self.saved[mb] = (x, out)
        return out

    def recompute_forward(self, mb: int) -> torch.Tensor:
        """Rebuild minibatch ``mb``'s graph from its saved input and the same stash."""
        x, _ = self.saved[mb]
        out = self._run(self.stash[mb], x)
        self.saved[mb] = (x, out)
        return out

    def output_of(self, mb: int) -> torch.Tensor:
        out = self.saved[mb][1]
        if out is None:
            raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for minibatch "
                               f"{mb}: Recompute({mb}) must precede Bwd({mb})")
        return out

    def backward(self, mb: int, root: torch.Tensor, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Back-propagate ``root`` (the loss, or the output with ``grad``); returns the input's gradient."""
        x, _ = self.saved.pop(mb)
        if root.requires_grad:
            root.backward(grad)
        return x.grad if x.requires_grad else None

    def apply(self, mb: int) -> None:
        """One optimizer step with minibatch ``mb``'s stashed gradients; accumulate the wave delta."""
        stash = self.stash.pop(mb)
        if self.optimizer is None:
            return
        before = self.flat()
        for layer, params in zip(self.layers, stash):
            for name, p in layer.named_parameters():
                p.grad = params[name].grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        change = self.flat() - before
        wave = mb // self.nm
        if wave in self.deltas:
            self.deltas[wave] += change
        else:
            self.deltas[wave] = change

    def drop(self, mb: int) -> None:
        """Forget minibatch ``mb``'s stash (a schedule without Apply)."""
        self.stash.pop(mb, None)

    # --- WSP ---------------------------------------------------------------------------------
    def wave_delta(self, wave: int, shard: int) -> torch.Tensor:
        if wave not in self.deltas:
            return torch.zeros(len(self.shard_index[shard]), device=self.device)
        return self.shard_slice(self.deltas[wave], shard)

    def merge_pull(self, pulled: Dict[int, Tuple[int, torch.Tensor]]) -> None:
        """Live weights of each shard's slice ← W_g + own deltas of waves ≥ g; drop deltas all shards hold."""
        flat = self.flat()
        for k, (g, w) in sorted(pulled.items()):
            merged = w.clone()
            for c in sorted(self.deltas):
                if c >= g:
                    merged += self.shard_slice(self.deltas[c], k)
            flat.index_copy_(0, self.shard_index[k], merged)
            self.floor[k] = g
        self.set_flat(flat)
        if self.floor:
            low = min(self.floor.values())
            for c in [c for c in self.deltas if c < low]:
                del self.deltas[c]
