"""A JAX model as hetpipe sees it: a list of layers, each a params pytree and an ``apply(params, x)``.

The layers are the units the plan cuts into stages and the PS shards own. Each layer's params are
raveled into one flat float32 vector (``jax.flatten_util.ravel_pytree``); a stage's weights are its
layers' vectors end to end, the layout the wave ledger and the PS exchange (docs/design.md,
"Front ends"). Values between stages are single float32 arrays.

:class:`StageMath` holds a stage's jitted computations on its flat weights: the forward, the
backward (``jax.vjp``, recomputing the forward inside one compiled function, so a minibatch's stash is
just the weights and input its forward saw: JAX arrays are immutable), and on the last stage the
loss and its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


@dataclass(frozen=True)
class Layer:
    """``apply(params, x) -> y``; ``params`` a pytree of float32 arrays (the PS holds float32)."""

    params: Any
    apply: Callable[[Any, Any], Any]
    name: str = ""


class FlatLayers:
    """Each layer's params as a flat float32 NumPy vector, and the function that rebuilds the pytree.

    A ValueError names the layer and the leaf whose dtype the PS does not hold."""

    def __init__(self, layers: Sequence[Layer]) -> None:
        self.layers = list(layers)
        self.vectors: List[np.ndarray] = []
        self.unravel: List[Callable[[Any], Any]] = []
        for i, layer in enumerate(self.layers):
            for path, leaf in jax.tree_util.tree_flatten_with_path(layer.params)[0]:
                dtype = getattr(leaf, "dtype", type(leaf).__name__)
                if str(dtype) != "float32":
                    raise ValueError(f"hetpipe: layer {i}{_named(layer)} parameter {jax.tree_util.keystr(path)} is "
                                     f"{dtype}; the parameter servers hold float32 weights")
            flat, unravel = ravel_pytree(layer.params)
            self.vectors.append(np.asarray(flat, dtype=np.float32).reshape(-1).copy())
            self.unravel.append(unravel)

    @property
    def sizes(self) -> List[int]:
        return [v.size for v in self.vectors]

    def params_of(self, layer: int, flat: Any) -> Any:
        return self.unravel[layer](jnp.asarray(flat))


def _named(layer: Layer) -> str:
    return f" ({layer.name})" if layer.name else ""


def boundary_shapes(flat: FlatLayers, x: Any, y: Any, loss: Callable) -> List[Tuple[Tuple[int, ...], str]]:
    """``(shape, dtype)`` of what enters each layer (and, last, of the model's output), traced abstractly
    on a minibatch ``(x, y)``. A ValueError names the layer that cannot take what the previous one
    returns, or a loss that does not give a scalar."""
    spec = jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype)
    out = [(tuple(spec.shape), str(spec.dtype))]
    for i, layer in enumerate(flat.layers):
        try:
            spec = jax.eval_shape(layer.apply, layer.params, spec)
        except Exception as e:  # noqa: BLE001 - named and re-raised as the user's error
            raise ValueError(f"hetpipe: layer {i}{_named(layer)} cannot take {out[-1][1]}{list(out[-1][0])} "
                             f"(what {'the data gives' if i == 0 else f'layer {i - 1} returns'}): "
                             f"{type(e).__name__}: {e}") from None
        if not isinstance(spec, jax.ShapeDtypeStruct):
            raise ValueError(f"hetpipe: layer {i}{_named(layer)} returns a {type(spec).__name__}; a value between "
                             "layers is one array")
        out.append((tuple(spec.shape), str(spec.dtype)))
    value = jax.eval_shape(loss, spec, jax.ShapeDtypeStruct(np.shape(y), jnp.asarray(y).dtype))
    if getattr(value, "shape", None) != ():
        raise ValueError(f"hetpipe: the loss returns {getattr(value, 'shape', value)}, not a scalar")
    return out


class StageMath:
    """The jitted computations of the stage holding layers ``[start, stop)`` on its flat weights."""

    def __init__(self, flat: FlatLayers, start: int, stop: int, loss: Optional[Callable] = None,
                 input_grad: bool = True) -> None:
        offsets = np.cumsum([0] + flat.sizes[start:stop]).tolist()

        def run(w, x):
            for i in range(start, stop):
                params = flat.unravel[i](w[offsets[i - start]:offsets[i - start + 1]])
                x = flat.layers[i].apply(params, x)
            return x

        argnums = (0, 1) if input_grad else (0,)
        self.forward = jax.jit(run)
        self.backward = jax.jit(lambda w, x, g: _pad(jax.vjp(run, w, x)[1](g), input_grad))
        if loss is not None:
            def lossed(w, x, y):
                return loss(run(w, x), y)

            self.loss = jax.jit(lossed)
            self.loss_backward = jax.jit(lambda w, x, y: _pad(jax.grad(lossed, argnums=argnums)(w, x, y), input_grad))


def _pad(grads: Tuple, input_grad: bool) -> Tuple[Any, Any]:
    """``(gradient of the weights, gradient of the input or None)``."""
    return (grads[0], grads[1] if input_grad else None)


@dataclass(frozen=True)
class Optimizer:
    """The optax contract, on a stage's flat weights: ``init(w) -> state``;
    ``update(grads, state, w) -> (updates, state)``; the step is ``w + updates``. An optax
    ``GradientTransformation`` satisfies it as it is."""

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], Tuple[Any, Any]]


def sgd(lr: float, momentum: float = 0.0) -> Optimizer:
    """Stochastic gradient descent, with heavy-ball ``momentum`` when non-zero (PyTorch's convention:
    ``m = momentum * m + g``, step ``-lr * m``)."""
    if momentum == 0.0:
        return Optimizer(lambda w: (), lambda g, s, w: (-lr * g, s))
    return Optimizer(lambda w: jnp.zeros_like(w),
                     lambda g, m, w: (lambda m2: (-lr * m2, m2))(momentum * m + g))


def jitted_step(optimizer: Any) -> Callable[[Any, Any, Any], Tuple[Any, Any]]:
    """``step(w, grads, state) -> (new w, state)`` of ``optimizer``, compiled."""
    def step(w, g, state):
        updates, state = optimizer.update(g, state, w)
        return w + updates, state

    return jax.jit(step)
