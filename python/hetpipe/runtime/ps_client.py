"""A stage's parameter-server client: its wave pushes, its pulls and their merge, and its DONE messages.

Thread role: the stage's executor thread. ``push`` and ``pull`` never block: they return False (and
set ``blocked_on``) while a pool slot or a shard's reply is missing, and continue where they stopped
when called again.
"""

from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

import torch

from hetpipe.runtime.stage_model import StageModel
from hetpipe.runtime.transport import DONE, PULL, PUSH, WEIGHTS, Header, Transport, slot_shortage
from hetpipe.runtime.wire import StageError, payload_tensor, tensor_to_slot


class PSClient:
    """Pushes ``model``'s wave deltas to, and pulls its global weights from, the PS shards of ``ctx``."""

    def __init__(self, ctx, model: StageModel, transport: Transport, pool, d: int) -> None:
        self.ctx, self.model, self.transport, self.pool, self.d = ctx, model, transport, pool, d
        self.global_clock = 0                       # g of the latest Pull (min over shards)
        self.pushes_sent: Dict[int, int] = {k: 0 for k in ctx.all_shard_ranks}
        self.blocked_on = ""
        self._pull: Optional[Dict[int, Tuple[int, torch.Tensor]]] = None
        self._push_sent: Set[int] = set()           # shards the Push in progress already sent to

    def push(self, wave: int) -> bool:
        """Send this stage's wave delta (and synced buffers), shard by shard; the sends overlap the
        following instructions. False while a shard's payload waits for a free pool slot (the shards
        already sent are not resent)."""
        for k in self.model.pushed_shards:
            if k in self._push_sent:
                continue
            rank = self.ctx.all_shard_ranks[k]
            payload = self.model.push_payload(wave, k)
            slot, dtype = tensor_to_slot(self.pool, payload)
            if slot is None:
                self.blocked_on = f"{slot_shortage(self.pool)} to push wave {wave} to PS shard {k} (rank {rank})"
                return False
            self.transport.send(rank, Header(PUSH, self.ctx.vw, self.ctx.stage, -1, wave, dtype,
                                             tuple(payload.shape), payload.numel() * payload.element_size()), slot)
            self.pushes_sent[k] += 1
            self._push_sent.add(k)
        self._push_sent.clear()
        self.model.mark_pushed(wave)
        return True

    def pull(self, wave: int) -> bool:
        """Request wave ``wave``'s global weights from every shard this stage pulls from, collect the
        replies, check them against D and merge them into the model; False while a reply is missing."""
        shards = {k: self.ctx.all_shard_ranks[k] for k in self.model.pulled_shards}
        if not shards:
            return True
        if self._pull is None:
            for k, rank in sorted(shards.items()):
                self.transport.send(rank, Header(PULL, self.ctx.vw, self.ctx.stage, -1, wave))
            self._pull = {}
        for k, rank in sorted(shards.items()):
            if k in self._pull:
                continue
            msg = self.transport.try_recv(rank, WEIGHTS)
            if msg is None:
                continue
            h = msg.header
            if h.mb != wave or h.vw != self.ctx.vw or h.stage != self.ctx.stage:
                raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave} from PS shard {k}, got a reply "
                                 f"for wave {h.mb} addressed to VW {h.vw} stage {h.stage}")
            want = sum(self.model.pull_sizes(k))
            if h.shape != (want,) or h.dtype != "float32":
                raise StageError(f"hetpipe: PS shard {k} sent {h.dtype}{list(h.shape)} weights, "
                                 f"{self.ctx.who()} holds float32[{want}] of its layers")
            self._pull[k] = (h.aux, payload_tensor(msg.payload, "float32", h.shape, self.model.device))
        missing = sorted(set(shards) - set(self._pull))
        if missing:
            self.blocked_on = (f"the weights of wave {wave} from PS shard(s) {missing} "
                               f"(rank(s) {[shards[k] for k in missing]})")
            if self.transport.slot_wait:
                self.blocked_on += f", blocked on {self.transport.slot_wait}"
            return False
        if any(wave - self.d > g for g, _ in self._pull.values()):
            raise StageError(f"hetpipe: {self.ctx.who()} pulled wave {wave} with D = {self.d} but got "
                             f"global clocks {[g for g, _ in self._pull.values()]}")
        self.model.merge_pull(self._pull)
        self.global_clock = min(g for g, _ in self._pull.values())
        self._pull = None
        return True

    def send_done(self) -> None:
        """Tell every PS shard this stage finished, with the number of pushes it sent to each."""
        for k, rank in sorted(self.ctx.all_shard_ranks.items()):
            self.transport.send(rank, Header(DONE, self.ctx.vw, self.ctx.stage, aux=self.pushes_sent[k]))
