"""The JAX front end under mpiexec (2 VWs of 2 stages, Nm = 2, 2 PS shards on the core's shard service)
against a single-process reference of the same schedule written from the WSP specification
(tests/mpi/scripts/jax_wsp.py): bitwise at D = 0, and at D = 1 given the run's record of what each
pull got. ``import torch`` fails in every process of both."""

import json

import pytest

from mpirun import results, run_mpi

pytest.importorskip("jax")
pytestmark = pytest.mark.mpi


def _run_and_reference(tmp_path, d: int):
    import subprocess
    import sys

    from mpirun import SCRIPTS

    proc = run_mpi(6, "jax_wsp.py", "run", str(tmp_path), str(d), timeout=400)
    assert proc.returncode == 0 and results(proc) == [{"mode": "run", "d": d}], f"{proc.stdout}\n{proc.stderr}"
    ref = subprocess.run([sys.executable, str(SCRIPTS / "jax_wsp.py"), "reference", str(tmp_path), str(d)],
                         capture_output=True, text=True, timeout=400, cwd=SCRIPTS)
    assert ref.returncode == 0, ref.stderr
    return (json.loads((tmp_path / f"run_{d}.json").read_text()),
            json.loads((tmp_path / f"reference_{d}.json").read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("jax")
    return {d: _run_and_reference(out, d) for d in (0, 1)}


@pytest.mark.parametrize("d", [0, 1])
def test_jax_run_equals_the_single_process_reference(runs, d):
    run, ref = runs[d]
    assert run["torch"] is False and ref["torch"] is False
    assert run["plane"] in ("core", "python")
    assert len(run["losses"]["0"]) == 12 and len(run["losses"]["1"]) == 12
    assert run["losses"] == ref["losses"]
    assert run["weights"] == ref["weights"]


def test_the_model_learns(runs):
    run, _ = runs[0]
    for losses in run["losses"].values():
        assert sum(losses[-4:]) < sum(losses[:4]), losses


def test_at_d1_pulls_were_stale_and_changed_the_numbers(runs):
    run0, _ = runs[0]
    run1, _ = runs[1]
    stale = [(v, s, w, g) for v, s, w, gs in run1["pulls"] for g in gs.values() if g < w]
    assert stale, run1["pulls"]             # the record is not the D = 0 one, so following it matters
    assert all(w - 1 <= g <= w for v, s, w, gs in run1["pulls"] for g in gs.values())
    assert run1["losses"] != run0["losses"]


def test_the_jax_example_runs_under_hetpipe_launch_without_torch():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", "6", str(root / "examples" / "jax_mlp.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=root)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "torch imported: False" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    ours = [float(r[1]) for r in rows]
    assert len(rows) == 8 and ours[-1] < 0.5 * ours[0], proc.stdout      # it learned
