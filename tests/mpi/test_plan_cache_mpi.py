"""Reproducible plans under `hetpipe launch --plan-cache`: the second of two identical launches reuses
the first one's plan (and says so) and trains exactly the same losses."""

import json
import os
import subprocess
import sys

import pytest

from mpirun import SCRIPTS
from hetpipe.run.config import Planning

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _launch(n, cache, out):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    return subprocess.run([sys.executable, "-m", "hetpipe.cli", "launch", "-n", str(n), "--plan-cache", str(cache),
                           "plan_cache_run.py", str(out)], cwd=SCRIPTS, env=env, capture_output=True, text=True,
                          timeout=600)


def test_identical_launches_with_a_plan_cache_train_the_same_plan_and_losses(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    from common import cross_entropy, mlp, sgd, synthetic

    from hetpipe.run.trainer import Trainer

    ranks = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256),
                    planning=Planning(cluster="cpu-emulated", nm=2, d=0, plan_cache=tmp_path / "probe")).resolve_plan().num_ranks
    cache = tmp_path / "cache"
    first = _launch(ranks, cache, tmp_path / "first")
    assert first.returncode == 0, first.stderr
    assert "plan cache: re-planning: no cached plan" in first.stderr
    second = _launch(ranks, cache, tmp_path / "second")
    assert second.returncode == 0, second.stderr
    assert "plan cache: reusing the cached plan" in second.stderr
    a = json.loads((tmp_path / "first" / "result.json").read_text())
    b = json.loads((tmp_path / "second" / "result.json").read_text())
    assert a["plan"] == b["plan"] and a["losses"] == b["losses"]
