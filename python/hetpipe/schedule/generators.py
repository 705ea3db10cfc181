"""Schedule generators: HetPipe/WSP, GPipe and 1F1B, as pure functions returning lowered schedules.

Every generator first builds a compute-only order per stage (Fwd, Recompute, Bwd, Apply, Push,
Pull) and then :func:`hetpipe.schedule.lower.lower` inserts the sends and receives.

The 1F1B rule shared by HetPipe and 1F1B, for stage ``s`` of ``k`` with in-flight cap ``c``::

    warm-up  w_s = min(c, k - s)       (>= 1; non-increasing in s, which makes it deadlock-free)
    repeat:  run the next Fwd if (minibatches in flight on this stage after it) <= w_s
             and the wave gate allows it; otherwise run the oldest pending Bwd (then its Apply).

After the warm-up a stage therefore alternates Bwd, Fwd (backward has priority), and the last stage
runs each Fwd immediately followed by its Bwd (Hippie's last-stage schedule: the loss gradient is
ready at once, so the last stage never holds more than one activation).

Wave gate: under WSP the first Fwd of wave ``w`` on a stage waits until the stage has pushed wave
``w - d - 1``. When the cap is below the number of stages (``nm < k``), stages ``1 .. k-1`` drain at
every wave boundary whatever ``d`` (their gate is that of ``d = 0``), and only stage 0 runs ahead
under ``d``: running the 1F1B rule straight through waves is then slower than draining
(docs/design.md, "Schedules").

Each generator is registered (:mod:`hetpipe.schedule.registry`) under its name with one signature,
``generate(ScheduleOptions)``; the positional ``*_schedule`` functions are shorthands for it.
"""

from __future__ import annotations

from typing import List

from hetpipe.schedule.ir import Apply, Bwd, Fwd, Instr, Pull, Push, Recompute, Schedule
from hetpipe.schedule.lower import lower
from hetpipe.schedule.registry import ScheduleOptions, ScheduleSpec, generate, register


def warmup(stage: int, num_stages: int, cap: int) -> int:
    """Forwards stage ``stage`` runs before its first backward (``min(cap, num_stages - stage)``)."""
    return min(cap, num_stages - stage)


def _one_f_one_b(shape: Schedule, stage: int, cap: int, wsp: bool, recompute: bool) -> List[Instr]:
    """One stage's compute-only order by the 1F1B rule above.

    ``shape`` supplies the micro-batch/minibatch/wave arithmetic (its streams are ignored). With
    ``wsp`` the order carries Apply right after each minibatch's last Bwd, ``Push(c)`` right after the
    Apply that completes wave ``c``, and ``Pull(w)`` (w >= 1) right before the first Fwd of wave
    ``w``, which waits until this stage has pushed wave ``w - d - 1`` (``w - 1`` on stages >= 1 when
    ``cap < num_stages``: the wave gate of the module docstring).
    """
    micro = shape.num_micro
    w = warmup(stage, shape.num_stages, cap)
    # Below k in flight, stages 0 .. k - cap share the cap, so Fwd(p + cap) on stage s >= 1 waits for
    # Bwd(p) on stage s - 1; placed before Bwd(p + 1) it stalls stage s, so stages >= 1 drain instead.
    d = 0 if stage >= 1 and cap < shape.num_stages else shape.d
    out: List[Instr] = []
    nf = nb = 0

    def in_flight(next_f: int) -> int:
        # minibatches with a Fwd among micro-batches < next_f and a Bwd still pending from nb on
        if next_f <= nb:
            return 0
        return shape.minibatch_of(next_f - 1) - shape.minibatch_of(nb) + 1

    def gate_open(j: int) -> bool:
        wave = shape.wave_of(j)
        if not wsp or j != shape.first_micro_of_wave(wave) or wave - d - 1 < 0:
            return True
        return nb > shape.last_micro_of_wave(wave - d - 1)

    while nb < micro:
        if nf < micro and in_flight(nf + 1) <= w and gate_open(nf):
            wave = shape.wave_of(nf)
            if wsp and wave >= 1 and nf == shape.first_micro_of_wave(wave):
                out.append(Pull(wave))
            out.append(Fwd(nf))
            nf += 1
            continue
        if recompute:
            out.append(Recompute(nb))
        out.append(Bwd(nb))
        p = shape.minibatch_of(nb)
        if wsp and nb == shape.micros_of(p)[-1]:
            out.append(Apply(nb))
            if nb == shape.last_micro_of_wave(shape.wave_of(nb)):
                out.append(Push(shape.wave_of(nb)))
        nb += 1
    return out


def _shape(name: str, num_stages: int, num_minibatches: int, nm: int, d: int, split: int = 0) -> Schedule:
    if num_stages < 1 or num_minibatches < 1:
        raise ValueError(f"{name}: need num_stages >= 1 and num_minibatches >= 1, "
                         f"got {num_stages} and {num_minibatches}")
    return Schedule(name, num_stages, num_minibatches, nm, d, tuple(() for _ in range(num_stages)), split)


def _with_streams(shape: Schedule, streams) -> Schedule:
    return Schedule(shape.name, shape.num_stages, shape.num_minibatches, shape.nm, shape.d,
                    tuple(tuple(s) for s in streams), shape.split)


def hetpipe_compute_schedule(num_stages: int, num_minibatches: int, nm: int, d: int, recompute: bool = False,
                             split_startup: int = 0) -> Schedule:
    """The compute-only HetPipe/WSP order (no sends or receives); :func:`hetpipe_schedule` lowers it."""
    shape = _shape("hetpipe", num_stages, num_minibatches, nm, d, split_startup)
    return _with_streams(shape, [_one_f_one_b(shape, s, nm, True, recompute) for s in range(num_stages)])


def hetpipe_schedule(num_stages: int, num_minibatches: int, nm: int, d: int, recompute: bool = False,
                     split_startup: int = 0) -> Schedule:
    """One virtual worker under WSP: ``num_stages`` stages, ``nm`` minibatches in flight, staleness ``d``.

    Minibatch ``p`` is in wave ``p // nm``. Each stage follows the 1F1B rule (module docstring) with
    cap ``nm``; after ``Bwd(p)`` comes ``Apply(p)``, after the Apply that ends wave ``c`` comes
    ``Push(c)`` (Hippie's early gradient sync: a stage pushes as soon as its own last backward of the
    wave is done), and ``Pull(w)`` comes right before the first Fwd of wave ``w >= 1`` (lowering puts
    the ``RecvAct`` between them). A Fwd of wave ``w`` waits until the stage has pushed wave
    ``w - d - 1``; with ``d = 0`` this drains the pipeline at every wave boundary, with ``d >= 1``
    and ``nm >= num_stages`` the 1F1B order runs straight through (below ``num_stages`` only stage 0
    runs ahead: the wave gate of the module docstring). 2 stages, nm = 2, 4 minibatches (compute only)::

        d = 0   stage 0: F0 F1 B0 A0 B1 A1 PUSH0 | PULL1 F2 F3 B2 A2 B3 A3 PUSH1
                stage 1: F0 B0 A0 F1 B1 A1 PUSH0 | PULL1 F2 B2 A2 F3 B3 A3 PUSH1
        d = 1   stage 0: F0 F1 B0 A0 PULL1 F2 B1 A1 PUSH0 F3 B2 A2 B3 A3 PUSH1
                stage 1: F0 B0 A0 F1 B1 A1 PUSH0 PULL1 F2 B2 A2 F3 B3 A3 PUSH1

    Weight versions: ``Fwd(p)`` on stage ``s`` follows ``Apply(p - w_s)`` with ``w_s <= nm``, so it sees
    at least the VW's own updates of minibatches ``<= p - nm`` (local staleness ``nm - 1``).
    ``recompute`` puts ``Recompute(p)`` right before each ``Bwd(p)``. ``split_startup = n`` runs the
    first ``n`` minibatches as two half micro-batches each (AutoPipe-H), see :class:`Schedule`.
    """
    return generate("hetpipe", ScheduleOptions(num_stages, num_minibatches, nm, d, recompute, split_startup))


def _hetpipe(o: ScheduleOptions) -> Schedule:
    return lower(hetpipe_compute_schedule(o.stages, o.minibatches, o.nm, o.d, o.recompute, o.split_startup))


def _flush(shape: Schedule, order: List[Instr]) -> List[Instr]:
    """Append the flush: every minibatch's Apply, in minibatch order, then ``Push(0)``."""
    return order + [Apply(j) for j in range(shape.num_micro)] + [Push(0)]


def _with_recompute(order: List[Instr]) -> List[Instr]:
    """``order`` with ``Recompute(mb)`` right before each ``Bwd(mb)``."""
    return [x for i in order for x in ((Recompute(i.mb), i) if isinstance(i, Bwd) else (i,))]


def gpipe_schedule(num_stages: int, num_minibatches: int, recompute: bool = False) -> Schedule:
    """GPipe fill-drain: every stage runs all forwards, then all backwards in reverse, then the flush.

    One wave (``nm = num_minibatches``, ``d = 0``): all minibatches see the same weights, and the
    flush expresses the synchronous update as ``A0 .. A{m-1}`` after the stage's last Bwd (their
    summed gradients, as one step of plain SGD), followed by ``Push(0)``; no Pull. 3 stages,
    4 minibatches, equal unit times (compute only, time runs right)::

        stage 0: F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 | A0 A1 A2 A3 PUSH0
        stage 1: .  F0 F1 F2 F3 .  .  B3 B2 B1 B0    | A0 ..
        stage 2: .  .  F0 F1 F2 F3 B3 B2 B1 B0       | A0 ..
    """
    return generate("gpipe", ScheduleOptions(num_stages, num_minibatches, recompute=recompute))


def _gpipe(o: ScheduleOptions) -> Schedule:
    shape = _shape("gpipe", o.stages, o.minibatches, o.minibatches, 0)
    m = o.minibatches
    order = [Fwd(j) for j in range(m)] + [Bwd(j) for j in reversed(range(m))]
    streams = [_flush(shape, _with_recompute(order) if o.recompute else order) for _ in range(o.stages)]
    return lower(_with_streams(shape, streams))


def one_f_one_b_schedule(num_stages: int, num_minibatches: int, recompute: bool = False) -> Schedule:
    """1F1B with a flush (PipeDream-flush): the 1F1B rule with cap ``num_stages``, then the flush.

    Like :func:`gpipe_schedule`: one wave, every Apply at the flush, then ``Push(0)``. Stage ``s``
    warms up with ``min(m, k - s)`` forwards. 3 stages, 4 minibatches, equal unit times::

        stage 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 | A0 A1 A2 A3 PUSH0
        stage 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3    | A0 ..
        stage 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3       | A0 ..
    """
    return generate("1f1b", ScheduleOptions(num_stages, num_minibatches, recompute=recompute))


def _one_f_one_b_flush(o: ScheduleOptions) -> Schedule:
    shape = _shape("1f1b", o.stages, o.minibatches, o.minibatches, 0)
    streams = [_flush(shape, _one_f_one_b(shape, s, o.stages, False, o.recompute)) for s in range(o.stages)]
    return lower(_with_streams(shape, streams))


# --- cost-model closed forms (hetpipe.plan.cost explains them) -------------------------------------

def _wsp_wave_time(bottleneck: float, round_trip: float, sync: float, o: ScheduleOptions) -> float:
    """HetPipe: with ``d >= 1`` and ``nm >= k`` the 1F1B order runs across waves and one wave costs
    the largest of ``nm`` bottlenecks, the round trip and the PS sync; otherwise every wave fills and
    drains the pipeline and the sync is exposed."""
    if o.d == 0 or o.nm < o.stages:
        return round_trip + (o.nm - 1) * bottleneck + sync
    return max(o.nm * bottleneck, round_trip, sync)


def _flush_wave_time(bottleneck: float, round_trip: float, sync: float, o: ScheduleOptions) -> float:
    """GPipe and 1F1B with a flush: one wave of all ``minibatches``, filled, drained, then synced."""
    return round_trip + (o.minibatches - 1) * bottleneck + sync


register(ScheduleSpec(
    "hetpipe", _hetpipe, frozenset({"nm", "d", "recompute", "split_startup"}), syncs=True,
    wave_time=_wsp_wave_time,
    summary="HetPipe/WSP: nm minibatches in flight per wave, 1F1B order, push and pull per wave under staleness d"))
register(ScheduleSpec(
    "gpipe", _gpipe, frozenset({"recompute"}), syncs=True, wave_time=_flush_wave_time,
    summary="GPipe fill-drain: one wave of every minibatch, all forwards then all backwards, then one flush"))
register(ScheduleSpec(
    "1f1b", _one_f_one_b_flush, frozenset({"recompute"}), syncs=True, wave_time=_flush_wave_time,
    summary="1F1B with a flush (PipeDream-flush): one wave of every minibatch in the 1F1B order, then one flush"))
