"""The start-up data check: every rank that reads data reads the same sequence.

Each rank contributes a :class:`Reading` (how many minibatches an epoch has, the source's identity,
and the digests its streams kept of their first minibatches, see
:class:`hetpipe.loader.source.VWStream`); :func:`compare` finds the first disagreement among them and
names the two ranks, the VW and the minibatch. Ranks that disagree would otherwise pair one sample's
inputs with another's labels, silently, or wait for each other until the peer timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Sequence, Tuple

from hetpipe.util.errors import HetpipeError


class DataMismatch(HetpipeError, ValueError):
    """Ranks read different data."""


@dataclass
class Reading:
    """What one rank (``who``) read, or would deal, at start-up."""

    who: str
    per_epoch: int
    identity: Optional[str] = None
    digests: Dict[Tuple[int, int], str] = field(default_factory=dict)     # (epoch, minibatch) -> digest


def reading(who: str, per_epoch: int, identity: Optional[str], streams: Iterable, checked: int) -> Reading:
    """This rank's :class:`Reading`; reads the first ``checked`` minibatches of each of its ``streams``
    ahead (they are yielded later, in order)."""
    digests: Dict[Tuple[int, int], str] = {}
    for stream in streams:
        stream.peek(checked)
        digests.update(stream.digests)
    return Reading(who, per_epoch, identity, digests)


_ADVICE = ("every rank must read the same minibatches in the same order; an iterable that reshuffles on "
           "each pass (a DataLoader with a custom sampler, a generator drawing from the global RNG) does not: "
           "give the Trainer the Dataset (hetpipe.DatasetSource, or a plain DataLoader over it) so that "
           "hetpipe shards it with a seeded sampler")


def compare(readings: Sequence[Reading]) -> None:
    """Raise :class:`DataMismatch` naming the first two readings that disagree (see the module docstring)."""
    first = readings[0]
    for r in readings[1:]:
        if r.per_epoch != first.per_epoch:
            raise DataMismatch(f"hetpipe: the data differs between ranks: one epoch has {first.per_epoch} "
                               f"minibatch(es) on {first.who} but {r.per_epoch} on {r.who}")
    named = [r for r in readings if r.identity is not None]
    for r in named[1:]:
        if r.identity != named[0].identity:
            raise DataMismatch(f"hetpipe: the data differs between ranks: {named[0].who} reads {named[0].identity}, "
                               f"{r.who} reads {r.identity}")
    seen: Dict[Tuple[int, int], Tuple[str, str]] = {}
    for r in readings:
        for key, d in sorted(r.digests.items()):
            if key in seen and seen[key][1] != d:
                epoch, index = key
                raise DataMismatch(f"hetpipe: the data differs between ranks: minibatch {index} of epoch {epoch} "
                                   f"is not the same on {seen[key][0]} and {r.who} (their labels or sample "
                                   f"indices differ): {_ADVICE}")
            seen.setdefault(key, (r.who, d))
