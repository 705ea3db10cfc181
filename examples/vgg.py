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

import torch
from torch import nn

from compare import add_run_options, finish, run_options
from hetpipe import Trainer
from hetpipe.adapters import adapt
from hetpipe.run.data import digits
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
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    add_run_options(p, epochs=2)
    args = p.parse_args()

    x_tr, y_tr, x_te, y_te = digits()
    train = image_minibatches(x_tr, y_tr, args.batch)[: args.minibatches]
    test = image_minibatches(x_te, y_te, args.batch)
    torch.manual_seed(0)
    model = VGG(dropout=args.dropout)
    plain_model = copy.deepcopy(model)
    optimizer = lambda params: torch.optim.Adam(params, lr=args.lr)     # noqa: E731

    layers, loss_fn = adapt(model)
    trainer = Trainer(layers, loss_fn, optimizer, train, **run_options(args))
    finish("VGG", trainer.fit(), model, plain_model, classify_step, optimizer, train, test, args.epochs, args.batch)


if __name__ == "__main__":
    main()
