"""Recomputation and Hippie's memory efficiency.

The partitioner decides recomputation per stage (:mod:`hetpipe.plan.stage` gives its memory and
time): mode ``none`` never recomputes, ``fit`` recomputes exactly the stages that would otherwise
not fit their device (the DP takes the cheaper variant that fits), ``all`` recomputes every stage.
A recomputing stage lists all its layers in ``StagePlan.recompute``.

Hippie chooses among candidate plans by memory efficiency, ``ME = scalability x throughput /
memory``, where scalability is the plan's throughput over that of the fastest single device
training the whole model (memory ignored), and memory is the plan's total predicted peak bytes.
``make_plan(objective="memory_efficiency")`` picks, over Nm and the three modes, the plan of
highest ME instead of the fastest.
"""

from __future__ import annotations

from typing import Iterable

from hetpipe.plan.stage import LayerTable, reference_times


def single_device_throughput(table: LayerTable, device_types: Iterable[str]) -> float:
    """Minibatches per second of the fastest device type running the whole model alone."""
    best = min(float(sum(reference_times(table, t))) for t in device_types)
    return float("inf") if best <= 0 else 1.0 / best


def memory_efficiency(throughput: float, single_throughput: float, memory_bytes: float) -> float:
    if memory_bytes <= 0 or single_throughput <= 0:
        return 0.0
    return (throughput / single_throughput) * throughput / memory_bytes
