"""Transport backends by name, the one place that chooses a rank's backend, and the collective that opens it.

A backend is a factory ``open(comm, pool, channels) -> Transport`` and a test ``fits(devices, comm)``
that returns a :class:`Fit`: whether it can serve a rank with those devices on that communicator,
the one-line reason (or why not), and whether the automatic choice takes it unasked. :func:`choose`
asks the backends in registration order (most capable first) and takes the first automatic one
that serves; a forced name must serve, else the error says why. Registered: ``loopback`` (the
single-process replay), ``torch-p2p`` (stage-to-stage tensors over torch.distributed: NCCL between
GPUs, automatic; gloo between CPU stages, when forced) and ``mpi-host`` (pinned-host slots over MPI;
on a stage rank through the core's progress thread where it can run, :mod:`hetpipe.transport.core`).

:func:`open_rank` is the collective every rank of a job calls: the ranks' choices are gathered, a
channel between two stage ranks uses torch-p2p when both chose it with the same torch.distributed
backend and, for NCCL, are not ranks of one GPU (else that edge stays on mpi-host); PS shard ranks
always use mpi-host (they have no device). "One GPU" is decided by the GPU's identity (its UUID,
:func:`device_identity`), not by the device string: under per-rank ``CUDA_VISIBLE_DEVICES`` two ranks
on different GPUs both compute on ``cuda:0``. See docs/design.md, "Transports".
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from hetpipe.transport.base import Transport
from hetpipe.transport.core import CoreTransport, choose_stage_plane
from hetpipe.transport.loopback import LoopbackHub
from hetpipe.transport.mpi import MPITransport
from hetpipe.util.gpus import gpu_identity
from hetpipe.transport.torch_groups import NCCL, Channels, flavour_for, job_channels, open_channels
from hetpipe.transport.torch_p2p import TorchP2PTransport
from hetpipe.util.errors import HetpipeError

TORCH_P2P = "torch-p2p"
MPI_HOST = "mpi-host"


class TransportChoiceError(HetpipeError, ValueError):
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
    problem, name, flavour, reason = None, MPI_HOST, None, ""
    try:
        backend, reason = choose(devices, comm, forced if device is not None else None)
        name = backend.name
        if name == TORCH_P2P:
            flavour = flavour_for(device)[0]
    except TransportChoiceError as e:
        problem = f"{who or f'rank {comm.Get_rank()}'} on {device or 'no device'}: {e}"
    everyone = [RankChoice(*c) for c in comm.allgather((problem, name, flavour, str(device), socket.gethostname(),
                                                        device_identity(device)))]
    problems = [c.problem for c in everyone if c.problem]
    if forced == TORCH_P2P and not problems:
        problems = [f"ranks {a} ({everyone[a].device}) and {b} ({everyone[b].device}) exchange tensors but "
                    f"{why}" for a, b in sorted({tuple(sorted(p)) for p in pairs})
                    for why in [unjoinable(everyone[a], everyone[b])] if why]
    if problems:
        raise TransportChoiceError("hetpipe: transport: " + "; ".join(problems))
    rank = comm.Get_rank()
    edges = [c for c in job_channels(pairs) if not unjoinable(everyone[c[0]], everyone[c[1]])]
    channels: Optional[Channels] = None
    for fl in sorted({c.flavour for c in everyone if c.flavour}):
        # Collective, one flavour after the other in one order on every rank.
        mine = [c for c in edges if everyone[c[0]].flavour == fl]
        opened = open_channels(comm, mine, fl, device if flavour == fl else torch.device("cpu"), timeout_s,
                               one_host=len({everyone[r].host for c in mine for r in c}) <= 1)
        if opened.groups:
            channels = opened
    stage_peers = sorted({b for a, b in job_channels(pairs) if a == rank})
    if channels is not None:
        peers = channels.peers()
        staying = sorted(set(stage_peers) - set(peers))
        reason += f"; to stage rank(s) {peers}" + (f", pinned-host MPI to stage rank(s) {staying}" if staying else "") \
            + "; PS traffic over pinned-host MPI"
        return Opened(_BACKENDS[TORCH_P2P].open(comm, pool, channels), TORCH_P2P, reason)
    if name == TORCH_P2P:
        why = "; ".join(f"rank {p}: {unjoinable(everyone[rank], everyone[p])}" for p in stage_peers) or "no peer stage"
        reason = f"mpi-host: pinned-host slots over MPI; torch-p2p would serve {device} but not its peers ({why})"
        name = MPI_HOST
    if name == MPI_HOST and device is not None:
        plane, why = choose_stage_plane(comm, ranks_here=sum(c.host == everyone[rank].host for c in everyone))
        if plane == "core":
            return Opened(CoreTransport(comm, pool), name, f"{reason}; {why}")
        reason += f"; {why}"
    return Opened(_BACKENDS[name].open(comm, pool, None), name, reason)


@dataclass(frozen=True)
class RankChoice:
    """What a rank chose, as gathered by :func:`open_rank`."""

    problem: Optional[str]
    backend: str
    flavour: Optional[str]
    device: str
    host: str
    gpu: str = ""           # device_identity(): the GPU's UUID (or PCI bus id), "" when unknown or no GPU


def device_identity(device: Optional[torch.device]) -> str:
    """The identity of a CUDA ``device`` across processes (:func:`hetpipe.util.gpus.gpu_identity`):
    its UUID as CUDA reports it (torch's ``get_device_properties(i).uuid``) where torch sees the device,
    else as nvidia-smi lists it; "" for any other device, or when neither is known."""
    if device is None or device.type != "cuda":
        return ""
    index = device.index if device.index is not None else 0
    reported = ""
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        raw = getattr(uuid, "bytes", None)
        reported = bytes(raw).hex() if raw else str(uuid or "")
    return gpu_identity(index, reported)


def same_gpu(a: RankChoice, b: RankChoice) -> bool:
    """Whether two ranks compute on one GPU: by the GPUs' identities when both are known, else (no driver
    tool, no UUID) by host and device string, which holds only where every rank sees every GPU."""
    if a.host != b.host:
        return False
    if a.gpu and b.gpu:
        return a.gpu == b.gpu
    return a.device == b.device


def unjoinable(a: RankChoice, b: RankChoice) -> str:
    """Why a channel between two ranks cannot use torch-p2p ("" when it can)."""
    if a.backend != TORCH_P2P or b.backend != TORCH_P2P:
        return f"one uses {a.backend if a.backend != TORCH_P2P else b.backend}"
    if a.flavour != b.flavour:
        return f"torch-p2p joins stages of one kind of device, not {a.flavour} with {b.flavour}"
    if a.flavour == NCCL and same_gpu(a, b):
        return f"NCCL cannot join two ranks on one GPU ({a.device} of {a.host}{', ' + a.gpu if a.gpu else ''})"
    return ""


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
    return Fit(True, f"torch-p2p: {why}", automatic=flavour == NCCL)


def _mpi_host_fits(devices: Sequence[torch.device], comm) -> Fit:
    if isinstance(comm, LoopbackPort):
        return Fit(False, "mpi-host: joins processes; the single-process replay uses loopback")
    on = ", ".join(sorted({d.type for d in devices})) or "no device (PS shard)"
    return Fit(True, f"mpi-host: pinned-host slots over MPI ({on})")


register("loopback", lambda port, pool, channels: port.hub.endpoint(port.rank, pool), _loopback_fits)
register(TORCH_P2P, TorchP2PTransport, _torch_p2p_fits)
register(MPI_HOST, lambda comm, pool, channels: MPITransport(comm, pool), _mpi_host_fits)
