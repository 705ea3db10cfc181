"""Transport backends by name, and the one place that chooses a rank's backend.

A backend is a factory ``open(comm, pool) -> Transport`` and a test ``fits(devices, comm)`` that
returns the one-line reason it serves a rank with those devices on that communicator, or None.
:func:`choose` asks the backends in registration order (most capable first) and takes the first
that fits, so a new backend (device-to-device, say) is one :func:`register` call ahead of the
pinned-host one. The trainer and the replay open their endpoints through here and report the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from hetpipe.runtime.transport import LoopbackHub, MPITransport, Transport


@dataclass(frozen=True)
class LoopbackPort:
    """The "communicator" of a loopback endpoint: the replay's hub and this endpoint's rank."""

    hub: LoopbackHub
    rank: int


@dataclass(frozen=True)
class Backend:
    """A registered transport: its name, its factory and its applicability test."""

    name: str
    open: Callable[[object, object], Transport]
    fits: Callable[[Sequence[torch.device], object], Optional[str]]


_BACKENDS: Dict[str, Backend] = {}


def register(name: str, open: Callable[[object, object], Transport],
             fits: Callable[[Sequence[torch.device], object], Optional[str]]) -> None:
    """Add backend ``name``; :func:`choose` tries backends in the order they were registered."""
    if name in _BACKENDS:
        raise ValueError(f"transports: a backend named {name!r} is already registered")
    _BACKENDS[name] = Backend(name, open, fits)


def names() -> Tuple[str, ...]:
    """The registered backends, in the order :func:`choose` tries them."""
    return tuple(_BACKENDS)


def choose(devices: Sequence[torch.device], comm) -> Tuple[Backend, str]:
    """The backend for a rank computing on ``devices`` (empty for a PS shard) over ``comm`` (an mpi4py
    communicator or a :class:`LoopbackPort`), with the one-line reason it was chosen."""
    for backend in _BACKENDS.values():
        reason = backend.fits(devices, comm)
        if reason is not None:
            return backend, reason
    where = ", ".join(str(d) for d in devices) or "no device"
    raise ValueError(f"transports: no registered backend ({', '.join(_BACKENDS)}) serves a rank on {where} "
                     f"over a {type(comm).__name__}")


def _loopback_fits(devices: Sequence[torch.device], comm) -> Optional[str]:
    if not isinstance(comm, LoopbackPort):
        return None
    return "loopback: the single-process replay, messages handed between the parts of one process"


def _mpi_host_fits(devices: Sequence[torch.device], comm) -> Optional[str]:
    if isinstance(comm, LoopbackPort):
        return None
    on = ", ".join(sorted({d.type for d in devices})) or "no device (PS shard)"
    return f"mpi-host: pinned-host slots over MPI, the only inter-process backend ({on})"


register("loopback", lambda port, pool: port.hub.endpoint(port.rank, pool), _loopback_fits)
register("mpi-host", MPITransport, _mpi_host_fits)
