"""Models for the synthetic benchmarks, without torchvision (not installable on every machine).

``resnet50`` follows the published architecture (bottleneck blocks 3-4-6-3, 25.6 M parameters,
161 parameter tensors), so its gradient layout is the one real training sees; torchvision's is used
instead when it is installed. ``mlp10m`` is a ~10 M-parameter MLP for CPU runs, ``cnn10m`` a ~10
M-parameter conv net in 30 tensors (also for CPU runs), ``cnn`` a small convolutional net, ``transformer`` a small encoder-only transformer (0.9 M parameters, 55 tensors).

Every model takes a float batch ``torch.randn(batch, *sample)``, where ``sample`` is the shape
``build`` returns, and gives 1000 class scores per sample.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * Bottleneck.expansion
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


def cnn10m(num_classes: int = 1000) -> nn.Module:
    """A VGG-style conv net: 9.0 M parameters in 30 tensors (7 conv + BatchNorm blocks and a linear
    head) on 3x32x32 inputs, so its gradients fill several buckets of unequal size."""
    layers, channels = [], 3
    for out, stride in ((64, 1), (128, 2), (256, 1), (256, 2), (512, 1), (512, 2), (512, 2)):
        layers += [nn.Conv2d(channels, out, 3, stride=stride, padding=1), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(512 * 4, num_classes))


def mlp10m(width: int = 1024, num_classes: int = 1000) -> nn.Module:
    """About 9.4 M parameters in 4 linear layers (8 tensors; several gradient buckets)."""
    return nn.Sequential(nn.Linear(width, width * 2), nn.ReLU(), nn.Linear(width * 2, width * 2), nn.ReLU(),
                         nn.Linear(width * 2, width), nn.ReLU(), nn.Linear(width, num_classes))


class SmallTransformer(nn.Module):
    """Encoder-only transformer classifier over a sequence of feature vectors ("tokens", such as image
    patches): a linear token embedding plus learned positions, pre-norm encoder layers, mean pooling,
    a linear head. Tokens are float features rather than ids so that the same random-batch recipe
    feeds every model here; the layer mix (attention, feed-forward, LayerNorm) is a transformer's."""

    def __init__(self, seq_len: int = 64, features: int = 64, d_model: int = 128, heads: int = 4,
                 layers: int = 4, ff: int = 512, num_classes: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
        # nested-tensor fast path only applies to inference with post-norm layers; off keeps the warning away
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.encoder(self.embed(x) + self.pos)
        return self.head(self.norm(y.mean(dim=1)))


MODELS = ("resnet50", "cnn", "cnn10m", "mlp10m", "transformer")


def build(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """The model and the shape of one input sample."""
    if name == "resnet50":
        try:
            import torchvision  # noqa: PLC0415

            return torchvision.models.resnet50(), (3, 224, 224)
        except ImportError:
            return ResNet50(), (3, 224, 224)
    if name == "cnn":
        return SmallCNN(), (3, 64, 64)
    if name == "mlp10m":
        return mlp10m(), (1024,)
    if name == "cnn10m":
        return cnn10m(), (3, 32, 32)
    if name == "transformer":
        return SmallTransformer(), (64, 64)
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODELS)}")
