"""Schedules as data: instruction streams, generators, lowering, validation and simulation.

Pure Python: nothing here imports torch, MPI or hetpipe_core.
"""

from hetpipe.schedule.ir import (  # noqa: F401
    Apply, Bwd, Fwd, Instr, Pull, Push, Recompute, RecvAct, RecvGrad, Schedule, SendAct, SendGrad,
    parse, parse_stream,
)
