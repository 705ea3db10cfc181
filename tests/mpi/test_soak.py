"""Fault soak: one long `hetpipe launch --max-restarts N` run under mpiexec takes a seeded random series of
faults, and must end as if nothing had happened.

The job (scripts/soak_run.py: 1 VW of 2 stages + 2 PS shards, D = 0, momentum and a StepLR, checkpoints
every 3 waves, 2 kept, resume falling back past a checkpoint that fails verification) gets, at seeded
random waves of its attempts, each of:

* kill: SIGKILL of a rank; stop: SIGSTOP of a rank (the launcher must see it stopped, T/2 with T = 4 s);
  the victim is a PS shard rank: a stage rank's device is emulated here, and an emulated device whose
  rank failed is left out for good (launch/restart.py), so every stage fault would shrink the job and
  change its plan (tests/mpi/test_checkpoint_mpi.py covers that, once); a PS shard restarts in place;
* disk full: a rank's next checkpoint write gets half its bytes on disk, then OSError(ENOSPC)
  (soak_run.arm_disk_full), any rank;
* corrupt: once an attempt has failed and its processes are gone, a byte of a part of the latest
  complete checkpoint is flipped, so the next attempt must detect the digest mismatch and fall back.

References, each independent of the soaked run: a fault-free launch of the same job (its weights, and its
last stage's list of trained minibatches, identified by their labels' digest), the kernel's view of
processes (/proc), and the launcher's own stderr. Asserted: the job ends well within N restarts; the
minibatches committed by the final lineage (each attempt's trained list cut at the clock the next
attempt of the lineage resumed from) are the fault-free run's, in order, each exactly once, with the
same losses; the final weights equal the fault-free run's bitwise; after every fault, and at the end, no
process of the run is alive; every fault's culprit is named. The seed (``HETPIPE_SOAK_SEED``) and the
schedule are printed, so a failure reproduces; ``tests/soak_table.py`` prints the fault table from the
record the test writes (``HETPIPE_SOAK_RECORD``).
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpirun import SCRIPTS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from soak_table import table  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.mpi,
              pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")]

SEED = int(os.environ.get("HETPIPE_SOAK_SEED", "20261125"))
CFG = {"nm": 2, "epochs": 2, "minibatches": 48, "time": 0.01}       # 48 waves of 2 minibatches
EVERY = 3                               # waves between checkpoints
PEER_TIMEOUT_S = 4.0
RANKS, PS_RANKS = 4, (2, 3)
# A hang guard, as in the fault suite: every process of a failed attempt must go by itself; how long
# that took is recorded (the table's figures), not asserted, since a loaded host stretches it.
GONE_GUARD_S = 120.0
ATTEMPT_TIMEOUT_S = 120.0               # start-up of 4 ranks (torch) and a few waves on a loaded 2-core machine
SOAK_TIMEOUT_S = 420.0


def schedule(seed: int):
    """Five failures, each kind at least once, at clocks spread over the job (one in each fifth of its
    waves, so on both sides of the epoch boundary), two of them followed by a corrupted checkpoint part."""
    rng = random.Random(seed)
    kinds = ["kill", "stop", "diskfull"] + [rng.choice(["kill", "stop", "diskfull"]) for _ in range(2)]
    rng.shuffle(kinds)
    corrupt = set(rng.sample(range(len(kinds)), 2))
    span = CFG["epochs"] * CFG["minibatches"] // CFG["nm"] - 8
    return [{"kind": kind, "victim": rng.choice(PS_RANKS) if kind in ("kill", "stop") else rng.randrange(RANKS),
             "at_clock": rng.randint(4 + i * span // 5, 3 + (i + 1) * span // 5),
             "corrupt": {"rank": rng.randrange(RANKS), "at": rng.random()} if i in corrupt else None}
            for i, kind in enumerate(kinds)]


# --- processes, read from the kernel ------------------------------------------------------------------
def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZXx" and marker in env


def _alive_of(run_dir: Path, recorded=True) -> set:
    """Processes (not zombies) whose environment carries a HETPIPE_RUN_DIR at or under ``run_dir``
    (the marker every process of a launched run inherits), and the pids the run directory records."""
    marker = f"HETPIPE_RUN_DIR={run_dir}".encode()
    pids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    if recorded:
        for f in [*run_dir.rglob("*.pid"), *run_dir.rglob("rank-*.txt")]:
            try:
                pids.add(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
    return {pid for pid in pids if pid != os.getpid() and _environ_has(pid, marker)}


# --- the job's records ---------------------------------------------------------------------------------
def _trained(attempt: Path) -> list:
    """(digest, loss) of every minibatch the attempt's last stage computed a loss for, in order."""
    files = sorted(attempt.glob("trained-*.jsonl"))
    assert len(files) <= 1, files          # one VW: one last stage per attempt
    if not files:
        return []
    rows = []
    for line in files[0].read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:                  # a line cut by SIGKILL mid-write (never a committed one)
            continue
        rows.append((row["digest"], row["loss"]))
    return rows


def _resumed_clock(attempt: Path) -> int:
    f = attempt / "resumed.json"
    return json.loads(f.read_text())["clock"] if f.exists() else 0


def _reached(attempt: Path) -> int:
    """The lowest clock every rank of the attempt reached (-1 before each rank wrote one)."""
    files = list(attempt.glob("clock-of-rank-*"))
    if len(files) < RANKS:
        return -1
    try:
        return min(int(f.read_text().split()[0]) for f in files)
    except (OSError, ValueError, IndexError):
        return -1


def _data_order(cfg) -> list:
    """The label digests of the job's minibatches in the order one VW trains them, from the data itself."""
    sys.path.insert(0, str(SCRIPTS))
    from soak_run import data_of, label_digest

    data, order = data_of(cfg), []
    for epoch in range(cfg["epochs"]):
        data.set_epoch(epoch)
        order += [label_digest(y) for _, y in data]
    return order


def _launch(out: Path, run_dir: Path, ckpt: Path, fault_dir: Path, *extra: str, err=None, cfg=CFG
            ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", str(RANKS), "--timeout", str(PEER_TIMEOUT_S),
           "--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), *extra,
           "soak_run.py", str(out), json.dumps(cfg)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}, "SOAK_FAULT_DIR": str(fault_dir)}
    return subprocess.Popen(cmd, cwd=SCRIPTS, env=env, stdout=subprocess.DEVNULL, stderr=err or subprocess.PIPE,
                            text=True, start_new_session=True)


def _weights(out: Path) -> dict:
    with np.load(out / "weights.npz", allow_pickle=False) as z:
        return {int(k): z[k] for k in z.files}


def _flip(ckpt: Path, rank: int, at: float) -> dict:
    """Flip one byte of the tensor data of ``rank``'s part of the latest complete checkpoint."""
    from hetpipe.checkpoint.format import latest, part_name

    path = latest(ckpt)
    assert path is not None, "no complete checkpoint to corrupt"
    file = path / f"{part_name(rank)}.safetensors"
    data = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")         # safetensors: header length, header, then the data
    pos = start + int(at * (len(data) - start))
    data[pos] ^= 0xFF
    file.write_bytes(bytes(data))
    return {"clock": int(path.name.split("-")[1]), "file": str(file), "byte": pos}


def _finish(proc: subprocess.Popen, run_dir: Path, what: str):
    try:
        out, err = proc.communicate(timeout=SOAK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate()
        for pid in _alive_of(run_dir):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the {what} run did not finish within {SOAK_TIMEOUT_S} s:\n{err}")
    return proc.returncode, err


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The reference: the same job, never interrupted."""
    base = tmp_path_factory.mktemp("fault-free")
    proc = _launch(base / "out", base / "run", base / "ckpt", base / "faults")
    rc, err = _finish(proc, base / "run", "fault-free")
    assert rc == 0, err
    trained = _trained(base / "run" / "attempt-0")
    assert [d for d, _ in trained] == _data_order(CFG)
    assert len({d for d, _ in trained}) == len(trained), "two minibatches with the same labels: no identity"
    return trained, _weights(base / "out")


def test_soak_of_random_faults_ends_as_the_fault_free_run(tmp_path, fault_free):
    plan = schedule(SEED)
    print(f"soak seed {SEED} (HETPIPE_SOAK_SEED to replay); schedule:")
    for i, f in enumerate(plan):
        print(f"  fault {i}: {json.dumps(f)}")
    ref_trained, ref_weights = fault_free
    run, ckpt, fault_dir, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "faults", tmp_path / "out"
    fault_dir.mkdir()
    err_path = tmp_path / "launcher.err"
    started = time.monotonic()
    with open(err_path, "w") as err_file:
        proc = _launch(out, run, ckpt, fault_dir, "--max-restarts", str(len(plan)), err=err_file)
        try:
            done = [_inject(proc, run, ckpt, fault_dir, i, f, err_path) for i, f in enumerate(plan)]
            rc, _ = _finish(proc, run, "soaked")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            for pid in _alive_of(run):
                os.kill(pid, signal.SIGKILL)
    wall = time.monotonic() - started
    err = err_path.read_text()

    # (1) The job ends well, after exactly one restart per fault.
    assert rc == 0, err
    attempts = sorted(run.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(attempts) == len(plan) + 1, err
    assert json.loads((attempts[-1] / "outcome.json").read_text())["status"] == "ok"
    for i, f in enumerate(done):
        line = next((ln for ln in err.splitlines() if ln.startswith(f"hetpipe: restart {i + 1} of {len(plan)}: ")),
                    "")
        f["named"] = f["named"] and f["role"] in line and f["says"] in line
        assert f["named"], (f, line)

    # (4) No process of the run is alive, by pid recorded and by the run's marker in /proc.
    gone_at = time.monotonic()
    while _alive_of(run) and time.monotonic() - gone_at < GONE_GUARD_S:
        time.sleep(0.05)
    assert not _alive_of(run), f"process(es) of the run alive after the launcher exited: {_alive_of(run)}"
    assert not [p for p in ckpt.rglob("*") if p.name.endswith(".tmp")], "a failed write left a temporary file"

    # A corrupted part: the next attempt named the file, fell back past it, and resumed from before it.
    for i, f in enumerate(done):
        c = f.get("corruption")
        if c:
            resumed = _resumed_clock(attempts[i + 1])
            c["named"] = f"the checkpoint part {c['file']} is corrupt" in err and \
                "falling back to the previous complete checkpoint" in err and resumed < c["clock"]
            c["redone"] = (f["latest"] - resumed) * CFG["nm"]
            assert c["named"], (c, resumed, err)

    # (2) The final lineage committed every minibatch exactly once, in the fault-free order, with its losses.
    starts = [_resumed_clock(a) for a in attempts]
    trained = [_trained(a) for a in attempts]
    lineage = [len(attempts) - 1]
    while starts[lineage[-1]] > 0:
        cut = starts[lineage[-1]]
        # Who wrote the checkpoint at `cut` the attempt resumed from: the latest earlier attempt that went on
        # from a cut before it (each attempt discards its run's checkpoints past the cut it resumed from).
        writer = max(j for j in range(lineage[-1]) if starts[j] < cut)
        assert len(trained[writer]) >= (cut - starts[writer]) * CFG["nm"], \
            f"attempt {lineage[-1]} resumed from clock {cut}, which attempt {writer} never trained up to"
        lineage.append(writer)
    lineage.reverse()
    committed = []
    for a, b in zip(lineage, lineage[1:] + [None]):
        committed += trained[a] if b is None else trained[a][:(starts[b] - starts[a]) * CFG["nm"]]
    ref_digests = [d for d, _ in ref_trained]
    lost = len(set(ref_digests) - {d for d, _ in committed})
    twice = len(committed) - len({d for d, _ in committed})
    assert [d for d, _ in committed] == ref_digests, \
        f"lineage {lineage} (resumed at clocks {starts}): {lost} minibatch(es) missing, {twice} trained twice"
    assert committed == ref_trained, "the lineage's losses differ from the fault-free run's"
    # Work redone: what attempt i trained past the latest complete checkpoint when it failed (the fault's
    # share), and past that down to the checkpoint the next attempt fell back to (the corruption's).
    for i, f in enumerate(done):
        f["redone"] = max(0, len(trained[i]) - (f["latest"] - starts[i]) * CFG["nm"])
        if f.get("corruption"):
            f["corruption"]["gone"] = done[i + 1]["gone"] if i + 1 < len(done) else not _alive_of(run)

    # (3) The final weights are the fault-free run's, bitwise.
    weights = _weights(out)
    assert sorted(weights) == sorted(ref_weights)
    assert all(np.array_equal(weights[k], ref_weights[k]) for k in ref_weights), \
        "weights differ from the fault-free run"

    record = {"seed": SEED, "schedule": plan, "faults": done, "attempts": len(attempts), "lineage": lineage,
              "resumed_at": starts, "minibatches": len(ref_trained), "lost": lost + twice, "wall_s": wall}
    (tmp_path / "soak.json").write_text(json.dumps(record, indent=1))
    if os.environ.get("HETPIPE_SOAK_RECORD"):
        Path(os.environ["HETPIPE_SOAK_RECORD"]).write_text(json.dumps(record, indent=1))
    print(table(record))


def _inject(proc, run: Path, ckpt: Path, fault_dir: Path, i: int, fault: dict, err_path: Path) -> dict:
    """Wait until every rank of attempt ``i`` reached clock ``at_clock`` and a wave past the attempt's start
    (and, before a corruption, two complete checkpoints exist to fall back between), inject ``fault``, wait
    for the attempt to end, check that every process of it is gone, and corrupt a part if asked; returns
    what happened."""
    from hetpipe.checkpoint.format import complete_clocks, latest

    attempt = run / f"attempt-{i}"
    deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
    while True:
        if proc.poll() is not None or (attempt / "outcome.json").exists():
            pytest.fail(f"attempt {i} ended before fault {i} ({fault}) was injected:\n{err_path.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"attempt {i} did not reach clock {fault['at_clock']} within {ATTEMPT_TIMEOUT_S} s")
        if _reached(attempt) >= max(fault["at_clock"], _resumed_clock(attempt) + 1) and \
                (fault["corrupt"] is None or len(complete_clocks(ckpt)) >= 2):
            break
        time.sleep(0.01)
    victim, kind = fault["victim"], fault["kind"]
    role = (attempt / f"rank-{victim}.txt").read_text().splitlines()[1]
    at = time.monotonic()
    if kind == "diskfull":
        tmp = fault_dir / ".diskfull-armed"
        tmp.write_text(f"{victim}\n")
        os.replace(tmp, fault_dir / "diskfull-armed")
    else:
        os.kill(int((attempt / f"rank-{victim}.txt").read_text().split()[0]),
                signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    while not (attempt / "outcome.json").exists():
        if time.monotonic() - at > ATTEMPT_TIMEOUT_S:
            pytest.fail(f"attempt {i} did not end within {ATTEMPT_TIMEOUT_S} s of fault {fault}")
        time.sleep(0.01)
    corruption = None
    if fault["corrupt"] is not None:
        # Between attempts: the launcher is held (SIGSTOP) from the moment it wrote the attempt's outcome
        # until the part is corrupted, so that the next attempt's ranks cannot have read it yet.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert not list((run / f"attempt-{i + 1}").glob("rank-*.txt")), "the next attempt started too soon"
            found = latest(ckpt)
            corruption = _flip(ckpt, fault["corrupt"]["rank"], fault["corrupt"]["at"])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    else:
        found = latest(ckpt)
    left = _alive_of(attempt)
    while left and time.monotonic() - at < GONE_GUARD_S:
        time.sleep(0.05)
        left = _alive_of(attempt)
    gone_s = time.monotonic() - at
    outcome = json.loads((attempt / "outcome.json").read_text())
    says = {"kill": "failed: it died", "stop": "failed: it stopped responding",
            "diskfull": "No space left on device"}[kind]
    named = outcome["rank"] == victim and outcome["role"] == role
    if kind == "diskfull":
        fired = json.loads((fault_dir / "diskfull-fired").read_text())
        named = named and fired["rank"] == victim and outcome["cause"] == "reported"
    result = {**fault, "role": role, "says": says, "latest": int(found.name.split("-")[1]) if found else 0,
              "cause": outcome["cause"], "gone": not left, "gone_s": gone_s,
              "named": named, "message": outcome["message"]}
    if corruption:
        result["corruption"] = {**corruption, "gone_s": None}
    assert not left, f"fault {i} ({kind}): process(es) {sorted(left)} of attempt {i} alive {GONE_GUARD_S} s after it"
    assert named, f"fault {i} ({kind} of rank {victim}): the outcome names {outcome}"
    return result


def test_a_disk_full_at_the_first_checkpoint_restarts_the_same_run_from_the_start(tmp_path):
    """Rank 1's first checkpoint write finds the disk full, so no checkpoint is complete: the restart
    (same devices: the disk failed, not a device) starts over, as the same run, whose incomplete clock is
    its own. Before, the restarted ranks drew a new run id and refused the directory as another run's."""
    from hetpipe.checkpoint.format import run_ids

    cfg = {"nm": 2, "epochs": 1, "minibatches": 16, "time": 0.0}
    run, ckpt, fault_dir, out = tmp_path / "run", tmp_path / "ckpt", tmp_path / "faults", tmp_path / "out"
    fault_dir.mkdir()
    (fault_dir / "diskfull-armed").write_text("1\n")
    proc = _launch(out, run, ckpt, fault_dir, "--max-restarts", "1", cfg=cfg)
    rc, err = _finish(proc, run, "disk-full")
    assert rc == 0, err
    assert json.loads((fault_dir / "diskfull-fired").read_text())["rank"] == 1
    assert "hetpipe: restart 1 of 1: rank 1 (vw 0 stage 1) failed: CheckpointError: hetpipe: writing " in err, err
    assert "No space left on device" in err and "a checkpoint write found no space left on its disk: restarting " \
           "with the same devices; 1 VW(s) on 4 ranks; no complete checkpoint in " in err, err
    assert not (run / "attempt-1" / "resumed.json").exists()
    assert [d for d, _ in _trained(run / "attempt-1")] == _data_order(cfg)     # every minibatch, once, in order
    assert len(run_ids(ckpt)) == 1 and not _alive_of(run)
