"""The exchange of tied-parameter gradients among the stages of a VW that hold the same parameter
(TIED messages; docs/design.md, "Tied weights").

After its ``Bwd(mb)`` a stage queues, for each peer holding some of its tied parameters, the flat
gradients of the parameters they share; they are sent in order as pool slots allow, without ever
blocking the stage. ``Apply(p)`` waits until every peer's gradients of ``p``'s micro-batches arrived.
No wait cycle: a peer sends after its own ``Bwd(mb)``, which never waits for any stage's Apply.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from hetpipe.stage.params import StageModel
from hetpipe.stage.settings import StageContext
from hetpipe.stage.traffic import Blocked
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import TIED, Header


class TiedExchange:
    """This stage's end of the exchange with its tied peers (``model.tied``)."""

    def __init__(self, ctx: StageContext, model: StageModel, link: StageLink, blocked: Blocked) -> None:
        self.ctx, self.model, self.link, self.blocked = ctx, model, link, blocked
        self.peers = model.tied.peers
        self._out: List[Tuple[int, int, torch.Tensor]] = []      # (peer, mb, flat) not yet sent
        self._in: Dict[Tuple[int, int], torch.Tensor] = {}       # (peer, mb) -> flat received

    @property
    def unsent(self) -> bool:
        return bool(self._out)

    def queue(self, mb: int) -> None:
        """Queue micro-batch ``mb``'s tied gradients for every peer (after its backward) and send what fits."""
        for peer in self.peers:
            self._out.append((peer, mb, self.model.tied_grad(mb, self.model.keys_shared_with(peer))))
        self.send()

    def send(self) -> bool:
        """Send the queued gradients, in order, while pool slots are free; True if any was sent."""
        sent = False
        while self._out:
            peer, mb, flat = self._out[0]
            header = Header(TIED, self.ctx.vw, self.ctx.stage, mb, -1, "float32", tuple(flat.shape), flat.numel() * 4)
            if not self.link.send(self.ctx.rank_of_stage(peer), header, flat):
                return sent
            self._out.pop(0)
            sent = True
        return sent

    def arrived(self, p: int, micros: Sequence[int]) -> bool:
        """Receive until every peer's gradients of ``micros`` (minibatch ``p``'s) are here; False while
        one is missing (the stage's ``blocked`` says which)."""
        for peer in self.peers:
            while any((peer, m) not in self._in for m in micros):
                got = self.link.try_recv(self.ctx.rank_of_stage(peer), TIED)
                if got is None:
                    self.blocked.on = f"the tied-parameter gradients of minibatch {p} from {self.ctx.who(peer)}"
                    return False
                h, flat = got
                self._in[(peer, h.mb)] = flat
        return True

    def take(self, micros: Sequence[int]) -> Dict[int, List[torch.Tensor]]:
        """Per peer, its received gradients of ``micros`` (in order), removed."""
        return {peer: [self._in.pop((peer, m)) for m in micros] for peer in self.peers}
