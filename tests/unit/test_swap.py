"""model.swap.SwapCall against torch.func.functional_call: the same outputs and gradients, bitwise, and
the layer's own tensors back in place afterwards, also when the layer raises."""

import pytest
import torch
from torch import nn

from hetpipe.model.swap import SwapCall


class Tied(nn.Module):
    """A layer that uses one parameter under two names and carries BatchNorm buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x, scale=1.0):
        return self.bn(self.b(torch.relu(self.a(x)))) * scale


def _fresh(layer: nn.Module, buffers: bool):
    g = torch.Generator().manual_seed(3)
    out = {n: torch.randn(p.shape, generator=g).requires_grad_(True) for n, p in layer.named_parameters()}
    if buffers:
        out.update({n: b.clone() + 0.5 for n, b in layer.named_buffers() if b.is_floating_point()})
    return out


def _gpt2_block():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=32)
    torch.manual_seed(0)
    return transformers.GPT2Model(cfg).h[0]


@pytest.mark.parametrize("make,shape,buffers", [
    (lambda: nn.Linear(8, 4), (5, 8), False),
    (Tied, (5, 6), True),
    (_gpt2_block, (2, 8, 16), False),
])
def test_matches_functional_call(make, shape, buffers):
    layer = make()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    own = {n: t for n, t in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers()]}
    a, b = _fresh(layer, buffers), _fresh(layer, buffers)
    torch.manual_seed(5)                               # the same dropout draws in both
    ref = torch.func.functional_call(layer, a, (x,))
    torch.manual_seed(5)
    got = SwapCall(layer)(b, (x,), {})
    ref = ref[0] if isinstance(ref, tuple) else ref
    got = got[0] if isinstance(got, tuple) else got
    assert torch.equal(ref, got)
    ref.sum().backward()
    got.sum().backward()
    for n in a:
        if a[n].requires_grad:
            assert torch.equal(a[n].grad, b[n].grad), n
        else:
            assert torch.equal(a[n], b[n]), n            # running statistics updated the same way
    for n, t in [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers()]:
        assert t is own[n], f"{n} was not restored"


def test_tied_alias_gets_the_tensor():
    layer = Tied()
    tensors = _fresh(layer, False)
    assert "b.weight" not in tensors                   # the deduplicated name is a.weight
    seen = []
    layer.b.register_forward_pre_hook(lambda m, args: seen.append(m.weight is tensors["a.weight"]))
    SwapCall(layer)(tensors, (torch.randn(5, 6),), {"scale": 2.0})
    assert seen == [True]


def test_restores_on_error_and_names_unknown():
    layer = nn.Linear(4, 4)
    weight = layer.weight
    with pytest.raises(RuntimeError):
        SwapCall(layer)({"weight": torch.zeros(3, 3)}, (torch.randn(2, 4),), {})
    assert layer.weight is weight
    with pytest.raises(KeyError, match="nope"):
        SwapCall(layer)({"weight": torch.zeros(4, 4), "nope": torch.zeros(1)}, (torch.randn(2, 4),), {})
    assert layer.weight is weight
