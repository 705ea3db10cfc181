"""The planner's parameter-sized memory terms against what the runtime really holds.

Reference: a replay (the real StageModel code, two VWs of 3 and 2 stages) instrumented to record,
per stage, the peak number of parameter-sized buffers it holds: weight-stash snapshots allocated,
stashes holding gradients, and wave-delta buffers allocated, besides its weights, their gradients
and its scratch buffer. The planner's count of weight stashes must equal the observed one, and its
memory for the stage must cover all the observed buffers.
"""

import sys
from pathlib import Path

import pytest

from hetpipe.plan.stage_cost import LayerTable, LinkCost, StageDevice
from hetpipe.plan.profile import LayerProfile, ModelProfile
from hetpipe.ps.ledger import WaveLedger
from hetpipe.stage import params as stage_module
from hetpipe.run.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan  # noqa: E402

CUTS = ([2, 4], [3])            # VW 0: [0, 2) [2, 4) [4, 6); VW 1: [0, 3) [3, 6)
ALWAYS = 3                      # the weights, their gradients (between Apply's sum and the step), the scratch


def observed_peaks(monkeypatch, nm: int, d: int):
    """(start, stop) -> [snapshots, stashes with gradients, deltas]: each one's peak over a replay."""
    peaks = {}

    def sample(model) -> None:
        now = [model.stashes.buffers_held,
               sum(1 for st in model.stash.values() if any(v.grad is not None for layer in st for v in layer.values())),
               len(model.ledger.deltas) + model.ledger.spare_deltas]
        old = peaks.setdefault((model.start, model.stop), [0, 0, 0])
        peaks[(model.start, model.stop)] = [max(a, b) for a, b in zip(old, now)]

    models = {}                 # id(ledger) -> its stage model: a pull's merge is sampled too
    for name in ("forward", "backward", "apply"):
        real = getattr(stage_module.StageModel, name)

        def traced(self, *args, _real=real, **kwargs):
            out = _real(self, *args, **kwargs)
            models[id(self.ledger)] = self
            sample(self)
            return out

        monkeypatch.setattr(stage_module.StageModel, name, traced)
    real_merge = WaveLedger.merge_pull

    def traced_merge(self, *args, **kwargs):
        out = real_merge(self, *args, **kwargs)
        if id(self) in models:
            sample(models[id(self)])
        return out

    monkeypatch.setattr(WaveLedger, "merge_pull", traced_merge)
    plan = two_vw_plan(CUTS, (0.0, 0.0), nm=nm, d=d)
    Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256), plan=plan, epochs=2).replay()
    return peaks, plan


@pytest.mark.parametrize("nm,d", [(1, 0), (2, 1), (4, 0), (4, 3), (1, 3)])
def test_planner_weight_copies_cover_what_the_runtime_holds(monkeypatch, nm, d):
    peaks, plan = observed_peaks(monkeypatch, nm, d)
    model = mlp()
    param_bytes = [4 * sum(p.numel() for p in layer.parameters()) for layer in model]
    # parameters only, so that the planner's stage memory is its parameter-sized terms alone
    profile = ModelProfile("mlp", 16, [LayerProfile(f"l{i}", {"t": 1.0}, {"t": 1.0}, param_bytes=b)
                                       for i, b in enumerate(param_bytes)])
    table = LayerTable(profile, ["t"], d)
    stage_dev, link = StageDevice("d", "t", "n", 10**12), LinkCost(1e9, 0.0)
    for vw in plan.virtual_workers:
        K = len(vw.stages)
        for k, st in enumerate(vw.stages):
            snapshots, stash_grads, deltas = peaks[(st.start, st.stop)]
            size = sum(param_bytes[st.start:st.stop])
            _, planned = table.stage(stage_dev, k, K, nm, st.start, st.stop, link if k else None,
                                     link if k < K - 1 else None, False)
            assert planned % size == 0
            copies = planned // size
            # weights and gradients, then a stash and its gradient per minibatch in flight, then D + 2 deltas
            assert (copies - 2 - (d + 2)) // 2 == snapshots, (vw.index, k, peaks)
            assert copies >= ALWAYS + snapshots + stash_grads + deltas, (vw.index, k, peaks)


@pytest.mark.parametrize("cuts", [[2], [1, 4], [4]])
def test_planner_counts_the_replicas_of_tied_weights_a_stage_holds(monkeypatch, cuts):
    """A tied weight (layer 0's matrix, reused by layer 4 as the output) split across stages: the
    stage holding layer 4 without layer 0 keeps a replica in its flat weights. Reference: the size of
    each stage's flat weight vector in a real replay, against the planner's parameter-sized memory
    of a profile measured by profile_model (activations left out, SGD-momentum state)."""
    import dataclasses

    import real_models as rm
    from common import one_vw_plan
    from hetpipe.model.measure import profile_model

    flat_bytes = {}
    init = stage_module.StageModel.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        flat_bytes[(self.start, self.stop)] = self.flat.data.numel() * self.flat.data.element_size()

    monkeypatch.setattr(stage_module.StageModel, "__init__", recording_init)
    nm, d = 2, 1
    plan = one_vw_plan(cuts, nm=nm, d=d, num_layers=5)
    Trainer(rm.tied_mlp(), rm.tied_loss, sgd(), synthetic(n=64), plan=plan, epochs=1).replay()

    x, y = next(iter(synthetic(n=64)))
    measured = profile_model(rm.tied_mlp(), x, "cpu-emulated", loss_fn=lambda out: rm.tied_loss(out, y), repeats=1)
    profile = dataclasses.replace(measured, layers=tuple(
        dataclasses.replace(l, activation_bytes=0, stash_bytes=0, workspace_bytes=0) for l in measured.layers))
    kind = profile.device_types[0]
    table = LayerTable(profile, [kind], d)
    device = StageDevice("d", kind, "n", 10**12)
    stages = plan.virtual_workers[0].stages
    for k, st in enumerate(stages):
        _, planned = table.stage(device, k, len(stages), nm, st.start, st.stop, None, None, False)
        # weights, gradients, SGD momentum, then the stashes and deltas: all parameter-sized
        copies = 3 + table.weight_copies(min(nm, len(stages) - k))
        assert planned == copies * flat_bytes[(st.start, st.stop)], (k, st, flat_bytes)


def _arrays(obj, seen=None):
    """The torch tensors and NumPy arrays reachable from ``obj`` through containers and dataclasses."""
    import dataclasses

    import numpy as np
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _arrays(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _arrays(v, seen)
    elif dataclasses.is_dataclass(obj):
        yield from _arrays(vars(obj), seen)


def test_the_wave_ledger_holds_only_parameter_sized_float32_vectors(monkeypatch):
    """What a stage's wave ledger holds besides the planner's parameter-sized terms: nothing. Its shards'
    places in the flat vectors are ranges; per-element int64 index arrays (8 bytes per weight on the
    stage's device, none of it in the planner's memory model) would show up here. Three PS shards owning
    every third layer, so that shard 2's part of the second stage (layers 2 and 5, layer 4 between) is split."""
    from common import one_vw_plan

    ledgers = []
    init = stage_module.StageModel.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        ledgers.append(self.ledger)

    monkeypatch.setattr(stage_module.StageModel, "__init__", recording_init)
    plan = one_vw_plan([2], nm=2, d=1, num_layers=6, shards=3)
    Trainer(mlp(), cross_entropy, sgd(), synthetic(n=64), plan=plan, epochs=1).replay()
    assert len(ledgers) == 2 and ledgers[1].layout.weights[2] == ((0, 1056), (2112, 2442))
    for ledger in ledgers:
        held = list(_arrays(vars(ledger)))
        assert held and all(str(a.dtype).endswith("float32") for a in held), {str(a.dtype) for a in held}
        sizes = {ledger.layout.numel, ledger.layout.buffer_numel}
        assert all((a.numel() if hasattr(a, "numel") else a.size) in sizes for a in held)
