"""bench/host_overhead.py end to end (its --quick run), so the benchmark cannot rot: every row is
measured on both stage planes and the table states the goals. No timing is asserted here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "host_overhead.py"


def test_quick_run_prints_the_table(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["model"], r["nm"]) for r in rows] == [("tiny", 1), ("tiny", 4), ("compute", 4)]
    for r in rows:
        for key in ("plain_ms", "python_ms", "core_ms"):
            assert r[key] > 0, r
    assert "devices: host CPU (real)" in proc.stdout
    assert proc.stdout.count(" core ") == 3 and proc.stdout.count(" python ") == 3, proc.stdout
