"""bench/convergence's task and bookkeeping: corpus split, minibatch stream, causal model, snapshots, curves."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH / "convergence"), str(BENCH / "e2e")]

import snapshots  # noqa: E402
from curves import loss_at, time_to_target  # noqa: E402
from emulate import Emulated  # noqa: E402
from hetpipe.stage.pacer import Pacer
from task import (Embed, MinibatchStream, TaskSpec, build_layers, corpus, evaluate, loss_fn, stdlib_files,  # noqa: E402
                  validation_set)

SMALL = TaskSpec(context=16, width=16, heads=2, blocks=2, minibatch=4, train_bytes=1 << 18, val_windows=8)


def test_corpus_holds_out_whole_files_and_is_deterministic():
    tr, va, about = corpus(SMALL)
    files = stdlib_files()
    held = [f.read_bytes() for k, f in enumerate(files) if k % SMALL.val_every == SMALL.val_every - 1]
    assert va.tobytes() == b"".join(held)
    # No held-out file's text is in the training text (checked on a long slice of each).
    train = tr.tobytes()
    for text in held:
        if len(text) > 400:
            assert text[100:400] not in train
    tr2, va2, _ = corpus(SMALL)
    assert np.array_equal(tr, tr2) and np.array_equal(va, va2)
    assert about["train_bytes"] == len(tr) == SMALL.train_bytes


def test_minibatches_are_next_byte_windows_of_the_text_fixed_by_seed_and_index():
    tr, va, _ = corpus(SMALL)
    s = MinibatchStream(tr, SMALL, seed=3, count=5)
    x, y = s[2]
    assert x.shape == y.shape == (SMALL.minibatch, SMALL.context) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = tr.tobytes()
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in text
    assert torch.equal(s[2][0], MinibatchStream(tr, SMALL, seed=3, count=9)[2][0])
    assert not torch.equal(s[2][0], MinibatchStream(tr, SMALL, seed=4, count=5)[2][0])
    cx, cy = s.concat(1, 3)
    assert torch.equal(cx, torch.cat([s[1][0], s[2][0], s[3][0]])) and torch.equal(cy[4:8], s[2][1])
    assert len(list(s)) == 5
    vx, vy = validation_set(va, SMALL)
    assert bytes(vx[1].tolist()) == va[SMALL.context:2 * SMALL.context].tobytes()


def test_model_is_causal_and_identical_per_seed():
    layers = build_layers(SMALL, seed=7)
    model = torch.nn.Sequential(*layers)
    x = torch.randint(0, 256, (2, SMALL.context))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    again = build_layers(SMALL, seed=7)
    assert all(torch.equal(p, q) for l, m in zip(layers, again) for p, q in zip(l.parameters(), m.parameters()))
    assert not torch.equal(layers[1].qkv.weight, build_layers(SMALL, seed=8)[1].qkv.weight)
    # evaluate() is the mean cross-entropy over every position, as loss_fn computes it on the whole set.
    y = torch.randint(0, 256, x.shape)
    with torch.no_grad():
        assert evaluate(layers, x, y, chunk=1) == pytest.approx(float(loss_fn(model(x), y)), rel=1e-5)


def test_emulated_pads_the_backward_of_a_module_fed_token_ids():
    clock = Pacer(1.0)
    emb = Emulated(Embed(SMALL), 0.0, 0.15, clock)
    x = torch.randint(0, 256, (2, SMALL.context))
    for _ in range(2):      # the hook is registered once and pads every backward
        out = emb(x).sum()
        t0 = time.perf_counter()
        out.backward()
        assert time.perf_counter() - t0 >= 0.15
    assert emb.inner.tok.weight.grad is not None


def test_snapshots_round_trip_and_join_parts_at_the_latest_time(tmp_path):
    a = {0: (0.0, {0: np.arange(3, dtype=np.float32)}), 1: (1.5, {0: np.ones(3, np.float32)}),
         2: (3.0, {0: np.zeros(3, np.float32)})}
    b = {0: (0.0, {1: np.full(2, 7, np.float32)}), 1: (1.75, {1: np.full(2, 8, np.float32)})}
    joined = snapshots.merge([a, b])
    assert [t for t, _ in joined] == [0.0, 1.75]          # index 2 is missing from b: dropped
    snapshots.save(tmp_path / "s.npz", joined)
    back = snapshots.load(tmp_path / "s.npz")
    assert [t for t, _ in back] == [0.0, 1.75]
    assert np.array_equal(back[1][1][0], np.ones(3)) and np.array_equal(back[1][1][1], np.full(2, 8))


def test_time_to_target_and_loss_at_budget_interpolate_linearly():
    curve = [(0.0, 5.0), (2.0, 3.0), (4.0, 2.0), (6.0, 2.5)]
    assert time_to_target(curve, 4.0) == pytest.approx(1.0)
    assert time_to_target(curve, 2.5) == pytest.approx(3.0)
    assert time_to_target(curve, 5.5) == 0.0
    assert time_to_target(curve, 1.9) is None
    assert loss_at(curve, 5.0) == pytest.approx(2.25)
    assert loss_at(curve, 9.0) == 2.5                     # ended before the budget: its last value


def test_outer_comparison_runs_every_rule_at_every_d_and_its_jobs_round_trip(tmp_path):
    import outer
    from job import load_jobs, save_jobs

    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    stages = (StagePlan("n0.g0", "emu_fast", 0, 1, 0.01, 0.02), StagePlan("n0.g1", "emu_fast", 1, 2, 0.01, 0.02))
    plan = Plan(2, 2, 0, "NP", (VirtualWorkerPlan(0, stages), VirtualWorkerPlan(1, stages)),
                (ShardPlan(0, "n0", (0, 1)),), minibatch_size=4)
    args = outer.parse_args(["--budget", "1", "--d", "0,4", "--outer-lr", "0.5", "--outer-momentum", "0.8"])
    jobs = outer.jobs_of(args, SMALL, plan, tmp_path, 4)
    assert [(j.d, j.aggregate, j.outer) for j in jobs] == [(d, a, o) for d in (0, 4) for a, o in outer.RULES]
    assert {(j.outer, j.outer_lr) for j in jobs} == {("sgd", 1.0), ("nesterov", 0.5)}
    assert outer.rule_of(jobs[3]) == "mean + nesterov (lr 0.5, momentum 0.8)" and outer.rule_of(jobs[1]) == "sum"
    save_jobs(tmp_path / "jobs.json", jobs)
    assert load_jobs(tmp_path / "jobs.json") == jobs


def test_outer_comparison_takes_the_rules_staleness_gain_and_delay_to_tune(tmp_path, capsys):
    import outer
    from job import load_jobs, save_jobs

    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    stages = (StagePlan("n0.g0", "emu_fast", 0, 1, 0.01, 0.02), StagePlan("n0.g1", "emu_fast", 1, 2, 0.01, 0.02))
    plan = Plan(2, 2, 0, "NP", (VirtualWorkerPlan(0, stages), VirtualWorkerPlan(1, stages)),
                (ShardPlan(0, "n0", (0, 1)),), minibatch_size=4)
    args = outer.parse_args(["--d", "2", "--rules", "mean:sgd,sqrt:sgd,sum:delayed-nesterov", "--outer-lr", "0.6",
                             "--outer-staleness", "sqrt", "--outer-delay", "4"])
    jobs = outer.jobs_of(args, SMALL, plan, tmp_path, 4)
    assert [(j.aggregate, j.outer_gain, j.outer, j.outer_staleness, j.outer_delay, j.outer_lr) for j in jobs] == [
        ("mean", "none", "sgd", "none", 0, 1.0), ("mean", "sqrt", "sgd", "sqrt", 0, 1.0),
        ("sum", "none", "delayed-nesterov", "sqrt", 4, 0.6)]
    assert [outer.is_plain(j) for j in jobs] == [True, False, False]
    assert [outer.rule_of(j) for j in jobs] == [
        "mean", "sqrt gain (sqrt staleness)", "sum + delayed-nesterov (lr 0.6, momentum 0.9, delay 4, sqrt staleness)"]
    save_jobs(tmp_path / "jobs.json", jobs)
    assert load_jobs(tmp_path / "jobs.json") == jobs
    with pytest.raises(SystemExit):
        outer.parse_args(["--rules", "mean:adam"])
    assert "a rule is AGG:OUTER with AGG in mean, sum, sqrt" in capsys.readouterr().err


def test_fast_subset_is_the_best_subset_of_the_fitting_devices_by_brute_force():
    from itertools import combinations

    from baselines import fast_subset

    rng = np.random.default_rng(0)
    cases = [([0.118, 0.118, 0.236, 0.236, 0.473, 0.473], [True] * 6)]
    for _ in range(200):
        n = int(rng.integers(1, 7))
        times = list(rng.choice([0.1, 0.15, 0.2, 0.3, 0.45, 0.8], size=n))
        fits = [bool(f) for f in rng.random(n) < 0.8]
        if any(fits):
            cases.append((times, fits))
    for times, fits in cases:
        got = fast_subset(times, fits, minibatch=4)
        ok = [i for i in range(len(times)) if fits[i]]
        brute = max(len(s) * 4 / max(times[i] for i in s) for k in range(1, len(ok) + 1) for s in combinations(ok, k))
        assert got.rate == pytest.approx(brute, rel=1e-12)
        assert all(fits[i] for i in got.devices)
        # the chosen devices are the fastest fitting ones, and no fewer devices reach the same rate
        fastest = sorted(ok, key=lambda i: (times[i], i))[:len(got.devices)]
        assert list(got.devices) == fastest
        assert all(r < got.rate * (1 - 1e-9) for k, r in got.candidates if k < len(got.devices))
    # the default cluster: 2 fast at 118 ms, 2 at twice and 2 at four times that; k = 2 and k = 4 tie: fewer
    got = fast_subset(*cases[0], minibatch=4)
    assert got.devices == (0, 1) and got.rate == pytest.approx(8 / 0.118)
    with pytest.raises(ValueError):
        fast_subset([0.1, 0.2], [False, False], 4)


def test_batch_split_sums_to_the_step_and_is_proportional_to_speed():
    from baselines import batch_split, proportional_shares, step_time

    assert batch_split([0.118, 0.118, 0.236, 0.236, 0.473, 0.473], 24) == [7, 7, 3, 3, 2, 2]
    assert batch_split([1.0, 1.0, 1.0], 6) == [2, 2, 2]
    assert batch_split([1.0, 100.0, 100.0], 4) == [2, 1, 1]          # the slow ones get their one window
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 8))
        times = list(rng.uniform(0.05, 2.0, size=n))
        total = int(rng.integers(n, 40))
        w = batch_split(times, total)
        assert sum(w) == total and min(w) >= 1
        share = proportional_shares(times, total)
        if min(share) >= 1:
            assert all(abs(a - b) < 1 for a, b in zip(w, share))
        order = sorted(range(n), key=lambda i: times[i])
        assert all(w[a] >= w[b] for a, b in zip(order, order[1:]))   # a faster device never gets fewer
    assert step_time([0.1, 0.4], [6, 2], 4) == pytest.approx(max(0.1 * 6 / 4, 0.4 * 2 / 4))
    with pytest.raises(ValueError):
        batch_split([1.0, 1.0, 1.0], 2)


def test_weighted_shares_average_to_the_gradient_of_the_mean_over_all_windows():
    from baselines import weighted_loss

    tr, _, _ = corpus(SMALL)
    s = MinibatchStream(tr, SMALL, seed=2, count=0)
    windows = [5, 2, 1]
    total, world = sum(windows), len(windows)
    grads = []
    for r, w in enumerate(windows):
        model = torch.nn.Sequential(*build_layers(SMALL, 3))
        x, y = s.windows(total + sum(windows[:r]), w)
        weighted_loss(loss_fn(model(x), y), w, total, world).backward()
        grads.append([p.grad for p in model.parameters()])
    ref = torch.nn.Sequential(*build_layers(SMALL, 3))
    xa, ya = s.concat(total // SMALL.minibatch, total // SMALL.minibatch)
    loss_fn(ref(xa), ya).backward()
    for k, q in enumerate(ref.parameters()):          # DDP's average: the sum over ranks / world
        assert torch.allclose(sum(g[k] for g in grads) / world, q.grad, atol=1e-6, rtol=0)
    # equal shares: the weight is exactly one (plain DDP's loss unchanged)
    assert weighted_loss(torch.tensor(2.5), 4, 24, 6).item() == 2.5


def test_stream_windows_read_the_minibatches_window_by_window():
    tr, _, _ = corpus(SMALL)
    s = MinibatchStream(tr, SMALL, seed=3, count=0)
    x, y = s.windows(8, 4)                             # a whole minibatch: minibatch 2 itself
    assert torch.equal(x, s[2][0]) and torch.equal(y, s[2][1])
    x, y = s.windows(6, 5)                             # windows 2, 3 of minibatch 1 and 0..2 of minibatch 2
    assert torch.equal(x[:2], s[1][0][2:]) and torch.equal(x[2:], s[2][0][:3])


def test_run_options_large_task_and_sweep_budget():
    import run
    from task import PRESETS

    args = run.parse_args([])
    assert args.sweep_budget == args.budget == 18.0 and args.task == "small"
    assert set(args.only.split(",")) >= {"ddp", "ddp-fast", "hetero-dp", "pipelining", "hetpipe"}
    args = run.parse_args(["--task", "large", "--budget", "120", "--sweep-budget", "40"])
    assert (args.budget, args.sweep_budget, args.lrs) == (120.0, 40.0, "1e-3,3e-3,1e-2")
    large = sum(p.numel() for l in build_layers(PRESETS["large"], 0) for p in l.parameters())
    assert large >= 2_000_000
    with pytest.raises(SystemExit):
        run.parse_args(["--only", "ddp,nonesuch"])


def test_goal_is_judged_against_the_fastest_baseline_not_ddp():
    import report
    row = lambda key, ttt, loss: {"key": key, "label": key, "ttt_mean": ttt, "loss_mean": loss}  # noqa: E731
    rows = [row("ddp", 48.0, 3.08), row("ddp-fast", 16.0, 2.70), row("pipelining", None, 3.2),
            row("hetpipe-d1-mean", 26.0, 2.86), row("hetpipe-d0-mean", 10.0, 2.72)]
    lines = report.goal_lines(rows)
    assert lines[0].startswith("best baseline: ddp-fast (16.0 s to target, val loss 2.700")
    assert "speed-up 0.62x vs the best baseline (NOT met" in lines[1]
    assert "+5.93% vs it (NOT met" in lines[1]
    assert "speed-up 1.60x vs the best baseline (met" in lines[2] and "+0.74% vs it (met" in lines[2]
    assert report.goal_lines([row("hetpipe-d0-sum", 5.0, 3.0)]) == ["goal: no baseline reached the target in this run"]
