"""The NumPy front end against the torch runtime: one plan, D = 0, trained by torch stages and by
NumPy workers (:mod:`hetpipe.numpy`) in a process where ``import torch`` fails; the shard logs and
the final weights must be equal bit for bit (tests/mpi/scripts/numpy_vs_torch.py says why they can be)."""

import json

import numpy as np
import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


def _weights(run: dict) -> dict:
    return {l: np.frombuffer(bytes.fromhex(h), np.float32) for l, h in run["weights"].items()}


def test_numpy_workers_equal_torch_stages_bitwise(tmp_path):
    for mode in ("torch", "numpy"):
        proc = run_mpi(4, "numpy_vs_torch.py", mode, str(tmp_path), timeout=300)
        assert proc.returncode == 0 and results(proc) == [{"mode": mode}], f"{proc.stdout}\n{proc.stderr}"
    torch_run = json.loads((tmp_path / "torch.json").read_text())
    numpy_run = json.loads((tmp_path / "numpy.json").read_text())
    assert numpy_run["torch_loaded"] is False
    # Both trained: 2 VWs x 12 minibatches moved the weights away from where they started.
    start = [np.linspace(0.5, 1.5, 16, dtype=np.float32), np.linspace(-1.0, 1.0, 16, dtype=np.float32)]
    for l, w in _weights(torch_run).items():
        assert not np.allclose(w, start[int(l)], atol=1e-3), f"layer {l} did not train"
    for k, log in torch_run["logs"].items():
        assert len(log["pushes"]) == 12 and len(log["applied"]) == 12, log     # 2 VWs x 6 waves, one stage each
    assert numpy_run["logs"] == torch_run["logs"]
    for l, w in _weights(torch_run).items():
        assert np.array_equal(_weights(numpy_run)[l], w), f"layer {l}"
