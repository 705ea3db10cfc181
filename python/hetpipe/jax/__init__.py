"""The JAX front end: a JAX model, as a list of layers, trains pipelined under WSP; no torch needed.

``train(comm, plan, layers, loss, optimizer, batches)`` on every rank of an MPI job: each
``Layer(params, apply)`` is a unit the plan cuts into stages and the PS shards own; gradients come
from ``jax.vjp``; the PS ranks run the core's shard service, as torch runs do.
"""

from hetpipe.jax.model import FlatLayers, Layer, Optimizer, sgd
from hetpipe.jax.train import JaxResult, train, vw_minibatches
from hetpipe.plan.manual import manual_plan

__all__ = ["Layer", "Optimizer", "sgd", "train", "JaxResult", "manual_plan", "FlatLayers", "vw_minibatches"]
