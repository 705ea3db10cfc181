"""bench/gpu_runtime.py and bench/gpu_check.sh end to end on the CPU (their smoke and dry runs), so that
the GPU benchmark cannot rot: plain PyTorch, the profile, the hetpipe run under mpiexec, the planner's
memory model and each stage's time breakdown all run and land in the output folder; a budget too short
for the runs records them as skipped; the probe phase of gpu_check.sh writes its figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "gpu_runtime.py"


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
    # Each stage's wall time, split by what it did or waited for, adds up (trace.time_breakdown).
    assert len(run["breakdown"]) == 2 and "where each stage's time went" in text
    for b in run["breakdown"]:
        assert b["compute"] > 0 and b["total"] > 0
        assert abs(sum(v for k, v in b.items() if k != "total") - b["total"]) < 1e-6


def test_a_budget_too_short_records_every_run_as_skipped(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--head", "both", "--budget", "0",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "some runs failed" in proc.stderr
    report = json.loads((tmp_path / "gpu_runtime.json").read_text())
    assert [v["skipped"] for v in report["variants"]] == ["plain PyTorch: no time left in the budget"] * 2


def test_gpu_check_probe_phase_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "OUT": str(out), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "probe"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "summary.txt").read_text().startswith("probe: ok in ")
    rows = [json.loads(line) for line in (out / "probe" / "probe.jsonl").read_text().splitlines()]
    kinds = {r["probe"] for r in rows}
    assert kinds == {"env", "pinning", "copy", "mpi"}, rows
    pinning = next(r for r in rows if r["probe"] == "pinning")
    assert pinning["pinned"] is False and pinning["pin_error"]           # no CUDA device here: it says why
    assert all(r["gb_s"] > 0 for r in rows if r["probe"] in ("copy", "mpi") and "error" not in r)
    assert {(r["direction"], r["host"]) for r in rows if r["probe"] == "copy"} >= {("h2d", "pageable"),
                                                                                   ("h2d+d2h", "unpinned-pool")}
    assert any(r["probe"] == "mpi" and "error" not in r for r in rows)
    assert "transformers" in (out / "env.txt").read_text()
