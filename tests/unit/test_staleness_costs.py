"""The planner's staleness costs: the local staleness against the schedule a stage really runs, the cost
of an unpriced plan, the command line, and the fitted coefficients against a refit of the committed runs."""

import importlib.util
import math
from pathlib import Path

import pytest

from hetpipe.cli import main
from hetpipe.plan.efficiency import (FITTED_STALENESS_COSTS, NO_STALENESS_COSTS, StalenessCosts, local_staleness,
                                     sample_cost, staleness_costs)
from hetpipe.schedule.generators import hetpipe_compute_schedule
from hetpipe.schedule.ir import Apply, Fwd

ROOT = Path(__file__).resolve().parents[2]


def lacking(stages: int, nm: int, d: int):
    """Per stage, the most of its own updates a steady-state forward's weights lack, read off the schedule:
    at ``Fwd(p)`` the stage has applied the minibatches before some ``q``; it lacks ``p - q``."""
    out = []
    minibatches = 8 * (nm + stages)
    for stream in hetpipe_compute_schedule(stages, minibatches, nm, d).streams:
        applied, worst = 0, 0
        for ins in stream:
            if isinstance(ins, Apply):
                applied += 1
            elif isinstance(ins, Fwd) and 2 * (nm + stages) <= ins.mb < minibatches - 2 * (nm + stages):
                worst = max(worst, ins.mb - applied)
        out.append(worst)
    return out


@pytest.mark.parametrize("d", [0, 1, 2])
def test_the_local_staleness_is_the_mean_of_what_the_schedule_leaves_out(d):
    for stages in range(1, 7):
        for nm in range(1, 9):
            per_stage = lacking(stages, nm, d)
            if d >= 1 or nm >= stages:
                assert per_stage == [min(nm, stages - s) - 1 for s in range(stages)], (stages, nm, d)
            # the model's figure: the mean of the steady state's worst case over the stages
            assert local_staleness([stages], nm) == pytest.approx(sum(min(nm, stages - s) - 1
                                                                      for s in range(stages)) / stages)
            assert max(per_stage) <= nm - 1
    assert local_staleness([4, 2], 4) == pytest.approx((1.5 + 0.5) / 2)


def test_a_plan_costs_nothing_extra_unless_costs_are_priced_and_more_the_wider_and_staler_it_is():
    for stages, nm, d in (([1], 1, 0), ([4, 4, 4, 4], 8, 3), ([2, 1], 4, 1)):
        assert sample_cost(stages, nm, d, NO_STALENESS_COSTS) == 1.0
    one = StalenessCosts(0.1, 0.2, 0.1)
    assert sample_cost([1], 1, 0, one) == 1.0                      # one device, one minibatch: synchronous SGD
    assert sample_cost([4], 4, 0, one) > sample_cost([2], 4, 0, one) > 1.0       # deeper pipelines lag more
    assert sample_cost([1, 1, 1, 1], 4, 0, one) > sample_cost([1, 1], 4, 0, one) > 1.0   # more VWs averaged
    assert sample_cost([1, 1], 4, 1, one) > sample_cost([1, 1], 4, 0, one)       # a looser bound
    assert sample_cost([1], 4, 5, one) == 1.0                      # one VW: the bound has no one to wait for


@pytest.mark.parametrize("value,message", [
    ("best", "staleness costs are one of none, fitted or three numbers"),
    ("1,2", "staleness costs are one of none, fitted or three numbers"),
    ("0.1,nan,0", "StalenessCosts.averaging must be a finite number >= 0, got nan"),
    ("0.1,0,inf", "StalenessCosts.wsp must be a finite number >= 0, got inf"),
])
def test_bad_costs_are_refused_naming_the_coefficient(value, message):
    with pytest.raises(ValueError, match=message):
        staleness_costs(value)
    with pytest.raises(ValueError, match="pipeline must be a finite number >= 0, got True"):
        StalenessCosts(True)
    assert staleness_costs("0.5,0,0.25") == StalenessCosts(0.5, 0.0, 0.25)
    assert staleness_costs("fitted") is FITTED_STALENESS_COSTS


def test_cli_prices_the_costs_and_refuses_bad_ones_in_one_line(capsys):
    argv = ["plan", "--cluster", "hetpipe-testbed", "--profile", "vgg19", "--d", "1",
            "--objective", "time-to-accuracy", "--noise-scale", "100"]
    assert main(argv + ["--staleness-costs", "fitted"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("time to accuracy: noise scale 100 samples"))
    assert lines[head].endswith("staleness costs: pipeline 0.127, averaging 0.194, wsp 0.111")
    assert lines[head + 1].split()[7:11] == ["efficiency", "sample", "cost", "goodput"]
    end = next(i for i, line in enumerate(lines) if line.startswith("* chosen:"))
    costs = [float(line.split()[-3].rstrip("x")) for line in lines[head + 3:end]]
    assert len(costs) > 3 and min(costs) >= 1.0 and max(costs) > 1.0
    assert "samples/s x efficiency / sample cost" in out and "switch points are early" not in out
    assert main(argv + ["--staleness-costs", "0,-1,0"]) == 2
    err = capsys.readouterr().err
    assert err == "hetpipe plan: --staleness-costs: StalenessCosts.averaging must be a finite number >= 0, got -1.0\n"
    assert main(argv[:-4] + ["--staleness-costs", "fitted"]) == 2
    assert capsys.readouterr().err == "hetpipe plan: --staleness-costs is for --objective time-to-accuracy\n"


def test_the_fitted_coefficients_are_the_refit_of_the_committed_runs():
    """bench/convergence/staleness_fit.py fits R2's committed runs: the planner's constants are its output,
    and the fit predicts R1's committed runs better than Pollux's efficiency alone (out of sample)."""
    spec = importlib.util.spec_from_file_location("staleness_fit", ROOT / "bench" / "convergence" / "staleness_fit.py")
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    results = ROOT / "bench" / "convergence" / "results"
    train = fit.observations(sorted(results.glob(fit.FIT_FILES)))
    check = fit.observations(sorted(results.glob(fit.CHECK_FILES)))
    assert {o["regime"] for o in train} == {"r2"} and {o["regime"] for o in check} == {"r1"}
    assert fit.fit(train) == FITTED_STALENESS_COSTS
    assert fit.log_error(check, FITTED_STALENESS_COSTS) < fit.log_error(check, NO_STALENESS_COSTS)
    assert math.isclose(fit.log_error(train, NO_STALENESS_COSTS),
                        math.exp(sum(abs(math.log(o["residual"])) for o in train) / len(train)))
