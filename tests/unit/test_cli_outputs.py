"""Bad input to `hetpipe simulate` and unwritable output paths of every command (and of examples/demo.py): one
line, exit 2, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest

from hetpipe.cli import main
from hetpipe.util.outputs import OutputError, write_file
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan


@pytest.fixture
def plan_file(tmp_path):
    vw = VirtualWorkerPlan(0, (StagePlan("n0.g0", "t", 0, 1, 1.0, 2.0, send_time=0.1),
                               StagePlan("n0.g1", "t", 1, 2, 1.0, 2.0)))
    plan = Plan(num_layers=2, nm=2, d=0, policy="NP", virtual_workers=(vw,), ps_shards=(ShardPlan(0, "n0", (0, 1)),))
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def one_line_error(capsys, *needles):
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    assert "minibatches/s" not in captured.out          # no table with a wrong figure
    return err


@pytest.mark.parametrize("flag,value", [("--waves", "1e9"), ("--waves", "0"), ("--waves", "2.5"),
                                        ("--push", "-1"), ("--push", "nan"), ("--pull", "inf"),
                                        ("--pull", "x"), ("--ps-apply-rate", "0")])
def test_simulate_rejects_bad_numbers_at_once(plan_file, capsys, flag, value):
    """Rejected before anything is simulated: "--waves 1e9" would take hours to simulate, so its answer
    can only come from the bound on the waves, which the message names."""
    assert main(["simulate", "--plan", str(plan_file), flag, value]) == 2
    err = one_line_error(capsys, flag)
    if value == "1e9":
        assert "minibatch-stages, more than the" in err, err


def test_simulate_accepts_whole_numbers_in_exponent_form(plan_file, capsys):
    assert main(["simulate", "--plan", str(plan_file), "--waves", "2e0"]) == 0
    assert "minibatches/s" in capsys.readouterr().out


def unwritable(tmp_path):
    """Paths no one can write, root included: under a regular file, and a directory as a file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    return [blocker / "out.json", tmp_path / "missing" / "out.json", tmp_path]


def leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.rglob("*") if p.name not in ("file", "plan.json"))


@pytest.mark.parametrize("flag", ["--trace", "--png"])
def test_simulate_unwritable_output_is_one_line_and_writes_nothing(plan_file, tmp_path, capsys, flag):
    for path in unwritable(tmp_path):
        assert main(["simulate", "--plan", str(plan_file), flag, str(path)]) == 2
        one_line_error(capsys, flag, str(path))
        assert leftovers(tmp_path) == []
    ok = tmp_path / "out.png"
    assert main(["simulate", "--plan", str(plan_file), "--png" if flag == "--png" else "--trace", str(ok),
                 "--trace" if flag == "--png" else "--png", str(tmp_path / "file" / "x")]) == 2
    assert not ok.exists()                                # checked before anything is written


def test_plan_unwritable_output_is_one_line_and_plans_nothing(tmp_path, capsys):
    for path in unwritable(tmp_path):
        assert main(["plan", "--cluster", "hetpipe-testbed", "--profile", "resnet152", "-o", str(path)]) == 2
        err = one_line_error(capsys, "-o", str(path))
        assert err.startswith("hetpipe plan: ")
        assert leftovers(tmp_path) == []
        # The output is checked before the cluster and the profile are even read: with neither of them
        # valid, the error is still the output's.
        assert main(["plan", "--cluster", "no-such-cluster", "--profile", "no-such-model", "-o", str(path)]) == 2
        assert one_line_error(capsys, "-o", str(path)) == err


def test_demo_unwritable_out_is_one_line(tmp_path):
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path in (blocker, blocker / "sub"):
        proc = subprocess.run([sys.executable, str(demo), "--out", str(path)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc
        err = proc.stderr.strip()
        assert "\n" not in err and "Traceback" not in err and "--out" in err and str(path) in err, err
        assert "launching" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and blocker.read_text() == "x"


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("old")

    def half(path):
        path.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match=r"^-o .*plan\.json: cannot write: No space left on device$"):
        write_file("-o", target, half)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    write_file("-o", target, lambda p: p.write_text("new"))
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
