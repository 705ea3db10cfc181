"""What an adapter returns: the layer list, the names of its layers and the model's own loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from torch import nn

from hetpipe.model.names import named_source
from hetpipe.plan.profile import LAYER_NAMES_ATTR


@dataclass
class Adapted:
    """A model cut into layers that follow the layer contract.

    layers: the ordered layers; they hold the model's own modules and ``nn.Parameter`` objects (no
        copies), so training them trains the model, and a tied weight is one object in every layer
        that uses it.
    names: one name per layer, after the model's attribute names (``h.3``, ``layer2.1``); ``layers``
        carries them too (``hetpipe_layer_names``), so a plan made from it names its stages' layers.
    loss_fn: ``loss_fn(output, target)`` matching the model's output (shifted cross entropy for a
        causal LM, cross entropy for a classifier); None where the adapter cannot know it.
    source: the model the layers were cut from; ``layers`` carries it (``hetpipe_source_model``), so
        that checkpoints name the weights as the model does and ``hetpipe export`` writes its keys.

    Unpacks as ``layers, loss_fn = adapt(model)``."""

    layers: nn.ModuleList
    names: List[str]
    loss_fn: Optional[Callable]
    source: Optional[nn.Module] = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.layers):
            raise ValueError(f"hetpipe: {len(self.names)} layer names for {len(self.layers)} layers")
        setattr(self.layers, LAYER_NAMES_ATTR, list(self.names))
        named_source(self.layers, self.source)

    def __iter__(self) -> Iterator:
        return iter((self.layers, self.loss_fn))
