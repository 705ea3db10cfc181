"""Values between neighbouring stages: activations (ACT), input gradients (GRAD) and evaluation
activations (EVAL), each a pytree of tensors sent as one message (``model.tree``, ``transport.codec``).

Under "bf16"/"fp16" a sender rounds its float32 leaves to the half type (``transport.codec.to_wire``) and
flags them in the header; the receiver widens exactly those back to float32 (``codec.from_wire``), so the
value it computes on is the sender's rounded once, in the sender's dtype.

Neither side ever blocks: a send returns False while no pool slot is free, a receive while its
message has not arrived; either then says why in the stage's :class:`Blocked`, which the drivers
report when the stage stalls. Thread role: the stage's executor thread.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

import torch
from torch.utils import _pytree as pytree

from hetpipe.model.tree import Boundary, check_message, pack, unpack
from hetpipe.stage.settings import StageContext
from hetpipe.transport.codec import from_wire, value_batch, value_header, value_rounded
from hetpipe.transport.link import StageLink
from hetpipe.transport.protocol import ACT, EVAL, KIND_NAMES, StageError


class Blocked:
    """What the stage waits for, as the drivers name it when it cannot proceed ("" while it runs)."""

    def __init__(self) -> None:
        self.on = ""


class ValueChannel:
    """This stage's end of its value messages, through ``link``; ``minibatch_of`` names a micro-batch's
    minibatch in errors."""

    def __init__(self, ctx: StageContext, link: StageLink, device: torch.device, minibatch_of: Callable[[int], int],
                 blocked: Blocked) -> None:
        self.ctx, self.link, self.device, self.minibatch_of, self.blocked = ctx, link, device, minibatch_of, blocked

    def send(self, kind: int, peer: int, mb: int, leaves: Sequence[torch.Tensor], rounded: Sequence[int] = ()) -> bool:
        """Start sending the tensor ``leaves`` of a value to stage ``peer`` as one message; False (nothing
        sent) while no pool slot is free. ``rounded``: the leaves rounded from float32 for the wire."""
        t = pack(leaves, self.device)
        header, nbytes = value_header(kind, self.ctx.vw, self.ctx.stage, mb, leaves, t, rounded)
        dest = self.ctx.rank_of_stage(peer)
        limit = self.link.slot_limit(dest)
        if limit is not None and nbytes > limit:
            p = self.minibatch_of(mb)
            raise StageError(f"hetpipe: {self.ctx.who()}: the {KIND_NAMES[kind]} of minibatch {p} of VW "
                             f"{self.ctx.vw} is {list(t.shape)} ({nbytes} bytes) but the stage's pinned slots hold "
                             f"{limit} bytes, sized by the first minibatch: minibatches must not "
                             "exceed the first one's size")
        sent = self.link.send(dest, header, t)
        if not sent:
            self.blocked.on = (f"{self.link.waiting_for} to send the {KIND_NAMES[kind]} of minibatch {mb} "
                               f"to {self.ctx.who(peer)}")
        return sent

    def recv(self, kind: int, peer: int, mb: int, into: Dict[int, Any], expect: Boundary, what: str) -> bool:
        """Receive minibatch ``mb``'s value from stage ``peer`` into ``into[mb]`` (a pytree for ACT and
        EVAL, the list of leaves for GRAD, the leaves its sender rounded widened back); False while it
        has not arrived."""
        got = self.link.try_recv(self.ctx.rank_of_stage(peer), kind)
        if got is None:
            self.blocked.on = f"the {what} of minibatch {mb} from {self.ctx.who(peer)}"
            if self.link.waiting_for:
                self.blocked.on += f", blocked on {self.link.waiting_for}"
            return False
        h, buf = got
        if h.vw != self.ctx.vw or h.stage != peer or h.mb != mb:
            raise StageError(f"hetpipe: {self.ctx.who()} expected the {what} of minibatch {mb} from "
                             f"{self.ctx.who(peer)}, got one for minibatch {h.mb} from VW {h.vw} stage {h.stage}")
        batch = value_batch(h.aux)
        problem = check_message(expect, h.dtype, h.shape, batch, h.nbytes)
        if problem is not None:
            raise StageError(f"hetpipe: shape mismatch between {self.ctx.who(peer)} and {self.ctx.who()}: the "
                             f"{what} of minibatch {mb} {problem}")
        leaves = from_wire(unpack(buf, expect, h.shape[0] if len(expect.leaves) == 1 else batch), value_rounded(h.aux))
        into[mb] = pytree.tree_unflatten(leaves, expect.spec) if kind in (ACT, EVAL) else leaves
        return True
