"""The fault soak's table from one soak run's record (``tests/mpi/test_soak.py`` writes it: into the test's
temporary directory as ``soak.json``, and to ``HETPIPE_SOAK_RECORD`` when set).

Usage: python tests/soak_table.py RECORD.json
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List

KINDS = (("stagekill", "stage kill (SIGKILL of a stage rank; re-planned without its device)"),
         ("pskill", "PS kill (SIGKILL of the PS shard's rank)"), ("psstop", "PS stop (SIGSTOP of the PS shard's rank)"),
         ("term", "SIGTERM of a rank while a checkpoint is written"),
         ("diskfull", "disk full (a real tmpfs filled to ENOSPC)"), ("corrupt", "corrupt checkpoint part (flipped byte)"))


def table(record: Dict) -> str:
    """One row per fault kind: trials, whether every process of the failed attempt was gone after each,
    whether the launcher's output named the culprit each time (for a corrupt part: the resume named the
    file and fell back), the minibatches the faults' attempts trained but the final lineage redid, and the
    minibatches the final lineage lost (trained by no attempt of it, or twice). For a SIGTERM, "kept" says
    whether the checkpoint being written when it came was completed."""
    lines: List[str] = [f"seed {record['seed']}: {len(record['faults'])} fault(s), {record['attempts']} attempt(s), "
                        f"{record['minibatches']} minibatches, {record['wall_s']:.0f} s",
                        "| fault | trials | every process gone after | culprit named | checkpoint kept | "
                        "redone (minibatches) | lost (minibatches) |",
                        "|---|---|---|---|---|---|---|"]
    for kind, name in KINDS:
        rows = [f for f in record["faults"] if f["kind"] == kind] if kind != "corrupt" else \
            [f["corruption"] for f in record["faults"] if f.get("corruption")]
        if not rows:
            lines.append(f"| {name} | 0 | - | - | - | - | - |")
            continue
        gone = "yes" if all(r["gone"] for r in rows) else "no"
        named = "yes" if all(r["named"] for r in rows) else "no"
        kept = "-" if kind != "term" else "yes" if all(r.get("kept") for r in rows) else "no"
        redone = sum(r["redone"] for r in rows)
        times = ", ".join(f"{r['gone_s']:.1f}" for r in rows if r.get("gone_s") is not None)
        lines.append(f"| {name} | {len(rows)} | {gone}{f' ({times} s)' if times else ''} | {named} | {kept} | "
                     f"{redone} | {record['lost']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(open(sys.argv[1]).read())))
