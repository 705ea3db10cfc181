"""Measuring a layer list on this host: forward/backward time, activation, parameter and workspace bytes per layer, into a profile (the planner's input)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hetpipe.plan.precision import HALF_DTYPE
from hetpipe.plan.profile import LayerProfile, ModelProfile, layer_names


def profile_model(model: Any, sample_input: Any, cluster: Any, loss_fn: Optional[Callable] = None,
                  reference_type: Optional[str] = None, repeats: int = 5, optimizer_factor: float = 1.0,
                  name: str = "model", precision: str = "fp32") -> ModelProfile:
    """Measure each layer of ``model`` (an ``nn.Sequential`` or a list of modules) on this host and
    derive its times on every device type of ``cluster`` (see the module docstring).

    ``sample_input`` is one minibatch; ``loss_fn(output) -> scalar`` drives the last layer's
    backward (default: the sum of the output). ``optimizer_bytes = optimizer_factor x param_bytes``
    (1.0: SGD with momentum; 2.0: Adam). Layers may pass any pytree of tensors (every leaf counts
    towards ``activation_bytes``) and take side inputs from a dict ``sample_input``; a parameter
    shared by several layers counts once, on the first. Layers are named by :func:`layer_names`.

    The layers run where their parameters are. On a CUDA device the times are synchronised and
    ``workspace_bytes`` is measured: the allocator's peak while the layer's forward and backward (and
    the loss, for the last layer) run, above what it held before plus the layer's output and stash
    (transients such as a language-model head's logits and their gradient); elsewhere it is 0.
    ``precision="bf16"`` runs each forward and the loss under ``torch.autocast`` to bfloat16, as a
    bf16 run does (:mod:`hetpipe.plan.precision`), so the stash holds what such a run keeps.
    """
    from hetpipe.plan.precision import check_precision

    check_precision(precision, "profile_model")

    from hetpipe.plan.cluster import load_cluster

    cluster = load_cluster(cluster)
    if repeats < 1:
        raise ValueError(f"profile_model: repeats must be >= 1, got {repeats}")
    if cluster.emulated:
        ref_speed = 1.0
    elif reference_type is None:
        raise ValueError(f"profile_model: cluster {cluster.name!r} is not emulated; give reference_type, "
                         f"the device type this host's device is (one of {sorted(cluster.device_types)})")
    elif reference_type not in cluster.device_types:
        raise ValueError(f"profile_model: unknown device type {reference_type!r} "
                         f"(cluster types: {sorted(cluster.device_types)})")
    else:
        ref_speed = cluster.device_types[reference_type].speed_for(precision)
    measured = measure_layers(model, sample_input, loss_fn=loss_fn, repeats=repeats, precision=precision)
    speed = {t: dt.speed_for(precision) for t, dt in cluster.device_types.items()}
    out = []
    for m in measured.layers:
        f = {t: m.fwd_s * ref_speed / speed[t] for t in cluster.device_types}
        b = {t: m.bwd_s * ref_speed / speed[t] for t in cluster.device_types}
        derived = {t: cluster.emulated or t != reference_type for t in cluster.device_types}
        out.append(m.profile(f, b, derived, optimizer_factor))
    src = "measured on this host, " + ("emulated types derived by speed" if cluster.emulated
                                       else f"as {reference_type}, other types derived by speed")
    return ModelProfile(name=name, minibatch_size=measured.minibatch_size, layers=tuple(out),
                        input_bytes=measured.input_bytes, source=src)


@dataclass(frozen=True)
class LayerMeasure:
    """One layer measured on one device: median forward and backward seconds per minibatch, and bytes."""

    name: str
    fwd_s: float
    bwd_s: float
    activation_bytes: int
    stash_bytes: int
    param_bytes: int
    workspace_bytes: int
    tied: Tuple[Tuple[int, str, int], ...]
    host_s: float = 0.0     # forward + backward on the bare host, when the device was emulated

    def profile(self, fwd: Dict[str, float], bwd: Dict[str, float], derived: Dict[str, bool],
                optimizer_factor: float) -> LayerProfile:
        """This layer's profile entry, with times per device type."""
        return LayerProfile(name=self.name, fwd_time=fwd, bwd_time=bwd, activation_bytes=self.activation_bytes,
                            param_bytes=self.param_bytes, optimizer_bytes=int(optimizer_factor * self.param_bytes),
                            workspace_bytes=self.workspace_bytes, derived=derived, stash_bytes=self.stash_bytes,
                            tied=self.tied)


@dataclass(frozen=True)
class ModelMeasure:
    """Every layer of a model measured on one device, and the device's peak allocated bytes (CUDA; 0 elsewhere)."""

    layers: Tuple[LayerMeasure, ...]
    minibatch_size: int
    input_bytes: int
    peak_bytes: int = 0


def measure_layers(model: Any, sample_input: Any, loss_fn: Optional[Callable] = None, repeats: int = 5,
                   precision: str = "fp32", speed: Optional[float] = None, device: Any = None) -> ModelMeasure:
    """Measure each layer of ``model`` where its parameters are (see :func:`profile_model`), on one
    thread, leaving the model's buffers and the random state as they were. ``speed``: the device
    is emulated at ``speed`` times this host's speed: the layers are measured on the host, then
    measured again under a pacer padding each section to its host time / ``speed``, as an emulated
    stage is padded in training (:mod:`hetpipe.stage.pacer`); the padded times are returned. (A
    proportional stretch would multiply the cold-cache slowdown after each sleep by 1 / speed.)
    ``device``: measure on this device instead, moving one layer there at a time (the model and
    ``sample_input`` stay on the CPU); the loss function must accept outputs on that device."""
    import torch
    from torch.utils import _pytree as pytree

    from hetpipe.model.layout import ModelLayout
    from hetpipe.model.tree import batch_of, flatten

    if repeats < 1:
        raise ValueError(f"measure_layers: repeats must be >= 1, got {repeats}")
    names = layer_names(model)
    layers = list(model)
    if not layers:
        raise ValueError("profile_model: the model has no layers")

    def nbytes(t: Any) -> int:
        return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(t) if isinstance(x, torch.Tensor))

    def detach(t: Any) -> Any:
        return pytree.tree_map(lambda d: d.detach().requires_grad_(d.is_floating_point()), t)

    def side_of(layer: Any) -> Dict[str, Any]:
        keys = getattr(layer, "hetpipe_side_inputs", ())
        return {k: sample_input[k] for k in keys} if keys else {}

    # The layers run for real below: their buffers (BatchNorm statistics) and the random state are
    # restored afterwards, so profiling leaves the model as it found it.
    saved_buffers = [b.detach().clone() for layer in layers for b in layer.buffers()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    def median(v: Sequence[float]) -> float:
        s = sorted(v)
        return s[len(s) // 2]

    peak = [0]
    stage = None if device is None else torch.device(device)
    if stage is not None and stage.type == "cpu":
        stage = None
    if stage is not None:
        sample_input = pytree.tree_map(lambda t: t.to(stage) if isinstance(t, torch.Tensor) else t, sample_input)
    try:
        with torch.random.fork_rng(devices=[]):
            fwd_s, bwd_s, out_bytes, stash_bytes, work_bytes = _measure(layers, sample_input, loss_fn, repeats,
                                                                        nbytes, detach, side_of, flatten, precision,
                                                                        None, stage, peak)
            host_s = [median(f) + median(b) for f, b in zip(fwd_s, bwd_s)]
            if speed is not None:
                targets = [(median(f) / speed, median(b) / speed) for f, b in zip(fwd_s, bwd_s)]
                fwd_s, bwd_s = _measure(layers, sample_input, loss_fn, repeats, nbytes, detach, side_of, flatten,
                                        precision, targets, stage, peak)[:2]
    finally:
        torch.set_num_threads(threads)
        with torch.no_grad():
            for b, v in zip((b for layer in layers for b in layer.buffers()), saved_buffers):
                b.copy_(v)

    layout = ModelLayout(layers)
    owned = [dict(layout.owned[l]) for l in range(len(layers))]

    def tied_of(i: int) -> Tuple[Tuple[int, str, int], ...]:
        return tuple((r.owner, r.owner_name, r.numel * owned[r.owner][r.owner_name].element_size())
                     for r in layout.replicas[i])
    out = [LayerMeasure(name=names[i] if names else f"{i}:{type(layer).__name__}", fwd_s=median(fwd_s[i]),
                        bwd_s=median(bwd_s[i]), activation_bytes=out_bytes[i], stash_bytes=stash_bytes[i],
                        param_bytes=sum(p.numel() * p.element_size() for _, p in layout.owned[i]),
                        workspace_bytes=work_bytes[i], tied=tied_of(i),
                        host_s=host_s[i] if speed is not None else 0.0)
           for i, layer in enumerate(layers)]
    return ModelMeasure(tuple(out), batch_of(sample_input), nbytes(sample_input), int(peak[0]))


def _measure(layers: List[Any], sample_input: Any, loss_fn: Optional[Callable], repeats: int, nbytes: Callable,
             detach: Callable, side_of: Callable, flatten: Callable, precision: str = "fp32",
             targets: Optional[List[Tuple[float, float]]] = None, stage: Any = None,
             peak: Optional[List[int]] = None):
    """Per layer: forward and backward times of each repeat, output bytes (every leaf of a pytree
    output), bytes saved for backward, and (on CUDA) transient bytes above those. A layer that
    raises is named in the error. ``targets``: per layer, the forward and backward seconds a pacer
    pads each section to (an emulated device); the times measured are then the padded ones.
    ``stage``: a device each layer is moved to for its own measurement only (and back to the CPU
    after), so a device too small for the whole model still measures every layer. ``peak[0]`` is
    raised to the largest allocated bytes seen on a CUDA device."""
    import contextlib
    import time

    import torch
    from torch.utils import _pytree as pytree

    fwd_s: List[List[float]] = [[] for _ in layers]
    bwd_s: List[List[float]] = [[] for _ in layers]
    out_bytes, stash_bytes, work_bytes = [0] * len(layers), [0] * len(layers), [0] * len(layers)
    for r in range(repeats + 1):
        x = sample_input
        for i, layer in enumerate(layers):
            if stage is not None:
                layer.to(stage)
                x = pytree.tree_map(lambda t: t.to(stage) if isinstance(t, torch.Tensor) else t, x)
            xin = detach(x)
            params = {p.data_ptr() for p in layer.parameters()}
            device = _device_of(layer, xin)
            cuda = device.type == "cuda"
            compute = (torch.autocast(device.type, dtype=getattr(torch, HALF_DTYPE[precision])) if precision != "fp32"
                       else contextlib.nullcontext())
            saved: List[int] = []

            def pack(t, saved=saved, params=params):
                if t.data_ptr() not in params:
                    saved.append(t.numel() * t.element_size())
                return t

            def now() -> float:
                if cuda:
                    torch.cuda.synchronize(device)
                return time.perf_counter()

            def paced(started: float, section: int) -> float:
                end = now()
                if targets is None:
                    return end
                sleep_until(started + targets[i][section])
                return time.perf_counter()

            if cuda:
                held = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t0 = now()
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), compute:
                    y = layer(xin, **side_of(layer))
            except Exception as e:
                raise ValueError(f"profile_model: layer {i} ({type(layer).__name__}) failed: "
                                 f"{type(e).__name__}: {e}") from e
            t1 = paced(t0, 0)
            leaves, _ = flatten(y, f"layer {i} ({type(layer).__name__})")
            outs = [t for t in leaves if t.requires_grad]
            if outs:
                if i == len(layers) - 1:
                    with compute:
                        loss = loss_fn(y) if loss_fn is not None else sum(t.float().sum() for t in outs)
                    t1 = now()
                    loss.backward()
                    del loss
                else:
                    grads = [torch.ones_like(t) for t in outs]
                    t1 = now()
                    torch.autograd.backward(outs, grads)
                    del grads
            t2 = paced(t1, 1)
            if r > 0:
                fwd_s[i].append(t1 - t0)
                bwd_s[i].append(t2 - t1)
            out_bytes[i], stash_bytes[i] = nbytes(y), sum(saved)
            if cuda and r > 0:
                # From the second run on, the parameters' gradients exist (they accumulate in place),
                # so the peak holds the transients alone beyond the output and the stash.
                peak = torch.cuda.max_memory_allocated(device) - held - out_bytes[i] - stash_bytes[i]
                work_bytes[i] = max(work_bytes[i], peak, 0)
            if cuda and peak is not None:
                peak[0] = max(peak[0], torch.cuda.max_memory_allocated(device))
            if stage is not None:
                layer.to("cpu")
            x = pytree.tree_map(lambda t: t.detach(), y)
    return fwd_s, bwd_s, out_bytes, stash_bytes, work_bytes



def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``: all but the last millisecond at once,
    then in short slices, since ``sleep()`` overshoots (0.1 ms idle, more on a busy host)."""
    import time

    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left - 1e-3 if left > 2e-3 else left / 2 if left > 1e-4 else 0)


def _device_of(layer: Any, inputs: Any) -> Any:
    """Where ``layer`` runs: its first parameter's or buffer's device, else its first input tensor's."""
    import torch
    from torch.utils import _pytree as pytree

    for t in layer.parameters():
        return t.device
    for t in layer.buffers():
        return t.device
    for t in pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
