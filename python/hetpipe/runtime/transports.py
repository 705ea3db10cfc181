"""Transport backends by name, the one place that chooses a rank's backend, and the collective that opens it.

A backend is a factory ``open(comm, pool, channels) -> Transport`` and a test ``fits(devices, comm)``
that returns a :class:`Fit`: whether it can serve a rank with those devices on that communicator,
the one-line reason (or why not), and whether the automatic choice takes it unasked. :func:`choose`
asks the backends in registration order (most capable first) and takes the first automatic one
that serves; a forced name must serve, else the error says why. Registered: ``loopback`` (the
single-process replay), ``torch-p2p`` (stage-to-stage tensors over torch.distributed: NCCL between
GPUs, automatic; gloo between CPU stages, when forced) and ``mpi-host`` (pinned-host slots over MPI).

:func:`open_rank` is the collective every rank of a job calls: the ranks' choices are gathered, a
channel between two stage ranks uses torch-p2p when both chose it with the same torch.distributed
backend (else that edge stays on mpi-host), and PS shard ranks always use mpi-host (they have no
device). See docs/design.md, "Transports".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hetpipe.runtime.torch_groups import Channels, flavour_for, job_channels, open_channels
from hetpipe.runtime.torch_p2p import TorchP2PTransport
from hetpipe.runtime.transport import LoopbackHub, MPITransport, Transport

TORCH_P2P = "torch-p2p"
MPI_HOST = "mpi-host"
TRANSPORT_ENV = "HETPIPE_TRANSPORT"     # the backend the stage ranks must use (``hetpipe launch --transport``)


class TransportChoiceError(ValueError):
    """A forced backend cannot serve a rank, or no backend can."""


@dataclass(frozen=True)
class LoopbackPort:
    """The "communicator" of a loopback endpoint: the replay's hub and this endpoint's rank."""

    hub: LoopbackHub
    rank: int


@dataclass(frozen=True)
class Fit:
    """A backend's verdict on a rank: whether it serves it, why (or why not), whether unasked."""

    serves: bool
    reason: str
    automatic: bool = True


@dataclass(frozen=True)
class Backend:
    """A registered transport: its name, its factory and its applicability test."""

    name: str
    open: Callable[[object, object, Optional[Channels]], Transport]
    fits: Callable[[Sequence[torch.device], object], Fit]


_BACKENDS: Dict[str, Backend] = {}


def register(name: str, open: Callable[[object, object, Optional[Channels]], Transport],
             fits: Callable[[Sequence[torch.device], object], Fit]) -> None:
    """Add backend ``name``; :func:`choose` tries backends in the order they were registered."""
    if name in _BACKENDS:
        raise ValueError(f"transports: a backend named {name!r} is already registered")
    _BACKENDS[name] = Backend(name, open, fits)


def names() -> Tuple[str, ...]:
    """The registered backends, in the order :func:`choose` tries them."""
    return tuple(_BACKENDS)


def choose(devices: Sequence[torch.device], comm, forced: Optional[str] = None) -> Tuple[Backend, str]:
    """The backend for a rank computing on ``devices`` (empty for a PS shard) over ``comm`` (an mpi4py
    communicator or a :class:`LoopbackPort`), with the one-line reason it was chosen; ``forced``: that
    backend, which must serve the rank (else :class:`TransportChoiceError` says why)."""
    if forced is not None:
        if forced not in _BACKENDS:
            raise TransportChoiceError(f"no transport backend named {forced!r} (registered: {', '.join(_BACKENDS)})")
        fit = _BACKENDS[forced].fits(devices, comm)
        if not fit.serves:
            raise TransportChoiceError(f"the forced transport {forced!r} cannot serve it: {fit.reason}")
        return _BACKENDS[forced], f"{fit.reason} (forced)"
    for backend in _BACKENDS.values():
        fit = backend.fits(devices, comm)
        if fit.serves and fit.automatic:
            return backend, fit.reason
    where = ", ".join(str(d) for d in devices) or "no device"
    raise TransportChoiceError(f"no registered backend ({', '.join(_BACKENDS)}) serves a rank on {where} "
                               f"over a {type(comm).__name__}")


@dataclass
class Opened:
    """A rank's open transport, the backend name it reports and why."""

    transport: Transport
    name: str
    reason: str


def open_rank(comm, pool, device: Optional[torch.device], pairs: Sequence[Tuple[int, int]], *,
              forced: Optional[str] = None, timeout_s: float = 120.0, who: str = "") -> Opened:
    """Open this rank's transport; collective over ``comm`` (every rank calls it).

    device: the stage's device (None on a PS shard rank); pairs: the ranks of stages that exchange
    messages (both directions get a channel); forced: the backend every stage rank must use (PS
    shard ranks stay on mpi-host); who: this rank in error messages. Raises
    :class:`TransportChoiceError` on every rank, listing each rank a forced backend cannot serve."""
    devices = [device] if device is not None else []
    problem, name, flavour = None, MPI_HOST, None
    try:
        backend, reason = choose(devices, comm, forced if device is not None else None)
        name = backend.name
        if name == TORCH_P2P:
            flavour = flavour_for(device)[0]
    except TransportChoiceError as e:
        problem, reason = f"{who or f'rank {comm.Get_rank()}'} on {device or 'no device'}: {e}", ""
    everyone = comm.allgather((problem, name, flavour, str(device)))
    problems = [p for p, _, _, _ in everyone if p]
    if forced == TORCH_P2P:
        problems += [f"ranks {a} ({everyone[a][3]}) and {b} ({everyone[b][3]}) exchange tensors but use "
                     f"{everyone[a][2]} and {everyone[b][2]}: torch-p2p joins stages of one kind of device"
                     for a, b in sorted({tuple(sorted(p)) for p in pairs})
                     if everyone[a][2] != everyone[b][2]]
    if problems:
        raise TransportChoiceError("hetpipe: transport: " + "; ".join(problems))
    rank = comm.Get_rank()
    channels: List[Channels] = []
    for fl in sorted({f for _, n, f, _ in everyone if n == TORCH_P2P}):
        edges = [c for c in job_channels(pairs) if all(everyone[r][1] == TORCH_P2P and everyone[r][2] == fl for r in c)]
        opened = open_channels(comm, edges, fl, device if flavour == fl else torch.device("cpu"), timeout_s)
        if opened.groups:
            channels.append(opened)
    if channels:
        mine = channels[0]
        peers = mine.peers()
        staying = sorted({b for a, b in job_channels(pairs) if a == rank} - set(peers))
        reason += f"; to rank(s) {peers}" + (f", pinned-host MPI to stage rank(s) {staying}" if staying else "") + \
            "; PS traffic over pinned-host MPI"
        return Opened(_BACKENDS[TORCH_P2P].open(comm, pool, mine), TORCH_P2P, reason)
    if name == TORCH_P2P:
        reason = (f"mpi-host: pinned-host slots over MPI; torch-p2p would serve {device} but no peer stage "
                  "uses the same torch.distributed backend")
        name = MPI_HOST
    return Opened(_BACKENDS[name].open(comm, pool, None), name, reason)


def _loopback_fits(devices: Sequence[torch.device], comm) -> Fit:
    if not isinstance(comm, LoopbackPort):
        return Fit(False, "loopback: only the single-process replay (Trainer.replay) has a loopback hub")
    return Fit(True, "loopback: the single-process replay, messages handed between the parts of one process")


def _torch_p2p_fits(devices: Sequence[torch.device], comm) -> Fit:
    if isinstance(comm, LoopbackPort):
        return Fit(False, "torch-p2p: joins processes; the single-process replay uses loopback")
    if len(devices) != 1:
        return Fit(False, "torch-p2p: joins stage ranks of one device each; a PS shard rank has no device")
    flavour, why = flavour_for(devices[0])
    if flavour is None:
        return Fit(False, f"torch-p2p: {why}")
    # Between CPU stages gloo moves the same bytes through host memory as mpi-host: only when forced.
    return Fit(True, f"torch-p2p: {why}", automatic=flavour != "gloo")


def _mpi_host_fits(devices: Sequence[torch.device], comm) -> Fit:
    if isinstance(comm, LoopbackPort):
        return Fit(False, "mpi-host: joins processes; the single-process replay uses loopback")
    on = ", ".join(sorted({d.type for d in devices})) or "no device (PS shard)"
    return Fit(True, f"mpi-host: pinned-host slots over MPI ({on})")


register("loopback", lambda port, pool, channels: port.hub.endpoint(port.rank, pool), _loopback_fits)
register(TORCH_P2P, TorchP2PTransport, _torch_p2p_fits)
register(MPI_HOST, lambda comm, pool, channels: MPITransport(comm, pool), _mpi_host_fits)
