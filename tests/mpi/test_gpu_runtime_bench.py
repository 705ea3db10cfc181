"""bench/gpu_runtime.py end to end on the CPU (its smoke run), so that the GPU benchmark cannot rot:
plain PyTorch, the profile, the hetpipe run under mpiexec and the planner's memory model all run,
and land in the output folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_runtime.py"


def test_gpu_runtime_smoke_run_writes_its_tables(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--d", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_runtime.json").read_text())
    text = (tmp_path / "gpu_runtime.txt").read_text()
    assert "plain PyTorch, tied head" in text and "hetpipe D=0, tied head" in text and "planned" in text
    (variant,) = report["variants"]
    plain, run = variant["plain"], variant["hetpipe"]["0"]
    assert plain["tokens_per_s"] > 0 and run["tokens_per_s"] > 0 and run["transport"] == "mpi-host"
    # The same model, data and first weights: the first minibatch's loss is plain PyTorch's (bf16
    # autocast on both sides; hetpipe rounds the residual stream at the cut, hence the tolerance).
    assert abs(run["losses"][0] - plain["losses"][0]) < 1e-2
    assert len(run["losses"]) == len(plain["losses"]) == 12
    # The planner's memory of each stage, from the profile of the same layers: every stage holds
    # parameters, so each figure is positive; stage ranks and the PS rank are all reported.
    assert len(run["planned_memory"]) == 2 and all(m > 0 for m in run["planned_memory"])
    assert sorted(r["stage"] is None for r in run["ranks"]) == [False, False, True]
    assert not any(r["torch_cuda_initialized"] for r in run["ranks"])
