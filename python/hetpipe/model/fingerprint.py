"""Digests of the initial weights, which every rank holding a layer must agree on at start-up.

Each rank builds its own copy of the model, so the copies agree only if every rank seeded and built
it the same way. A rank hashes the flat weights and synced buffers (``model.layout``) of the layers
it holds; :func:`first_difference` names the first layer two ranks hold differently. Without this
check such a run trains silently from weights no rank has (the PS's copy is one rank's, the stages'
another's).
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, Optional, Sequence, Tuple

from hetpipe.model.layout import ModelLayout


def layer_digests(layout: ModelLayout, layers: Iterable[int]) -> Dict[int, str]:
    """Per layer of ``layers``: a digest of its flat float32 weights and synced buffers."""
    out = {}
    for l in layers:
        h = hashlib.sha1(layout.flat(l).tobytes())
        h.update(layout.flat_buffers(l).tobytes())
        out[l] = h.hexdigest()[:16]
    return out


def first_difference(held: Sequence[Tuple[str, Dict[int, str]]], names: Optional[Sequence[str]] = None
                     ) -> Optional[str]:
    """The first layer two holders (``(who, digests)``) disagree on, as one line; None if none."""
    seen: Dict[int, Tuple[str, str]] = {}
    for who, digests in held:
        for l, d in sorted(digests.items()):
            if l in seen and seen[l][1] != d:
                name = f" ({names[l]})" if names is not None and l < len(names) else ""
                return (f"hetpipe: the initial weights differ between ranks: layer {l}{name} is not the same on "
                        f"{seen[l][0]} and {who}: build the model identically on every rank (the same seed, "
                        "torch.manual_seed, before constructing it)")
            seen.setdefault(l, (who, d))
    return None
