"""Rank side: each rank sits on the host its launcher placed it on, and, in a world of several hosts,
on the node the plan puts its part on. Checked at start-up from the allgathered hosts, on every rank
alike, so that a misplaced rank is one error naming it before anything starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, List, Optional, Sequence

PLACEMENT_ENV = "HETPIPE_PLACEMENT"          # the launcher's placement.json: the host of each world rank


def launcher_placement() -> Optional[List[str]]:
    """The host of each world rank as the launcher placed them, None without a placement."""
    path = os.environ.get(PLACEMENT_ENV)
    if not path:
        return None
    return [str(h) for h in json.loads(Path(path).read_text())["hosts"]]


def placement_problems(hosts: Sequence[str], expected: Optional[Sequence[str]]) -> List[str]:
    """One line per world rank that is not on the host the launcher placed it on."""
    if expected is None:
        return []
    if len(expected) != len(hosts):
        return [f"the launcher placed {len(expected)} ranks but {len(hosts)} were started"]
    return [f"rank {r} runs on host {h} but the launcher placed it on {e}" for r, (h, e) in
            enumerate(zip(hosts, expected)) if h != e]


def node_of(plan, rank: int) -> Optional[str]:
    """The node the plan puts rank ``rank``'s part on; None for a stage on a bare ``cpu``/``cuda:i``."""
    kind, a, b = plan.role_of(rank)
    if kind == "ps":
        return plan.ps_shards[a].node
    device = plan.virtual_workers[a].stages[b].device
    return device.rsplit(".g", 1)[0] if ".g" in device else None


def plan_problems(plan, hosts: Sequence[str], describe: Callable[[int], str]) -> List[str]:
    """In a world of several hosts, one line per rank (by plan rank) not on its part's node."""
    if len(set(hosts)) < 2:
        return []           # one host: the plan's nodes are emulated on it
    out = []
    for r, host in enumerate(hosts):
        node = node_of(plan, r)
        if node is not None and node != host:
            out.append(f"{describe(r)} runs on host {host} but the plan puts it on node {node}")
    return out
