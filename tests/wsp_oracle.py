"""WSP written from its specification (docs/design.md: "Aggregation across VWs", the wave ledger of
"Front ends: WSP's worker half", "Run records and the replay"), in plain torch, for runs with D >= 1.

Given the version of the global weights each pull got (a run's record says which), :func:`wsp_oracle`
computes what every stage of every VW computes and what the PS ends with. It shares no code with
hetpipe: only tensors and ``torch.autograd``. The rules it follows, for Nm = 1 (one minibatch per wave,
so a VW's stages run one minibatch at a time and each stage's weights change only in its own steps
and pulls):

* Versions. ``W_0`` is the model's initial weights. When wave ``c`` is applied, every layer moves by
  each VW's wave-``c`` delta of it, VW by VW: ``W_{c+1} = W_c + sum_v u_{v,c} / n``, with ``n`` the
  number of VWs for ``aggregate="mean"`` and 1 for ``"sum"``. ``u_{v,c}`` comes from the stage of VW
  ``v`` holding the layer.
* Pull. Wave ``w >= 1`` of a stage starts with ``Pull(w)`` (wave 0 starts from ``W_0``): from each PS
  shard holding its layers it gets ``W_g`` at some ``g`` with ``w - D <= g <= w``, and those layers
  become ``W_g`` plus the stage's own deltas of the waves ``g .. w - 1`` (the waves ``W_g`` does not
  hold yet; its own, undivided).
* Wave ``w`` of VW ``v``: its ``w``-th minibatch goes forward through the stages on their current
  weights; the loss (mean cross-entropy) is back-propagated; each stage takes one SGD step (torch's
  convention for momentum, whose buffer the stage keeps across pulls). ``after - before`` of that step
  is the stage's wave-``w`` delta, which ``Push(w)`` sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]
Params = List[List[torch.Tensor]]                  # per layer: its parameters (weight, bias); [] if none
PullKey = Tuple[int, int, int, int]                # (vw, stage, wave, shard)


@dataclass
class OracleRun:
    """What the spec says a run computes."""

    losses: Dict[int, Dict[int, float]]             # vw -> minibatch -> loss at its forward
    weights: Params                                 # the final global weights W_T


def forward(model: nn.Sequential, params: Params, first: int, x: torch.Tensor) -> torch.Tensor:
    """Layers ``first .. first + len(params) - 1`` of ``model`` on ``x``, with ``params`` as their weights."""
    for i, ps in enumerate(params):
        layer = model[first + i]
        if isinstance(layer, nn.Linear):
            x = nn.functional.linear(x, ps[0], ps[1])
        elif isinstance(layer, nn.ReLU):
            x = torch.relu(x)
        elif isinstance(layer, nn.Tanh):
            x = torch.tanh(x)
        else:
            raise TypeError(f"the oracle has no rule for {layer}")
    return x


class Sgd:
    """One stage's SGD: ``buf = g`` at the first step, then ``buf = momentum * buf + g``; ``w -= lr * buf``."""

    def __init__(self, lr: float, momentum: float) -> None:
        self.lr, self.momentum = lr, momentum
        self.buf: Dict[Tuple[int, int], torch.Tensor] = {}

    def step(self, params: Params, grads: Params) -> Params:
        out = []
        for i, (ps, gs) in enumerate(zip(params, grads)):
            row = []
            for j, (p, g) in enumerate(zip(ps, gs)):
                if self.momentum:
                    b = self.buf.get((i, j))
                    b = g.clone() if b is None else self.momentum * b + g
                    self.buf[(i, j)] = b
                    g = b
                row.append(p - self.lr * g)
            out.append(row)
        return out


def wsp_oracle(model: nn.Sequential, vw_bounds: Sequence[Sequence[Tuple[int, int]]], shard_of: Mapping[int, int],
               batches: Sequence[Sequence[Batch]], d: int, aggregate: str, lr: float, momentum: float,
               versions: Mapping[PullKey, int]) -> OracleRun:
    """The run of ``model`` (its current parameters are ``W_0``) under WSP with Nm = 1.

    ``vw_bounds``: per VW, its stages' ``(start, stop)`` layer ranges; ``shard_of``: layer -> PS shard;
    ``batches[v]``: VW ``v``'s minibatches, one per wave (every VW runs as many waves); ``versions``:
    ``(vw, stage, wave, shard) -> g``, the version each pull got. A pull outside ``w - D <= g <= w`` or
    missing from ``versions`` is an AssertionError: the record is then not of a WSP run."""
    assert aggregate in ("mean", "sum"), aggregate
    num_vws, waves = len(vw_bounds), len(batches[0])
    assert all(len(b) == waves for b in batches), "every VW runs the same number of waves"
    W: List[Params] = [[[p.detach().clone() for p in layer.parameters()] for layer in model]]
    # Per (vw, stage): live weights of its layers, optimizer, and its deltas of waves not yet merged.
    live = {(v, s): [[p.clone() for p in W[0][l]] for l in range(a, b)]
            for v, stages in enumerate(vw_bounds) for s, (a, b) in enumerate(stages)}
    opts = {key: Sgd(lr, momentum) for key in live}
    own: Dict[Tuple[int, int], Dict[int, Params]] = {key: {} for key in live}
    losses: Dict[int, Dict[int, float]] = {v: {} for v in range(num_vws)}
    for w in range(waves):
        wave_delta: Dict[int, Params] = {}             # vw -> per layer, its delta of wave w
        for v, stages in enumerate(vw_bounds):
            if w >= 1:
                for s, (a, b) in enumerate(stages):
                    live[(v, s)] = _pulled(W, own[(v, s)], versions, v, s, w, a, b, shard_of, d)
            leaves = [[[p.clone().requires_grad_(True) for p in ps] for ps in live[(v, s)]]
                      for s in range(len(stages))]
            x, y = batches[v][w]
            for s, (a, _) in enumerate(stages):
                x = forward(model, leaves[s], a, x)
            loss = nn.functional.cross_entropy(x, y)
            loss.backward()
            losses[v][w] = float(loss.detach())
            wave_delta[v] = []
            for s in range(len(stages)):
                before = live[(v, s)]
                after = opts[(v, s)].step(before, [[p.grad for p in ps] for ps in leaves[s]])
                delta = [[q - p for p, q in zip(ps, qs)] for ps, qs in zip(before, after)]
                own[(v, s)][w] = delta
                wave_delta[v] += delta
                live[(v, s)] = after
        n = num_vws if aggregate == "mean" else 1
        nxt = [[p.clone() for p in ps] for ps in W[w]]
        for v in range(num_vws):
            for layer, ps in enumerate(nxt):
                for j in range(len(ps)):
                    ps[j] = ps[j] + wave_delta[v][layer][j] / n
        W.append(nxt)
    return OracleRun(losses, W[-1])


def _pulled(W: List[Params], own: Dict[int, Params], versions: Mapping[PullKey, int], v: int, s: int, w: int,
            a: int, b: int, shard_of: Mapping[int, int], d: int) -> Params:
    """Stage ``(v, s)``'s layers ``a .. b - 1`` after Pull(w): ``W_g`` of each layer's shard plus the
    stage's own deltas of waves ``g .. w - 1``."""
    out = []
    for layer in range(a, b):
        if not W[0][layer]:
            out.append([])
            continue
        key = (v, s, w, shard_of[layer])
        assert key in versions, f"no recorded version for the pull of wave {w} by VW {v} stage {s} at shard {key[3]}"
        g = versions[key]
        assert w - d <= g <= w, f"the pull of wave {w} by VW {v} stage {s} got W_{g}: outside [w - D, w], D = {d}"
        ps = [p.clone() for p in W[g][layer]]
        for c in range(g, w):
            ps = [p + dp for p, dp in zip(ps, own[c][layer - a])]
        out.append(ps)
    return out


def flat(params: Params) -> List[torch.Tensor]:
    """Per layer, its parameters as one flat vector (weight then bias), as the PS holds them."""
    return [torch.cat([p.reshape(-1) for p in ps]) if ps else torch.zeros(0) for ps in params]
