"""How an epoch's minibatches are dealt to VWs whose waves differ in length (docs/design.md, "Waves of
unequal length").

With equal waves VW ``v`` takes global minibatches ``v, v + N, v + 2N, ...`` (:mod:`hetpipe.loader.source`).
With VW ``v`` training ``n_v`` minibatches per wave, the epoch is dealt round-robin to ``Q`` *slots*
instead, ``Q = sum_v q_v`` with ``q_v = n_v / gcd(n)``, and VW ``v`` owns the ``q_v`` consecutive slots
from ``sum_{u < v} q_u``: its ``j``-th minibatch of an epoch is the ``(j // q_v)``-th of slot
``offset_v + j % q_v``. Every slot takes ``per_epoch // Q`` minibatches of an epoch, so VW ``v`` takes
``q_v`` times that and every VW trains the same number of waves. With equal waves ``q_v = 1`` and the
slots are the VWs: the deal is exactly the round-robin one. A source is read per slot (a
:class:`~hetpipe.loader.source.PerVWSource`'s factory is called with ``(slot, Q, epoch)``), and VW ``v``'s
stream interleaves its slots' streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Tuple

from hetpipe.loader.source import CHECKED, VWStream


@dataclass(frozen=True)
class Deal:
    """The slots of a deal: ``shares[v]`` (``q_v``) and ``offsets[v]`` of each VW, ``num_slots`` (``Q``)."""

    shares: Tuple[int, ...]
    offsets: Tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return sum(self.shares)

    @property
    def equal(self) -> bool:
        """Whether each VW is one slot: the round-robin deal of equal waves."""
        return all(q == 1 for q in self.shares)

    def slots_of(self, vw: int) -> range:
        return range(self.offsets[vw], self.offsets[vw] + self.shares[vw])

    def per_epoch(self, vw: int, minibatches: int) -> int:
        """Minibatches VW ``vw`` takes of an epoch of ``minibatches``."""
        return minibatches // self.num_slots * self.shares[vw]


def deal_for(wave_minibatches: Sequence[int]) -> Deal:
    """The deal of VWs training ``wave_minibatches[v]`` minibatches per wave (``Plan.wave_minibatches``)."""
    g = 0
    for n in wave_minibatches:
        g = math.gcd(g, n)
    shares = tuple(n // g for n in wave_minibatches)
    offsets = tuple(sum(shares[:v]) for v in range(len(shares)))
    return Deal(shares, offsets)


def deal_stream(source: Any, deal: Deal, vw: int, epochs: int, start_epoch: int = 0, start_index: int = 0,
                part: str = "both") -> VWStream:
    """VW ``vw``'s minibatches under ``deal`` (:meth:`DataSource.vw_stream
    <hetpipe.loader.source.DataSource.vw_stream>`'s arguments): its own stream when each VW is one slot,
    else its slots' streams interleaved, one minibatch of each in turn."""
    if deal.equal:
        return source.vw_stream(vw, deal.num_slots, epochs, start_epoch, start_index, part=part)
    slots = [source.vw_stream(s, deal.num_slots, epochs, start_epoch, start_index, part=part)
             for s in deal.slots_of(vw)]

    def items(stream: VWStream) -> Iterator[Any]:
        while True:
            for slot in slots:
                try:
                    item = next(slot)
                except StopIteration:
                    return
                for key, value in slot.digests.items():
                    if len(stream.digests) < CHECKED:
                        stream.digests.setdefault(key, value)
                yield item

    return VWStream(items)

