"""The CIFAR-10 variant of ResNet-18 used by the assignment. Differences from the ImageNet ResNet-18:
a 3x3 stride-1 stem convolution with 64 channels and no max-pool (CIFAR images are only 32x32), a 4x4
average pool before the classifier, and 10 classes. It has exactly 11,173,962 trainable parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.learn.flops import count_flops


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection: the identity when the shape is unchanged,
    otherwise a 1x1 conv + BN (stride 2 halves the spatial size when the width doubles)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR ResNet-18: stem, four stages of two BasicBlocks, 4x4 average pool, Linear. ``width`` scales
    every stage's channels (64: the spec model; smaller: the same family for CPU profiles)."""

    def __init__(self, num_classes: int = 10, width: int = 64, blocks: tuple[int, ...] = (2, 2, 2, 2)):
        super().__init__()
        widths = [width, width * 2, width * 4, width * 8]
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages = []
        in_ch = width
        for i, (w, n) in enumerate(zip(widths, blocks, strict=True)):
            layers = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(in_ch, w, stride))
                in_ch = w
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.linear = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)  # 4x4 feature map -> 1x1
        return self.linear(out.flatten(1))


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


@dataclass(frozen=True)
class FlopsPerImage:
    """FLOPs of ResNet-18 (this width) per 32x32 image, from ``torch.utils.flop_counter``."""

    width: int
    forward_flops: float
    train_flops: float  # forward + backward (weight and input gradients); optimizer not counted


def flops_per_image(width: int = 64) -> FlopsPerImage:
    """Forward and training FLOPs per image of ResNet-18 at ``width``, counted on the ``meta`` device
    (shapes propagate and every convolution and matmul is seen, no arithmetic: instant at any width)."""
    with torch.device("meta"):
        model = ResNet18(width=width)
    fc = count_flops(model, torch.randn(2, 3, 32, 32, device="meta"))
    return FlopsPerImage(width, fc.forward_flops_per_sample, fc.train_flops_per_sample)
