"""The step × stage grid: a schedule's lock-step run printed as a table, one row per step."""

from __future__ import annotations

from typing import List, Optional

from hetpipe.schedule.ir import Schedule
from hetpipe.schedule.lockstep import Lockstep, BufferCaps, lockstep


def format_lockstep(rep: Lockstep, last: Optional[int] = None) -> str:
    """Rows ``step | stage 0 | stage 1 ...`` with the instruction each stage ran (``.`` for none).

    ``last`` keeps only the final ``last`` steps. A run that deadlocked ends with a ``stuck`` row
    naming, for each unfinished stage, the instruction it waits on (finished stages show ``done``).
    """
    k = rep.schedule.num_stages
    width = max([7] + [len(str(i)) + 1 for row in rep.steps for i in row if i is not None]
                + [len(str(i)) + 2 for i in rep.stuck.values()])
    head = "step  | " + " ".join(f"{'stage ' + str(s):<{width}}" for s in range(k))
    lines: List[str] = [head, "-" * len(head)]
    first = 0 if last is None else max(0, len(rep.steps) - last)
    if first:
        lines.append(f"... {first} earlier steps")
    for t in range(first, len(rep.steps)):
        cells = [str(i) if i is not None else "." for i in rep.steps[t]]
        lines.append(f"{t:<5} | " + " ".join(f"{c:<{width}}" for c in cells))
    if rep.stuck:
        cells = [f"*{rep.stuck[s]}" if s in rep.stuck else "done" for s in range(k)]
        lines.append("stuck | " + " ".join(f"{c:<{width}}" for c in cells))
    return "\n".join(line.rstrip() for line in lines)


def format_grid(schedule: Schedule, buffers: BufferCaps = None, last: Optional[int] = None) -> str:
    """The step × stage grid of ``schedule``'s lock-step run (see :func:`format_lockstep`)."""
    return format_lockstep(lockstep(schedule, buffers), last)
