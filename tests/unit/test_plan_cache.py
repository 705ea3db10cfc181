"""The plan cache: a second identical run reuses the first one's plan without profiling; a changed
model, cluster or setting re-plans and says which; an unreadable cache re-plans and says why."""

import re
import sys
from pathlib import Path

import pytest
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, sgd, synthetic  # noqa: E402

import hetpipe.model.measure as measure  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.run.config import Planning
from hetpipe.run.workload import resolve_plan


def _plan(cache, model=None, **kw):
    return Trainer(model or mlp(), cross_entropy, sgd(), synthetic(),
                   planning=Planning(cluster="cpu-emulated", plan_cache=cache), **kw).resolve_plan()


def test_an_identical_run_reuses_the_plan_without_profiling(tmp_path, monkeypatch, capsys):
    first = _plan(tmp_path)
    assert "re-planning: no cached plan" in capsys.readouterr().err
    monkeypatch.setattr(measure, "profile_model", lambda *a, **k: pytest.fail("profiled although cached"))
    again = _plan(tmp_path)
    assert "reusing the cached plan" in capsys.readouterr().err
    assert again.to_json() == first.to_json()


@pytest.mark.parametrize("change, why", [
    ({"model": nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 32),
                             nn.Linear(32, 10))}, r"the model's layer 0 \(Linear\) differs"),
    ({"cluster": "cpu-emulated-6"}, "the cluster differs"),
    ({"numerics": {"precision": "bf16"}}, r"the precision differs \('fp32' cached, 'bf16' now\)"),
    ({"planning": {"d": 1}}, r"the d differs \(0 cached, 1 now\)"),
])
def test_a_change_re_plans_and_says_which(tmp_path, capsys, change, why):
    _plan(tmp_path)
    capsys.readouterr()
    model = change.pop("model", None)
    cluster = change.pop("cluster", "cpu-emulated")
    planning = {"cluster": cluster, "plan_cache": tmp_path, **change.pop("planning", {})}
    Trainer(model or mlp(), cross_entropy, sgd(), synthetic(), planning=planning, **change).resolve_plan()
    err = capsys.readouterr().err
    assert "re-planning:" in err and re.search(why, err), err


def test_an_unreadable_cache_re_plans_and_says_why(tmp_path, capsys):
    _plan(tmp_path)
    (tmp_path / "plan.json").write_text("{")
    capsys.readouterr()
    _plan(tmp_path)
    assert f"re-planning: the cache in {tmp_path} is unreadable (plan: not valid JSON" in capsys.readouterr().err


def test_a_reused_plan_keeps_what_a_restart_re_plans_with(tmp_path):
    made = Trainer(mlp(), cross_entropy, sgd(), synthetic(),
                   planning=Planning(cluster="cpu-emulated", plan_cache=tmp_path))
    _, made_inputs = resolve_plan(made.work, made.config)
    reused = Trainer(mlp(), cross_entropy, sgd(), synthetic(),
                     planning=Planning(cluster="cpu-emulated", plan_cache=tmp_path))
    _, reused_inputs = resolve_plan(reused.work, reused.config)
    assert reused_inputs == made_inputs and reused_inputs["profile"]["layers"]
