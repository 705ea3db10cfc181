"""The GPT-2 and ResNet (BatchNorm) examples launched with ``hetpipe launch``: adapted model, real
ranks, against the plain PyTorch run each example prints beside it.

The plan is one VW of two stages with Nm = 1 and D = 0, so hetpipe's run is plain training (each
minibatch sees the weights every earlier one produced); the cut falls between the embedding and the
head, so GPT-2's tied weight spans both stages, and BatchNorm statistics live on both. What may still
differ is float32 rounding: a stage's update reaches the weights as ``w + (w' - w)`` through the PS,
about one ulp per step, and Adam/momentum carry it on. Over the few dozen steps here that stays
orders of magnitude below the 1e-4 allowed per minibatch loss, while a wrong gradient, a split tie
or a lost BatchNorm update moves the losses by 1e-3 or more after a handful of steps.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpirun import results

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4


def _plan(path: Path, num_layers: int, cut: int) -> str:
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    stages = (StagePlan("cpu", "cpu", 0, cut, 0.0, 0.0), StagePlan("cpu", "cpu", cut, num_layers, 0.0, 0.0))
    Plan(num_layers, 1, 0, "manual", (VirtualWorkerPlan(0, stages),),
         (ShardPlan(0, "n0", tuple(range(num_layers))),)).save(path)
    return str(path)


def _launch(script: str, *args: str, timeout: float = 420) -> dict:
    cmd = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", "3", str(ROOT / "examples" / script), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{script} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{script}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    print(proc.stdout)
    return got[0]


def _check(r: dict) -> None:
    assert r["minibatches"] >= 8 and len(r["plain"]) == len(r["hetpipe"]) == r["minibatches"], r
    diffs = [abs(a - b) for a, b in zip(r["plain"], r["hetpipe"])]
    assert max(diffs) <= TOL, f"per-minibatch loss differences up to {max(diffs):.2e}: {r}"
    assert abs(r["plain_held_out"] - r["hetpipe_held_out"]) <= TOL, r
    assert r["plain_last"] < r["plain_first"] - 0.1, f"the run barely trained, so equal losses prove little: {r}"


def test_gpt2_example_equals_plain_pytorch(tmp_path):
    # 2 blocks: layers = [embeddings, h.0, h.1, head]; the cut after h.0 puts wte/lm_head on both stages.
    plan = _plan(tmp_path / "plan.json", 4, 2)
    _check(_launch("gpt2.py", "--plan", plan, "--nm", "1", "--d", "0", "--layers", "2", "--width", "32",
                   "--seq", "32", "--files", "2", "--minibatches", "24"))


def test_resnet_bn_example_equals_plain_pytorch(tmp_path):
    # layers = [stem, layer1.0, layer2.0, layer3.0, layer4.0, head]
    plan = _plan(tmp_path / "plan.json", 6, 3)
    _check(_launch("resnet_bn.py", "--plan", plan, "--nm", "1", "--d", "0", "--minibatches", "12",
                   "--epochs", "1"))
