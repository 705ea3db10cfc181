"""How a layer list is called under the layer contract, in one process (README, "Models").

Layer 0 gets the whole minibatch inputs, layer i > 0 what layer i-1 returned; a layer that declares
``hetpipe_side_inputs`` also gets those keys of the inputs dict as keyword arguments. This is the
sequential meaning of a layer list: a pipeline of the same layers must compute exactly this.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import nn

from hetpipe.adapters.errors import AdapterError


def side_inputs(layer: nn.Module, inputs: Any, index: int) -> dict:
    """The keyword arguments ``layer`` (number ``index``) declares through ``hetpipe_side_inputs``."""
    names = getattr(layer, "hetpipe_side_inputs", ())
    if not names:
        return {}
    if not isinstance(inputs, Mapping):
        raise AdapterError(f"hetpipe: layer {index} ({type(layer).__name__}) needs side inputs {tuple(names)} "
                           f"but the minibatch inputs are a {type(inputs).__name__}, not a dict")
    missing = [k for k in names if k not in inputs]
    if missing:
        raise AdapterError(f"hetpipe: layer {index} ({type(layer).__name__}) needs side inputs {missing} "
                           f"that the minibatch inputs (keys {sorted(inputs)}) lack")
    return {k: inputs[k] for k in names}


def run_layers(layers: Sequence[nn.Module], inputs: Any) -> Any:
    """The output of ``layers`` on ``inputs``, calling each one as the layer contract says."""
    value = inputs
    for i, layer in enumerate(layers):
        value = layer(value, **side_inputs(layer, inputs, i))
    return value
