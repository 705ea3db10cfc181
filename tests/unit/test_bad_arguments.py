"""A corpus of bad arguments, each refused up front in one line naming the culprit and its value.

The Trainer's arguments and sections, Batches and the data sources, the HETPIPE_* variables a rank
reads, and the command line (``python -m hetpipe``, run for real in subprocesses): every case must
fail at once, with one line (no traceback from the command line, exit status 2) that names the argument
(or variable) and the value, and leave nothing behind: no run directory, run file or output where the
case ran. Before these checks some of them hung while their memory grew (``epochs=10**12``), were
silently changed, failed on every rank with a ZeroDivisionError, or ended in a traceback.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from hetpipe import Batches, DatasetSource, HetpipeDeprecationWarning, StreamSource, Trainer  # noqa: E402
from hetpipe.run.config import MAX_MINIBATCH_STAGES  # noqa: E402
from hetpipe.util.errors import HetpipeError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _setup(where: Path) -> None:
    """What a case may point at: a file where a directory is expected, and a script that exists."""
    (where / "afile").write_text("not a directory\n")
    (where / "ok.py").write_text("print('hi')\n")


def _contents(where: Path):
    return sorted(str(p.relative_to(where)) for p in where.rglob("*"))


def _one_line(text: str) -> str:
    text = text.strip()
    assert text and "\n" not in text and "Traceback" not in text, text
    return text


# ---------------------------------------------------------------------------------------------------
# The Python API: (id, how to call it, the exception, what the message must name).

def _trainer(**kw):
    return lambda: Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0), **kw)


def _bare_trainer(**kw):
    return lambda: Trainer(mlp(), cross_entropy, sgd(), synthetic(), **kw)


def _legacy_trainer(**kw):
    def build():
        with pytest.warns(HetpipeDeprecationWarning):
            return _trainer(**kw)()
    return build


def _x(n=8):
    return torch.zeros(n, 2)


def _y(n=8):
    return torch.zeros(n)


API = [
    ("epochs-absurd", _trainer(epochs=10 ** 12), ["epochs", "1000000000000", str(MAX_MINIBATCH_STAGES)]),
    ("epochs-zero", _trainer(epochs=0), ["epochs", "got 0"]),
    ("epochs-fraction", _trainer(epochs=2.5), ["epochs", "2.5"]),
    ("checkpoint-every-zero", _trainer(checkpointing={"every": 0}), ["checkpointing.every", "got 0"]),
    ("checkpoint-every-fraction", _trainer(checkpointing={"every": 2.5}), ["checkpointing.every", "2.5"]),
    ("legacy-checkpoint-every-zero", _legacy_trainer(checkpoint_every=0), ["checkpointing.every", "got 0"]),
    ("legacy-checkpoint-every-fraction", _legacy_trainer(checkpoint_every=2.5), ["checkpointing.every", "2.5"]),
    ("checkpoint-keep-zero", _trainer(checkpointing={"keep": 0}), ["checkpointing.keep", "got 0"]),
    ("checkpoint-dir-is-a-file", _trainer(checkpointing={"dir": "afile"}), ["checkpointing.dir", "'afile'"]),
    ("checkpoint-dir-below-a-file", _trainer(checkpointing={"dir": "afile/ck"}), ["checkpointing.dir", "afile/ck"]),
    ("checkpoint-resume-missing", _trainer(checkpointing={"resume": "gone"}), ["checkpointing.resume", "'gone'"]),
    ("checkpoint-fallback-word", _trainer(checkpointing={"fallback": "yes"}), ["checkpointing.fallback", "'yes'"]),
    ("planning-cluster-unknown", _bare_trainer(planning={"cluster": "nosuch"}), ["planning.cluster", "'nosuch'"]),
    ("planning-policy-unknown", _bare_trainer(planning={"policy": "fastest"}), ["planning.policy", "'fastest'"]),
    ("planning-nm-too-many", _trainer(planning={"nm": 5000}), ["planning.nm", "5000", "1024"]),
    ("planning-d-negative", _trainer(planning={"d": -1}), ["planning.d", "-1"]),
    ("planning-schedule-unknown", _trainer(planning={"schedule": "zb"}), ["planning.schedule", "'zb'"]),
    ("planning-plan-cache-is-a-file", _bare_trainer(planning={"plan_cache": "afile"}),
     ["planning.plan_cache", "'afile'"]),
    ("reporting-progress-word", _trainer(reporting={"progress": "no"}), ["reporting.progress", "'no'"]),
    ("reporting-metrics-is-a-directory", _trainer(reporting={"metrics": "."}), ["reporting.metrics", "'.'"]),
    ("reporting-eval-every-zero", _trainer(reporting={"eval_every": 0}), ["reporting.eval_every", "got 0"]),
    ("runtime-timeout-nan", _trainer(runtime={"timeout": math.nan}), ["runtime.timeout", "nan"]),
    ("runtime-emulate-word", _trainer(runtime={"emulate": "yes"}), ["runtime.emulate", "'yes'"]),
    ("runtime-transport-unknown", _trainer(runtime={"transport": "ib"}), ["runtime.transport", "'ib'"]),
    ("runtime-emulation-scale-zero", _trainer(runtime={"emulation_scale": 0}), ["runtime.emulation_scale", "0"]),
    ("numerics-accumulate-zero", _trainer(numerics={"accumulate": 0}), ["numerics.accumulate", "got 0"]),
    ("numerics-clip-negative", _trainer(numerics={"clip_grad_norm": -1.0}), ["numerics.clip_grad_norm", "-1.0"]),
    ("numerics-seed-negative", _trainer(numerics={"seed": -1}), ["numerics.seed", "-1"]),
    ("numerics-precision-unknown", _trainer(numerics={"precision": "fp8"}), ["precision", "'fp8'"]),
    ("ps-aggregate-unknown", _trainer(ps={"aggregate": "max"}), ["ps.aggregate", "'max'"]),
    ("ps-audit-word", _trainer(ps={"audit": "yes"}), ["ps.audit", "'yes'"]),
    ("model-a-number", lambda: Trainer(5, cross_entropy, sgd(), synthetic()), ["model", "int"]),
    ("loss-fn-a-number", lambda: Trainer(mlp(), 5, sgd(), synthetic()), ["loss_fn", "5"]),
    ("optimizer-a-number", lambda: Trainer(mlp(), cross_entropy, 5, synthetic()), ["optimizer", "int"]),
    ("data-a-number", lambda: Trainer(mlp(), cross_entropy, sgd(), 5), ["data", "int"]),
    ("plan-a-number", _bare_trainer(plan=5), ["plan", "5"]),
    ("plan-missing-file", _bare_trainer(plan="noplan.json"), ["plan", "noplan.json"]),
    ("batches-batch-size-zero", lambda: Batches(_x(), _y(), 0), ["Batches(batch_size)", "got 0"]),
    ("batches-batch-size-fraction", lambda: Batches(_x(), _y(), 2.5), ["Batches(batch_size)", "2.5"]),
    ("batches-batch-size-bool", lambda: Batches(_x(), _y(), True), ["Batches(batch_size)", "True"]),
    ("batches-lengths-differ", lambda: Batches(_x(8), _y(6), 2), ["x", "y", "8", "6"]),
    ("batches-seed-negative", lambda: Batches(_x(), _y(), 2, seed=-3), ["Batches(seed)", "-3"]),
    ("batches-shuffle-word", lambda: Batches(_x(), _y(), 2, shuffle="no"), ["Batches(shuffle)", "'no'"]),
    ("batches-x-a-list", lambda: Batches([1, 2], _y(2), 1), ["Batches(x)", "list"]),
    ("dataset-source-seed-fraction", lambda: DatasetSource(torch.utils.data.TensorDataset(_x(), _y()), 2, seed=1.5),
     ["DatasetSource(seed)", "1.5"]),
    ("dataset-source-batch-size-zero", lambda: DatasetSource(torch.utils.data.TensorDataset(_x(), _y()), 0),
     ["batch_size", "0"]),
    ("stream-source-batch-size-zero", lambda: StreamSource(torch.utils.data.TensorDataset(_x(), _y()), 0),
     ["StreamSource(batch_size)", "got 0"]),
]

# The HETPIPE_* variables a rank reads, refused when the Trainer is built: (id, variable, value, names).
RANK_ENV = [
    ("ps-plane", "HETPIPE_PS_PLANE", "gpu", ["HETPIPE_PS_PLANE", "'gpu'"]),
    ("stage-plane", "HETPIPE_STAGE_PLANE", "fast", ["HETPIPE_STAGE_PLANE", "'fast'"]),
    ("term-grace", "HETPIPE_TERM_GRACE", "-1", ["HETPIPE_TERM_GRACE", "'-1'"]),
    ("timeout", "HETPIPE_TIMEOUT", "nan", ["HETPIPE_TIMEOUT", "'nan'"]),
    ("launcher-pid", "HETPIPE_LAUNCHER_PID", "abc", ["HETPIPE_LAUNCHER_PID", "'abc'"]),
    ("run-dir", "HETPIPE_RUN_DIR", "gone", ["HETPIPE_RUN_DIR", "'gone'"]),
    ("placement", "HETPIPE_PLACEMENT", "gone.json", ["HETPIPE_PLACEMENT", "'gone.json'"]),
]


@pytest.fixture
def bare_env(monkeypatch, tmp_path):
    """A case's own empty working directory (with :func:`_setup`'s files) and no HETPIPE_* variable."""
    for key in [k for k in os.environ if k.startswith("HETPIPE_")]:
        monkeypatch.delenv(key)
    _setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("build, names", [c[1:] for c in API], ids=[c[0] for c in API])
def test_a_bad_api_argument_is_one_line_naming_it(bare_env, build, names):
    before = _contents(bare_env)
    with pytest.raises((ValueError, TypeError)) as raised:
        build()
    message = _one_line(str(raised.value))
    assert message.startswith("hetpipe") and all(n in message for n in names), (message, names)
    # A bad value is a hetpipe error (a ValueError too); a value of the wrong kind may be a plain TypeError.
    assert isinstance(raised.value, HetpipeError) or type(raised.value) is TypeError, \
        f"{type(raised.value).__name__}: {message}"
    assert _contents(bare_env) == before


@pytest.mark.parametrize("variable, value, names", [c[1:] for c in RANK_ENV], ids=[c[0] for c in RANK_ENV])
def test_a_bad_variable_is_refused_when_the_trainer_is_built(bare_env, monkeypatch, variable, value, names):
    monkeypatch.setenv(variable, value)
    before = _contents(bare_env)
    with pytest.raises(ValueError) as raised:
        _trainer()()
    message = _one_line(str(raised.value))
    assert all(n in message for n in names), (message, names)
    assert _contents(bare_env) == before


def test_epochs_past_what_the_schedules_hold_are_refused_before_any_is_built(bare_env):
    """Each epoch of ``synthetic()`` is 8 minibatches: 2**22 epochs on 2 stages hold 2**26 minibatch-stages,
    past the bound; refused before a schedule is built (building them would take hours and ~60 GB)."""
    trainer = _trainer(epochs=1 << 22)()
    plan = trainer.resolve_plan()
    with pytest.raises(ValueError) as raised:
        trainer.spec(plan)
    message = _one_line(str(raised.value))
    assert f"epochs={1 << 22}" in message and str(MAX_MINIBATCH_STAGES) in message, message
    most = MAX_MINIBATCH_STAGES // (8 * 2)
    assert f"train at most {most} epoch(s) per run" in message, message
    assert len(_trainer(epochs=2)().spec(plan).schedules) == 1       # a valid count still builds


def test_valid_arguments_are_taken_as_given(bare_env, monkeypatch):
    from hetpipe.run.config import Checkpointing, Planning, Reporting, Runtime

    monkeypatch.setenv("HETPIPE_PS_PLANE", "Python")
    monkeypatch.setenv("HETPIPE_EMULATE", "emu_fast,emu_slow,ps")
    trainer = _trainer(epochs=3, checkpointing=Checkpointing(dir=bare_env / "new" / "ck", every=2, fallback=True),
                       planning=Planning(policy="ed", nm=2, plan_cache="cache"),
                       reporting=Reporting(progress=False, metrics=Path("out", "m.jsonl"), tensorboard="tb"),
                       runtime=Runtime(emulate=None, copy_stream=False))()
    cfg = trainer.config
    assert (cfg.epochs, cfg.checkpoint_every, cfg.planning.policy, cfg.reporting.metrics) == \
        (3, 2, "ed", Path("out", "m.jsonl"))
    data = Batches(_x(8), _y(8), 3, shuffle=False, seed=7)
    assert len(data) == 2 and [len(x) for x, _ in data] == [3, 3]
    assert _contents(bare_env) == ["afile", "ok.py"]        # nothing made before a run


# ---------------------------------------------------------------------------------------------------
# The command line, run for real: (id, arguments, environment, what stderr must name).

def _launch(*options, script="ok.py"):
    return ["launch", *options, script]


CLI = [
    ("np-zero", _launch("-n", "0"), {}, ["-n", "got 0"]),
    ("np-word", _launch("-n", "two"), {}, ["-n", "'two'"]),
    ("no-np", _launch(), {}, ["-n"]),
    ("timeout-nan", _launch("-n", "1", "--timeout", "nan"), {}, ["--timeout", "'nan'"]),
    ("start-timeout-negative", _launch("-n", "1", "--start-timeout", "-1"), {}, ["--start-timeout", "'-1'"]),
    ("term-grace-zero", _launch("-n", "1", "--term-grace", "0"), {}, ["--term-grace", "'0.0'"]),
    ("term-grace-negative", _launch("-n", "1", "--term-grace", "-1"), {}, ["--term-grace", "'-1'"]),
    ("checkpoint-every-zero", _launch("-n", "1", "--checkpoint-every", "0"), {}, ["--checkpoint-every", "got 0"]),
    ("checkpoint-every-fraction", _launch("-n", "1", "--checkpoint-every", "2.5"), {},
     ["--checkpoint-every", "'2.5'"]),
    ("max-restarts-negative", _launch("-n", "1", "--max-restarts", "-1"), {}, ["--max-restarts", "got -1"]),
    ("script-missing", _launch("-n", "1", script="missing.py"), {}, ["script", "'missing.py'"]),
    ("run-dir-is-a-file", _launch("-n", "1", "--run-dir", "afile"), {}, ["--run-dir", "'afile'"]),
    ("run-dir-below-a-file", _launch("-n", "1", "--run-dir", "afile/run"), {}, ["--run-dir", "'afile/run'"]),
    ("checkpoint-dir-is-a-file", _launch("-n", "1", "--checkpoint-dir", "afile"), {}, ["--checkpoint-dir", "'afile'"]),
    ("plan-cache-is-a-file", _launch("-n", "1", "--plan-cache", "afile"), {}, ["--plan-cache", "'afile'"]),
    ("resume-missing", _launch("-n", "1", "--resume", "nockpt"), {}, ["--resume", "'nockpt'"]),
    ("exclude-device-without-resume", _launch("-n", "1", "--exclude-device", "n0.g1"), {},
     ["--exclude-device", "n0.g1", "--resume"]),
    ("cluster-unknown", _launch("-n", "1", "--cluster", "nosuch"), {}, ["--cluster", "'nosuch'"]),
    ("transport-unknown", _launch("-n", "1", "--transport", "ib"), {}, ["--transport", "'ib'"]),
    ("plan-missing", _launch("--plan", "noplan.json"), {}, ["--plan noplan.json"]),
    ("hosts-no-slots", _launch("-n", "1", "-H", "a:0"), {}, ["-H a:0", "'0'"]),
    ("hosts-empty", _launch("-n", "1", "-H", ""), {}, ["-H", "names no host"]),
    ("hostfile-missing", _launch("-n", "1", "--hostfile", "nohosts"), {}, ["hostfile nohosts"]),
    ("emulate-hosts-without-hosts", _launch("-n", "1", "--emulate-hosts"), {}, ["--emulate-hosts"]),
    ("unknown-option", _launch("-n", "1", "--bogus"), {}, ["--bogus"]),
    ("env-timeout", _launch("-n", "1"), {"HETPIPE_TIMEOUT": "-5"}, ["HETPIPE_TIMEOUT", "'-5'"]),
    ("env-start-timeout", _launch("-n", "1"), {"HETPIPE_START_TIMEOUT": "nan"}, ["HETPIPE_START_TIMEOUT", "'nan'"]),
    ("env-term-grace", _launch("-n", "1"), {"HETPIPE_TERM_GRACE": "soon"}, ["HETPIPE_TERM_GRACE", "'soon'"]),
    ("env-ps-plane", _launch("-n", "1"), {"HETPIPE_PS_PLANE": "gpu"}, ["HETPIPE_PS_PLANE", "'gpu'"]),
    ("env-stage-plane", _launch("-n", "1"), {"HETPIPE_STAGE_PLANE": "fast"}, ["HETPIPE_STAGE_PLANE", "'fast'"]),
    ("env-emulate-type", _launch("-n", "1"), {"HETPIPE_EMULATE": "emu_nope"}, ["HETPIPE_EMULATE", "'emu_nope'"]),
    ("env-emulate-speed", _launch("-n", "1"), {"HETPIPE_EMULATE": "x:speed=0:memory=1GiB"},
     ["HETPIPE_EMULATE", "speed", "'0'"]),
    ("env-emulate-count", _launch("-n", "3"), {"HETPIPE_EMULATE": "emu_fast,emu_slow"},
     ["HETPIPE_EMULATE", "lists 2 values", "3 ranks", "'emu_fast,emu_slow'"]),
    ("env-host-count", _launch("-n", "3"), {"HETPIPE_HOST": "a,b"}, ["HETPIPE_HOST", "lists 2 values", "'a,b'"]),
    ("env-placement-left-over", _launch("-n", "1"), {"HETPIPE_PLACEMENT": "/old/placement.json"},
     ["HETPIPE_PLACEMENT", "'/old/placement.json'"]),
    ("env-slurm-nodelist", _launch("-n", "1"), {"SLURM_JOB_NODELIST": "gpu[1-x]"}, ["SLURM_JOB_NODELIST", "'1-x'"]),
    ("plan-d-negative", ["plan", "--cluster", "cpu-emulated", "--profile", "gpt", "--d", "-1"], {},
     ["--d", "got -1"]),
    ("simulate-waves-zero", ["simulate", "--plan", "noplan.json", "--waves", "0"], {}, ["--waves", "'0'"]),
]


# Runs each case as ``python -m hetpipe`` does (``runpy.run_module("hetpipe", run_name="__main__")``), each in
# a fork of one process that imported the command line's modules once: a fresh interpreter per case would
# spend most of the test importing them again. Writes {case: exit status}; each case's output is in its folder.
DRIVER = r"""
import json, os, runpy, sys, traceback
import hetpipe.cli, hetpipe.launch.checks, hetpipe.launch.mpiexec, hetpipe.plan.cluster, hetpipe.schedule.registry
statuses = {}
for case in json.load(open(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(case["where"])
            for key in [k for k in os.environ if k.startswith(("HETPIPE_", "SLURM_"))]:
                del os.environ[key]
            os.environ.update(case["env"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(case["where"], os.pardir, case["name"] + "." + name),
                                os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.argv = ["hetpipe", *case["argv"]]
            runpy.run_module("hetpipe", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    statuses[case["name"]] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
json.dump(statuses, sys.stdout)
"""


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Every CLI case's (exit status, stdout, stderr, files left in its folder). Each case runs in its own
    folder, with its own temporary directory (where a launcher would make its run directory) and no
    HETPIPE_* or Slurm variable but the case's."""
    import json

    base = tmp_path_factory.mktemp("cli")
    cases = []
    for name, argv, env, _ in CLI:
        where = base / name
        (where / "tmp").mkdir(parents=True)
        _setup(where)
        cases.append({"name": name, "argv": argv, "env": {**env, "TMPDIR": str(where / "tmp")}, "where": str(where)})
    (base / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(base / "cases.json")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    statuses = json.loads(proc.stdout)
    return {name: (statuses[name], (base / f"{name}.stdout").read_text(), (base / f"{name}.stderr").read_text(),
                   _contents(base / name)) for name, _, _, _ in CLI}


@pytest.mark.parametrize("case, names", [(c[0], c[3]) for c in CLI], ids=[c[0] for c in CLI])
def test_a_bad_command_line_is_one_line_naming_it(cli_results, case, names):
    status, out, err, left = cli_results[case]
    assert status == 2, (status, err)
    message = _one_line(err)
    assert message.startswith("hetpipe") and all(n in message for n in names), (message, names)
    assert left == ["afile", "ok.py", "tmp"], left         # no run directory, run file or output
    assert "hi" not in out                                  # the script never ran


@pytest.mark.parametrize("argv, env, names", [
    (_launch("-n", "1", "--run-dir", "afile"), {}, ["--run-dir", "'afile'"]),
    (_launch("-n", "2"), {"HETPIPE_EMULATE": "emu_fast,emu_nope"}, ["HETPIPE_EMULATE", "rank 1", "'emu_nope'"]),
], ids=["run-dir", "emulate"])
def test_the_real_entry_refuses_in_one_line(tmp_path, argv, env, names):
    """``python -m hetpipe`` in a fresh interpreter, as a user types it (the corpus above runs forks of one)."""
    _setup(tmp_path)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("HETPIPE_", "SLURM_"))}, **env,
            "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "hetpipe", *argv], cwd=tmp_path, env=full, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc
    message = _one_line(proc.stderr)
    assert message.startswith("hetpipe launch: ") and all(n in message for n in names), message
    assert _contents(tmp_path) == ["afile", "ok.py"]


def test_the_cli_corpus_is_large_enough():
    assert len(API) + len(RANK_ENV) + len(CLI) >= 40
    assert len({c[0] for c in CLI}) == len(CLI) and len({c[0] for c in API}) == len(API)


def test_valid_launch_arguments_pass_the_checks(bare_env, monkeypatch):
    """The launcher's checks take what a valid launch gives (directories still to be made, a preset
    cluster, an emulated world of one value per rank), without making anything."""
    import argparse

    from hetpipe.launch.checks import check_arguments

    monkeypatch.setenv("HETPIPE_EMULATE", "emu_fast,emu_slow,ps")
    monkeypatch.setenv("HETPIPE_TERM_GRACE", "5")
    args = argparse.Namespace(script="ok.py", run_dir="runs/a", checkpoint_dir="ck", plan_cache="pc",
                              resume=None, cluster="cpu-emulated")
    check_arguments(args, 3, None)
    check_arguments(argparse.Namespace(**{**vars(args), "cluster": "auto", "resume": "."}), 3, None)
    assert _contents(bare_env) == ["afile", "ok.py"]
