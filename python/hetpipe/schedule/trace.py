"""Timelines: events of a simulated or real run, exported as Chrome trace JSON (Perfetto, chrome://tracing).

The simulator and the runtime write the same format: one process per virtual worker, one thread row
per stage (PS shards as extra rows), one complete event ("ph": "X") per executed instruction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Union


# ``TraceEvent.vw`` of a parameter-server row; ``stage`` is then the shard index.
PS_VW = -1


@dataclass(frozen=True)
class TraceEvent:
    """One timed activity. ``kind`` is the instruction code (F, B, R, A, SA, RA, SG, RG, PUSH, PULL; a
    run's stages also ST, RT, SN, RN, EVAL, SV, RV, DONE) or ``WAIT`` for time spent blocked on the WSP
    staleness bound; ``mb`` is -1 when not per-minibatch.
    With ``vw == PS_VW`` the event is a parameter-server shard's (``stage`` = shard index): ``PUSH``
    for a push received (and the waves it let the shard apply), ``PULL`` for a pull served."""

    vw: int
    stage: int
    kind: str
    start_s: float
    dur_s: float
    mb: int = -1
    wave: int = -1
    label: Optional[str] = None

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.mb >= 0:
            return f"{self.kind}{self.mb}"
        return f"{self.kind}{self.wave}" if self.wave >= 0 else self.kind


def chrome_trace(events: Iterable[TraceEvent], *, emulated: Optional[bool] = None) -> dict:
    """The Chrome trace JSON object for ``events`` (times in microseconds). VW ``v`` is process ``v``;
    the parameter-server shards are one process after the last VW, one row per shard."""
    events = list(events)
    out: List[dict] = []
    seen = set()
    ps_pid = 1 + max((e.vw for e in events), default=-1)
    for e in events:
        pid = ps_pid if e.vw == PS_VW else e.vw
        if (e.vw, e.stage) not in seen:
            seen.add((e.vw, e.stage))
            ps = e.vw == PS_VW
            out.append({"ph": "M", "name": "process_name", "pid": pid,
                        "args": {"name": "PS shards" if ps else f"VW {e.vw}"}})
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": e.stage,
                        "args": {"name": f"shard {e.stage}" if ps else f"stage {e.stage}"}})
        args = {"kind": e.kind}
        if e.mb >= 0:
            args["mb"] = e.mb
        if e.wave >= 0:
            args["wave"] = e.wave
        out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": e.stage,
                    "ts": e.start_s * 1e6, "dur": e.dur_s * 1e6, "args": args})
    meta = {} if emulated is None else {"emulated_devices": emulated}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}


def write_chrome_trace(events: Iterable[TraceEvent], path: Union[str, Path], *,
                       emulated: Optional[bool] = None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(events, emulated=emulated)))


# The categories of a stage's time in a run's trace (time_breakdown), by instruction code.
_COMPUTE = ("F", "B", "R", "A", "EVAL")
_RECEIVE = ("RA", "RG", "RT", "RN", "RV")
_SEND = ("SA", "SG", "ST", "SN", "SV")
BREAKDOWN = ("startup", "compute", "blocked_recv", "recv", "blocked_pull", "pull", "push", "send", "sync", "other")


def time_breakdown(events: Iterable[TraceEvent], vw: int, stage: int) -> dict:
    """Where VW ``vw``'s stage ``stage`` spent its wall time, in seconds, from a run's trace (host clock).

    The runtime times each instruction from the attempt that could run it to its end; the gap before
    it (since the previous one ended) is the time the stage spent blocked on it, stepping the
    transport and backing off. So: ``compute`` (F, B, R, A, EVAL), ``blocked_recv`` (gaps before the
    receives: waiting for a peer's message) and ``recv`` (the receives themselves: the copy onto the
    device enqueued, or done inline), ``blocked_pull`` (the gap before each Pull: the reply, or the
    staleness bound) and ``pull`` (the merge), ``push`` and ``send`` (with their gaps: waiting for a
    free pinned slot), ``sync`` (DONE and the gap before it: the stage's copies and queued sends
    draining), ``startup`` (before the first instruction: building the stage), ``other``. They sum to
    ``total``, the end of the stage's last instruction. On a GPU the host's clock sees the device only
    where it waits for it (a loss read, a gradient norm, a copy's event): device time the host did
    not wait for shows up in the next blocking category, not in ``compute``."""
    mine = sorted((e for e in events if e.vw == vw and e.stage == stage), key=lambda e: e.start_s)
    out = {k: 0.0 for k in BREAKDOWN}
    end = None
    for e in mine:
        gap = max(0.0, e.start_s - end) if end is not None else max(0.0, e.start_s)
        if end is None:
            out["startup"] += gap
            gap = 0.0
        # An instruction timed from an attempt that began before the previous one ended overlaps it
        # (the clocks of two threads, or an attempt's start taken early): only the part past ``end``
        # is its own, so that every instant of the stage's wall time is counted once.
        own = e.dur_s if end is None else max(0.0, e.start_s + e.dur_s - max(e.start_s, end))
        if e.kind in _COMPUTE:
            out["compute"] += own
            out["other"] += gap
        elif e.kind in _RECEIVE:
            out["blocked_recv"] += gap
            out["recv"] += own
        elif e.kind == "PULL":
            out["blocked_pull"] += gap
            out["pull"] += own
        elif e.kind == "PUSH":
            out["push"] += gap + own
        elif e.kind in _SEND:
            out["send"] += gap + own
        elif e.kind == "DONE":
            out["sync"] += gap + own
        else:
            out["other"] += gap + own
        end = max(end or 0.0, e.start_s + e.dur_s)
    out["total"] = end or 0.0
    return out
