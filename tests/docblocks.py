"""The code blocks of README.md and docs/*.md, and how the docs tests run them.

A block is fenced with its language: ``python``, ``bash`` or ``console`` (run), ``json`` (parsed),
``text`` (output, or commands this host cannot run: those are listed in :data:`NOT_RUN` with the
reason), ``diff`` (a unified diff between two files of the repository, which must equal theirs:
:func:`repository_diff`). A block with another language, or none, is an error. An HTML comment on the line before a
fence marks the block:

- ``<!-- test: standalone -->``: a python block run in a namespace of its own (the page's other
  python blocks share one namespace and run in page order);
- ``<!-- test: file NAME -->``: a python (or json) block that is the file NAME of the page's working
  directory, not run in place: a command of the page runs (or reads) it (``hetpipe launch -n 6 NAME``);
- ``<!-- test: mpi -->``: a python block that needs what an earlier command block of the mpi tier made
  (a record, a checkpoint): it runs in the mpi tier, after those commands.

A command block runs in the mpi tier (tests/mpi/test_docs_mpi.py, under ``mpi`` and ``slow``) when one
of its commands is ``hetpipe launch`` or ``mpiexec``; every other one runs in the unit tier
(tests/unit/test_docs.py). Each page has a working directory of its own in which ``examples/`` and
``bench/`` lead to the repository's, so commands read as they do from the repository root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_LANGS = {"python", "bash", "console"}
LANGS = RUN_LANGS | {"text", "json", "diff"}
COMMAND_WORDS = {"hetpipe", "mpiexec", "mpirun", "python", "python3", "pip", "bash", "sh", "srun", "sbatch", "ssh",
                 "cmake", "ctest", "pytest"}
UNIT_HETPIPE = {"plan", "simulate", "reproduce", "export", "info"}

# Command blocks fenced as text: they need what this host cannot have, or they are no hetpipe command.
# Keyed by (page, the block's first command line); the value says why, as the page does.
NOT_RUN: Dict[Tuple[str, str], str] = {
    ("README.md", "hetpipe launch -n 20 --hostfile hosts --cluster auto train.py"):
        "needs several hosts with GPUs",
    ("clusters.md", "mpiexec -n 16 -f hosts hetpipe plan --cluster auto --profile gpt -o plan.json"):
        "needs several hosts with GPUs",
    ("clusters.md", "hetpipe launch --hostfile hosts -n 12 --plan plan.json train.py"):
        "needs the hosts of the host file",
    ("index.md", 'CMAKE_ARGS="-DHETPIPE_WITH_CUDA=OFF" pip install --no-build-isolation -e .'):
        "rebuilds and reinstalls the package the tests run",
    ("performance.md", "bash bench/gpu_check.sh wheels"): "needs a CUDA machine (and PyPI for the wheels)",
    ("performance.md", "python bench/core_clock.py"):
        "benchmarks take minutes each and measure the machine they run on",
    ("performance.md", "python bench/convergence/run.py --task large --budget 120 --sweep-budget 30"):
        "about two hours of a 2-core host",
}

# The Quick start block: .ci/run checks that it holds the CI command and runs its second line on a
# fresh clone; the first builds a new environment. Neither runs inside this test suite.
QUICK_START = ("README.md", "## Quick start")


@dataclass
class Block:
    page: Path
    line: int                       # 1-based line of the opening fence
    lang: str
    code: str
    mark: str = ""                  # the <!-- test: ... --> comment before the fence
    section: str = ""               # the heading above the block

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def file(self) -> Optional[str]:
        return self.mark.split(None, 1)[1].strip() if self.mark.startswith("file ") else None

    def commands(self) -> List[str]:
        """The block's command lines: continuations joined, comments (whole lines and trailing ones) and
        blank lines dropped; in a console block only the ``$ `` lines."""
        out, pending = [], ""
        for raw in self.code.splitlines():
            line = raw.rstrip()
            if self.lang == "console":
                if not (line.startswith("$ ") or pending):
                    continue
                line = line[2:] if line.startswith("$ ") else line
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append(re.sub(r"\s+#\s.*$", "", pending + line).strip())      # a trailing comment
            pending = ""
        return out

    @property
    def tier(self) -> str:
        """``unit``, ``mpi``, ``file``, ``text``, ``json`` or ``ci`` (the Quick start)."""
        if (self.page.name, self.section) == QUICK_START:
            return "ci"
        if self.file:
            return "file"
        if self.lang in ("text", "json", "diff"):
            return self.lang
        if self.lang == "python":
            return "mpi" if self.mark == "mpi" else "unit"
        return "mpi" if any(mpi_command(argv(c)[1]) for c in self.commands()) else "unit"


def blocks(page: Path) -> List[Block]:
    """Every fenced block of ``page`` in order (an unclosed fence is an error naming its line)."""
    lines = page.read_text().splitlines()
    out: List[Block] = []
    section, i = "", 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if lines[i].startswith("#"):
            section = lines[i].strip()
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.name}:{start + 1}: a code fence that never closes")
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = re.fullmatch(r"<!-- test: (.*?) -->", before)
        out.append(Block(page, start + 1, info.strip().split()[0] if info.strip() else "", "\n".join(body) + "\n",
                         mark.group(1).strip() if mark else "", section))
        i += 1
    return out


def all_blocks() -> List[Block]:
    return [b for page in PAGES for b in blocks(page)]


def argv(command: str) -> Tuple[Dict[str, str], List[str]]:
    """(environment assignments before the command, the command's words)."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


def mpi_command(words: List[str]) -> bool:
    return bool(words) and (words[0] in ("mpiexec", "mpirun") or words[:2] == ["hetpipe", "launch"])


def looks_like_commands(block: Block) -> bool:
    """Whether a text block holds shell commands (so it must be listed in NOT_RUN)."""
    for line in Block(block.page, block.line, "bash", block.code).commands():
        try:
            _, words = argv(line[2:] if line.startswith("$ ") else line)
        except ValueError:
            continue
        if words and Path(words[0]).name in COMMAND_WORDS:
            return True
    return False


def check_runnable(block: Block) -> None:
    """A command block's commands are ones this suite knows how to run; else an error naming it."""
    for command in block.commands():
        _, words = argv(command)
        if words[:1] == ["hetpipe"] and len(words) > 1 and (words[1] in UNIT_HETPIPE or words[1] == "launch"):
            continue
        if words[:1] in (["mpiexec"], ["python"]):
            continue
        raise AssertionError(f"{block.where}: {command!r} is no command the docs tests run; fence the block as "
                             "text with a sentence saying why it is not run, and list it in tests/docblocks.py NOT_RUN")


def _translate(words: List[str]) -> List[str]:
    """``hetpipe`` and ``python`` as this suite's Python runs them; ``mpiexec`` the one beside it."""
    from mpirun import mpiexec

    out: List[str] = []
    for w in words:
        if w == "hetpipe":
            out += [sys.executable, "-m", "hetpipe.cli"]
        elif w == "python":
            out.append(sys.executable)
        elif w == "mpiexec" and not out:
            found = mpiexec()
            if found is None:
                raise AssertionError("no mpiexec beside this Python nor on PATH")
            out.append(found)
        else:
            out.append(w)
    return out


def environment(extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


def run_command(command: str, cwd: Path, timeout: float) -> str:
    """Run one documented command in ``cwd``; fails (naming it, with its output) unless it exits 0.
    Past ``timeout`` every process it started is killed, found by a marker in its environment."""
    from hetpipe.job.procs import environment_marker, processes_with, send

    extra, words = argv(command)
    job = uuid.uuid4().hex
    env = environment({**extra, "HETPIPE_TEST_JOB": job})
    try:
        proc = subprocess.run(_translate(words), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        for pid in processes_with(environment_marker("HETPIPE_TEST_JOB", job), exclude=[os.getpid()]):
            send(pid, signal.SIGKILL)
        raise AssertionError(f"{command!r} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{command!r} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@dataclass
class PageRun:
    """Runs a page's blocks of one tier in its working directory, python blocks in one namespace."""

    page: Path
    cwd: Path
    timeout: float
    namespace: Dict[str, object] = field(default_factory=lambda: {"__name__": "__docs__"})

    def __post_init__(self) -> None:
        self.cwd.mkdir(parents=True, exist_ok=True)
        for name in ("examples", "bench"):
            link = self.cwd / name
            if not link.exists():
                link.symlink_to(ROOT / name, target_is_directory=True)
        for b in blocks(self.page):
            if b.tier == "file":
                if b.lang == "json":
                    parse_json(b)
                else:
                    compile(b.code, b.where, "exec")
                (self.cwd / b.file).write_text(b.code)

    def python(self, block: Block) -> None:
        ns = {"__name__": "__docs__"} if block.mark == "standalone" else self.namespace
        cwd = os.getcwd()
        os.chdir(self.cwd)
        try:
            exec(compile(block.code, block.where, "exec"), ns)
        finally:
            os.chdir(cwd)

    def commands(self, block: Block) -> None:
        check_runnable(block)
        for command in block.commands():
            run_command(command, self.cwd, self.timeout)

    def run(self, tier: str) -> List[str]:
        """Run the page's blocks of ``tier`` in order; returns where each ran block was."""
        ran = []
        for b in blocks(self.page):
            if b.tier != tier:
                continue
            if b.lang == "python":
                self.python(b)
            else:
                self.commands(b)
            ran.append(b.where)
        return ran


def parse_json(block: Block) -> None:
    try:
        json.loads(block.code)
    except ValueError as e:
        raise AssertionError(f"{block.where}: a json block that does not parse: {e}") from None


def repository_diff(block: Block) -> str:
    """The unified diff (one line of context) between the two repository files a ``diff`` block names
    in its ``---`` / ``+++`` header lines, as the block should read."""
    import difflib

    lines = block.code.splitlines()
    old, new = lines[0].removeprefix("--- "), lines[1].removeprefix("+++ ")
    a, b = ((ROOT / f).read_text().splitlines() for f in (old, new))
    return "\n".join(difflib.unified_diff(a, b, old, new, n=1, lineterm=""))
