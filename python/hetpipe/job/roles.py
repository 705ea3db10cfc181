"""Role assignment: which part of a plan an MPI rank runs, on which torch device, emulated or not."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from hetpipe.plan.types import Plan, StagePlan
from hetpipe.util.errors import HetpipeError


class LaunchError(HetpipeError, RuntimeError):
    """The world does not fit the plan (rank count, devices)."""


@dataclass(frozen=True)
class Role:
    """``kind`` is "stage" (``vw``, ``stage`` set) or "ps" (``shard`` set)."""

    rank: int
    kind: str
    vw: int = -1
    stage: int = -1
    shard: int = -1
    world: int = -1         # the MPI world rank running it, when not ``rank`` (a discovered world)
    host: str = ""          # where it runs, in a world of several hosts

    def describe(self) -> str:
        who = self.rank if self.world < 0 else self.world
        where = f" on {self.host}" if self.host else ""
        if self.kind == "stage":
            return f"rank {who} (vw {self.vw} stage {self.stage}{where})"
        return f"rank {who} (ps shard {self.shard}{where})"


def role_of(plan: Plan, rank: int, world: int = -1, host: str = "") -> Role:
    """The part of ``plan`` its rank ``rank`` runs; ``world``: the MPI world rank running it, when the
    ranks were put in plan order (:mod:`hetpipe.run.world_plan`); ``host``: where, to name it by."""
    kind, a, b = plan.role_of(rank)
    w = -1 if world == rank else world
    if kind == "stage":
        return Role(rank, "stage", vw=a, stage=b, world=w, host=host)
    return Role(rank, "ps", shard=a, world=w, host=host)


def check_world(plan: Plan, size: int) -> None:
    if size != plan.num_ranks:
        raise LaunchError(
            f"hetpipe: the plan needs {plan.num_ranks} ranks ({plan.num_stage_ranks} stages in "
            f"{len(plan.virtual_workers)} virtual workers + {len(plan.ps_shards)} PS shards) "
            f"but {size} were started; run mpiexec -n {plan.num_ranks}")


_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def resolve_device(stage: StagePlan, *, emulate: Optional[bool], cuda_count: int):
    """The torch device for a stage and whether it is emulated (padded to its profile's times).

    ``cpu`` and ``cuda[:i]`` name real devices: a missing CUDA device is a :class:`LaunchError`.
    Any other id is a cluster-spec device (e.g. ``n0.g1``): it is emulated on the CPU when
    ``emulate`` is true, or when ``emulate`` is None and this host has no GPU; otherwise it runs on
    ``cuda:<g>`` of this host.
    """
    import torch

    dev = stage.device
    m = _CUDA.match(dev)
    if dev == "cpu":
        return torch.device("cpu"), bool(emulate)
    if m:
        idx = int(m.group(1) or 0)
        if idx >= cuda_count:
            have = f"{cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
            raise LaunchError(f"hetpipe: the plan asks for {dev} but this host has {have}")
        return torch.device("cuda", idx), bool(emulate)
    if emulate or (emulate is None and cuda_count == 0):
        return torch.device("cpu"), True
    g = re.search(r"g(\d+)$", dev)
    idx = int(g.group(1)) if g else 0
    if idx >= cuda_count:
        raise LaunchError(f"hetpipe: device {dev} maps to cuda:{idx} but this host has {cuda_count} CUDA device(s)")
    return torch.device("cuda", idx), False
