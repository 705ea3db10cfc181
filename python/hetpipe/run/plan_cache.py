"""A plan cache: the cluster, profile and plan a run made, reused by the next run of the same model on
the same cluster with the same settings, so that two identical launches train with the same cuts.

Profiling measures the model on this host, and timings differ from one launch to the next; without a
cache, two identical launches could plan different cuts and train different losses. ``key`` holds
what the plan depends on: the model's structure (each layer's class and its parameter and buffer
shapes and dtypes, not their values), the shapes of a sample minibatch, the cluster, the precision,
the policy, Nm and D. A lookup whose key differs re-plans and says which field differs; an unreadable
cache re-plans and says why. Files: ``DIR/key.json``, ``plan.json``, ``profile.json``, ``cluster.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from hetpipe.plan.types import Plan



def plan_key(layers: Sequence[Any], sample: Any, cluster: Any, precision: str, planning: Any,
             **extra: Any) -> Dict[str, Any]:
    """The cache key of a plan made for ``layers`` on ``sample`` over ``cluster`` (a ClusterSpec) in
    ``precision`` with ``planning``'s policy, Nm, D and objective when not the default (a
    :class:`~hetpipe.run.config.Planning`); ``extra``:
    what else the planner was given (e.g. the world's PS nodes). The fields in the order a mismatch is
    reported."""
    key = {"model": model_key(layers), "sample": sample_key(sample), "cluster": cluster.to_dict(),
           "precision": precision, "policy": planning.policy, "nm": planning.nm, "d": planning.d or 0}
    waves = getattr(planning, "waves", "equal")
    if waves != "equal":
        key["waves"] = waves
    objective = getattr(planning, "objective", "throughput")
    if objective != "throughput":
        # a plan for another objective (time to accuracy: from the given noise scale, or None: the pilot's)
        key.update(objective=objective, noise_scale=getattr(planning, "noise_scale", None))
    return {**key, **extra}


def planning_inputs(cluster: Any, profile: Dict[str, Any], planning: Any, minibatch_size: int, precision: str,
                    **extra: Any) -> Dict[str, Any]:
    """What a restarting launcher re-plans the surviving devices with (``planning.json``): the cluster,
    the profile (JSON data) and the planner's settings of a plan made in this run."""
    return {"cluster": cluster.to_dict(), "profile": profile, "policy": planning.policy, "nm": planning.nm,
            "d": planning.d or 0, "minibatch_size": minibatch_size, "precision": precision, **extra}


def model_key(layers: Sequence[Any]) -> list:
    """Per layer: its class, and the shape and dtype of each parameter and buffer, by name."""
    out = []
    for layer in layers:
        tensors = [[n, list(t.shape), str(t.dtype)] for n, t in layer.named_parameters(remove_duplicate=False)]
        tensors += [[n, list(t.shape), str(t.dtype)] for n, t in layer.named_buffers()]
        out.append([type(layer).__name__, tensors])
    return out


def sample_key(sample: Any) -> list:
    """The shapes and dtypes of a minibatch's tensors (its pytree leaves, in order)."""
    from torch.utils import _pytree as pytree

    return [[list(t.shape), str(t.dtype)] if hasattr(t, "shape") else repr(t) for t in pytree.tree_leaves(sample)]


def _differs(old: Dict[str, Any], new: Dict[str, Any]) -> Optional[str]:
    for field in new:
        if old.get(field) != new[field]:
            if field == "model" and isinstance(old.get("model"), list):
                a, b = old["model"], new["model"]
                if len(a) != len(b):
                    return f"the model has {len(b)} layers, the cached plan's {len(a)}"
                l = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                return f"the model's layer {l} ({b[l][0]}) differs from the cached plan's ({a[l][0]})"
            return f"the {field} differs ({old.get(field)!r} cached, {new[field]!r} now)" if field not in (
                "cluster", "sample") else f"the {field} differs from the cached plan's"
    return None


class PlanCache:
    """The plan cache in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def lookup(self, key: Dict[str, Any]) -> Tuple[Optional[Plan], str]:
        """The cached plan when its key is ``key`` (and why it is reused), else None and why not."""
        if not (self.directory / "key.json").exists():
            return None, f"re-planning: no cached plan in {self.directory}"
        try:
            old = json.loads((self.directory / "key.json").read_text())
            plan = Plan.load(self.directory / "plan.json")
        except (OSError, ValueError) as e:
            return None, f"re-planning: the cache in {self.directory} is unreadable ({e})"
        why = _differs(old, key)
        if why is not None:
            return None, f"re-planning: {why} (cache {self.directory})"
        return plan, f"reusing the cached plan in {self.directory} (model, cluster and settings match)"

    def profile(self) -> Dict[str, Any]:
        """The cached profile (JSON data), what a restart re-plans the surviving devices with."""
        return json.loads((self.directory / "profile.json").read_text())

    def store(self, key: Dict[str, Any], plan: Plan, profile: Any, cluster: Any) -> None:
        """Write the cache (each file whole: a temporary name, then a rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        texts = {"key.json": json.dumps(key, indent=1, sort_keys=True), "plan.json": plan.to_json(),
                 "profile.json": json.dumps(profile.to_dict(), indent=1), "cluster.json": json.dumps(cluster.to_dict(),
                                                                                                      indent=1)}
        for name in ("profile.json", "cluster.json", "plan.json", "key.json"):      # the key last: it validates
            tmp = self.directory / f".{name}.tmp"
            tmp.write_text(texts[name] + "\n")
            tmp.replace(self.directory / name)
