"""What a run's update rule means per sample, said once at start-up: why its loss curve is not a
one-process loop's at the same learning rate, and the switch that makes it one
(docs/training.md, "Why the loss differs").

A one-process loop at minibatch ``B`` takes one step per minibatch. In a run, each VW steps its own
weights once per minibatch (``Nm`` per wave) and the PS combines the VWs' wave deltas: ``"mean"``
divides them by the number of VWs ``N``, so a wave of ``N x Nm`` minibatches moves the global weights
about as far as ``Nm`` steps at minibatch ``N x B`` (the step of one GPU, as with DDP), ``1/N`` of a
loop's progress per sample at the same rate; ``"sum"`` adds them, so every minibatch's step reaches
the global weights, as in a loop, on weights up to ``D`` waves of the other VWs stale. Inside a VW,
a minibatch computes on weights that lack the steps of up to ``Nm - 1`` minibatches still in flight.
"""

from __future__ import annotations

from hetpipe.plan.types import Plan


def update_rule(plan: Plan, batch: int, accumulate: int = 1) -> str:
    """The start-up line for ``plan`` with minibatches of ``batch`` samples (see the module docstring)."""
    n, nm = len(plan.virtual_workers), max(plan.wave_minibatches)
    per_step = f"{batch * accumulate} samples" if accumulate == 1 else f"{accumulate} minibatches of {batch}"
    inflight = (f"; a minibatch computes on weights lacking the steps of up to {nm - 1} minibatch(es) still in "
                "flight" if nm > 1 else "")
    if n == 1:
        rule = (f"hetpipe: update rule: 1 VW stepping once per {per_step}, every step reaching its weights as in a "
                f"one-process loop{inflight}")
    elif plan.aggregate == "mean":
        rule = (f"hetpipe: update rule: {n} VWs each stepping once per {per_step}; the PS averages their updates "
                f"(aggregate 'mean'), so per sample the run advances 1/{n} as far as a one-process loop at the same "
                f"learning rate (an effective batch of {n * batch * accumulate}); PSRule(aggregate='sum') advances "
                f"per sample as a loop does{inflight}")
    else:
        rule = (f"hetpipe: update rule: {n} VWs each stepping once per {per_step}; the PS adds their updates "
                f"(aggregate 'sum'), so per sample the run advances as a one-process loop does, on global weights "
                f"lacking up to {plan.d} wave(s) of the other VWs' updates{inflight}")
    if n > 1 and plan.outer_gain == "sqrt":
        rule += f"; outer_gain 'sqrt' divides each VW's update by sqrt({n}) instead, between 'mean' and 'sum'"
    if not plan.equal_waves:
        rule += f"; the VWs' waves are {'/'.join(map(str, plan.wave_minibatches))} minibatches long"
        if plan.aggregate == "mean":
            rule += " and the PS weighs each VW's update by its samples instead of 1/N"
    if plan.outer != "sgd" or plan.outer_lr != 1.0:
        rule += f"; the PS's outer step ({plan.outer}, lr {plan.outer_lr:g}) scales each wave's update"
    return rule + " (docs/training.md, \"Why the loss differs\")"
