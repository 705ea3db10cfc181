"""The JAX front end's model checks: a dtype the PS does not hold and a layer that cannot take what the
previous one returns are one-line errors naming the layer; the stage math's gradients against
``jax.grad`` of the whole model."""

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hetpipe.jax import Layer, manual_plan, sgd, vw_minibatches  # noqa: E402
from hetpipe.jax.model import FlatLayers, StageMath, boundary_shapes, jitted_step  # noqa: E402


def _dense(n_in, n_out, seed, dtype=jnp.float32):
    w = jax.random.normal(jax.random.PRNGKey(seed), (n_in, n_out)).astype(dtype)
    return {"w": w, "b": jnp.zeros(n_out, dtype)}


def _apply(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _loss(y, t):
    return jnp.mean((y - t) ** 2)


def test_a_float64_parameter_names_its_layer():
    jax.config.update("jax_enable_x64", True)
    try:
        layers = [Layer(_dense(4, 4, 0), _apply), Layer(_dense(4, 2, 1, jnp.float64), _apply, "head")]
        with pytest.raises(ValueError, match=r"layer 1 \(head\) parameter \['b'\] is float64; the parameter servers "
                                             r"hold float32"):
            FlatLayers(layers)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_a_layer_that_cannot_take_the_previous_output_is_named():
    flat = FlatLayers([Layer(_dense(4, 8, 0), _apply), Layer(_dense(5, 2, 1), _apply, "head")])
    x, t = np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"layer 1 \(head\) cannot take float32\[3, 8\] \(what layer 0 returns\)"):
        boundary_shapes(flat, x, t, _loss)


def test_boundary_shapes_and_a_non_scalar_loss():
    flat = FlatLayers([Layer(_dense(4, 8, 0), _apply), Layer(_dense(8, 2, 1), _apply)])
    x, t = np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32)
    assert boundary_shapes(flat, x, t, _loss) == [((3, 4), "float32"), ((3, 8), "float32"), ((3, 2), "float32")]
    with pytest.raises(ValueError, match="the loss returns"):
        boundary_shapes(flat, x, t, lambda y, t: (y - t) ** 2)


def test_stage_math_chains_to_the_whole_models_gradient():
    layers = [Layer(_dense(4, 8, 0), _apply), Layer(_dense(8, 8, 1), _apply), Layer(_dense(8, 2, 2), _apply)]
    flat = FlatLayers(layers)
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(5, 2)).astype(np.float32)
    first, last = StageMath(flat, 0, 1, input_grad=False), StageMath(flat, 1, 3, _loss)
    w0, w1 = jnp.asarray(flat.vectors[0]), jnp.asarray(np.concatenate(flat.vectors[1:]))
    h = first.forward(w0, x)
    g1, gh = last.loss_backward(w1, h, t)
    g0, none = first.backward(w0, x, gh)
    assert none is None

    def whole(params):
        y = x
        for p, layer in zip(params, layers):
            y = layer.apply(p, y)
        return _loss(y, t)

    ref = jax.grad(whole)([layer.params for layer in layers])
    ref_flat = [np.asarray(jax.flatten_util.ravel_pytree(r)[0]) for r in ref]
    np.testing.assert_allclose(np.asarray(g0), ref_flat[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.concatenate(ref_flat[1:]), rtol=1e-5, atol=1e-6)


def test_sgd_with_momentum_follows_pytorchs_convention():
    step = jitted_step(sgd(0.5, momentum=0.9))
    w, m = jnp.ones(3), jnp.zeros(3)
    g = jnp.asarray([1.0, 2.0, 4.0])
    w, m = step(w, g, m)                  # m = g, w = 1 - 0.5 g
    w, m = step(w, g, m)                  # m = 0.9 g + g, w -= 0.5 m
    np.testing.assert_allclose(np.asarray(w), 1 - 0.5 * np.asarray(g) - 0.5 * 1.9 * np.asarray(g), rtol=1e-6)


def test_minibatches_per_vw_and_manual_plans():
    assert vw_minibatches(list(range(7)), 2, 2) == [[0, 2, 4, 0, 2, 4], [1, 3, 5, 1, 3, 5]]
    with pytest.raises(ValueError, match="1 minibatches for 2 virtual workers"):
        vw_minibatches([0], 2, 1)
    plan = manual_plan(4, [[2], []], nm=2, d=1, shards=2)
    assert [len(vw.stages) for vw in plan.virtual_workers] == [2, 1] and plan.num_ranks == 5
    with pytest.raises(ValueError, match=r"VW 1's cuts \[3, 2\] must increase"):
        manual_plan(4, [[2], [3, 2]], nm=2, d=1)
