"""Weight stashes per minibatch, and the versions of the live weights.

* ``take(mb)`` (at ``Fwd(mb)``) copies the live weights into a snapshot and returns the stash: per
  layer, each parameter name mapped to a view of that snapshot requiring grad, so ``Bwd(mb)``
  differentiates the version ``Fwd(mb)`` used, whatever was applied in between.
* The live weights change only in an optimizer step (:meth:`count_step`) and a pull's merge (the
  ledger's ``merges``), each of which makes a new version. A step needs the weights before its
  update; when the newest snapshot was copied at the current version (in steady state the forward
  just before each Apply), it is those weights, bit for bit, and :meth:`before_step` copies nothing.
* Snapshots of minibatches already applied are recycled for the next forwards: a fresh allocation of
  the stage's flat size is fresh pages, and faulting them in costs as much as a copy.

Thread role: the stage's one thread.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hetpipe.ps.ledger import WaveLedger

Stash = List[Dict[str, torch.Tensor]]       # per layer of the stage: parameter name -> its stashed tensor


class WeightStashes:
    """The stashes of the minibatches between their forward and their Apply, over ``flat`` (the live
    weights, whose slices are ``params``; ``layer_params`` as :class:`~hetpipe.stage.flat.FlatParams`)."""

    def __init__(self, flat: torch.Tensor, params: Sequence[torch.Tensor], layer_params: List[List[Tuple[str, int]]],
                 ledger: WaveLedger) -> None:
        self._flat, self._params, self._layer_params, self._ledger = flat, params, layer_params, ledger
        self.scratch = torch.empty_like(flat)                            # a step's "before", then its change
        self._spare: List[torch.Tensor] = []                            # of minibatches already applied
        self._snapshots: Dict[int, torch.Tensor] = {}                   # mb -> the storage of its stash
        self.stash: Dict[int, Stash] = {}
        self._steps = 0
        self._latest: Optional[Tuple[int, torch.Tensor]] = None          # the newest snapshot, with its version

    @property
    def buffers_held(self) -> int:
        """The weight copies this stage holds for stashes: those in flight and the spares kept for reuse
        (what the planner's memory model counts as snapshots)."""
        return len(self._snapshots) + len(self._spare)

    @property
    def version(self) -> int:
        """The live weights' version: each optimizer step and each pull that changed them makes one."""
        return self._steps + self._ledger.merges

    def take(self, mb: int) -> Stash:
        """Stash the live weights for minibatch ``mb``: one copy, with one view per parameter object
        (so a parameter two of the stage's layers share stays one tensor)."""
        snapshot = self._spare.pop() if self._spare else torch.empty_like(self._flat)
        snapshot.copy_(self._flat)
        self._snapshots[mb] = snapshot
        self._latest = (self.version, snapshot)
        views: List[torch.Tensor] = []
        off = 0
        for p in self._params:
            views.append(snapshot[off:off + p.numel()].view_as(p).requires_grad_(True))
            off += p.numel()
        stash = [{n: views[i] for n, i in names} for names in self._layer_params]
        self.stash[mb] = stash
        return stash

    def pop(self, micros: Sequence[int]) -> Tuple[List[Stash], List[torch.Tensor]]:
        """Remove the stashes of ``micros`` and their snapshots; give the snapshots back with
        :meth:`recycle` once nothing reads the stashes' gradients any more."""
        return [self.stash.pop(mb) for mb in micros], [self._snapshots.pop(mb) for mb in micros]

    def recycle(self, snapshots: Sequence[torch.Tensor]) -> None:
        self._spare.extend(snapshots)

    def count_step(self) -> None:
        """An optimizer step changed the live weights: a new version."""
        self._steps += 1

    def before_step(self) -> torch.Tensor:
        """The live weights as they are now: the newest snapshot if it copied this version (a snapshot is
        only ever written by :meth:`take`'s copy, so its bits are still those weights), else a copy."""
        if self._latest is not None and self._latest[0] == self.version:
            return self._latest[1]
        self.scratch.copy_(self._flat)
        return self.scratch
