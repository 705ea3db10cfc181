"""The schedule IR: typed, immutable instructions and the per-stage instruction streams.

A schedule is, for each stage of one virtual worker (VW), a static list of instructions. Each stage
executes its list in order; the weights every minibatch sees are therefore a function of the
schedule alone, never of timing. Minibatch ``mb`` belongs to wave ``mb // nm``.

Text form (round-trips through ``str`` and :func:`parse`)::

    F3      Fwd(3)          RA3:0   RecvAct(3, peer=0)      PUSH1   Push(1)
    B3      Bwd(3)          SA3:2   SendAct(3, peer=2)      PULL2   Pull(2)
    R3      Recompute(3)    RG3:2   RecvGrad(3, peer=2)
    A3      Apply(3)        SG3:0   SendGrad(3, peer=0)

The messages a run adds besides activations and gradients (:mod:`hetpipe.schedule.messages` inserts
them where the run's options need them)::

    ST3:2   SendTied(3, peer=2)     SN3:1   SendNorm(3, peer=1)     EVAL1   Eval(1)
    RT3:0   RecvTied(3, peer=0)     RN3:1   RecvNorm(3, peer=1)     SV1:0   SendVerdict(1, peer=0)
    DONE    Done()                                                  RV1:2   RecvVerdict(1, peer=2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Tuple, Union


@dataclass(frozen=True)
class Fwd:
    """Run the stage's forward pass on minibatch ``mb`` with the stage's current weights.

    The input comes from the preceding ``RecvAct(mb)`` (or the data loader on stage 0); the weight
    version used is stashed so that ``Bwd(mb)`` differentiates the same version.
    Pairs with: a later ``Bwd(mb)`` on the same stage.
    """

    mb: int
    code: ClassVar[str] = "F"

    def __str__(self) -> str:
        return f"F{self.mb}"


@dataclass(frozen=True)
class Bwd:
    """Back-propagate minibatch ``mb`` through the stage, with the weight version its ``Fwd`` used.

    The output gradient comes from the preceding ``RecvGrad(mb)`` (or the loss on the last stage).
    Pairs with: an earlier ``Fwd(mb)``; followed by ``Apply(mb)`` where the schedule updates weights.
    """

    mb: int
    code: ClassVar[str] = "B"

    def __str__(self) -> str:
        return f"B{self.mb}"


@dataclass(frozen=True)
class Recompute:
    """Re-run the forward of minibatch ``mb`` to rebuild activations that were dropped to save memory.

    Pairs with: an earlier ``Fwd(mb)`` that kept only its input, and the ``Bwd(mb)`` that follows.
    """

    mb: int
    code: ClassVar[str] = "R"

    def __str__(self) -> str:
        return f"R{self.mb}"


@dataclass(frozen=True)
class Apply:
    """Apply minibatch ``mb``'s gradients to the stage's local weights (one optimizer step).

    The change is added to the delta of wave ``mb // nm`` that the next ``Push`` of that wave sends.
    Pairs with: an earlier ``Bwd(mb)`` on the same stage.
    """

    mb: int
    code: ClassVar[str] = "A"

    def __str__(self) -> str:
        return f"A{self.mb}"


@dataclass(frozen=True)
class SendAct:
    """Send minibatch ``mb``'s output activation to stage ``peer`` (the next stage).

    Pairs with: ``RecvAct(mb, peer=this stage)`` on stage ``peer``.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "SA"

    def __str__(self) -> str:
        return f"SA{self.mb}:{self.peer}"


@dataclass(frozen=True)
class RecvAct:
    """Receive minibatch ``mb``'s input activation from stage ``peer`` (the previous stage).

    Pairs with: ``SendAct(mb, peer=this stage)`` on stage ``peer``.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "RA"

    def __str__(self) -> str:
        return f"RA{self.mb}:{self.peer}"


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient of minibatch ``mb``'s input activation to stage ``peer`` (the previous stage).

    Pairs with: ``RecvGrad(mb, peer=this stage)`` on stage ``peer``.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "SG"

    def __str__(self) -> str:
        return f"SG{self.mb}:{self.peer}"


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient of minibatch ``mb``'s output activation from stage ``peer`` (the next stage).

    Pairs with: ``SendGrad(mb, peer=this stage)`` on stage ``peer``.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "RG"

    def __str__(self) -> str:
        return f"RG{self.mb}:{self.peer}"


@dataclass(frozen=True)
class Push:
    """Send the sum of this stage's updates of wave ``wave`` to the parameter-server shards.

    Non-blocking for the stage: the transfer overlaps the instructions that follow. When every stage
    of the VW has pushed wave ``wave``, the VW's clock becomes ``wave + 1``.
    Pairs with: exactly one ``Push(wave)`` per stage per wave, after the stage's last ``Apply`` of it.
    """

    wave: int
    code: ClassVar[str] = "PUSH"

    def __str__(self) -> str:
        return f"PUSH{self.wave}"


@dataclass(frozen=True)
class Pull:
    """Wait until the global clock is at least ``wave - d``, then fetch the global weights.

    The stage's weights become the pulled global weights plus its own updates that they do not yet
    contain. Pairs with: the ``Push(wave - d - 1)`` of every VW, this stage's own among them, which
    therefore precedes it in this stream.
    """

    wave: int
    code: ClassVar[str] = "PULL"

    def __str__(self) -> str:
        return f"PULL{self.wave}"


@dataclass(frozen=True)
class SendTied:
    """Send micro-batch ``mb``'s gradients of the tied parameters this stage shares with stage ``peer``.

    Non-blocking for the stage: the message is queued and sent, in order, as pool slots free (the
    stage's DONE waits for the queue to drain). Comes after ``Bwd(mb)``, which made the gradients.
    Pairs with: ``RecvTied(mb, peer=this stage)`` on stage ``peer``, in the same order.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "ST"

    def __str__(self) -> str:
        return f"ST{self.mb}:{self.peer}"


@dataclass(frozen=True)
class RecvTied:
    """Receive stage ``peer``'s gradients of the tied parameters of micro-batch ``mb``, which the
    ``Apply`` of ``mb``'s minibatch adds to this stage's (every holder sums them in stage order).

    Pairs with: ``SendTied(mb, peer=this stage)`` on stage ``peer``, in the same order.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "RT"

    def __str__(self) -> str:
        return f"RT{self.mb}:{self.peer}"


@dataclass(frozen=True)
class SendNorm:
    """Send stage ``peer`` this stage's share of the squared gradient norm of the minibatch whose
    ``Apply(mb)`` follows (``mb``: that Apply's micro-batch); the minibatch's gradients are gathered
    first, once. Header-only (the share's float64 bits ride in a header word).

    Pairs with: ``RecvNorm(mb, peer=this stage)`` on stage ``peer``, in the same order.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "SN"

    def __str__(self) -> str:
        return f"SN{self.mb}:{self.peer}"


@dataclass(frozen=True)
class RecvNorm:
    """Receive stage ``peer``'s share of the squared gradient norm for the ``Apply(mb)`` that follows,
    which sums every stage's share in stage order (clipping, fp16's overflow verdict).

    Pairs with: ``SendNorm(mb, peer=this stage)`` on stage ``peer``, in the same order.
    """

    mb: int
    peer: int
    code: ClassVar[str] = "RN"

    def __str__(self) -> str:
        return f"RN{self.mb}:{self.peer}"


@dataclass(frozen=True)
class Eval:
    """VW 0's evaluation point after ``Push(wave)``: a forward-only pass over the evaluation data on the
    live weights, pipelined: each evaluation minibatch's input comes from stage ``s - 1`` (EVAL
    messages; the data on stage 0) and its output goes to stage ``s + 1``; the last stage scores it and
    decides whether the run stops.

    Pairs with: ``Eval(wave)`` on every other stage (the EVAL stream between neighbours), then the
    verdict: ``SendVerdict(wave, s)`` on the last stage and ``RecvVerdict(wave, last)`` on stage ``s``.
    """

    wave: int
    code: ClassVar[str] = "EVAL"

    def __str__(self) -> str:
        return f"EVAL{self.wave}"


@dataclass(frozen=True)
class SendVerdict:
    """Last stage: send stage ``peer`` the outcome of the evaluation point after wave ``wave`` (the
    wave after which the run stops, or none). Header-only, never blocks.

    Pairs with: ``RecvVerdict(wave, peer=this stage)`` on stage ``peer``, in the same order.
    """

    wave: int
    peer: int
    code: ClassVar[str] = "SV"

    def __str__(self) -> str:
        return f"SV{self.wave}:{self.peer}"


@dataclass(frozen=True)
class RecvVerdict:
    """Receive the outcome of the evaluation point after wave ``wave`` from the last stage ``peer``;
    a stop ends this stage's stream after the wave it names.

    Pairs with: ``SendVerdict(wave, peer=this stage)`` on stage ``peer``, in the same order.
    """

    wave: int
    peer: int
    code: ClassVar[str] = "RV"

    def __str__(self) -> str:
        return f"RV{self.wave}:{self.peer}"


@dataclass(frozen=True)
class Done:
    """Tell every PS shard that this stage finished its stream, with the number of pushes it sent each
    (DONE messages); runs once the stage's device copies and queued tied gradients are out.

    Pairs with: the last instruction of the stream; every shard counts one DONE per stage.
    """

    code: ClassVar[str] = "DONE"

    def __str__(self) -> str:
        return "DONE"


Instr = Union[Fwd, Bwd, Recompute, Apply, SendAct, RecvAct, SendGrad, RecvGrad, Push, Pull,
              SendTied, RecvTied, SendNorm, RecvNorm, Eval, SendVerdict, RecvVerdict, Done]
COMPUTE = (Fwd, Bwd, Recompute, Apply)
COMMS = (SendAct, RecvAct, SendGrad, RecvGrad)
SYNC = (Push, Pull)
# The run's messages besides activations, gradients and the PS's pushes and pulls.
MESSAGES = (SendTied, RecvTied, SendNorm, RecvNorm, Eval, SendVerdict, RecvVerdict, Done)
_PEERED = (*COMMS, SendTied, RecvTied, SendNorm, RecvNorm, SendVerdict, RecvVerdict)

_BY_CODE = {cls.code: cls for cls in (*COMPUTE, *COMMS, *SYNC, *MESSAGES)}
_TOKEN = re.compile(r"^(PUSH|PULL|EVAL|SA|RA|SG|RG|ST|RT|SN|RN|SV|RV|F|B|R|A)(\d+)(?::(\d+))?$")


def parse(text: str) -> Instr:
    """Parse one instruction from its text form, e.g. ``"SA3:1"`` → ``SendAct(3, peer=1)``."""
    if text.strip() == "DONE":
        return Done()
    m = _TOKEN.match(text.strip())
    if not m:
        raise ValueError(f"not an instruction: {text!r} (expected e.g. F3, B3, SA3:1, PUSH0, PULL1)")
    code, num, peer = m.group(1), int(m.group(2)), m.group(3)
    cls = _BY_CODE[code]
    takes_peer = cls in _PEERED
    if takes_peer != (peer is not None):
        raise ValueError(f"instruction {text!r}: {cls.__name__} {'needs' if takes_peer else 'takes no'} ':peer'")
    return cls(num, int(peer)) if takes_peer else cls(num)


def parse_stream(text: str) -> Tuple[Instr, ...]:
    """Parse a whitespace-separated instruction stream."""
    return tuple(parse(tok) for tok in text.split())


@dataclass(frozen=True)
class Schedule:
    """Instruction streams for the ``num_stages`` stages of one virtual worker.

    ``streams[s]`` is stage ``s``'s instruction list. ``nm`` is the number of minibatches allowed in
    flight (and the wave size), ``d`` the WSP staleness bound the Pull placement honours.

    Micro-batches: instructions name micro-batches. Normally micro-batch ``j`` is minibatch ``j``.
    With ``split = n`` (AutoPipe-H's split start-up) each of the first ``n`` minibatches runs as two
    half micro-batches: micro-batches ``2p`` and ``2p + 1`` are the halves of minibatch ``p < n`` and
    micro-batch ``j >= 2n`` is minibatch ``j - n``. A split minibatch's ``Apply`` names its second
    half and applies the gradients of both.
    """

    name: str
    num_stages: int
    num_minibatches: int
    nm: int
    d: int
    streams: Tuple[Tuple[Instr, ...], ...]
    split: int = 0

    def __post_init__(self) -> None:
        if len(self.streams) != self.num_stages:
            raise ValueError(f"schedule {self.name!r}: {len(self.streams)} streams for {self.num_stages} stages")
        if self.nm < 1:
            raise ValueError(f"schedule {self.name!r}: nm must be >= 1, got {self.nm}")
        if self.d < 0:
            raise ValueError(f"schedule {self.name!r}: d must be >= 0, got {self.d}")
        if not 0 <= self.split <= self.num_minibatches:
            raise ValueError(f"schedule {self.name!r}: split must be in [0, {self.num_minibatches}], got {self.split}")

    @property
    def num_micro(self) -> int:
        """Number of micro-batches the instructions name (``num_minibatches + split``)."""
        return self.num_minibatches + self.split

    def minibatch_of(self, mb: int) -> int:
        """The minibatch that micro-batch ``mb`` belongs to."""
        return mb // 2 if mb < 2 * self.split else mb - self.split

    def micros_of(self, p: int) -> Tuple[int, ...]:
        """The micro-batches of minibatch ``p``, in order."""
        return (2 * p, 2 * p + 1) if p < self.split else (p + self.split,)

    def fraction_of(self, mb: int) -> float:
        """The share of its minibatch that micro-batch ``mb`` carries (0.5 for a half, else 1)."""
        return 0.5 if mb < 2 * self.split else 1.0

    def wave_of(self, mb: int) -> int:
        """The wave of micro-batch ``mb``."""
        return self.minibatch_of(mb) // self.nm

    def last_micro_of_wave(self, wave: int) -> int:
        """The last micro-batch of wave ``wave``."""
        return self.micros_of(min((wave + 1) * self.nm, self.num_minibatches) - 1)[-1]

    def first_micro_of_wave(self, wave: int) -> int:
        """The first micro-batch of wave ``wave``."""
        return self.micros_of(wave * self.nm)[0]

    @property
    def num_waves(self) -> int:
        return -(-self.num_minibatches // self.nm)

    def to_text(self) -> str:
        """One header line, then one line per stage: ``<stage>: <instr> <instr> ...``."""
        head = f"# {self.name} stages={self.num_stages} minibatches={self.num_minibatches} nm={self.nm} d={self.d}"
        if self.split:
            head += f" split={self.split}"
        body = [f"{s}: " + " ".join(map(str, stream)) for s, stream in enumerate(self.streams)]
        return "\n".join([head, *body]) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines or not lines[0].startswith("# "):
            raise ValueError("schedule text must start with a '# <name> stages=.. minibatches=.. nm=.. d=..' line")
        name, *fields = lines[0][2:].split()
        kv = dict(f.split("=", 1) for f in fields)
        streams = []
        for s, ln in enumerate(lines[1:]):
            label, _, rest = ln.partition(":")
            if label.strip() != str(s):
                raise ValueError(f"schedule text line {s + 2}: expected stage {s}, got {label.strip()!r}")
            streams.append(parse_stream(rest))
        return cls(name, int(kv["stages"]), int(kv["minibatches"]), int(kv["nm"]), int(kv["d"]), tuple(streams),
                   int(kv.get("split", 0)))
