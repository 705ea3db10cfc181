"""How a layer list is called under the layer contract, in one process.

The contract: docs/design.md, "The layer contract".

Layer 0 gets the whole minibatch inputs, layer i > 0 what layer i-1 returned; a layer that declares
``hetpipe_side_inputs`` also gets those keys of the inputs dict as keyword arguments (taken as the
runtime takes them). This is the sequential meaning of a layer list: a pipeline of the same layers
must compute exactly this.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from hetpipe.model.contract import side_inputs_of


def run_layers(layers: Sequence[nn.Module], inputs: Any) -> Any:
    """The output of ``layers`` on ``inputs``, calling each one as the layer contract says."""
    value = inputs
    for i, layer in enumerate(layers):
        value = layer(value, **side_inputs_of(layer, i, inputs))
    return value
