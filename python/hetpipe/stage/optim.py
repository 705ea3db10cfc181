"""A stage's optimizer step: its optimizer and LR scheduler over the flat parameters, the gathering
of a minibatch's gradients, and the hooks the executor runs between gathering and stepping (the
VW's gradient norm for clipping, a skipped step for fp16's loss scaling).

The LR scheduler steps after each optimizer step (one per minibatch, or per accumulated group) and
after a skipped one, as in PyTorch's loss-scaling recipe: the same schedule on every stage of every VW.
It steps ``lr_stride`` times each time: with the run's count (``numerics.lr_scheduler_steps="run"``),
once for each VW's step taken meanwhile, so a schedule sized for one process spans the run.
Thread role: the stage's one thread.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from hetpipe.model.names import NAMED_ATTR
from hetpipe.util.errors import HetpipeError
from hetpipe.stage.flat import TiedKey
from hetpipe.stage.stash import Stash


class SchedulerError(HetpipeError, ValueError):
    """An LR scheduler the run cannot drive."""


# Schedulers whose step() needs a metric: a stage steps its scheduler by optimizer steps and has no
# metric to give (evaluation happens on VW 0's last stage only), so they are refused when built.
METRIC_SCHEDULERS = (torch.optim.lr_scheduler.ReduceLROnPlateau,)


class OptimizerStep:
    """The optimizer of ``params`` (named ``names`` for an optimizer factory that takes names; None
    when the stage has no parameter) and its LR scheduler. ``counted``: the parameters whose gradients
    this stage's share of the VW's gradient norm counts."""

    def __init__(self, params: List[nn.Parameter], names: List[str], layer_params: List[List[Tuple[str, int]]],
                 optimizer_factory: Callable, lr_scheduler: Optional[Callable], counted: List[nn.Parameter],
                 lr_stride: int = 1) -> None:
        self.params, self._layer_params, self._counted = params, layer_params, counted
        self.lr_stride = lr_stride
        if params and getattr(optimizer_factory, NAMED_ATTR, False):
            self.optimizer = optimizer_factory(list(zip(names, params)))
        else:
            self.optimizer = optimizer_factory(params) if params else None
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None and self.optimizer is not None \
            else None
        if isinstance(self.scheduler, METRIC_SCHEDULERS):
            raise SchedulerError(f"lr_scheduler: {type(self.scheduler).__name__} steps on a metric, which a stage "
                                 f"does not have (it steps its scheduler once per optimizer step); use a "
                                 f"step-based schedule, with hetpipe.EarlyStopping for a plateau")

    def gather(self, stashes: Sequence[Stash], tied: Dict[TiedKey, torch.Tensor],
               tied_params: Sequence[Tuple[TiedKey, nn.Parameter]], accumulate: bool) -> None:
        """Set each parameter's ``.grad`` to the summed gradients of ``stashes`` (the micro-batches of
        one minibatch, in order) and each tied parameter's to its sum over the holding stages (``tied``);
        with ``accumulate``, add them to the ``.grad`` earlier minibatches left."""
        for i, names in enumerate(self._layer_params):
            for name, k in names:
                p = self.params[k]
                grads = [s[i][name].grad for s in stashes if s[i][name].grad is not None]
                g = sum(grads[1:], grads[0]) if grads else None
                if not (accumulate and p.grad is not None):
                    p.grad = g
                elif g is not None:
                    p.grad = p.grad + g
        for key, p in tied_params:
            g = tied[key].view_as(p)
            p.grad = p.grad + g if accumulate and p.grad is not None else g

    def grad_sumsq(self, on_host: bool = True) -> Union[float, torch.Tensor]:
        """The sum of squares of the gathered gradients of the counted parameters (float64): a float
        (``on_host``: synchronises with the device), else a 0-d tensor on their device (0.0 without any)."""
        grads = [p.grad for p in self._counted if p.grad is not None] if self.optimizer is not None else []
        if not grads:
            return 0.0
        sumsq = torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
        return float(sumsq) if on_host else sumsq

    def scale_grads(self, coef: float) -> None:
        """Multiply every gathered gradient by ``coef`` (clipping, accumulation's mean, fp16's unscaling)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)

    def skip(self) -> None:
        """A skipped step (fp16 overflow): the gathered gradients are dropped; the LR scheduler steps."""
        if self.optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler_step()

    def step(self) -> None:
        """One optimizer step with the gathered gradients, which it then drops (call under no_grad);
        :meth:`scheduler_step` follows once the step's change is recorded."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def scheduler_step(self) -> None:
        if self.scheduler is not None:
            for _ in range(self.lr_stride):
                self.scheduler.step()
