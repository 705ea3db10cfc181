"""Counting host-device synchronisations without a device.

On a GPU the host runs ahead of the kernels it queued; an operation whose result the host needs at
once (a tensor's value, a data-dependent shape, a copy to host memory) makes it wait until the
device drained the queue. Which operations do that does not depend on the device, so they can be
counted on the CPU: :class:`HostSyncs` records every one of them that runs while it is active, with
the time it ran and who it was charged to (``owner``, set by the caller as it steps its parts).

Recorded: at the dispatcher (every route to them, Python or C++), the scalar reads
(``_local_scalar_dense``: ``item()``, ``float()``, ``bool()``, ``int()``, an ``if`` on a tensor),
``equal``, and the ops whose output shape depends on the data (``nonzero``, ``masked_select``,
``unique``, ``repeat_interleave`` of a tensor, indexing by a boolean mask); at the Python API,
``Tensor.tolist`` (a read of every value, which on the CPU runs no op the dispatcher sees), and the
copies to host memory (``Tensor.numpy``, ``Tensor.cpu``, ``Tensor.to`` a CPU device) of a tensor in
device memory. A host tensor's copy to the host waits for nothing: on a CPU-only machine, where the
stage's own tensors are host tensors too, these copies are therefore not counted, and every value
read is (``host_reads``); run on a GPU, the copies are counted, and only the reads of device
tensors (a host tensor's value, an optimizer's step counter, is read without waiting).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, List

import torch
from torch.utils import _pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that make the host wait for the device whatever their arguments.
SYNCING_OPS = frozenset({
    aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select,
    aten.unique_consecutive, aten.unique_dim, aten._unique, aten._unique2, aten.unique_dim_consecutive,
    aten.bincount,
})
# Ops that do so when an index is a boolean mask (it becomes the indices of its true elements).
MASK_INDEXED_OPS = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})
# Python-level copies to host memory (of a tensor in device memory).
TO_HOST = frozenset({torch.Tensor.numpy, torch.Tensor.cpu})


@dataclass(frozen=True)
class Sync:
    owner: Any          # what the caller said was running
    at: float           # time.perf_counter()
    what: str           # the op or method


def _is_host_device(x: Any) -> bool:
    return (isinstance(x, str) and x.split(":")[0] == "cpu") or (isinstance(x, torch.device) and x.type == "cpu")


def _reads_device(args: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in pytree.tree_leaves(args))


class _Dispatch(TorchDispatchMode):
    def __init__(self, record, host_reads: bool) -> None:
        super().__init__()
        self.record, self.host_reads = record, host_reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if not (self.host_reads or _reads_device(args)):
            pass
        elif packet in SYNCING_OPS:
            self.record(str(func))
        elif packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) \
                and kwargs.get("output_size") is None and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
            self.record(str(func))
        elif packet in MASK_INDEXED_OPS and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ())):
            self.record(str(func))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, record, host_reads: bool) -> None:
        super().__init__()
        self.record, self.host_reads = record, host_reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            if self.host_reads or _reads_device(args[:1]):
                self.record("Tensor.tolist")
        elif isinstance(args[0] if args else None, torch.Tensor) and args[0].device.type != "cpu":
            if func in TO_HOST:
                self.record(f"Tensor.{func.__name__}")
            elif func is torch.Tensor.to and any(_is_host_device(a) for a in (*args[1:], kwargs.get("device"))):
                self.record("Tensor.to(cpu)")
        return func(*args, **kwargs)


class HostSyncs:
    """Records the synchronising operations run while :meth:`recording`; ``owner`` is charged with each.
    ``host_reads``: whether reads of host tensors count (on a CPU-only machine, where they stand for
    the device's; not beside a device)."""

    def __init__(self, host_reads: bool = True) -> None:
        self.owner: Any = None
        self.syncs: List[Sync] = []
        self.host_reads = host_reads

    def _record(self, what: str) -> None:
        self.syncs.append(Sync(self.owner, time.perf_counter(), what))

    @contextlib.contextmanager
    def recording(self) -> Iterator["HostSyncs"]:
        with _Function(self._record, self.host_reads), _Dispatch(self._record, self.host_reads):
            yield self
