"""torch.compile'd layers are refused in one line (docs/training.md, "Models")."""

import pytest
import torch
from torch import nn

from hetpipe.model.contract import as_layers


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))


def test_compiled_model_layer_or_submodule_is_refused_naming_it():
    assert len(as_layers(_mlp())) == 4
    with pytest.raises(TypeError, match=r"the model is torch.compile'd.*its \._orig_mod"):
        as_layers(torch.compile(_mlp(), backend="eager"))
    m = _mlp()
    m[1] = torch.compile(m[1], backend="eager")
    with pytest.raises(TypeError, match="layer 1 \\(the layer itself\\) is torch.compile'd"):
        as_layers(m)
    m = _mlp()
    m[2][0] = torch.compile(m[2][0], backend="eager")
    with pytest.raises(TypeError, match="layer 2 \\(its 0\\) is torch.compile'd"):
        as_layers(list(m))
    # the wrapped module itself is accepted
    m[2][0] = m[2][0]._orig_mod
    assert as_layers(m)[2] is m[2]
