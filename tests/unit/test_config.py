"""The Trainer's settings: six typed sections, the run file of ``hetpipe launch`` merged into them, and
the flat keywords of the previous release.

What is proved: each section refuses a bad field naming it; a dict is accepted as its section and an
unknown key is refused; the launcher fills only what the script leaves unset, and a value both give
differently is one error naming both; a restart's plan and checkpoint replace the script's; a flat
keyword still configures the same field (the run equal to the sectioned one) and warns naming its
replacement; the run file refuses unknown fields and wrong types, naming the file.
"""

import inspect
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic  # noqa: E402

from hetpipe import (Checkpointing, HetpipeDeprecationWarning, Numerics, Planning, PSRule, Reporting,  # noqa: E402
                     Runtime, Trainer)
from hetpipe.job.launch_file import LAUNCH_FILE, LaunchFileError, LaunchSettings  # noqa: E402
from hetpipe.job.roles import LaunchError  # noqa: E402
from hetpipe.job.rundir import RUN_DIR_ENV  # noqa: E402
from hetpipe.run.config import SECTIONS, resolve, section  # noqa: E402


def _trainer(**kw):
    return Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([3], 1, 0), **kw)


def test_the_trainer_takes_at_most_twelve_parameters():
    params = [p for p in inspect.signature(Trainer).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert len(params) <= 12, [p.name for p in params]
    assert {"planning", "ps", "numerics", "checkpointing", "reporting", "runtime"} <= {p.name for p in params}


@pytest.mark.parametrize("name, value, match", [
    ("planning", Planning, r"planning\.nm must be a whole number >= 1"),
    ("numerics", Numerics, r"numerics\.accumulate \(minibatches\) must be a whole number >= 1"),
    ("checkpointing", Checkpointing, r"checkpointing\.every \(waves\) must be a whole number >= 1"),
    ("runtime", Runtime, r"runtime\.timeout must be a finite number > 0"),
    ("ps", PSRule, r"ps\.aggregate must be 'mean' or 'sum'"),
])
def test_a_bad_field_is_named_by_its_section(name, value, match):
    bad = {"planning": {"nm": 0}, "numerics": {"accumulate": 0}, "checkpointing": {"every": 0},
           "runtime": {"timeout": -1}, "ps": {"aggregate": "max"}}[name]
    with pytest.raises(ValueError, match=match):
        value(**bad)
    with pytest.raises(ValueError, match=match):
        _trainer(**{name: bad})


def test_a_dict_is_its_section_and_an_unknown_key_is_refused():
    assert section("numerics", {"precision": "bf16", "seed": 3}, Numerics) == Numerics(precision="bf16", seed=3)
    assert section("planning", None, Planning) == Planning()
    with pytest.raises(TypeError, match=r"numerics has no field 'nm'; its fields are accumulate, clip_grad_norm"):
        section("numerics", {"nm": 2}, Numerics)
    with pytest.raises(TypeError, match=r"ps must be a hetpipe\.PSRule or a dict of its fields, got 3"):
        _trainer(ps=3)


def _resolved(launch: LaunchSettings, **sections):
    given = {name: section(name, sections.get(name), kind) for name, kind in SECTIONS.items()}
    return resolve(1, sections.get("plan"), given, launch)


def test_the_launcher_fills_only_what_the_script_leaves_unset(tmp_path):
    launch = LaunchSettings(cluster="cpu-emulated-6", checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3,
                            transport="mpi-host", timeout=9.0, plan_cache=str(tmp_path / "cache"))
    config = _resolved(launch)
    assert config.planning.cluster == "cpu-emulated-6" and config.checkpoint_every == 3
    assert config.runtime.transport == "mpi-host" and config.timeout_s == 9.0
    assert config.plan_cache == tmp_path / "cache" and Path(config.checkpointing.dir) == tmp_path / "ck"
    same = _resolved(launch, checkpointing=Checkpointing(dir=tmp_path / "x" / ".." / "ck", every=3))
    assert same.checkpoint_every == 3        # the same directory, spelt otherwise, is no conflict
    alone = _resolved(LaunchSettings(), checkpointing=Checkpointing(every=2))
    assert alone.checkpoint_every == 2 and alone.planning.cluster is None and alone.plan_source == "planned"


@pytest.mark.parametrize("sections, launch, names", [
    ({"checkpointing": Checkpointing(every=2)}, {"checkpoint_every": 5},
     "the script sets checkpointing.every=2 but hetpipe launch --checkpoint-every asks for 5"),
    ({"planning": Planning(cluster="cpu-emulated")}, {"cluster": "auto"},
     "the script sets planning.cluster='cpu-emulated' but hetpipe launch --cluster asks for 'auto'"),
    ({"runtime": Runtime(timeout=30)}, {"timeout": 60.0},
     "the script sets runtime.timeout=30 but hetpipe launch --timeout asks for 60.0"),
    ({"runtime": Runtime(transport="torch-p2p")}, {"transport": "mpi-host"},
     "the script sets runtime.transport='torch-p2p' but hetpipe launch --transport asks for 'mpi-host'"),
])
def test_a_setting_given_twice_differently_is_one_line_naming_both(sections, launch, names):
    with pytest.raises(LaunchError) as e:
        _resolved(LaunchSettings(**launch), **sections)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_launch_plan_must_match_the_scripts_and_a_restart_plan_replaces_it(tmp_path):
    mine, other = one_vw_plan([3], 1, 0), one_vw_plan([2], 1, 0)
    path, other_path = tmp_path / "mine.json", tmp_path / "other.json"
    mine.save(path)
    other.save(other_path)
    assert _resolved(LaunchSettings(plan=str(path)), plan=mine).plan_source == "script"
    with pytest.raises(LaunchError, match=r"the script's plan= and hetpipe launch --plan .*other\.json are "
                                          r"different plans"):
        _resolved(LaunchSettings(plan=str(other_path)), plan=mine)
    restart = _resolved(LaunchSettings(plan=str(other_path), restarting=True, resume=str(tmp_path / "ck")),
                        plan=mine, checkpointing=Checkpointing(resume=tmp_path / "first"))
    assert (restart.plan, restart.plan_source) == (str(other_path), "restart")
    assert restart.checkpointing.resume == str(tmp_path / "ck")
    with pytest.raises(LaunchError, match="checkpointing.resume"):
        _resolved(LaunchSettings(resume=str(tmp_path / "ck")), checkpointing=Checkpointing(resume=tmp_path / "a"))


def test_the_trainer_reads_the_run_file_of_its_launch(tmp_path, monkeypatch):
    LaunchSettings(checkpoint_every=4).write(str(tmp_path))
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    assert _trainer().config.checkpoint_every == 4
    with pytest.raises(LaunchError, match="checkpointing.every=2 but hetpipe launch --checkpoint-every asks for 4"):
        _trainer(checkpointing=Checkpointing(every=2))


def test_flat_keywords_still_work_warn_and_train_as_their_sections():
    with pytest.warns(HetpipeDeprecationWarning) as warned:
        old = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([2, 4], 1, 0), seed=3,
                      clip_grad_norm=0.5, progress=False)
    said = [str(w.message) for w in warned]
    assert len(said) == 3
    assert "Trainer(seed=...) is deprecated and goes in the next release: use numerics=hetpipe.Numerics(seed=...)" \
        in said[0]
    assert "use reporting=hetpipe.Reporting(progress=...)" in said[2]
    new = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=one_vw_plan([2, 4], 1, 0),
                  numerics=Numerics(seed=3, clip_grad_norm=0.5), reporting=Reporting(progress=False))
    assert old.config == new.config
    a, b = old.replay(), new.replay()
    assert a.losses == b.losses
    with pytest.warns(HetpipeDeprecationWarning), pytest.raises(TypeError, match=r"seed=\.\.\.\) and numerics\.seed "
                                                                                  r"both given"):
        _trainer(seed=1, numerics=Numerics(seed=2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'nmm'"):
        _trainer(nmm=2)


@pytest.mark.parametrize("text, match", [
    ('{"checkpoint_every": "2"}', r"checkpoint_every must be int, got '2'"),
    ('{"timeout": true}', r"timeout must be int or float, got True"),
    ('{"plan_file": "x"}', r"unknown field 'plan_file'"),
    ('[1]', r"must hold a JSON object"),
    ('{', r"cannot be read"),
])
def test_a_bad_run_file_is_refused_naming_it(tmp_path, text, match):
    (tmp_path / LAUNCH_FILE).write_text(text)
    with pytest.raises(LaunchFileError, match=match) as e:
        LaunchSettings.read(str(tmp_path))
    assert str(tmp_path / LAUNCH_FILE) in str(e.value)


def test_the_run_file_round_trips(tmp_path):
    settings = LaunchSettings(cluster="auto", plan="/p.json", plan_reason="why", restarting=True, checkpoint_every=2,
                              timeout=3.5, run_id="abc")
    settings.write(str(tmp_path))
    assert LaunchSettings.read(str(tmp_path)) == settings
    assert json.loads((tmp_path / LAUNCH_FILE).read_text())["cluster"] == "auto"
    assert LaunchSettings.read(str(tmp_path / "none")) == LaunchSettings()
