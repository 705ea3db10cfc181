"""Pulls requested early (docs/design.md, "The PS exchange"): a stage's pull request leaves as soon as WSP
lets the shard answer it, not at its Pull instruction. Observed on the shard's own clock (its trace: when
each push header and pull request arrived): the last stage of a D = 1 pipeline pushes wave w - 1 right
before its Pull(w), so a request sent at the instruction arrives after that push, and an early one a
wave before it."""

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core._mpi not built")]


def _rows(tmp_path, ahead: str):
    proc = run_mpi(3, "early_pull.py", str(tmp_path), timeout=300,
                   env={"HETPIPE_PULL_AHEAD": ahead, "HETPIPE_PS_PLANE": "core"})
    got = results(proc)
    assert proc.returncode == 0 and len(got) == 1, f"{proc.stdout}\n{proc.stderr}"
    assert got[0]["ps_plane"] == "core"
    return got[0]["rows"]


def test_the_request_reaches_the_shard_before_the_stage_reaches_its_pull(tmp_path):
    rows = _rows(tmp_path, "1")
    assert rows and all(r["request"] < r["push_before"] for r in rows), rows


def test_without_early_pulls_the_request_follows_the_push_before_the_pull(tmp_path):
    rows = _rows(tmp_path, "0")
    assert rows and all(r["request"] >= r["push_before"] for r in rows), rows
