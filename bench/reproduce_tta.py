"""Modelled time to accuracy on HetPipe's testbed: measured statistical efficiency over simulated throughput.

``modelled TTA = samples to target / samples per second``. The throughput of each system is modelled
on the ``hetpipe-testbed`` preset (every device modelled, nothing run): hetpipe's from
:func:`reproduce.run` (the simulator with the PS modelled), best policy and Nm per D; a
Horovod-style baseline's from the same profiles by :func:`horovod`. The samples to target are not
modelled: they are read from a convergence run of bench/convergence (its JSON), per system the mean
over seeds of ``time to target x that run's samples/s``. That run trains a byte-level GPT on
emulated devices (6 devices, 3 VWs), not ResNet-152 or VGG-19 on the testbed's 16 GPUs: the TTA here
transplants its statistical efficiency onto the testbed's throughput, and is no measurement of either.

Horovod-style baseline (what is assumed): synchronous data parallelism, one minibatch of the
profile's size per GPU per step, on every GPU whose memory holds the whole model (weights, gradients,
optimizer state, the activations of one minibatch, the largest layer workspace); a step is the
slowest such GPU's forward and backward of the whole model, then a ring all-reduce of the gradients
(``2 (N - 1) / N`` times the parameter bytes over the ring's slowest link, the inter-node one when
the GPUs span nodes, plus ``2 (N - 1)`` link latencies), not overlapped with the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

from hetpipe.plan.cluster import ClusterSpec, Link
from hetpipe.plan.profile import ModelProfile

if TYPE_CHECKING:     # annotations only: reproduce.py, run as a script, imports this module and must not load twice
    from reproduce import Point

# What HetPipe's paper reports on its convergence, as found in its published abstract (USENIX ATC'20).
PAPER = ("HetPipe paper (abstract, USENIX ATC'20): 'DNN models converge up to 49% faster compared to the "
         "state-of-the-art DP technique'; its per-model time-to-accuracy figures (ResNet-152, VGG-19 against "
         "Horovod) were not found in the sources searched and are not shown")


@dataclass(frozen=True)
class Horovod:
    """The Horovod-style baseline on one model: the GPUs it uses, those left out (memory), and its step."""

    model: str
    gpus: Tuple[str, ...]
    left_out: Tuple[str, ...]
    compute_s: float          # slowest GPU's forward + backward of one minibatch
    allreduce_s: float
    minibatch: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.allreduce_s

    @property
    def samples_per_s(self) -> float:
        return len(self.gpus) * self.minibatch / self.step_s


def whole_model_bytes(profile: ModelProfile) -> int:
    """Bytes one GPU needs to train the whole model on one minibatch (see the module docstring)."""
    return (sum(2 * l.param_bytes + l.optimizer_bytes + l.stash for l in profile.layers)
            + max(l.workspace_bytes for l in profile.layers))


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` members whose slowest hop is ``link``."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def horovod(cluster: ClusterSpec, profile: ModelProfile) -> Horovod:
    """The Horovod-style baseline of ``profile`` on ``cluster`` (see the module docstring)."""
    need = whole_model_bytes(profile)
    fit = [d for d in cluster.devices if cluster.device_types[d.type].memory_bytes >= need]
    if not fit:
        raise ValueError(f"{profile.name}: no GPU of {cluster.name} holds the whole model ({need / 2**30:.1f} GiB)")
    compute = max(sum(profile.fwd(d.type)) + sum(profile.bwd(d.type)) for d in fit)
    link = cluster.intra_node if len({d.node for d in fit}) == 1 else cluster.inter_node
    params = sum(l.param_bytes for l in profile.layers)
    return Horovod(profile.name, tuple(d.id for d in fit), tuple(d.id for d in cluster.devices if d not in fit),
                   compute, ring_allreduce_s(params, len(fit), link), profile.minibatch_size)


def tta_s(samples: float, samples_per_s: float) -> float:
    """Modelled time to accuracy: samples to target over samples per second."""
    if samples_per_s <= 0:
        raise ValueError(f"throughput must be > 0, got {samples_per_s}")
    return samples / samples_per_s


def samples_to_target(conv: Mapping, key: str) -> Optional[Tuple[float, List[float]]]:
    """``(mean, per seed)`` samples a system of a bench/convergence JSON took to its target: per seed
    its time to target times that run's samples/s (samples over training end), at the system's best
    learning rate and the final budget. None if the system is absent or missed the target on a seed."""
    row = next((r for r in conv.get("summary", ()) if r["key"] == key), None)
    if row is None or any(t is None for t in row["time_to_target"]):
        return None
    budget = conv.get("budgets", {}).get("final_s")
    per = []
    for seed, t in zip(row["seeds"], row["time_to_target"]):
        run = next(r for r in conv["runs"] if r["key"] == key and r["seed"] == seed and r["lr"] == row["lr"]
                   and (budget is None or r.get("budget_s", budget) == budget))
        per.append(t * run["samples"] / run["end_s"])
    return sum(per) / len(per), per


@dataclass(frozen=True)
class Row:
    model: str
    system: str               # "Horovod" or "hetpipe"
    d: Optional[int]
    config: str               # hetpipe: policy and Nm; Horovod: GPUs used
    source: str               # which measured system's samples to target
    samples: Optional[float]
    samples_per_s: float

    @property
    def tta(self) -> Optional[float]:
        return None if self.samples is None else tta_s(self.samples, self.samples_per_s)


def best_points(points: Sequence[Point]) -> Dict[Tuple[str, int], Point]:
    """Per (model, D) the simulated point with the highest throughput over policies and Nm."""
    out: Dict[Tuple[str, int], Point] = {}
    for p in points:
        k = (p.model, p.d)
        if k not in out or p.throughput > out[k].throughput:
            out[k] = p
    return out


def rows(points: Sequence[Point], profiles: Mapping[str, ModelProfile], cluster: ClusterSpec, conv: Mapping,
         aggregate: str = "sum") -> List[Row]:
    """Per model: the Horovod-style row, then hetpipe's best (policy, Nm) per D; samples to target from
    ``conv`` (DDP's for Horovod, ``hetpipe-d{D}-{aggregate}``'s for hetpipe; None where not measured)."""
    best = best_points(points)
    out = []
    for model, prof in profiles.items():
        hv = horovod(cluster, prof)
        s = samples_to_target(conv, "ddp")
        out.append(Row(model, "Horovod", None, f"{len(hv.gpus)} GPUs", "ddp", s and s[0], hv.samples_per_s))
        for (m, d), p in sorted(best.items()):
            if m != model:
                continue
            key = f"hetpipe-d{d}-{aggregate}"
            s = samples_to_target(conv, key)
            out.append(Row(model, "hetpipe", d, f"{p.policy} Nm={p.nm}", key, s and s[0],
                           p.throughput * prof.minibatch_size))
    return out


def table(rs: Sequence[Row]) -> str:
    """model, system, D, samples to target (source), modelled throughput, modelled TTA, ratio vs Horovod."""
    head = (f"{'model':<10} {'system':<8} {'D':>2} {'config':<12} {'samples to target (source)':<34} "
            f"{'samples/s':>9} {'TTA s':>8} {'vs Horovod':>10}")
    lines = [head, "-" * len(head)]
    base = {r.model: r.tta for r in rs if r.system == "Horovod"}
    for r in rs:
        src = f"{r.samples:.0f} ({r.source})" if r.samples is not None else f"- ({r.source}: not measured)"
        tta = f"{r.tta:>8.3g}" if r.tta is not None else f"{'-':>8}"
        ratio = (f"{r.tta / base[r.model]:>10.2f}" if r.tta is not None and base.get(r.model) else f"{'-':>10}")
        d = "-" if r.d is None else str(r.d)
        lines.append(f"{r.model:<10} {r.system:<8} {d:>2} {r.config:<12} {src:<34} {r.samples_per_s:>9.1f} {tta} "
                     f"{ratio}")
    return "\n".join(lines)


def report(rs: Sequence[Row], hv: Sequence[Horovod], conv_name: str, conv: Mapping, aggregate: str) -> str:
    """The TTA table with what each figure is and where it comes from."""
    task = conv.get("task", {})
    lines = [
        "Modelled time to accuracy on hetpipe-testbed = samples to target / modelled samples/s (ratio vs Horovod: "
        "TTA / Horovod's TTA, lower is better)",
        f"samples to target: MEASURED in {conv_name} on an emulated byte-level GPT (width {task.get('width')}, "
        f"{task.get('blocks')} blocks; 6 emulated devices, hetpipe with 3 VWs, aggregation '{aggregate}'), target "
        f"{conv.get('target', float('nan')):.2f} nats/byte; NOT measured on ResNet-152 or VGG-19: the same samples "
        "are used for both models, only the throughput differs",
        "throughput: MODELLED; hetpipe: simulator with the PS modelled, best policy and Nm per D; Horovod: "
        "synchronous DP, step = slowest GPU's minibatch + ring all-reduce of the parameters (not overlapped)",
    ]
    for h in hv:
        lines.append(f"  Horovod {h.model}: {len(h.gpus)} GPUs" + (f" ({len(h.left_out)} left out, their memory "
                     f"cannot hold the whole model: {', '.join(h.left_out)})" if h.left_out else "")
                     + f"; step {h.compute_s * 1e3:.0f} ms compute + {h.allreduce_s * 1e3:.0f} ms all-reduce")
    lines += ["", table(rs), "", PAPER]
    return "\n".join(lines)
