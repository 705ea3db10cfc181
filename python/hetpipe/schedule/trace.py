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
