"""A stage rank's plumbing for the torch-free front ends (NumPy, JAX): its place in the plan, its pinned
pool, its MPI endpoint, its :class:`~hetpipe.transport.array_link.ArrayLink`, and blocking waits that
never hang.

Failure contract: no collective call is made; every wait gives up after ``timeout`` seconds without
progress with a ``PeerTimeout`` naming what it waited for, so a failed peer never leaves this rank
hanging. Thread role: one thread (the rank's main thread).
"""

from __future__ import annotations

import time
from typing import Callable, Dict

from hetpipe.plan.types import Plan
from hetpipe.transport.array_link import ArrayLink
from hetpipe.transport.backoff import Backoff
from hetpipe.transport.drive import PeerTimeout
from hetpipe.transport.mpi import MPITransport
from hetpipe.transport.slots import stage_pool, stage_slot_classes


class WorkerRank:
    """Stage ``stage`` of VW ``vw`` of ``plan`` on this rank of ``comm``; payloads up to ``slot_bytes``."""

    def __init__(self, comm, plan: Plan, slot_bytes: int, *, timeout: float = 60.0) -> None:
        self.rank = comm.Get_rank()
        kind, a, b = plan.role_of(self.rank)
        if kind != "stage":
            raise ValueError(f"hetpipe: rank {self.rank} is PS shard {a} in this plan: run serve_shard there")
        self.plan, self.vw, self.stage, self.timeout = plan, a, b, timeout
        self.num_stages = len(plan.virtual_workers[a].stages)
        self.all_shard_ranks: Dict[int, int] = {sh.index: plan.ps_rank(sh.index) for sh in plan.ps_shards}
        if not plan.equal_waves:
            v = next(v for v, n in enumerate(plan.wave_minibatches) if n != plan.nm)
            raise ValueError(f"hetpipe: the NumPy and JAX front ends run waves of equal length; VW {v} trains "
                             f"{plan.nm_of(v)} minibatches per wave, the plan's Nm is {plan.nm} (the torch front end "
                             f"runs waves of unequal length)")
        self.pool = stage_pool(stage_slot_classes(plan.nm, plan.d, slot_bytes, [slot_bytes] * len(plan.ps_shards)))
        self.transport = MPITransport(comm, self.pool)
        self.link = ArrayLink(self.transport, self.pool)

    def who(self, stage: int = -1) -> str:
        s = self.stage if stage < 0 else stage
        return f"VW {self.vw} stage {s} (rank {self.plan.rank_of(self.vw, s)})"

    def rank_of_stage(self, stage: int) -> int:
        return self.plan.rank_of(self.vw, stage)

    def wait(self, attempt: Callable[[], bool], blocked_on: Callable[[], str]) -> None:
        """Call ``attempt`` (which never blocks) until it returns True, progressing the transport and
        backing off in between; PeerTimeout after ``timeout`` s."""
        backoff, start = Backoff(), time.monotonic()
        while True:
            self.link.progress()
            if attempt():
                return
            if time.monotonic() - start > self.timeout:
                raise PeerTimeout(f"hetpipe: {self.who()} waited {self.timeout:g} s for {blocked_on()}")
            backoff.wait()

    def close(self) -> None:
        """Wait for the sends in flight to complete (bounded by ``timeout``), then close the endpoint."""
        self.wait(lambda: self.link.pending_sends() == 0,
                  lambda: f"{self.link.pending_sends()} send(s) to complete")
        self.transport.close()
