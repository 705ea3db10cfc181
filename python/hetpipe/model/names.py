"""The model's own names of what the layers hold, for checkpoints, export and named parameter groups.

A checkpoint stores each layer's parameters as one flat vector (``model.layout``). To give them back
under the names a user loads them with (``model.load_state_dict`` keys, or a Hugging Face model's),
the manifest carries, per layer, each owned parameter and each buffer in flat order with its shape
and the ``state_dict`` keys of the tensor in the model the layers came from: the model an adapter
cut (``hetpipe_source_model`` on its layer list), else the ``nn.Sequential``/``nn.ModuleList`` passed
as the model, else positions (``3.weight``). A tensor under several keys (a tied weight) is listed
under all of them; one no ``state_dict`` holds (a non-persistent buffer) under none.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from torch import nn

from hetpipe.model.layout import ModelLayout, synced_buffers

SOURCE_ATTR = "hetpipe_source_model"       # on an adapter's layer list: the model it was cut from
NAMED_ATTR = "hetpipe_named_params"         # on an optimizer factory that takes (name, parameter) pairs


def _keys_by_tensor(source: nn.Module) -> Dict[int, List[str]]:
    keys: Dict[int, List[str]] = {}
    for key, t in source.state_dict(keep_vars=True).items():
        keys.setdefault(id(t), []).append(key)
    return keys


def model_names(model: Any, layers: Sequence[nn.Module]) -> Dict[str, Any]:
    """The manifest's ``names`` entry for ``layers`` (see the module docstring): ``params`` and
    ``buffers``, lists of ``[layer, local name, [keys], shape]`` (buffers add whether the PS syncs
    them), and ``model``: the source model's class and, for a Hugging Face model, its config."""
    source = getattr(model, SOURCE_ATTR, None)
    if source is None:
        source = model if isinstance(model, nn.Module) else nn.ModuleList(list(layers))
    keys = _keys_by_tensor(source)
    layout = ModelLayout(layers)
    params = [[l, name, keys.get(id(p), []), list(p.shape)] for l in range(len(layers)) for name, p in layout.owned[l]]
    buffers = []
    for l, layer in enumerate(layers):
        synced = {name for name, _ in synced_buffers(layer)}
        for name, b in layer.named_buffers():
            buffers.append([l, name, keys.get(id(b), []), list(b.shape), name in synced])
    info: Dict[str, Any] = {"class": type(source).__name__}
    config = getattr(source, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        info["config"] = config.to_dict()
    return {"params": params, "buffers": buffers, "model": info}


def param_names(names: Dict[str, Any]) -> Dict[tuple, str]:
    """(layer, local name) -> the parameter's first model key (``layer.local`` where it has none)."""
    return {(l, local): (ks[0] if ks else f"{l}.{local}") for l, local, ks, _ in names["params"]}


def named_source(layers: nn.Module, source: Optional[nn.Module]) -> None:
    """Mark an adapter's layer list with the model it was cut from."""
    if source is not None:
        object.__setattr__(layers, SOURCE_ATTR, source)


def named_params(factory):
    """Mark an optimizer factory as taking ``(name, parameter)`` pairs instead of parameters: each stage
    then calls it with its parameters under the model's own names (see :func:`model_names`), so that
    it can build parameter groups by name (no weight decay on biases and norms, a smaller learning
    rate for embeddings). Returns ``factory``."""
    setattr(factory, NAMED_ATTR, True)
    return factory
