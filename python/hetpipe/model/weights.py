"""Flat per-layer float32 weights of a model's layers, out of and back into the modules."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch
from torch import nn

from hetpipe.model.layout import ModelLayout


def flat_weights(layer: nn.Module) -> np.ndarray:
    """A private flat float32 copy of one layer's parameters (its ``named_parameters`` order)."""
    ps = [p.detach().to("cpu").reshape(-1) for p in layer.parameters()]
    return (torch.cat(ps) if ps else torch.zeros(0)).numpy().astype(np.float32, copy=True)


def initial_weights(layers: Sequence[nn.Module], first: int) -> Dict[int, np.ndarray]:
    """Flat float32 weights of consecutive layers, keyed by model layer index (``layers[0]`` is ``first``)."""
    return {first + i: flat_weights(layer) for i, layer in enumerate(layers)}


def load_layer_weights(layers: Sequence[nn.Module], weights: Dict[int, np.ndarray],
                       buffers: Optional[Dict[int, np.ndarray]] = None,
                       local: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """Write flat per-layer weights (the parameters each layer owns, see ``model.layout``), synced
    buffers and the unsynchronised buffers ``local`` (by ``"layer.name"``) into the model's layers, in
    place; a tied parameter stays one tensor."""
    layout = ModelLayout(layers)
    for l, flat in weights.items():
        layout.load(l, flat, (buffers or {}).get(l))
    with torch.no_grad():
        for key, value in (local or {}).items():
            l, name = key.split(".", 1)
            layers[int(l)].get_buffer(name).copy_(value)
