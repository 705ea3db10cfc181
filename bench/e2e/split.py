"""The uniform layer split of the pipelining baseline."""

from __future__ import annotations

from typing import List, Tuple


def uniform_split(depth: int, parts: int) -> List[Tuple[int, int]]:
    """Contiguous [start, stop) ranges of near-equal layer counts (the first ranges take the extra layers)."""
    if parts < 1 or depth < parts:
        raise ValueError(f"cannot split {depth} layers into {parts} non-empty stages")
    base, extra = divmod(depth, parts)
    out, pos = [], 0
    for k in range(parts):
        n = base + (1 if k < extra else 0)
        out.append((pos, pos + n))
        pos += n
    return out
