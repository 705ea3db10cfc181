"""Which layer owns each parameter and synchronised buffer: the per-layer flat layout of the PS.

A parameter object that appears in several layers (a tied embedding and LM head) is detected by
identity and owned by the first layer holding it: it is part of that layer's flat weight vector only,
so it is one parameter on one PS shard. Every later layer holding it keeps a *replica*
(see docs/design.md, "Tied weights").

A layer's synchronised buffers are its persistent float32 buffers (BatchNorm running mean and
variance), flattened like the weights; they are averaged across VWs at the PS. Other buffers
(integer counters, non-persistent constants such as causal masks, other float dtypes) stay local to
each stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch import nn


def synced_buffers(layer: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """The layer's persistent float32 buffers, in ``named_buffers`` order (the PS holds float32)."""
    persistent = set(layer.state_dict(keep_vars=True))
    return [(n, b) for n, b in layer.named_buffers() if n in persistent and b.dtype == torch.float32]


@dataclass(frozen=True)
class Replica:
    """Layer ``layer`` holds, as ``name``, the parameter that layer ``owner`` owns as ``owner_name``."""

    layer: int
    name: str
    owner: int
    owner_name: str
    offset: int            # of the parameter in the owner layer's flat vector
    numel: int


class ModelLayout:
    """Per layer: the parameters it owns (flat PS order), the replicas it holds, its synced buffers."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        first: Dict[int, Tuple[int, str, int]] = {}          # id(param) -> (owner layer, name, offset)
        self.owned: List[List[Tuple[str, nn.Parameter]]] = []
        self.replicas: List[List[Replica]] = []
        self.buffers: List[List[Tuple[str, torch.Tensor]]] = []
        for l, layer in enumerate(layers):
            owned, reps, off = [], [], 0
            for name, p in layer.named_parameters():
                if id(p) in first and first[id(p)][0] != l:
                    o, oname, ooff = first[id(p)]
                    reps.append(Replica(l, name, o, oname, ooff, p.numel()))
                    continue
                first[id(p)] = (l, name, off)
                owned.append((name, p))
                off += p.numel()
            self.owned.append(owned)
            self.replicas.append(reps)
            self.buffers.append(synced_buffers(layer))

    def numel(self, layer: int) -> int:
        return sum(p.numel() for _, p in self.owned[layer])

    def buffer_numel(self, layer: int) -> int:
        return sum(b.numel() for _, b in self.buffers[layer])

    def holders(self, owner: int, owner_name: str) -> List[int]:
        """Every layer holding the parameter ``owner`` owns as ``owner_name`` (the owner first)."""
        return [owner] + [r.layer for reps in self.replicas for r in reps
                          if (r.owner, r.owner_name) == (owner, owner_name)]

    def stage_replicas(self, start: int, stop: int) -> List[Replica]:
        """The replicas layers ``[start, stop)`` hold of parameters owned outside them, one per
        parameter, ordered by (owner layer, offset): the order of a stage's replica slices."""
        seen: Dict[Tuple[int, str], Replica] = {}
        for l in range(start, stop):
            for r in self.replicas[l]:
                if not start <= r.owner < stop:
                    seen.setdefault((r.owner, r.owner_name), r)
        return sorted(seen.values(), key=lambda r: (r.owner, r.offset))

    def flat(self, layer: int) -> np.ndarray:
        """A private flat float32 copy of the parameters ``layer`` owns."""
        return _flat([p for _, p in self.owned[layer]])

    def flat_buffers(self, layer: int) -> np.ndarray:
        return _flat([b for _, b in self.buffers[layer]])

    def load(self, layer: int, weights: np.ndarray, buffers: np.ndarray = None) -> None:
        """Write flat weights (and synced buffers) into ``layer``'s tensors, in place."""
        with torch.no_grad():
            _load([p for _, p in self.owned[layer]], weights)
            if buffers is not None:
                _load([b for _, b in self.buffers[layer]], buffers)


def _flat(ts: Sequence[torch.Tensor]) -> np.ndarray:
    parts = [t.detach().to("cpu", torch.float32).reshape(-1) for t in ts]
    return (torch.cat(parts) if parts else torch.zeros(0)).numpy().astype(np.float32, copy=True)


def _load(ts: Sequence[torch.Tensor], flat: np.ndarray) -> None:
    src = torch.from_numpy(np.asarray(flat, dtype=np.float32))
    off = 0
    for t in ts:
        n = t.numel()
        t.copy_(src[off:off + n].view_as(t).to(t.device, t.dtype))
        off += n


def local_buffers(model, layout: ModelLayout) -> Dict[str, torch.Tensor]:
    """The persistent buffers of stage ``model``'s layers the PS does not synchronise (integer counters,
    ...), by ``"layer.name"``."""
    out = {}
    for l in range(model.start, model.stop):
        layer = model.layers[l - model.start]
        synced = {n for n, _ in layout.buffers[l]}
        persistent = set(layer.state_dict(keep_vars=True))
        for n, b in layer.named_buffers():
            if n in persistent and n not in synced:
                out[f"{l}.{n}"] = b
    return out
