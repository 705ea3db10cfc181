"""torchvision-style ResNet and VGG classifiers as layer lists (duck-typed on their attributes).

torchvision is not a dependency: any model with torchvision's attribute layout *and* its forward
(ResNet: conv1, bn1, relu, maxpool, layer1..layer4, avgpool, flatten, fc; VGG: features, avgpool,
flatten, classifier) is accepted. The layers hold the model's own modules, BatchNorm included.
"""

from __future__ import annotations

from typing import List, Tuple

from torch import nn

from hetpipe.adapters.adapted import Adapted
from hetpipe.adapters.errors import AdapterError, require

RESNET_ATTRS = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")
VGG_ATTRS = ("features", "avgpool", "classifier")


def is_resnet(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in RESNET_ATTRS)


def is_vgg(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in VGG_ATTRS) and isinstance(model.features, nn.Sequential)


def _blocks(model: nn.Module, attr: str, adapter: str) -> nn.Sequential:
    stage = getattr(model, attr)
    if not isinstance(stage, nn.Sequential) or len(stage) == 0:
        what = "an empty nn.Sequential" if isinstance(stage, nn.Sequential) else f"a {type(stage).__name__}"
        raise AdapterError(f"hetpipe.adapters.{adapter}: {type(model).__name__}.{attr} is {what}, not an "
                           "nn.Sequential of blocks")
    return stage


def resnet(model: nn.Module) -> Adapted:
    """[stem (conv1, bn1, relu, maxpool), every block of layer1..layer4, head (avgpool, flatten, fc)]."""
    require(model, RESNET_ATTRS, "resnet")
    layers: List[nn.Module] = [nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)]
    names = ["stem"]
    for attr in ("layer1", "layer2", "layer3", "layer4"):
        for j, block in enumerate(_blocks(model, attr, "resnet")):
            layers.append(block)
            names.append(f"{attr}.{j}")
    layers.append(nn.Sequential(model.avgpool, nn.Flatten(1), model.fc))
    names.append("head")
    return Adapted(nn.ModuleList(layers), names, nn.functional.cross_entropy, model)


def _groups(seq: nn.Sequential, starts: Tuple[type, ...]) -> List[Tuple[str, List[nn.Module]]]:
    """``seq`` cut before every module of a type in ``starts``; the cut's first index names a group."""
    groups: List[Tuple[str, List[nn.Module]]] = []
    for name, m in seq.named_children():
        if not groups or isinstance(m, starts):
            groups.append((name, []))
        groups[-1][1].append(m)
    return groups


def vgg(model: nn.Module) -> Adapted:
    """One layer per convolution of ``features`` (with the norm, activation and pooling after it),
    then avgpool + flatten + the classifier's first linear block, one layer per further linear."""
    require(model, VGG_ATTRS, "vgg")
    features = _blocks(model, "features", "vgg")
    classifier = model.classifier
    if not isinstance(classifier, nn.Sequential):
        classifier = nn.Sequential(classifier)
    layers: List[nn.Module] = []
    names: List[str] = []
    for first, mods in _groups(features, (nn.Conv2d,)):
        layers.append(nn.Sequential(*mods))
        names.append(f"features.{first}")
    for k, (first, mods) in enumerate(_groups(classifier, (nn.Linear,))):
        if k == 0:
            mods = [model.avgpool, nn.Flatten(1), *mods]
        layers.append(nn.Sequential(*mods))
        names.append(f"classifier.{first}")
    return Adapted(nn.ModuleList(layers), names, nn.functional.cross_entropy, model)


__all__ = ["resnet", "vgg", "is_resnet", "is_vgg"]
