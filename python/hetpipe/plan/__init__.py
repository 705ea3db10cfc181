"""Planning: VW formation, heterogeneous partitioning, device mapping, PS placement, cost model."""

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: F401
