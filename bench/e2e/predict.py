"""Predicted samples/s of every system from the same device model (compute only, no host communication).

hetpipe and the pipelining baseline are played by hetpipe's discrete-event simulator
(``hetpipe.schedule``); DDP and the limit are closed forms of the device model. All are labelled
"predicted" in the table and never stand in for a measurement.
"""

from __future__ import annotations

from hetpipe.plan.types import Plan
from hetpipe.schedule import simulate, simulate_plan, vw_costs
from hetpipe.schedule.registry import ScheduleOptions, generate

from devices import DeviceModel
from split import uniform_split


def hetpipe_rate(plan: Plan, waves: int, skip_waves: int) -> float:
    """Simulated steady samples/s of the plan under its Nm and D (start-up waves excluded)."""
    sim = simulate_plan(plan, waves=waves)
    return plan.minibatch_size * sum(sim.steady_throughput(v, skip_waves) for v in range(len(plan.virtual_workers)))


def pipelining_rate(dm: DeviceModel, depth: int, microbatches: int, schedule: str) -> float:
    """Simulated samples/s of one uniform-split pipeline over the devices in cluster order, flush per step."""
    split = uniform_split(depth, len(dm.devices))
    times = [dm.scaled_times(t, range(a, b), dm.minibatch) for (_, t), (a, b) in zip(dm.devices, split)]
    sched = generate(schedule, ScheduleOptions(len(times), microbatches))
    sim = simulate([sched], [vw_costs([f for f, _ in times], [b for _, b in times])])
    return microbatches * dm.minibatch / sim.makespan_s


def ddp_rate(dm: DeviceModel, depth: int, global_batch: int) -> float:
    """Equal shares: a step takes the slowest device's time for its share (all-reduce not modelled)."""
    share = global_batch // len(dm.devices)
    step = max(sum(dm.scaled_times(t, range(depth), share)) for _, t in dm.devices)
    return share * len(dm.devices) / step


def limit_rate(dm: DeviceModel) -> float:
    """Sum over devices of the device model's standalone samples/s."""
    return sum(dm.standalone_throughput(t) for _, t in dm.devices)
