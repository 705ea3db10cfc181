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
    nm = f"Nm={plan.nm}" if plan.equal_waves else f"Nm per VW {list(plan.wave_minibatches)}"
    head = (f"plan: policy {plan.policy}, {len(plan.virtual_workers)} VWs, {nm}, D={plan.d}, "
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
    if meta.get("not_used"):
        lines.append(f"not used: {meta['not_used']['text']} (the plan reaches its target sooner without them)")
    if meta.get("time_to_accuracy"):
        lines.append(format_candidates(plan))
    return "\n".join(lines)


def format_candidates(plan: Plan) -> str:
    """The candidates of a time-to-accuracy plan (``meta["time_to_accuracy"]``) as a table: devices left
    out, VWs, Nm (each VW's, ``a/b/c``, where waves by speed make them differ), predicted samples/s, batch per
    update, efficiency, the sample cost of the plan's staleness and averaging (when priced), goodput and time
    to the target relative to the chosen one, which is marked; skipped candidates with their reason below it."""
    tta = plan.meta["time_to_accuracy"]
    costs = tta.get("staleness_costs") or {}
    priced = any(v > 0 for v in costs.values())
    head = (f"time to accuracy: noise scale {tta['noise_scale']:g} samples, base batch {tta['base_batch']:g}, "
            f"batch per update = VWs x minibatch ({tta['minibatch_size']})")
    if priced:
        head += (f"; staleness costs: pipeline {costs['pipeline']:g}, averaging {costs['averaging']:g}, "
                 f"wsp {costs['wsp']:g}")
    cols = ("", "#", "layout", "without", "VWs", "Nm", "samples/s", "batch/update", "efficiency")
    cols += ("sample cost",) * priced + ("goodput", "time to target")
    rows, skipped = [], []
    for r in tta["candidates"]:
        if "goodput" not in r:
            skipped.append(f"  #{r['index']} {r['layout']} without {r['without_text']}: skipped: {r['skipped']}")
            continue
        mark = "*" if r["index"] == tta["chosen"] else ""
        nm = str(r["nm"]) if len(set(r.get("waves", ()))) < 2 else "/".join(str(n) for n in r["waves"])
        cells = (mark, str(r["index"]), r["layout"], r["without_text"], r["vws_text"], nm,
                 f"{r['samples_per_s']:.1f}", str(r["batch_per_update"]), f"{r['efficiency']:.3f}")
        cells += (f"{r['sample_cost']:.2f}x",) * priced + (f"{r['goodput']:.1f}", f"{r['relative_time']:.2f}x")
        rows.append(cells)
    width = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]
    right = set(range(5, len(cols)))
    fmt = [lambda c, w, i=i: c.rjust(w) if i in right else c.ljust(w) for i in range(len(cols))]
    lines = [head, "  ".join(f(c, w) for f, c, w in zip(fmt, cols, width)).rstrip(), "  ".join("-" * w for w in width)]
    lines += ["  ".join(f(c, w) for f, c, w in zip(fmt, r, width)).rstrip() for r in rows]
    chosen = tta["candidates"][tta["chosen"]]
    fastest = tta["candidates"][tta["fastest"]]
    what = "samples/s x efficiency / sample cost" if priced else "samples/s x efficiency"
    lines.append(f"* chosen: #{chosen['index']} ({chosen['layout']}), the largest goodput ({what})")
    if fastest["index"] != chosen["index"]:
        lines.append(f"  the fastest, #{fastest['index']} ({fastest['layout']}, {fastest['samples_per_s']:.1f} "
                     f"samples/s), is predicted to take {fastest['relative_time']:.2f}x as long")
    schedule = tta.get("schedule", [])
    if len(schedule) > 1:
        steps = [f"#{seg['candidate']} up to {seg['to']:.3g}" for seg in schedule[:-1]]
        lines.append(f"  as the noise scale grows from {schedule[0]['from']:g} samples (it does along training): "
                     f"{', '.join(steps)}, #{schedule[-1]['candidate']} beyond; a run switches by resuming its "
                     f"checkpoint into the next plan")
        if not priced:
            # Measured (docs/clusters.md): wider plans cost samples the model does not count, so a switch
            # the model predicts may not pay at all.
            lines.append("  the switch points are early: the model counts neither the averaging of separate VWs "
                         "nor a pipeline's own staleness (--staleness-costs fitted prices both)")
    lines += skipped
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
