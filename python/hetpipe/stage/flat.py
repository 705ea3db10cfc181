"""A stage's flat float32 vectors: its parameters and its synchronised buffers, each one buffer whose
slices the modules' tensors view (updated in place, so the modules always compute with them).

Flat order of the parameters: each layer's owned parameters (its PS vector, ``model.layout``), layer
by layer, then the replicas of tied parameters owned outside the stage (never pushed), by (owner,
offset). The synchronised buffers (persistent float32 buffers such as BatchNorm's running
statistics) follow the same layer order in a second vector; other buffers stay in their modules.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hetpipe.model.layout import ModelLayout

TiedKey = Tuple[int, str]          # (owner layer, the owner's parameter name)


def check_float32(layers: Sequence[nn.Module], first: int) -> None:
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"hetpipe: layer {first + i} parameter {name!r} is {p.dtype}; "
                                "the parameter servers hold float32 weights")


class Flat:
    """One flat float32 buffer whose slices are the data of ``tensors`` (in order)."""

    def __init__(self, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
        self.numel = sum(t.numel() for t in tensors)
        self.data = torch.empty(self.numel, dtype=torch.float32, device=device)
        off = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                self.data[off:off + n].copy_(t.reshape(-1))
                t.data = self.data[off:off + n].view_as(t)
                off += n


class FlatParams:
    """The parameters and synchronised buffers of the stage's ``layers`` (layers ``[start, stop)``)
    in their flat order (module docstring)."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, layout: ModelLayout,
                 device: torch.device, param_names: Optional[Dict[Tuple[int, str], str]] = None) -> None:
        owned = [layers[l - start].get_parameter(n) for l in range(start, stop) for n, _ in layout.owned[l]]
        replicas = {(r.owner, r.owner_name): (r.offset, r.numel, layers[r.layer - start].get_parameter(r.name))
                    for r in layout.stage_replicas(start, stop)}
        self.replica_keys: List[TiedKey] = list(replicas)
        # The (owner layer, numel) of each replica, in flat order: the ledger's layout of the vector's tail.
        self.replica_sizes = [(k[0], replicas[k][1]) for k in self.replica_keys]
        self.params: List[nn.Parameter] = owned + [replicas[k][2] for k in self.replica_keys]
        flat = Flat(self.params, device)
        self.data, self.numel = flat.data, flat.numel
        # Per layer, each parameter name with the index of its parameter in ``params`` (a parameter two
        # layers share has one index): how a stash is built and its gradients read, per minibatch,
        # without walking the modules again.
        index = {id(p): i for i, p in enumerate(self.params)}
        self.layer_params = [[(n, index[id(p)]) for n, p in layer.named_parameters()] for layer in layers]
        # Every parameter the stage holds by its tied-parameter key: owned ones by (layer, name),
        # replicas by their owner's.
        self.by_key: Dict[TiedKey, nn.Parameter] = {
            **{(l, n): layers[l - start].get_parameter(n) for l in range(start, stop) for n, _ in layout.owned[l]},
            **{k: v[2] for k, v in replicas.items()}}
        bufs = [layers[l - start].get_buffer(n) for l in range(start, stop) for n, _ in layout.buffers[l]]
        self.buffers = Flat(bufs, device).data
        # The model's name of each flat parameter (a replica by its owner's), for named parameter groups.
        names = param_names or {}
        self.names = [names.get((l, n), f"{l}.{n}") for l in range(start, stop) for n, _ in layout.owned[l]] + \
            [names.get(k, f"{k[0]}.{k[1]}") for k in self.replica_keys]
