"""Any other ``nn.Module`` as a layer list: trace its forward with ``torch.fx``, cut the graph at the
user's split points (or into a number of balanced parts) with ``torch.fx``'s ``split_module``, and
chain the parts so that each returns exactly what the next one needs.

Why not ``torch.distributed.pipelining.pipeline``: it traces with ``torch.export`` (train/eval mode and
the example's shapes are fixed at trace time, and BatchNorm updates become functional copies) and it
deep-copies every parameter used by several stages, which breaks a tie that the layer contract keeps
as one ``nn.Parameter``; its stages also read values from any earlier stage, where the contract chains
them. ``torch.fx`` symbolic tracing keeps ``torch.nn`` modules as leaves (the model's own modules and
parameters, mode switches and BatchNorm buffers intact); its ``split_module`` is what ``pipeline``
splits with too. Split points use ``pipelining``'s :class:`SplitPoint` (before/after a submodule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import fx, nn
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_leaves

from hetpipe.adapters.adapted import Adapted
from hetpipe.adapters.errors import AdapterError

if TYPE_CHECKING:   # importing torch.distributed.pipelining costs seconds: a spec's values are checked by name
    from torch.distributed.pipelining import SplitPoint

SplitSpec = Union[Sequence[str], Mapping[str, "SplitPoint"]]


def _split_marker() -> None:
    """A no-op the tracer records where a split point falls; removed before the graph is split."""


class _SplitTracer(fx.Tracer):
    """``fx.Tracer`` that records a marker node before/after the submodules named in the split spec,
    treats ``leaf_modules`` as opaque, and remembers which submodule it was tracing when it fails."""

    def __init__(self, before: Sequence[str], after: Sequence[str], leaves: Sequence[str]) -> None:
        super().__init__()
        self.before, self.after, self.leaves = set(before), set(after), set(leaves)
        self.seen: set = set()
        self.stack: List[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        path = self.path_of_module(m)
        self.seen.add(path)
        if path in self.before:
            self.create_node("call_function", _split_marker, (), {})
        self.stack.append(path)
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()
        if path in self.after:
            self.create_node("call_function", _split_marker, (), {})
        return out


def _spec(model: nn.Module, split_points: SplitSpec) -> Tuple[List[str], List[str]]:
    items = split_points.items() if isinstance(split_points, Mapping) else [(n, "BEGINNING") for n in split_points]
    before, after = [], []
    for name, where in items:
        kind = getattr(where, "name", where)            # SplitPoint.BEGINNING -> "BEGINNING"
        try:
            model.get_submodule(name)
        except AttributeError:
            raise AdapterError(f"hetpipe.adapters.traced: split point {name!r} is not a submodule of "
                               f"{type(model).__name__}") from None
        if kind not in ("BEGINNING", "END"):
            raise AdapterError(f"hetpipe.adapters.traced: split point {name!r} has {where!r}, not a SplitPoint")
        (before if kind == "BEGINNING" else after).append(name)
    return before, after


def _trace(model: nn.Module, before: Sequence[str], after: Sequence[str], leaves: Sequence[str]) -> fx.GraphModule:
    tracer = _SplitTracer(before, after, leaves)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... for untraceable code
        where = f" in submodule {tracer.stack[-1]!r}" if tracer.stack and tracer.stack[-1] else ""
        raise AdapterError(f"hetpipe.adapters.traced: torch.fx cannot trace {type(model).__name__}{where}: {e} "
                           "(name that submodule in leaf_modules to keep it whole, or split the model by hand)") from e
    for name in [*before, *after]:
        if name not in tracer.seen:
            raise AdapterError(f"hetpipe.adapters.traced: split point {name!r} is never called by "
                               f"{type(model).__name__}.forward (or lies inside a leaf module)")
    for node in graph.nodes:
        if node.op == "placeholder" and node.target.startswith("*"):
            raise AdapterError(f"hetpipe.adapters.traced: {type(model).__name__}.forward takes {node.target}; "
                               "only named arguments can be fed from the minibatch inputs")
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _body(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _marked_parts(gm: fx.GraphModule) -> Dict[fx.Node, int]:
    """Part of each body node, counting the split markers before it; the markers are erased."""
    part, parts = 0, {}
    for node in _body(gm):
        if node.op == "call_function" and node.target is _split_marker:
            part += 1
            gm.graph.erase_node(node)
        else:
            parts[node] = part
    return parts


def _attr(root: nn.Module, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _node_cost(gm: fx.GraphModule, node: fx.Node) -> int:
    """Parameters a node brings (its module's, or the tensor it fetches), plus one for the op itself."""
    if node.op == "call_module":
        return 1 + sum(p.numel() for p in gm.get_submodule(node.target).parameters())
    if node.op == "get_attr":
        value = _attr(gm, node.target)
        return 1 + (value.numel() if isinstance(value, torch.Tensor) else 0)
    return 1


def _balanced_parts(gm: fx.GraphModule, num_layers: int) -> Dict[fx.Node, int]:
    """``num_layers`` contiguous parts of the body with parameter counts close to equal: the k-th cut
    falls where the running count is nearest to k/num_layers of the total."""
    body = _body(gm)
    computing = [n for n in body if n.op != "get_attr"]
    if num_layers < 1 or num_layers > len(computing):
        raise AdapterError(f"hetpipe.adapters.traced: num_layers = {num_layers}, but "
                           f"{gm.__class__.__name__}.forward has {len(computing)} operations to split")
    costs = [_node_cost(gm, n) for n in body]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    cuts: List[int] = []
    for k in range(1, num_layers):
        target = prefix[-1] * k / num_layers
        lo = (cuts[-1] + 1) if cuts else 1
        hi = len(body) - (num_layers - k)          # leave at least one node per remaining part
        cuts.append(min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - target)))
    parts, part = {}, 0
    for i, node in enumerate(body):
        while part < len(cuts) and i >= cuts[part]:
            part += 1
        parts[node] = part
    return parts


_REQUIRED = object()


class _Ref:
    """A value of the split graph, by node name, inside the last layer's output structure."""

    def __init__(self, name: str) -> None:
        self.name = name


def _refs(arg: Any) -> Any:
    """``arg`` (an fx argument) with plain containers and :class:`_Ref` in place of nodes."""
    if isinstance(arg, fx.Node):
        return _Ref(arg.name)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_refs(a) for a in arg) if type(arg) in (tuple, list) else tuple(_refs(a) for a in arg)
    if isinstance(arg, dict):
        return {k: _refs(v) for k, v in arg.items()}
    return arg


def _resolve(arg: Any, env: Dict[str, Any]) -> Any:
    if isinstance(arg, _Ref):
        return env[arg.name]
    if isinstance(arg, (tuple, list)):
        return type(arg)(_resolve(a, env) for a in arg)
    if isinstance(arg, dict):
        return {k: _resolve(v, env) for k, v in arg.items()}
    return arg


class TracedLayer(nn.Module):
    """One part of a traced model: takes the values live before it (layer 0: the minibatch inputs),
    runs its ``fx`` submodule and returns the values live after it (the last part: the output).

    A part that reads a forward argument of a dict-fed model declares it in ``hetpipe_side_inputs``;
    a single live value crosses the boundary bare, several as a tuple. Tensors the graph reads as
    attributes (a weight used functionally) are registered here too: the model's own objects, so a
    weight read by several parts stays one ``nn.Parameter``."""

    def __init__(self, index: int, name: str, submod: fx.GraphModule, args: Sequence[str], results: Sequence[str],
                 live_in: Sequence[str], live_out: Sequence[str], output: Any,
                 placeholders: Sequence[Tuple[str, str, Any]], side_inputs: Dict[str, str],
                 attrs: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.index, self.name, self.submod = index, name, submod
        self.args, self.results = tuple(args), tuple(results)
        self.live_in, self.live_out, self.output = tuple(live_in), tuple(live_out), output
        self.placeholders = tuple(placeholders)     # layer 0: (node name, argument name, default or _REQUIRED)
        self.side_nodes = dict(side_inputs)         # argument name -> node name
        self.hetpipe_side_inputs = tuple(side_inputs)
        self.attr_slots: Dict[str, str] = {}        # node name -> attribute of this module
        for node_name, value in attrs.items():
            slot = f"attr_{len(self.attr_slots)}"
            if isinstance(value, nn.Parameter):
                self.register_parameter(slot, value)
            else:
                self.register_buffer(slot, value)
            self.attr_slots[node_name] = slot

    def _bind_inputs(self, inputs: Any) -> Dict[str, Any]:
        if len(self.placeholders) == 1 and not isinstance(inputs, Mapping):
            return {self.placeholders[0][0]: inputs}
        if not isinstance(inputs, Mapping):
            raise AdapterError(f"hetpipe: layer 0 ({self.name}) takes a dict with keys "
                               f"{[p[1] for p in self.placeholders]}, got a {type(inputs).__name__}")
        env = {}
        for node_name, arg, default in self.placeholders:
            if arg in inputs:
                env[node_name] = inputs[arg]
            elif default is _REQUIRED:
                raise AdapterError(f"hetpipe: layer 0 ({self.name}) needs input {arg!r}; the inputs have keys "
                                   f"{sorted(inputs)}")
            else:
                env[node_name] = default
        return env

    def forward(self, value: Any, **side: Any) -> Any:
        if self.index == 0:
            env = self._bind_inputs(value)
        else:
            env = dict(zip(self.live_in, (value,) if len(self.live_in) == 1 else value))
        env.update((self.side_nodes[k], v) for k, v in side.items())
        env.update((n, getattr(self, slot)) for n, slot in self.attr_slots.items())
        out = self.submod(*(env[a] for a in self.args))
        env.update(zip(self.results, (out,) if len(self.results) == 1 else out))
        if self.output is not None:
            return _resolve(self.output, env)
        for name in self.live_out:
            bad = [type(x).__name__ for x in tree_leaves(env[name]) if not isinstance(x, torch.Tensor)]
            if bad:
                raise AdapterError(f"hetpipe: layer {self.index} ({self.name}) passes {name!r} of type {bad[0]} to "
                                   "the next layer: only tensors cross a stage boundary; move the split point")
        vals = tuple(env[n] for n in self.live_out)
        return vals[0] if len(vals) == 1 else vals


def traced(model: nn.Module, split_points: Optional[SplitSpec] = None, *, num_layers: Optional[int] = None,
           leaf_modules: Sequence[str] = ()) -> Adapted:
    """Cut ``model`` into layers by tracing its forward with ``torch.fx``.

    split_points: submodule names to split *before*, or ``{name: SplitPoint.BEGINNING | END}``
        (``torch.distributed.pipelining``'s spec; a member's name as a string works too); or
        num_layers: that many parts of nearly equal parameter count. leaf_modules: submodules to keep
        whole (e.g. ones fx cannot trace through).
    A forward of one argument takes the minibatch inputs as that tensor; a forward of several takes a
    dict keyed by argument name, and later parts read the arguments they use as side inputs.
    ``train()``/``eval()`` switch the traced modules as they switch the model; python control flow on
    tensor values cannot be traced (fx's limit): keep such a submodule whole with leaf_modules."""
    if (split_points is None) == (num_layers is None):
        raise AdapterError("hetpipe.adapters.traced: give either split_points or num_layers")
    before, after = _spec(model, split_points) if split_points is not None else ([], [])
    for name in leaf_modules:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise AdapterError(f"hetpipe.adapters.traced: leaf module {name!r} is not a submodule of "
                               f"{type(model).__name__}") from None
    gm = _trace(model, before, after, leaf_modules)
    parts = _marked_parts(gm) if split_points is not None else _balanced_parts(gm, num_layers)
    n = max(parts.values(), default=0) + 1
    filled = {p for node, p in parts.items() if node.op != "get_attr"}
    for p in range(n):
        if p not in filled:
            raise AdapterError(f"hetpipe.adapters.traced: the split points of {type(model).__name__} leave "
                               f"part {p} without an operation (two split points at the same place?)")
    by_name = {node.name: p for node, p in parts.items()}
    split = split_module(gm, model, lambda node: by_name[node.name])
    layers = _chain(model, split, n)
    return Adapted(layers, [_part_name(gm, parts, p) for p in range(n)], None, model)


def _part_name(gm: fx.GraphModule, parts: Dict[fx.Node, int], p: int) -> str:
    """``first..last`` submodule a part calls (``part p`` if it calls none)."""
    mods = [str(node.target) for node, q in parts.items() if q == p and node.op == "call_module"]
    if not mods:
        return f"part {p}"
    return mods[0] if len(mods) == 1 else f"{mods[0]}..{mods[-1]}"


def _chain(model: nn.Module, split: fx.GraphModule, n: int) -> nn.ModuleList:
    """The parts of ``split`` as :class:`TracedLayer` s, each handing the next what it needs."""
    nodes = list(split.graph.nodes)
    placeholders = [nd for nd in nodes if nd.op == "placeholder"]
    attrs = {nd.name: _attr(split, nd.target) for nd in nodes if nd.op == "get_attr"}
    dict_fed = len(placeholders) > 1
    required = {p.name: (p.args[0] if p.args else _REQUIRED) for p in placeholders}
    # A forward argument is bound by layer 0 and carried, unless a dict feeds it to later parts directly.
    side = {p.name for p in placeholders if dict_fed and required[p.name] is _REQUIRED}
    stage_of: Dict[str, int] = {p.name: 0 for p in placeholders}
    calls: List[fx.Node] = []
    for nd in nodes:
        if nd.op == "call_module":
            stage_of[nd.name] = len(calls)
            calls.append(nd)
        elif nd.op == "call_function":            # getitem unpacking a part's results
            stage_of[nd.name] = stage_of[nd.args[0].name]
    if len(calls) != n:
        raise AdapterError(f"hetpipe.adapters.traced: expected {n} parts of {type(model).__name__}, "
                           f"torch.fx produced {len(calls)}")
    output = next(nd for nd in nodes if nd.op == "output")
    for a in output.all_input_nodes:
        if a.name in attrs:
            raise AdapterError(f"hetpipe.adapters.traced: {type(model).__name__}.forward returns attribute "
                               f"{a.target!r} itself; return a computed value")
    last_use: Dict[str, int] = {}
    for nd in nodes:
        user_stage = n - 1 if nd.op == "output" else stage_of.get(nd.name, 0)
        for a in nd.all_input_nodes:
            last_use[a.name] = max(last_use.get(a.name, 0), user_stage)
    carried = [nd.name for nd in nodes if nd.op in ("placeholder", "call_module", "call_function")
               and nd.name not in side]
    live_after = [[v for v in carried if stage_of[v] <= k < last_use.get(v, -1)] for k in range(n)]
    layers = []
    for k, call in enumerate(calls):
        inputs = call.all_input_nodes
        results = [u.name for u in nodes if u.op == "call_function" and u.args[0] is call] or [call.name]
        layers.append(TracedLayer(
            k, call.target, getattr(split, call.target), [a.name for a in call.args], results,
            live_after[k - 1] if k > 0 else [], live_after[k],
            _refs(output.args[0]) if k == n - 1 else None,
            [(p.name, p.target, required[p.name]) for p in placeholders] if k == 0 else [],
            {a.target: a.name for a in inputs if a.name in side} if k > 0 else {},
            {a.name: attrs[a.name] for a in inputs if a.name in attrs}))
    return nn.ModuleList(layers)
