"""Gantt chart of a simulated timeline as a PNG: one row per (VW, stage), one colour per minibatch.

Forward bars are solid, backward bars hatched, Apply thin; WSP waits are red and Pulls black, so
time lost to the staleness bound is visible. matplotlib is optional: only :func:`save_gantt` needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Union

from hetpipe.schedule.trace import PS_VW, TraceEvent


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("save_gantt needs matplotlib, which is not installed "
                           "(pip install matplotlib); the Chrome trace export works without it") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_gantt(result_or_events: Union["object", Iterable[TraceEvent]], path: Union[str, Path], *,
               max_rows: int = 64, title: Optional[str] = None) -> None:
    """Write a PNG Gantt chart of a :class:`~hetpipe.schedule.simulate.SimResult` (or of a list of
    :class:`TraceEvent`) to ``path``. Shows at most ``max_rows`` (VW, stage) rows, the first ones.
    Raises RuntimeError if matplotlib is missing."""
    plt = _pyplot()
    events = getattr(result_or_events, "timeline", result_or_events)
    rows = sorted({(e.vw, e.stage) for e in events}, key=lambda r: (r[0] == PS_VW, r))[:max_rows]
    row_of = {r: i for i, r in enumerate(rows)}
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(14, 0.35 * len(rows) + 1.5))
    for e in events:
        y = row_of.get((e.vw, e.stage))
        if y is None:
            continue
        if e.kind == "WAIT":
            ax.barh(y, e.dur_s, left=e.start_s, height=0.8, color="red", alpha=0.6)
        elif e.kind == "PULL" or e.vw == PS_VW:
            ax.barh(y, e.dur_s, left=e.start_s, height=0.8, color="black")
        else:
            colour = cmap(e.mb % 20)
            height = 0.3 if e.kind == "A" else 0.8
            ax.barh(y, e.dur_s, left=e.start_s, height=height, color=colour, edgecolor="black", linewidth=0.3,
                    hatch="//" if e.kind in ("B", "R") else None)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"PS shard {s}" if v == PS_VW else f"VW {v} stage {s}" for v, s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or "schedule timeline (solid: forward, hatched: backward, red: WSP wait, black: pull, PS busy)")
    fig.tight_layout()
    try:
        fig.savefig(str(path), dpi=100)
    finally:
        plt.close(fig)
