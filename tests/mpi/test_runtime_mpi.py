"""The runtime under real mpiexec: equality with the single-process replay, plain PyTorch, WSP
invariants with two VWs, convergence on digits, and failures that end the job with a clear message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import hetpipe_core
from mpirun import SCRIPTS, results, run_mpi

pytestmark = pytest.mark.mpi

EQUAL_CONFIGS = [{"cuts": cuts, "nm": nm, "d": 0} for cuts in ([3], [2, 4]) for nm in (1, 2, 3, 4)]
PLAIN = {"cuts": [], "nm": 1, "d": 0, "plain": True}
# Per-layer recomputation must equal the plain plan bitwise, split start-up within 1e-6.
VARIANTS = [{"cuts": [2, 4], "nm": 2, "d": 0, "recompute": [[1], [], [4, 5]]},
            {"cuts": [3], "nm": 2, "d": 0, "split": 2},
            {"cuts": [2, 4], "nm": 3, "d": 0, "copy_stream": True},
            {"cuts": [3], "nm": 2, "d": 0, "precision": "bf16"},
            {"cuts": [2, 4], "nm": 2, "d": 0, "clip": 0.3, "lr_step": 3},
            {"cuts": [2, 4], "nm": 2, "d": 0, "precision": "fp16"}]


def _key(cfg):
    return (tuple(cfg["cuts"]), cfg["nm"], tuple(map(tuple, cfg.get("recompute", ()))), cfg.get("split", 0),
            bool(cfg.get("copy_stream")), cfg.get("precision", "fp32"), cfg.get("clip"))


@pytest.fixture(scope="module")
def equal_runs():
    """All equality configurations in one 4-rank launch (smaller plans run on a sub-communicator)."""
    proc = run_mpi(4, "equal_replay.py", json.dumps(EQUAL_CONFIGS + VARIANTS + [PLAIN]), timeout=600)
    got = {_key(r): r for r in results(proc)}
    return proc, got


def _id(cfg) -> str:
    name = f"{len(cfg['cuts']) + 1}stages-nm{cfg['nm']}"
    if cfg.get("recompute"):
        name += "-recompute"
    if cfg.get("split"):
        name += f"-split{cfg['split']}"
    if cfg.get("copy_stream"):
        name += "-copystream"
    if cfg.get("precision"):
        name += f"-{cfg['precision']}"
    if cfg.get("clip"):
        name += "-clip-lrschedule"
    return name


@pytest.mark.parametrize("cfg", EQUAL_CONFIGS + VARIANTS, ids=_id)
def test_multiprocess_equals_replay(equal_runs, cfg):
    proc, got = equal_runs
    r = got.get(_key(cfg))
    assert r is not None, f"no result for {cfg}:\n{proc.stdout}\n{proc.stderr}"
    assert r["trained"], "the weights never moved"
    assert r["losses_equal"], r
    assert r["weights_equal"], r
    if cfg.get("recompute"):
        assert r["unmodified_max_diff"] == 0.0, r
    if cfg.get("split"):
        assert r["unmodified_max_diff"] <= 1e-6, r
    if cfg.get("precision"):
        # The half type shows against fp32 (float16 keeps 3 more mantissa bits than bfloat16).
        assert r["plan_precision"] == cfg["precision"] and r["fp32_max_diff"] > {"bf16": 1e-4, "fp16": 1e-5}[
            cfg["precision"]], r


def test_one_stage_equals_plain_pytorch(equal_runs):
    proc, got = equal_runs
    r = got.get(_key(PLAIN))
    assert r is not None, f"no result:\n{proc.stdout}\n{proc.stderr}"
    assert r["plain_max_diff"] < 1e-4, r
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def wsp_runs():
    proc = run_mpi(5, "wsp_two_vws.py", json.dumps([0, 0, 1, 3]), timeout=600)
    return proc, results(proc)


@pytest.mark.parametrize("d", [0, 1, 3])
def test_two_vws_wsp_invariants(wsp_runs, d):
    proc, res = wsp_runs
    runs = [r for r in res if r["d"] == d]
    assert runs, f"no result for D = {d}:\n{proc.stdout}\n{proc.stderr}"
    for r in runs:
        assert r["bound_ok"] and r["max_gap"] <= d + 1, r
        assert r["pushes_once"], r
        assert r["pulls_ok"], r
        assert r["sum_ok"], r
        assert r["final_global"] == r["waves"], r
        assert r["ps_plane"] == ("core" if hetpipe_core.build_info()["mpi_built"] else "python"), r


def test_two_vws_d0_reproducible(wsp_runs):
    proc, res = wsp_runs
    again = [r for r in res if r["d"] == 0 and "reproducible" in r]
    assert again and again[0]["reproducible"], f"{proc.stdout}\n{proc.stderr}"


def test_digits_converges_with_two_vws(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    from common import two_vw_plan

    plan = two_vw_plan(([3], [4]), (0.001, 0.002), nm=2, d=1)
    plan.save(tmp_path / "plan.json")
    from mpirun import mpiexec

    demo = Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    proc = subprocess.run([mpiexec(), "-n", "5", sys.executable, str(demo), "--rank", "--plan",
                           str(tmp_path / "plan.json"), "--out", str(tmp_path / "out"), "--epochs", "10",
                           "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["test_accuracy"] >= 0.95, result
    lines = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert {l["event"] for l in lines} == {"wave", "epoch", "summary"}
    summary = next(l for l in lines if l["event"] == "summary")
    assert summary["transport"] == "mpi-host" and summary["transport_reason"].startswith("mpi-host: "), summary
    plane = "core" if hetpipe_core.build_info()["mpi_built"] else "python"
    assert summary["ps_plane"] == plane and summary["ps_plane_reason"].startswith(plane + ": "), summary
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1, 2}     # 2 VWs, then the PS
    ps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert {e["cat"] for e in ps} == {"PUSH", "PULL"} and {e["tid"] for e in ps} == {0}
    assert any("applied wave(s)" in e["name"] for e in ps)
    assert result["predicted_samples_per_s"]["simulated"] > 0


def _failed(mode: str, rank: int, timeout_env: str = "30", via_launcher: bool = False, n: int = 3):
    """The failed job; it must end by itself (the 300 s given to it are a hang guard, not a bound under test)."""
    env = {"HETPIPE_TIMEOUT": timeout_env}
    if via_launcher:
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as run_dir:      # a failed run's directory is kept otherwise
            proc = subprocess.run([sys.executable, "-m", "hetpipe.cli", "launch", "-n", str(n), "--run-dir", run_dir,
                                   str(SCRIPTS / "failing.py"), mode, str(rank)], capture_output=True, text=True,
                                  timeout=300, env={**os.environ, **env}, cwd=SCRIPTS)
    else:
        proc = run_mpi(n, "failing.py", mode, str(rank), env=env, timeout=300)
    return proc


def test_raising_rank_ends_the_job():
    proc = _failed("raise", 1)
    assert proc.returncode != 0
    assert "hetpipe: rank 1 (vw 0 stage 1) failed: RuntimeError: deliberate failure" in proc.stderr
    assert "FINISHED" not in proc.stdout


def test_killed_rank_is_named_by_the_launcher():
    proc = _failed("kill", 1, via_launcher=True)
    assert proc.returncode != 0
    assert "hetpipe: rank 1 (vw 0 stage 1) failed: it died" in proc.stderr, proc.stderr


def test_hanging_peer_times_out_with_its_name():
    proc = _failed("hang", 1, timeout_env="5")
    assert proc.returncode != 0
    assert "waited 5 s for" in proc.stderr and "VW 0 stage 1 (rank 1)" in proc.stderr, proc.stderr


def test_shape_mismatch_names_both_stages():
    proc = _failed("shape", 0)
    assert proc.returncode != 0
    assert ("shape mismatch between VW 0 stage 0 (rank 0) and VW 0 stage 1 (rank 1): the activation of "
            "minibatch 0 is float32[16, 16]") in proc.stderr, proc.stderr


def test_wrong_rank_count_fails_on_every_rank():
    proc = _failed("none", 0, n=2)
    assert proc.returncode != 0
    assert "the plan needs 3 ranks" in proc.stderr and "but 2 were started" in proc.stderr
    assert proc.stderr.count("the plan needs 3 ranks") == 1, proc.stderr       # once per job, not per rank


def test_missing_device_is_a_clear_error():
    proc = _failed("cuda", 0)
    assert proc.returncode != 0
    assert "the plan asks for cuda:3 but this host has no CUDA device" in proc.stderr, proc.stderr


def test_healthy_run_finishes():
    proc = _failed("none", 0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("FINISHED") == 3


REAL_MODELS = [{"model": "dropout", "cuts": [3], "nm": 2}, {"model": "tied", "cuts": [2], "nm": 2, "vws": 2},
               {"model": "resnet", "cuts": [1, 3], "nm": 2}, {"model": "pytree", "cuts": [1, 2], "nm": 1}]


def test_real_models_equal_the_replay_bitwise():
    """Dropout (per-minibatch seeds), tied weights across stages (their gradient exchange), BatchNorm
    (buffers through the PS) and pytree boundaries with side inputs: mpiexec == replay at D = 0."""
    proc = run_mpi(4, "real_models_mpi.py", json.dumps(REAL_MODELS), timeout=600)
    got = {r["model"]: r for r in results(proc)}
    assert sorted(got) == sorted(c["model"] for c in REAL_MODELS), f"{proc.stdout}\n{proc.stderr}"
    assert all(r["equal"] for r in got.values()), got
