"""The PS's outer optimizer: how a shard turns a wave's pushes into a step of the global weights.

The names, defaults and checks live here, free of torch and numpy, so that the plan, the Trainer, the
command line and both shard planes (Python and the compiled core) agree on them. The arithmetic is in
:mod:`hetpipe.ps.outer_step` and ``csrc/core/shard_plane.cc``; its contract, with every float32
rounding, is in docs/design.md ("Outer optimizer").

Each push ``p`` of a wave is first divided by its divisor ``k_p = gain * decay`` (below): ``u_p = delta_p / k_p``.

* ``outer="sgd"`` (default): ``W <- W + lr * u_p`` push by push. With ``outer_lr=1``, no staleness decay and
  no gain this is exactly the plain WSP rule (bit for bit).
* ``outer="nesterov"``: DiLoCo's outer step once per wave on ``A = sum_p u_p`` (apply order):
  ``g = -A``; ``m <- mu * m + g``; ``W <- W - lr * (g + mu * m)``.
* ``outer="delayed-nesterov"``: the Delayed Nesterov update of Async Local-SGD (Liu et al., 2024,
  arXiv 2401.09135, with their c = 0): each push is applied at once as a plain step ``W <- W + lr * u_p``
  and summed into the buffer ``A``; every ``outer_delay``-th push (per layer; 0: the VW count, one
  momentum step per wave) ``m <- mu * m - A``, ``W <- W - lr * mu * m`` and ``A <- 0``. ``m``, ``A`` and
  the pushes counted since the last momentum step are part of the shard's state.
* ``gain``: ``N`` (the VW count) with ``aggregate="mean"``, else 1; ``outer_gain="sqrt"`` makes it
  ``sqrt(N)`` whatever the aggregate (the ``1/sqrt(N)`` arrival weighting, between mean and sum).
* ``decay`` of a push whose stage's pull of wave ``c`` got version ``v`` (lag ``s = c - v``; 0 at D = 0 and
  for wave 0): 1 with ``outer_staleness="none"``, ``1 + s`` with ``"inverse"``, ``sqrt(1 + s)`` with
  ``"sqrt"``.
"""

from __future__ import annotations

import math
from typing import Any, Dict

from hetpipe.util.errors import ArgumentError

OUTERS = ("sgd", "nesterov", "delayed-nesterov")
STALENESS_RULES = ("none", "inverse", "sqrt")
GAINS = ("none", "sqrt")
OUTER_FIELDS = ("outer", "outer_lr", "outer_momentum", "outer_staleness", "outer_gain", "outer_delay")
OUTER_DEFAULTS: Dict[str, Any] = {"outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.9, "outer_staleness": "none",
                                  "outer_gain": "none", "outer_delay": 0}
# The fields run records and plans had before these two: left out of a record at their defaults.
LATER_FIELDS = ("outer_gain", "outer_delay")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_outer(where: str, outer: Any = "sgd", outer_lr: Any = 1.0, outer_momentum: Any = 0.9,
                outer_staleness: Any = "none", outer_gain: Any = "none", outer_delay: Any = 0) -> Dict[str, Any]:
    """The outer optimizer's options as a dict (``outer_lr``/``outer_momentum`` as floats); a ValueError naming
    ``where`` and the field for an unknown name, ``outer_lr`` not a finite number > 0, ``outer_momentum``
    outside [0, 1), or ``outer_delay`` not an integer >= 0."""
    if outer not in OUTERS:
        raise ArgumentError(f"{where}: outer must be one of {list(OUTERS)}, got {outer!r}")
    if not _is_number(outer_lr) or not math.isfinite(outer_lr) or outer_lr <= 0:
        raise ArgumentError(f"{where}: outer_lr must be a finite number > 0, got {outer_lr!r}")
    if not _is_number(outer_momentum) or not 0 <= outer_momentum < 1:
        raise ArgumentError(f"{where}: outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
    if outer_staleness not in STALENESS_RULES:
        raise ArgumentError(f"{where}: outer_staleness must be one of {list(STALENESS_RULES)}, got {outer_staleness!r}")
    if outer_gain not in GAINS:
        raise ArgumentError(f"{where}: outer_gain must be one of {list(GAINS)}, got {outer_gain!r}")
    if isinstance(outer_delay, bool) or not isinstance(outer_delay, int) or outer_delay < 0:
        raise ArgumentError(f"{where}: outer_delay must be an integer >= 0 (0: the VW count), got {outer_delay!r}")
    return {"outer": outer, "outer_lr": float(outer_lr), "outer_momentum": float(outer_momentum),
            "outer_staleness": outer_staleness, "outer_gain": outer_gain, "outer_delay": outer_delay}


def is_plain(options: Dict[str, Any]) -> bool:
    """Whether ``options`` (of :func:`check_outer`) make the plain WSP rule: sgd, lr 1, no staleness decay, no gain."""
    return (options["outer"] == "sgd" and options["outer_lr"] == 1.0 and options["outer_staleness"] == "none"
            and options["outer_gain"] == "none")


def has_momentum(options: Dict[str, Any]) -> bool:
    """Whether the rule keeps a momentum buffer per layer (nesterov, delayed-nesterov)."""
    return options["outer"] in ("nesterov", "delayed-nesterov")


def recorded_outer(options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` as a run record keeps them: the fields added later left out at their defaults, so the
    records written before them still match the runs they describe."""
    return {k: v for k, v in options.items() if k not in LATER_FIELDS or v != OUTER_DEFAULTS[k]}


def describe_outer(options: Dict[str, Any]) -> str:
    """One phrase for messages and plan summaries, e.g. ``nesterov (lr 0.7, momentum 0.9, inverse staleness)``."""
    parts = [f"lr {options['outer_lr']:g}"]
    if has_momentum(options):
        parts.append(f"momentum {options['outer_momentum']:g}")
    if options["outer"] == "delayed-nesterov":
        parts.append(f"delay {options['outer_delay'] or 'N'}")
    if options["outer_gain"] != "none":
        parts.append(f"{options['outer_gain']} gain")
    if options["outer_staleness"] != "none":
        parts.append(f"{options['outer_staleness']} staleness")
    return f"{options['outer']} ({', '.join(parts)})"
