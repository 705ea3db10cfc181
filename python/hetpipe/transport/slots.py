"""Pinned pool slots as message buffers: non-blocking acquisition, shortage reports, byte views."""

from __future__ import annotations

import numpy as np

import hetpipe_core

SLOT_ALIGN = 4096


def round_slot(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one): a pool's slot size."""
    return max(SLOT_ALIGN, -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN)


def stage_pool(nm: int, num_shards: int, nbytes: int, device: int = -1):
    """A stage rank's slots of ``nbytes`` (its largest payload): its Nm outgoing and incoming values,
    a push and a pull reply per PS shard, and spares; pinned through CUDA device ``device`` (-1: host)."""
    return hetpipe_core.PinnedBufferPool(2 * nm + 2 * num_shards + 8, round_slot(nbytes), device)


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
