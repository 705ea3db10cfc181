"""Layer profiles: per-layer compute time on each device type, and the bytes each layer needs.

A :class:`ModelProfile` is an ordered list of :class:`LayerProfile` (the layers a plan partitions)
measured for one minibatch of ``minibatch_size`` samples. File format (JSON)::

    {"name": "vgg19", "minibatch_size": 32, "input_bytes": 19267584,
     "layers": [{"name": "conv1_1", "fwd_time": {"titan_v": 0.0049, ...}, "bwd_time": {...},
                 "activation_bytes": 411041792, "stash_bytes": 411041792, "param_bytes": 7168,
                 "optimizer_bytes": 7168, "workspace_bytes": 0, "flops": 3.5e9,
                 "derived": {"titan_v": true, ...}}, ...]}

Times are seconds per minibatch; ``activation_bytes`` is the layer's output for one minibatch (what
a stage sends to the next); ``stash_bytes`` what the layer keeps for its backward per minibatch in
flight (defaults to ``activation_bytes``; the layer's own parameters are not part of it, since the
planner counts the runtime's per-minibatch weight stashes separately); ``param_bytes`` its weights
(the planner adds the gradient, weight stashes and wave deltas of that size, see
:mod:`hetpipe.plan.stage_cost`); ``optimizer_bytes`` its optimizer state; ``workspace_bytes`` transient
scratch while it runs. ``derived[t]`` says that the times for type ``t`` were not measured on ``t``.

Where numbers come from:

* :func:`hetpipe.model.measure.profile_model` measures each layer's forward and backward on this host (one thread, the
  median of ``repeats`` runs) and the bytes it saves for backward (autograd's saved-tensor hooks),
  then derives every device type of the cluster by speed ratio: on an emulated cluster the host is
  the reference (time on type T = measured / T.speed); otherwise the host is a device of
  ``reference_type`` (time on T = measured x speed[reference] / speed[T]).
* The shipped presets ``resnet152``, ``vgg19`` and ``gpt`` (a 1.3B-parameter GPT: 24 blocks, width
  2048, 16 heads, sequence 1024) are analytic: :func:`analytic_profile` builds each layer from its
  shape (forward FLOPs, parameters, output and stashed activation elements per sample), and times
  it on each device type as ``minibatch x FLOPs / (peak FLOP/s x efficiency)`` with efficiency 0.5
  and backward = 2 x forward, the peak being that of the run's precision (FP32 for the shipped
  files; :meth:`hetpipe.plan.cluster.DeviceType.peak_for`). CNNs are FP32 with SGD momentum (4 + 4 bytes per parameter); the GPT
  is mixed precision (2-byte weights and activations, 12 bytes of Adam state and master weights per
  parameter). Regenerate the files with ``write_presets()``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from hetpipe.plan.precision import ACTIVATION_DTYPES, check_speed_precision
from hetpipe.util.files import read_text

PRESET_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"
EFFICIENCY = 0.5


@dataclass(frozen=True)
class LayerProfile:
    name: str
    fwd_time: Dict[str, float]
    bwd_time: Dict[str, float]
    activation_bytes: int = 0
    param_bytes: int = 0
    optimizer_bytes: int = 0
    workspace_bytes: int = 0
    derived: Dict[str, bool] = field(default_factory=dict)
    stash_bytes: Optional[int] = None
    flops: float = 0.0          # forward FLOPs per minibatch, 0 when unknown
    # Tied weights: (owner layer, the owner's parameter name, bytes) of each parameter this layer
    # holds that an earlier layer owns (and counts in its param_bytes). A stage holding this layer
    # but not the owner holds a replica of it (hetpipe.plan.stage_cost).
    tied: Tuple[Tuple[int, str, int], ...] = ()

    @property
    def stash(self) -> int:
        """Bytes kept for backward per minibatch in flight."""
        return self.activation_bytes if self.stash_bytes is None else self.stash_bytes


@dataclass(frozen=True)
class ModelProfile:
    name: str
    minibatch_size: int
    layers: Tuple[LayerProfile, ...]
    input_bytes: int = 0        # bytes of one minibatch's input to layer 0
    source: str = ""
    # The dtype ``activation_bytes`` counts floating activations in (the planner halves float32 ones
    # for a bf16 plan, see hetpipe.plan.precision.wire_factor); profile_model measures float32 models.
    activation_dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_names(self) -> Tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def device_types(self) -> Tuple[str, ...]:
        """Types every layer has times for."""
        if not self.layers:
            return ()
        common = set(self.layers[0].fwd_time)
        for layer in self.layers:
            common &= set(layer.fwd_time) & set(layer.bwd_time)
        return tuple(sorted(common))

    def validate(self, device_types: Optional[Iterable[str]] = None) -> None:
        """Raise ValueError naming the layer (and type) for negative or missing numbers.

        With ``device_types``, every layer must have forward and backward times for each of them.
        """
        where = f"profile {self.name!r}"
        if not self.layers:
            raise ValueError(f"{where}: no layers")
        for kind in ("minibatch_size", "input_bytes"):
            v = getattr(self, kind)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where}: {kind} must be an integer >= 0, got {v!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"{where}: activation_dtype must be one of {list(ACTIVATION_DTYPES)}, "
                             f"got {self.activation_dtype!r}")
        need = list(device_types) if device_types is not None else None
        for i, layer in enumerate(self.layers):
            lw = f"{where}: layer {i} ({layer.name!r})"
            for kind, times in (("fwd_time", layer.fwd_time), ("bwd_time", layer.bwd_time)):
                for t, v in times.items():
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                        raise ValueError(f"{lw}: {kind} on device type {t!r} must be a finite number >= 0, got {v!r}")
                for t in need or ():
                    if t not in times:
                        raise ValueError(f"{lw}: no {kind} for device type {t!r} "
                                         f"(profiled types: {sorted(times)})")
            for kind in ("activation_bytes", "param_bytes", "optimizer_bytes", "workspace_bytes"):
                v = getattr(layer, kind)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"{lw}: {kind} must be an integer >= 0, got {v!r}")
            sb = layer.stash_bytes
            if sb is not None and (isinstance(sb, bool) or not isinstance(sb, int) or sb < 0):
                raise ValueError(f"{lw}: stash_bytes must be an integer >= 0, got {sb!r}")
            fl = layer.flops
            if isinstance(fl, bool) or not isinstance(fl, (int, float)) or not math.isfinite(fl) or fl < 0:
                raise ValueError(f"{lw}: flops must be a finite number >= 0, got {fl!r}")
            for t in layer.tied:
                ok = (isinstance(t, tuple) and len(t) == 3 and isinstance(t[0], int) and not isinstance(t[0], bool)
                      and 0 <= t[0] < i and isinstance(t[1], str) and isinstance(t[2], int)
                      and not isinstance(t[2], bool) and t[2] >= 0)
                if not ok:
                    raise ValueError(f"{lw}: each tied entry must be [owner layer < {i}, parameter name, bytes >= 0], "
                                     f"got {t!r}")

    def fwd(self, device_type: str) -> List[float]:
        return [layer.fwd_time[device_type] for layer in self.layers]

    def bwd(self, device_type: str) -> List[float]:
        return [layer.bwd_time[device_type] for layer in self.layers]

    def derive_types(self, speeds: Mapping[str, float], reference_type: Optional[str] = None) -> "ModelProfile":
        """A copy with times for every type in ``speeds`` (name -> relative speed) that a layer lacks,
        scaled from ``reference_type`` (default: the fastest profiled type present in ``speeds``)
        by speed ratio and marked derived. Accepts a ClusterSpec's ``device_types`` via
        ``{t: dt.speed for t, dt in cluster.device_types.items()}``."""
        have = [t for t in self.device_types if t in speeds]
        if reference_type is None:
            if not have:
                raise ValueError(f"profile {self.name!r}: no profiled device type among {sorted(speeds)} "
                                 f"to derive the others from (profiled: {list(self.device_types)})")
            reference_type = max(have, key=lambda t: speeds[t])
        if reference_type not in self.device_types or reference_type not in speeds:
            raise ValueError(f"profile {self.name!r}: reference type {reference_type!r} is not profiled "
                             f"or has no speed")
        ref = speeds[reference_type]
        layers = []
        for layer in self.layers:
            f, b, dv = dict(layer.fwd_time), dict(layer.bwd_time), dict(layer.derived)
            for t, s in speeds.items():
                if t not in f or t not in b:
                    f[t] = layer.fwd_time[reference_type] * ref / s
                    b[t] = layer.bwd_time[reference_type] * ref / s
                    dv[t] = True
            layers.append(replace(layer, fwd_time=f, bwd_time=b, derived=dv))
        return replace(self, layers=tuple(layers))

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        out = []
        for layer in self.layers:
            d = {"name": layer.name, "fwd_time": layer.fwd_time, "bwd_time": layer.bwd_time,
                 "activation_bytes": layer.activation_bytes, "param_bytes": layer.param_bytes,
                 "optimizer_bytes": layer.optimizer_bytes, "workspace_bytes": layer.workspace_bytes,
                 "derived": layer.derived}
            if layer.stash_bytes is not None:
                d["stash_bytes"] = layer.stash_bytes
            if layer.flops:
                d["flops"] = layer.flops
            if layer.tied:
                d["tied"] = [list(t) for t in layer.tied]
            out.append(d)
        d = {"name": self.name, "minibatch_size": self.minibatch_size, "input_bytes": self.input_bytes,
             "source": self.source, "layers": out}
        if self.activation_dtype != "float32":
            d["activation_dtype"] = self.activation_dtype
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "ModelProfile":
        if not isinstance(data, Mapping):
            raise ValueError(f"profile: must be a JSON object, got {type(data).__name__}")
        name = str(data.get("name", "model"))
        if "layers" not in data or not isinstance(data["layers"], list):
            raise ValueError(f"profile {name!r}: missing the list of layers")
        layers = []
        for i, ld in enumerate(data["layers"]):
            if not isinstance(ld, Mapping):
                raise ValueError(f"profile {name!r}: layer {i} must be an object, got {ld!r}")
            lname = ld.get("name", f"layer{i}")
            unknown = set(ld) - {f.name for f in LayerProfile.__dataclass_fields__.values()}
            if unknown:
                raise ValueError(f"profile {name!r}: layer {i} ({lname!r}): unknown field(s) {sorted(unknown)}")
            if not isinstance(ld.get("derived", {}), Mapping):
                raise ValueError(f"profile {name!r}: layer {i} ({lname!r}): derived must be an object "
                                 f"mapping device type to true/false, got {ld['derived']!r}")
            for key in ("fwd_time", "bwd_time"):
                if not isinstance(ld.get(key), Mapping):
                    raise ValueError(f"profile {name!r}: layer {i} ({lname!r}): {key} must be an object "
                                     f"mapping device type to seconds")
            layers.append(LayerProfile(
                name=str(lname), fwd_time=dict(ld["fwd_time"]), bwd_time=dict(ld["bwd_time"]),
                activation_bytes=ld.get("activation_bytes", 0), param_bytes=ld.get("param_bytes", 0),
                optimizer_bytes=ld.get("optimizer_bytes", 0), workspace_bytes=ld.get("workspace_bytes", 0),
                derived=dict(ld.get("derived", {})), stash_bytes=ld.get("stash_bytes"),
                flops=ld.get("flops", 0.0), tied=_tied_entries(ld.get("tied", []), f"profile {name!r}: layer {i}")))
        return cls(name=name, minibatch_size=data.get("minibatch_size", 0), layers=tuple(layers),
                   input_bytes=data.get("input_bytes", 0), source=str(data.get("source", "")),
                   activation_dtype=str(data.get("activation_dtype", "float32")))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: Union[str, Path]) -> "ModelProfile":
        p = Path(path)
        text = read_text(p, "profile")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"profile: {p} is not valid JSON: {e}") from e
        return cls.from_dict(data)


def _tied_entries(value: Any, where: str) -> Tuple[Tuple[Any, ...], ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, (list, tuple)) for t in value):
        raise ValueError(f"{where}: tied must be a list of [owner layer, parameter name, bytes], got {value!r}")
    return tuple(tuple(t) for t in value)


def presets() -> List[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_profile(spec: Union[str, Path, Mapping, ModelProfile]) -> ModelProfile:
    """A profile from a preset name (``resnet152``, ``vgg19``, ``gpt``), a JSON path or a dict."""
    if isinstance(spec, ModelProfile):
        return spec
    if isinstance(spec, Mapping):
        return ModelProfile.from_dict(spec)
    text = str(spec)
    path = Path(text)
    if not path.suffix and (PRESET_DIR / f"{text}.json").is_file():
        return ModelProfile.load(PRESET_DIR / f"{text}.json")
    if not path.is_file():
        raise ValueError(f"profile: {text!r} is neither a preset ({', '.join(presets())}) nor a file")
    return ModelProfile.load(path)


def profile_for_cluster(spec: Union[str, Path, Mapping, "ModelProfile"], cluster: Any,
                        precision: str = "fp32") -> Tuple["ModelProfile", str]:
    """A profile with times for every device type ``cluster``'s devices have, and a note saying how the times of
    types the profile did not measure were made ("" when none were).

    A preset name (``resnet152``, ``vgg19``, ``gpt``) whose shipped file lacks some of the cluster's
    types, or whose types run ``precision`` at another peak than FP32, is rebuilt analytically for the
    cluster's types at their peak for ``precision`` (each needs ``peak_flops``;
    :meth:`hetpipe.plan.cluster.DeviceType.peak_for`). Any other profile keeps what it measured and
    derives the missing types by their speed ratio for ``precision``, marked ``derived``."""
    from hetpipe.plan.cluster import load_cluster

    cluster = load_cluster(cluster)
    types = sorted({d.type for d in cluster.devices})      # the types a plan can use
    rated = cluster.at_precision(precision)
    if isinstance(spec, str) and not Path(spec).suffix and spec in PRESET_SHAPES:
        profile = load_profile(spec)
        same_peaks = all(rated.device_types[t].peak_flops == cluster.device_types[t].peak_flops for t in types)
        if set(types) <= set(profile.device_types) and same_peaks:
            return profile, ""
        flopless = [t for t in types if not cluster.device_types[t].peak_flops]
        if flopless:
            fix = ("which emulated types have not: give a profile measured on this host instead (the profile.json "
                   "a launch with --plan-cache DIR writes there, or hetpipe.model.measure.profile_model's on "
                   "cluster cpu-emulated-6)"
                   if cluster.emulated else "or give a profile measured on them (a profile.json that hetpipe wrote)")
            raise ValueError(f"profile {spec!r} is analytic: device type(s) {', '.join(flopless)} of cluster "
                             f"{cluster.name!r} need peak_flops (FLOP/s) in the cluster JSON, {fix}")
        return analytic_profile(spec, {t: rated.device_types[t] for t in types}, precision=precision), (
            f"profile {spec!r}: analytic for this cluster's types ({', '.join(types)}): layer FLOPs / "
            f"(peak {'' if precision == 'fp32' else precision + ' '}FLOP/s x {EFFICIENCY}); modelled, not measured")
    profile = load_profile(spec)
    missing = [t for t in types if t not in profile.device_types]
    if not missing:
        return profile, ""
    speeds = {t: rated.device_types[t].speed for t in types}
    derived = profile.derive_types(speeds)
    have = [t for t in profile.device_types if t in speeds]
    return derived, (f"profile {profile.name!r}: {', '.join(missing)} derived by speed ratio from "
                     f"{max(have, key=lambda t: speeds[t])} (not measured on them)")


# --- measuring -------------------------------------------------------------------------------

LAYER_NAMES_ATTR = "hetpipe_layer_names"


def layer_names(model: Any) -> Optional[List[str]]:
    """The names of ``model``'s layers for plans and reports: ``model.hetpipe_layer_names`` (what
    :func:`hetpipe.adapters.adapt` sets on its layer list, e.g. ``h.3``), else an ``nn.Sequential``'s own
    child names when they are not just positions; None when there are none."""
    import torch.nn as nn

    names = getattr(model, LAYER_NAMES_ATTR, None)
    if names is not None:
        names = [str(n) for n in names]
        if len(names) != len(model):
            raise ValueError(f"hetpipe: {LAYER_NAMES_ATTR} names {len(names)} layers, the model has {len(model)}")
        return names
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        keys = [k for k, _ in model.named_children()]
        if any(not k.isdigit() for k in keys):
            return keys
    return None


# --- analytic presets ------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerShape:
    """Per-sample sizes of one layer: forward FLOPs, parameters, output and stashed elements."""

    name: str
    flops: float
    params: int
    out_elems: int
    stash_elems: int


def resnet152_shapes(image: int = 224, classes: int = 1000) -> List[LayerShape]:
    """Stem, 50 bottleneck blocks (3, 8, 36, 3), pooled classifier: 52 layers."""
    hw = image // 2
    out: List[LayerShape] = [LayerShape("stem", 2 * 3 * 64 * 49 * hw * hw, 3 * 64 * 49 + 128,
                                        64 * (hw // 2) ** 2, 3 * 64 * hw * hw + 64 * (hw // 2) ** 2)]
    hw //= 2
    cin = 64
    for stage, (blocks, w) in enumerate(zip((3, 8, 36, 3), (64, 128, 256, 512))):
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 0) else 1
            ho = hw // stride
            macs = cin * w * hw * hw + 9 * w * w * ho * ho + 4 * w * w * ho * ho
            params = cin * w + 9 * w * w + 4 * w * w + 2 * (6 * w)
            stash = 3 * w * hw * hw + 3 * w * ho * ho + 3 * 4 * w * ho * ho
            if b == 0:
                macs += cin * 4 * w * ho * ho
                params += cin * 4 * w + 8 * w
                stash += 2 * 4 * w * ho * ho
            out.append(LayerShape(f"conv{stage + 2}_{b + 1}", 2 * macs, params, 4 * w * ho * ho, stash))
            cin, hw = 4 * w, ho
    out.append(LayerShape("fc", 2 * cin * classes + cin * hw * hw, cin * classes + classes, classes,
                          cin * hw * hw + cin))
    return out


def vgg19_shapes(image: int = 224, classes: int = 1000) -> List[LayerShape]:
    """16 convolutions (ReLU and any following max-pool folded in) and 3 fully connected: 19 layers."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    out: List[LayerShape] = []
    cin, hw, stage, idx = 3, image, 1, 0
    for i, c in enumerate(cfg):
        if c == "M":
            continue
        idx += 1
        pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
        ho = hw // 2 if pool else hw
        out.append(LayerShape(f"conv{stage}_{idx}", 2 * cin * c * 9 * hw * hw, cin * c * 9 + c, c * ho * ho,
                              2 * c * hw * hw + (c * ho * ho if pool else 0)))
        cin, hw = c, ho
        if pool:
            stage, idx = stage + 1, 0
    for j, (fi, fo) in enumerate(((cin * hw * hw, 4096), (4096, 4096), (4096, classes))):
        out.append(LayerShape(f"fc{j + 6}", 2 * fi * fo, fi * fo + fo, fo, fi + 2 * fo))
    return out


def gpt_shapes(blocks: int = 24, width: int = 2048, heads: int = 16, seq: int = 1024,
               vocab: int = 50257) -> List[LayerShape]:
    """Embedding, ``blocks`` transformer blocks, final norm + LM head (untied): blocks + 2 layers."""
    d, s = width, seq
    out = [LayerShape("embed", 0.0, vocab * d + s * d, s * d, s)]
    for b in range(blocks):
        out.append(LayerShape(f"block{b}", s * (24 * d * d + 4 * s * d), 12 * d * d + 13 * d, s * d,
                              17 * s * d + int(2.5 * heads * s * s)))
    out.append(LayerShape("head", 2 * s * d * vocab, vocab * d + 2 * d, s * vocab, s * d + s * vocab))
    return out


PRESET_SHAPES = {
    # name: (shapes, minibatch, bytes per parameter, per activation element, optimizer bytes per parameter,
    #        input bytes per sample)
    "resnet152": (resnet152_shapes, 32, 4, 4, 4, 3 * 224 * 224 * 4),
    "vgg19": (vgg19_shapes, 32, 4, 4, 4, 3 * 224 * 224 * 4),
    "gpt": (gpt_shapes, 4, 2, 2, 12, 1024 * 8),
}


def analytic_profile(name: str, device_types: Mapping[str, Any], efficiency: float = EFFICIENCY,
                     precision: str = "fp32") -> ModelProfile:
    """The preset ``name`` built from its layer shapes for ``device_types`` (name -> DeviceType with
    ``peak_flops``), each timed at its peak for ``precision`` (``peak_flops`` for "fp32",
    :meth:`hetpipe.plan.cluster.DeviceType.peak_for` otherwise); see the module docstring. The
    gradient buffer (as large as the weights) is not in ``optimizer_bytes``: the planner adds it."""
    if name not in PRESET_SHAPES:
        raise ValueError(f"analytic_profile: unknown model {name!r} (known: {sorted(PRESET_SHAPES)})")
    shapes_fn, batch, pbytes, abytes, obytes, in_bytes = PRESET_SHAPES[name]
    for t, dt in device_types.items():
        if not getattr(dt, "peak_flops", 0):
            raise ValueError(f"analytic_profile: device type {t!r} has no peak_flops")
    check_speed_precision(precision, "analytic_profile")
    peak = {t: dt.peak_flops if precision == "fp32" else dt.peak_for(precision) for t, dt in device_types.items()}
    layers = []
    for sh in shapes_fn():
        fl = batch * sh.flops
        f = {t: fl / (peak[t] * efficiency) for t in device_types}
        layers.append(LayerProfile(
            name=sh.name, fwd_time=f, bwd_time={t: 2 * v for t, v in f.items()},
            activation_bytes=batch * sh.out_elems * abytes, param_bytes=sh.params * pbytes,
            optimizer_bytes=sh.params * obytes,
            workspace_bytes=batch * sh.out_elems * abytes, derived={t: True for t in device_types},
            stash_bytes=batch * sh.stash_elems * abytes, flops=float(fl)))
    return ModelProfile(name=name, minibatch_size=batch, layers=tuple(layers), input_bytes=batch * in_bytes,
                        source=f"analytic: layer FLOPs / (peak {precision.upper()} FLOP/s x {efficiency}); "
                               f"devices modelled",
                        activation_dtype="bfloat16" if abytes == 2 else "float32")


def write_presets(cluster: Any = "hetpipe-testbed", directory: Union[str, Path, None] = None) -> List[Path]:
    """Write the analytic presets for the device types of ``cluster`` as JSON files."""
    from hetpipe.plan.cluster import load_cluster

    c = load_cluster(cluster)
    d = Path(directory) if directory is not None else PRESET_DIR
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PRESET_SHAPES:
        p = d / f"{name}.json"
        analytic_profile(name, c.device_types).save(p)
        paths.append(p)
    return paths
