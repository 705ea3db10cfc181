"""bench/convergence on the virtual clock: the baselines' step-time formulas against hand-computed values,
the runner's time axis, and the staleness histograms of two records side by side."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH / "convergence"), str(BENCH / "e2e")]

import steptimes as st  # noqa: E402
import vclock  # noqa: E402
from devices import DeviceModel  # noqa: E402
from hetpipe.plan.cluster import Link, load_cluster  # noqa: E402
from hetpipe.plan.profile import LayerProfile, ModelProfile  # noqa: E402
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.run.record import RunRecord, ShardRecord  # noqa: E402
from task import TaskSpec, corpus, validation_set  # noqa: E402

torch.set_num_threads(1)
CLUSTER = load_cluster("cpu-emulated-6")      # n0: 2 emu_fast, n1: 2 emu_mid, n2: 2 emu_slow


def test_ring_allreduce_by_hand():
    link = Link(2.5e8, 1e-4)
    # 6 members: 10 steps of 1e6 bytes each (6e6 / 6) at 2.5e8 B/s = 0.04 s, plus 10 latencies.
    assert st.ring_allreduce_s(6e6, 6, link) == pytest.approx(0.04 + 10 * 1e-4)
    assert st.ring_allreduce_s(4e6, 2, Link(2e9, 2e-5)) == pytest.approx(2 * 1 / 2 * 4e6 / 2e9 + 2 * 2e-5)
    assert st.ring_allreduce_s(6e6, 1, link) == 0.0
    assert st.ring_link(CLUSTER, ["n0.g0", "n0.g1"]) == CLUSTER.intra_node
    assert st.ring_link(CLUSTER, ["n0.g0", "n0.g1", "n2.g0"]) == CLUSTER.inter_node


def test_data_parallel_step_is_the_slowest_share_plus_the_allreduce():
    link = Link(1e9, 0.0)
    # 1 s and 2 s per minibatch of 4; shares 4 and 2 windows: both 1 s. 8 MB over 2 members: 8 ms.
    assert st.dp_step_s([1.0, 2.0], [4, 2], 4, 8e6, link) == pytest.approx((1.0, 0.008))
    assert st.dp_step_s([1.0, 2.0], [4, 4], 4, 8e6, link)[0] == 2.0


def test_one_f_one_b_step_by_hand():
    # Equal stages: (M + S - 1)(f + b), the S - 1 bubbles of fill and drain.
    assert st.pipeline_step_s([1.0] * 3, [2.0] * 3, 4) == pytest.approx(st.one_f_one_b_uniform(1.0, 2.0, 3, 4)) \
        == pytest.approx(18.0)
    # Two stages (f, b) = (1, 2) and (2, 4), two micro-batches: stage 1 runs F0 1-3, B0 3-7, F1 7-9, B1 9-13;
    # stage 0 B0 7-9, B1 13-15.
    assert st.pipeline_step_s([1.0, 2.0], [2.0, 4.0], 2) == pytest.approx(15.0)
    # A transfer of 0.5 s each way across the boundary: F0 reaches stage 1 at 1.5, B0's gradient stage 0
    # at 8; F1 1-2 arrives at 2.5 (stage 1 busy until 7.5): F1 7.5-9.5, B1 9.5-13.5, stage 0 B1 14-16.
    assert st.pipeline_step_s([1.0, 2.0], [2.0, 4.0], 2, [0.5]) == pytest.approx(16.0)
    assert st.boundary_transfers(CLUSTER, ["n0.g0", "n0.g1", "n1.g0"], [2e6, 2.5e6]) == \
        pytest.approx([2e-5 + 2e6 / 2e9, 1e-4 + 2.5e6 / 2.5e8])


TINY = TaskSpec(context=8, width=16, heads=2, blocks=2, minibatch=4, train_bytes=1 << 16, val_windows=8)


def tiny_setting() -> vclock.Setting:
    """A 6-layer GPT on the cpu-emulated-6 preset with made-up times: emu_fast 0.1 s per layer forward,
    mid 2x, slow 4x (backward 2x forward; a minibatch 1.8, 3.6, 7.2 s), 1 MB of weights per layer; a plan
    of one VW of two emu_fast stages and one of one emu_slow stage, 2 PS shards."""
    text, val, _ = corpus(TINY)
    scale = {"emu_fast": 1.0, "emu_mid": 2.0, "emu_slow": 4.0}
    fwd = {t: [0.1 * k] * 6 for t, k in scale.items()}
    bwd = {t: [0.2 * k] * 6 for t, k in scale.items()}
    dm = DeviceModel([(d.id, d.type) for d in CLUSTER.devices], fwd, bwd, TINY.minibatch, "test")
    prof = ModelProfile("tiny", TINY.minibatch, tuple(
        LayerProfile(f"l{i}", {t: v[i] for t, v in fwd.items()}, {t: v[i] for t, v in bwd.items()},
                     activation_bytes=4096, param_bytes=1_000_000) for i in range(6)))
    vws = (VirtualWorkerPlan(0, (StagePlan("n0.g0", "emu_fast", 0, 3, 0.3, 0.6, send_time=0.01),
                                 StagePlan("n0.g1", "emu_fast", 3, 6, 0.3, 0.6))),
           VirtualWorkerPlan(1, (StagePlan("n2.g0", "emu_slow", 0, 6, 2.4, 4.8),)))
    plan = Plan(6, 2, 0, "manual", vws, (ShardPlan(0, "n1", (0, 2, 4)), ShardPlan(1, "n1", (1, 3, 5))),
                minibatch_size=4)
    return vclock.Setting(TINY, text, validation_set(val, TINY), dm, prof, CLUSTER, plan)


def test_baseline_step_models_on_the_device_model():
    s = tiny_setting()
    ddp = vclock.baseline(s, "ddp")
    # Every device one minibatch: emu_slow's 7.2 s, then 6 MB over 6 devices across nodes (ring: 10 steps).
    assert ddp.windows == 24 and ddp.parts["compute"] == pytest.approx(7.2)
    assert ddp.parts["all-reduce"] == pytest.approx(10 / 6 * 6e6 / 2.5e8 + 10 * 1e-4)
    fast = vclock.baseline(s, "ddp-fast")          # the two emu_fast: 8 / 1.8 ties 16 / 3.6 (fewer devices win)
    assert fast.windows == 8 and fast.step_s == pytest.approx(1.8 + 6e6 / 2e9 + 2 * 2e-5)
    hetero = vclock.baseline(s, "hetero-dp")       # speeds 4:4:2:2:1:1 of 24 windows: 7, 7, 3, 3, 2, 2
    assert hetero.windows == 24 and hetero.parts["compute"] == pytest.approx(max(1.8 * 7, 3.6 * 3, 7.2 * 2) / 4)
    # One layer per device, 6 micro-batches: at least the slowest stage's 5 more after the first one's
    # round trip, (M - 1) max(f + b) + sum(f + b) = 5 x 1.2 + 4.2 (with transfers: up to 2 x 5 of them more).
    pipe = vclock.baseline(s, "pipelining")
    assert pipe.windows == 24 and 10.2 <= pipe.step_s <= 10.2 + 10 * (1e-4 + 4096 / 2.5e8)


def test_runners_put_points_on_the_virtual_clock():
    s = tiny_setting()
    points, b = vclock.run_baseline(s, "ddp", 4, 1e-2, 0, evals=2)
    assert [p[0] for p in points] == pytest.approx([0.0, 2 * b.step_s, 4 * b.step_s])
    assert [p[1] for p in points] == [0, 48, 96] and points[-1][2] < points[0][2]
    # DDP and hetero-aware DP apply the same update (the mean over the same 24 windows): one curve.
    other, _ = vclock.run_baseline(s, "hetero-dp", 4, 1e-2, 0, evals=2)
    assert [p[2] for p in other] == [p[2] for p in points]
    hp, run = vclock.run_hetpipe(s, 8, 1e-2, 0, d=1, evals=4)
    assert [p[0] for p in hp] == [run.version_s[g] for g in (0, 1, 2, 3, 4)]
    assert [p[1] for p in hp] == [g * 2 * 2 * 4 for g in range(5)] and np.all(np.diff([p[0] for p in hp]) > 0)
    assert hp[-1][2] < hp[0][2] and set(run.staleness()) <= {0, 1}


def test_staleness_table_puts_two_records_side_by_side():
    def record(pulls):
        return RunRecord({}, {0: ShardRecord(0, [], [(0, 0, w, g, 0) for w, g in pulls])})

    table = vclock.staleness_table(record([(1, 0), (2, 1), (3, 3)]), record([(1, 1), (2, 1), (3, 2), (4, 2)]))
    assert table.splitlines() == [
        "w - g |        simulated |         measured",
        "    0 |      1 ( 33.3%) |      1 ( 25.0%)",
        "    1 |      2 ( 66.7%) |      2 ( 50.0%)",
        "    2 |      0 (  0.0%) |      1 ( 25.0%)",
        "pulls |                3 |                4"]


def test_hetpipe_rows_carry_the_outer_optimizer_into_the_replay():
    """Two VWs at D = 0: ``mean`` with outer lr 2 moves the weights by 2 x (delta / 2) per push, which is
    exactly ``sum``'s delta (both factors are powers of two), so every wave's weights and hence every
    validation loss agree bitwise with ``sum``; plain ``mean`` differs from both."""
    s = tiny_setting()
    assert len(s.plan.virtual_workers) == 2
    summed, _ = vclock.run_hetpipe(s, 8, 1e-2, 0, d=0, aggregate="sum", evals=4)
    scaled, _ = vclock.run_hetpipe(s, 8, 1e-2, 0, d=0, aggregate="mean", evals=4, outer={"outer_lr": 2.0})
    plain, _ = vclock.run_hetpipe(s, 8, 1e-2, 0, d=0, aggregate="mean", evals=4)
    assert [p[2] for p in scaled] == [p[2] for p in summed]
    assert [p[2] for p in plain][1:] != [p[2] for p in summed][1:]
