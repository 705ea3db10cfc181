"""One pipeline stage's model state (torch): live weights, per-minibatch weight stashes, the optimizer step.

The stage owns layers ``[start, stop)``. The parameters each layer owns (``model.layout``),
flattened layer by layer, form the stage's flat vector (:mod:`hetpipe.stage.flat`); the slice owned
by PS shard ``k`` is the concatenation of the layers shard ``k`` owns, in layer order — the byte
layout of every Push and Pull. The WSP state over that vector (wave deltas, push payloads, the merge
of pulls) is the stage's :class:`~hetpipe.ps.ledger.WaveLedger` (``ledger``), which ``step`` tells of
each update.

:class:`StageModel` composes the parts, one concern each:

* :mod:`hetpipe.stage.stash`: ``forward(p)`` stashes a copy of the live weights and differentiates
  it, so ``backward(p)`` uses the version ``forward(p)`` used; the versions of the live weights.
* :mod:`hetpipe.stage.recompute` and :mod:`hetpipe.stage.compute`: segments, the random state of each
  forward, recomputation, autocast, the backward.
* :mod:`hetpipe.stage.tied`: the tied parameters the stage holds with others of its VW; a parameter it
  holds for a layer outside it is a replica at the end of the flat vector, never pushed, its gradient
  summed with the other holders' before each Apply (``gather(..., peer_grads)``), pulled from its
  owner's shard.
* :mod:`hetpipe.stage.optim`: the optimizer and LR scheduler.

The step: ``apply(micros, w)`` takes one optimizer step on the live weights with the summed
gradients of one minibatch's micro-batches (one, or the two halves of a split minibatch) and adds
``after - before`` to the delta of its wave ``w`` (``ledger.record_step``); it raises once ``w`` was
pushed. It is ``gather`` (the gradients into ``.grad``) then ``step``; between them the executor may
read ``grad_sumsq`` and ``scale_grads`` (clipping by the VW's global norm) or ``skip_step`` (fp16).
``ledger.merge_pull({k: (g, W_g)})`` sets the shard-``k`` slice of the live weights to
``W_g + sum(delta_c for c >= g)`` (increasing c) and forgets the deltas every shard holds.

Buffers: persistent float32 buffers (BatchNorm running statistics) live in a second flat vector,
pushed and pulled with the weights (the ledger's ``push_payload``, ``merge_pull``); the forward updates them
once, a recomputed segment reruns on a copy of the buffers its forward saw.
Thread role: used by one thread (the rank's main thread, or the replay loop).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from torch import nn

from hetpipe.model.layout import ModelLayout
from hetpipe.plan.precision import HALF_DTYPE, check_precision
from hetpipe.ps.ledger import LedgerLayout, WaveLedger
from hetpipe.stage.compute import SegmentRunner
from hetpipe.stage.flat import FlatParams, TiedKey, check_float32
from hetpipe.stage.optim import OptimizerStep
from hetpipe.stage.recompute import Replays, StageRng, minibatch_seed, segments
from hetpipe.stage.stash import WeightStashes
from hetpipe.stage.tied import TiedParams

__all__ = ["StageModel", "TiedKey", "check_float32", "minibatch_seed", "segments"]


class StageModel:
    """Layers ``[start, stop)`` of the model with the bookkeeping the WSP executor needs."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, *, nm: int,
                 shard_layers: Dict[int, Sequence[int]], optimizer_factory: Callable,
                 device: torch.device, recompute: Sequence[int] = (), layout: Optional[ModelLayout] = None,
                 tied_stages: Optional[Dict[TiedKey, Sequence[int]]] = None, seed: int = 0, vw: int = 0,
                 stage: int = 0, precision: str = "fp32", micro_offset: int = 0,
                 lr_scheduler: Optional[Callable] = None, param_names: Optional[Dict[Tuple[int, str], str]] = None,
                 lr_stride: int = 1) -> None:
        self.start, self.stop, self.nm = start, stop, nm
        self.device = device
        self.precision = check_precision(precision, f"stage layers [{start}, {stop})")
        self.seed, self.vw, self.stage = seed, vw, stage
        outside = sorted(set(recompute) - set(range(start, stop)))
        if outside:
            raise ValueError(f"hetpipe: stage layers [{start}, {stop}) cannot recompute layers {outside}")
        self.recompute = tuple(sorted(set(recompute)))
        self.segments = segments(start, stop, self.recompute)
        layout = layout if layout is not None else ModelLayout(layers)
        # The stage owns private copies: nn.Module.to moves in place, so without them stages of
        # different VWs in one process (the replay) would share live weights, and the caller's
        # model would end up on the device. One deepcopy of all the stage's layers keeps the
        # parameters they share one object.
        self.layers: List[nn.Module] = [m.to(device) for m in copy.deepcopy(list(layers[start:stop]))]
        check_float32(self.layers, start)
        self.flat = FlatParams(self.layers, start, stop, layout, device, param_names)
        self.params, self.numel, self.replica_keys = self.flat.params, self.flat.numel, self.flat.replica_keys
        self.param_names = self.flat.names
        wire = getattr(torch, HALF_DTYPE[self.precision]) if self.precision in HALF_DTYPE else torch.float32
        self.tied = TiedParams(tied_stages, self.flat.by_key, stage, self.layers, device, wire)
        # The wave ledger (ps.ledger): deltas per wave, the push layout, the merge of pulls, over the
        # flat weights and buffers (updated in place: the parameters stay views of them).
        ledger_layout = LedgerLayout.of_layers(
            start, stop, {l: layout.numel(l) for l in range(start, stop)}, shard_layers,
            {l: layout.buffer_numel(l) for l in range(start, stop)}, self.flat.replica_sizes)
        self.ledger = WaveLedger(ledger_layout, self.flat.data, self.flat.buffers,
                                 who=f"stage layers [{start}, {stop})")
        self.stashes = WeightStashes(self.flat.data, self.params, self.flat.layer_params, self.ledger)
        self.optim = OptimizerStep(self.params, self.param_names, self.flat.layer_params, optimizer_factory,
                                   lr_scheduler, self.tied.counted(self.params), lr_stride)
        self.rng = StageRng(seed, vw, stage, micro_offset, device)
        self.runner = SegmentRunner(self.layers, start, stop, self.segments, self.precision, device,
                                    Replays(self.rng, self.layers))
        self.side_inputs = self.runner.side_inputs

    # --- the parts' state, by the names the executor, checkpoints and tests read ---------------
    @property
    def optimizer(self) -> Any:
        return self.optim.optimizer

    @property
    def scheduler(self) -> Any:
        return self.optim.scheduler

    @property
    def tied_keys(self) -> List[TiedKey]:
        return self.tied.keys

    @property
    def tied_stages(self) -> Dict[TiedKey, Tuple[int, ...]]:
        return self.tied.stages

    @property
    def stash(self) -> Dict[int, Any]:
        return self.stashes.stash

    @property
    def saved(self) -> Dict[int, List[List[Any]]]:
        return self.runner.saved

    @property
    def needs_side_inputs(self) -> bool:
        return any(self.side_inputs)

    # --- compute -----------------------------------------------------------------------------
    @property
    def recomputes_output(self) -> bool:
        """Whether the stage's output has no graph until ``Recompute`` (its last segment is recomputed)."""
        return self.segments[-1][0]

    def compute_context(self) -> ContextManager[Any]:
        return self.runner.compute_context()

    def forward(self, mb: int, x: Any, needs_input_grad: bool, side: Optional[Dict[str, Any]] = None) -> Any:
        """Forward of minibatch ``mb`` on a stash of the live weights; returns the output (attached
        unless ``recomputes_output``). ``side``: this minibatch's side inputs by name."""
        return self.runner.forward(mb, self.stashes.take(mb), x, needs_input_grad, side or {})

    def recompute_forward(self, mb: int) -> Any:
        """Rebuild the recomputed segments of minibatch ``mb``; returns the stage's (attached) output."""
        return self.runner.recompute(mb, self.stashes.stash[mb])

    def output_of(self, mb: int) -> Any:
        return self.runner.output_of(mb)

    def backward(self, mb: int, root: Any, grads: Optional[Sequence[torch.Tensor]]) -> Optional[List[torch.Tensor]]:
        """See :meth:`SegmentRunner.backward <hetpipe.stage.compute.SegmentRunner.backward>`."""
        return self.runner.backward(mb, root, grads)

    # --- tied parameters ----------------------------------------------------------------------
    def tied_grad(self, mb: int, keys: Sequence[TiedKey]) -> torch.Tensor:
        """The flat gradients of tied parameters ``keys`` from minibatch ``mb``'s backward, in the run's
        precision (``stage.tied``)."""
        return self.tied.grad(self.stashes.stash[mb], keys)

    def keys_shared_with(self, stage: int) -> List[TiedKey]:
        """The tied parameters this stage exchanges with ``stage`` of its VW (sorted)."""
        return self.tied.shared_with(stage)

    # --- the optimizer step -------------------------------------------------------------------
    def apply(self, micros: Sequence[int], wave: int,
              peer_grads: Optional[Dict[int, List[torch.Tensor]]] = None) -> None:
        """:meth:`gather` then :meth:`step`: one optimizer step with the summed gradients of ``micros``."""
        self.gather(micros, wave, peer_grads)
        self.step(wave)

    def gather(self, micros: Sequence[int], wave: int,
               peer_grads: Optional[Dict[int, List[torch.Tensor]]] = None, accumulate: bool = False) -> None:
        """Set each parameter's ``.grad`` to the summed stashed gradients of ``micros`` (the micro-batches
        of one minibatch, in order), for the :meth:`step` of ``wave`` that follows; with ``accumulate``,
        add them to the ``.grad`` earlier minibatches left (gradient accumulation). ``peer_grads[s]``:
        per micro-batch, the flat gradients of the tied parameters this stage shares with stage ``s``
        (:meth:`keys_shared_with`); each tied gradient becomes the sum, in stage order, of every
        holding stage's micro-batch sum, so every holder takes the same step."""
        self.ledger.check_open(wave, lambda: f"Apply of micro-batch(es) {list(micros)}")
        stashes, snapshots = self.stashes.pop(micros)
        # Tied gradients first, then every gradient; the graphs were freed by backward, and once the
        # gradients are summed nothing reads the snapshots, so they are recycled for the next forwards.
        tied = self.tied.summed(stashes, peer_grads)
        if self.optimizer is None:
            return
        self.optim.gather(stashes, tied, list(zip(self.tied.keys, self.tied.params)), accumulate)
        del stashes
        self.stashes.recycle(snapshots)

    def grad_sumsq(self, on_host: bool = True) -> Union[float, torch.Tensor]:
        """The sum of squares of the gathered gradients (float64), a tied parameter counted by the first
        stage holding it only, so that the stages' sums add up to the VW's. ``on_host``: as a float (a
        host-device synchronisation), else as a 0-d float64 tensor on the stage's device (none; 0.0 when
        there is no gradient)."""
        return self.optim.grad_sumsq(on_host)

    def scale_grads(self, coef: float) -> None:
        """Multiply every gathered gradient by ``coef`` (gradient clipping)."""
        self.optim.scale_grads(coef)

    def skip_step(self, wave: int) -> None:
        """A skipped step (fp16 overflow): the gathered gradients are dropped, the weights and the delta
        of ``wave`` stay as they are; the LR scheduler steps, as in PyTorch's loss-scaling recipe."""
        self.optim.skip()

    def step(self, wave: int) -> None:
        """One optimizer step with the gathered gradients, then the LR scheduler's step; accumulate the
        change into the delta of ``wave``."""
        if self.optimizer is None:
            return
        with torch.no_grad():
            before = self.stashes.before_step()
            self.optim.step()
            self.stashes.count_step()
            # delta(wave) += after - before (scratch: the subtraction's buffer off the CPU; ``before`` may
            # be the scratch itself, read element by element before it is overwritten).
            self.ledger.record_step(wave, self.flat.data, before, self.stashes.scratch)
        self.optim.scheduler_step()

    # --- results -----------------------------------------------------------------------------
    def layer_weights(self, layout: ModelLayout) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
        """Per layer of the stage: its owned weights and synced buffers (flat float32 copies)."""
        out = {}
        for l in range(self.start, self.stop):
            m = self.layers[l - self.start]
            w = [m.get_parameter(n) for n, _ in layout.owned[l]]
            b = [m.get_buffer(n) for n, _ in layout.buffers[l]]
            out[l] = tuple((torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.zeros(0))
                           .to("cpu").numpy().astype(np.float32, copy=True) for ts in (w, b))
        return out
