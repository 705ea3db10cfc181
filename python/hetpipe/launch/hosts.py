"""Where the ranks of a launch run: hosts and their slots (a hostfile, ``-H``, or a Slurm allocation),
the host of each rank, and what mpiexec is told so that it puts them there. Torch-free.

Rank ``r`` goes to a host in fill order: the first host's slots take the first ranks, and so on, as
mpiexec places ranks given ``host:slots``. With a plan (``hetpipe launch --plan``), rank ``r`` goes to
the node the plan puts its part on (:meth:`hetpipe.plan.types.Plan.role_of`), which must be a host of
the list with a free slot. Either way the launcher writes the placement to the run directory and
every rank checks at start-up that it sits where it was put (:mod:`hetpipe.job.placement`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hetpipe.util.errors import HetpipeError


class HostsError(HetpipeError, ValueError):
    """A host list that cannot hold the run (too few slots, an unknown node, a malformed line)."""


@dataclass(frozen=True)
class HostSlots:
    """Hosts in order with their slot counts; ``source`` names where they came from, for errors."""

    hosts: Tuple[Tuple[str, int], ...]
    source: str

    @property
    def total(self) -> int:
        return sum(s for _, s in self.hosts)

    def describe(self) -> str:
        return ", ".join(f"{h}:{s}" for h, s in self.hosts)


# Names of this machine a host list may use; they stand for its host name, which is what each rank
# reports (socket.gethostname) and what plans and placement checks compare against.
LOCAL_NAMES = ("localhost", "127.0.0.1")


def local_host(name: str) -> str:
    """``name``, or this machine's host name when ``name`` is one of :data:`LOCAL_NAMES`."""
    import socket

    return socket.gethostname() if name.lower() in LOCAL_NAMES else name


def _entry(text: str, where: str) -> Tuple[str, int]:
    """``host``, ``host:slots`` or Open MPI's ``host slots=N``; ``localhost`` is this machine."""
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(?::\s*(\S+)|\s+slots\s*=\s*(\S+))?\s*", text)
    if not m:
        raise HostsError(f"{where}: {text.strip()!r} is not host, host:slots or host slots=N")
    count = m.group(2) or m.group(3) or "1"
    if not count.isdigit() or int(count) < 1:
        raise HostsError(f"{where}: the slots of {m.group(1)} must be an integer >= 1, got {count!r}")
    return local_host(m.group(1)), int(count)


def _merged(entries: Sequence[Tuple[str, int]], source: str) -> HostSlots:
    slots: Dict[str, int] = {}
    for host, count in entries:
        slots[host] = slots.get(host, 0) + count
    if not slots:
        raise HostsError(f"{source} names no host")
    return HostSlots(tuple(slots.items()), source)


def parse_hostfile(path: str) -> HostSlots:
    """A hostfile: one host per line (``host``, ``host:slots`` or ``host slots=N``), ``#`` comments."""
    source = f"hostfile {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostsError(f"{source}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise HostsError(f"{source} is not a text file") from None
    entries = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0]
        if line.strip():
            entries.append(_entry(line, f"{source}, line {i}"))
    return _merged(entries, source)


def parse_hosts(text: str) -> HostSlots:
    """``-H host:slots,host:slots`` (a host without slots has one)."""
    return _merged([_entry(item, f"-H {text}") for item in text.split(",") if item.strip()], f"-H {text}")


def expand_nodelist(text: str) -> List[str]:
    """Slurm's compressed host list: ``gpu[01-03,07],cpu5`` -> gpu01, gpu02, gpu03, gpu07, cpu5."""
    out: List[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", text.strip()):
        prefix, ranges = m.group(1), m.group(2)
        if not prefix:
            continue
        if ranges is None:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise HostsError(f"SLURM_JOB_NODELIST {text!r}: cannot read the range {part!r}")
            for k in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{k:0{len(lo)}d}")
    return out


def expand_tasks(text: str, nodes: int) -> List[int]:
    """Slurm's tasks per node: ``2(x3),1`` -> 2, 2, 2, 1 (one count for every node of the list)."""
    counts: List[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise HostsError(f"SLURM_TASKS_PER_NODE {text!r}: cannot read {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != nodes:
        raise HostsError(f"SLURM_TASKS_PER_NODE {text!r} gives {len(counts)} counts for {nodes} nodes")
    return counts


def from_slurm(env: Mapping[str, str]) -> Optional[HostSlots]:
    """The hosts of the Slurm allocation this launcher runs in, None outside Slurm."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    tasks = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_TASKS_PER_NODE")
    counts = expand_tasks(tasks, len(hosts)) if tasks else [1] * len(hosts)
    return _merged(list(zip(hosts, counts)), f"the Slurm allocation ({nodelist})")


def fill(slots: HostSlots, n: int) -> List[str]:
    """The host of each of ``n`` ranks in fill order; fails naming the list when it has too few slots."""
    if slots.total < n:
        raise HostsError(f"{slots.source} has {slots.total} slot(s) ({slots.describe()}) but the run needs {n} ranks")
    out: List[str] = []
    for host, count in slots.hosts:
        out += [host] * count
    return out[:n]


def by_plan(slots: HostSlots, nodes: Sequence[str]) -> List[str]:
    """The host of each rank when rank ``r`` must run on ``nodes[r]`` (its part's node in the plan)."""
    have = dict(slots.hosts)
    need: Dict[str, int] = {}
    for node in nodes:
        need[node] = need.get(node, 0) + 1
    for node, count in need.items():
        if node not in have:
            raise HostsError(f"the plan puts {count} rank(s) on node {node}, which {slots.source} does not list "
                             f"(hosts: {', '.join(have)}); name each node of the plan as its host")
        if have[node] < count:
            raise HostsError(f"the plan puts {count} rank(s) on node {node} but {slots.source} gives it "
                             f"{have[node]} slot(s)")
    return list(nodes)


def machinefile(rank_hosts: Sequence[str], flavour: str) -> str:
    """mpiexec's host file placing rank ``r`` on ``rank_hosts[r]``: MPICH's ``host:count`` runs, or one
    line per rank for Open MPI's sequential mapper."""
    if flavour == "openmpi":
        return "".join(f"{h}\n" for h in rank_hosts)
    lines: List[Tuple[str, int]] = []
    for h in rank_hosts:
        if lines and lines[-1][0] == h:
            lines[-1] = (h, lines[-1][1] + 1)
        else:
            lines.append((h, 1))
    return "".join(f"{h}:{c}\n" for h, c in lines)


def host_arguments(path: str, flavour: str) -> List[str]:
    """The mpiexec options that read ``path`` (written by :func:`machinefile`)."""
    if flavour == "openmpi":
        return ["--hostfile", path, "--map-by", "seq"]
    return ["-f", path]


def mpi_flavour(mpiexec: str) -> str:
    """``mpich`` (Hydra) or ``openmpi``, from ``mpiexec --version``; ``mpich`` when it cannot tell."""
    import subprocess

    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "mpich"
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"


def choose(hostfile: Optional[str], hosts: Optional[str], env: Mapping[str, str] = os.environ) -> Optional[HostSlots]:
    """The host list of a launch: ``--hostfile``, else ``-H``, else the Slurm allocation, else None
    (every rank on this host)."""
    if hostfile is not None and hosts is not None:
        raise HostsError("hetpipe launch: give --hostfile or -H, not both")
    if hostfile is not None:
        return parse_hostfile(hostfile)
    if hosts is not None:
        return parse_hosts(hosts)
    return from_slurm(env)


@dataclass(frozen=True)
class Placement:
    """Where a launch puts its ranks: ``slots`` (filled in order, or by ``plan_nodes``, the node of each
    plan rank). ``emulate``: the hosts are identities on this machine (each rank's ``HETPIPE_HOST``),
    not places mpiexec starts ranks on: several hosts tested on one machine."""

    slots: HostSlots
    emulate: bool = False
    plan_nodes: Optional[Tuple[str, ...]] = None

    def rank_hosts(self, n: int) -> List[str]:
        if self.plan_nodes is not None:
            if len(self.plan_nodes) != n:
                raise HostsError(f"hetpipe launch: the plan has {len(self.plan_nodes)} ranks but -n is {n}")
            return by_plan(self.slots, self.plan_nodes)
        return fill(self.slots, n)

    def apply(self, n: int, run_dir: str, mpiexec: str, env: Dict[str, str]) -> List[str]:
        """Write ``placement.json`` (and mpiexec's host file) to ``run_dir``, set the ranks' environment
        in ``env``, and return the mpiexec options that place the ranks."""
        import json

        from hetpipe.job.guard import LAUNCHER_HOST_ENV
        from hetpipe.job.inventory import HOST_ENV
        from hetpipe.job.placement import PLACEMENT_ENV

        hosts = self.rank_hosts(n)
        path = Path(run_dir, "placement.json")
        path.write_text(json.dumps({"source": self.slots.source, "emulated": self.emulate, "hosts": hosts}) + "\n")
        env[PLACEMENT_ENV] = str(path)
        if self.emulate:
            env[HOST_ENV] = ",".join(hosts)
            env[LAUNCHER_HOST_ENV] = hosts[0]
            return []
        flavour = mpi_flavour(mpiexec)
        machine = Path(run_dir, "machinefile")
        machine.write_text(machinefile(hosts, flavour))
        return host_arguments(str(machine), flavour)
