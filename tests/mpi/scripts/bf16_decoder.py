"""A tiny GPT-2 (Hugging Face, built from its config) trained in bf16 by one VW of two stage ranks
plus one PS rank, against plain PyTorch on the same device in one process, one minibatch after the
other, the same model, data and optimizer. Rank 0 prints one ``RESULT {json}`` line.

At Nm = 1, D = 0 the run's weight versions are plain training's. It differs from plain autocast by
two roundings: the residual stream where the stages are cut crosses as bfloat16, once (autocast keeps
that sum in float32, and the receiving stage widens it back to float32), and the embedding's gradient
of the tied weight crosses to the head's stage as bfloat16 (the head's own comes through autocast's
cast, bfloat16's already). The reference rounds both the same way, and the run must equal it up to
float32 rounding of the PS's ``W + (W' - W)`` and the device's own non-determinism: far below what
float32 training (the yardstick of bf16 being off) differs by. Plain autocast without the roundings
is reported too.

Usage: mpiexec -n 3 python bf16_decoder.py '{"device": "cuda:0"}'
"""

import copy
import json
import sys

import torch

from common import one_vw_plan
from hetpipe.adapters import adapt
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics, Reporting

MINIBATCHES = 8
CUT = 2                 # stage 0: embeddings and block 0; stage 1: block 1 and the head


def decoder():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def data():
    """Counting sequences from random starts (token t + 1 follows t): learnable in a few steps."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(MINIBATCHES):
        ids = (torch.randint(0, 256, (4, 1), generator=g) + torch.arange(32)) % 256
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids))
    return out


def sgd(params):
    # SGD: the weights move linearly in the gradients, so rounding differences are not amplified
    # into sign flips of the update as Adam's normalisation would in a few steps.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


class RoundedGradEmbedding(torch.nn.Module):
    """``embedding``, whose weight gets the gradient of this use rounded to bfloat16: what the bf16
    exchange of tied gradients does to the embedding's share."""

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embedding.weight.view_as(self.embedding.weight)
        w.register_hook(lambda g: g.to(torch.bfloat16).to(torch.float32))
        return torch.nn.functional.embedding(ids, w)


def plain(device: torch.device, bf16: bool, rounded: bool = False):
    """The reference: the adapted layers of the same model on ``device`` in one process, one minibatch
    after the other (the adapters equal the model's own forward: tests/unit/test_adapters.py); with
    ``rounded`` the value crossing the cut is rounded to bfloat16 once and widened back (forward, and
    so its gradient), and the embedding's gradient of the tied weight is rounded to bfloat16, as the
    bf16 wire does. (model, losses)."""
    model = decoder().to(device)
    layers, loss_fn = adapt(model)
    if rounded:
        layers[0].wte = RoundedGradEmbedding(layers[0].wte)
    opt = sgd(model.parameters())
    losses = []
    for inputs, labels in data():
        opt.zero_grad()
        inputs = {k: v.to(device) for k, v in inputs.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            x = inputs
            for i, layer in enumerate(layers):
                side = {k: inputs[k] for k in getattr(layer, "hetpipe_side_inputs", ())}
                x = layer(x, **side)
                if rounded and i == CUT - 1:
                    x = x.to(torch.bfloat16).to(x.dtype)
            loss = loss_fn(x, labels.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().cpu().reshape(-1) for _, p in sorted(model.named_parameters())])


def main() -> int:
    cfg = json.loads(sys.argv[1])
    model = decoder()
    initial = flat(copy.deepcopy(model))
    layers, loss_fn = adapt(model)
    plan = one_vw_plan([CUT], nm=1, d=0, num_layers=len(layers), device=cfg["device"])
    run = Trainer(layers, loss_fn, sgd, data(), plan=plan, epochs=1, numerics=Numerics(precision="bf16"),
                  reporting=Reporting(progress=False)).fit()
    if run.rank != 0:
        return 0
    device = torch.device(cfg["device"])
    ref, ref_losses = plain(device, bf16=True, rounded=True)
    autocast, autocast_losses = plain(device, bf16=True)
    fp32, fp32_losses = plain(device, bf16=False)
    losses = [run.losses[0][p] for p in sorted(run.losses[0])]
    w_ref = flat(ref)
    update = float((w_ref - initial).norm())

    def loss_diff(other):
        return max(abs(a - b) for a, b in zip(other, ref_losses))

    res = {"device": str(device), "transport": run.transport, "minibatches": len(losses),
           "loss_diff": loss_diff(losses), "autocast_loss_diff": loss_diff(autocast_losses),
           "fp32_loss_diff": loss_diff(fp32_losses),
           "weight_error": float((flat(model) - w_ref).norm()) / update,
           "autocast_weight_error": float((flat(autocast) - w_ref).norm()) / update,
           "fp32_weight_error": float((flat(fp32) - w_ref).norm()) / update,
           "trained": ref_losses[-1] < ref_losses[0] - 0.1, "losses": losses, "reference_losses": ref_losses}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
