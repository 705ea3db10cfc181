"""bench/host_overhead.py end to end (its --quick run, over two of its five rows: between them both models,
Nm = 1 and 4, D = 0 and 1, and the baseline's GPipe and 1F1B schedules), so the benchmark cannot rot: every
row is measured on both stage planes, with each rank's CPU time and each stage's blocked-on-pull time with pulls
requested at the instruction and early, beside its baselines (torch.distributed.pipelining on the same
model, two plain loops at once), and the table states the goals and bounds. No timing is asserted here:
each figure is a long run less a short one, and on a busy host the difference of two noisy times can
have either sign, so the rows are checked for shape and for finite numbers only."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_overhead.py"


def test_quick_run_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--rows", "tiny:1:0,compute:4:1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["model"], r["nm"], r["d"]) for r in rows] == [("tiny", 1, 0), ("compute", 4, 1)]
    for r in rows:
        for key in ("plain_ms", "python_ms", "core_ms", "replay_ms", "pipelining_ms", "pair_ms"):
            assert math.isfinite(r[key]), r
        # CPU per minibatch: the plain loop's, and each of the three ranks' on each plane.
        assert len(r["plain_cpu_ms"]) == 1 and math.isfinite(r["plain_cpu_ms"][0]), r
        for plane in ("python", "core"):
            assert len(r[f"{plane}_cpu_ms"]) == 3 and all(math.isfinite(c) for c in r[f"{plane}_cpu_ms"]), r
            assert math.isfinite(r[f"{plane}_before_ms"]), r
            # Per stage, ms per wave its Pull waited: requests at the instruction, and early.
            for key in (f"{plane}_before_pull_wait_ms", f"{plane}_pull_wait_ms"):
                assert len(r[key]) == 2 and all(w >= 0 for w in r[key]), r
        # The baselines: torch.distributed.pipelining's two ranks, and two plain loops at once.
        assert len(r["pipelining_cpu_ms"]) == 2 and all(math.isfinite(c) for c in r["pipelining_cpu_ms"]), r
        assert len(r["pair_cpu_ms"]) == 1 and math.isfinite(r["pair_cpu_ms"][0]), r
    assert "devices: host CPU (real)" in proc.stdout
    assert proc.stdout.count(" core ") == 2 and proc.stdout.count(" python ") == 2, proc.stdout
    assert "baseline pipeline: torch.distributed.pipelining" in proc.stdout
    assert "blocked on pull ms/wave s0/s1, before -> after" in proc.stdout and "vs torch pp" in proc.stdout


def test_rows_are_chosen_by_model_nm_and_d_and_a_bad_one_is_named():
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--rows", "tiny:4:1,huge:4:1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--rows item 'huge:4:1' is not MODEL:NM:D" in proc.stderr, proc.stderr
    assert " python " not in proc.stdout                # refused before anything ran
