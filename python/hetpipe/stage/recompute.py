"""Random state and recomputation of a stage (docs/design.md, "Random state").

Random state: ``Fwd(mb)`` runs with the CPU (and device) generator seeded from ``(seed, vw, stage,
mb + micro_offset)``, inside a fork of the caller's generators (restored afterwards: the stage's
seeding never leaks out). Draws therefore depend on the schedule's micro-batch numbering only.

Recomputation (per layer): the stage's layers form maximal runs ("segments") of consecutive layers
that are all kept or all recomputed (:func:`segments`). Before a recomputed segment's forward (run
under ``no_grad``), :class:`Replays` records the generator state and a copy of the segment's buffers;
``Recompute(mb)`` reruns the segment from them, so dropout masks and BatchNorm statistics are the
forward's and the buffers are not updated a second time.
Thread role: the stage's one thread.
"""

from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]     # the CPU generator's state, the device's (CUDA)
Buffers = List[Dict[str, torch.Tensor]]                     # per layer of a segment: buffer name -> a copy


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


def minibatch_seed(seed: int, vw: int, stage: int, mb: int) -> int:
    """The seed of micro-batch ``mb`` of a VW's stage: distinct per (VW, stage, micro-batch)."""
    return int(np.random.SeedSequence([seed, vw, stage, mb]).generate_state(1, np.uint64)[0] >> 1)


class StageRng:
    """The generators a stage's forwards draw from (module docstring). ``micro_offset``: micro-batches
    of this VW that ran before micro-batch 0 of this stream (a resumed run): the seeds go on."""

    def __init__(self, seed: int, vw: int, stage: int, micro_offset: int, device: torch.device) -> None:
        self.seed, self.vw, self.stage, self.micro_offset, self.device = seed, vw, stage, micro_offset, device

    def fork(self) -> ContextManager[Any]:
        """The caller's generators, restored when the block ends."""
        return torch.random.fork_rng(devices=[self._cuda_index()] if self.device.type == "cuda" else [])

    def seed_for(self, mb: int) -> None:
        """Seed the generators for the forward of micro-batch ``mb``."""
        seed = minibatch_seed(self.seed, self.vw, self.stage, mb + self.micro_offset)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self._cuda_index()].manual_seed(seed)

    def state(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def restore(self, state: RngState) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    def _cuda_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()


class Replays:
    """Per minibatch with a recomputed segment: what each such segment's rerun starts from (the
    generator state and buffers its forward saw) and the minibatch's side inputs."""

    def __init__(self, rng: StageRng, layers: Sequence[nn.Module]) -> None:
        self.rng, self.layers = rng, layers
        self._replay: Dict[int, Dict[int, Tuple[RngState, Buffers]]] = {}
        self._side: Dict[int, Dict[str, Any]] = {}

    def capture(self, layers: range) -> Tuple[RngState, Buffers]:
        """The generator state now and a copy of the buffers of ``layers`` (before the forward updates them)."""
        return self.rng.state(), [{n: b.clone() for n, b in self.layers[i].named_buffers()} for i in layers]

    def keep(self, mb: int, records: Dict[int, Tuple[RngState, Buffers]], side: Dict[str, Any]) -> None:
        """Keep minibatch ``mb``'s records (segment index -> :meth:`capture`) until its recompute."""
        if records:
            self._replay[mb] = records
            self._side[mb] = side

    def take(self, mb: int) -> Tuple[Dict[int, Tuple[RngState, Buffers]], Dict[str, Any]]:
        """Remove and return minibatch ``mb``'s records and side inputs (empty when it has none)."""
        return self._replay.pop(mb, {}), self._side.pop(mb, {})
