"""The package layout of docs/design.md ("Package layout"): imports point down, none forms a cycle, the
launcher and the torch-free packages import no torch.

Every import is read from the source (module level and inside functions alike: a lazy import is still
a dependency), so a new upward or circular import fails here, naming the file and the line.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "python" / "hetpipe"

# Lower first. A package may import itself and any package of a lower level; packages of one level
# are independent of each other.
LEVELS = [
    ("util",),
    ("schedule",),
    ("plan",),
    ("model", "loader"),
    ("transport",),
    ("checkpoint", "ps"),
    ("stage",),
    ("job", "adapters"),
    ("launch", "numpy", "jax"),
    ("run",),
    ("cli", "hf"),
    ("__main__",),
]
LEVEL = {name: i for i, names in enumerate(LEVELS) for name in names}
TORCH_FREE = ["hetpipe.launch.supervisor", "hetpipe.launch.restart", "hetpipe.launch.mpiexec", "hetpipe.cli",
              "hetpipe.job.world", "hetpipe.job.roles", "hetpipe.job.failure", "hetpipe.checkpoint.format",
              "hetpipe.plan", "hetpipe.schedule", "hetpipe.ps.gate", "hetpipe.transport.protocol",
              "hetpipe.launch.hosts", "hetpipe.job.placement", "hetpipe.job.inventory", "hetpipe.job.discovery",
              "hetpipe.plan.outer", "hetpipe.ps", "hetpipe.ps.client", "hetpipe.ps.ledger", "hetpipe.ps.arrays",
              "hetpipe.ps.shard", "hetpipe.ps.server", "hetpipe.ps.core_plane", "hetpipe.transport.core",
              "hetpipe.transport.mpi", "hetpipe.transport.base", "hetpipe.transport.loopback",
              "hetpipe.transport.array_link", "hetpipe.transport.drive", "hetpipe.ps.serve", "hetpipe.ps.worker",
              "hetpipe.numpy", "hetpipe.jax", "hetpipe.plan.manual", "hetpipe.util.errors",
              "hetpipe.util.numbers", "hetpipe.util.outputs"]
# The only modules at the top of the package: every other one lives in the package of its job.
TOP = {"__init__.py", "cli.py", "__main__.py"}     # __main__: `python -m hetpipe` runs the cli


def _unit(path: Path) -> str:
    """The layout unit of a source file: its package under hetpipe, or its module name at the top."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path):
    """(line, imported hetpipe unit) for every import of another hetpipe unit in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hetpipe."):
            names = [node.module]
            if node.module == "hetpipe":
                names = [f"hetpipe.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "hetpipe":
            names = [f"hetpipe.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("hetpipe.")]
        for name in names:
            yield node.lineno, name.split(".")[1]


def _sources():
    return [p for p in sorted(PKG.rglob("*.py")) if p.parent != PKG or p.name != "__init__.py"]


def test_every_unit_has_a_level():
    units = {_unit(p) for p in _sources()} - {"data"}
    assert units <= set(LEVEL), f"units missing from LEVELS: {sorted(units - set(LEVEL))}"


def test_no_loose_module_at_the_top():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in TOP)
    assert not loose, f"modules at the top of hetpipe (give each a package): {loose}"


def test_imports_point_down():
    bad = []
    for path in _sources():
        me = _unit(path)
        for line, other in _imports(path):
            if other != me and LEVEL[other] >= LEVEL[me]:
                bad.append(f"{path.relative_to(PKG)}:{line} ({me}, level {LEVEL[me]}) imports {other} "
                           f"(level {LEVEL[other]})")
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free(module):
    # torch is made unimportable, so that an import of it anywhere below fails here, guarded or not.
    code = f"import sys; sys.modules['torch'] = None; import {module}; print(sys.modules['torch'] is None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True", f"importing {module} imports torch"
