"""``Emulated(module, fwd_s, bwd_s)``: run a module for real, then pad forward and backward to a device's time.

The padding is hetpipe's own ``Pacer`` (the one the hetpipe runtime pads its Fwd/Bwd
instructions with), so the baselines and hetpipe share one device model and one padding code path.

Contract: the forward of the wrapped module takes at least ``fwd_s`` seconds of wall time and its
backward (from the moment the gradient of its output arrives to the moment the gradient of its
input leaves) at least ``bwd_s``. Parameter gradients are produced inside that window, before the
backward padding, so gradient hooks (DDP's all-reduce buckets) fire while the device "still computes".
A module whose input is not floating point (token ids into an embedding) has no input gradient: its
backward window ends when the gradients of all its parameters are computed, and is padded there,
before they are accumulated (and before DDP's hooks see them).
Time is set per call: ``set_times`` lets a trainer change the target when the batch share changes.
"""

from __future__ import annotations

import time
from typing import Tuple

import torch
from torch import nn

from hetpipe.stage.pacer import Pacer


class _BackwardStart(torch.autograd.Function):
    """Identity on the module's output; its backward records when the output gradient arrived."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, box: "Emulated") -> torch.Tensor:
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.box._bwd_started = time.perf_counter()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on the module's input; its backward pads the backward window to the target.

    ``anchor`` (a leaf requiring grad) makes this node run in backward even when the input needs no
    gradient (the first layer).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, box: "Emulated") -> torch.Tensor:
        ctx.box = box
        ctx.x_needs_grad = x.requires_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        box = ctx.box
        box.pacer.pad(box._bwd_started, box.bwd_s)
        return (grad if ctx.x_needs_grad else None), None, None


class Emulated(nn.Module):
    """A module whose forward and backward take the emulated device's time (see module docstring)."""

    def __init__(self, module: nn.Module, fwd_s: float, bwd_s: float, pacer: Pacer) -> None:
        super().__init__()
        self.inner = module
        self.pacer = pacer
        self.set_times(fwd_s, bwd_s)
        self._anchor = torch.zeros((), requires_grad=True)   # not a Parameter: DDP never sees it
        self._bwd_started = 0.0
        self._param_hook = None      # integer inputs: the hook padding the backward (registered once)

    def set_times(self, fwd_s: float, bwd_s: float) -> None:
        if fwd_s < 0 or bwd_s < 0:
            raise ValueError(f"emulated times must be >= 0, got fwd {fwd_s}, bwd {bwd_s}")
        self.fwd_s, self.bwd_s = fwd_s, bwd_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        if torch.is_grad_enabled():
            if x.is_floating_point():
                x = _BackwardEnd.apply(x, self._anchor, self)
            elif self._param_hook is None:
                params = [p for p in self.inner.parameters() if p.requires_grad]
                if not params:
                    raise ValueError("Emulated: a module with integer inputs and no trainable parameters has no "
                                     "backward to pad")
                self._param_hook = torch.autograd.graph.register_multi_grad_hook(
                    params, lambda grads: self.pacer.pad(self._bwd_started, self.bwd_s), mode="all")
        y = self.inner(x)
        if torch.is_grad_enabled():
            y = _BackwardStart.apply(y, self)
        self.pacer.pad(t0, self.fwd_s)
        return y


def pacer_report(pacer: Pacer, wall_s: float) -> Tuple[float, float]:
    """(padding fraction of ``wall_s``, overrun seconds) of one rank's pacer over the measured window."""
    return (pacer.padded_s / wall_s if wall_s > 0 else 0.0, pacer.overrun_s)
