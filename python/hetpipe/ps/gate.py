"""The gate of a PS shard: which version each pull gets and in which order a wave's pushes are applied.

A shard (:class:`hetpipe.ps.shard.ShardState`) owns its weights, clocks and pending deltas; the
*decisions* timing could change go through its gate. :class:`WSPGate`, the default, is WSP itself:
a pull of wave ``w`` is answered once the global clock is at least ``w - D`` (with whatever version
``W`` then is), a wave is applied as soon as the global clock passes it, in VW then stage order. A
replay following a run's record installs the record's gate instead
(:class:`hetpipe.run.record.ShardScript`), which answers each pull at its recorded version and
applies each wave in its recorded order; the shard's code is the same in both cases.

Thread role: a gate is called by the thread that drives its shard, and only from the shard.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Tuple


class Gate(Protocol):
    """What a shard asks before it applies a wave or answers a pull."""

    def holds(self, wave: int) -> bool:
        """Whether wave ``wave``, which the global clock has passed, must not be applied yet."""

    def order(self, wave: int, default: Sequence[Tuple[int, int]]) -> Sequence[Tuple[int, int]]:
        """The ``(vw, stage)`` pushes of wave ``wave`` in the order to apply them (``default``: the shard's)."""

    def due(self, vw: int, stage: int, wave: int, applied: int, global_clock: int, d: int) -> bool:
        """Whether the pull of wave ``wave`` by ``(vw, stage)`` may be answered now, with ``W`` at version
        ``applied`` and the global clock at ``global_clock`` (staleness bound ``d``)."""

    def served(self, vw: int, stage: int, wave: int) -> None:
        """The reply to that pull was taken."""

    def waiting(self, applied: int) -> str:
        """What the shard waits for because of the gate ("" when nothing), for timeout messages."""


class WSPGate:
    """WSP's own rules (see the module docstring); holds no state."""

    def holds(self, wave: int) -> bool:
        return False

    def order(self, wave: int, default: Sequence[Tuple[int, int]]) -> Sequence[Tuple[int, int]]:
        return default

    def due(self, vw: int, stage: int, wave: int, applied: int, global_clock: int, d: int) -> bool:
        return wave - d <= global_clock

    def served(self, vw: int, stage: int, wave: int) -> None:
        return None

    def waiting(self, applied: int) -> str:
        return ""
