"""The documentation as built and as run: README.md and the pages of docs/ (tests/docblocks.py says how
each code block is treated; the blocks that need mpiexec run in tests/mpi/test_docs_mpi.py).

Here: every block's fence language is known; every python block and command block of the unit tier
runs, page by page; every json block parses; every text block holding commands is listed with the
reason it is not run; the README stays short and keeps the CI command; the site builds with
``mkdocs build --strict``; what the code cites of the docs exists; every ``HETPIPE_*`` variable the
code reads is documented, and the docs name no variable the code does not know.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import docblocks as db
from docblocks import NOT_RUN, PAGES, ROOT

README_LIMIT = 12_000


def test_readme_is_short():
    size = len((ROOT / "README.md").read_text())
    assert size <= README_LIMIT, f"README.md holds {size} characters, more than {README_LIMIT}: move reference " \
                                 "material to a page of docs/"


def test_every_fence_names_a_known_language():
    bad = [f"{b.where}: {b.lang or 'no language'}" for b in db.all_blocks() if b.lang not in db.LANGS]
    assert not bad, f"code blocks must be fenced as one of {sorted(db.LANGS)}: {bad}"


def test_marks_are_known():
    for b in db.all_blocks():
        assert b.mark in ("", "standalone", "mpi") or b.file, f"{b.where}: unknown mark <!-- test: {b.mark} -->"
        assert not b.mark or b.lang == "python" or (b.file and b.lang == "json"), \
            f"{b.where}: only python blocks take a mark (and json blocks a file mark)"


def test_text_blocks_holding_commands_are_listed():
    """A command block that is not run is fenced as text and listed in NOT_RUN, so none slips by."""
    found = set()
    for b in db.all_blocks():
        if b.lang == "text" and db.looks_like_commands(b):
            key = (b.page.name, b.commands()[0])
            assert key in NOT_RUN, f"{b.where}: a text block of commands not listed in tests/docblocks.py NOT_RUN " \
                                   f"(add {key!r} with the reason the page gives, or fence it to run)"
            found.add(key)
    stale = set(NOT_RUN) - found
    assert not stale, f"NOT_RUN lists blocks the docs no longer hold: {sorted(stale)}"


def test_command_blocks_are_runnable():
    for b in db.all_blocks():
        if b.lang in ("bash", "console") and b.tier in ("unit", "mpi"):
            db.check_runnable(b)


def test_json_blocks_parse():
    for b in db.all_blocks():
        if b.lang == "json":
            db.parse_json(b)
    assert any(b.lang == "json" for b in db.all_blocks())


def test_quick_start_holds_the_ci_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^test_command='(.*)'$", ci, re.M).group(1)
    quick = [b for b in db.blocks(ROOT / "README.md") if b.tier == "ci"]
    assert len(quick) == 1, "README.md's Quick start must hold one code block"
    lines = quick[0].commands()
    assert len(lines) == 2 and lines[1] == command, f"the Quick start's second line must be .ci/run's {command!r}"
    install = command.rsplit(" && ", 1)[0]
    assert lines[0].startswith(install + " && "), "the Quick start's first line must build the same environment"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_blocks_run(page, tmp_path):
    """The page's python blocks (in order, one namespace) and its unit-tier commands run."""
    run = db.PageRun(page, tmp_path / page.stem, timeout=300)
    run.run("unit")


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (requirements.txt pins it): the site is not built")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def test_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"\b([\w-]+\.md)\b", nav))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert listed == pages, f"mkdocs.yml's nav and docs/ differ: only in nav {sorted(listed - pages)}, " \
                            f"only in docs/ {sorted(pages - listed)}"


def _headings(page: Path) -> list:
    return [re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            for line in page.read_text().splitlines() if re.match(r"^#{1,6} ", line)]


def _source_files():
    for top in ("python", "csrc", "bench", "tests", "examples"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".h", ".cc", ".cu", ".sh", ".txt", ".md") and path.is_file():
                yield path
    yield ROOT / "setup.py"
    yield ROOT / "CMakeLists.txt"


def test_citations_of_the_docs_resolve():
    """A citation of a page of docs/ and a quoted section title, in code and bench notes, names a page that exists and a section of it."""
    cited = 0
    for path in _source_files():
        text = re.sub(r"\n\s*(?:#|//|\*)?\s*", " ", path.read_text(errors="replace"))
        for m in re.finditer(r"docs/([\w-]+\.md)`?\)?,?\s*\(?\"([^\"]{1,80})\"", text):
            page, title = ROOT / "docs" / m.group(1), m.group(2).lower()
            assert page.exists(), f"{path.relative_to(ROOT)} cites {m.group(1)}, which does not exist"
            assert any(title in h for h in _headings(page)), \
                f"{path.relative_to(ROOT)} cites {m.group(1)}, \"{m.group(2)}\": no such section"
            cited += 1
        for m in re.finditer(r"docs/([\w-]+\.md)", text):
            assert (ROOT / "docs" / m.group(1)).exists(), f"{path.relative_to(ROOT)} cites docs/{m.group(1)}"
    assert cited > 10


def _variables(paths) -> set:
    return {v for p in paths for v in re.findall(r"\bHETPIPE_[A-Z][A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="replace"))}


def _table_names(page: Path, heading: str) -> set:
    """The code spans of the first column of the table under ``heading``."""
    text = page.read_text().split(heading, 1)[1]
    names = set()
    for line in text.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("| `"):
            names.update(re.findall(r"`(HETPIPE_[A-Z0-9_]+)", line.split("|")[1]))
    return names


def test_every_environment_variable_is_documented():
    """Every HETPIPE_* the Python, bench, test and build scripts read is in docs/clusters.md's table of
    environment variables or docs/index.md's table of CMake options; both tables and the prose name
    none the code does not know (the run file replaced the launcher's variables)."""
    used = _variables(p for p in _source_files() if p.suffix in (".py", ".sh") and "csrc" not in p.parts)
    env_table = _table_names(ROOT / "docs" / "clusters.md", "## Environment variables")
    cmake_table = _table_names(ROOT / "docs" / "index.md", "## Building")
    missing = used - env_table - cmake_table
    assert not missing, f"HETPIPE_* variables the code uses but docs do not describe: {sorted(missing)}"
    known = _variables(_source_files())
    stale = _variables(PAGES) - known
    assert not stale, f"the docs name HETPIPE_* variables the code does not know: {sorted(stale)}"


def test_diff_blocks_are_the_files_diffs():
    diffs = [b for b in db.all_blocks() if b.lang == "diff"]
    assert diffs, "README.md shows the GPT-2 recipe's move as a diff"
    for b in diffs:
        assert b.code.rstrip("\n") == db.repository_diff(b), f"{b.where}: the diff is not the files' diff"
