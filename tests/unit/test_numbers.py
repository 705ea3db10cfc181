"""Bad numbers, one line each naming the argument: Trainer arguments, CLI and demo options and HETPIPE_TIMEOUT
(``nan`` once turned the peer timeout off, ``-5`` failed every rank at once)."""

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from hetpipe.job.failure import timeout_s  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402


@pytest.mark.parametrize("kw, match", [
    ({"runtime": {"timeout": float("nan")}}, r"timeout must be a finite number > 0, got nan"),
    ({"runtime": {"timeout": -5}}, r"timeout must be a finite number > 0, got -5"),
    ({"runtime": {"timeout": "soon"}}, r"timeout must be a number of seconds, got 'soon'"),
    ({"planning": {"nm": 0}}, r"nm must be a whole number >= 1, got 0"),
    ({"planning": {"nm": 2.5}}, r"nm must be a whole number >= 1, got 2.5"),
    ({"planning": {"d": -1}}, r"d must be a whole number >= 0, got -1"),
    ({"epochs": 0}, r"epochs must be a whole number >= 1, got 0"),
    ({"epochs": True}, r"epochs must be a whole number >= 1, got True"),
    ({"planning": {"split_startup": -2}}, r"split_startup must be a whole number >= 0"),
    ({"runtime": {"emulation_scale": float("inf")}}, r"emulation_scale must be a finite number > 0, got inf"),
    ({"numerics": {"seed": -1}}, r"seed must be a whole number >= 0"),
])
def test_bad_trainer_numbers_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0), **kw)


@pytest.mark.parametrize("env", ["nan", "-5", "0", "inf", "x"])
def test_a_bad_hetpipe_timeout_is_named(monkeypatch, env):
    monkeypatch.setenv("HETPIPE_TIMEOUT", env)
    with pytest.raises(ValueError, match=r"HETPIPE_TIMEOUT must be"):
        timeout_s()


@pytest.mark.parametrize("argv, culprit", [
    (["launch", "-n", "2", "--timeout", "nan", "x.py"], "--timeout must be a finite number > 0, got 'nan'"),
    (["launch", "-n", "2", "--timeout", "-5", "x.py"], "--timeout must be a finite number > 0, got '-5'"),
    (["launch", "-n", "0", "x.py"], "-n must be a whole number >= 1, got 0"),
    (["launch", "-n", "2", "--max-restarts", "-1", "x.py"], "--max-restarts must be a whole number >= 0"),
    (["launch", "-n", "2", "--checkpoint-every", "0", "x.py"], "--checkpoint-every must be a whole number >= 1"),
    (["launch", "-n", "2", "--term-grace", "-1", "x.py"], "--term-grace must be a finite number >= 0"),
    (["plan", "--cluster", "cpu-emulated", "--profile", "gpt", "--d", "-1"], "--d must be a whole number >= 0"),
    (["plan", "--cluster", "cpu-emulated", "--profile", "gpt", "--ps-shards", "0"],
     "--ps-shards must be a whole number >= 1"),
])
def test_bad_cli_numbers_are_one_line_naming_the_option(argv, culprit):
    proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc
    assert culprit in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, culprit", [
    (["--batch", "0"], "--batch must be a whole number >= 1, got 0"),
    (["--epochs", "1.5"], "--epochs must be a whole number >= 1, got '1.5'"),
    (["--min-accuracy", "2"], "--min-accuracy must be between 0 and 1, got '2'"),
    (["--slowdown", "nan"], "--slowdown must be a finite number > 0"),
    (["--rank"], "--rank needs --plan"),
])
def test_bad_demo_numbers_are_one_line_naming_the_option(argv, culprit):
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    proc = subprocess.run([sys.executable, str(demo), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert culprit in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bad_plan_and_input_files_are_named(tmp_path):
    from hetpipe.plan import make_plan
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.plan.profile import load_profile
    from hetpipe.plan.types import Plan

    with pytest.raises(ValueError, match=r"a plan is a JSON object .* got a list: \[1, 2\]"):
        Plan.from_dict([1, 2])
    with pytest.raises(ValueError, match=r"policy must be one of .* got None"):
        make_plan(load_cluster("hetpipe-testbed"), load_profile("gpt"), policy=None)
    binary = tmp_path / "b.json"
    binary.write_bytes(bytes(range(200, 256)))
    for argv, what in ((["simulate", "--plan", str(binary)], "plan"),
                       (["plan", "--cluster", str(binary), "--profile", "gpt"], "cluster"),
                       (["plan", "--cluster", "cpu-emulated", "--profile", str(binary)], "profile")):
        proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert f"{what}: {binary} is not a text (JSON) file: byte 0xc8 at offset 0" in proc.stderr, proc.stderr
    null = tmp_path / "n.json"
    null.write_text("null")
    proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", "simulate", "--plan", str(null)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and f"got a NoneType: None (in {null})" in proc.stderr, proc.stderr
