"""Step times of the synchronous baselines on the virtual clock: formulas on the device and cluster model.

* **Data parallelism** (DDP, DDP on a device subset, heterogeneity-aware DP): a step is the slowest
  member's forward and backward of its share (per-sample linear, bench/e2e's device model), then the
  ring all-reduce of the gradient, not overlapped with the backward (DDP's buckets overlap part of it:
  an upper bound by at most the all-reduce).
* **Ring all-reduce** of ``n`` bytes over ``k`` members: ``2 (k - 1)`` steps, each moving ``n / k``
  bytes over every link of the ring at once, so the slowest link sets the pace:
  ``2 (k - 1) / k x n / bandwidth + 2 (k - 1) x latency`` (0 for one member). The ring visits the
  members in the given order and closes; a ring spanning nodes has an inter-node link.
* **FSDP** (fully sharded data parallelism, every member one shard of the weights, gradients and
  optimizer state): the data-parallel step's compute, then per step an all-gather of the weights for
  the forward, another for the backward, and a reduce-scatter of the gradient, each a ring pass of
  ``(k - 1) / k x n / bandwidth + (k - 1) x latency``: ``3 (k - 1) / k x n / bandwidth + 3 (k - 1) x
  latency`` in all (1.5x a ring all-reduce), not overlapped with the compute (FSDP's prefetch overlaps
  part of it: an upper bound by at most the communication).
* **1F1B pipelining**: one pipeline, ``M`` micro-batches and a flush per step, played by hetpipe's
  simulator (``hetpipe.schedule.simulate``, the registered ``1f1b`` schedule) with each boundary's
  activation and gradient transfer over the link between its two devices. With equal stages it is
  ``(M + S - 1) (f + b)``: the ``S - 1`` bubbles of the fill and the drain
  (:func:`one_f_one_b_uniform`, against which the tests check it).

The optimizer step and host overheads are not modelled, for any system (hetpipe's neither).
"""

from __future__ import annotations

from typing import Sequence, Tuple

from hetpipe.plan.cluster import ClusterSpec, Link
from hetpipe.schedule import simulate, vw_costs
from hetpipe.schedule.registry import ScheduleOptions, generate


def _ring_s(what: str, phases: int, nbytes: float, members: int, link: Link) -> float:
    """Seconds of ``phases`` ring passes (an all-gather or a reduce-scatter each: ``members - 1`` steps
    of ``nbytes / members``) over ``members`` whose slowest ring link is ``link``."""
    if members < 1 or nbytes < 0:
        raise ValueError(f"{what}: {members} members, {nbytes} bytes")
    if members == 1 or nbytes == 0:
        return 0.0
    steps = phases * (members - 1)
    return steps / members * nbytes / link.bandwidth + steps * link.latency


def ring_allreduce_s(nbytes: float, members: int, link: Link) -> float:
    """Seconds of a ring all-reduce (a reduce-scatter and an all-gather) of ``nbytes`` over ``members``."""
    return _ring_s("ring all-reduce", 2, nbytes, members, link)


def fsdp_comm_s(nbytes: float, members: int, link: Link) -> float:
    """Seconds of one FSDP step's communication of ``nbytes`` of weights over ``members``: two ring
    all-gathers (forward, backward) and one ring reduce-scatter (see the module docstring)."""
    return _ring_s("fsdp", 3, nbytes, members, link)


def fsdp_bytes_per_device(param_bytes: Sequence[float], optimizer_bytes: Sequence[float], members: int,
                          stash_bytes: float) -> float:
    """Bytes an FSDP member holds at its peak: its shard of the weights, gradients and optimizer state,
    the largest layer's gathered weights and gradient (one FSDP unit per layer), and the stashed
    activations of its share (``stash_bytes``)."""
    if members < 1:
        raise ValueError(f"fsdp: {members} members")
    state = sum(2 * p + o for p, o in zip(param_bytes, optimizer_bytes))
    return state / members + 2 * max(param_bytes, default=0.0) + stash_bytes


def ring_link(cluster: ClusterSpec, devices: Sequence[str]) -> Link:
    """The slowest link of the ring through ``devices`` (in order, closed): inter-node if they span
    nodes, else intra-node."""
    nodes = {cluster.device(d).node for d in devices}
    return cluster.inter_node if len(nodes) > 1 else cluster.intra_node


def dp_step_s(times: Sequence[float], windows: Sequence[int], minibatch: int, grad_bytes: float,
              link: Link) -> Tuple[float, float]:
    """(compute, all-reduce) seconds of a data-parallel step: member ``i`` takes ``times[i]`` per minibatch
    of ``minibatch`` windows and computes ``windows[i]`` of them; the gradient has ``grad_bytes``."""
    if len(times) != len(windows) or not times:
        raise ValueError(f"dp step: {len(times)} devices, {len(windows)} shares")
    compute = max(t * w / minibatch for t, w in zip(times, windows))
    return compute, ring_allreduce_s(grad_bytes, len(times), link)


def pipeline_step_s(fwd: Sequence[float], bwd: Sequence[float], micro: int,
                    transfer_s: Sequence[float] = ()) -> float:
    """Seconds of one 1F1B step (``micro`` micro-batches, then the flush): stage ``s`` takes ``fwd[s]``,
    ``bwd[s]`` per micro-batch; ``transfer_s[b]``: one activation (or gradient) across boundary ``b``."""
    stages = len(fwd)
    sched = generate("1f1b", ScheduleOptions(stages, micro))
    tx = list(transfer_s) if transfer_s else [0.0] * (stages - 1)
    return simulate([sched], [vw_costs(list(fwd), list(bwd), transfer_s=tx)]).makespan_s


def one_f_one_b_uniform(f: float, b: float, stages: int, micro: int) -> float:
    """The closed form of a 1F1B step over equal stages without transfers: ``(M + S - 1)(f + b)``."""
    return (micro + stages - 1) * (f + b)


def boundary_transfers(cluster: ClusterSpec, devices: Sequence[str], act_bytes: Sequence[float]) -> list:
    """Seconds to move ``act_bytes[b]`` between ``devices[b]`` and ``devices[b + 1]`` over their link."""
    out = []
    for b, nbytes in enumerate(act_bytes):
        bw, lat = cluster.link(devices[b], devices[b + 1])
        out.append(0.0 if nbytes <= 0 else lat + nbytes / bw)
    return out
