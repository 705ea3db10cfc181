"""Formats the benchmark's results: one row per system, then per-rank emulation figures."""

from __future__ import annotations

from typing import Dict, List, Optional


def _ratio(a: Optional[float], b: Optional[float], pct: bool = False) -> str:
    if not a or not b:
        return "-"
    return f"{100 * a / b:.0f}%" if pct else f"{a / b:.2f}x"


def main_table(rows: List[Dict], header: str) -> str:
    """``rows``: dicts with system, measured (samples/s or None), predicted, note, error (if it failed)."""
    by = {r["key"]: r.get("measured") for r in rows}
    limit, ddp, pp = by.get("limit"), by.get("ddp"), by.get("pipelining")
    cols = ["system", "samples/s", "% of limit", "vs DDP", "vs pipelining", "predicted", "pred. err", "setup"]
    body = []
    for r in rows:
        m, p = r.get("measured"), r.get("predicted")
        err = f"{100 * (p - m) / m:+.1f}%" if m and p else "-"
        body.append([r["system"], f"{m:.1f}" if m else "FAILED", _ratio(m, limit, pct=True), _ratio(m, ddp),
                     _ratio(m, pp), f"{p:.1f}" if p else "-", err, r.get("error") or r.get("note", "")])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
    fmt = lambda row: " | ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
    lines = [header, fmt(cols), "-+-".join("-" * w for w in widths)] + [fmt(b) for b in body]
    return "\n".join(lines)


def rank_table(results: Dict[str, dict]) -> str:
    """Per system and rank: device, type, padding fraction of wall time, overrun seconds."""
    lines = ["per rank: padding = share of the timed wall time spent sleeping to the device's time; "
             "overrun = seconds real work exceeded its emulated time (0 means the device model, not the host, set the pace)"]
    for name, res in results.items():
        if "per_type" in res:
            cells = [f"{t}: pad {100 * v['pad_frac']:.0f}% overrun {v['overrun_s']:.3f}s" for t, v in res["per_type"].items()]
            lines.append(f"  {name:<18} " + "; ".join(cells))
        for r in res.get("ranks", []):
            lines.append(f"  {name:<18} rank {r['rank']} {r['device']:<6} {r['type']:<10} "
                         f"pad {100 * r['pad_frac']:5.1f}%  overrun {r['overrun_s']:.3f}s")
    return "\n".join(lines)
