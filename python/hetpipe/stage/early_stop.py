"""Where a stage's stream ends when the run stops early (docs/design.md, "Early stop").

A stage learns the last wave ``S`` trained at VW 0's evaluation verdict, or from the STOPPED replies
to its pull of wave ``S + 1``; it then drops every instruction of a minibatch beyond wave ``S``, every
later Push and Pull of a wave beyond it, and the evaluation points after wave ``S`` and beyond (as
after the last wave of a run that ends normally, none follows the last wave trained). Every stage of
every VW drops the same ones, so no message is left unsent or unreceived; DONE stays. With accumulation, the
last minibatch of wave ``S`` now takes a step: when the VW's stages exchange norm shares, each of them
puts that step's exchange before its Apply (unless that Apply already ran), as the schedule would have.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from hetpipe.schedule.ir import Apply, Eval, Instr, RecvVerdict, SendNorm, SendVerdict


class EarlyStop:
    """The stage's early stop: ``after`` is the last wave trained once known (None: the stream runs to
    its end). ``minibatch_of`` maps the stream's micro-batches to minibatches, ``nm`` minibatches a wave;
    ``exchange(mb)``: the norm exchange before ``Apply(mb)`` (None: the stage exchanges no shares)."""

    def __init__(self, minibatch_of: Callable[[int], int], nm: int,
                 exchange: Optional[Callable[[int], List[Instr]]] = None) -> None:
        self.minibatch_of, self.nm, self.exchange = minibatch_of, nm, exchange
        self.after: Optional[int] = None

    def truncate(self, stream: Sequence[Instr], pc: int, last: int, step_mb: Optional[int]) -> List[Instr]:
        """``stream`` with the instructions from ``pc`` on that belong to waves after ``last`` dropped;
        ``step_mb``: the micro-batch of the Apply that now takes the last step (None: unknown)."""
        self.after = last

        def kept(instr: Instr) -> bool:
            mb = getattr(instr, "mb", None)
            if mb is not None:
                return self.minibatch_of(mb) // self.nm <= last
            if isinstance(instr, (Eval, SendVerdict, RecvVerdict)):
                return instr.wave < last
            wave = getattr(instr, "wave", None)
            return wave is None or wave <= last

        rest = [i for i in stream[pc:] if kept(i)]
        if self.exchange is not None and step_mb is not None and Apply(step_mb) in rest \
                and not any(isinstance(i, SendNorm) and i.mb == step_mb for i in stream):
            at = rest.index(Apply(step_mb))
            rest[at:at] = self.exchange(step_mb)
        return list(stream[:pc]) + rest
