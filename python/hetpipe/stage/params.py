"""One pipeline stage's model state (torch): live weights, per-minibatch weight stashes, the optimizer step.

The stage owns layers ``[start, stop)``. The parameters each layer owns (``model.layout``),
flattened layer by layer, form the stage's flat vector; the slice owned by PS shard ``k`` is the
concatenation of the layers shard ``k`` owns, in layer order — the byte layout of every Push and Pull.
The WSP state over that vector (wave deltas, push payloads, the merge of pulls) is the stage's
:class:`~hetpipe.ps.ledger.WaveLedger` (``ledger``), which ``step`` tells of each update.

Weight versions (our WSP specification):
* ``forward(p)`` stashes a clone of the live weights and differentiates that clone, so ``backward(p)``
  uses the version ``forward(p)`` used, whatever was applied in between.
* The live weights change only in ``step`` and the ledger's ``merge_pull``, each of which counts a new version.
  ``step`` needs the weights before its update; when the newest stash was cloned at the current
  version (in steady state the forward just before each Apply), it is those weights, bit for bit,
  and no further copy is made.

Recomputation (per layer): the stage's layers form maximal runs ("segments") of consecutive layers
that are all kept or all recomputed. ``forward(p)`` keeps the graph of kept segments and only the
input of recomputed ones (run under ``no_grad``); ``recompute_forward(p)`` rebuilds the recomputed
segments from those inputs with the same stash, and ``backward(p)`` back-propagates segment by
segment, last to first. The same ops run on the same weights, so the numbers equal those of a run
without recomputation bitwise (on CPU).
* ``apply(micros, w)`` takes one optimizer step on the live weights with the summed gradients of one
  minibatch's micro-batches (one, or the two halves of a split minibatch) and adds ``after - before``
  to the delta of its wave ``w`` (``ledger.record_step``); it raises once ``w`` was pushed. It is
  ``gather`` (the gradients into ``.grad``) then ``step``; between them the executor may read
  ``grad_sumsq`` and ``scale_grads`` (clipping by the VW's global norm).
* ``ledger.merge_pull({k: (g, W_g)})`` sets the shard-``k`` slice of the live weights to
  ``W_g + sum(delta_c for c >= g)`` (increasing c) and forgets the deltas every shard holds.

Pytree values: a segment's input and output are any pytree of tensors (``model.tree``); its
floating leaves carry gradients. Side inputs (``hetpipe_side_inputs``) are keyword arguments of the
layers that declare them, given per minibatch to ``forward``.

Tied parameters (``model.layout``): a parameter the stage holds for a layer outside it is a
replica at the end of the flat vector, never pushed; its gradient is summed with the other holding
stages' before each Apply (``apply(..., peer_grads)``) and it is pulled from its owner's shard.

Buffers: persistent float32 buffers (BatchNorm running statistics) live in a second flat vector,
pushed and pulled with the weights (the ledger's ``push_payload``, ``merge_pull``); the forward updates them
once, a recomputed segment reruns on a copy of the buffers its forward saw.

Precision (docs/design.md, "Mixed precision"): with ``precision="bf16"`` every segment's forward (and
its recompute) runs under ``torch.autocast(device, bfloat16)`` on the float32 flat weights, which stay
the master copy the optimizer steps and the PS exchanges; the backward runs outside autocast, and a
gradient that arrives in a narrower dtype than the output leaf it belongs to is widened first (what
autograd does for the cast the wire stands for).

Random state: ``forward(mb)`` runs with the CPU (and device) generator seeded from ``seed``, the
stage and ``mb``; a recomputed segment reruns from the generator state its forward started from.
Thread role: used by one thread (the rank's main thread, or the replay loop).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torch import nn
from torch.utils import _pytree as pytree

from hetpipe.model.layout import ModelLayout
from hetpipe.model.names import NAMED_ATTR
from hetpipe.model.swap import SwapCall
from hetpipe.plan.precision import HALF_DTYPE, check_precision
from hetpipe.ps.ledger import LedgerLayout, WaveLedger

TiedKey = Tuple[int, str]          # (owner layer, the owner's parameter name)


def check_float32(layers: Sequence[nn.Module], first: int) -> None:
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.dtype != torch.float32:
                raise TypeError(f"hetpipe: layer {first + i} parameter {name!r} is {p.dtype}; "
                                "the parameter servers hold float32 weights")


def segments(start: int, stop: int, recompute: Sequence[int]) -> List[Tuple[bool, range]]:
    """Maximal runs of layers ``[start, stop)`` that are all recomputed or all kept, as
    ``(recomputed, local layer indices)``; e.g. layers 0..4 recomputing {1, 2} give
    ``[(False, range(0, 1)), (True, range(1, 3)), (False, range(3, 5))]``."""
    out: List[Tuple[bool, range]] = []
    a = start
    for i in range(start + 1, stop + 1):
        if i == stop or (i in recompute) != (a in recompute):
            out.append((a in recompute, range(a - start, i - start)))
            a = i
    return out


def minibatch_seed(seed: int, vw: int, stage: int, mb: int) -> int:
    """The seed of micro-batch ``mb`` of a VW's stage: distinct per (VW, stage, micro-batch)."""
    return int(np.random.SeedSequence([seed, vw, stage, mb]).generate_state(1, np.uint64)[0] >> 1)


def _float_leaves(tree: Any) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if t.is_floating_point()]


def _attach(tree: Any) -> Any:
    """``tree`` with its floating leaves detached and requiring grad (the segment's differentiable input)."""
    return pytree.tree_map(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, tree)


class _Flat:
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


class StageModel:
    """Layers ``[start, stop)`` of the model with the bookkeeping the WSP executor needs."""

    def __init__(self, layers: Sequence[nn.Module], start: int, stop: int, *, nm: int,
                 shard_layers: Dict[int, Sequence[int]], optimizer_factory: Callable,
                 device: torch.device, recompute: Sequence[int] = (), layout: Optional[ModelLayout] = None,
                 tied_stages: Optional[Dict[TiedKey, Sequence[int]]] = None, seed: int = 0, vw: int = 0,
                 stage: int = 0, precision: str = "fp32", micro_offset: int = 0,
                 lr_scheduler: Optional[Callable] = None, param_names: Optional[Dict[Tuple[int, str], str]] = None
                 ) -> None:
        self.start, self.stop, self.nm = start, stop, nm
        self.device = device
        self.precision = check_precision(precision, f"stage layers [{start}, {stop})")
        self.seed, self.vw, self.stage = seed, vw, stage
        # Micro-batches of this VW run before micro-batch 0 of this stream (a resumed run): seeds go on.
        self.micro_offset = micro_offset
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
        self.side_inputs: List[Tuple[str, ...]] = [tuple(getattr(m, "hetpipe_side_inputs", ())) for m in self.layers]
        # Each layer runs on a minibatch's stash, not on its live parameters (model.swap).
        self._calls = [SwapCall(m) for m in self.layers]
        # Flat order: each layer's owned parameters (its PS vector), layer by layer, then the replicas of
        # parameters owned outside the stage (never pushed), by (owner, offset).
        owned = [self.layers[l - start].get_parameter(n) for l in range(start, stop) for n, _ in layout.owned[l]]
        replicas = {(r.owner, r.owner_name): (r.offset, r.numel, self.layers[r.layer - start].get_parameter(r.name))
                    for r in layout.stage_replicas(start, stop)}
        self.replica_keys = list(replicas)
        self.params: List[nn.Parameter] = owned + [replicas[k][2] for k in self.replica_keys]
        flat = _Flat(self.params, device)
        self._flat, self.numel = flat.data, flat.numel
        # Per layer, each parameter name with the index of its parameter in ``params`` (a parameter two
        # layers share has one index): how forward builds a stash and gather reads it, per minibatch,
        # without walking the modules again.
        index = {id(p): i for i, p in enumerate(self.params)}
        self._layer_params = [[(n, index[id(p)]) for n, p in layer.named_parameters()] for layer in self.layers]
        # Tied parameters held by other stages of this VW too: their gradients are exchanged.
        by_key = {**{(l, n): self.layers[l - start].get_parameter(n)
                     for l in range(start, stop) for n, _ in layout.owned[l]},
                  **{k: v[2] for k, v in replicas.items()}}
        self.tied_stages = {k: tuple(sorted(s)) for k, s in (tied_stages or {}).items() if k in by_key and len(s) > 1}
        self.tied_keys = sorted(self.tied_stages)
        self._tied_params = [by_key[k] for k in self.tied_keys]
        # Synchronised buffers, flat like the weights; other buffers stay in their modules.
        bufs = [self.layers[l - start].get_buffer(n) for l in range(start, stop) for n, _ in layout.buffers[l]]
        self._bflat = _Flat(bufs, device).data
        # Buffers of the stage's flat size, reused rather than allocated per minibatch or wave (a
        # fresh allocation this large is fresh pages, and faulting them in costs as much as a copy).
        self._scratch = torch.empty_like(self._flat)                    # apply's "before", then change
        self._spare_snapshots: List[torch.Tensor] = []                  # of minibatches already applied
        self._snapshots: Dict[int, torch.Tensor] = {}                   # mb -> the storage of its stash
        # Versions of the live weights (see "Weight versions"): optimizer steps plus the ledger's merges,
        # and the newest snapshot with the version it copied.
        self._steps = 0
        self._latest: Optional[Tuple[int, torch.Tensor]] = None
        # The wave ledger (ps.ledger): deltas per wave, the push layout, the merge of pulls, over the
        # flat weights and buffers (updated in place: the parameters stay views of them).
        ledger_layout = LedgerLayout.of_layers(
            start, stop, {l: layout.numel(l) for l in range(start, stop)}, shard_layers,
            {l: layout.buffer_numel(l) for l in range(start, stop)},
            [(k[0], replicas[k][1]) for k in self.replica_keys])
        self.ledger = WaveLedger(ledger_layout, self._flat, self._bflat, who=f"stage layers [{start}, {stop})")
        # The model's name of each flat parameter (a replica by its owner's), for named parameter groups.
        names = param_names or {}
        self.param_names = [names.get((l, n), f"{l}.{n}") for l in range(start, stop) for n, _ in layout.owned[l]] + \
            [names.get(k, f"{k[0]}.{k[1]}") for k in self.replica_keys]
        if self.params and getattr(optimizer_factory, NAMED_ATTR, False):
            self.optimizer = optimizer_factory(list(zip(self.param_names, self.params)))
        else:
            self.optimizer = optimizer_factory(self.params) if self.params else None
        # Stepped after each optimizer step (one per minibatch): the same schedule on every stage of every VW.
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None and self.optimizer is not None \
            else None
        # The parameters whose gradients this stage's share of the VW's gradient norm counts.
        first_holder = {id(p): self.tied_stages[k][0] == stage for k, p in zip(self.tied_keys, self._tied_params)}
        self._counted = [p for p in self.params if first_holder.get(id(p), True)]
        self.stash: Dict[int, List[Dict[str, torch.Tensor]]] = {}
        # mb -> per segment [input, output]; output None while a recomputed segment awaits Recompute(mb)
        self.saved: Dict[int, List[List[Any]]] = {}
        # mb -> per recomputed segment: the generator state and buffers its forward started from
        self._replay: Dict[int, Dict[int, Tuple[Any, List[Dict[str, torch.Tensor]]]]] = {}
        self._side: Dict[int, Dict[str, Any]] = {}

    @property
    def _version(self) -> int:
        """The live weights' version: each optimizer step and each pull that changed them makes one."""
        return self._steps + self.ledger.merges

    @property
    def needs_side_inputs(self) -> bool:
        return any(self.side_inputs)

    # --- compute -----------------------------------------------------------------------------
    @property
    def recomputes_output(self) -> bool:
        """Whether the stage's output has no graph until ``Recompute`` (its last segment is recomputed)."""
        return self.segments[-1][0]

    def compute_context(self) -> ContextManager[Any]:
        """Where forwards and the loss run: autocast to bfloat16 under "bf16"; under "fp32" no context
        at all, so the float32 path is exactly what it was."""
        if self.precision in HALF_DTYPE:
            return torch.autocast(self.device.type, dtype=getattr(torch, HALF_DTYPE[self.precision]))
        return contextlib.nullcontext()

    def _run(self, stash: List[Dict[str, torch.Tensor]], x: Any, layers: range, side: Dict[str, Any],
             buffers: Optional[List[Dict[str, torch.Tensor]]] = None) -> Any:
        with self.compute_context():
            return self._run_layers(stash, x, layers, side, buffers)

    def _run_layers(self, stash: List[Dict[str, torch.Tensor]], x: Any, layers: range, side: Dict[str, Any],
                    buffers: Optional[List[Dict[str, torch.Tensor]]]) -> Any:
        for n, i in enumerate(layers):
            kwargs = {k: side[k] for k in self.side_inputs[i]}
            tensors = stash[i] if buffers is None else {**stash[i], **buffers[n]}
            try:
                x = self._calls[i](tensors, (x,), kwargs)
            except Exception as e:
                e.add_note(f"hetpipe: raised by layer {self.start + i} ({type(self.layers[i]).__name__})")
                raise
        return x

    def _rng_state(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _forked_rng(self):
        """The caller's generators are restored afterwards: the stage's seeding never leaks out."""
        return torch.random.fork_rng(devices=[self._cuda_index()] if self.device.type == "cuda" else [])

    def _cuda_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _seed_rng(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self._cuda_index()].manual_seed(seed)

    def forward(self, mb: int, x: Any, needs_input_grad: bool, side: Optional[Dict[str, Any]] = None) -> Any:
        """Forward of minibatch ``mb`` on a stash of the live weights; returns the output (attached
        unless ``recomputes_output``). ``side``: this minibatch's side inputs by name."""
        side = side or {}
        # One copy of the live weights; the stash's parameters are views into it (one per parameter
        # object, so a parameter two of the stage's layers share stays one tensor).
        snapshot = self._spare_snapshots.pop() if self._spare_snapshots else torch.empty_like(self._flat)
        snapshot.copy_(self._flat)
        self._snapshots[mb] = snapshot
        self._latest = (self._version, snapshot)
        views: List[torch.Tensor] = []
        off = 0
        for p in self.params:
            views.append(snapshot[off:off + p.numel()].view_as(p).requires_grad_(True))
            off += p.numel()
        stash = [{n: views[i] for n, i in names} for names in self._layer_params]
        self.stash[mb] = stash
        saved: List[List[Any]] = []
        replay: Dict[int, Tuple[Any, List[Dict[str, torch.Tensor]]]] = {}
        with self._forked_rng():
            self._seed_rng(minibatch_seed(self.seed, self.vw, self.stage, mb + self.micro_offset))
            for k, (recomputed, layers) in enumerate(self.segments):
                if k > 0 or needs_input_grad:
                    x = _attach(x)
                if recomputed:
                    # What the recompute needs to rerun this forward exactly: the generator state and
                    # the buffers as they are now (the forward below updates the live ones, once).
                    replay[k] = (self._rng_state(), [{n: b.clone() for n, b in self.layers[i].named_buffers()}
                                                     for i in layers])
                    with torch.no_grad():
                        out = self._run(stash, x, layers, side)
                    saved.append([x, None])
                else:
                    out = self._run(stash, x, layers, side)
                    saved.append([x, out])
                x = out
        self.saved[mb] = saved
        if replay:
            self._replay[mb] = replay
            self._side[mb] = side
        return x

    def recompute_forward(self, mb: int) -> Any:
        """Rebuild the recomputed segments of minibatch ``mb`` from their saved inputs, the same stash,
        generator state and buffers; returns the stage's (attached) output."""
        saved, stash = self.saved[mb], self.stash[mb]
        replay, side = self._replay.pop(mb, {}), self._side.pop(mb, {})
        for k, ((recomputed, layers), seg) in enumerate(zip(self.segments, saved)):
            if recomputed:
                (cpu, cuda), buffers = replay[k]
                with self._forked_rng():
                    torch.set_rng_state(cpu)
                    if cuda is not None:
                        torch.cuda.set_rng_state(cuda, self.device)
                    seg[1] = self._run(stash, seg[0], layers, side, buffers)
        return saved[-1][1]

    def output_of(self, mb: int) -> Any:
        out = self.saved[mb][-1][1]
        if out is None:
            raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for minibatch "
                               f"{mb}: Recompute({mb}) must precede Bwd({mb})")
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
                    raise RuntimeError(f"hetpipe: stage layers [{self.start}, {self.stop}) has no graph for "
                                       f"minibatch {mb}: Recompute({mb}) must precede Bwd({mb})")
                grads = [t.grad for t in _float_leaves(saved[k + 1][0])]
            if grads is None:
                if root.requires_grad:
                    root.backward()
                continue
            # A bfloat16 wire gradient of a float32 output is widened, as autograd widens the gradient
            # of a cast (exact); under "fp32" the dtypes already agree.
            pairs = [(t, g.to(t.dtype)) for t, g in zip(_float_leaves(root), grads)
                     if t.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        leaves = _float_leaves(saved[0][0])
        if not any(t.requires_grad for t in leaves):
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]

    # --- tied parameters ----------------------------------------------------------------------
    def tied_grad(self, mb: int, keys: Sequence[TiedKey]) -> torch.Tensor:
        """The flat float32 gradients of tied parameters ``keys`` from minibatch ``mb``'s backward."""
        stash = self.stash[mb]
        by_key = dict(zip(self.tied_keys, self._tied_params))
        parts = []
        for key in keys:
            v = self._view_of(stash, by_key[key])
            parts.append((v.grad if v.grad is not None else torch.zeros_like(v)).reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device)

    def _view_of(self, stash: List[Dict[str, torch.Tensor]], p: nn.Parameter) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            for n, q in layer.named_parameters():
                if q is p:
                    return stash[i][n]
        raise KeyError("hetpipe: a tied parameter is missing from the stage")

    def keys_shared_with(self, stage: int) -> List[TiedKey]:
        """The tied parameters this stage exchanges with ``stage`` of its VW (sorted)."""
        return [k for k in self.tied_keys if stage in self.tied_stages[k]]

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
        # Tied gradients first, while the stashes hold them.
        tied: Dict[TiedKey, torch.Tensor] = {}
        if self.tied_keys:
            per_stage: Dict[int, Dict[TiedKey, torch.Tensor]] = {}
            own = [self.tied_grad(mb, self.tied_keys) for mb in micros]
            per_stage[self.stage] = self._split(self.tied_keys, sum(own[1:], own[0]))
            for s, flats in (peer_grads or {}).items():
                per_stage[s] = self._split(self.keys_shared_with(s), sum(flats[1:], flats[0]))
            for key in self.tied_keys:
                parts = [per_stage[s][key] for s in self.tied_stages[key]]
                tied[key] = sum(parts[1:], parts[0])
        stashes = [self.stash.pop(mb) for mb in micros]
        # Their graphs were freed by backward; once the gradients below are summed, nothing reads
        # the snapshots, so they are recycled for the next forwards.
        snapshots = [self._snapshots.pop(mb) for mb in micros]
        if self.optimizer is None:
            return
        for i, names in enumerate(self._layer_params):
            for name, k in names:
                p = self.params[k]
                grads = [s[i][name].grad for s in stashes if s[i][name].grad is not None]
                g = sum(grads[1:], grads[0]) if grads else None
                if not (accumulate and p.grad is not None):
                    p.grad = g
                elif g is not None:
                    p.grad = p.grad + g
        for key, p in zip(self.tied_keys, self._tied_params):
            g = tied[key].view_as(p)
            p.grad = p.grad + g if accumulate and p.grad is not None else g
        del stashes
        self._spare_snapshots.extend(snapshots)

    def grad_sumsq(self) -> float:
        """The sum of squares of the gathered gradients (float64), a tied parameter counted by the first
        stage holding it only, so that the stages' sums add up to the VW's. Synchronises with the device."""
        if self.optimizer is None:
            return 0.0
        grads = [p.grad for p in self._counted if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.stack(torch._foreach_norm(grads)).double().pow(2).sum())

    def scale_grads(self, coef: float) -> None:
        """Multiply every gathered gradient by ``coef`` (gradient clipping)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)

    def skip_step(self, wave: int) -> None:
        """A skipped step (fp16 overflow): the gathered gradients are dropped, the weights and the delta
        of ``wave`` stay as they are; the LR scheduler steps, as in PyTorch's loss-scaling recipe."""
        if self.optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def step(self, wave: int) -> None:
        """One optimizer step with the gathered gradients, then the LR scheduler's step; accumulate the
        change into the delta of ``wave``."""
        if self.optimizer is None:
            return
        with torch.no_grad():
            before = self._before_step()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._steps += 1
            # delta(wave) += after - before (scratch: the subtraction's buffer off the CPU; ``before`` may
            # be the scratch itself, read element by element before it is overwritten).
            self.ledger.record_step(wave, self._flat, before, self._scratch)
        if self.scheduler is not None:
            self.scheduler.step()

    def _before_step(self) -> torch.Tensor:
        """The live weights as they are now: the newest snapshot if it copied this version (a snapshot is
        only ever written by ``forward``'s copy, so its bits are still those weights), else a copy."""
        if self._latest is not None and self._latest[0] == self._version:
            return self._latest[1]
        self._scratch.copy_(self._flat)
        return self._scratch

    def _split(self, keys: Sequence[TiedKey], flat: torch.Tensor) -> Dict[TiedKey, torch.Tensor]:
        by_key = dict(zip(self.tied_keys, self._tied_params))
        out, off = {}, 0
        for key in keys:
            n = by_key[key].numel()
            out[key] = flat[off:off + n]
            off += n
        return out

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
