"""bench/training_job.py runs and its table says what the unit tests assert: every feature within
float32 rounding of plain PyTorch, and far from it with the feature off.

It runs a benchmark script, so it is ``slow``, outside the unit tier; the features themselves are
proven there against plain PyTorch (tests/unit/test_loader.py: a shuffled DataLoader;
test_training_options.py: lr schedules, clipping, accumulation; test_precision.py: fp16 with loss
scaling)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_training_job_bench_prints_small_gaps_beside_large_ones():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "training_job.py")], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    rows = [line.split("|") for line in out.splitlines() if re.match(r"^(shuffled|lr_|clip|accumulate|fp16)", line)]
    assert len(rows) == 5, out
    for cells in rows:
        loss_gap, weight_gap, off = (c.strip() for c in cells[2:5])
        assert float(loss_gap) <= 1e-5 and float(weight_gap) <= 1e-6, cells
        assert off == "-" or float(off) > 1e-3, cells
    assert "real, no emulation" in out
