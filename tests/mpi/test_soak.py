"""Fault soak: one long `hetpipe launch --max-restarts N` run under mpiexec takes a seeded random series of
faults, and must end as if nothing had happened.

The job (scripts/soak_run.py: planned by the Trainer on three emulated devices, 1 VW of 3 stages + 1 PS
shard, D = 0, momentum and a StepLR, checkpoints every 3 waves, 2 kept, resume falling back past a
checkpoint that fails verification) runs in a mount namespace of its own whose checkpoint directory is
a small tmpfs (``unshare -rm``), so that a full disk is a real one. At seeded random waves of its
attempts it gets each of:

* stage kill: SIGKILL of a stage rank; its emulated device is left out for good (launch/restart.py), and
  the restart re-plans the remaining two (1 VW of 2 stages); once per soak;
* PS kill, PS stop: SIGKILL or SIGSTOP of the PS shard's rank (the launcher must see it stopped, T/2
  with T = 4 s); a PS shard restarts in place;
* SIGTERM at a checkpoint: SIGTERM to a rank while a checkpoint is being written (a clock directory
  without its manifest); the rank writes its SIGTERM checkpoint, and the run restarts from it;
* disk full: the test fills the tmpfs (a file of zeros up to ENOSPC), so the next checkpoint write
  fails with the kernel's ENOSPC wherever the writing layer reports it; once the attempt has ended the
  file is removed (an operator freeing space) before the restart goes on;
* corrupt: once an attempt has failed and its processes are gone, a byte of a part of the latest
  complete checkpoint is flipped, so the next attempt must detect the digest mismatch and fall back.

References, each independent of the soaked run: a fault-free launch of the same job (its weights, and its
last stage's list of trained minibatches, identified by their labels' digest), the kernel's view of
processes (/proc), and the launcher's own stderr. Asserted: the job ends well within N restarts; the
minibatches committed by the final lineage (each attempt's trained list cut at the clock the next
attempt of the lineage resumed from) are the fault-free run's, in order, each exactly once, with the
same losses up to the re-plan (both runs train one plan, through a shared plan cache; a re-planned layout
computes other numbers, so after it only the minibatches are compared); the final weights equal the
fault-free run's bitwise when no re-plan changed the layout; after every fault, and at the end, no
process of the run is alive; every fault's culprit is named. The seed (``HETPIPE_SOAK_SEED``) and the
schedule are printed, so a failure reproduces; ``tests/soak_table.py`` prints the fault table from the
record the test writes (``HETPIPE_SOAK_RECORD``).
"""

import errno
import json
import os
import random
import shutil
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

SEED = int(os.environ.get("HETPIPE_SOAK_SEED", "20261128"))
CFG = {"nm": 2, "epochs": 2, "minibatches": 48}       # 48 waves of 2 minibatches
# The fault-free run plans (profiling on this host) and keeps its plan there (the fixture sets it); the
# soaked run plans from it, so both train one plan, whatever the host's load did to the profile.
PLAN_CACHE = None
EVERY = 3                               # waves between checkpoints
PEER_TIMEOUT_S = 4.0
RANKS = 4                               # 3 stages + the PS shard, until a stage's device is left out
# A hang guard, as in the fault suite: every process of a failed attempt must go by itself; how long
# that took is recorded (the table's figures), not asserted, since a loaded host stretches it.
GONE_GUARD_S = 120.0
ATTEMPT_TIMEOUT_S = 120.0               # start-up of 4 ranks (torch) and a few waves on a loaded 2-core machine
SOAK_TIMEOUT_S = 600.0
TMPFS = "4m"                            # the checkpoint directory's disk: 2 kept checkpoints are ~150 KiB
NO_MOUNT = 97                           # the namespace's exit status when it could not mount the tmpfs
KINDS = ("stagekill", "pskill", "psstop", "term", "diskfull")


def schedule(seed: int):
    """Five failures: a stage kill, a SIGTERM at a checkpoint and a disk full, and two more of the kinds that
    do not shrink the job, at clocks spread over it (one in each fifth of its waves, so on both sides of the
    epoch boundary), two of them followed by a corrupted checkpoint part."""
    rng = random.Random(seed)
    kinds = ["stagekill", "term", "diskfull"] + [rng.choice(["pskill", "psstop", "term", "diskfull"]) for _ in range(2)]
    rng.shuffle(kinds)
    corrupt = set(rng.sample(range(len(kinds)), 2))
    span = CFG["epochs"] * CFG["minibatches"] // CFG["nm"] - 8
    return [{"kind": kind, "pick": rng.random(), "at_clock": rng.randint(4 + i * span // 5, 3 + (i + 1) * span // 5),
             "corrupt": {"pick": rng.random(), "at": rng.random()} if i in corrupt else None}
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


def _reached(attempt: Path, ranks: int) -> int:
    """The lowest clock every one of the attempt's ``ranks`` ranks reached (-1 before each wrote one)."""
    files = list(attempt.glob("clock-of-rank-*"))
    if len(files) < ranks:
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


class Job:
    """One `hetpipe launch` of the soak job in a user and mount namespace of its own (``unshare -rm``) whose
    checkpoint directory ``ckpt`` is a tmpfs of TMPFS bytes. Seen from here through the namespace's root
    (``/proc/<pid>/root``): the namespace's shell waits, after the launcher exited, until :meth:`release`,
    so that the checkpoints can be read at the end. ``full``: the disk is full before the launch."""

    def __init__(self, base: Path, *extra: str, cfg=CFG, full: bool = False) -> None:
        self.out, self.run, self.ckpt_path, self.err = base / "out", base / "run", base / "ckpt", base / "launcher.err"
        self.ckpt_path.mkdir(parents=True, exist_ok=True)
        self.rc_file, self.released = base / "launcher.rc", base / "release"
        launch = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", str(RANKS), "--timeout", str(PEER_TIMEOUT_S),
                  "--run-dir", str(self.run), "--checkpoint-dir", str(self.ckpt_path), "--checkpoint-every",
                  str(EVERY), *extra, "soak_run.py", str(self.out), json.dumps({**cfg, "plan_cache": PLAN_CACHE})]
        fill = 'dd if=/dev/zero of="$0/.filler" bs=4096 2>/dev/null; ' if full else ""
        script = (f'mount -t tmpfs -o size={TMPFS} tmpfs "$0" || exit {NO_MOUNT}; {fill}"$@"; rc=$?; '
                  f'echo $rc > "{self.rc_file}"; i=0; while [ ! -e "{self.released}" ] && [ $i -lt 3000 ]; '
                  f'do sleep 0.1; i=$((i + 1)); done; exit $rc')
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script, str(self.ckpt_path), *launch],
                                         cwd=SCRIPTS, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        self.ckpt = Path(f"/proc/{self.proc.pid}/root") / str(self.ckpt_path).lstrip("/")

    def launcher_pid(self, attempt: int) -> int:
        return int((self.run / f"attempt-{attempt}" / "launcher.pid").read_text())

    def fill(self) -> int:
        """Fill the checkpoint disk: zeros up to the kernel's ENOSPC; the bytes written."""
        fd, total = os.open(self.ckpt / ".filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 0
        try:
            while True:
                total += os.write(fd, bytes(4096))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        finally:
            os.close(fd)
        return total

    def free(self) -> None:
        (self.ckpt / ".filler").unlink()

    def finish(self, what: str):
        """Wait for the launcher to exit; its status and stderr (the checkpoints stay readable until release)."""
        deadline = time.monotonic() + SOAK_TIMEOUT_S
        while not self.rc_file.exists() and self.proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGTERM)
                for pid in _alive_of(self.run):
                    os.kill(pid, signal.SIGKILL)
                self.release()
                pytest.fail(f"the {what} run did not finish within {SOAK_TIMEOUT_S} s")
            time.sleep(0.05)
        if self.proc.poll() == NO_MOUNT or self.err.read_text().startswith("unshare:"):
            pytest.skip(f"no tmpfs can be mounted in a namespace of our own here: {self.err.read_text()[-300:]}")
        return int(self.rc_file.read_text()), self.err.read_text()

    def release(self) -> None:
        self.released.write_text("")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


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
    return {"clock": int(path.name.split("-")[1]), "file": str(file).split("/root", 1)[1], "byte": pos}


def _writing(ckpt: Path):
    """The clock of a checkpoint being written (a clock directory without its sealed manifest yet), or None."""
    try:
        return max((int(d.name.split("-")[1]) for d in ckpt.glob("clock-*") if not (d / "manifest.json").exists()),
                   default=None)
    except OSError:
        return None


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The reference: the same job, never interrupted."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to give the job a small tmpfs of its own")
    global PLAN_CACHE
    PLAN_CACHE = str(tmp_path_factory.mktemp("plans"))
    base = tmp_path_factory.mktemp("fault-free")
    job = Job(base)
    try:
        rc, err = job.finish("fault-free")
    finally:
        job.release()
    assert rc == 0, err
    trained = _trained(job.run / "attempt-0")
    assert [d for d, _ in trained] == _data_order(CFG)
    assert len({d for d, _ in trained}) == len(trained), "two minibatches with the same labels: no identity"
    return trained, _weights(job.out)


def test_soak_of_random_faults_ends_as_the_fault_free_run(tmp_path, fault_free):
    plan = schedule(SEED)
    print(f"soak seed {SEED} (HETPIPE_SOAK_SEED to replay); schedule:")
    for i, f in enumerate(plan):
        print(f"  fault {i}: {json.dumps(f)}")
    ref_trained, ref_weights = fault_free
    started = time.monotonic()
    job = Job(tmp_path, "--max-restarts", str(len(plan)))
    run, ckpt = job.run, job.ckpt
    try:
        done, ranks = [], RANKS
        for i, f in enumerate(plan):
            done.append(_inject(job, i, f, ranks))
            ranks -= f["kind"] == "stagekill"
        rc, err = job.finish("soaked")
        leftovers = [p.name for p in ckpt.rglob("*") if p.name.endswith(".tmp")]
    finally:
        if job.proc.poll() is None and not job.rc_file.exists():
            os.killpg(job.proc.pid, signal.SIGTERM)
        for pid in _alive_of(run):
            os.kill(pid, signal.SIGKILL)
        job.release()
    wall = time.monotonic() - started

    # (1) The job ends well, after exactly one restart per fault.
    assert rc == 0, err
    attempts = sorted(run.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(attempts) == len(plan) + 1, err
    assert json.loads((attempts[-1] / "outcome.json").read_text())["status"] == "ok"
    for i, f in enumerate(done):
        line = next((ln for ln in err.splitlines() if ln.startswith(f"hetpipe: restart {i + 1} of {len(plan)}: ")),
                    "")
        f["named"] = f["named"] and f["role"] in line and f["says"] in line and f["restart"] in line
        assert f["named"], (f, line)
    assert "Traceback" not in err, err

    # (4) No process of the run is alive, by pid recorded and by the run's marker in /proc.
    gone_at = time.monotonic()
    while _alive_of(run) and time.monotonic() - gone_at < GONE_GUARD_S:
        time.sleep(0.05)
    assert not _alive_of(run), f"process(es) of the run alive after the launcher exited: {_alive_of(run)}"
    assert not leftovers, f"a failed write left temporary files: {leftovers}"

    # A corrupted part: the next attempt named the file, fell back past it, and resumed from before it.
    for i, f in enumerate(done):
        c = f.get("corruption")
        if c:
            resumed = _resumed_clock(attempts[i + 1])
            c["named"] = f"the checkpoint part {c['file']} is corrupt" in err and \
                "falling back to the previous complete checkpoint" in err and resumed < c["clock"]
            c["redone"] = (f["latest"] - resumed) * CFG["nm"]
            assert c["named"], (c, resumed, err)
    # A SIGTERM at a checkpoint: the next attempt resumed from the newest checkpoint (unless it was corrupted).
    for i, f in enumerate(done):
        if f["kind"] == "term" and not f.get("corruption"):
            assert _resumed_clock(attempts[i + 1]) == f["latest"], (f, _resumed_clock(attempts[i + 1]))

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
    committed, by = [], []
    for a, b in zip(lineage, lineage[1:] + [None]):
        part = trained[a] if b is None else trained[a][:(starts[b] - starts[a]) * CFG["nm"]]
        committed += part
        by += [a] * len(part)
    ref_digests = [d for d, _ in ref_trained]
    lost = len(set(ref_digests) - {d for d, _ in committed})
    twice = len(committed) - len({d for d, _ in committed})
    assert [d for d, _ in committed] == ref_digests, \
        f"lineage {lineage} (resumed at clocks {starts}): {lost} minibatch(es) missing, {twice} trained twice"
    # The losses are the fault-free run's up to the re-plan: the same plan (one plan cache), the same numbers.
    # A re-planned layout computes other numbers (which layers sit on the last stage decides which see
    # their VW's own in-flight updates: docs/design.md, "WSP semantics"), so from there on only the
    # minibatches, each once in order, are the reference's.
    layouts = [[(st["start"], st["stop"]) for st in json.loads((a / "plan.json").read_text())["virtual_workers"][0]
                ["stages"]] for a in attempts]
    replanned = next((k for k, lay in enumerate(layouts) if lay != layouts[0]), None)
    same = [i for i, a in enumerate(by) if replanned is None or a < replanned]
    assert [committed[i] for i in same] == [ref_trained[i] for i in same], \
        "the lineage's losses differ from the fault-free run's before any re-plan"
    # Work redone: what attempt i trained past the latest complete checkpoint when it failed (the fault's
    # share), and past that down to the checkpoint the next attempt fell back to (the corruption's).
    for i, f in enumerate(done):
        f["redone"] = max(0, len(trained[i]) - (f["latest"] - starts[i]) * CFG["nm"])
        if f.get("corruption"):
            f["corruption"]["gone"] = done[i + 1]["gone"] if i + 1 < len(done) else not _alive_of(run)

    # (3) The final weights: the fault-free run's, bitwise, when no re-plan changed the layout.
    stages = [len(lay) for lay in layouts]
    assert stages[0] == 3 and stages[-1] == 2, f"stages per attempt: {stages} (a stage kill re-plans 3 -> 2)"
    weights = _weights(job.out)
    assert sorted(weights) == sorted(ref_weights)
    assert all(np.isfinite(weights[k]).all() for k in weights)
    if replanned is None:
        assert all(np.array_equal(weights[k], ref_weights[k]) for k in ref_weights), \
            "weights differ from the fault-free run"

    record = {"seed": SEED, "schedule": plan, "faults": done, "attempts": len(attempts), "lineage": lineage,
              "resumed_at": starts, "stages": stages, "replanned_at_attempt": replanned,
              "losses_compared": len(same), "minibatches": len(ref_trained), "lost": lost + twice,
              "wall_s": wall}
    (tmp_path / "soak.json").write_text(json.dumps(record, indent=1))
    if os.environ.get("HETPIPE_SOAK_RECORD"):
        Path(os.environ["HETPIPE_SOAK_RECORD"]).write_text(json.dumps(record, indent=1))
    print(table(record))


def _roles(attempt: Path) -> dict:
    """rank -> its role line, for the attempt's registered ranks."""
    return {int(f.name[5:-4]): f.read_text().splitlines()[1] for f in attempt.glob("rank-*.txt")}


def _inject(job: Job, i: int, fault: dict, ranks: int) -> dict:
    """Wait until every rank of attempt ``i`` reached clock ``at_clock`` and a wave past the attempt's start
    (and, before a corruption, two complete checkpoints exist to fall back between), inject ``fault``, wait
    for the attempt to end, check that every process of it is gone, and corrupt a part if asked; returns
    what happened."""
    from hetpipe.checkpoint.format import complete_clocks, latest

    run, ckpt, proc = job.run, job.ckpt, job.proc
    attempt = run / f"attempt-{i}"
    deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
    while True:
        if proc.poll() is not None or job.rc_file.exists() or (attempt / "outcome.json").exists():
            pytest.fail(f"attempt {i} ended before fault {i} ({fault}) was injected:\n{job.err.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"attempt {i} did not reach clock {fault['at_clock']} within {ATTEMPT_TIMEOUT_S} s")
        if _reached(attempt, ranks) >= max(fault["at_clock"], _resumed_clock(attempt) + 1) and \
                (fault["corrupt"] is None or len(complete_clocks(ckpt)) >= 2):
            break
        time.sleep(0.01)
    kind, roles = fault["kind"], _roles(attempt)
    stages = sorted(r for r, role in roles.items() if "stage" in role)
    shards = sorted(r for r, role in roles.items() if "ps shard" in role)
    pool = stages if kind == "stagekill" else shards if kind in ("pskill", "psstop") else sorted(roles)
    victim = pool[int(fault["pick"] * len(pool))]
    pid = int((attempt / f"rank-{victim}.txt").read_text().split()[0])
    at = time.monotonic()
    filled, writing = 0, None
    if kind == "diskfull":
        filled = job.fill()
    elif kind == "term":
        # At a checkpoint: the next clock directory that has no manifest yet.
        while writing is None:
            if time.monotonic() - at > ATTEMPT_TIMEOUT_S:
                pytest.fail(f"attempt {i}: no checkpoint write seen within {ATTEMPT_TIMEOUT_S} s")
            writing = _writing(ckpt)
            time.sleep(0 if writing is not None else 0.0005)
        os.kill(pid, signal.SIGTERM)
    else:
        os.kill(pid, signal.SIGKILL if kind in ("stagekill", "pskill") else signal.SIGSTOP)
    while not (attempt / "outcome.json").exists():
        if time.monotonic() - at > ATTEMPT_TIMEOUT_S:
            pytest.fail(f"attempt {i} did not end within {ATTEMPT_TIMEOUT_S} s of fault {fault}")
        time.sleep(0.01)
    # Between attempts: the launcher is held (SIGSTOP) from the moment it wrote the attempt's outcome until
    # the disk is freed or the part corrupted, so that the next attempt's ranks cannot have run yet.
    corruption = None
    held = kind == "diskfull" or fault["corrupt"] is not None
    if held:
        os.kill(job.launcher_pid(i), signal.SIGSTOP)
    try:
        if held:
            assert not list((run / f"attempt-{i + 1}").glob("rank-*.txt")), "the next attempt started too soon"
        if kind == "diskfull":
            job.free()
        found = latest(ckpt)
        if fault["corrupt"] is not None:
            parts = sorted(int(p.name[5:10]) for p in found.glob("rank-*.safetensors"))
            corruption = _flip(ckpt, parts[int(fault["corrupt"]["pick"] * len(parts))], fault["corrupt"]["at"])
    finally:
        if held:
            os.kill(job.launcher_pid(i), signal.SIGCONT)
    left = _alive_of(attempt)
    while left and time.monotonic() - at < GONE_GUARD_S:
        time.sleep(0.05)
        left = _alive_of(attempt)
    gone_s = time.monotonic() - at
    outcome = json.loads((attempt / "outcome.json").read_text())
    role = roles[victim]
    says, restart = {
        "stagekill": ("failed: it died", "is left out"),
        "pskill": ("failed: it died", "holds no device of the plan (a PS shard of this host): restarting it"),
        "psstop": ("failed: it stopped responding", "holds no device of the plan"),
        "term": ("was ended by a SIGTERM from outside the run", "a SIGTERM from outside the run is no fault of a "
                                                                "device: restarting with the same devices"),
        "diskfull": ("No space left on device", "a checkpoint write found no space left on its disk: restarting "
                                                "with the same devices")}[kind]
    if kind == "diskfull":
        # The disk is the culprit: whichever rank's write met it first reports it, and is named with it.
        named = outcome["cause"] == "reported" and says in outcome["message"]
        role = outcome["role"]
    else:
        named = outcome["rank"] == victim and outcome["role"] == role
    # No checkpoint lost: one being written when a SIGTERM came is completed (its own, or a later one).
    kept = writing is None or (found is not None and int(found.name.split("-")[1]) >= writing)
    result = {**fault, "victim": victim, "role": role, "says": says, "restart": restart, "filled": filled,
              "writing": writing, "kept": kept,
              "latest": int(found.name.split("-")[1]) if found else 0, "cause": outcome["cause"], "gone": not left,
              "gone_s": gone_s, "named": named, "message": outcome["message"]}
    if corruption:
        result["corruption"] = {**corruption, "gone_s": None}
    assert not left, f"fault {i} ({kind}): process(es) {sorted(left)} of attempt {i} alive {GONE_GUARD_S} s after it"
    assert named, f"fault {i} ({kind} of rank {victim}): the outcome names {outcome}"
    assert kept, f"fault {i}: the checkpoint of clock {writing} being written at the SIGTERM is lost ({found})"
    return result


def test_a_disk_full_at_the_first_checkpoint_restarts_the_same_run_from_the_start(tmp_path):
    """The checkpoint disk is full from the start (a real tmpfs, filled to ENOSPC), so the first checkpoint
    write fails and no checkpoint is complete: the restart (same devices: the disk failed, not a device),
    once the disk was freed, starts over, as the same run, whose incomplete clock is its own. Before, the
    restarted ranks drew a new run id and refused the directory as another run's."""
    from hetpipe.checkpoint.format import run_ids

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to give the job a small tmpfs of its own")
    cfg = {"nm": 2, "epochs": 1, "minibatches": 16}
    job = Job(tmp_path, "--max-restarts", "1", cfg=cfg, full=True)
    try:
        deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
        while not (job.run / "attempt-0" / "outcome.json").exists():
            if job.proc.poll() is not None or job.rc_file.exists() or time.monotonic() > deadline:
                job.release()
                pytest.fail(f"attempt 0 did not fail within {ATTEMPT_TIMEOUT_S} s")
            time.sleep(0.01)
        os.kill(job.launcher_pid(0), signal.SIGSTOP)
        try:
            job.free()
        finally:
            os.kill(job.launcher_pid(0), signal.SIGCONT)
        rc, err = job.finish("disk-full")
        ids = run_ids(job.ckpt)
    finally:
        job.release()
    assert rc == 0, err
    outcome = json.loads((job.run / "attempt-0" / "outcome.json").read_text())
    assert outcome["cause"] == "reported" and "No space left on device" in outcome["message"], outcome
    assert f"hetpipe: restart 1 of 1: {outcome['role']} failed: CheckpointError: hetpipe: writing " in err, err
    assert "a checkpoint write found no space left on its disk: restarting with the same devices; 1 VW(s) on 4 " \
           "ranks; no complete checkpoint in " in err, err
    assert not (job.run / "attempt-1" / "resumed.json").exists()
    assert [d for d, _ in _trained(job.run / "attempt-1")] == _data_order(cfg)     # every minibatch, once, in order
    assert len(ids) == 1 and not _alive_of(job.run)
