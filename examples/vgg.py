"""A small torchvision-style VGG trained on scikit-learn's digits (8x8 images), by hetpipe beside
plain PyTorch (same data order, seed and optimizer).

    hetpipe launch -n 6 examples/vgg.py             # cpu-emulated: 2 VWs x 2 stages + 2 PS shards

``layers, loss_fn = adapt(model)`` gives one layer per convolution (with its activation and pooling),
then avgpool + flatten + the first linear block, then the other linear blocks. Rank 0 prints the
table at the end.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from torch import nn

from compare import held_out, report, result_line, sample_order, train_plain
from hetpipe import Trainer
from hetpipe.adapters import adapt
from hetpipe.runtime.data import digits
from resnet_bn import classify_step, image_minibatches


class VGG(nn.Module):
    """torchvision's VGG layout (features, avgpool, classifier); ``cfg`` as torchvision's ("M": max pool)."""

    def __init__(self, cfg=(16, 16, "M", 32, 32, "M", 64), dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        mods, cin = [], 1
        for v in cfg:
            if v == "M":
                mods.append(nn.MaxPool2d(2, 2))
            else:
                mods += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*mods)
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(cin * 4, 128), nn.ReLU(True), nn.Dropout(dropout),
                                        nn.Linear(128, 128), nn.ReLU(True), nn.Dropout(dropout),
                                        nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--minibatches", type=int, default=40, help="training minibatches per epoch (at most)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nm", type=int, default=2)
    p.add_argument("--d", type=int, default=0)
    p.add_argument("--policy", default="auto")
    p.add_argument("--plan", help="a plan JSON to run instead of planning on the cpu-emulated preset")
    p.add_argument("--emulation-scale", type=float, default=1.0)
    args = p.parse_args()

    x_tr, y_tr, x_te, y_te = digits()
    train = image_minibatches(x_tr, y_tr, args.batch)[: args.minibatches]
    test = image_minibatches(x_te, y_te, args.batch)
    torch.manual_seed(0)
    model = VGG(dropout=args.dropout)
    plain_model = copy.deepcopy(model)
    optimizer = lambda params: torch.optim.Adam(params, lr=args.lr)     # noqa: E731

    layers, loss_fn = adapt(model)
    trainer = Trainer(layers, loss_fn, optimizer, train, plan=args.plan, cluster="cpu-emulated", policy=args.policy,
                      nm=args.nm, d=args.d, epochs=args.epochs, emulation_scale=args.emulation_scale,
                      progress=False)
    result = trainer.fit()

    if result.rank == 0:
        num_vws = len(result.plan.virtual_workers)
        ours = sample_order(result.losses, len(train))
        plain, plain_rate = train_plain(plain_model, classify_step, optimizer, train, args.epochs, num_vws)
        held = (held_out(plain_model, classify_step, test), held_out(model, classify_step, test))
        print(report("VGG", plain, ours, args.batch, held, (plain_rate, result.samples_per_s), result.emulated))
        print("RESULT " + json.dumps(result_line(plain, ours, held)), flush=True)


if __name__ == "__main__":
    main()
