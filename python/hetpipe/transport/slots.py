"""Pinned pool slots as message buffers: non-blocking acquisition, shortage reports, byte views."""

from __future__ import annotations

import numpy as np


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
