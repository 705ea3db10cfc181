"""The last stage's loss: labels, the halves of a split minibatch, the losses and learning rates it
records, and the tensor each backward starts from.

A half's (mean) loss is weighted by its share of the minibatch's samples, so that the halves'
gradients sum to the whole minibatch's, and a split minibatch's recorded loss is the sum of its
halves'. The loss is computed where the forward was (under autocast with "bf16"), as in a
single-process autocast loop; under "fp16" the backward starts from the loss times the VW's scale.

The losses stay on the device and are read at the wave boundary (:mod:`hetpipe.stage.readings`),
one host-device synchronisation per wave: ``losses`` holds a minibatch's loss from the end of its
wave on. A non-finite loss then stops the run, before the wave's update leaves the stage (its Push),
unless fp16's loss scaling is on: its verdict of each step needs the loss on the host at once, so
under "fp16" each loss is read at its forward, and a non-finite one skips the step instead.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch

from hetpipe.model.tree import to_device
from hetpipe.stage.loss_scale import LossScaleVerdict
from hetpipe.stage.params import StageModel
from hetpipe.stage.readings import WaveReadings
from hetpipe.stage.settings import StageContext, StageIO
from hetpipe.transport.protocol import StageError


class LossHead:
    """The losses of the stage's minibatches (``minibatch_of`` maps its micro-batches to them), read
    through ``readings`` at the stage's wave boundaries."""

    def __init__(self, ctx: StageContext, model: StageModel, io: StageIO, verdicts: Optional[LossScaleVerdict],
                 minibatch_of: Callable[[int], int], readings: WaveReadings) -> None:
        self.ctx, self.model, self.io, self.verdicts, self.minibatch_of = ctx, model, io, verdicts, minibatch_of
        self.readings = readings
        self.losses: Dict[int, float] = {}          # minibatch -> loss (set once all its halves were read)
        self.lrs: Dict[int, float] = {}             # minibatch -> its step's learning rate
        self._partial: Dict[int, float] = {}        # split minibatch -> weighted loss of its first half
        self._shares: Dict[int, float] = {}         # micro-batch -> its share of its minibatch
        self._labels: Dict[int, Any] = {}
        self._tensors: Dict[int, torch.Tensor] = {}     # micro-batch -> the loss its backward starts from

    def forward(self, mb: int, out: Any) -> None:
        """Micro-batch ``mb``'s forward produced ``out``: its loss, recorded (and kept for the backward
        unless the output is rebuilt by a recompute first)."""
        p = self.minibatch_of(mb)
        self._labels[mb] = to_device(self.io.labels.get(mb), self.model.device)
        self._shares[mb] = self.io.labels.share(mb)
        loss = self._loss(mb, out)
        if not self.model.recomputes_output:
            self._tensors[mb] = loss
        self._record(mb, p, loss)

    def recomputed(self, mb: int, out: Any) -> None:
        """``Recompute(mb)`` rebuilt the output: the loss to back-propagate, if the forward kept none."""
        if mb not in self._tensors:
            self._tensors[mb] = self._loss(mb, out)

    def root(self, mb: int) -> torch.Tensor:
        """The tensor ``Bwd(mb)`` back-propagates (the loss, times the loss scale under fp16)."""
        if mb not in self._tensors:
            raise StageError(f"hetpipe: {self.ctx.who()}: Recompute({mb}) must precede Bwd({mb})")
        root = self._tensors.pop(mb)
        if self.verdicts is not None:
            root = root * self.verdicts.scaled(self.minibatch_of(mb))
        self._labels.pop(mb, None)
        self._shares.pop(mb, None)
        return root

    def _loss(self, mb: int, out: Any) -> torch.Tensor:
        with self.model.compute_context():
            loss = self.io.loss_fn(out, self._labels[mb])
        share = self._shares[mb]
        return loss if share == 1.0 else loss * share

    def _record(self, mb: int, p: int, loss: torch.Tensor) -> None:
        opt = self.model.optimizer
        if opt is not None and opt.param_groups:
            # The rate minibatch p's step takes (the scheduler stepped after the previous Apply).
            self.lrs[p] = float(opt.param_groups[0]["lr"])
        whole = self._shares[mb] == 1.0
        if self.verdicts is not None:
            self._value(p, whole, float(loss.detach()))
        else:
            self.readings.add(loss, lambda value: self._value(p, whole, value))

    def _value(self, p: int, whole: bool, value: float) -> None:
        """Minibatch ``p``'s loss (``whole``) or a half of it has been read: ``value``."""
        if not math.isfinite(value) and self.verdicts is None:
            raise StageError(f"hetpipe: {self.ctx.who()}: the loss of VW {self.ctx.vw}'s minibatch {p} (wave "
                             f"{p // self.model.nm}) is {value}; stopping at the end of the wave, before its "
                             "update leaves the stage")
        if whole:
            self.losses[p] = value
        elif p in self._partial:
            self.losses[p] = self._partial.pop(p) + value
        else:
            self._partial[p] = value
