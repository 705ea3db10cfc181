"""A JAX MLP trained by hetpipe: 2 virtual workers of 2 pipelined stages each, under WSP (D = 1), with
2 PS shards on the compiled core's shard service. No torch is imported.

    mpiexec -n 6 python examples/jax_mlp.py             # hetpipe; rank 0 prints both tables
    python examples/jax_mlp.py --plain                   # the plain single-process JAX loop alone

The plain loop below is what a JAX user starts from; the hetpipe version changes the lines marked
``# hetpipe``. Rank 0 then trains the plain loop in-process on the same data and prints both runs'
losses per sample, in the data's order (VW ``v``'s ``k``-th minibatch is minibatch ``2k + v``).
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import hetpipe.jax as hj                                       # hetpipe

LR, EPOCHS, CLASSES = 0.1, 4, 3


def dense(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out), jnp.float32) / np.sqrt(n_in), "b": jnp.zeros(n_out)}


def hidden(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def logits(p, x):
    return x @ p["w"] + p["b"]


def loss(out, y):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(out) * jax.nn.one_hot(y, CLASSES), axis=-1))


def data(n=1536, batch=32, seed=0):
    """Three Gaussian blobs in 16 dimensions, shuffled, as ``(inputs, labels)`` minibatches."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n).astype(np.int32)
    centres = rng.normal(size=(CLASSES, 16)).astype(np.float32)
    x = (centres[y] + 1.2 * rng.normal(size=(n, 16))).astype(np.float32)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


keys = jax.random.split(jax.random.PRNGKey(0), 4)
layers = [hj.Layer(dense(keys[0], 16, 64), hidden), hj.Layer(dense(keys[1], 64, 64), hidden),   # hetpipe
          hj.Layer(dense(keys[2], 64, 64), hidden), hj.Layer(dense(keys[3], 64, CLASSES), logits)]
batches = data()


def plain():
    """The single-process loop: sequential SGD over the minibatches, epoch after epoch."""
    def forward(params, x):
        for layer, p in zip(layers, params):
            x = layer.apply(p, x)
        return x

    @jax.jit
    def update(params, x, y):
        value, grads = jax.value_and_grad(lambda ps: loss(forward(ps, x), y))(params)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), value

    params, losses = [layer.params for layer in layers], []
    for _ in range(EPOCHS):
        for x, y in batches:
            params, value = update(params, x, y)
            losses.append(float(value))
    return losses


def main():
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--plain", action="store_true", help="run the plain single-process loop only")
    if args.parse_args().plain:
        print(" ".join(f"{v:.4f}" for v in plain()))
        return 0
    from mpi4py import MPI                                                                         # hetpipe

    plan = hj.manual_plan(len(layers), [[2], [2]], nm=2, d=1, shards=2, aggregate="mean")          # hetpipe
    result = hj.train(MPI.COMM_WORLD, plan, layers, loss, hj.sgd(LR), batches, epochs=EPOCHS)      # hetpipe
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    ours = [result.losses[v][k] for k in range(len(result.losses[0])) for v in sorted(result.losses)]
    reference = plain()
    print(f"JAX MLP, {len(batches)} minibatches x {EPOCHS} epochs; hetpipe: 2 VWs x 2 stages, Nm = 2, D = 1, "
          f"PS plane {result.ps_plane}; plain: one process, sequential SGD (CPU, real devices)")
    print(f"{'samples':>8} {'hetpipe loss':>13} {'plain loss':>11}")
    window = len(batches) // 2
    for start in range(0, len(ours), window):
        print(f"{(start + window) * 32:>8} {np.mean(ours[start:start + window]):>13.4f} "
              f"{np.mean(reference[start:start + window]):>11.4f}")
    print("torch imported:", "torch" in sys.modules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
