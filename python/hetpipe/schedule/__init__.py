"""Schedules as data: instruction streams, generators, lowering, validation and simulation.

Pure Python: nothing here imports torch, MPI or hetpipe_core.
"""

from hetpipe.schedule.ir import (  # noqa: F401
    Apply, Bwd, Done, Eval, Fwd, Instr, Pull, Push, Recompute, RecvAct, RecvGrad, RecvNorm, RecvTied, RecvVerdict,
    Schedule, SendAct, SendGrad, SendNorm, SendTied, SendVerdict, parse, parse_stream,
)
from hetpipe.schedule.lower import lower  # noqa: F401
from hetpipe.schedule.messages import MessageOptions, with_messages, without_messages  # noqa: F401
from hetpipe.schedule.registry import (  # noqa: F401
    ScheduleOptions, ScheduleSpec, generate, get_schedule, register, schedule_names, unregister,
)
from hetpipe.schedule.generators import (  # noqa: F401
    gpipe_schedule, hetpipe_compute_schedule, hetpipe_schedule, one_f_one_b_schedule,
)
from hetpipe.schedule.lockstep import Lockstep, lockstep  # noqa: F401
from hetpipe.schedule.grid import format_grid, format_lockstep  # noqa: F401
from hetpipe.schedule.validate import ScheduleError, validate  # noqa: F401
from hetpipe.schedule.buffers import buffer_counts  # noqa: F401
from hetpipe.schedule.ps import DEFAULT_APPLY_RATE, ShardStats, ShardTraffic, plan_traffic  # noqa: F401
from hetpipe.schedule.simulate import (  # noqa: F401
    PSLog, SimResult, StageStats, VWCosts, simulate, simulate_plan, vw_costs,
)
from hetpipe.schedule.gantt import save_gantt  # noqa: F401
