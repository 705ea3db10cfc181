"""bench/convergence's heterogeneity-aware data parallelism over real gloo: unequal shares, loss weighted
by share, DDP's averaged gradients equal the gradient of the mean loss over the whole step."""

import pytest

from mpirun import results, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_weighted_shares_give_the_gradient_of_the_mean_over_all_windows(ranks):
    proc = run_mpi(ranks, "hetero_dp_grads.py", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = results(proc)
    assert len(res["windows"]) == ranks
    assert res["max_abs_grad"] > 1e-4
    assert res["max_abs_diff"] < 1e-6
