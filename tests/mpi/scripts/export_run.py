"""Train under real ranks with checkpoints, then export the last checkpoint with `hetpipe export` and
load it back as a user would. Usage: mpiexec -n 3 python export_run.py OUT MODE [EVERY]

MODE ``sequential``: an nn.Sequential with a tied weight and BatchNorm (its num_batches_tracked is a
buffer the PS does not sync), loaded with ``load_state_dict(strict=True)``; ``gpt2``: a tiny Hugging
Face GPT-2 through ``adapt()``, opened with ``GPT2LMHeadModel.from_pretrained``. EVERY (optional,
default 1): checkpoint every that many waves (the export then reads the run's final checkpoint, of a
clock that was not due unless EVERY divides the run's waves). Rank 0 prints
``RESULT {json}``: whether every exported tensor equals the trained model's (the Trainer loads the
final weights into every rank's model), and the keys on either side that differ.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

from common import one_vw_plan
from hetpipe import named_params
from hetpipe.run.data import Batches
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Checkpointing, Reporting


class Tied(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, h):
        return h @ self.weight


def sequential():
    torch.manual_seed(0)
    first = nn.Linear(16, 12)
    model = nn.Sequential(first, nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 12), Tied(first.weight))
    g = torch.Generator().manual_seed(2)
    data = Batches(torch.randn(96, 16, generator=g), torch.randint(0, 16, (96,), generator=g), 16, seed=1)
    return model, model, nn.functional.cross_entropy, data, 5, 3


def gpt2():
    import transformers

    from hetpipe.adapters import adapt

    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    layers, loss = adapt(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (48, 16), generator=g)
    data = [({"input_ids": x, "attention_mask": torch.ones_like(x)}, x) for x in ids.split(8)]
    return model, layers, loss, data, len(layers), 2


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    model, layers, loss, data, n, cut = sequential() if mode == "sequential" else gpt2()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []

    @named_params
    def adamw(named):
        named = list(named)
        seen.extend(name for name, _ in named)
        decay = [p for name, p in named if p.dim() >= 2]
        rest = [p for name, p in named if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01)

    Trainer(layers, loss, adamw, data, plan=one_vw_plan([cut], nm=2, d=0, num_layers=n), epochs=2,
            checkpointing=Checkpointing(dir=out / "ckpt", every=every), reporting=Reporting(progress=False)).fit()
    names = MPI.COMM_WORLD.gather(seen, root=0)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    cli = [sys.executable, "-m", "hetpipe.cli", "export", str(out / "ckpt")]
    cli += ["-o", str(out / "model.safetensors")] if mode == "sequential" else ["--hf", str(out / "hf")]
    proc = subprocess.run(cli, capture_output=True, text=True)
    if proc.returncode != 0:
        print("RESULT " + json.dumps({"export_failed": proc.stderr}), flush=True)
        return 1
    want = model.state_dict()
    if mode == "sequential":
        from safetensors.torch import load_file

        fresh = sequential()[0]
        fresh.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    else:
        import transformers

        fresh = transformers.GPT2LMHeadModel.from_pretrained(out / "hf")
    got = fresh.state_dict()
    differ = sorted(k for k in want if k in got and not torch.equal(want[k], got[k]))
    from hetpipe.checkpoint.format import latest

    print("RESULT " + json.dumps({"said": proc.stdout.strip(), "exported": latest(out / "ckpt").name, "missing": sorted(set(want) - set(got)),
                                  "extra": sorted(set(got) - set(want)), "differ": differ,
                                  "trained": sum(not torch.equal(initial[k], want[k]) for k in want),
                                  "optimizer_names": sorted({n for per in names for n in per})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
