"""ShardPlane (the PS shard's data plane in the core) against the Python shard, ShardState of
hetpipe.ps.shard: the same pushes and pulls give bit-identical weights, clocks and pull replies,
sequentially and with one thread per stage pushing and pulling at once (GIL released), under the
plain rule and under every outer optimizer (hetpipe.plan.outer: nesterov, delayed nesterov, an outer lr, the
staleness decays, the sqrt gain), and with VWs' waves of unequal length (deltas weighed by their samples)."""

import random
import threading

import numpy as np
import pytest

from hetpipe.ps.shard import ShardLog, ShardState
from hetpipe.run.record import ShardRecord, ShardScript
from hetpipe_core import ShardPlane

# The shard owns model layers 1, 4 and 5 (plane indices 0, 1, 2); VW 0 has 2 stages, VW 1 has 3.
LAYERS = {1: 3000, 4: 1100, 5: 70}
CUTS = [[(0, 3), (3, 6)], [(0, 2), (2, 5), (5, 6)]]


def _plane_layout():
    order = sorted(LAYERS)
    stage_layers = [[[order.index(l) for l in order if a <= l < b] for (a, b) in vw] for vw in CUTS]
    return [LAYERS[l] for l in order], stage_layers


def _pair(d: int, threads: int = 1, **options):
    rng = np.random.default_rng(0)
    init = {l: rng.standard_normal(n).astype(np.float32) for l, n in LAYERS.items()}
    ref = ShardState(0, init, CUTS, d, **options)
    numels, stage_layers = _plane_layout()
    plane = ShardPlane(numels, stage_layers, d, threads, **options)
    for i, l in enumerate(sorted(LAYERS)):
        plane.weights(i)[:] = init[l]
    return ref, plane


def _stages(ref: ShardState):
    return [(vw, s) for vw in range(ref.num_vws) for s in sorted(ref.stage_layers[vw])]


def _delta(vw: int, stage: int, wave: int, n: int) -> np.ndarray:
    return np.random.default_rng(1000 * vw + 100 * stage + wave).standard_normal(n).astype(np.float32) * 0.01


def _assert_same_weights(ref: ShardState, plane: ShardPlane):
    delayed = ref.outer_options["outer"] == "delayed-nesterov"
    for i, l in enumerate(sorted(LAYERS)):
        assert np.array_equal(plane.weights(i), ref.W[l]), f"layer {l}"
        assert np.array_equal(plane.momentum(i), ref.M[l]), f"layer {l}"
        if delayed:
            assert np.array_equal(plane.aggregated(i), ref.A[l]), f"layer {l}"
        assert plane.outer_count(i) == ref.outer_counts()[l], f"layer {l}"


# The outer optimizers the plane must compute as the Python shard does (hetpipe.plan.outer).
OUTERS = {
    "nesterov-mean": dict(aggregate="mean", outer="nesterov", outer_lr=0.7, outer_momentum=0.9),
    "nesterov-sum-inverse": dict(aggregate="sum", outer="nesterov", outer_lr=1.3, outer_momentum=0.5,
                                 outer_staleness="inverse"),
    "sgd-lr-inverse": dict(aggregate="mean", outer="sgd", outer_lr=0.6, outer_staleness="inverse"),
    "plain-inverse": dict(aggregate="mean", outer_staleness="inverse"),
    "sgd-sqrt-gain-sqrt-staleness": dict(aggregate="mean", outer_gain="sqrt", outer_staleness="sqrt"),
    "delayed-nesterov-mean": dict(aggregate="mean", outer="delayed-nesterov", outer_lr=0.7, outer_momentum=0.9),
    # 2 VWs, a momentum step every 3 pushes: the windows straddle waves (A is non-zero at wave boundaries).
    "delayed-nesterov-delay3-sqrt": dict(aggregate="sum", outer="delayed-nesterov", outer_lr=0.8, outer_momentum=0.6,
                                         outer_delay=3, outer_gain="sqrt", outer_staleness="sqrt"),
    # Waves of unequal length: each VW's delta divided by S / n_v (10 / 3 is inexact in float32).
    "mean-waves-3-7": dict(aggregate="mean", wave_minibatches=[3, 7]),
    "nesterov-mean-waves-inverse": dict(aggregate="mean", outer="nesterov", outer_lr=0.7, outer_momentum=0.9,
                                        outer_staleness="inverse", wave_minibatches=[5, 2]),
}


def _ref_pull(ref: ShardState, vw: int, stage: int, wave: int) -> int:
    """The Python shard answers the pull now (the staleness bound allows it), logging its version."""
    ref.pull(None, vw, stage, wave)
    ready = ref.ready_pulls()
    assert [q[1:] for q in ready] == [(vw, stage, wave)]
    ref.answered(ready)
    return ref.log.pulls[-1][3]


def _run_stage_threads(plane, stages, waves: int, d=None) -> None:
    """One thread per stage pulls then pushes each wave on ``plane`` (with ``d``: checking that every
    pull got a version within the staleness bound); a failure in any thread fails the test."""
    errors = []

    def stage_thread(vw: int, stage: int) -> None:
        try:
            out = np.empty(plane.stage_numel(vw, stage), np.float32)
            for w in range(waves):
                g = plane.pull(vw, stage, w, out, timeout=30)
                assert d is None or g >= w - d, (vw, stage, w, g)
                plane.push(vw, stage, w, _delta(vw, stage, w, out.size))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=stage_thread, args=k) for k in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("d", [0, 1, 2])
def test_random_interleaving_matches_python_shard(d):
    ref, plane = _pair(d)
    stages = _stages(ref)
    next_wave = {k: 0 for k in stages}
    rnd = random.Random(d)
    waves = 12
    while any(w < waves for w in next_wave.values()):
        # A stage may push wave w once its pull of w was answered: w - D <= global clock.
        ready = [k for k, w in next_wave.items() if w < waves and w - d <= ref.global_clock]
        vw, stage = rnd.choice(ready)
        w = next_wave[(vw, stage)]
        n = ref.stage_numel(vw, stage)
        got, want = np.empty(n, np.float32), np.empty(n, np.float32)
        g = plane.pull(vw, stage, w, got, timeout=5)
        ref.snapshot_into(vw, stage, want)
        assert g == ref.global_clock and np.array_equal(got, want)
        delta = _delta(vw, stage, w, n)
        ref.push(vw, stage, w, delta)
        plane.push(vw, stage, w, delta)
        assert plane.applied == ref.applied and plane.clock(vw) == int(ref.clock.clock(vw))
        next_wave[(vw, stage)] += 1
    assert plane.applied == waves
    _assert_same_weights(ref, plane)


@pytest.mark.parametrize("d", [0, 2])
@pytest.mark.parametrize("options", list(OUTERS.values()), ids=list(OUTERS))
def test_outer_optimizers_match_python_shard(d, options):
    ref, plane = _pair(d, **options)
    stages = _stages(ref)
    next_wave = {k: 0 for k in stages}
    rnd = random.Random(10 + d)
    waves = 10
    while any(w < waves for w in next_wave.values()):
        ready = [k for k, w in next_wave.items() if w < waves and w - d <= ref.global_clock]
        vw, stage = rnd.choice(ready)
        w = next_wave[(vw, stage)]
        n = ref.stage_numel(vw, stage)
        got = np.empty(n, np.float32)
        assert plane.pull(vw, stage, w, got, timeout=5) == _ref_pull(ref, vw, stage, w)
        delta = _delta(vw, stage, w, n)
        ref.push(vw, stage, w, delta)
        plane.push(vw, stage, w, delta)
        next_wave[(vw, stage)] += 1
    assert plane.applied == ref.applied == waves
    if d:
        assert any(g < w for _, _, w, g in ref.log.pulls), "no pull lagged: the staleness scale went untested"
    _assert_same_weights(ref, plane)


def _follow(ref: ShardState, plane: ShardPlane, waves: int) -> None:
    """Drive the Python shard through what the plane did: each pull answered at the version the plane's
    got, each wave applied in the plane's order (a run record's gate, hetpipe.run.record)."""
    got = plane.log()
    log = ShardLog(pushes=[tuple(p) for p in got["pushes"]], clocks=[tuple(c) for c in got["clocks"]],
                   pulls=[tuple(p) for p in got["pulls"]], pull_clocks=list(got["pull_clocks"]),
                   applied=[tuple(a) for a in got["applied"]])
    ref.gate = ShardScript(ShardRecord.from_log(0, log), ref, "the plane's log")
    state = {k: (0, "pull") for k in _stages(ref)}
    while any(w < waves for w, _ in state.values()):
        for (vw, stage), (w, what) in list(state.items()):
            if w < waves and what == "pull":
                ref.pull(None, vw, stage, w)
                state[(vw, stage)] = (w, "waiting")
            elif w < waves and what == "push":
                ref.push(vw, stage, w, _delta(vw, stage, w, ref.stage_numel(vw, stage)))
                state[(vw, stage)] = (w + 1, "pull")
        ready = ref.ready_pulls()
        ref.answered(ready)
        for _, vw, stage, w in ready:
            state[(vw, stage)] = (w, "push")


THREADED = ["nesterov-sum-inverse", "sgd-lr-inverse", "delayed-nesterov-delay3-sqrt"]


@pytest.mark.parametrize("options", [OUTERS[k] for k in THREADED], ids=THREADED)
def test_threads_per_stage_with_an_outer_optimizer_match_python_shard(options):
    d, waves = 2, 20
    ref, plane = _pair(d, threads=2, **options)
    stages = _stages(ref)
    _run_stage_threads(plane, stages, waves)
    _follow(ref, plane, waves)
    assert plane.applied == waves == ref.applied
    _assert_same_weights(ref, plane)


def test_bad_outer_options_name_the_field():
    numels, stage_layers = _plane_layout()
    for kwargs, message in [(dict(outer="adam"), "outer must be 'sgd', 'nesterov' or 'delayed-nesterov', got 'adam'"),
                            (dict(outer_lr=0.0), "outer_lr must be a finite number > 0"),
                            (dict(outer_lr=float("inf")), "outer_lr must be a finite number > 0"),
                            (dict(outer_momentum=1.0), "outer_momentum must be a number in \\[0, 1\\)"),
                            (dict(outer_staleness="linear"), "outer_staleness must be 'none', 'inverse' or 'sqrt'"),
                            (dict(outer_gain="mean"), "outer_gain must be 'none' or 'sqrt', got 'mean'"),
                            (dict(outer_delay=-1), "outer_delay must be an integer >= 0 \\(0: the VW count\\)")]:
        with pytest.raises(ValueError, match=message):
            ShardPlane(numels, stage_layers, 0, **kwargs)
    plain = ShardPlane(numels, stage_layers, 0)
    assert plain.momentum(0).size == plain.aggregated(0).size == 0
    assert ShardPlane(numels, stage_layers, 0, outer="nesterov").momentum(0).size == numels[0]
    delayed = ShardPlane(numels, stage_layers, 0, outer="delayed-nesterov")
    assert delayed.momentum(0).size == delayed.aggregated(0).size == numels[0] and delayed.outer_count(0) == 0
    with pytest.raises(ValueError, match="the outer buffer of layer 0 counts -2 pushes"):
        delayed.set_outer_count(0, -2)


def test_threads_per_stage_match_python_shard():
    d, waves = 1, 25
    ref, plane = _pair(d, threads=2)
    stages = _stages(ref)
    for w in range(waves):
        for vw, stage in stages:
            ref.push(vw, stage, w, _delta(vw, stage, w, ref.stage_numel(vw, stage)))
    _run_stage_threads(plane, stages, waves, d)
    assert plane.applied == waves == ref.applied
    _assert_same_weights(ref, plane)


def test_bad_pushes_and_pulls_name_the_culprit():
    _, plane = _pair(0)
    n = plane.stage_numel(0, 0)
    with pytest.raises(ValueError, match="VW 0 stage 7 holds none"):
        plane.push(0, 7, 0, np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=fr"has 3 floats \(12 bytes\), expected {n}"):
        plane.push(0, 0, 0, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="delta must be float32"):
        plane.push(0, 0, 0, np.zeros(n, np.float64))
    plane.push(0, 0, 0, np.zeros(n, np.float32))
    with pytest.raises(ValueError, match="duplicate push of wave 0 from VW 0 stage 0"):
        plane.push(0, 0, 0, np.zeros(n, np.float32))
    with pytest.raises(TimeoutError, match="0 waves applied"):
        plane.pull(0, 0, 1, np.empty(n, np.float32), timeout=0.05)
    with pytest.raises(ValueError, match="no stage of VW 0 holds layer 1"):
        ShardPlane([4, 4], [[[0]]], 0)
