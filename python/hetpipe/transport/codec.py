"""The wire codec: tensors into pinned pool slots and headers, and received payloads back into tensors."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch

from hetpipe.model.tree import Boundary
from hetpipe.transport.protocol import DTYPES, Header
from hetpipe.transport.slots import slot_bytes, try_acquire



# The wire name of each torch dtype the transport carries (transport.DTYPES are torch's names).
TORCH_DTYPE_NAME = {getattr(torch, name): name for name in DTYPES}


def tensor_to_slot(pool, t: torch.Tensor):
    """Copy ``t`` into a fresh pool slot (device→host when ``t`` is on a GPU); returns (slot, dtype name),
    or (None, dtype name) when every slot is in use (see :func:`try_acquire`)."""
    t = t.detach().contiguous()
    nbytes = t.numel() * t.element_size()
    slot = try_acquire(pool, nbytes)
    if slot is not None and nbytes:
        dst = torch.from_numpy(slot_bytes(slot, nbytes))
        dst.copy_(t.reshape(-1).view(torch.uint8))
    return slot, TORCH_DTYPE_NAME[t.dtype]


def to_wire(leaves: Sequence[torch.Tensor], boundary: Boundary) -> List[torch.Tensor]:
    """The float32 leaves that ``boundary`` (a wire boundary, see ``tree.on_wire``) carries in a half
    type, rounded to it; every other leaf as it is (a mismatch is still the receiver's error)."""
    return [t.to(leaf.dtype) if t.dtype == torch.float32 and leaf.dtype in (torch.bfloat16, torch.float16) else t
            for t, leaf in zip(leaves, boundary.leaves)]


def value_header(kind: int, vw: int, stage: int, mb: int, leaves: Sequence[torch.Tensor],
                 packed: torch.Tensor) -> Tuple[Header, int]:
    """The header of a value's message and its byte count: ``packed`` (``tree.pack`` of ``leaves``)
    travels with its own dtype and shape when the value is one tensor, else as bytes with aux = the
    batch size (see ``tree.unpack``)."""
    nbytes = packed.numel() * packed.element_size()
    if len(leaves) == 1:
        return Header(kind, vw, stage, mb, -1, TORCH_DTYPE_NAME[packed.dtype], tuple(packed.shape), nbytes), nbytes
    batch = int(leaves[0].shape[0]) if leaves else 0
    return Header(kind, vw, stage, mb, batch, "uint8", (nbytes,), nbytes), nbytes


def payload_tensor(payload: np.ndarray, dtype: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """A received payload viewed as a ``dtype`` tensor of ``shape`` (no copy on the CPU), on ``device``."""
    if payload.size == 0:           # an empty message (numpy gives its view stride 0, which torch refuses)
        return torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
    t = torch.from_numpy(payload).view(getattr(torch, dtype)).reshape(tuple(shape))
    return t.to(device) if device.type != "cpu" else t
