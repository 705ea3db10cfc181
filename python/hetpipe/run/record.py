"""Run records: what timing decided in a WSP run, so that a single-process replay reproduces it bitwise.

With ``D >= 1`` a run's numbers depend on timing in exactly one way: the version ``g`` of the global
weights each pull gets (every wave ``< g`` applied; any ``g`` with ``w - D <= g <= w`` is allowed at
wave ``w``). A stage's instruction order is fixed by its schedule, and a shard applies a wave's
pushes as one unit once the global clock passes it, in an order it logs. A record keeps, per PS
shard, the order it applied pushes ``(vw, stage)`` wave by wave, and the ``g`` of every pull it
answered (with the pulling VW's clock then, as evidence of the staleness reached); it also keeps
the clock changes and digests of the initial weights and of the outcome.

Replaying (:class:`ShardScript`, installed as the shard's gate, :mod:`hetpipe.ps.gate`): a shard answers a pull when its
weights are at the recorded version, holds back wave ``c`` while a pull recorded at version ``c`` is
unanswered, and applies each wave in the recorded order (BatchNorm buffers averaged in that VW
order too). The shard's own staleness gate and apply order are then not consulted. Why this suffices
and cannot deadlock: docs/design.md, "Run records and the replay".

File format (JSON, written once by rank 0 from the shard logs every rank gathers at the end)::

    {"format": "hetpipe-wsp-record", "version": 1,
     "run": {"nm", "d", "aggregate", ["outer": {outer, outer_lr, outer_momentum, outer_staleness, [outer_gain,
             outer_delay, each when not its default]}, when not the plain rule], "seed",
             "vws": [[[start, stop] per stage] per VW],
             "shards": [[layers] per shard], "minibatches": [per VW], "split": [per VW],
             "weights_crc32": crc of the initial global weights},
     "shards": [{"shard": k, "applied": [[[vw, stage], ...] per wave],
                 "pulls": [[vw, stage, wave, g, clock_vw], ...] in answer order,
                 "clocks": [[vw, clock_vw, global], ...] after each change}],
     "outcome": {"weights_crc32", "losses_crc32"}}
"""

from __future__ import annotations

import collections
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

import numpy as np

from hetpipe.plan.outer import is_plain, recorded_outer
from hetpipe.ps.shard import ShardLog, ShardState
from hetpipe.run.spec import Outcome, RunSpec
from hetpipe.util.errors import HetpipeError
from hetpipe.util.outputs import write_file

FORMAT = "hetpipe-wsp-record"
VERSION = 1
PullKey = Tuple[int, int, int]          # (vw, stage, wave)


class RecordMismatch(HetpipeError, ValueError):
    """A record that does not belong to this run, or that the replay cannot follow; names the field."""


def run_identity(spec: RunSpec) -> Dict[str, Any]:
    """What a record must agree on with the run replaying it (plan, schedules, seed, initial weights)."""
    plan = spec.plan
    # The outer optimizer only where it is not the plain rule, and its later fields only where they are not
    # their defaults: records written before them stay as they were.
    outer = {} if is_plain(plan.outer_options) else {"outer": recorded_outer(plan.outer_options)}
    # Each VW's wave only where they differ: records of equal waves stay as they were.
    waves = {} if plan.equal_waves else {"waves": list(plan.wave_minibatches)}
    return {
        "nm": plan.nm, "d": plan.d, "aggregate": plan.aggregate, **outer, **waves, "seed": spec.seed,
        "vws": [[[st.start, st.stop] for st in vw.stages] for vw in plan.virtual_workers],
        "shards": [list(sh.layers) for sh in plan.ps_shards],
        "minibatches": [s.num_minibatches for s in spec.schedules],
        "split": [s.split for s in spec.schedules],
        "weights_crc32": weights_crc32({l: spec.layout.flat(l) for l in range(plan.num_layers)}),
    }


def weights_crc32(weights: Mapping[int, np.ndarray]) -> int:
    """CRC-32 of per-layer float32 weights, in layer order (a bitwise fingerprint)."""
    crc = 0
    for l in sorted(weights):
        crc = zlib.crc32(np.ascontiguousarray(weights[l], dtype=np.float32).tobytes(), crc)
    return crc


def losses_crc32(losses: Mapping[int, Mapping[int, float]]) -> int:
    """CRC-32 of every VW's losses (float64, VW then minibatch order)."""
    flat = [losses[vw][p] for vw in sorted(losses) for p in sorted(losses[vw])]
    return zlib.crc32(np.asarray(flat, dtype=np.float64).tobytes())


@dataclass
class ShardRecord:
    """One shard's part of a record."""

    shard: int
    applied: List[List[Tuple[int, int]]]                     # per wave: (vw, stage) in applied order
    pulls: List[Tuple[int, int, int, int, int]]              # (vw, stage, wave, g, clock_vw), answer order
    clocks: List[Tuple[int, int, int]] = field(default_factory=list)   # (vw, clock_vw, global)

    @classmethod
    def from_log(cls, shard: int, log: ShardLog) -> "ShardRecord":
        applied: List[List[Tuple[int, int]]] = []
        for vw, stage, wave in log.applied:
            if wave == len(applied):
                applied.append([])
            applied[wave].append((vw, stage))
        pulls = [(*p, c) for p, c in zip(log.pulls, log.pull_clocks)]
        return cls(shard, applied, pulls, list(log.clocks))

    def to_dict(self) -> Dict[str, Any]:
        return {"shard": self.shard, "applied": [[list(p) for p in wave] for wave in self.applied],
                "pulls": [list(p) for p in self.pulls], "clocks": [list(c) for c in self.clocks]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "ShardRecord":
        try:
            return cls(int(d["shard"]), [[(int(v), int(s)) for v, s in wave] for wave in d["applied"]],
                       [tuple(int(x) for x in p) for p in d["pulls"]],  # type: ignore[misc]
                       [tuple(int(x) for x in c) for c in d.get("clocks", [])])  # type: ignore[misc]
        except (KeyError, TypeError, ValueError) as e:
            raise RecordMismatch(f"{where}: malformed shard entry ({type(e).__name__}: {e})") from None


@dataclass
class RunRecord:
    """A run's record: its identity and, per shard, the apply order and the version of every pull."""

    run: Dict[str, Any]
    shards: Dict[int, ShardRecord]
    outcome: Dict[str, int] = field(default_factory=dict)
    where: str = "record"                                    # the file it came from, for messages

    @classmethod
    def of_run(cls, spec: RunSpec, outcome: Outcome) -> "RunRecord":
        """The record of a finished run, from its merged outcome (the shards' logs, losses, final
        weights); call it before the final weights are loaded into the model (its initial weights are
        part of the run's identity)."""
        shards = {k: ShardRecord.from_log(k, log) for k, log in sorted(outcome.shard_logs.items())}
        return cls(run_identity(spec), shards,
                   {"weights_crc32": weights_crc32(outcome.weights), "losses_crc32": losses_crc32(outcome.losses)})

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "run": self.run,
                           "shards": [self.shards[k].to_dict() for k in sorted(self.shards)],
                           "outcome": self.outcome}, separators=(",", ":"))

    def save(self, path: Union[str, Path]) -> None:
        """Write the record whole or not at all (a scratch file renamed over ``path``)."""
        text = self.to_json()
        write_file("record", path, lambda scratch: scratch.write_text(text))

    @classmethod
    def load(cls, path: Union[str, Path]) -> "RunRecord":
        where = f"record {path}"
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise RecordMismatch(f"{where}: cannot read: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise RecordMismatch(f"{where}: not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise RecordMismatch(f"{where}: not a hetpipe WSP record (field 'format' should be {FORMAT!r})")
        if d.get("version") != VERSION:
            raise RecordMismatch(f"{where}: version {d.get('version')!r}, this hetpipe reads version {VERSION}")
        shards = [ShardRecord.from_dict(s, where) for s in d.get("shards", [])]
        return cls(dict(d.get("run", {})), {s.shard: s for s in shards}, dict(d.get("outcome", {})), where)

    def check(self, spec: RunSpec) -> None:
        """Raise :class:`RecordMismatch` naming the first field where this record and ``spec`` differ."""
        mine = run_identity(spec)
        # "outer" (the plain rule) and "waves" (equal waves) may be absent on either side: compared either way,
        # so neither side's is ignored, and named before the fields that follow from them.
        keys = [k for k in mine if k not in ("outer", "waves")]
        at = keys.index("aggregate") + 1
        for key in keys[:at] + ["outer", "waves"] + keys[at:]:
            got, want = self.run.get(key), mine.get(key)
            if got != want:
                what = ("the model's initial weights differ (another seed or model?)" if key == "weights_crc32"
                        else f"the record has {got!r}, this run {want!r}")
                raise RecordMismatch(f"{self.where} is of another run: field 'run.{key}': {what}")
        if sorted(self.shards) != list(range(len(spec.plan.ps_shards))):
            raise RecordMismatch(f"{self.where}: holds PS shards {sorted(self.shards)}, the plan has "
                                 f"{len(spec.plan.ps_shards)}")

    def matches(self, losses: Mapping[int, Mapping[int, float]], weights: Mapping[int, np.ndarray]) -> bool:
        """Whether ``losses`` and final ``weights`` are bitwise the recorded run's."""
        return self.outcome == {"weights_crc32": weights_crc32(weights), "losses_crc32": losses_crc32(losses)}

    def staleness(self) -> Dict[int, int]:
        """How many pulls (over every shard) got a version ``s = w - g`` waves old, by ``s`` (a histogram)."""
        out: Dict[int, int] = collections.Counter(w - g for sh in self.shards.values() for _, _, w, g, _ in sh.pulls)
        return dict(sorted(out.items()))

    def max_gap(self) -> int:
        """The largest ``clock_vw - global`` any shard saw (the staleness the run reached)."""
        return max((cv - g for s in self.shards.values() for _, cv, g in s.clocks), default=0)


class ShardScript:
    """A shard's part of a record as the replaying shard's :class:`~hetpipe.ps.gate.Gate` (one thread)."""

    def __init__(self, record: ShardRecord, state: ShardState, where: str) -> None:
        self.index, self.where = state.index, where
        expected = sorted(state.apply_order())
        for c, order in enumerate(record.applied):
            if sorted(order) != expected:
                raise RecordMismatch(f"{where}: PS shard {self.index} wave {c} applied pushes {order}, but the "
                                     f"shard receives {expected} per wave")
        self.applied = record.applied
        self.version: Dict[PullKey, int] = {}
        for vw, stage, wave, g, _ in record.pulls:
            if (vw, stage, wave) in self.version:
                raise RecordMismatch(f"{where}: PS shard {self.index} answered the pull of wave {wave} by VW {vw} "
                                     f"stage {stage} twice")
            if not 0 <= g <= len(record.applied):
                raise RecordMismatch(f"{where}: PS shard {self.index} gave the pull of wave {wave} by VW {vw} "
                                     f"stage {stage} version {g}, outside 0..{len(record.applied)}")
            self.version[(vw, stage, wave)] = g
        self.unanswered: Dict[int, List[PullKey]] = collections.defaultdict(list)   # version -> pulls
        for key, g in self.version.items():
            self.unanswered[g].append(key)

    def order(self, wave: int, default: Sequence[Tuple[int, int]]) -> Sequence[Tuple[int, int]]:
        if wave >= len(self.applied):
            raise RecordMismatch(f"{self.where}: PS shard {self.index} applied {len(self.applied)} waves in the "
                                 f"recorded run; the replay reached wave {wave}")
        return self.applied[wave]

    def holds(self, wave: int) -> bool:
        """Whether wave ``wave`` must wait: a pull recorded at version ``wave`` is not answered yet."""
        return bool(self.unanswered.get(wave))

    def due(self, vw: int, stage: int, wave: int, applied: int, global_clock: int, d: int) -> bool:
        """Whether the pull may be answered now, the shard's weights being at version ``applied`` (the
        recorded version decides; the clock and D bounded it in the recorded run)."""
        g = self.version.get((vw, stage, wave))
        if g is None:
            raise RecordMismatch(f"{self.where}: PS shard {self.index} never answered a pull of wave {wave} by "
                                 f"VW {vw} stage {stage} in the recorded run")
        if g < applied:
            raise RecordMismatch(f"{self.where}: PS shard {self.index} must answer the pull of wave {wave} by VW "
                                 f"{vw} stage {stage} at version {g}, but its weights are already at {applied}")
        return g == applied

    def served(self, vw: int, stage: int, wave: int) -> None:
        self.unanswered[self.version[(vw, stage, wave)]].remove((vw, stage, wave))

    def waiting(self, applied: int) -> str:
        """What the shard waits for under the record (for deadlock messages)."""
        held = self.unanswered.get(applied)
        if not held:
            return f"following the record at version {applied}"
        return (f"following the record: wave {applied} is held until the pull(s) recorded at version {applied} "
                f"arrive: {', '.join(f'VW {v} stage {s} wave {w}' for v, s, w in held)}")

    def check_done(self, state: ShardState) -> None:
        """After the replay: every recorded pull answered, every recorded wave applied."""
        left = [k for keys in self.unanswered.values() for k in keys]
        if left:
            raise RecordMismatch(f"{self.where}: PS shard {self.index} answered pulls in the recorded run that "
                                 f"the replay never made: {left}")
        if state.applied != len(self.applied):
            raise RecordMismatch(f"{self.where}: PS shard {self.index} applied {len(self.applied)} waves in the "
                                 f"recorded run, {state.applied} in the replay")
