"""The worker half of WSP on the wire: a stage's wave pushes, its pulls and their merge, its DONE messages.

Front-end neutral: it speaks :mod:`hetpipe.transport.protocol` through a :class:`~hetpipe.transport.base.Link`
(the torch stage's ``StageLink``, or ``ArrayLink`` of NumPy arrays) and keeps its state in a
:class:`~hetpipe.ps.ledger.WaveLedger`; no torch import.

Thread role: the stage's executor thread. ``push`` and ``pull`` never block: they return False (and
set ``blocked_on``) while a pool slot or a shard's reply is missing, and continue where they stopped
when called again. With a torch stage's copy stream, a push is copied device→pinned slot on it and
sent once the copy completed, and a pull reply is copied pinned slot→device on it (docs/design.md,
"Transports").
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Protocol, Set, Tuple

from hetpipe.ps.ledger import WaveLedger
from hetpipe.transport.base import Link
from hetpipe.transport.protocol import DONE, PULL, PUSH, STOPPED, WEIGHTS, Header, StageError


class ClientContext(Protocol):
    """Where the stage sits: its VW and stage index, every PS shard's rank, and how to name itself."""

    vw: int
    stage: int
    all_shard_ranks: Mapping[int, int]

    def who(self) -> str: ...


class PSClient:
    """Pushes ``ledger``'s wave deltas to, and pulls its global weights from, the PS shards of ``ctx``."""

    def __init__(self, ctx: ClientContext, ledger: WaveLedger, link: Link, d: int) -> None:
        self.ctx, self.ledger, self.link, self.d = ctx, ledger, link, d
        self.global_clock = 0                       # g of the latest Pull (min over shards)
        self.pulled: Dict[int, Dict[int, int]] = {}     # wave -> shard -> the g its pull got
        self.pushes_sent: Dict[int, int] = {k: 0 for k in ctx.all_shard_ranks}
        self.blocked_on = ""
        self._pull: Optional[Dict[int, Tuple[int, Any]]] = None
        self._push_sent: Set[int] = set()           # shards the Push in progress already sent to
        # An early stop: the last wave trained. VW 0's stages announce it on their pushes once decided;
        # a stage of another VW learns it from the STOPPED replies to its pull of the next wave.
        self.stop_after: Optional[int] = None
        self.stopped = False                        # a pull was answered STOPPED: the stream ends here

    def push(self, wave: int) -> bool:
        """Send this stage's wave delta (and synced buffers), shard by shard; the copies and sends overlap
        the following instructions. False while a shard's payload waits for a free pool slot (the shards
        already sent are not resent).

        The payload may be a view of the wave's delta, which stays unchanged until a pull drops it; a
        pull drops it only once every shard's clock passed the wave, i.e. after this push arrived."""
        for k in self.ledger.pushed_shards:
            if k in self._push_sent:
                continue
            rank = self.ctx.all_shard_ranks[k]
            payload = self.ledger.push_payload(wave, k)
            announce = self.stop_after if self.stop_after is not None and self.ctx.vw == 0 else -1
            n = int(payload.shape[0])
            header = Header(PUSH, self.ctx.vw, self.ctx.stage, announce, wave, "float32", (n,), 4 * n)
            if not self.link.send(rank, header, payload):
                self.blocked_on = f"{self.link.waiting_for} to push wave {wave} to PS shard {k} (rank {rank})"
                return False
            self.pushes_sent[k] += 1
            self._push_sent.add(k)
        self._push_sent.clear()
        self.ledger.mark_pushed(wave)
        return True

    def pull(self, wave: int) -> bool:
        """Request wave ``wave``'s global weights from every shard this stage pulls from, collect the
        replies, check them against D and merge them into the model; False while a reply is missing."""
        shards = {k: self.ctx.all_shard_ranks[k] for k in self.ledger.pulled_shards}
        if not shards:
            return True
        if self._pull is None:
            for k, rank in sorted(shards.items()):
                self.link.send_header(rank, Header(PULL, self.ctx.vw, self.ctx.stage, -1, wave))
            self._pull = {}
        for k, rank in sorted(shards.items()):
            if k in self._pull:
                continue
            got = self.link.try_recv(rank, WEIGHTS)
            if got is None:
                continue
            h, reply = got
            if h.mb != wave or h.vw != self.ctx.vw or h.stage != self.ctx.stage:
                raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave} from PS shard {k}, got a reply "
                                 f"for wave {h.mb} addressed to VW {h.vw} stage {h.stage}")
            if h.aux == STOPPED:
                self._pull[k] = (STOPPED, reply)
                continue
            want = sum(self.ledger.pull_sizes(k))
            if h.shape != (want,) or h.dtype != "float32":
                raise StageError(f"hetpipe: PS shard {k} sent {h.dtype}{list(h.shape)} weights, "
                                 f"{self.ctx.who()} holds float32[{want}] of its layers")
            self._pull[k] = (h.aux, reply)
        missing = sorted(set(shards) - set(self._pull))
        if missing:
            self.blocked_on = (f"the weights of wave {wave} from PS shard(s) {missing} "
                               f"(rank(s) {[shards[k] for k in missing]})")
            if self.link.waiting_for:
                self.blocked_on += f", blocked on {self.link.waiting_for}"
            return False
        stopped = [k for k, (g, _) in self._pull.items() if g == STOPPED]
        if stopped:
            if len(stopped) != len(self._pull):
                raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave}: PS shard(s) {stopped} answered "
                                 f"that the run stopped, shard(s) {sorted(set(self._pull) - set(stopped))} did not")
            self._pull = None
            self.stopped = True
            return True
        if any(wave - self.d > g for g, _ in self._pull.values()):
            raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave} with D = {self.d} but got "
                             f"global clocks {[g for g, _ in self._pull.values()]}")
        self.ledger.merge_pull(self._pull)
        self.pulled[wave] = {k: g for k, (g, _) in self._pull.items()}
        self.global_clock = min(g for g, _ in self._pull.values())
        self._pull = None
        return True

    def send_done(self) -> None:
        """Tell every PS shard this stage finished, with the number of pushes it sent to each."""
        for k, rank in sorted(self.ctx.all_shard_ranks.items()):
            self.link.send_header(rank, Header(DONE, self.ctx.vw, self.ctx.stage, aux=self.pushes_sent[k]))
