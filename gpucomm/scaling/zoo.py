"""Plain-torch definitions of the image models whose published scaling results we check.

torchvision does not install beside this torch, so the architectures are written out here from
their published descriptions (layer types, channels, kernel sizes, strides), parameter for
parameter as torchvision builds them; ``tests/test_scaling.py`` checks the totals against the
published counts (ResNet-18 11,689,512; ResNet-50 25,557,032; ResNet-101 44,549,160; VGG-16
138,357,544; Inception V3 27,161,264 with its auxiliary head, 23,834,568 without). Only the shapes
matter to the scaling model; the weights are left at PyTorch's default initialisation.

``build(name)`` returns ``(model, sample_shape)``; build on ``torch.device("meta")`` (``with
torch.device("meta"): build(...)``) to get shapes without allocating VGG-16's 528 MiB.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

__all__ = ["MODELS", "PUBLISHED_PARAMETERS", "build", "resnet", "vgg16", "inception_v3"]


# ---------------------------------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + identity)


class Bottleneck(nn.Module):
    """1x1, 3x3 (carrying the stride, "ResNet v1.5"), 1x1 with 4x the channels (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu3 = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        return self.relu3(self.bn3(self.conv3(y)) + identity)


def _shortcut(inplanes: int, out: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == out:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))


class ResNet(nn.Module):
    """ImageNet ResNet: 7x7 stem, four stages of ``blocks``, global average pool, linear classifier."""

    def __init__(self, block: type, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, inplanes = [], 64
        for planes, count, stride in zip((64, 128, 256, 512), blocks, (1, 2, 2, 2)):
            layer = []
            for i in range(count):
                layer.append(block(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(depth: int, num_classes: int = 1000) -> ResNet:
    """ResNet-18, -34, -50, -101 or -152."""
    table = {18: (BasicBlock, (2, 2, 2, 2)), 34: (BasicBlock, (3, 4, 6, 3)), 50: (Bottleneck, (3, 4, 6, 3)),
             101: (Bottleneck, (3, 4, 23, 3)), 152: (Bottleneck, (3, 8, 36, 3))}
    if depth not in table:
        raise ValueError(f"resnet: depth {depth} is not one of {sorted(table)}.")
    block, blocks = table[depth]
    return ResNet(block, blocks, num_classes)


# ---------------------------------------------------------------------------------------------- VGG-16


def vgg16(num_classes: int = 1000) -> nn.Module:
    """VGG-16 (configuration D): 13 3x3 convolutions with biases in five blocks, then 4096-4096-classes."""
    layers: list[nn.Module] = []
    channels = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
            channels = v
    return nn.Sequential(
        nn.Sequential(*layers), nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
        nn.Linear(4096, num_classes))


# ---------------------------------------------------------------------------------------------- Inception V3


class Conv(nn.Module):
    """Convolution without bias, BatchNorm (eps 0.001), ReLU: Inception V3's unit."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class _Branches(nn.Module):
    """Parallel branches whose outputs are concatenated along channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches()], 1)


class InceptionA(_Branches):
    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.b1 = Conv(cin, 64, 1)
        self.b5 = nn.Sequential(Conv(cin, 48, 1), Conv(48, 64, 5, padding=2))
        self.b3 = nn.Sequential(Conv(cin, 64, 1), Conv(64, 96, 3, padding=1), Conv(96, 96, 3, padding=1))
        self.pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), Conv(cin, pool_features, 1))

    def branches(self):
        return self.b1, self.b5, self.b3, self.pool


class InceptionB(_Branches):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = Conv(cin, 384, 3, stride=2)
        self.b3dbl = nn.Sequential(Conv(cin, 64, 1), Conv(64, 96, 3, padding=1), Conv(96, 96, 3, stride=2))
        self.pool = nn.MaxPool2d(3, stride=2)

    def branches(self):
        return self.b3, self.b3dbl, self.pool


class InceptionC(_Branches):
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.b1 = Conv(cin, 192, 1)
        self.b7 = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (1, 7), padding=(0, 3)),
                                Conv(c7, 192, (7, 1), padding=(3, 0)))
        self.b7dbl = nn.Sequential(Conv(cin, c7, 1), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                   Conv(c7, c7, (1, 7), padding=(0, 3)), Conv(c7, c7, (7, 1), padding=(3, 0)),
                                   Conv(c7, 192, (1, 7), padding=(0, 3)))
        self.pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), Conv(cin, 192, 1))

    def branches(self):
        return self.b1, self.b7, self.b7dbl, self.pool


class InceptionD(_Branches):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b3 = nn.Sequential(Conv(cin, 192, 1), Conv(192, 320, 3, stride=2))
        self.b7x3 = nn.Sequential(Conv(cin, 192, 1), Conv(192, 192, (1, 7), padding=(0, 3)),
                                  Conv(192, 192, (7, 1), padding=(3, 0)), Conv(192, 192, 3, stride=2))
        self.pool = nn.MaxPool2d(3, stride=2)

    def branches(self):
        return self.b3, self.b7x3, self.pool


class _Split(nn.Module):
    """A 1x3 and a 3x1 convolution of the same input, concatenated (InceptionE's expanded branches)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = Conv(c, 384, (1, 3), padding=(0, 1))
        self.b = Conv(c, 384, (3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], 1)


class InceptionE(_Branches):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = Conv(cin, 320, 1)
        self.b3 = nn.Sequential(Conv(cin, 384, 1), _Split(384))
        self.b3dbl = nn.Sequential(Conv(cin, 448, 1), Conv(448, 384, 3, padding=1), _Split(384))
        self.pool = nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), Conv(cin, 192, 1))

    def branches(self):
        return self.b1, self.b3, self.b3dbl, self.pool


class InceptionAux(nn.Module):
    """The auxiliary classifier on Mixed_6e's output (training only)."""

    def __init__(self, cin: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(5, stride=3)
        self.conv0 = Conv(cin, 128, 1)
        self.conv1 = Conv(128, 768, 5)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.gap(self.conv1(self.conv0(self.pool(x)))), 1))


class InceptionV3(nn.Module):
    """Inception V3 on 299x299 inputs; ``aux_logits`` adds the auxiliary head (its loss weighs 0.4)."""

    def __init__(self, num_classes: int = 1000, aux_logits: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(Conv(3, 32, 3, stride=2), Conv(32, 32, 3), Conv(32, 64, 3, padding=1),
                                  nn.MaxPool2d(3, stride=2), Conv(64, 80, 1), Conv(80, 192, 3),
                                  nn.MaxPool2d(3, stride=2))
        self.mixed5 = nn.Sequential(InceptionA(192, 32), InceptionA(256, 64), InceptionA(288, 64))
        self.mixed6 = nn.Sequential(InceptionB(288), InceptionC(768, 128), InceptionC(768, 160), InceptionC(768, 160),
                                    InceptionC(768, 192))
        self.aux = InceptionAux(768, num_classes) if aux_logits else None
        self.mixed7 = nn.Sequential(InceptionD(768), InceptionE(1280), InceptionE(2048))
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mixed6(self.mixed5(self.stem(x)))
        aux = self.aux(x) if self.aux is not None and self.training else None
        logits = self.fc(self.dropout(torch.flatten(self.gap(self.mixed7(x)), 1)))
        return logits if aux is None else logits + 0.4 * aux  # one tensor whose loss trains both heads


def inception_v3(num_classes: int = 1000, aux_logits: bool = True) -> InceptionV3:
    return InceptionV3(num_classes, aux_logits)


# ---------------------------------------------------------------------------------------------- registry

MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (lambda: resnet(18), (3, 224, 224)),
    "resnet50": (lambda: resnet(50), (3, 224, 224)),
    "resnet101": (lambda: resnet(101), (3, 224, 224)),
    "vgg16": (vgg16, (3, 224, 224)),
    "inception_v3": (lambda: inception_v3(aux_logits=False), (3, 299, 299)),
    "inception_v3_aux": (lambda: inception_v3(aux_logits=True), (3, 299, 299)),
}

PUBLISHED_PARAMETERS = {  # torchvision's counts (research/scaling-inputs.md section 3)
    "resnet18": 11_689_512, "resnet50": 25_557_032, "resnet101": 44_549_160, "vgg16": 138_357_544,
    "inception_v3": 23_834_568, "inception_v3_aux": 27_161_264,
}


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """The model called ``name`` and the shape of one input sample."""
    if name not in MODELS:
        raise ValueError(f"unknown built-in model {name!r}: choose one of {', '.join(MODELS)}, or pass "
                         "module:callable returning (model, batch, loss_fn).")
    make, shape = MODELS[name]
    return make(), shape
