"""Where a stage's stream ends when the run stops early (docs/design.md, "Early stop").

A stage learns the last wave ``S`` trained at VW 0's evaluation verdict, or from the STOPPED replies
to its pull of wave ``S + 1``; it then drops every instruction of a minibatch beyond wave ``S`` and
every later Push and Pull. Every stage of every VW drops the same minibatches, so no message is left
unsent or unreceived. Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from hetpipe.schedule.ir import Instr, Pull, Push


class EarlyStop:
    """The stage's early stop: ``after`` is the last wave trained once known (None: the stream runs to
    its end). ``minibatch_of`` maps the stream's micro-batches to minibatches, ``nm`` minibatches a wave."""

    def __init__(self, minibatch_of: Callable[[int], int], nm: int) -> None:
        self.minibatch_of, self.nm = minibatch_of, nm
        self.after: Optional[int] = None

    def truncate(self, stream: Sequence[Instr], pc: int, last: int) -> List[Instr]:
        """``stream`` with the instructions from ``pc`` on that belong to waves after ``last`` dropped."""
        self.after = last

        def kept(instr: Instr) -> bool:
            if isinstance(instr, (Push, Pull)):
                return instr.wave <= last
            mb = getattr(instr, "mb", None)
            return mb is None or self.minibatch_of(mb) // self.nm <= last

        return list(stream[:pc]) + [i for i in stream[pc:] if kept(i)]
