"""The layer contract in one process: a model's ordered layers, their side inputs, and the boundary shapes between them."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Union

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetpipe.model.tree import Boundary, boundary_of


def as_layers(model: Union[nn.Module, Sequence[nn.Module]]) -> List[nn.Module]:
    """The ordered layers of an ``nn.Sequential`` (or of a list of modules). A ``torch.compile``'d
    model, layer or submodule is refused (docs/training.md, "Models")."""
    if _compiled(model):
        raise TypeError("hetpipe: the model is torch.compile'd, which hetpipe does not support yet (docs/training.md): "
                        "pass the module itself (its ._orig_mod)")
    if isinstance(model, nn.Sequential) or isinstance(model, (list, tuple, nn.ModuleList)):
        layers = list(model)
    else:
        raise TypeError(f"hetpipe: the model must be an nn.Sequential or a list of modules, got {type(model).__name__}")
    for i, layer in enumerate(layers):
        inner = next((name or "itself" for name, m in layer.named_modules() if _compiled(m)), None) \
            if isinstance(layer, nn.Module) else None
        if inner is not None:
            raise TypeError(f"hetpipe: layer {i} ({'its ' + inner if inner != 'itself' else 'the layer itself'}) "
                            f"is torch.compile'd, which hetpipe does not support yet (docs/training.md): pass "
                            f"the module itself (its ._orig_mod)")
    return layers


def _compiled(m: Any) -> bool:
    """Whether ``m`` is a ``torch.compile`` wrapper (dynamo's OptimizedModule), without importing dynamo."""
    return type(m).__name__ == "OptimizedModule" and hasattr(m, "_orig_mod")


@dataclass(frozen=True)
class LayerFailure:
    """Layer ``layer`` raised during shape inference on this rank; the boundaries after it are unknown."""

    layer: int
    error: str

    def explain(self) -> str:
        return f"layer {self.layer} failed on the first minibatch during shape inference: {self.error}"


def side_inputs_of(layer: nn.Module, i: int, inputs: Any) -> Dict[str, Any]:
    """The side inputs layer ``i`` declares (``hetpipe_side_inputs``), taken from the minibatch inputs."""
    keys = tuple(getattr(layer, "hetpipe_side_inputs", ()))
    if not keys:
        return {}
    if not isinstance(inputs, dict):
        raise ValueError(f"hetpipe: layer {i} ({type(layer).__name__}) declares side inputs {list(keys)}, but the "
                         f"minibatch inputs are a {type(inputs).__name__}, not a dict")
    missing = [k for k in keys if k not in inputs]
    if missing:
        raise ValueError(f"hetpipe: layer {i} ({type(layer).__name__}) declares side inputs {missing} that the "
                         f"minibatch inputs lack (their keys: {sorted(inputs)})")
    return {k: inputs[k] for k in keys}


FALLBACK_SAMPLES = 2


def infer_boundaries(layers: Sequence[nn.Module], x: Any) -> List[Union[Boundary, LayerFailure, None]]:
    """What enters each layer (and leaves the last), as :class:`Boundary` pytree specs.

    ``x`` is the first minibatch's inputs (a tensor or a dict of tensors). Runs on the meta device (no
    real compute), falling back to a real no-grad pass, on a copy of the layer and with the caller's
    random state restored, for layers meta cannot run (e.g. a causal-mask builder that reads the
    attention mask's values). The real pass takes the first ``FALLBACK_SAMPLES`` samples only: a
    boundary is per sample (batch on dim 0), and a whole minibatch of a large model would cost every
    rank minutes of CPU at start-up; two, not one, so that a training-mode BatchNorm still has a
    batch to normalise over. A layer returning a non-tensor leaf is a
    TypeError naming it. A layer that raises on this rank's copy of the model gives a
    :class:`LayerFailure` for every later boundary: only a stage that needs one of them fails (see
    :func:`build_stage`), with that layer's own error."""
    out: List[Union[Boundary, LayerFailure, None]] = [boundary_of(x, "the data loader's inputs")]
    to_meta = lambda t: torch.empty_like(t, device="meta")  # noqa: E731
    cur = pytree.tree_map(to_meta, x)
    meta_inputs = pytree.tree_map(to_meta, x)
    real: Any = None
    few = pytree.tree_map(lambda t: t[:FALLBACK_SAMPLES] if isinstance(t, torch.Tensor) and t.dim() else t, x)
    for i, layer in enumerate(layers):
        side = side_inputs_of(layer, i, few)
        where = f"layer {i} ({type(layer).__name__})"
        try:
            with torch.random.fork_rng(devices=[]):
                if real is None:
                    try:
                        tensors = {k: to_meta(v) for k, v in (*layer.named_parameters(), *layer.named_buffers())}
                        cur = torch.func.functional_call(layer, tensors, (cur,),
                                                         side_inputs_of(layer, i, meta_inputs))
                    except (NotImplementedError, RuntimeError):
                        real = pytree.tree_map(lambda t: torch.zeros((min(t.shape[0], FALLBACK_SAMPLES),
                                                                      *t.shape[1:]), dtype=t.dtype), cur)
                if real is not None:
                    with torch.no_grad():
                        real = copy.deepcopy(layer)(real, **side)
        except Exception as e:  # noqa: BLE001 - this rank's copy cannot run layer i; later shapes are unknown
            out.extend([LayerFailure(i, f"{type(e).__name__}: {e}")] * (len(layers) - i))
            break
        out.append(boundary_of(cur if real is None else real, where))
    return out


def boundary_bytes(b: Union[Boundary, LayerFailure, None], batch: int) -> int:
    return b.nbytes(batch) if isinstance(b, Boundary) else 0
