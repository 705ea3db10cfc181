"""`hetpipe simulate --plan ...`: table, throughput, trace and Gantt files."""

import json

import pytest

from hetpipe.cli import main
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan


@pytest.fixture
def plan_file(tmp_path):
    vws = tuple(
        VirtualWorkerPlan(v, (StagePlan(f"n{v}.g0", "t", 0, 1, 1.0 * (v + 1), 2.0 * (v + 1), send_time=0.1),
                              StagePlan(f"n{v}.g1", "t", 1, 2, 1.0 * (v + 1), 2.0 * (v + 1))))
        for v in range(2))
    plan = Plan(num_layers=2, nm=2, d=0, policy="NP", virtual_workers=vws,
                ps_shards=(ShardPlan(0, "n0", (0, 1)),), throughput=0.5)
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_simulate_prints_table_and_writes_trace(plan_file, tmp_path, capsys):
    trace = tmp_path / "t.json"
    assert main(["simulate", "--plan", str(plan_file), "--waves", "4", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert "minibatches/s" in out and "planner cost model: 0.500" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] == "F") == 2 * 2 * 8


def test_simulate_png(plan_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "g.png"
    assert main(["simulate", "--plan", str(plan_file), "--waves", "2", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_simulate_bad_plan_is_a_clear_error(tmp_path, capsys):
    assert main(["simulate", "--plan", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
