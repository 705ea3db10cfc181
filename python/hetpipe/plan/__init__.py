"""Planning: VW formation, heterogeneous partitioning, device mapping, PS placement, cost model."""

from hetpipe.plan.format import format_plan  # noqa: F401
from hetpipe.plan.formation import POLICIES, form_virtual_workers  # noqa: F401
from hetpipe.plan.manual import manual_plan  # noqa: F401
from hetpipe.plan.partition import Partition, StageResult, partition, partition_order  # noqa: F401
from hetpipe.plan.placement import place_layers  # noqa: F401
from hetpipe.plan.planner import make_plan  # noqa: F401
from hetpipe.plan.stage_cost import LayerTable, LinkCost, StageDevice  # noqa: F401
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: F401
