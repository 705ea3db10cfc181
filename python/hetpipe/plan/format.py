"""format_plan: a plan as a readable table (VWs, stages, layer ranges, memory, predicted times)."""

from __future__ import annotations

from typing import List

from hetpipe.plan.outer import describe_outer, is_plain
from hetpipe.plan.recompute import runs
from hetpipe.plan.types import Plan


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def format_plan(plan: Plan, cluster=None) -> str:
    """The plan as text. With ``cluster`` (a ClusterSpec) each device's node is shown too."""
    nodes = {d.id: d.node for d in cluster.devices} if cluster is not None else {}
    meta = plan.meta or {}
    head = (f"plan: policy {plan.policy}, {len(plan.virtual_workers)} VWs, Nm={plan.nm}, D={plan.d}, "
            f"{plan.num_layers} layers, minibatch {plan.minibatch_size}, aggregate {plan.aggregate}, "
            f"precision {plan.precision}")
    if not is_plain(plan.outer_options):
        head += f", outer {describe_outer(plan.outer_options)}"
    if meta.get("cluster"):
        head += f"; cluster {meta['cluster']}, profile {meta.get('profile', '?')}"
    lines: List[str] = [head]
    cols = ("vw", "stage", "device", "type", "layers", "fwd", "bwd", "send", "stage time", "memory used / available",
            "recompute")
    rows = []
    for vw in plan.virtual_workers:
        for k, st in enumerate(vw.stages):
            dev = st.device + (f"@{nodes[st.device]}" if st.device in nodes else "")
            names = ""
            if plan.layer_names:
                names = f" {plan.layer_names[st.start]}..{plan.layer_names[st.stop - 1]}"
            pct = f" ({100 * st.memory_bytes / st.memory_capacity:.0f}%)" if st.memory_capacity else ""
            rows.append((str(vw.index), str(k), dev, st.device_type, f"[{st.start}, {st.stop}){names}",
                         _seconds(st.fwd_time), _seconds(st.bwd_time), _seconds(st.send_time),
                         _seconds(st.fwd_time + st.bwd_time + st.send_time),
                         f"{_bytes(st.memory_bytes)} / {_bytes(st.memory_capacity)}{pct}",
                         _recompute_cell(st)))
    width = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, width)).rstrip())
    lines.append("  ".join("-" * w for w in width))
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip())
    for vw in plan.virtual_workers:
        lines.append(f"VW {vw.index}: {' -> '.join(vw.devices)}; alone {vw.throughput:.3f} minibatches/s")
    for v, how in enumerate(meta.get("search", ())):
        if how != "exact":
            lines.append(f"VW {v} partition: {how}")
    for out in meta.get("left_out", ()):
        lines.append(f"left out {', '.join(out['devices'])}: {out['reason']}")
    for sh in plan.ps_shards:
        lines.append(f"PS shard {sh.index} on {sh.node}: {len(sh.layers)} layers, {_bytes(sh.param_bytes)}")
    lines.append(f"predicted throughput: {plan.throughput:.3f} minibatches/s"
                 + (f" = {plan.throughput * plan.minibatch_size:.1f} samples/s" if plan.minibatch_size else "")
                 + (" (devices emulated)" if meta.get("emulated") else " (devices modelled, not measured)"))
    if isinstance(meta.get("policies"), dict) and len(meta["policies"]) > 1:
        parts = [f"{p}: {v:.3f}" if isinstance(v, float) else f"{p}: {v}" for p, v in meta["policies"].items()]
        lines.append("policies: " + ", ".join(parts))
    return "\n".join(lines)


def _recompute_cell(st) -> str:
    """Which layers a stage recomputes: "all", or "k of n: [a, b) c ..." (runs of layers)."""
    chosen = sorted(st.recompute)
    if not chosen:
        return ""
    if len(chosen) == st.stop - st.start:
        return "all"
    cells = [str(r[0]) if len(r) == 1 else f"[{r[0]}, {r[-1] + 1})" for r in runs(chosen)]
    return f"{len(chosen)} of {st.stop - st.start}: " + " ".join(cells)
