"""A small torchvision-style ResNet with BatchNorm trained on scikit-learn's digits (8x8 images),
by hetpipe beside plain PyTorch (same data order, seed and optimizer).

    hetpipe launch -n 6 examples/resnet_bn.py       # cpu-emulated: 2 VWs x 2 stages + 2 PS shards

``layers, loss_fn = adapt(model)`` gives [stem, every residual block, avgpool + fc]; BatchNorm's
running statistics live in the layers. Rank 0 prints the table at the end.
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


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 conv + BatchNorm, a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """torchvision's ResNet layout (conv1, bn1, relu, maxpool, layer1..4, avgpool, fc), sized for 8x8."""

    def __init__(self, width: int = 8, blocks=(1, 1, 1, 1), classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()            # 8x8 inputs: no room to pool in the stem
        cin = width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, cout, stride),
                                                         *[BasicBlock(cout, cout) for _ in range(n - 1)]))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def classify_step(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def image_minibatches(x: torch.Tensor, y: torch.Tensor, batch: int):
    """Fixed-order minibatches of 1x8x8 digit images (a list: the same on every rank and epoch). Pixels
    that are constant in the training split standardise to huge values elsewhere: clipped to +-5."""
    x = x.view(-1, 1, 8, 8).clamp(-5, 5)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x) // batch * batch, batch)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--minibatches", type=int, default=32, help="training minibatches per epoch (at most)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    add_run_options(p, epochs=2)
    args = p.parse_args()

    x_tr, y_tr, x_te, y_te = digits()
    train = image_minibatches(x_tr, y_tr, args.batch)[: args.minibatches]
    test = image_minibatches(x_te, y_te, args.batch)
    torch.manual_seed(0)
    model = ResNet(args.width)
    plain_model = copy.deepcopy(model)
    optimizer = lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9)     # noqa: E731

    layers, loss_fn = adapt(model)
    trainer = Trainer(layers, loss_fn, optimizer, train, **run_options(args))
    finish("ResNet (BatchNorm)", trainer.fit(), model, plain_model, classify_step, optimizer, train, test,
           args.epochs, args.batch)


if __name__ == "__main__":
    main()
