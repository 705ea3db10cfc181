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
stream interleaves its slots' streams. The slots' arithmetic (:class:`~hetpipe.plan.waves.Deal`) is the
plan's, free of torch, as a checkpoint's manifest counts them too.
"""

from __future__ import annotations

from typing import Any, Iterator

from hetpipe.loader.source import CHECKED, VWStream
from hetpipe.plan.waves import Deal


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

