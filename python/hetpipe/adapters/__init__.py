"""Models as layer lists that follow the layer contract: one call per model family.

``adapt(model)`` picks the adapter by the model's structure: a Hugging Face GPT-2 or Llama-style
causal LM, a torchvision-style ResNet or VGG; any other module needs ``split_points`` or
``num_layers`` and goes through the ``torch.fx`` split. Each returns an :class:`Adapted`
(``layers, loss_fn = adapt(model)``) whose layers hold the model's own modules and parameters.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from hetpipe.adapters.adapted import Adapted
from hetpipe.adapters.contract import run_layers
from hetpipe.adapters.errors import AdapterError
from hetpipe.adapters.gpt2 import gpt2, is_gpt2
from hetpipe.adapters.llama import decoder, is_decoder
from hetpipe.adapters.traced import SplitSpec, traced
from hetpipe.adapters.vision import is_resnet, is_vgg, resnet, vgg


def adapt(model: nn.Module, *, split_points: Optional[SplitSpec] = None, num_layers: Optional[int] = None,
          side_inputs: Sequence[str] = ("attention_mask",), leaf_modules: Sequence[str] = ()) -> Adapted:
    """``model`` as layers: by its family when it has one, else by tracing (see :func:`traced`).

    side_inputs: for causal LMs, the keys of the inputs dict every block reads (``attention_mask``,
    ``position_ids``; ``()`` when the inputs are a bare tensor of token ids). Giving split_points or
    num_layers always traces."""
    if split_points is None and num_layers is None:
        if is_gpt2(model):
            return gpt2(model, side_inputs)
        if is_decoder(model):
            return decoder(model, side_inputs)
        if is_resnet(model):
            return resnet(model)
        if is_vgg(model):
            return vgg(model)
        raise AdapterError(f"hetpipe.adapters.adapt: {type(model).__name__} is neither a GPT-2 nor a Llama-style "
                           "causal LM (transformer.h / model.layers), nor a ResNet (conv1..layer4, fc) nor a VGG "
                           "(features, avgpool, classifier): give split_points or num_layers to split it by tracing")
    return traced(model, split_points, num_layers=num_layers, leaf_modules=leaf_modules)


__all__ = ["Adapted", "AdapterError", "adapt", "decoder", "gpt2", "resnet", "run_layers", "traced", "vgg"]
