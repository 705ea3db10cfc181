"""Small models of the kinds users train, as layer sequences, and their plain PyTorch references.

* :func:`pytree_model`: layers passing a tuple (with an int64 leaf), a dict and a ``ModelOutput``-like
  mapping, plus a side input (``mask``) from the minibatch's inputs dict.
* :func:`tied_mlp`: an MLP whose first and last layers share one matrix (in / out, transposed).
* :func:`resnet`: a small ResNet with BatchNorm.
* :func:`dropout_mlp`: an MLP with dropout.
All are seeded, so every rank builds the same model.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn

from hetpipe.run.data import Batches


# --- pytree boundaries and side inputs -----------------------------------------------------------

class Embed(nn.Module):
    """inputs dict -> (hidden, token count as int64): a tuple with a leaf that carries no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 24)

    def forward(self, inputs: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x = inputs["x"]
        return torch.tanh(self.lin(x)), (x > 0).sum(dim=1)


class ToDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 24)

    def forward(self, value: Tuple[torch.Tensor, torch.Tensor]) -> Dict[str, torch.Tensor]:
        h, count = value
        return {"h": torch.tanh(self.lin(h)), "skip": h, "count": count}


class Masked(nn.Module):
    """Takes the side input ``mask`` (per-sample feature mask) and returns a ModelOutput-like value."""

    hetpipe_side_inputs = ("mask",)

    def __init__(self, output_type: Callable) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 24)
        self.output_type = output_type

    def forward(self, value: Dict[str, torch.Tensor], mask: torch.Tensor):
        h = torch.tanh(self.lin(value["h"])) * mask + value["skip"] * value["count"].unsqueeze(1).float() / 12
        return self.output_type(h)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(24, 5)

    def forward(self, value) -> torch.Tensor:
        return self.lin(value[0])


def model_output_type() -> Callable:
    """A Hugging Face ``ModelOutput`` class when transformers is installed, else a tuple wrapper."""
    try:
        from transformers.modeling_outputs import BaseModelOutput
        return lambda h: BaseModelOutput(last_hidden_state=h)
    except ImportError:
        return lambda h: (h,)


def pytree_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embed(), ToDict(), Masked(model_output_type()), Head())


class DictBatches:
    """Minibatches ``({"x": ..., "mask": ...}, y)`` (re-iterable, identical on every rank)."""

    def __init__(self, n: int = 64, batch: int = 8, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=g)
        self.mask = (torch.rand(n, 24, generator=g) > 0.3).float()
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.batch = batch

    def __len__(self) -> int:
        return len(self.x) // self.batch

    def __iter__(self):
        for i in range(0, len(self) * self.batch, self.batch):
            s = slice(i, i + self.batch)
            yield {"x": self.x[s], "mask": self.mask[s]}, self.y[s]


# --- tied weights ---------------------------------------------------------------------------------

class TiedOut(nn.Module):
    """The output layer: ``h @ W`` with the input layer's matrix ``W`` (shared, not copied)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


def tied_mlp(seed: int = 0) -> nn.Sequential:
    """64 -> 32 -> 32 -> 64 features; layer 0's weight (32 x 64) is layer 4's output matrix."""
    torch.manual_seed(seed)
    first = nn.Linear(64, 32)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), TiedOut(first.weight))


def tied_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


# --- BatchNorm ------------------------------------------------------------------------------------

class Stem(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def resnet(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Stem(), Block(8), Block(8), Pool())


def images(n: int = 64, batch: int = 8, seed: int = 5) -> Batches:
    g = torch.Generator().manual_seed(seed)
    return Batches(torch.randn(n, 1, 8, 8, generator=g) * 2 + 0.5, torch.randint(0, 10, (n,), generator=g),
                   batch, seed=seed)


# --- dropout --------------------------------------------------------------------------------------

def dropout_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.Dropout(0.2),
                         nn.Linear(32, 10))


# --- references -----------------------------------------------------------------------------------

def run_layers(layers: nn.Sequential, inputs):
    """The layer contract in plain PyTorch: each layer takes its predecessor's value, plus the side
    inputs it names from the inputs dict."""
    value = inputs
    for layer in layers:
        side = {k: inputs[k] for k in getattr(layer, "hetpipe_side_inputs", ())}
        value = layer(value, **side)
    return value


def plain_training(model: nn.Sequential, loss_fn: Callable, opt_factory: Callable, data, epochs: int = 1,
                   autocast: bool = False) -> List[float]:
    """Train ``model`` in place, one minibatch after the other (plain PyTorch); the losses.
    ``autocast``: forward and loss under CPU autocast to bfloat16, backward outside (PyTorch's recipe)."""
    opt = opt_factory(model.parameters())
    losses = []
    for e in range(epochs):
        if hasattr(data, "set_epoch"):
            data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(run_layers(model, x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def vw_waves(model: nn.Module, loss_fn: Callable, opt_factory: Callable, batches: Sequence, num_vws: int,
             aggregate: str) -> nn.Module:
    """HetPipe with ``num_vws`` one-stage VWs, nm = 1, D = 0, in plain PyTorch: in wave ``c`` each VW
    trains a copy of the global model (weights and buffers) on its ``c``-th minibatch with its own
    optimizer; the global weights move by the sum (or mean) of the VWs' changes, the global float
    buffers become the average of the VWs' buffers, the others (counters) VW 0's."""
    per_vw = len(batches) // num_vws
    replicas = [copy.deepcopy(model) for _ in range(num_vws)]
    opts = [opt_factory(r.parameters()) for r in replicas]
    scale = num_vws if aggregate == "mean" else 1
    for c in range(per_vw):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for v, (r, opt) in enumerate(zip(replicas, opts)):
            r.load_state_dict(model.state_dict())
            x, y = batches[c * num_vws + v]
            opt.zero_grad()
            loss_fn(r(x), y).backward()
            opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                change = sum(dict(r.named_parameters())[n] - before[n] for r in replicas)
                p.copy_(before[n] + change / scale)
            for n, b in model.named_buffers():
                if b.is_floating_point():
                    b.copy_(sum(dict(r.named_buffers())[n] for r in replicas) / num_vws)
                else:
                    b.copy_(dict(replicas[0].named_buffers())[n])
    return model
