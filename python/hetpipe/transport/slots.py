"""Pinned pool slots as message buffers: the pools' sizes, non-blocking acquisition, shortage reports,
byte views, and the check that a CUDA stage's pool really is page-locked."""

from __future__ import annotations

import os
import sys
from typing import Iterable, List, Tuple

import numpy as np

import hetpipe_core
from hetpipe.util.errors import HetpipeError

SLOT_ALIGN = 4096
# "1": a CUDA stage whose pool could not be page-locked fails instead of warning (see check_pinned).
REQUIRE_PINNED_ENV = "HETPIPE_REQUIRE_PINNED"


class PinningError(HetpipeError, RuntimeError):
    """A CUDA stage's pool is not page-locked and ``HETPIPE_REQUIRE_PINNED=1`` asks for an error."""


def round_slot(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one): a pool's slot size."""
    return max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)


def stage_slot_classes(nm: int, d: int, value_bytes: int, shard_bytes: Iterable[int],
                       value_peers: int = 2, tied_peers: int = 0) -> List[Tuple[int, int]]:
    """A stage rank's slot classes ``[(count, bytes), ...]``, each kind sized by its own payload and
    counted by what the schedule and WSP keep in flight.

    Values (activations, gradients, tied gradients; ``value_bytes``, the largest): at most ``nm``
    activations and ``nm`` gradients sent and not yet delivered (the 1F1B bound on forwards ahead of
    backwards), ``nm`` tied gradients per tied peer, and per peer exchanging values (neighbours and
    tied peers, ``value_peers``) one payload being received and one on its copy to the device.
    PS payloads, per shard (``shard_bytes[k]``: its push, or its pull reply of weights, replicas and
    buffers, whichever is larger; 0 for a shard owning none of the stage's layers): ``D + 2`` pushes
    in flight (Push(w + 1) may start while the shard has received waves up to ``w - D - 1`` only)
    and one pull reply. A value larger than its class takes a PS slot (the pool spills upwards)."""
    classes = [(2 * nm + nm * tied_peers + 2 * value_peers, round_slot(value_bytes))]
    classes += [(d + 3, round_slot(n)) for n in shard_bytes if n > 0]
    return classes


def stage_pool(classes: List[Tuple[int, int]], device: int = -1, who: str = "a stage"):
    """A stage rank's pool of ``classes`` (:func:`stage_slot_classes`), pinned through CUDA device
    ``device`` (-1: host memory); checked with :func:`check_pinned`."""
    pool = hetpipe_core.PinnedBufferPool.of_classes(classes, device)
    check_pinned(pool, device, who)
    return pool


def check_pinned(pool, device: int, who: str) -> None:
    """A pool asked to be page-locked through CUDA device ``device`` (>= 0) that is not: one line on
    stderr naming the bytes and why pinning failed (copies from pageable memory are staged by the
    driver and block the host), or :class:`PinningError` when ``HETPIPE_REQUIRE_PINNED=1``."""
    if device < 0 or pool.pinned:
        return
    what = (f"hetpipe: {who}: its {pool.num_slots} pool slots ({pool.total_bytes} bytes) asked to be page-locked "
            f"through CUDA device {device} are pageable memory: {pool.pin_error}")
    if os.environ.get(REQUIRE_PINNED_ENV, "").strip() == "1":
        raise PinningError(f"{what} ({REQUIRE_PINNED_ENV}=1)")
    sys.stderr.write(f"{what}; host<->device copies through them run synchronously ({REQUIRE_PINNED_ENV}=1 "
                     "makes this an error)\n")


def shard_pool(num_stage_ranks: int, nbytes: int, plane: str = "python"):
    """A PS shard rank's slots (host memory, so a PS rank opens no CUDA context): a push and a reply per
    stage rank and spares, of ``nbytes`` (its largest payload). The core plane receives and sends in
    place, so its Python side (DONE messages only) needs one small slot."""
    if plane == "core":
        return hetpipe_core.PinnedBufferPool(1, SLOT_ALIGN, -1)
    return hetpipe_core.PinnedBufferPool(2 * num_stage_ranks + 8, round_slot(nbytes), -1)


def try_acquire(pool, nbytes: int):
    """A free slot of ``pool`` for ``nbytes`` bytes, or None when every slot is in use; never blocks.

    Slots are released by the thread that acquires them (as its transfers and copies complete), so
    waiting inside ``acquire`` would wait for itself: callers report the shortage and retry."""
    try:
        return pool.acquire(max(nbytes, 1), timeout=0)
    except TimeoutError:
        return None


def slot_shortage(pool) -> str:
    """What a caller that got no slot from ``try_acquire`` waits for, with the pool's occupancy."""
    total = pool.num_slots
    return f"a free pinned slot ({total - pool.available()} of {total} in use)"


def slot_bytes(slot, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view of the first ``nbytes`` of a pool slot (shares its memory)."""
    return np.frombuffer(slot, dtype=np.uint8, count=nbytes)
