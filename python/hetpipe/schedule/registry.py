"""The schedule registry: every schedule by name, with one generator signature and its cost hooks.

A schedule is registered once (:func:`register`) with a :class:`ScheduleSpec`: its name, a generator
taking one :class:`ScheduleOptions` and returning a lowered :class:`~hetpipe.schedule.ir.Schedule`,
the options it honours, whether it talks to the parameter servers, and its closed-form wave time for
the cost model. The trainer, the simulator, the cost model, the command line and the benchmarks look
schedules up here by name, so adding one is a single :func:`register` call in the module that defines
its generator. The built-in schedules (``hetpipe``, ``gpipe``, ``1f1b``) register in
:mod:`hetpipe.schedule.generators`.

A generator only orders computation, transfers between neighbours and the PS's pushes and pulls. The
run's other messages (tied gradients, norm shares, evaluation points, DONE) depend on the run, not on
the schedule: when ``ScheduleOptions.messages`` asks for them, :func:`generate` inserts them into
whatever the generator returned with one shared pass (:func:`hetpipe.schedule.messages.with_messages`),
so every registered schedule carries them the same way and none has to know of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from hetpipe.schedule.ir import Schedule
from hetpipe.schedule.messages import MessageOptions, with_messages


@dataclass(frozen=True)
class ScheduleOptions:
    """What a generator is asked for: one VW of ``stages`` stages training ``minibatches`` minibatches.

    ``nm``: minibatches in flight (the wave size); ``d``: the WSP staleness bound; ``recompute``:
    rebuild activations before each backward; ``split_startup``: run the first ``split_startup``
    minibatches as two half micro-batches (AutoPipe-H). The defaults ask for nothing: a schedule that
    does not honour an option accepts only its default. ``messages``: the run's messages besides
    activations and gradients, inserted into every schedule alike (None: none, not even DONE; the
    streams a runtime executes always have them).
    """

    stages: int
    minibatches: int
    nm: int = 1
    d: int = 0
    recompute: bool = False
    split_startup: int = 0
    messages: Optional[MessageOptions] = None

    def __post_init__(self) -> None:
        if self.messages is not None:
            if not isinstance(self.messages, MessageOptions):
                raise ValueError(f"schedule options: messages must be a MessageOptions, got {self.messages!r}")
            self.messages.check(self.stages)
        for f in fields(self):
            if f.name == "messages":
                continue
            v, flag = getattr(self, f.name), f.name == "recompute"
            if not (isinstance(v, bool) if flag else isinstance(v, int) and not isinstance(v, bool)):
                raise ValueError(f"schedule options: {f.name} must be {'a bool' if flag else 'an int'}, got {v!r}")
        for name, lo in (("stages", 1), ("minibatches", 1), ("nm", 1), ("d", 0), ("split_startup", 0)):
            if getattr(self, name) < lo:
                raise ValueError(f"schedule options: {name} must be >= {lo}, got {getattr(self, name)}")
        if self.split_startup > self.minibatches:
            raise ValueError(f"schedule options: split_startup {self.split_startup} exceeds the "
                             f"{self.minibatches} minibatches")


# Options every generator takes (``messages`` by the shared pass); the others a spec lists in ``takes``
# or refuses unless at default.
_ALWAYS = frozenset({"stages", "minibatches", "messages"})
_DEFAULTS = {f.name: f.default for f in fields(ScheduleOptions) if f.name not in _ALWAYS}

# ``wave_time(bottleneck, round_trip, sync, options)``: seconds per wave of one VW (see
# :mod:`hetpipe.plan.cost`); ``bottleneck`` the slowest stage's compute + transfer per minibatch,
# ``round_trip`` one minibatch through every stage and back, ``sync`` the PS push + pull per wave.
# A single-wave schedule (gpipe, 1f1b) flushes ``options.minibatches`` per wave; a WSP one ``nm``.
WaveTime = Callable[[float, float, float, ScheduleOptions], float]


@dataclass(frozen=True)
class ScheduleSpec:
    """One registered schedule.

    ``generate(options)`` returns the lowered schedule (sends and receives inserted). ``takes``: the
    options beyond ``stages``/``minibatches`` it honours; any other option away from its default is
    refused by :meth:`options_error`. ``syncs``: its streams carry Push/Pull (the VW exchanges
    weights with the parameter servers), so the simulator models PS traffic for it. ``wave_time``:
    the cost model's closed form for one wave (:data:`WaveTime`).
    ``summary``: one line for ``--help`` and error messages.
    """

    name: str
    generate: Callable[[ScheduleOptions], Schedule]
    takes: FrozenSet[str]
    syncs: bool
    wave_time: WaveTime
    summary: str

    def options_error(self, options: ScheduleOptions) -> str:
        """Why ``options`` do not suit this schedule ("" when they do)."""
        for name in sorted(set(_DEFAULTS) - self.takes):
            value = getattr(options, name)
            if value != _DEFAULTS[name]:
                return (f"schedule {self.name!r} does not take option {name} (got {value!r}; it only runs with "
                        f"{name} = {_DEFAULTS[name]!r}): {self.summary}")
        return ""


_REGISTRY: Dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add ``spec`` under ``spec.name``; a name already taken, or an unknown option in ``takes``, is an error."""
    if not spec.name or spec.name != spec.name.strip() or " " in spec.name:
        raise ValueError(f"register: schedule name {spec.name!r} must be one word")
    if spec.name in _REGISTRY:
        raise ValueError(f"register: schedule {spec.name!r} is already registered")
    unknown = set(spec.takes) - set(_DEFAULTS)
    if unknown:
        raise ValueError(f"register: schedule {spec.name!r} takes unknown option(s) {sorted(unknown)}; "
                         f"options are {sorted(_DEFAULTS)}")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove schedule ``name`` (for tests that register their own)."""
    get_schedule(name)
    del _REGISTRY[name]


def schedule_names() -> Tuple[str, ...]:
    """The registered schedule names, sorted."""
    return tuple(sorted(_REGISTRY))


def get_schedule(name: str) -> ScheduleSpec:
    """The spec registered as ``name``; an unknown name is a ValueError listing the registered ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r} (registered: {', '.join(schedule_names())})")
    return spec


def generate(name: str, options: ScheduleOptions) -> Schedule:
    """The lowered schedule ``name`` builds for ``options``, with the run's messages inserted when
    ``options.messages`` asks for them; options it does not honour must be at their defaults
    (ValueError naming the option otherwise)."""
    spec = get_schedule(name)
    why = spec.options_error(options)
    if why:
        raise ValueError(why)
    schedule = spec.generate(options)
    return schedule if options.messages is None else with_messages(schedule, options.messages)
