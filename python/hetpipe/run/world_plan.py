"""Planning on the world's own devices: discover them (``cluster="auto"``) or match a given real cluster
onto the ranks, profile each device type on a rank that holds it, plan with the ranks that hold no
device as PS slots, and say which world rank runs each part of the plan.

A collective: every rank calls :func:`plan_on_world`. Every decision that can fail (discovery, the
match, the rank assignment) is computed from allgathered facts on every rank alike, so every rank
raises the same :class:`LaunchError` and none waits on another; what only rank 0 does (the plan cache,
the planner) is broadcast with its error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hetpipe.plan.cluster import ClusterSpec, load_cluster
from hetpipe.job.discovery import Discovery, DiscoveryError, assign_ranks, discover, match
from hetpipe.job.inventory import rank_facts
from hetpipe.job.roles import LaunchError
from hetpipe.job.rundir import RUN_DIR_ENV
from hetpipe.model.tree import batch_of
from hetpipe.plan.precision import speed_precision
from hetpipe.plan.types import Plan
from hetpipe.run.plan_cache import PlanCache, plan_key, planning_inputs
from hetpipe.run.profiling import ProfilingError, profile_on_devices

CLUSTER_FILE = "cluster.json"       # the discovered (or matched) cluster, in the run directory


def tf32_matmuls() -> bool:
    """Whether this process's float32 matmuls may use TF32 tensor cores (the script set
    ``torch.set_float32_matmul_precision("high")`` or ``"medium"``, or ``allow_tf32``): an fp32 run is
    then planned at the devices' TF32 peaks (:func:`hetpipe.plan.precision.speed_precision`)."""
    import torch

    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def on_world(cluster: Any, emulating: bool = False) -> bool:
    """Whether a Trainer's ``cluster`` is planned on the world's devices: ``"auto"``; a cluster whose
    devices are real (not emulated on this host), since each type must be measured where it is; or
    an emulated cluster when the ranks say which type each emulates (``emulating``: some rank sets
    ``HETPIPE_EMULATE``, known to all from the allgathered hosts, so every rank decides alike)."""
    if isinstance(cluster, str) and cluster == "auto":
        return True
    if cluster is None:
        return False
    return emulating or not load_cluster(cluster).emulated


def discovery_of(comm: Any, cluster: Any) -> Discovery:
    """The world's cluster and who holds what, the same on every rank (a collective)."""
    facts = comm.allgather(rank_facts(comm.Get_rank(), comm.Get_size()))
    try:
        if isinstance(cluster, str) and cluster == "auto":
            return discover(facts)
        return match(facts, load_cluster(cluster))
    except DiscoveryError as e:
        raise LaunchError(f"hetpipe: {e}") from None


def plan_on_world(work: Any, config: Any, comm: Any,
                  given: Optional[Plan]) -> Tuple[Plan, List[int], Discovery, Optional[Dict[str, Any]]]:
    """The plan every rank runs (``given``, else one made on the world's devices), the world rank of each
    plan rank, the discovery they came from, and the planning inputs of a plan made here (None for a
    given plan). ``work``: the run's :class:`~hetpipe.run.workload.Workload`; ``config``: its resolved
    :class:`~hetpipe.run.config.RunConfig`."""
    rank = comm.Get_rank()
    discovery = discovery_of(comm, config.planning.cluster)
    if rank == 0:
        sys.stderr.write(discovery.table() + "\n")
        _save_cluster(discovery.cluster, config.plan_cache)
    planning = None
    if given is not None:
        plan = given
    else:
        plan, planning = _planned(work, config, comm, discovery)
    try:
        order = assign_ranks(plan, discovery)
    except DiscoveryError as e:
        raise LaunchError(f"hetpipe: {e}") from None
    return plan, order, discovery, planning


def _planned(work: Any, config: Any, comm: Any, discovery: Discovery) -> Tuple[Plan, Dict[str, Any]]:
    from hetpipe.plan import make_plan
    from hetpipe.plan.profile import ModelProfile
    from hetpipe.run.pilot import planning_arguments

    rank = comm.Get_rank()
    cluster = discovery.cluster
    x, y = work.data.sample()
    p, cache_dir = config.planning, config.plan_cache
    precision = config.numerics.precision or "fp32"
    tf32 = tf32_matmuls()
    ps_nodes = [h.host for h in discovery.ps_slots()] or None
    key = plan_key(work.layers, (x, y), cluster, speed_precision(precision, tf32), p, ps_nodes=ps_nodes)
    cached = None
    if rank == 0 and cache_dir is not None:
        plan, why = PlanCache(cache_dir).lookup(key)
        sys.stderr.write(f"hetpipe: plan cache: {why}\n")
        if plan is not None:
            cached = (plan.to_json(), PlanCache(cache_dir).profile())
    cached = comm.bcast(cached, root=0)
    if cached is not None:
        plan_text, profile_data = cached
    else:
        try:
            profile = profile_on_devices(comm, work.sequence, (x, y), work.loss_fn, discovery, precision)
        except ProfilingError as e:
            raise LaunchError(str(e)) from None
        plan_text, error = None, None
        if rank == 0:
            try:
                plan = make_plan(cluster, profile, policy=p.policy, nm=p.nm, d=p.d or 0,
                                 minibatch_size=batch_of(x), precision=precision, ps_nodes=ps_nodes,
                                 tf32=tf32, **planning_arguments(work, p))
                if cache_dir is not None:
                    PlanCache(cache_dir).store(key, plan, profile, cluster)
                plan_text = plan.to_json()
            except Exception as e:  # noqa: BLE001 - relayed to every rank below
                error = f"planning on rank 0 failed: {type(e).__name__}: {e}"
        plan_text, error = comm.bcast((plan_text, error), root=0)
        if error:
            raise LaunchError(f"hetpipe: {error}")
        profile_data = profile.to_dict()
    if rank == 0:
        sys.stderr.write(f"hetpipe: profile: {ModelProfile.from_dict(profile_data).source}\n")
    # What a restarting launcher re-plans the surviving devices with (plan rank 0 saves it).
    return Plan.from_json(plan_text), planning_inputs(cluster, profile_data, p, batch_of(x), precision,
                                                      ps_nodes=ps_nodes, tf32=tf32)


def _save_cluster(cluster: ClusterSpec, plan_cache: Optional[Path]) -> None:
    """Write the cluster JSON (editable, accepted back as ``cluster=``) where this run keeps its files."""
    text = json.dumps(cluster.to_dict(), indent=1) + "\n"      # as the plan cache writes it
    places = [Path(os.environ[RUN_DIR_ENV])] if os.environ.get(RUN_DIR_ENV) else []
    if plan_cache is not None:
        places.append(Path(plan_cache))
    for place in places:
        path = place / CLUSTER_FILE
        if path.is_file() and path.read_text() == text:
            continue            # as it is (the file may be the cluster= every rank is reading)
        place.mkdir(parents=True, exist_ok=True)
        tmp = place / f".{CLUSTER_FILE}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)   # readers see the old file or the new one, never half of one
        sys.stderr.write(f"hetpipe: cluster written to {path}\n")
