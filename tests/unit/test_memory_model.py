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
from hetpipe.profile import LayerProfile, ModelProfile
from hetpipe.runtime import stage_model as stage_module
from hetpipe.runtime.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))
from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan  # noqa: E402

CUTS = ([2, 4], [3])            # VW 0: [0, 2) [2, 4) [4, 6); VW 1: [0, 3) [3, 6)
ALWAYS = 3                      # the weights, their gradients (between Apply's sum and the step), the scratch


def observed_peaks(monkeypatch, nm: int, d: int):
    """(start, stop) -> [snapshots, stashes with gradients, deltas]: each one's peak over a replay."""
    peaks = {}

    def sample(model) -> None:
        now = [len(model._snapshots) + len(model._spare_snapshots),
               sum(1 for st in model.stash.values() if any(v.grad is not None for layer in st for v in layer.values())),
               len(model.deltas) + len(model._spare_deltas)]
        old = peaks.setdefault((model.start, model.stop), [0, 0, 0])
        peaks[(model.start, model.stop)] = [max(a, b) for a, b in zip(old, now)]

    for name in ("forward", "backward", "apply", "merge_pull"):
        real = getattr(stage_module.StageModel, name)

        def traced(self, *args, _real=real, **kwargs):
            out = _real(self, *args, **kwargs)
            sample(self)
            return out

        monkeypatch.setattr(stage_module.StageModel, name, traced)
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
