"""The fault campaign: every signal, sent to every kind of process of a launched run, in every phase.

4 signals (SIGKILL, SIGTERM, SIGINT, SIGSTOP) x 3 targets (a stage rank, mpiexec, the launcher) x 5
phases (before MPI start-up, planning, training, a checkpoint write, shutdown): 60 trials of
`hetpipe launch -n 3 bench/fault_job.py` (1 VW of 2 stages and a PS shard, real mpiexec, this host;
the run's peer timeout T = ``--timeout``, 4 s by default). For each trial it records:

* ``gone_s``: seconds from the signal until no process of the run is left, the launcher included
  (read from /proc: every pid the run directory names and every process carrying the run's
  ``HETPIPE_RUN_DIR``); the goal is T + 5 s;
* ``culprit``: whether the outcome names what was hit: the rank (by rank, for a rank), mpiexec (a
  stopped or killed mpiexec), or the signal with no rank blamed (a signal the launcher got, or one
  mpiexec hands to every rank); a run that completed before the signal mattered counts as right when
  it is reported completed;
* ``checkpoint``: whether a complete checkpoint at least as new as the newest one seen before the
  signal is on disk and verifies afterwards ("none yet" before the first; a run that went on may have
  rotated that one out for newer ones, ``keep=2``);
* ``traceback``: whether anything printed a Python traceback.

A stopped launcher is a user's job control (Ctrl-Z): the run goes on, and the trial resumes the
launcher (SIGCONT) after 2 T; its ``gone_s`` counts from the SIGCONT to the end of the run it let go
on, so the time goal does not apply to it.

    python bench/fault_campaign.py [--signals KILL,TERM,INT,STOP] [--targets rank,mpiexec,launcher]
                                   [--phases pre,planning,training,checkpoint,shutdown] [--timeout 4]
                                   [--json out.json] [--markdown out.md]

Devices: emulated (CPU ranks); the table says so. What only real hosts show: a rank on another host
is watched by its proxy, not by the launcher's /proc (docs/faults.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
JOB = HERE / "fault_job.py"
SIGNALS = ("KILL", "TERM", "INT", "STOP")
TARGETS = ("rank", "mpiexec", "launcher")
PHASES = ("pre", "planning", "training", "checkpoint", "shutdown")
VICTIM_RANK = 1                 # a stage rank (stage 1 of VW 0)
START_S = 300.0                 # a hang guard for reaching a phase, not a bound under test


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _alive(pid: int, marker: bytes) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZXx" and marker in _environ(pid)


def _processes(run_dir: Path, marker: bytes) -> List[int]:
    pids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    return sorted(pid for pid in pids if pid != os.getpid() and _alive(pid, marker))


def _rank_pid(marker: bytes, rank: int) -> Optional[int]:
    """The pid of MPI rank ``rank`` of the run, by its environment (before it registers too)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            env = _environ(int(p.name))
            if marker in env and f"PMI_RANK={rank}\0".encode() in env:
                return int(p.name)
    return None


def _phase(run_dir: Path, pid: Optional[int]) -> str:
    try:
        return Path(run_dir, f"phase-{pid}").read_text().strip()
    except OSError:
        return ""


def _writing(ckpt: Path) -> bool:
    """A checkpoint is being written: a clock directory without its sealed manifest yet."""
    return any(not (d / "manifest.json").exists() for d in ckpt.glob("clock-*"))


def _newest_complete(ckpt: Path) -> Optional[Path]:
    from hetpipe.checkpoint.format import latest

    return latest(ckpt) if ckpt.is_dir() else None


def _clock(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def _verifies(path: Path) -> bool:
    from hetpipe.checkpoint.format import verify

    try:
        verify(path)
        return True
    except Exception:  # noqa: BLE001 - any refusal means the checkpoint is lost
        return False


def _age_s(pid: int) -> float:
    """Seconds since ``pid`` started (its start time in /proc against the system's uptime)."""
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    return uptime - start / os.sysconf("SC_CLK_TCK")


def _reached(phase: str, run_dir: Path, marker: bytes, ckpt: Path, victim: Optional[int]) -> bool:
    if phase == "pre":
        # Half a second into the rank's load before MPI start-up (the launcher looks for new rank
        # processes every 0.1 s: one that dies younger than that is not seen by pid; see the table).
        return victim is not None and not list(run_dir.glob("rank-*.txt")) and _age_s(victim) >= 0.5
    here = _phase(run_dir, victim)
    if phase == "planning":
        # The victim (rank 1) waits for rank 0's plan in "receiving the plan" while rank 0 profiles and plans.
        return here in ("start-up: planning", "start-up: receiving the plan")
    if phase == "training":
        return here == "training" and _newest_complete(ckpt) is not None
    if phase == "checkpoint":
        return here == "training" and _newest_complete(ckpt) is not None and _writing(ckpt)
    return here in ("done",) or here.startswith("shutdown")


def trial(sig_name: str, target: str, phase: str, timeout: float, work: Path) -> Dict[str, object]:
    run_dir, ckpt = work / "run", work / "ckpt"
    marker = f"HETPIPE_RUN_DIR={run_dir}\0".encode()
    err_path = work / "launcher.err"
    cmd = [sys.executable, "-m", "hetpipe.cli", "launch", "-n", "3", "--timeout", str(timeout),
           "--run-dir", str(run_dir), str(JOB), str(ckpt)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    with open(err_path, "wb") as err:
        launcher = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
    sig = getattr(signal, f"SIG{sig_name}")
    row: Dict[str, object] = {"signal": sig_name, "target": target, "phase": phase}
    try:
        deadline, victim = time.monotonic() + START_S, None
        while True:
            if time.monotonic() > deadline or launcher.poll() is not None:
                row["error"] = "the run ended or stalled before the phase"
                row["stderr"] = err_path.read_text(errors="replace")[-2000:]
                return row
            victim = victim or _rank_pid(marker, VICTIM_RANK)
            if _reached(phase, run_dir, marker, ckpt, victim):
                break
            time.sleep(0.002)
        before = _newest_complete(ckpt)
        pid = {"rank": victim, "launcher": launcher.pid}.get(target)
        if target == "mpiexec":
            pid = int((run_dir / "mpiexec.pid").read_text())
        at = time.monotonic()
        os.kill(pid, sig)
        if target == "launcher" and sig_name == "STOP":
            time.sleep(2 * timeout)
            os.kill(pid, signal.SIGCONT)
            at = time.monotonic()
        while True:
            launcher.poll()
            left = _processes(run_dir, marker)
            if launcher.returncode is not None and not left:
                break
            if time.monotonic() - at > timeout + 120:
                row["error"] = f"{len(left)} process(es) left {timeout + 120:.0f} s after the signal"
                break
            time.sleep(0.05)
        row["gone_s"] = round(time.monotonic() - at, 2)
    finally:
        for p in _processes(run_dir, marker):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()
    err = err_path.read_text(errors="replace")
    outcome = json.loads((run_dir / "outcome.json").read_text()) if (run_dir / "outcome.json").exists() else None
    row["outcome"] = {k: outcome[k] for k in ("status", "cause", "rank", "role")} if outcome else None
    row["culprit"] = _right_culprit(sig_name, target, outcome)
    after = _newest_complete(ckpt)
    row["checkpoint"] = ("none yet" if before is None else
                         "kept" if after is not None and _clock(after) >= _clock(before) and _verifies(after)
                         else "lost")
    row["traceback"] = "Traceback" in err
    row["exit"] = launcher.returncode
    return row


def _right_culprit(sig_name: str, target: str, outcome: Optional[dict]) -> bool:
    """Whether the outcome names what the trial hit (see the module docstring)."""
    if target == "launcher" and sig_name == "KILL":
        return outcome is None                  # nobody is left to write one; the ranks end themselves
    if outcome is None:
        return False
    if outcome["status"] == "ok":
        return True                             # the run had completed: reported as completed
    if target == "launcher":
        return outcome["cause"] == "signal" and outcome["rank"] is None
    if target == "mpiexec":
        if sig_name in ("INT", "TERM"):
            return outcome["cause"] == "signal" and outcome["rank"] is None
        return outcome["cause"] in ("mpiexec", "stopped") and outcome["rank"] is None
    return outcome["rank"] == VICTIM_RANK


def _late(row: Dict[str, object], goal: float) -> bool:
    """Whether the processes outlived the goal (a resumed launcher's run is let go on: no goal)."""
    gone = row.get("gone_s")
    return gone is not None and gone > goal and (row["target"], row["signal"]) != ("launcher", "STOP")


def table(rows: List[Dict[str, object]], timeout: float) -> str:
    goal = timeout + 5
    lines = [f"hetpipe fault campaign: `hetpipe launch -n 3` (1 VW x 2 stages + 1 PS shard), real mpiexec on this "
             f"host, emulated devices (CPU ranks); peer timeout T = {timeout:g} s; goal: every process gone within "
             f"T + 5 = {goal:g} s, the right culprit, no checkpoint lost, no traceback",
             "",
             "| signal | target | phase | gone (s) | culprit | outcome | checkpoint | traceback |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = r.get("outcome")
        said = "none written" if o is None else f"{o['status']}/{o['cause'] or '-'}" + \
            (f" rank {o['rank']}" if o.get("rank") is not None else "") + \
            (f" ({o['role']})" if o.get("role") and o.get("rank") is None else "")
        gone = r.get("gone_s")
        gone_text = "-" if gone is None else f"{gone:.2f}" + (" (over)" if _late(r, goal) else "")
        lines.append(f"| SIG{r['signal']} | {r['target']} | {r['phase']} | {gone_text} | "
                     f"{'right' if r.get('culprit') else 'WRONG'} | {r.get('error') or said} | "
                     f"{r.get('checkpoint', '-')} | {'yes' if r.get('traceback') else 'no'} |")
    ok = [r for r in rows if r.get("culprit") and r.get("gone_s") is not None and not _late(r, goal)
          and r.get("checkpoint") != "lost" and not r.get("traceback") and not r.get("error")]
    lines += ["", f"{len(ok)} of {len(rows)} trials met every goal"]
    return "\n".join(lines)


def summary(rows: List[Dict[str, object]], timeout: float) -> str:
    """The README's matrix: one row per signal and target, one column per phase; a cell is the
    seconds until every process was gone and whether every goal held (else which failed)."""
    goal = timeout + 5
    phases = list(dict.fromkeys(str(r["phase"]) for r in rows))
    lines = ["| signal to | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    keys = list(dict.fromkeys((str(r["signal"]), str(r["target"])) for r in rows))
    for sig, target in keys:
        cells = []
        for phase in phases:
            r = next((x for x in rows if (x["signal"], x["target"], x["phase"]) == (sig, target, phase)), None)
            if r is None:
                cells.append("")
                continue
            missed = [what for what, bad in (("not reached", r.get("error")),
                                             ("culprit", not r.get("culprit")),
                                             ("time", _late(r, goal)),
                                             ("checkpoint", r.get("checkpoint") == "lost"),
                                             ("traceback", r.get("traceback"))) if bad]
            gone = f"{r['gone_s']:.1f} s" if r.get("gone_s") is not None else "-"
            cells.append(f"{gone} ok" if not missed else f"{gone} MISSED: {', '.join(missed)}")
        lines.append(f"| SIG{sig} {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--signals", default=",".join(SIGNALS))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--timeout", type=float, default=4.0)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rows = []
    for phase in args.phases.split(","):
        for target in args.targets.split(","):
            for sig_name in args.signals.split(","):
                work = Path(tempfile.mkdtemp(prefix="hetpipe-fault-"))
                try:
                    row = trial(sig_name, target, phase, args.timeout, work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                rows.append(row)
                print(json.dumps(row), flush=True)
    text = table(rows, args.timeout) + "\n\n" + summary(rows, args.timeout)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
