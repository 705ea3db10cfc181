"""Tied parameters a stage holds together with other stages of its VW (docs/design.md, "Tied weights").

Each holder sends the others its gradients of the parameters they share, per micro-batch, and at the
Apply of a minibatch every holder computes the same sum in the same order: per stage, the
micro-batches summed in order; then the stages' sums in stage order. So every holder takes the same
step and the copies stay bitwise equal within the VW.

The gradients cross in the run's precision (``wire``): float32 under "fp32", the half type under
"bf16" and "fp16", half the bytes. Each holder then sums, in float32, every stage's gradient as it
crossed, its own too (rounded to the half type and widened back): the sums stay bitwise equal on
every holder, and each stage's share is rounded once (docs/design.md, "Tied weights").
Thread role: the stage's one thread.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from hetpipe.stage.flat import TiedKey
from hetpipe.stage.stash import Stash


class TiedParams:
    """The tied parameters of stage ``stage`` that other stages of its VW hold too. ``holders``: per
    tied parameter of the VW, the stages holding it; ``by_key``: the stage's parameters by key."""

    def __init__(self, holders: Optional[Dict[TiedKey, Sequence[int]]], by_key: Dict[TiedKey, nn.Parameter],
                 stage: int, layers: Sequence[nn.Module], device: torch.device,
                 wire: torch.dtype = torch.float32) -> None:
        self.stage, self.layers, self.device, self.wire = stage, layers, device, wire
        self.stages = {k: tuple(sorted(s)) for k, s in (holders or {}).items() if k in by_key and len(s) > 1}
        self.keys: List[TiedKey] = sorted(self.stages)
        self.params = [by_key[k] for k in self.keys]

    @property
    def peers(self) -> List[int]:
        """The other stages holding some of these parameters, sorted."""
        return sorted({s for k in self.keys for s in self.stages[k]} - {self.stage})

    def shared_with(self, stage: int) -> List[TiedKey]:
        """The tied parameters this stage exchanges with ``stage`` of its VW (sorted)."""
        return [k for k in self.keys if stage in self.stages[k]]

    def counted(self, params: Sequence[nn.Parameter]) -> List[nn.Parameter]:
        """``params`` less the tied ones another stage counts: a tied parameter's gradient counts towards
        the VW's norm on the first stage holding it only, so that the stages' sums add up to the VW's."""
        first = {id(p): self.stages[k][0] == self.stage for k, p in zip(self.keys, self.params)}
        return [p for p in params if first.get(id(p), True)]

    def grad(self, stash: Stash, keys: Sequence[TiedKey]) -> torch.Tensor:
        """The flat gradients of tied parameters ``keys`` in ``stash`` (after its backward), in the
        exchange's dtype ``wire`` (rounded from float32 under "bf16" and "fp16")."""
        by_key = dict(zip(self.keys, self.params))
        parts = []
        for key in keys:
            v = self._view_of(stash, by_key[key])
            parts.append((v.grad if v.grad is not None else torch.zeros_like(v)).reshape(-1))
        flat = torch.cat(parts) if parts else torch.zeros(0, device=self.device)
        return flat.to(self.wire)

    def summed(self, stashes: Sequence[Stash], peer_grads: Optional[Dict[int, List[torch.Tensor]]]
               ) -> Dict[TiedKey, torch.Tensor]:
        """Per tied parameter, its gradient over one minibatch: this stage's ``stashes`` (its
        micro-batches) and ``peer_grads[s]`` (stage ``s``'s flat gradients of :meth:`shared_with` ``s``,
        per micro-batch), each stage's micro-batches summed in order, then the stages in stage order: in
        float32, each gradient as it crossed the exchange (this stage's own rounded as it would have)."""
        if not self.keys:
            return {}
        per_stage: Dict[int, Dict[TiedKey, torch.Tensor]] = {}
        own = [self.grad(stash, self.keys).to(torch.float32) for stash in stashes]
        per_stage[self.stage] = self._split(self.keys, sum(own[1:], own[0]))
        for s, flats in (peer_grads or {}).items():
            flats = [f.to(torch.float32) for f in flats]
            per_stage[s] = self._split(self.shared_with(s), sum(flats[1:], flats[0]))
        out = {}
        for key in self.keys:
            parts = [per_stage[s][key] for s in self.stages[key]]
            out[key] = sum(parts[1:], parts[0])
        return out

    def _view_of(self, stash: Stash, p: nn.Parameter) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            for n, q in layer.named_parameters():
                if q is p:
                    return stash[i][n]
        raise KeyError("hetpipe: a tied parameter is missing from the stage")

    def _split(self, keys: Sequence[TiedKey], flat: torch.Tensor) -> Dict[TiedKey, torch.Tensor]:
        by_key = dict(zip(self.keys, self.params))
        out, off = {}, 0
        for key in keys:
            n = by_key[key].numel()
            out[key] = flat[off:off + n]
            off += n
        return out
