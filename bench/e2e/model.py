"""The benchmark model and its synthetic data: an MLP of equal hidden blocks, one block per layer.

Every system in the benchmark trains exactly this list of layers (same sizes, same seed), so the
per-layer profile applies to all of them. Layer ``i`` is one ``nn.Module``; the list is what the
planner partitions, what the pipelining baseline splits uniformly, and what DDP replicates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Tuple

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the MLP: ``depth`` layers in all (first maps ``in_dim`` to ``width``, last to ``classes``)."""

    depth: int = 18
    width: int = 512
    in_dim: int = 256
    classes: int = 10
    minibatch: int = 256     # samples per minibatch: the unit every profiled time refers to
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def build_layers(spec: ModelSpec) -> List[nn.Module]:
    """The model as an ordered list of layers; deterministic for a given ``spec.seed``."""
    if spec.depth < 2:
        raise ValueError(f"model depth must be >= 2, got {spec.depth}")
    gen = torch.Generator().manual_seed(spec.seed)
    layers: List[nn.Module] = []
    for i in range(spec.depth):
        fan_in = spec.in_dim if i == 0 else spec.width
        last = i == spec.depth - 1
        lin = nn.Linear(fan_in, spec.classes if last else spec.width)
        with torch.no_grad():
            bound = fan_in ** -0.5
            lin.weight.uniform_(-bound, bound, generator=gen)
            lin.bias.uniform_(-bound, bound, generator=gen)
        layers.append(lin if last else nn.Sequential(lin, nn.ReLU()))
    return layers


def synthetic_batches(spec: ModelSpec, count: int, batch: int, seed: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed (input, label) batches of ``batch`` samples; reused cyclically by the trainers."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, spec.in_dim, generator=gen),
             torch.randint(0, spec.classes, (batch,), generator=gen)) for _ in range(count)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss of every system (mean cross-entropy over the batch)."""
    return nn.functional.cross_entropy(output, target)
