"""The PS's outer optimizer (hetpipe.plan.outer) in the Python shard, against references written here: plain
PyTorch's Nesterov SGD on the pseudo-gradient, the explicit plain WSP rule, the explicit staleness
decays and sqrt gain, a loop of Async Local-SGD's Delayed Nesterov; the plan fields, the Trainer's and the
command line's options; the momentum buffer and delayed Nesterov's state through a checkpoint and back."""

import json
import math

import numpy as np
import pytest
import torch

from hetpipe.checkpoint import state as ckpt
from hetpipe.job.roles import Role
from hetpipe.plan.types import Plan
from hetpipe.ps.shard import ShardState
from hetpipe.run.checkpoints import RunCheckpoints
from hetpipe.run.config import PSRule

# One shard owning layers 0, 1, 2; VW 0 in one stage, VW 1 in two, VW 2 in two (another cut).
LAYERS = {0: 50, 1: 33, 2: 17}
CUTS = [[(0, 3)], [(0, 1), (1, 3)], [(0, 2), (2, 3)]]


def _init(seed=0):
    rng = np.random.default_rng(seed)
    return {l: rng.standard_normal(n).astype(np.float32) for l, n in LAYERS.items()}


def _layer_delta(vw, layer, wave):
    rng = np.random.default_rng(10_000 * vw + 100 * layer + wave)
    return (rng.standard_normal(LAYERS[layer]) * 0.05).astype(np.float32)


def _push_wave(shard, wave, vws=None, offset=0):
    """Every stage of every VW (or of ``vws``) pushes ``wave``: its layers' deltas (those of wave ``wave +
    offset``), back to back; to a Python shard or a core plane's state alike."""
    push = getattr(shard, "plane", shard).push
    for vw in range(shard.num_vws) if vws is None else vws:
        for stage, layers in sorted(shard.stage_layers[vw].items()):
            push(vw, stage, wave, np.concatenate([_layer_delta(vw, l, wave + offset) for l in layers]))


def _aggregated(wave, num_vws, mean):
    """The wave's aggregated delta per layer: each VW's delta (divided by N with mean), summed in VW order."""
    out = {}
    for l in LAYERS:
        acc = np.zeros(LAYERS[l], np.float32)
        for vw in range(num_vws):
            d = _layer_delta(vw, l, wave)
            acc += d / np.float32(num_vws) if mean else d
        out[l] = acc
    return out


# --- (a) nesterov against torch.optim.SGD(nesterov=True) on the pseudo-gradient --------------------------------
@pytest.mark.parametrize("aggregate, lr, mu, vws", [("mean", 0.7, 0.9, 3), ("sum", 0.35, 0.6, 2), ("mean", 1.0, 0.0, 3)])
def test_nesterov_equals_torch_sgd_on_the_pseudo_gradient(aggregate, lr, mu, vws):
    init = _init()
    shard = ShardState(0, init, CUTS[:vws], 0, aggregate=aggregate, outer="nesterov", outer_lr=lr, outer_momentum=mu)
    params = {l: torch.nn.Parameter(torch.from_numpy(init[l].copy())) for l in LAYERS}
    # torch refuses nesterov without momentum; with mu = 0 the outer step is plain SGD on g.
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=mu, nesterov=mu > 0)
    for wave in range(6):
        _push_wave(shard, wave)
        assert shard.applied == wave + 1
        for l, delta in _aggregated(wave, vws, aggregate == "mean").items():
            params[l].grad = torch.from_numpy(-delta)
        opt.step()
        for l, p in params.items():
            np.testing.assert_allclose(shard.W[l], p.detach().numpy(), rtol=1e-6, atol=1e-6, err_msg=f"layer {l}")
            buf = opt.state[p]["momentum_buffer"].numpy() if mu > 0 else -_aggregated(wave, vws, aggregate == "mean")[l]
            np.testing.assert_allclose(shard.M[l], buf, rtol=1e-6, atol=1e-7)
    moved = sum(float(np.abs(shard.W[l] - init[l]).sum()) for l in LAYERS)
    assert moved > 0.1


def test_nesterov_differs_from_the_plain_rule():
    plain = ShardState(0, _init(), CUTS, 0, aggregate="mean")
    nesterov = ShardState(0, _init(), CUTS, 0, aggregate="mean", outer="nesterov", outer_lr=1.0, outer_momentum=0.9)
    for wave in range(3):
        _push_wave(plain, wave)
        _push_wave(nesterov, wave)
    assert not np.allclose(plain.W[0], nesterov.W[0], atol=1e-4)


# --- (c) the default is the plain rule, bit for bit -------------------------------------------------------------
@pytest.mark.parametrize("aggregate", ["mean", "sum"])
def test_default_is_the_explicit_plain_rule_bitwise(aggregate):
    init = _init(1)
    shard = ShardState(0, init, CUTS, 0, aggregate=aggregate)
    want = {l: w.copy() for l, w in init.items()}
    for wave in range(5):
        _push_wave(shard, wave)
        for vw in range(3):                       # W <- W + delta (/ N), push by push in VW order
            for l in LAYERS:
                d = _layer_delta(vw, l, wave)
                want[l] = want[l] + (d / np.float32(3) if aggregate == "mean" else d)
    for l in LAYERS:
        assert np.array_equal(shard.W[l], want[l]), f"layer {l}"
        assert shard.M[l].size == 0


def test_sgd_with_an_outer_lr_scales_each_aggregated_push():
    init = _init(2)
    lr = 0.55
    shard = ShardState(0, init, CUTS, 0, aggregate="mean", outer="sgd", outer_lr=lr)
    want = {l: w.copy() for l, w in init.items()}
    for wave in range(3):
        _push_wave(shard, wave)
        for vw in range(3):
            for l in LAYERS:
                want[l] = want[l] + np.float32(lr) * (_layer_delta(vw, l, wave) / np.float32(3))
    for l in LAYERS:
        assert np.array_equal(shard.W[l], want[l]), f"layer {l}"


# --- the staleness scale ----------------------------------------------------------------------------------------
def _pull(shard, vw, stage, wave):
    shard.pull(None, vw, stage, wave)
    ready = shard.ready_pulls()
    assert [(v, s, w) for _, v, s, w in ready] == [(vw, stage, wave)]
    shard.answered(ready)
    return shard.log.pulls[-1][3]


def _two_waves(init, outer, parts_of):
    """The numpy reference of two waves of two VWs at outer_lr 0.8 and outer_momentum 0.5: ``parts_of(wave,
    layer)`` gives each VW's scaled delta in apply order; sgd adds each, nesterov steps on their sum."""
    w = {l: x.copy() for l, x in init.items()}
    m = {l: np.zeros_like(x) for l, x in init.items()}
    for wave in (0, 1):
        for l in LAYERS:
            parts = parts_of(wave, l)
            if outer == "sgd":
                for p in parts:
                    w[l] = w[l] + np.float32(0.8) * p
            else:
                g = -(np.zeros_like(w[l]) + parts[0] + parts[1])
                m[l] = np.float32(0.5) * m[l] + g
                w[l] = w[l] - np.float32(0.8) * (np.float32(0.5) * m[l] + g)
    return w


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
def test_inverse_staleness_divides_a_push_by_one_plus_its_lag(outer):
    """Two VWs of one stage, D = 1, sum: VW 0 runs a wave ahead, so its pull of wave 1 gets version 0
    (lag 1: its wave-1 push counts half) while VW 1's gets version 1 (lag 0)."""
    cuts = [[(0, 3)], [(0, 3)]]
    init = _init(3)
    shard = ShardState(0, init, cuts, 1, aggregate="sum", outer=outer, outer_lr=0.8, outer_momentum=0.5,
                       outer_staleness="inverse")
    _push_wave(shard, 0, vws=[0])
    assert _pull(shard, 0, 0, 1) == 0                 # VW 0 pulls wave 1 before VW 1 finished wave 0
    _push_wave(shard, 0, vws=[1])
    assert _pull(shard, 1, 0, 1) == 1
    _push_wave(shard, 1)
    assert shard.applied == 2
    divisors = ((1, 1), (2, 1))
    w = _two_waves(init, outer, lambda wave, l: [_layer_delta(vw, l, wave) / np.float32(k) if k > 1
                                                 else _layer_delta(vw, l, wave)
                                                 for vw, k in enumerate(divisors[wave])])
    for l in LAYERS:
        assert np.array_equal(shard.W[l], w[l]), f"layer {l}"


def test_inverse_staleness_changes_nothing_at_d0():
    plain = ShardState(0, _init(), CUTS, 0, aggregate="mean")
    scaled = ShardState(0, _init(), CUTS, 0, aggregate="mean", outer_staleness="inverse")
    for wave in range(4):
        for shard in (plain, scaled):
            if wave:
                for vw in range(3):
                    for stage in shard.stage_layers[vw]:
                        _pull(shard, vw, stage, wave)
            _push_wave(shard, wave)
    for l in LAYERS:
        assert np.array_equal(plain.W[l], scaled.W[l])


def _root(x) -> np.float32:
    """The float32 square root of ``x`` as float64's root rounded once (equal to the correctly rounded
    float32 root: float64 carries more than 2 * 24 + 2 bits), independent of the shards' float32 np.sqrt."""
    return np.float32(math.sqrt(x))


@pytest.mark.parametrize("aggregate", ["mean", "sum"])
def test_sqrt_gain_divides_each_push_by_the_root_of_the_vw_count_whatever_the_aggregate(aggregate):
    init = _init(4)
    lr = 0.55
    shard = ShardState(0, init, CUTS, 0, aggregate=aggregate, outer_lr=lr, outer_gain="sqrt")
    mean = ShardState(0, init, CUTS, 0, aggregate="mean")
    total = ShardState(0, init, CUTS, 0, aggregate="sum")
    want = {l: w.copy() for l, w in init.items()}
    for wave in range(3):
        for s in (shard, mean, total):
            _push_wave(s, wave)
        for vw in range(3):
            for l in LAYERS:
                want[l] = want[l] + np.float32(lr) * (_layer_delta(vw, l, wave) / _root(3))
    for l in LAYERS:
        assert np.array_equal(shard.W[l], want[l]), f"layer {l}"
    # Between the mean's step and the sum's: each push counts 1/sqrt(3) (times lr).
    moved = {name: sum(float(np.abs(s.W[l] - init[l]).sum()) for l in LAYERS)
             for name, s in (("mean", mean), ("sum", total))}
    gained = sum(float(np.abs(shard.W[l] - init[l]).sum()) for l in LAYERS) / lr
    assert moved["mean"] < gained < moved["sum"]


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
@pytest.mark.parametrize("staleness, gain", [("sqrt", "none"), ("sqrt", "sqrt"), ("inverse", "sqrt")])
def test_staleness_decay_and_gain_divide_a_push_by_their_float32_product(outer, staleness, gain):
    """The scene of the inverse test (VW 0's wave-1 push lags 1, VW 1's 0; sum): each push divided by
    float32(gain * decay), gain sqrt(2) or 1, decay sqrt(1 + s) or 1 + s."""
    cuts = [[(0, 3)], [(0, 3)]]
    init = _init(5)
    shard = ShardState(0, init, cuts, 1, aggregate="sum", outer=outer, outer_lr=0.8, outer_momentum=0.5,
                       outer_staleness=staleness, outer_gain=gain)
    _push_wave(shard, 0, vws=[0])
    assert _pull(shard, 0, 0, 1) == 0
    _push_wave(shard, 0, vws=[1])
    assert _pull(shard, 1, 0, 1) == 1
    _push_wave(shard, 1)
    assert shard.applied == 2
    g_ref = _root(2) if gain == "sqrt" else np.float32(1)

    def divisor(lag):
        decay = _root(1 + lag) if staleness == "sqrt" else np.float32(1 + lag)
        return np.float32(g_ref * decay)

    assert divisor(1) != np.float32(2) and divisor(1) > 1
    lags = ((0, 0), (1, 0))
    w = _two_waves(init, outer, lambda wave, l: [_layer_delta(vw, l, wave) / divisor(lag)
                                                 for vw, lag in enumerate(lags[wave])])
    for l in LAYERS:
        assert np.array_equal(shard.W[l], w[l]), f"layer {l}"


# --- delayed Nesterov (Async Local-SGD) ---------------------------------------------------------------------------
def _delayed_nesterov(init, waves, vws, n, eps, beta, period, state=None):
    """Liu et al.'s Delayed Nesterov (arXiv 2401.09135, momentum activation c = 0) over the pushes of a layer:
    server update t is one VW's delta (VW order within a wave), its pseudo-gradient g_t = -delta, weighted
    g_t / n (the paper's N; a float32 division). theta <- theta - eps * g_t / n; Delta <- Delta + g_t / n (the
    weighted sum, the paper's Delta / N); when t pushes since the last momentum step reach ``period``:
    m <- beta * m + Delta, theta <- theta - eps * beta * m (the paper's eps * (beta * m + g_t / N) as two
    steps), Delta <- 0. ``state``: (m, Delta, t) per layer to start from (else zeros). Returns
    (theta, m, Delta, t) per layer."""
    out = {}
    for l, w0 in init.items():
        theta = w0.copy()
        m, delta, t = (x.copy() if isinstance(x, np.ndarray) else x for x in state[l]) if state else \
            (np.zeros_like(w0), np.zeros_like(w0), 0)
        for wave in waves:
            for vw in range(vws):
                g = -(_layer_delta(vw, l, wave) / np.float32(n))
                theta = theta - np.float32(eps) * g
                delta = delta + g
                t += 1
                if t >= period:
                    m = np.float32(beta) * m + delta
                    theta = theta - np.float32(eps) * (np.float32(beta) * m)
                    delta, t = np.zeros_like(delta), 0
        out[l] = (theta, m, delta, t)
    return out


@pytest.mark.parametrize("aggregate, delay", [("mean", 0), ("mean", 2), ("sum", 5), ("mean", 6)])
def test_delayed_nesterov_equals_the_papers_loop_bitwise(aggregate, delay):
    init = _init(6)
    shard = ShardState(0, init, CUTS, 0, aggregate=aggregate, outer="delayed-nesterov", outer_lr=0.7,
                       outer_momentum=0.9, outer_delay=delay)
    for wave in range(7):
        _push_wave(shard, wave)
    want = _delayed_nesterov(init, range(7), 3, 3 if aggregate == "mean" else 1, 0.7, 0.9, delay or 3)
    for l, (theta, m, delta, t) in want.items():
        assert np.array_equal(shard.W[l], theta), f"layer {l}"
        assert np.array_equal(shard.M[l], m) and np.abs(m).sum() > 0, f"layer {l}"
        assert np.array_equal(shard.A[l], -delta) and shard.outer_counts()[l] == t, f"layer {l}"
    if delay == 2:
        assert all(shard.outer_counts()[l] == 1 and np.abs(shard.A[l]).sum() > 0 for l in LAYERS)


def test_delayed_nesterov_at_the_default_delay_is_nesterov_up_to_rounding():
    """One momentum step per wave, on the wave's pushes: nesterov's step (torch's SGD(nesterov=True) on the
    pseudo-gradient) in real numbers; a delay of two waves is another rule."""
    init = _init(7)
    shard = ShardState(0, init, CUTS, 0, aggregate="mean", outer="delayed-nesterov", outer_lr=0.7, outer_momentum=0.9)
    longer = ShardState(0, init, CUTS, 0, aggregate="mean", outer="delayed-nesterov", outer_lr=0.7,
                        outer_momentum=0.9, outer_delay=6)
    params = {l: torch.nn.Parameter(torch.from_numpy(init[l].copy())) for l in LAYERS}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for wave in range(6):
        _push_wave(shard, wave)
        _push_wave(longer, wave)
        for l, delta in _aggregated(wave, 3, True).items():
            params[l].grad = torch.from_numpy(-delta)
        opt.step()
        for l, p in params.items():
            np.testing.assert_allclose(shard.W[l], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"layer {l}")
            assert not shard.A[l].any() and shard.outer_counts()[l] == 0
    assert not np.allclose(longer.W[0], shard.W[0], atol=1e-4)


def test_a_resumed_count_past_a_smaller_delay_steps_at_the_next_push():
    init = _init(8)
    rng = np.random.default_rng(3)
    state = {l: (rng.standard_normal(n).astype(np.float32) * 0.1, rng.standard_normal(n).astype(np.float32) * 0.1, 5)
             for l, n in LAYERS.items()}
    shard = ShardState(0, init, CUTS, 0, aggregate="mean", outer="delayed-nesterov", outer_lr=0.6,
                       outer_momentum=0.8, outer_delay=2,
                       momentum={l: m for l, (m, _, _) in state.items()},
                       delayed=({l: -a for l, (_, a, _) in state.items()}, {l: n for l, (_, _, n) in state.items()}))
    _push_wave(shard, 0)
    want = _delayed_nesterov(init, [0], 3, 3, 0.6, 0.8, 2, state)
    for l, (theta, m, delta, t) in want.items():
        assert np.array_equal(shard.W[l], theta) and np.array_equal(shard.M[l], m), f"layer {l}"
        assert np.array_equal(shard.A[l], -delta) and shard.outer_counts()[l] == t == 0, f"layer {l}"
    with pytest.raises(ValueError, match="PS shard 0: the outer buffer of layer 0 counts -1 pushes"):
        ShardState(0, init, CUTS, 0, outer="delayed-nesterov", delayed=({}, {0: -1}))


def test_the_start_up_line_names_the_sqrt_gain():
    import dataclasses

    from hetpipe.plan.types import ShardPlan, StagePlan, VirtualWorkerPlan
    from hetpipe.run.explain import update_rule

    vws = tuple(VirtualWorkerPlan(v, (StagePlan(f"n{v}.g0", "cpu", 0, 2, 0.0, 0.0),)) for v in range(4))
    plan = Plan(2, 1, 0, "NP", vws, (ShardPlan(0, "n0", (0, 1)),))
    assert "sqrt" not in update_rule(plan, 32)
    assert "outer_gain 'sqrt' divides each VW's update by sqrt(4) instead" in \
        update_rule(dataclasses.replace(plan, outer_gain="sqrt"), 32)


def test_outer_options_in_records_and_summaries():
    from hetpipe.plan.outer import check_outer, describe_outer, recorded_outer

    nesterov = check_outer("t", "nesterov", 0.7, 0.9)
    # What a record kept before outer_gain and outer_delay existed, so those records still match.
    assert recorded_outer(nesterov) == {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9,
                                        "outer_staleness": "none"}
    delayed = check_outer("t", "delayed-nesterov", 0.5, 0.8, "sqrt", "sqrt", 0)
    assert recorded_outer(delayed) == {"outer": "delayed-nesterov", "outer_lr": 0.5, "outer_momentum": 0.8,
                                       "outer_staleness": "sqrt", "outer_gain": "sqrt"}
    assert describe_outer(delayed) == "delayed-nesterov (lr 0.5, momentum 0.8, delay N, sqrt gain, sqrt staleness)"


# --- options: checks, the plan, the Trainer, the command line ---------------------------------------------------
def _plan(**fields):
    from hetpipe.plan.types import ShardPlan, StagePlan, VirtualWorkerPlan

    stage = StagePlan("n0.g0", "cpu", 0, 2, 0.0, 0.0)
    return Plan(2, 1, 0, "NP", (VirtualWorkerPlan(0, (stage,)),), (ShardPlan(0, "n0", (0, 1)),), **fields)


@pytest.mark.parametrize("field, value, message", [
    ("outer", "adam", "plan: outer must be one of \\['sgd', 'nesterov', 'delayed-nesterov'\\], got 'adam'"),
    ("outer_lr", 0.0, "plan: outer_lr must be a finite number > 0, got 0.0"),
    ("outer_lr", -1, "plan: outer_lr must be a finite number > 0, got -1"),
    ("outer_lr", float("nan"), "plan: outer_lr must be a finite number > 0, got nan"),
    ("outer_lr", float("inf"), "plan: outer_lr must be a finite number > 0, got inf"),
    ("outer_lr", "1", "plan: outer_lr must be a finite number > 0, got '1'"),
    ("outer_momentum", 1.0, "plan: outer_momentum must be a number in \\[0, 1\\), got 1.0"),
    ("outer_momentum", -0.1, "plan: outer_momentum must be a number in \\[0, 1\\), got -0.1"),
    ("outer_staleness", "linear", "plan: outer_staleness must be one of \\['none', 'inverse', 'sqrt'\\], got 'linear'"),
    ("outer_gain", "mean", "plan: outer_gain must be one of \\['none', 'sqrt'\\], got 'mean'"),
    ("outer_delay", -1, "plan: outer_delay must be an integer >= 0 \\(0: the VW count\\), got -1"),
    ("outer_delay", 2.0, "plan: outer_delay must be an integer >= 0 \\(0: the VW count\\), got 2.0"),
    ("outer_delay", True, "plan: outer_delay must be an integer >= 0 \\(0: the VW count\\), got True"),
])
def test_bad_outer_fields_are_value_errors_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        _plan(**{field: value})


def test_outer_fields_round_trip_and_old_plans_read_as_the_plain_rule():
    plan = _plan(outer="delayed-nesterov", outer_lr=0.7, outer_momentum=0.8, outer_staleness="sqrt",
                 outer_gain="sqrt", outer_delay=5)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.outer_options == {"outer": "delayed-nesterov", "outer_lr": 0.7,
                                                   "outer_momentum": 0.8, "outer_staleness": "sqrt",
                                                   "outer_gain": "sqrt", "outer_delay": 5}
    old = json.loads(_plan().to_json())
    for name in ("outer", "outer_lr", "outer_momentum", "outer_staleness", "outer_gain", "outer_delay"):
        del old[name]
    assert Plan.from_dict(old).outer_options == {"outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.9,
                                                 "outer_staleness": "none", "outer_gain": "none", "outer_delay": 0}


def test_shards_refuse_bad_options_naming_the_field():
    with pytest.raises(ValueError, match="PS shard 0: outer_momentum must be a number in \\[0, 1\\), got 1.5"):
        ShardState(0, _init(), CUTS, 0, outer="nesterov", outer_momentum=1.5)
    with pytest.raises(ValueError, match="PS shard 0: outer must be one of"):
        ShardState(0, _init(), CUTS, 0, outer="Nesterov")


def test_trainer_overrides_the_plans_outer_fields():
    from hetpipe.run.trainer import Trainer

    data = [(torch.randn(4, 3), torch.randn(4, 2))]
    model = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)     # noqa: E731
    got = Trainer(model, torch.nn.functional.mse_loss, sgd, data, plan=_plan(),
                  ps=PSRule(outer="nesterov", outer_lr=0.5)).resolve_plan()
    assert got.outer_options == {"outer": "nesterov", "outer_lr": 0.5, "outer_momentum": 0.9, "outer_staleness": "none",
                                 "outer_gain": "none", "outer_delay": 0}
    kept = Trainer(model, torch.nn.functional.mse_loss, sgd, data, plan=_plan(outer_staleness="inverse")).resolve_plan()
    assert kept.outer_staleness == "inverse"
    delayed = Trainer(model, torch.nn.functional.mse_loss, sgd, data, plan=_plan(outer_staleness="inverse"),
                      ps=PSRule(outer="delayed-nesterov", outer_gain="sqrt", outer_delay=4)).resolve_plan()
    assert (delayed.outer, delayed.outer_gain, delayed.outer_delay, delayed.outer_staleness) == \
        ("delayed-nesterov", "sqrt", 4, "inverse")
    with pytest.raises(ValueError, match="ps: outer_lr must be a finite number > 0, got 0"):
        Trainer(model, torch.nn.functional.mse_loss, sgd, data, plan=_plan(), ps=PSRule(outer_lr=0))
    with pytest.raises(ValueError, match="ps: outer_delay must be an integer >= 0"):
        PSRule(outer_delay=-3)


def test_cli_plan_writes_the_outer_fields(tmp_path, capsys):
    from hetpipe.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--aggregate", "sum", "--outer",
                 "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.8", "--outer-staleness", "inverse",
                 "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert (plan.aggregate, plan.outer, plan.outer_lr, plan.outer_momentum, plan.outer_staleness) == \
        ("sum", "nesterov", 0.7, 0.8, "inverse")
    assert "outer nesterov (lr 0.7, momentum 0.8, inverse staleness)" in capsys.readouterr().out
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--outer", "delayed-nesterov",
                 "--outer-staleness", "sqrt", "--outer-gain", "sqrt", "--outer-delay", "6", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert (plan.outer, plan.outer_staleness, plan.outer_gain, plan.outer_delay) == \
        ("delayed-nesterov", "sqrt", "sqrt", 6)
    assert ("outer delayed-nesterov (lr 1, momentum 0.9, delay 6, sqrt gain, sqrt staleness)"
            in capsys.readouterr().out)
    assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--outer-momentum", "1"]) == 2
    assert "hetpipe plan: plan: outer_momentum must be a number in [0, 1), got 1.0" in capsys.readouterr().err


# --- (d) the momentum buffer through a checkpoint ---------------------------------------------------------------
def _checkpoint(tmp_path, shard, clock):
    manifest = lambda c: {"format": 1, "run_id": "r", "clock": c, "parts": ["rank-00000"], "plan": {}}  # noqa: E731
    writer = ckpt.Checkpointer(tmp_path, 1, 0, manifest, keep=0, run_id="r")
    writer.boundary(clock, lambda: RunCheckpoints.shard_snapshot(shard, Role(0, "ps", shard=0), 0))
    writer.close()
    return ckpt.Checkpoint.find(tmp_path)


@pytest.mark.parametrize("plane", ["python", "core"])
def test_momentum_round_trips_through_a_checkpoint_and_the_run_continues_bitwise(tmp_path, plane):
    from hetpipe.ps.core_plane import CoreShardState

    options = dict(aggregate="mean", outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    whole = ShardState(0, _init(), CUTS, 0, **options)
    for wave in range(6):
        _push_wave(whole, wave)
    first = ShardState(0, _init(), CUTS, 0, **options)
    for wave in range(3):
        _push_wave(first, wave)
    found = _checkpoint(tmp_path, first, 3)
    weights, buffers = found.global_weights()
    momentum = found.global_momentum()
    assert sorted(momentum) == sorted(LAYERS)
    for l in LAYERS:
        assert np.array_equal(momentum[l], first.M[l]) and np.abs(momentum[l]).sum() > 0
    make = ShardState if plane == "python" else CoreShardState
    resumed = make(0, weights, CUTS, 0, buffers=buffers, momentum=momentum, **options)
    for wave in range(3):                               # the resumed run's waves count from the cut
        _push_wave(resumed, wave, offset=3)
    for l in LAYERS:
        assert np.array_equal(resumed.W[l], whole.W[l]), f"layer {l}"
        assert np.array_equal(resumed.M[l], whole.M[l]), f"layer {l}"


def test_a_checkpoint_without_momentum_resumes_from_zeros(tmp_path):
    plain = ShardState(0, _init(), CUTS, 0)
    _push_wave(plain, 0)
    found = _checkpoint(tmp_path, plain, 1)
    assert found.global_momentum() == {}
    weights, _ = found.global_weights()
    resumed = ShardState(0, weights, CUTS, 0, outer="nesterov", momentum=found.global_momentum())
    assert all(np.array_equal(resumed.M[l], np.zeros(n, np.float32)) for l, n in LAYERS.items())
    with pytest.raises(ValueError, match="PS shard 0: the outer momentum of layer 1 has 3 elements, its weights 33"):
        ShardState(0, weights, CUTS, 0, outer="nesterov", momentum={1: np.zeros(3, np.float32)})



@pytest.mark.parametrize("plane", ["python", "core"])
def test_delayed_nesterov_state_round_trips_through_a_checkpoint_and_the_run_continues_bitwise(tmp_path, plane):
    """A momentum step every 2 pushes, 3 VWs: the cut after 3 waves (9 pushes) falls inside a window."""
    from hetpipe.ps.core_plane import CoreShardState

    options = dict(aggregate="mean", outer="delayed-nesterov", outer_lr=0.7, outer_momentum=0.9, outer_delay=2,
                   outer_gain="sqrt")
    whole = ShardState(0, _init(), CUTS, 0, **options)
    for wave in range(6):
        _push_wave(whole, wave)
    make = ShardState if plane == "python" else CoreShardState
    first = make(0, _init(), CUTS, 0, **options)
    for wave in range(3):
        _push_wave(first, wave)
    found = _checkpoint(tmp_path, first, 3)
    weights, buffers = found.global_weights()
    momentum, (pending, counts) = found.global_momentum(), found.global_delayed()
    assert sorted(momentum) == sorted(pending) == sorted(counts) == sorted(LAYERS)
    for l in LAYERS:
        assert np.array_equal(momentum[l], first.M[l]) and np.array_equal(pending[l], first.A[l])
        assert counts[l] == first.outer_counts()[l] == 1 and np.abs(pending[l]).sum() > 0
    resumed = make(0, weights, CUTS, 0, buffers=buffers, momentum=momentum, delayed=(pending, counts), **options)
    for wave in range(3):
        _push_wave(resumed, wave, offset=3)
    for l in LAYERS:
        assert np.array_equal(resumed.W[l], whole.W[l]), f"layer {l}"
        assert np.array_equal(resumed.M[l], whole.M[l]) and np.array_equal(resumed.A[l], whole.A[l]), f"layer {l}"
        assert resumed.outer_counts()[l] == whole.outer_counts()[l]
    # Resumed from zeros instead, the run goes elsewhere: the state mattered.
    fresh = ShardState(0, weights, CUTS, 0, buffers=buffers, **options)
    for wave in range(3):
        _push_wave(fresh, wave, offset=3)
    assert not np.array_equal(fresh.W[0], whole.W[0])
