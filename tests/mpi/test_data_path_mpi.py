"""The data path under mpiexec (tests/mpi/scripts/data_path.py): a shuffled DataLoader trains every
sample on its own label and equals plain PyTorch; ranks whose data, or whose initial weights, differ
stop at start-up with one error, long before the peer timeout."""

import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


def test_a_shuffled_dataloader_pairs_every_sample_with_its_label_across_ranks():
    proc = run_mpi(3, "data_path.py", "shuffled", timeout=240)
    assert proc.returncode == 0, proc.stderr
    (r,) = results(proc)
    assert r["mispaired"] == 0 and r["minibatches"] == 16 and r["same_count"], r
    # Nm = 1, D = 0: plain training; the PS adds one rounding per step (w + (w' - w)).
    assert r["max_diff"] <= 1e-4, r


def test_ranks_reading_different_data_stop_at_start_up_naming_them():
    proc = run_mpi(3, "data_path.py", "rank_dependent", timeout=120, env={"HETPIPE_TIMEOUT": "60"})
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "the data differs between ranks" in ln]
    assert len(lines) == 1, proc.stderr
    assert "minibatch 0 of epoch 0 is not the same on rank 0 (vw 0 stage 0) and rank 1 (vw 0 stage 1)" in lines[0]
    assert "timeout" not in proc.stderr.lower() and "RESULT" not in proc.stdout


def test_ranks_built_with_different_initial_weights_stop_at_start_up_naming_the_layer():
    proc = run_mpi(3, "data_path.py", "weights_differ", timeout=120, env={"HETPIPE_TIMEOUT": "60"})
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "the initial weights differ between ranks" in ln]
    assert len(lines) == 1, proc.stderr
    assert "layer 0 is not the same on rank 0 (vw 0 stage 0) and rank 2 (ps shard 0)" in lines[0], lines[0]
    assert "RESULT" not in proc.stdout
