"""The worker half of WSP on the wire: a stage's wave pushes, its pulls and their merge, its DONE messages.

Front-end neutral: it speaks :mod:`hetpipe.transport.protocol` through a :class:`~hetpipe.transport.base.Link`
(the torch stage's ``StageLink``, or ``ArrayLink`` of NumPy arrays) and keeps its state in a
:class:`~hetpipe.ps.ledger.WaveLedger`; no torch import.

Early pulls. A pull's request may leave before its Pull instruction: :meth:`PSClient.request` sends it
(the executor calls it as soon as WSP lets the shards answer, docs/design.md "The PS exchange"), and
:meth:`PSClient.poll` takes the replies that arrived, between instructions, into the client. The Pull
instruction (:meth:`PSClient.pull`) then waits only for what has not arrived yet, checks the replies
against D and merges them, in the same place of the stream as before: the weights a stage computes
with change only there, whichever moment the bytes arrived at. A shard answers an early request as
it answers any pull, once its global clock allows it, with the version it then holds; the version is
logged and recorded as any pull's. ``waits`` keeps, per wave, the seconds its Pull instruction spent
waiting for replies that had not arrived.

Thread role: the stage's executor thread. ``push`` and ``pull`` never block: they return False (and
set ``blocked_on``) while a pool slot or a shard's reply is missing, and continue where they stopped
when called again. With a torch stage's copy stream, a push is copied device→pinned slot on it and
sent once the copy completed, and a pull reply is copied pinned slot→device on it as soon as it is
taken, the compute stream ordered after that copy only at the merge (docs/design.md, "Transports").
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, Mapping, Optional, Protocol, Set, Tuple

from hetpipe.ps.ledger import WaveLedger
from hetpipe.transport.base import Link
from hetpipe.transport.protocol import DONE, PULL, PUSH, STOPPED, WEIGHTS, Header, StageError

PULL_AHEAD_ENV = "HETPIPE_PULL_AHEAD"


def pull_ahead() -> bool:
    """Whether stages request their pulls early (``HETPIPE_PULL_AHEAD``: "1", the default, or "0": at the
    Pull instruction, as before early pulls existed); ValueError naming the variable otherwise."""
    text = os.environ.get(PULL_AHEAD_ENV, "").strip() or "1"
    if text not in ("0", "1"):
        raise ValueError(f"hetpipe: {PULL_AHEAD_ENV} must be 1 (request pulls early) or 0, got {text!r}")
    return text == "1"


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
        self.requested: Optional[int] = None        # the wave whose pull requests are out, not yet merged
        self._pull: Dict[int, Tuple[int, Any]] = {}     # its replies taken so far: shard -> (g, reply)
        self._waiting_since: Optional[float] = None     # when its Pull instruction first found one missing
        self.waits: Dict[int, float] = {}           # wave -> seconds Pull(wave) waited for missing replies
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

    def _shards(self) -> Dict[int, int]:
        """The shards this stage pulls from, with their ranks."""
        return {k: self.ctx.all_shard_ranks[k] for k in self.ledger.pulled_shards}

    def request(self, wave: int) -> None:
        """Send the pull requests of wave ``wave`` to every shard this stage pulls from, unless they are
        out already. At most one wave's requests are out: ``wave``'s must not be sent before the previous
        wave's Pull merged (StageError otherwise)."""
        if self.requested == wave:
            return
        if self.requested is not None:
            raise StageError(f"hetpipe: {self.ctx.who()} requested the pull of wave {wave} while that of wave "
                             f"{self.requested} is not merged")
        shards = self._shards()
        if not shards:
            return
        for k, rank in sorted(shards.items()):
            self.link.send_header(rank, Header(PULL, self.ctx.vw, self.ctx.stage, -1, wave))
        self.requested, self._pull, self._waiting_since = wave, {}, None

    def poll(self) -> bool:
        """Take the replies of the requested pull that arrived, without merging them; never blocks. True
        if one was taken."""
        if self.requested is None or len(self._pull) == len(self.ledger.pulled_shards):
            return False
        return self._collect(self.requested, self._shards())

    def _collect(self, wave: int, shards: Mapping[int, int]) -> bool:
        """Take the replies of ``wave``'s pull that arrived (checked against the request); whether any did."""
        took = False
        for k, rank in sorted(shards.items()):
            if k in self._pull:
                continue
            got = self.link.try_recv(rank, WEIGHTS, deferred=True)
            if got is None:
                continue
            took = True
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
        return took

    def pull(self, wave: int) -> bool:
        """Wave ``wave``'s Pull: request its global weights from every shard this stage pulls from (unless
        :meth:`request` did already), collect the replies, check them against D and merge them into the
        model; False while a reply is missing."""
        shards = self._shards()
        if not shards:
            return True
        self.request(wave)
        self._collect(wave, shards)
        missing = sorted(set(shards) - set(self._pull))
        if missing:
            if self._waiting_since is None:
                self._waiting_since = time.perf_counter()
            self.blocked_on = (f"the weights of wave {wave} from PS shard(s) {missing} "
                               f"(rank(s) {[shards[k] for k in missing]})")
            if self.link.waiting_for:
                self.blocked_on += f", blocked on {self.link.waiting_for}"
            return False
        self.waits[wave] = time.perf_counter() - self._waiting_since if self._waiting_since is not None else 0.0
        pulled, self._pull, self.requested, self._waiting_since = self._pull, {}, None, None
        stopped = [k for k, (g, _) in pulled.items() if g == STOPPED]
        if stopped:
            if len(stopped) != len(pulled):
                raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave}: PS shard(s) {stopped} answered "
                                 f"that the run stopped, shard(s) {sorted(set(pulled) - set(stopped))} did not")
            self.stopped = True
            return True
        if any(wave - self.d > g for g, _ in pulled.values()):
            raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave} with D = {self.d} but got "
                             f"global clocks {[g for g, _ in pulled.values()]}")
        for _, reply in pulled.values():
            self.link.use(reply)
        self.ledger.merge_pull(pulled)
        self.pulled[wave] = {k: g for k, (g, _) in pulled.items()}
        self.global_clock = min(g for g, _ in pulled.values())
        return True

    def send_done(self) -> None:
        """Tell every PS shard this stage finished, with the number of pushes it sent to each."""
        for k, rank in sorted(self.ctx.all_shard_ranks.items()):
            self.link.send_header(rank, Header(DONE, self.ctx.vw, self.ctx.stage, aux=self.pushes_sent[k]))
