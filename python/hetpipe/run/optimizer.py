"""The optimizer a script hands the Trainer, as the per-stage factory every stage builds its own with.

A factory (``params -> Optimizer``, or one marked :func:`hetpipe.named_params`) is used as it is. An
optimizer object built over the whole model, as a plain PyTorch script builds it
(``AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)``),
becomes an :class:`OptimizerRecipe`: its class, its defaults, and per group its options and the model's
names of its parameters. Each stage then builds the same class over its own parameters with the same
groups (a group without a parameter on the stage is left out), so every parameter trains with the
options its group gave it, whatever the plan. The object itself never steps.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Sequence, Set, Tuple

import torch
from torch import nn

from hetpipe.model.layout import ModelLayout
from hetpipe.model.names import NAMED_ATTR, param_names


class OptimizerRecipe:
    """Builds ``cls(groups, **defaults)`` over a stage's ``(name, parameter)`` pairs (see the module
    docstring). Called by each stage's thread at start-up; holds no parameter."""

    def __init__(self, cls: type, defaults: Dict[str, Any], groups: List[Tuple[Dict[str, Any], Set[str]]]) -> None:
        self.cls, self.defaults, self.groups = cls, defaults, groups
        setattr(self, NAMED_ATTR, True)

    def __call__(self, named: Sequence[Tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        built = [{**options, "params": [p for n, p in named if n in names]} for options, names in self.groups]
        return self.cls([g for g in built if g["params"]], **self.defaults)

    def __repr__(self) -> str:
        return f"OptimizerRecipe({self.cls.__name__}, {len(self.groups)} group(s))"


def as_factory(optimizer: Any, layers: Sequence[nn.Module], names: Dict[str, Any]) -> Callable:
    """The per-stage factory for what the script gave as ``optimizer`` (see the module docstring).

    An optimizer object is refused, in one line naming the culprit, when it has taken a step (its state
    would be lost), when it holds a tensor none of the layers has, or when a trainable parameter of the
    layers is in none of its groups (plain PyTorch would leave it untrained; hetpipe's stages would not)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"hetpipe: the optimizer must be a torch.optim.Optimizer over the model or a factory "
                            f"params -> Optimizer, got {type(optimizer).__name__}")
        return optimizer
    kind = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(f"hetpipe: the {kind} given has taken {len(optimizer.state)} parameter step(s); give it "
                         "before any step (each stage builds its own and starts from its state)")
    key_of = _model_keys(layers, names)
    groups, listed = [], set()
    for g, group in enumerate(optimizer.param_groups):
        keys = set()
        for p in group["params"]:
            if id(p) not in key_of:
                raise ValueError(f"hetpipe: group {g} of the {kind} holds a tensor of shape {tuple(p.shape)} that no "
                                 "layer of the model has")
            keys.add(key_of[id(p)])
            listed.add(id(p))
        groups.append(({k: v for k, v in group.items() if k != "params"}, keys))
    left = sorted({key_of[id(p)] for layer in layers for p in layer.parameters()
                   if p.requires_grad and id(p) not in listed})
    if left:
        raise ValueError(f"hetpipe: the {kind} given holds no group with the parameter(s) {left[:4]}"
                         + (f" and {len(left) - 4} more" if len(left) > 4 else "")
                         + "; add them to a group, or set requires_grad=False")
    # The constructor's own keywords only: a class may keep more in its defaults than it takes
    # (AdamW's decoupled_weight_decay); the groups carry every option anyway.
    takes = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in takes}
    return OptimizerRecipe(type(optimizer), defaults, groups)


def _model_keys(layers: Sequence[nn.Module], names: Dict[str, Any]) -> Dict[int, str]:
    """id(parameter) -> the name a stage's factory gets it under (the model's own, see model.names)."""
    by_local = param_names(names)
    layout = ModelLayout(layers)
    return {id(p): by_local[(l, local)] for l in range(len(layers)) for local, p in layout.owned[l]}
