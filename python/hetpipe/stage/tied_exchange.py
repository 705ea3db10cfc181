"""The exchange of tied-parameter gradients among the stages of a VW that hold the same parameter
(TIED messages; docs/design.md, "Tied weights").

The stream says when (:mod:`hetpipe.schedule.messages`): ``SendTied(mb, peer)`` after ``Bwd(mb)``
queues the flat gradients of the parameters the stage shares with ``peer``; queued messages are sent
in order as pool slots allow, without ever blocking the stage (DONE waits for the queue to drain).
``RecvTied(mb, peer)`` receives the peer's, in the order the peer sent them, before the Apply of
``mb``'s minibatch takes them. No wait cycle: a peer sends after its own ``Bwd(mb)``, which never
waits for any stage's Apply. The gradients cross in the run's precision (``stage.tied``).
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from hetpipe.stage.params import StageModel
from hetpipe.stage.settings import StageContext
from hetpipe.stage.traffic import Blocked
from hetpipe.transport.codec import TORCH_DTYPE_NAME
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import TIED, Header, StageError


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

    def send(self, mb: int, peer: int) -> bool:
        """Queue micro-batch ``mb``'s tied gradients for ``peer`` (after its backward) and send what fits;
        never blocks (True)."""
        self._out.append((peer, mb, self.model.tied_grad(mb, self.model.keys_shared_with(peer))))
        self.flush()
        return True

    def flush(self) -> bool:
        """Send the queued gradients, in order, while pool slots are free; True if any was sent."""
        sent = False
        while self._out:
            peer, mb, flat = self._out[0]
            header = Header(TIED, self.ctx.vw, self.ctx.stage, mb, -1, TORCH_DTYPE_NAME[flat.dtype], tuple(flat.shape),
                            flat.numel() * flat.element_size())
            if not self.link.send(self.ctx.rank_of_stage(peer), header, flat):
                return sent
            self._out.pop(0)
            sent = True
        return sent

    def recv(self, mb: int, peer: int) -> bool:
        """Receive ``peer``'s tied gradients of micro-batch ``mb``; False while they have not arrived."""
        got = self.link.try_recv(self.ctx.rank_of_stage(peer), TIED)
        if got is None:
            self.blocked.on = f"the tied-parameter gradients of micro-batch {mb} from {self.ctx.who(peer)}"
            return False
        h, flat = got
        if h.mb != mb:
            raise StageError(f"hetpipe: {self.ctx.who()} expected the tied-parameter gradients of micro-batch {mb} "
                             f"from {self.ctx.who(peer)}, got those of micro-batch {h.mb}")
        self._in[(peer, mb)] = flat
        return True

    def take(self, micros: Sequence[int]) -> Dict[int, List[torch.Tensor]]:
        """Per peer, its received gradients of ``micros`` (in order), removed."""
        missing = [(peer, m) for peer in self.peers for m in micros if (peer, m) not in self._in]
        if missing:
            raise StageError(f"hetpipe: {self.ctx.who()}: an Apply needs the tied-parameter gradients (stage, "
                             f"micro-batch) {missing}, which its stream did not receive (RecvTied) before it")
        return {peer: [self._in.pop((peer, m)) for m in micros] for peer in self.peers}
