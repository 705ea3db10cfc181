"""TrainResult.cpu_s under real mpiexec: per rank, the CPU its process used over the run's window,
checked against a layer that burns a known amount of CPU on stage 0 only."""

import pytest

from mpirun import results, run_mpi

pytestmark = pytest.mark.mpi


def test_cpu_time_per_rank_counts_the_work_each_rank_did():
    proc = run_mpi(3, "cpu_time.py", env={"HETPIPE_STAGE_PLANE": "python"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (r,) = results(proc)
    stage0, stage1, ps = r["cpu_s"]
    burnt = r["forwards"] * r["burn_s"]
    assert stage0 >= burnt, r
    # Wall time would read the same on every rank: the other ranks did none of the burning.
    assert stage1 < stage0 - burnt / 2 and ps < stage0 - burnt / 2, r
    # The run's window only: within what the process used between building the Trainer and printing,
    # its start-up (importing torch) left out.
    assert stage0 <= r["process_cpu_s"] - r["before_s"], r
