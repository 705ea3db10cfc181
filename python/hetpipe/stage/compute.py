"""A stage's forward, recompute and backward over its segments (docs/design.md, "Random state",
"Mixed precision").

``forward(mb)`` runs each segment on minibatch ``mb``'s stash, keeping the graph of kept segments
and only the input of recomputed ones (run under ``no_grad``); ``recompute(mb)`` rebuilds the
recomputed segments from those inputs with the same stash, generator state and buffers
(:mod:`hetpipe.stage.recompute`); ``backward(mb)`` back-propagates segment by segment, last to
first. The same ops run on the same weights, so the numbers equal those of a run without
recomputation bitwise (on CPU).

Pytree values: a segment's input and output are any pytree of tensors (``model.tree``); its floating
leaves carry gradients. Side inputs (``hetpipe_side_inputs``) are keyword arguments of the layers
that declare them, given per minibatch to ``forward``.

Precision: with ``precision`` "bf16" or "fp16" every segment's forward (and its recompute) runs under
``torch.autocast`` on the float32 weights; the backward runs outside autocast, and a gradient that
arrives in a narrower dtype than the output leaf it belongs to is widened first (what autograd does
for the cast the wire stands for).
Thread role: the stage's one thread.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetpipe.model.swap import SwapCall
from hetpipe.plan.precision import HALF_DTYPE
from hetpipe.stage.recompute import Replays
from hetpipe.stage.stash import Stash


def _float_leaves(tree: Any) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if t.is_floating_point()]


def _attach(tree: Any) -> Any:
    """``tree`` with its floating leaves detached and requiring grad (the segment's differentiable input)."""
    return pytree.tree_map(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, tree)


class SegmentRunner:
    """Runs the stage's ``layers`` (layers ``[start, stop)`` of the model) segment by segment."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, segments: List[Tuple[bool, range]],
                 precision: str, device: torch.device, replays: Replays) -> None:
        self.layers, self.start, self.stop, self.segments = layers, start, stop, segments
        self.precision, self.device, self.replays = precision, device, replays
        self.side_inputs: List[Tuple[str, ...]] = [tuple(getattr(m, "hetpipe_side_inputs", ())) for m in layers]
        # Each layer runs on a minibatch's stash, not on its live parameters (model.swap).
        self._calls = [SwapCall(m) for m in layers]
        # mb -> per segment [input, output]; output None while a recomputed segment awaits Recompute(mb)
        self.saved: Dict[int, List[List[Any]]] = {}

    def compute_context(self) -> ContextManager[Any]:
        """Where forwards and the loss run: autocast to the half dtype under "bf16" and "fp16"; under
        "fp32" no context at all, so the float32 path is exactly what it was."""
        if self.precision in HALF_DTYPE:
            return torch.autocast(self.device.type, dtype=getattr(torch, HALF_DTYPE[self.precision]))
        return contextlib.nullcontext()

    def _run(self, stash: Stash, x: Any, layers: range, side: Dict[str, Any],
             buffers: Optional[List[Dict[str, torch.Tensor]]] = None) -> Any:
        with self.compute_context():
            for n, i in enumerate(layers):
                kwargs = {k: side[k] for k in self.side_inputs[i]}
                tensors = stash[i] if buffers is None else {**stash[i], **buffers[n]}
                try:
                    x = self._calls[i](tensors, (x,), kwargs)
                except Exception as e:
                    e.add_note(f"hetpipe: raised by layer {self.start + i} ({type(self.layers[i]).__name__})")
                    raise
        return x

    def forward(self, mb: int, stash: Stash, x: Any, needs_input_grad: bool, side: Dict[str, Any]) -> Any:
        """Forward of minibatch ``mb`` on ``stash``, with the generators seeded for ``mb``; returns the
        output (attached unless the last segment is recomputed)."""
        rng = self.replays.rng
        saved: List[List[Any]] = []
        records: Dict[int, Any] = {}
        with rng.fork():
            rng.seed_for(mb)
            for k, (recomputed, layers) in enumerate(self.segments):
                if k > 0 or needs_input_grad:
                    x = _attach(x)
                if recomputed:
                    # What the recompute needs to rerun this forward exactly: the generator state and
                    # the buffers as they are now (the forward below updates the live ones, once).
                    records[k] = self.replays.capture(layers)
                    with torch.no_grad():
                        out = self._run(stash, x, layers, side)
                    saved.append([x, None])
                else:
                    out = self._run(stash, x, layers, side)
                    saved.append([x, out])
                x = out
        self.saved[mb] = saved
        self.replays.keep(mb, records, side)
        return x

    def recompute(self, mb: int, stash: Stash) -> Any:
        """Rebuild the recomputed segments of minibatch ``mb`` from their saved inputs, ``stash`` (its
        forward's), generator state and buffers; returns the stage's (attached) output."""
        saved = self.saved[mb]
        records, side = self.replays.take(mb)
        for k, ((recomputed, layers), seg) in enumerate(zip(self.segments, saved)):
            if recomputed:
                state, buffers = records[k]
                with self.replays.rng.fork():
                    self.replays.rng.restore(state)
                    seg[1] = self._run(stash, seg[0], layers, side, buffers)
        return saved[-1][1]

    def _no_graph(self, mb: int) -> RuntimeError:
        return RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for minibatch "
                            f"{mb}: Recompute({mb}) must precede Bwd({mb})")

    def output_of(self, mb: int) -> Any:
        out = self.saved[mb][-1][1]
        if out is None:
            raise self._no_graph(mb)
        return out

    def backward(self, mb: int, root: Any, grads: Optional[Sequence[torch.Tensor]]) -> Optional[List[torch.Tensor]]:
        """Back-propagate ``root`` (the loss, with ``grads`` None, or the output pytree with the gradients
        of its floating leaves) through every segment, last first; returns the gradients of the stage
        input's floating leaves (zeros where none flowed), or None when the input has no gradient."""
        saved = self.saved.pop(mb)
        for k in range(len(saved) - 1, -1, -1):
            if k < len(saved) - 1:
                root = saved[k][1]
                if root is None:
                    raise self._no_graph(mb)
                grads = [t.grad for t in _float_leaves(saved[k + 1][0])]
            if grads is None:
                if root.requires_grad:
                    root.backward()
                continue
            # A half-precision wire gradient of a float32 output is widened, as autograd widens the
            # gradient of a cast (exact); under "fp32" the dtypes already agree.
            pairs = [(t, g.to(t.dtype)) for t, g in zip(_float_leaves(root), grads)
                     if t.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = _float_leaves(saved[0][0])
        if not any(t.requires_grad for t in leaves):
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
