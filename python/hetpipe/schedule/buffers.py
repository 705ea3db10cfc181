"""Buffer assignment: how many received-activation and received-gradient buffers each stage needs.

A stage keeps a received activation from its ``RecvAct(mb)`` until its ``Bwd(mb)`` ends (the backward
needs the input), and a received gradient from ``RecvGrad(mb)`` until ``Bwd(mb)`` ends. Replaying the
stage's stream, the peak number held at once is the slot count; it sizes the pinned buffer pool.
Stage 0 receives no activations and the last stage no gradients, so those counts are 0.

These counts make the bounded-buffer lock-step run (``validate(schedule, buffers=buffer_counts(schedule))``)
deadlock-free: when a stage reaches ``RecvAct(mb)`` it holds at most ``act_slots - 1`` activations
and every earlier message was consumed, so the sender's ``SendAct(mb)`` always finds a free slot.
"""

from __future__ import annotations

from typing import List, Tuple

from hetpipe.schedule.ir import Bwd, RecvAct, RecvGrad, Schedule


def buffer_counts(schedule: Schedule) -> List[Tuple[int, int]]:
    """Per stage, ``(act_slots, grad_slots)``: the peak number of received activations and gradients
    the stage holds at once, by running its stream."""
    out = []
    for stream in schedule.streams:
        acts, grads = set(), set()
        peak_a = peak_g = 0
        for ins in stream:
            if isinstance(ins, RecvAct):
                acts.add(ins.mb)
                peak_a = max(peak_a, len(acts))
            elif isinstance(ins, RecvGrad):
                grads.add(ins.mb)
                peak_g = max(peak_g, len(grads))
            elif isinstance(ins, Bwd):
                acts.discard(ins.mb)
                grads.discard(ins.mb)
        out.append((peak_a, peak_g))
    return out
