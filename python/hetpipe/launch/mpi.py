"""The MPI world: mpi4py import with a clear error, host/device inventory, and the mpiexec path."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from hetpipe.launch.deaths import RUN_DIR_ENV, DeathWatcher, marked, ranks_by_pid


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


def launch(n: int, argv: List[str]) -> int:
    """Run ``argv`` on ``n`` ranks under mpiexec, relaying its output; return its exit status.

    When a rank died without reporting an error (killed, or crashed in native code), say which rank
    and role it was: :mod:`hetpipe.launch.deaths` watches the ranks, since mpiexec may name any."""
    import subprocess
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="hetpipe-run-") as run_dir:
        env = {**os.environ, RUN_DIR_ENV: run_dir}
        watcher = DeathWatcher(run_dir, n).start()
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
        watcher.stop()
        for t in threads:
            t.join(timeout=5)
        if rc != 0:
            culprit = _culprit(run_dir, watcher, b"".join(tail).decode(errors="replace"))
            if culprit:
                sys.stderr.write(f"hetpipe: {culprit} failed: it died without reporting an error (killed, or "
                                 "crashed in native code); mpiexec ended the job\n")
    return rc


def _culprit(run_dir: str, watcher: DeathWatcher, mpiexec_text: str) -> Optional[str]:
    """The role of the rank that died unreported, or None when a rank reported its own failure.

    The first recorded process to vanish without a mark is the one; mpiexec's text names a pid only
    as a fallback (no pidfd support), since after a death it may report any rank it killed."""
    import re

    if marked(run_dir, "aborted"):
        return None
    who = ranks_by_pid(run_dir)
    pid = watcher.first_unmarked()
    if pid is None and not watcher.supported:
        found = re.findall(r"PID (\d+) RUNNING", mpiexec_text)
        pid = int(found[0]) if found else None
    if pid is None:
        return None
    return who.get(pid, f"the process with pid {pid}")
