"""Calling a layer on other tensors than its own: the per-minibatch weight stashes of a stage.

``torch.func.functional_call(layer, tensors, args)`` does this, but at every call it walks the
layer's parameters and buffers, finds tied names and builds the substitution: about 17 µs per small
layer on one CPU thread, three times the cost of a 32 x 32 Linear's forward. :class:`SwapCall` does
that work once per layer and at each call only swaps the tensors into the owning submodules'
``_parameters`` / ``_buffers`` slots, runs the layer and puts the originals back, even when the
layer raises. The layer computes with exactly the tensors given, so the results are bitwise those
of ``functional_call`` (``tests/unit/test_swap.py``).

Contract: ``tensors`` maps names of ``layer.named_parameters()`` / ``named_buffers()`` (the
deduplicated names) to tensors; an alias of a tied parameter or buffer (another name of the same
object within the layer) gets the same tensor, as ``functional_call`` unties it. A name the layer
does not have is a KeyError naming it. Thread role: one thread calls a layer at a time (the swap
mutates the module while it runs).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import torch
from torch import nn


class SwapCall:
    """``layer(*args, **kwargs)`` computed with ``tensors`` in place of its parameters and buffers."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        # name (deduplicated) -> every (submodule, slot dict name, attribute) the object sits in.
        self.places: Dict[str, List[Tuple[nn.Module, str, str]]] = {}
        for kind, named in (("_parameters", layer.named_parameters), ("_buffers", layer.named_buffers)):
            canonical = {id(t): n for n, t in named()}
            for name, t in named(remove_duplicate=False):
                owner, _, attr = name.rpartition(".")
                module = layer.get_submodule(owner) if owner else layer
                self.places.setdefault(canonical[id(t)], []).append((module, kind, attr))

    def __call__(self, tensors: Mapping[str, torch.Tensor], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        saved = []
        try:
            for name, t in tensors.items():
                places = self.places.get(name)
                if places is None:
                    raise KeyError(f"hetpipe: layer {type(self.layer).__name__} has no parameter or buffer {name!r}")
                for module, kind, attr in places:
                    slots = getattr(module, kind)
                    saved.append((slots, attr, slots[attr]))
                    slots[attr] = t
            return self.layer(*args, **kwargs)
        finally:
            for slots, attr, original in reversed(saved):
                slots[attr] = original
