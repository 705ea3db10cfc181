"""`hetpipe export` on checkpoints of real runs (tests/mpi/scripts/export_run.py): the exported weights
load into a fresh model under its own names (strict) and equal the trained model's, bitwise; the
optimizer factory marked with hetpipe.named_params gets the model's own parameter names."""

import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


def _run(tmp_path, mode, *every):
    proc = run_mpi(3, "export_run.py", str(tmp_path), mode, *every, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (r,) = results(proc)
    assert not r["missing"] and not r["extra"] and not r["differ"], r
    return r


def test_a_sequential_with_a_tied_weight_and_batchnorm_loads_strictly(tmp_path):
    r = _run(tmp_path, "sequential")
    assert "10 tensors" in r["said"] and r["trained"] >= 8, r     # 4.weight is 0.weight; num_batches_tracked too
    assert r["optimizer_names"] == ["0.bias", "0.weight", "1.bias", "1.weight", "3.bias", "3.weight"], r


def test_export_after_fit_is_the_final_model_when_the_last_clock_was_not_due(tmp_path):
    """12 minibatches in waves of 2 make 6 clocks; checkpoints every 4 waves: the last due one is 2
    waves old at the end, and the run's final checkpoint (clock 6) is what the export gives, bitwise
    the weights the Trainer put into the model."""
    r = _run(tmp_path, "sequential", "4")
    assert r["exported"] == "clock-000006" and r["trained"] >= 8, r


def test_an_adapted_gpt2_exports_a_folder_from_pretrained_opens(tmp_path):
    r = _run(tmp_path, "gpt2")
    assert "GPT2LMHeadModel" in r["said"] and r["trained"] >= 20, r
    assert "transformer.wte.weight" in r["optimizer_names"] and "lm_head.weight" not in r["optimizer_names"], r


def test_export_names_what_it_cannot_read(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", "export", str(tmp_path / "none"), "-o",
                           str(tmp_path / "m.safetensors")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == f"hetpipe: no complete checkpoint in {tmp_path / 'none'}"
