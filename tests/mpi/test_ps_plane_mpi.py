"""The PS shard's data plane in the compiled core under real mpiexec: bitwise equal to the
single-process replay (Python shards) at D = 0 with aggregate sum and mean, BatchNorm buffers and
tied parameters, as the Python plane is; the staleness bound at D >= 1 from the shard logs; a service
that stops without hanging; a failure in a core thread raised in Python naming the culprit."""

import json

import pytest

import hetpipe_core
from mpirun import results, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"],
                                                  reason="hetpipe_core was built without MPI")]

PLANES = [{"model": "mlp", "aggregate": "sum", "plane": "core"},
          {"model": "mlp", "aggregate": "sum", "plane": "python"},
          {"model": "resnet", "aggregate": "mean", "plane": "core"},
          {"model": "resnet", "aggregate": "sum", "plane": "core"},
          {"model": "tied", "aggregate": "mean", "plane": "core"},
          {"model": "mlp", "aggregate": "mean", "plane": "core", "d": 2}]


@pytest.fixture(scope="module")
def plane_runs():
    proc = run_mpi(4, "ps_planes.py", json.dumps(PLANES), timeout=600)
    return proc, results(proc)


def _id(cfg) -> str:
    return f"{cfg['model']}-{cfg['aggregate']}-{cfg['plane']}-d{cfg.get('d', 0)}"


@pytest.mark.parametrize("cfg", PLANES, ids=_id)
def test_plane_equals_the_replay(plane_runs, cfg):
    proc, res = plane_runs
    got = [r for r in res if all(r.get(k) == v for k, v in cfg.items())]
    assert got, f"no result for {cfg}:\n{proc.stdout}\n{proc.stderr}"
    r = got[0]
    assert r["ps_plane"] == cfg["plane"] and r["ps_plane_reason"].startswith(cfg["plane"] + ": "), r
    if cfg.get("d", 0) == 0:
        assert r["equal"], r
        if cfg["model"] == "resnet":
            assert r["buffers"] > 0, r
    else:
        assert r["bound_ok"] and r["pulls"] > 0, r


@pytest.fixture(scope="module")
def service_cases():
    proc = run_mpi(3, "ps_service.py", timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    return {r["case"]: r for r in results(proc)}


def test_service_stops_without_hanging(service_cases):
    # Each case is reported once stop() returned; a stop waiting for the payload that never comes would
    # hang the script past run_mpi's timeout instead.
    idle, mid = service_cases["idle_stop"], service_cases["stop_mid_push"]
    assert idle["lost"] == [], idle
    assert mid["lost"] == ["the push of wave 0 from VW 0 stage 0 (its payload never completed)"], mid


def test_core_thread_failure_is_a_python_exception_naming_the_culprit(service_cases):
    assert service_cases["wrong_size"]["error"] == (
        "WSPViolation: PS shard 0: push from VW 0 stage 0 wave 1 (rank 0) is float32[999] (3996 bytes), "
        "expected float32[1000] (4000 bytes)")
    assert service_cases["duplicate"]["error"] == (
        "WSPViolation: PS shard 0: duplicate push of wave 0 from VW 0 stage 0")
    assert service_cases["beyond_window"]["error"] == (
        "WSPViolation: PS shard 0: push from VW 0 stage 0 wave 5 (rank 0) is beyond VW 0's clock 0 + D + 1 = 1: "
        "no stage can push it under the staleness bound (a corrupt header, or a stage that ran ahead of its pulls)")
    assert {case: service_cases[case]["sender"] for case in ("wrong_size", "duplicate", "beyond_window")} == {
        "wrong_size": 0, "duplicate": 0, "beyond_window": 0}


def test_a_forged_or_far_future_message_is_blamed_on_its_transport_source(service_cases):
    """Rank 1 (VW 1's stage) sends a push and a pull whose headers claim VW 0 stage 0, rank 0's: the core
    names rank 1, the sender MPI reports, never rank 0; a pull of a wave no stage can request yet is its
    sender's fault too, not a wait that would end in a timeout blaming the shard."""
    forged = ("claiming VW 0 stage 0, which is rank 0 (a forged or corrupt header; the sender is named by its "
              "transport source)")
    assert service_cases["forged_push"] == {
        "case": "forged_push", "sender": 1, "error": f"WSPViolation: PS shard 0: rank 1 sent a push of wave 0 {forged}"}
    assert service_cases["forged_pull"] == {
        "case": "forged_pull", "sender": 1, "error": f"WSPViolation: PS shard 0: rank 1 sent a pull of wave 1 {forged}"}
    assert service_cases["far_pull"] == {
        "case": "far_pull", "sender": 0,
        "error": "WSPViolation: PS shard 0: pull of wave 7 from VW 0 stage 0 (rank 0) is beyond VW 0's clock 0 + D + "
                 "1 = 1: no stage can pull it under the staleness bound (a corrupt header, or a stage that ran ahead)"}
