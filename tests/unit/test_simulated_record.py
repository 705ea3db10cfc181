"""Records synthesised by the simulator (hetpipe.run.simulated): the replay follows them to the end, every
version is one WSP allows, D = 0 gives the replay's own run, and the versions against an event-by-event
reference written from the costs by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp, sgd, synthetic  # noqa: E402

from hetpipe.plan.cluster import load_cluster  # noqa: E402
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.run.record import losses_crc32, weights_crc32  # noqa: E402
from hetpipe.run.replay import replay_run  # noqa: E402
from hetpipe.run.simulated import simulated_record  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.schedule import vw_costs  # noqa: E402

torch.set_num_threads(1)
LAYERS = 6
BATCH = 4
PER_VW = 12                     # minibatches per VW


def make_plan(cuts: Sequence[Sequence[int]], fwd: Sequence[float], nm: int, d: int, shards: int = 1) -> Plan:
    """VW ``v`` cut at ``cuts[v]``, each of its stages ``fwd[v]`` s per forward (2x per backward), on the
    devices of the cpu-emulated-6 preset; ``shards`` PS shards own the layers round-robin."""
    devices = [d_.id for d_ in load_cluster("cpu-emulated-6").devices]
    vws, k = [], 0
    for v, c in enumerate(cuts):
        bounds = [0, *c, LAYERS]
        stages = []
        for a, b in zip(bounds, bounds[1:]):
            stages.append(StagePlan(devices[k], "emu_fast", a, b, fwd[v], 2 * fwd[v], send_time=0.1 * fwd[v]))
            k += 1
        vws.append(VirtualWorkerPlan(v, tuple(stages)))
    ps = tuple(ShardPlan(s, "n0", tuple(range(s, LAYERS, shards))) for s in range(shards))
    return Plan(LAYERS, nm, d, "manual", tuple(vws), ps)


def spec_of(plan: Plan, per_vw: int = PER_VW):
    data = synthetic(n=per_vw * BATCH * len(plan.virtual_workers), batch=BATCH)
    return Trainer(mlp(), cross_entropy, sgd(), data, plan=plan).spec(plan)


CASES = {   # name: (cuts per VW, forward seconds per VW, Nm, D, shards)
    "1vw-2st-d0-nm2": (([3],), (0.01,), 2, 0, 1),
    "1vw-3st-d1-nm4": (([2, 4],), (0.01,), 4, 1, 2),
    "2vw-d1-nm1": (([3], []), (0.01, 0.03), 1, 1, 1),
    "2vw-d2-nm2": (([3], [2]), (0.01, 0.025), 2, 2, 2),
    "2vw-d4-nm1": (([], [1, 3, 5]), (0.05, 0.01), 1, 4, 3),
    "3vw-d1-nm2": (([3], [], [2, 4]), (0.01, 0.04, 0.02), 2, 1, 2),
    "3vw-d4-nm4": (([], [3], []), (0.02, 0.01, 0.06), 4, 4, 1),
}


def _versions(pulls) -> Dict[Tuple[int, int, int], int]:
    return {(v, s, w): g for v, s, w, g, *_ in pulls}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_replay_follows_a_simulated_record_to_the_end(name):
    cuts, fwd, nm, d, shards = CASES[name]
    spec = spec_of(make_plan(cuts, fwd, nm, d, shards))
    run = simulated_record(spec, cluster=load_cluster("cpu-emulated-6"))
    rec = run.record
    rec.check(spec)
    for k, sh in rec.shards.items():
        for v, s, w, g, _ in sh.pulls:          # every version within WSP's bound
            assert w - d <= g <= w, (name, k, v, s, w, g)
    res = replay_run(spec, rec)                  # raises on a deadlock or a record it cannot follow
    assert res.reproduced is None                # a synthesised record holds no outcome digests
    for k, log in res.shard_logs.items():
        assert _versions(log.pulls) == _versions(rec.shards[k].pulls)
        assert [[(v, s) for v, s, c in log.applied if c == wave] for wave in range(len(rec.shards[k].applied))] \
            == rec.shards[k].applied
    # Filled with the replay's digests, the record is reproduced by a second replay.
    rec.outcome = {"weights_crc32": weights_crc32(res.weights), "losses_crc32": losses_crc32(res.losses)}
    assert replay_run(spec, rec).reproduced is True
    # Times: waves end in order, the global versions appear in order.
    assert all(np.all(np.diff(t) > 0) for t in run.wave_done_s)
    assert np.all(np.diff(run.version_s) > 0) and len(run.version_s) == PER_VW // nm + 1
    assert all(len(t) == PER_VW and min(t) > 0 for t in run.minibatch_done_s)


@pytest.mark.parametrize("nm", [1, 2])
def test_at_d0_the_record_is_the_replays_own_run(nm):
    spec = spec_of(make_plan(([3], []), (0.01, 0.03), nm, 0, 2))
    run = simulated_record(spec, cluster=load_cluster("cpu-emulated-6"))
    assert all(g == w for sh in run.record.shards.values() for _, _, w, g, _ in sh.pulls)
    plain = replay_run(spec)
    followed = replay_run(spec, run.record)
    for k, log in plain.shard_logs.items():
        assert _versions(log.pulls) == _versions(run.record.shards[k].pulls)
    assert weights_crc32(plain.weights) == weights_crc32(followed.weights)
    assert losses_crc32(plain.losses) == losses_crc32(followed.losses)


# --- the versions against an event-by-event reference ------------------------------------------------

def reference(times: Sequence[float], waves: int, d: int, ahead: bool) -> Dict[Tuple[int, int], int]:
    """(vw, wave) -> the version its pull gets, for one-stage VWs with Nm = 1 (a wave: Pull, forward,
    backward, Apply, Push) taking ``times[v]`` s of compute per wave, transfers and the PS instant.

    VW ``v``'s wave ``w`` starts once it finished wave ``w - 1`` and every VW pushed wave ``w - D - 1`` (the
    Pull's WSP wait); the shard applies wave ``c`` when the last VW pushes it (at ``P[c]``). The pull's
    request leaves when the VW reaches the Pull, or (``ahead``) right after its own Push of wave
    ``w - D - 1`` and its previous Pull; it is answered once ``P[w - D - 1]`` passed, with the number of
    waves applied by then (a push made at that very instant included: it came first)."""
    n = len(times)
    push: List[List[float]] = [[] for _ in range(n)]
    pull_end: List[List[float]] = [[0.0] for _ in range(n)]      # pull_end[v][w]: when Pull(w) ended (w >= 1)
    t = [0.0] * n
    pending = [(v, 0) for v in range(n)]
    while pending:
        ran = False
        for v, w in list(pending):
            gate = w - d - 1
            if gate >= 0 and any(len(push[u]) <= gate for u in range(n)):
                continue                                          # waits for the slow VW's push
            if w >= 1:
                t[v] = max([t[v]] + ([max(push[u][gate] for u in range(n))] if gate >= 0 else []))
                pull_end[v].append(t[v])
            t[v] += times[v]
            push[v].append(t[v])
            pending.remove((v, w))
            if w + 1 < waves:
                pending.append((v, w + 1))
            ran = True
        assert ran, "the reference deadlocked"
    applied = [max(push[u][c] for u in range(n)) for c in range(waves)]
    out = {}
    for v in range(n):
        for w in range(1, waves):
            gate = w - d - 1
            if ahead:
                r = max(pull_end[v][w - 1] if w > 1 else 0.0, push[v][gate] if gate >= 0 else 0.0)
            else:
                r = push[v][w - 1]                                # it reaches Pull(w) as it pushed w - 1
            a = max(r, applied[gate] if gate >= 0 else 0.0)
            out[(v, w)] = min(w, sum(1 for c in applied if c <= a))
    return out


def test_the_reference_by_hand():
    # VW 0 takes 1 s per wave, VW 1 3 s, D = 1, pulls requested at the instruction: VW 0 pulls wave 1 at
    # 1 s (nothing applied: g 0), waits at Pull(2) for VW 1's push of wave 0 (3 s: g 1) and at Pull(3) for
    # its push of wave 1 (6 s: g 2). VW 1 pulls wave 1 at 3 s (wave 0 applied at 3 s: g 1), wave 2 at 6 s
    # (wave 1 applied at 6 s, when it pushed it: g 2), wave 3 at 9 s (g 3).
    assert reference([1.0, 3.0], 4, 1, ahead=False) == {(0, 1): 0, (0, 2): 1, (0, 3): 2,
                                                        (1, 1): 1, (1, 2): 2, (1, 3): 3}
    # Requested early, every pull at D = 1 is one wave old: it is answered as soon as wave w - 2 is applied.
    assert set(reference([1.0, 3.0], 4, 1, ahead=True).items()) == {((v, w), w - 1) for v in (0, 1) for w in (1, 2, 3)}


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("times", [(1.0, 3.0), (0.75, 2.5), (2.0, 0.5)])
def test_versions_match_the_event_by_event_reference(times, ahead, d):
    waves = 8
    plan = make_plan(([], []), (0.01, 0.01), 1, d)
    spec = spec_of(plan, per_vw=waves)
    # Forward a third of the wave, backward the rest; no transfers, the PS serves at once.
    costs = [vw_costs([t / 4], [3 * t / 4]) for t in times]
    run = simulated_record(spec, costs, pull_ahead=ahead)
    got = {(v, w): g for v, _, w, g, _ in run.record.shards[0].pulls}
    assert got == reference(times, waves, d, ahead)
    assert max(w - g for (_, w), g in got.items()) > 0           # the fast VW lags behind the slow one
    assert run.wave_done_s[0][:2] == [times[0], 2 * times[0]]

