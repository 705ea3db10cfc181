"""The PS's outer optimizer: how a shard turns a wave's aggregated delta into a step of the global weights.

The names, defaults and checks live here, free of torch and numpy, so that the plan, the Trainer, the
command line and both shard planes (Python and the compiled core) agree on them. The arithmetic is in
:class:`hetpipe.ps.shard.ShardState` and ``csrc/core/shard_plane.cc``; its contract is in
docs/design.md ("Outer optimizer").

* ``outer="sgd"`` (default): each push's scaled delta is added to the weights, ``W <- W + lr * delta / k``.
  With ``outer_lr=1`` and ``outer_staleness="none"`` this is exactly the plain WSP rule (bit for bit).
* ``outer="nesterov"``: DiLoCo's outer step. The wave's aggregated delta ``A`` (the sum, in apply order,
  of every push's ``delta / k``) is a pseudo-gradient ``g = -A``; ``m <- mu * m + g``;
  ``W <- W - lr * (g + mu * m)``. ``m`` (one float32 buffer per layer) is part of the shard's state.
* ``k``: the push's divisor, ``N`` (the VW count) with ``aggregate="mean"``, else 1; times ``1 + s`` with
  ``outer_staleness="inverse"``, where ``s = c - v`` is how far the version ``v`` the pushing stage's
  pull of wave ``c`` got lags the version ``c`` the push is applied to (0 at D = 0 and for wave 0).
"""

from __future__ import annotations

import math
from typing import Any, Dict

from hetpipe.util.errors import ArgumentError

OUTERS = ("sgd", "nesterov")
STALENESS_RULES = ("none", "inverse")
OUTER_FIELDS = ("outer", "outer_lr", "outer_momentum", "outer_staleness")
OUTER_DEFAULTS: Dict[str, Any] = {"outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.9, "outer_staleness": "none"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_outer(where: str, outer: Any = "sgd", outer_lr: Any = 1.0, outer_momentum: Any = 0.9,
                outer_staleness: Any = "none") -> Dict[str, Any]:
    """The outer optimizer's options as a dict (numbers as floats); a ValueError naming ``where`` and the
    field for an unknown name, ``outer_lr`` not a finite number > 0, or ``outer_momentum`` outside [0, 1)."""
    if outer not in OUTERS:
        raise ArgumentError(f"{where}: outer must be one of {list(OUTERS)}, got {outer!r}")
    if not _is_number(outer_lr) or not math.isfinite(outer_lr) or outer_lr <= 0:
        raise ArgumentError(f"{where}: outer_lr must be a finite number > 0, got {outer_lr!r}")
    if not _is_number(outer_momentum) or not 0 <= outer_momentum < 1:
        raise ArgumentError(f"{where}: outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    if outer_staleness not in STALENESS_RULES:
        raise ArgumentError(f"{where}: outer_staleness must be one of {list(STALENESS_RULES)}, got {outer_staleness!r}")
    return {"outer": outer, "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum),
            "outer_staleness": outer_staleness}


def is_plain(options: Dict[str, Any]) -> bool:
    """Whether ``options`` (of :func:`check_outer`) make the plain WSP rule: sgd, lr 1, no staleness scale."""
    return options["outer"] == "sgd" and options["outer_lr"] == 1.0 and options["outer_staleness"] == "none"


def describe_outer(options: Dict[str, Any]) -> str:
    """One phrase for messages and plan summaries, e.g. ``nesterov (lr 0.7, momentum 0.9, inverse staleness)``."""
    parts = [f"lr {options['outer_lr']:g}"]
    if options["outer"] == "nesterov":
        parts.append(f"momentum {options['outer_momentum']:g}")
    if options["outer_staleness"] != "none":
        parts.append(f"{options['outer_staleness']} staleness")
    return f"{options['outer']} ({', '.join(parts)})"
