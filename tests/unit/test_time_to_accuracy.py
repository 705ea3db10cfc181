"""Planning for time to accuracy (hetpipe.plan.time_to_accuracy): the choice against a brute force over
the candidates written out here, cases where it differs from throughput's, the command line's table and
refusals, and the noise-scale pilot (hetpipe.run.pilot) against the exact noise scale of a linear
regression."""

import math

import pytest
import torch

from hetpipe.cli import main
from hetpipe.plan import Plan, form_virtual_workers, make_plan
from hetpipe.plan.cluster import load_cluster
from hetpipe.plan.efficiency import efficiency, sample_cost, staleness_costs
from hetpipe.plan.format import format_candidates
from hetpipe.plan.profile import load_profile
from hetpipe.plan.time_to_accuracy import batch_per_update, noise_schedule, slowest_first
from hetpipe.plan.waves import with_waves
from hetpipe.run.pilot import measure_noise_scale, pilot_noise_scale

TTA = "time-to-accuracy"

# Three nodes of two GPUs each, one type per node (the HetPipe testbed's types): fast, middle, slow.
TYPES = {"titan_rtx": {"memory_bytes": 25769803776, "peak_flops": 16.3e12},
         "titan_v": {"memory_bytes": 12884901888, "peak_flops": 14.9e12},
         "quadro_p4000": {"memory_bytes": 8589934592, "peak_flops": 5.3e12}}
NODES = (("n0", "titan_rtx", 2), ("n1", "titan_v", 2), ("n2", "quadro_p4000", 2))


def cluster(dropped=()):
    """The cluster without ``dropped`` (the last devices of a node; the kept ones keep their ids)."""
    nodes = []
    for name, kind, count in NODES:
        kept = [j for j in range(count) if f"{name}.g{j}" not in dropped]
        assert kept == list(range(len(kept)))
        if kept:
            nodes.append({"name": name, "type": kind, "count": len(kept)})
    return {"name": "three", "device_types": TYPES, "nodes": nodes,
            "intra_node": {"bandwidth": 15.75e9, "latency": 1e-5}, "inter_node": {"bandwidth": 7e9, "latency": 5e-6}}


def devices_of(plan):
    return sorted(st.device for vw in plan.virtual_workers for st in vw.stages)


def goodputs(plan):
    return {(tuple(c["without"]), c["layout"]): c["goodput"]
            for c in plan.meta["time_to_accuracy"]["candidates"] if "goodput" in c}


def test_the_batch_per_update_is_the_vws_times_the_minibatch():
    assert batch_per_update(1, 32) == 32 and batch_per_update(4, 32) == 128


@pytest.mark.parametrize("model,noise,waves,costs,d", [
    ("vgg19", 200.0, "equal", "none", 0), ("resnet152", 30.0, "equal", "none", 0),
    ("resnet152", 1e6, "equal", "none", 0), ("vgg19", 200.0, "speed", "none", 0),
    ("resnet152", 1e6, "speed", "none", 0), ("resnet152", 1e6, "equal", "fitted", 1),
    ("vgg19", 200.0, "equal", "fitted", 0)])
def test_the_choice_is_the_argmax_of_a_brute_force_over_the_candidates(model, noise, waves, costs, d):
    """Every candidate planned alone at every Nm (make_plan with the throughput objective on the cluster
    without the k slowest devices, each policy, one-device VWs and one VW of every device), scored by
    samples/s x Pollux's efficiency of VWs x minibatch samples (over the sample cost of its stages, Nm and D
    when ``costs`` are priced): the planner's choice and figures are the argmax's. With
    ``waves="speed"`` each candidate's Nm is its best for equal waves and its samples/s that of the
    same plan with waves by speed (hetpipe.plan.waves.with_waves)."""
    prof = load_profile(model)
    b = prof.minibatch_size
    priced = staleness_costs(costs)

    def cost(p):
        return sample_cost([len(vw.stages) for vw in p.virtual_workers], p.nm, d, priced)

    def model_time(t):
        return sum(layer.fwd_time[t] + layer.bwd_time[t] for layer in prof.layers)

    full = load_cluster(cluster())
    pos = {d.id: i for i, d in enumerate(full.devices)}
    order = [d.id for d in sorted(full.devices, key=lambda d: (-model_time(d.type), d.type, -pos[d.id]))]
    assert order[:2] == ["n2.g1", "n2.g0"] and slowest_first(full, prof) == order
    best, seen, want = None, {}, {}
    for k in range(len(order)):
        sub = cluster(order[:k])
        everything = len(load_cluster(sub).devices)            # one VW over every device: a single pipeline
        for layout, policy, size in (("NP", "NP", None), ("ED", "ED", None), ("HD", "HD", None), ("DP", "NP", 1),
                                     ("PP", "ED", everything)):
            vws = form_virtual_workers(load_cluster(sub), policy, size)
            key = tuple(sorted(tuple(v) for v in vws))
            if key in seen:
                continue                        # the same VWs as an earlier layout: one candidate
            seen[key] = layout
            top = None
            # Nm up to twice the VW's devices; a single pipeline's up to twice a node's (a policy VW's most)
            most = max(n["count"] for n in sub["nodes"]) if layout == "PP" else max(len(v) for v in vws)
            for nm in range(1, 2 * most + 1):
                try:
                    p = make_plan(sub, prof, policy=policy, vw_size=size, nm=nm, d=d)
                except ValueError:
                    continue                    # does not fit
                n = len(p.virtual_workers)
                g = p.throughput * b * efficiency(n * b, noise, b) / cost(p)
                if top is None or g > top[0] * (1 + 1e-9):
                    top = (g, p)
            if top is None:
                continue
            if waves == "speed":
                p = with_waves(top[1], "speed")
                top = (p.throughput * b * efficiency(len(p.virtual_workers) * b, noise, b) / cost(p), p)
            if best is None or top[0] > best[0] * (1 + 1e-9):
                best = (top[0], top[1], tuple(order[:k]), layout)
            want[(tuple(order[:k]), layout)] = top[0]
    plan = make_plan(cluster(), prof, d=d, objective=TTA, noise_scale=noise, waves=waves, staleness_costs=costs)
    figures = goodputs(plan)
    assert {(w, layout.split("/")[0]): g for (w, layout), g in figures.items()} == pytest.approx(want, rel=1e-12)
    g, ref, without, layout = best
    tta = plan.meta["time_to_accuracy"]
    chosen = tta["candidates"][tta["chosen"]]
    assert (tuple(chosen["without"]), chosen["layout"].split("/")[0]) == (without, layout)
    assert chosen["goodput"] == pytest.approx(g, rel=1e-12) and chosen["relative_time"] == 1.0
    assert devices_of(plan) == devices_of(ref) and plan.nm == ref.nm
    assert plan.wave_minibatches == ref.wave_minibatches
    assert plan.throughput == pytest.approx(ref.throughput, rel=1e-12)
    assert chosen["batch_per_update"] == len(plan.virtual_workers) * b
    assert max(figures.values()) == pytest.approx(g, rel=1e-12)
    assert all(c["relative_time"] >= 1.0 for c in tta["candidates"] if "goodput" in c)
    assert Plan.from_json(plan.to_json()) == plan


def test_the_noise_schedule_is_the_argmax_of_a_brute_force_over_a_grid_of_noise_scales():
    """A plan's schedule (which candidate wins as the noise scale grows) against a brute force over the
    candidates' goodput T (B + M0) / (B + M) at 400 noise scales from the measured one to 1e7 samples: the
    interval holding each scale names the argmax (scales within 1e-6 of a switch point skipped), the
    intervals tile [measured, inf), and the last is the fastest candidate's. Planning anew inside each
    interval chooses that interval's candidate."""
    measured = 2.0
    plan = make_plan(cluster(), "resnet152", objective=TTA, noise_scale=measured)
    tta = plan.meta["time_to_accuracy"]
    schedule = tta["schedule"]
    assert schedule[0]["candidate"] == tta["chosen"] and schedule[0]["from"] == measured
    assert schedule[-1]["candidate"] == tta["fastest"] and schedule[-1]["to"] == math.inf
    assert all(a["to"] == b["from"] and a["from"] < a["to"] for a, b in zip(schedule, schedule[1:]))
    assert len(schedule) >= 2
    rows = [c for c in tta["candidates"] if "goodput" in c]
    m0 = tta["base_batch"]
    switches = [seg["to"] for seg in schedule[:-1]]
    checked = 0
    for i in range(400):
        b = measured * (1e7 / measured) ** (i / 399)
        if any(abs(b - x) <= 1e-6 * x for x in switches):
            continue
        seg = next(seg for seg in schedule if seg["from"] <= b < seg["to"])
        brute = max(rows, key=lambda r: r["samples_per_s"] * (b + m0) / (b + r["batch_per_update"]))
        assert seg["candidate"] == brute["index"], b
        checked += 1
    assert checked > 390
    for seg in schedule:                # planning anew inside each interval chooses its candidate
        b = seg["from"] * 1.01 if seg["to"] == math.inf else math.sqrt(seg["from"] * seg["to"])
        again = make_plan(cluster(), "resnet152", objective=TTA, noise_scale=b).meta["time_to_accuracy"]
        assert again["candidates"][again["chosen"]]["devices"] == tta["candidates"][seg["candidate"]]["devices"]
        assert again["candidates"][again["chosen"]]["vws"] == tta["candidates"][seg["candidate"]]["vws"]
    assert noise_schedule(rows, 1e9, tta["fastest"]) == [{"candidate": tta["fastest"], "from": 1e9, "to": math.inf}]
    # The printed schedule names every switch and says that its switch points are early.
    text = format_candidates(plan)
    line = next(x for x in text.splitlines() if "as the noise scale grows" in x)
    assert all(f"#{seg['candidate']} up to {seg['to']:.3g}" in line for seg in schedule[:-1])
    assert f"#{schedule[-1]['candidate']} beyond" in line
    assert "switch points are early" in text and "averaging of separate VWs" in text


def test_a_small_noise_scale_makes_a_wide_data_parallel_plan_lose_to_a_narrow_one():
    """ResNet-152: with a huge noise scale (every batch as efficient) the fastest candidate wins, four
    one-device VWs; with B_noise = 30 one pipeline over the four faster devices wins (batch 32 against 128);
    without that layout (one policy asked for) two VWs of two stages win (batch 64), and the throughput
    objective's plan (three VWs) is another again."""
    wide = make_plan(cluster(), "resnet152", objective=TTA, noise_scale=1e9)
    tta = wide.meta["time_to_accuracy"]
    assert tta["chosen"] == tta["fastest"]
    assert wide.policy == "DP" and [len(vw.stages) for vw in wide.virtual_workers] == [1, 1, 1, 1]
    narrow = make_plan(cluster(), "resnet152", objective=TTA, noise_scale=30.0)
    assert narrow.policy == "PP" and [len(vw.stages) for vw in narrow.virtual_workers] == [4]
    assert devices_of(narrow) == ["n0.g0", "n0.g1", "n1.g0", "n1.g1"] and narrow.nm == 4
    tta = narrow.meta["time_to_accuracy"]
    fastest = tta["candidates"][tta["fastest"]]
    assert fastest["layout"] == "DP" and fastest["samples_per_s"] > narrow.throughput * narrow.minibatch_size
    assert fastest["relative_time"] > 1.4           # the wide plan is predicted to take 51% longer
    two = make_plan(cluster(), "resnet152", policy="ED", objective=TTA, noise_scale=30.0)
    assert [len(vw.stages) for vw in two.virtual_workers] == [2, 2]
    assert not any(c["layout"] in ("DP", "PP") for c in two.meta["time_to_accuracy"]["candidates"])
    fast = make_plan(cluster(), "resnet152")
    assert len(fast.virtual_workers) == 3 and fast.throughput > two.throughput > narrow.throughput
    assert "time_to_accuracy" not in fast.meta and fast.meta["objective"] == "throughput"


def test_leaving_the_slowest_devices_out_wins():
    """VGG-19 at B_noise = 200, ED's VWs: without the slow node the two VWs' batch is 64, not 96, and the
    WSP period no longer waits for the Quadros; the best plan of the whole cluster is predicted slower."""
    plan = make_plan(cluster(), "vgg19", policy="ED", objective=TTA, noise_scale=200.0)
    assert devices_of(plan) == ["n0.g0", "n0.g1", "n1.g0", "n1.g1"]
    assert plan.meta["not_used"]["devices"] == ["n2.g1", "n2.g0"]
    assert {sh.node for sh in plan.ps_shards} <= {"n0", "n1"}
    figures = goodputs(plan)
    whole = max(g for (without, _), g in figures.items() if not without)
    assert plan.throughput * plan.minibatch_size * efficiency(64, 200.0, 32) > 1.05 * whole


def test_candidates_that_do_not_fit_are_skipped_with_their_reason():
    plan = make_plan("hetpipe-testbed", "gpt", objective=TTA, noise_scale=50.0)
    skipped = [c for c in plan.meta["time_to_accuracy"]["candidates"] if "skipped" in c]
    assert any(c["layout"] == "DP" and "fits memory" in c["skipped"] for c in skipped)
    # the smallest device sets cannot hold the model at all: one line says so, and the search stops
    assert skipped[-1]["layout"] == "any" and "more than the whole cluster" in skipped[-1]["skipped"]


def test_the_default_objective_is_unchanged_by_the_new_arguments():
    assert make_plan(cluster(), "vgg19") == make_plan(cluster(), "vgg19", objective="throughput")


@pytest.mark.parametrize("kwargs,message", [
    ({"objective": TTA}, "needs noise_scale: measure the gradient noise scale"),
    ({"objective": TTA, "noise_scale": -1.0}, "noise_scale must be a finite number >= 0"),
    ({"objective": TTA, "noise_scale": math.inf}, "noise_scale must be a finite number >= 0"),
    ({"objective": TTA, "noise_scale": "10"}, "noise_scale must be a finite number >= 0"),
    ({"objective": TTA, "noise_scale": 10.0, "base_batch": 0}, "base_batch must be a finite number > 0"),
    ({"objective": "accuracy", "noise_scale": 10.0}, "unknown objective 'accuracy'"),
    ({"noise_scale": 10.0}, "noise_scale, base_batch and staleness_costs are for objective='time-to-accuracy'"),
    ({"staleness_costs": "fitted"}, "noise_scale, base_batch and staleness_costs are for objective="),
    ({"objective": TTA, "noise_scale": 10.0, "staleness_costs": "best"}, "staleness costs are one of none, fitted"),
    ({"objective": TTA, "noise_scale": 10.0, "staleness_costs": "0.1,-1,0"},
     "StalenessCosts.averaging must be a finite number >= 0, got -1.0"),
])
def test_bad_arguments_are_refused_in_one_line_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        make_plan(cluster(), "vgg19", **kwargs)
    assert "\n" not in str(e.value)


def test_cli_prints_the_candidates_and_marks_the_choice(capsys):
    argv = ["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--objective", TTA]
    assert main(argv + ["--noise-scale", "100"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("time to accuracy: noise scale 100 samples"))
    assert lines[head + 1].split() == ["#", "layout", "without", "VWs", "Nm", "samples/s", "batch/update",
                                       "efficiency", "goodput", "time", "to", "target"]
    marked = [line for line in lines[head + 3:] if line.startswith("*  ")]
    assert len(marked) == 1 and marked[0].rstrip().endswith("1.00x")
    assert "* chosen: #" in out and "not used: n2 (4 rtx2060), n3 (4 quadro_p4000)" in out
    assert "is predicted to take 1.55x as long" in out


@pytest.mark.parametrize("extra,message", [
    ([], "hetpipe plan: --objective time-to-accuracy needs --noise-scale B: measure the gradient noise scale "
         "(samples) with a short pilot on the model and its data: hetpipe.run.pilot.measure_noise_scale("),
    (["--noise-scale", "-3"], "hetpipe plan: --noise-scale must be a finite number >= 0, got '-3'"),
    (["--noise-scale", "nan"], "hetpipe plan: --noise-scale must be a finite number >= 0, got 'nan'"),
    (["--noise-scale", "10", "--base-batch", "0"], "hetpipe plan: --base-batch must be a finite number > 0"),
])
def test_cli_refuses_without_a_good_noise_scale_in_one_line(capsys, extra, message):
    argv = ["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--objective", TTA]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_cli_refuses_a_noise_scale_without_the_objective_and_an_unknown_objective(capsys):
    argv = ["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19"]
    assert main(argv + ["--noise-scale", "10"]) == 2
    err = capsys.readouterr().err
    assert err == "hetpipe plan: --noise-scale is for --objective time-to-accuracy\n"
    with pytest.raises(SystemExit) as e:
        main(argv + ["--objective", "speed"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--objective" in err and "'speed'" in err and err.count("\n") == 1


# --- the pilot ------------------------------------------------------------------------------------------

def _regression(n=512, dim=5, seed=0):
    """A dataset, a linear model at weights off the optimum, and the exact noise scale there: per-sample
    gradients g_i = (x_i . w - y_i) x_i of 0.5 (x . w - y)^2, G their mean, Sigma their covariance over
    the dataset, B_noise = tr(Sigma) / |G|^2 (minibatches drawn with replacement make it exact)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    w_true = torch.randn(dim, generator=g, dtype=torch.float64)
    y = x @ w_true + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    model = torch.nn.Linear(dim, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_true + 0.3).unsqueeze(0))
    w = model.weight.detach()[0]
    per = (x @ w - y)[:, None] * x
    mean = per.mean(0)
    sigma = (per - mean).T @ (per - mean) / n
    return x, y, model, float(torch.trace(sigma) / (mean @ mean))


def _draws(x, y, batch, seed):
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(x), (batch,), generator=g)
        yield x[idx], y[idx]


def _mse(out, y):
    return 0.5 * ((out[:, 0] - y) ** 2).mean()


def test_the_pilot_measures_the_exact_noise_scale_of_a_linear_regression():
    """400 measurements of 8 minibatches of 4 samples: the estimate lies within 4 of its delta-method
    standard errors of the exact tr(Sigma) / |G|^2, and that error is under 5% of it (the standard error
    is itself checked: over 30 pilots of 100 measurements it matched the estimates' spread)."""
    torch.set_num_threads(1)
    x, y, model, exact = _regression()
    before = model.weight.detach().clone()
    result = pilot_noise_scale(model, _mse, _draws(x, y, 4, seed=1), k=8, rounds=400)
    assert result.batches == (4, 32) and len(result.measurements) == 400
    assert result.standard_error < 0.05 * exact
    assert abs(result.noise_scale - exact) <= 4 * result.standard_error
    assert torch.equal(model.weight, before) and model.weight.grad is None


def test_the_pilot_takes_layers_a_list_of_minibatches_and_sgd_steps_without_changing_the_model():
    torch.set_num_threads(1)
    x, y, model, exact = _regression()
    before = model.weight.detach().clone()
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 512, 8)]      # re-iterated when it runs out
    got = measure_noise_scale([model], _mse, batches, k=4, rounds=40, sgd_steps=2, lr=0.05)
    assert 0 < got < math.inf
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("kwargs,message", [
    ({"k": 1}, "measure_noise_scale\\(k\\) must be a whole number >= 2"),
    ({"rounds": 0}, "measure_noise_scale\\(rounds\\) must be a whole number >= 1"),
    ({"lr": -1.0, "sgd_steps": 1}, "measure_noise_scale\\(lr\\) must be a finite number > 0"),
])
def test_the_pilot_refuses_bad_arguments(kwargs, message):
    x, y, model, _ = _regression()
    with pytest.raises(ValueError, match=message):
        measure_noise_scale(model, _mse, _draws(x, y, 4, 0), **kwargs)


def test_the_pilot_refuses_data_that_runs_out_or_minibatches_of_several_sizes():
    x, y, model, _ = _regression()
    gen = ((x[i:i + 4], y[i:i + 4]) for i in range(0, 40, 4))      # ten minibatches, not re-iterable
    with pytest.raises(ValueError, match="the data ran out after 1 measurement"):
        measure_noise_scale(model, _mse, gen, k=8, rounds=3)
    mixed = [(x[:4], y[:4]), (x[4:12], y[4:12])]
    with pytest.raises(ValueError, match="differ in size"):
        measure_noise_scale(model, _mse, mixed, k=2, rounds=1)


# --- a job planning for time to accuracy ------------------------------------------------------------------

def _job(**planning):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
    from common import cross_entropy, mlp, sgd

    from hetpipe.run.config import Planning
    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=g)
    data = Batches(x, x[:, :10].argmax(dim=1), 16, seed=1)      # labels the model can learn: a gradient signal
    return Trainer(mlp(), cross_entropy, sgd(), data, planning=Planning(cluster="cpu-emulated", **planning))


def test_a_job_planning_for_time_to_accuracy_runs_the_pilot_on_its_own_model_and_data(capsys):
    torch.set_num_threads(1)
    trainer = _job(objective=TTA)
    plan = trainer.resolve_plan()
    assert plan.meta["objective"] == TTA
    measured = plan.meta["time_to_accuracy"]["noise_scale"]
    assert "hetpipe: noise-scale pilot: " in capsys.readouterr().err
    # the pilot: the layers, the loss and the first 8 x 16 minibatches of a one-VW run, over epochs
    work = trainer.work
    again = pilot_noise_scale(list(work.layers), work.loss_fn, work.data.vw_stream(0, 1, 8), k=8, rounds=16)
    assert measured == again.noise_scale and 0 < measured < math.inf
    assert plan.meta["time_to_accuracy"]["minibatch_size"] == 16


def test_a_job_given_a_noise_scale_plans_without_the_pilot(monkeypatch):
    import hetpipe.run.pilot as pilot

    monkeypatch.setattr(pilot, "pilot_noise_scale", lambda *a, **k: pytest.fail("ran the pilot"))
    plan = _job(objective=TTA, noise_scale=5.0).resolve_plan()
    assert plan.meta["time_to_accuracy"]["noise_scale"] == 5.0
    assert _job().resolve_plan().meta["objective"] == "throughput"


@pytest.mark.parametrize("planning,message", [
    ({"objective": "accuracy"}, "planning.objective must be one of throughput, memory_efficiency, time-to-accuracy"),
    ({"objective": TTA, "noise_scale": -1}, "planning.noise_scale must be a finite number >= 0"),
    ({"noise_scale": 3.0}, "planning.noise_scale is for objective='time-to-accuracy'"),
])
def test_planning_refuses_a_bad_objective_or_noise_scale(planning, message):
    from hetpipe.run.config import Planning

    with pytest.raises(ValueError, match=message):
        Planning(**planning)


def test_the_plan_cache_tells_the_objectives_apart():
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.run.config import Planning
    from hetpipe.run.plan_cache import plan_key

    layers, sample, cl = [torch.nn.Linear(2, 2)], (torch.zeros(4, 2), torch.zeros(4)), load_cluster("cpu-emulated")
    plain = plan_key(layers, sample, cl, "fp32", Planning())
    assert "objective" not in plain         # the keys of plans cached before the objective stay as they were
    tta = plan_key(layers, sample, cl, "fp32", Planning(objective=TTA))
    assert tta["objective"] == TTA and tta["noise_scale"] is None
    assert plan_key(layers, sample, cl, "fp32", Planning(objective=TTA, noise_scale=7.0))["noise_scale"] == 7.0


def test_a_job_whose_pilot_finds_no_signal_plans_for_throughput(monkeypatch, capsys):
    import hetpipe.run.pilot as pilot

    monkeypatch.setattr(pilot, "job_noise_scale", lambda work, planning: math.inf)
    plan = _job(objective=TTA).resolve_plan()
    assert plan.meta["objective"] == "throughput" and "time_to_accuracy" not in plan.meta
    assert "found no gradient above the noise" in capsys.readouterr().err
