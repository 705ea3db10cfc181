"""The MPI world: mpi4py import with a clear error, host/device inventory, and the mpiexec path."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List


class MPIUnavailable(RuntimeError):
    """mpi4py (or an MPI library) is missing."""


def world():
    """``MPI.COMM_WORLD``; raises :class:`MPIUnavailable` naming the fix when mpi4py cannot be imported."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MPIUnavailable(
            f"hetpipe: mpi4py is not importable ({e}); install it (pip install mpi4py mpich) and start the "
            "program with mpiexec -n N or `hetpipe launch -n N`") from None
    return MPI.COMM_WORLD


def host_info() -> Dict[str, Any]:
    """This rank's host name and devices (CUDA devices if any; the emulated type from HETPIPE_EMULATE)."""
    info: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "cuda": [],
                            "emulate": os.environ.get("HETPIPE_EMULATE", "")}
    try:
        import torch
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                info["cuda"].append({"name": p.name, "memory": p.total_memory})
    except ImportError:
        pass
    return info


def gather_hosts(comm) -> List[Dict[str, Any]]:
    """Every rank's :func:`host_info`, indexed by rank (a collective: every rank calls it)."""
    return comm.allgather(host_info())


def mpiexec_path() -> str:
    """The mpiexec beside this Python (a virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise MPIUnavailable("hetpipe: no mpiexec beside the Python interpreter nor on PATH; pip install mpich")
    return found


def mpiexec_command(n: int, argv: List[str]) -> List[str]:
    """The command line that runs ``argv`` (a Python script and its arguments) on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"hetpipe launch: -n must be >= 1, got {n}")
    return [mpiexec_path(), "-n", str(n), sys.executable, *argv]


RUN_DIR_ENV = "HETPIPE_RUN_DIR"


def register_rank(rank: int, describe: str) -> None:
    """Record this rank's pid and role in the launcher's run directory (when started by :func:`launch`)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        Path(run_dir, f"rank-{rank}.txt").write_text(f"{os.getpid()}\n{describe}\n")


def _rank_by_pid(run_dir: str) -> Dict[int, str]:
    out = {}
    for f in Path(run_dir).glob("rank-*.txt"):
        lines = f.read_text().splitlines()
        if len(lines) >= 2:
            out[int(lines[0])] = lines[1]
    return out


def launch(n: int, argv: List[str]) -> int:
    """Run ``argv`` on ``n`` ranks under mpiexec, relaying its output; return its exit status.

    When mpiexec reports a process that died (it names only the pid), say which rank and role it was."""
    import re
    import subprocess
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="hetpipe-run-") as run_dir:
        env = {**os.environ, RUN_DIR_ENV: run_dir}
        proc = subprocess.Popen(mpiexec_command(n, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tail: List[bytes] = []

        def relay(src, dst) -> None:
            for chunk in iter(lambda: src.read1(65536), b""):
                dst.write(chunk)
                dst.flush()
                tail.append(chunk)
                del tail[:-64]

        threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout.buffer), daemon=True),
                   threading.Thread(target=relay, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
        for t in threads:
            t.start()
        rc = proc.wait()
        for t in threads:
            t.join(timeout=5)
        if rc != 0:
            text = b"".join(tail).decode(errors="replace")
            who = _rank_by_pid(run_dir)
            for pid in re.findall(r"PID (\d+) RUNNING", text):
                role = who.get(int(pid), f"the process with pid {pid}")
                code = re.search(r"EXIT CODE: (\d+)", text)
                sys.stderr.write(f"hetpipe: {role} failed: it died (exit code {code.group(1) if code else '?'}); "
                                 "mpiexec ended the job\n")
    return rc
