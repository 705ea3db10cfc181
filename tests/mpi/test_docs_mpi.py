"""The docs' blocks that need mpiexec (tests/docblocks.py): per page, in page order, the command blocks
that launch ranks and the python blocks marked ``mpi`` that read what those runs wrote."""

from __future__ import annotations

import pytest

import docblocks as db

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

PAGES = [p for p in db.PAGES if any(b.tier == "mpi" for b in db.blocks(p))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_mpi_blocks_run(page, tmp_path):
    ran = db.PageRun(page, tmp_path / page.stem, timeout=480).run("mpi")
    assert ran, f"{page.name} has mpi blocks but none ran"
