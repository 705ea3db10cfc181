"""Tables and the figure of the convergence benchmark: the sweep, the per-system summary, the goal lines.

Input: run records (dicts with key, label, seed, lr, curve, end_s, samples, overrun) as run.py
keeps them. Times are seconds of training wall time on emulated devices.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from curves import best_within, loss_at, on_grid, time_to_target


def fmt(x: Optional[float], spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(cols: Sequence[str], body: List[List[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *body)]
    line = lambda row: " | ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), "-+-".join("-" * w for w in widths)] + [line(b) for b in body])


def sweep_table(runs: List[dict], best: Dict[str, float], budget: float) -> str:
    """One row per system: validation loss at the budget for each learning rate of the sweep (seed 0)."""
    lrs = sorted({r["lr"] for r in runs})
    labels = list(dict.fromkeys(r["label"] for r in runs))
    body = []
    for label in labels:
        row = [label]
        for lr in lrs:
            rs = [r for r in runs if r["label"] == label and r["lr"] == lr]
            cell = fmt(loss_at(rs[0]["curve"], budget), ".3f") if rs else "-"
            if rs and best.get(rs[0]["key"]) == lr:
                cell += " *"
            row.append(cell)
        body.append(row)
    return table(["system"] + [f"lr {lr:.3g}" for lr in lrs], body)


def summarize(runs: List[dict], target: float, budget: float) -> List[dict]:
    """Per system (runs at its best learning rate, every seed): times to target, losses at the budget."""
    out = []
    for key in dict.fromkeys(r["key"] for r in runs):
        rs = [r for r in runs if r["key"] == key]
        ttt = [time_to_target(r["curve"], target) for r in rs]
        fin = [loss_at(r["curve"], budget) for r in rs]
        reached = [t for t in ttt if t is not None]
        out.append({"key": key, "label": rs[0]["label"], "lr": rs[0]["lr"], "seeds": [r["seed"] for r in rs],
                    "time_to_target": ttt, "ttt_mean": float(np.mean(reached)) if len(reached) == len(rs) else None,
                    "ttt_sd": float(np.std(reached, ddof=1)) if len(reached) == len(rs) > 1 else None,
                    "loss_at_budget": fin, "loss_mean": float(np.mean(fin)),
                    "loss_sd": float(np.std(fin, ddof=1)) if len(fin) > 1 else 0.0,
                    "samples_per_s": float(np.mean([r["samples"] / r["end_s"] for r in rs])),
                    "short": [r["seed"] for r in rs if r["end_s"] < budget],
                    "overrun": float(np.max([r["overrun_frac"] for r in rs]))})
    return out


def summary_table(rows: List[dict], budget: float) -> str:
    ddp = next((r for r in rows if r["key"] == "ddp"), None)
    body = []
    for r in rows:
        per_seed = ", ".join(fmt(t) for t in r["time_to_target"])
        speed = (f"{ddp['ttt_mean'] / r['ttt_mean']:.2f}x" if ddp and ddp["ttt_mean"] and r["ttt_mean"] else "-")
        dloss = f"{100 * (r['loss_mean'] / ddp['loss_mean'] - 1):+.2f}%" if ddp else "-"
        note = f"ended before {budget:g} s (seeds {r['short']})" if r["short"] else ""
        body.append([r["label"], f"{r['lr']:.3g}", f"{fmt(r['ttt_mean'])} ± {fmt(r['ttt_sd'])}", per_seed, speed,
                     f"{r['loss_mean']:.3f} ± {r['loss_sd']:.3f}", dloss, f"{r['samples_per_s']:.0f}",
                     f"{100 * r['overrun']:.1f}%", note])
    return table(["system", "lr", "time to target s (mean ± sd)", "per seed", "speed-up vs DDP",
                   f"val loss at {budget:g} s", "vs DDP", "samples/s", "overrun", ""], body)


def goal_lines(rows: List[dict], speedup: float = 1.5, loss_tol: float = 0.01) -> List[str]:
    """Per hetpipe row: is it >= ``speedup`` x faster to target than the best baseline, and within
    ``loss_tol`` of that baseline's loss at the budget? The best baseline is the row of another system
    with the shortest mean time to target (ties: the lower loss)."""
    base = [r for r in rows if not r["key"].startswith("hetpipe") and r["ttt_mean"]]
    if not base:
        return ["goal: no baseline reached the target in this run"]
    best = min(base, key=lambda r: (r["ttt_mean"], r["loss_mean"]))
    out = [f"best baseline: {best['label']} ({best['ttt_mean']:.1f} s to target, val loss {best['loss_mean']:.3f} "
           "at the budget)"]
    for r in rows:
        if not r["key"].startswith("hetpipe"):
            continue
        s = best["ttt_mean"] / r["ttt_mean"] if r["ttt_mean"] else None
        rel = r["loss_mean"] / best["loss_mean"] - 1
        ok_s = s is not None and s >= speedup
        ok_l = rel <= loss_tol
        out.append(f"goal {r['label']}: speed-up {fmt(s, '.2f')}x vs the best baseline ({'met' if ok_s else 'NOT met'}, "
                   f"needs >= {speedup}x); val loss at budget {100 * rel:+.2f}% vs it ({'met' if ok_l else 'NOT met'}, "
                   f"needs <= +{100 * loss_tol:.0f}%)")
    return out


def choose_target(runs: List[dict], budget: float, step: float = 0.01) -> float:
    """The lowest loss (rounded up to ``step``) that every given run reaches within the budget."""
    worst = max(best_within(r["curve"], budget) for r in runs)
    return math.ceil(worst / step - 1e-9) * step


def plot(runs: List[dict], target: float, budget: float, path, title: str) -> None:
    """Validation loss against wall time: per system the mean over seeds (line) and their range (band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, budget, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in dict.fromkeys(r["key"] for r in runs):
        rs = [r for r in runs if r["key"] == key]
        ys = np.array([on_grid(r["curve"], grid) for r in rs])
        style = "-" if key.startswith("hetpipe") else "--"
        line, = ax.plot(grid, np.nanmean(ys, axis=0), style, label=f"{rs[0]['label']} (lr {rs[0]['lr']:.3g}, "
                                                                  f"{len(rs)} seeds)")
        ax.fill_between(grid, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=line.get_color(), alpha=0.15)
    ax.axhline(target, color="grey", lw=0.8, ls=":", label=f"target {target:.2f}")
    lo = min(np.nanmin(on_grid(r["curve"], grid)) for r in runs)
    ax.set_ylim(lo - 0.05, max(target + 1.0, lo + 1.0))
    ax.set_xlabel("training wall-clock time, s (emulated devices)")
    ax.set_ylabel("validation loss, nats/byte")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
