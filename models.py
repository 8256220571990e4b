"""The trainer's models: the assignment's small net (BatchNorm1d, dropout), a small CIFAR ResNet (BatchNorm2d)
and torchvision's ResNets (weights=None), with their BatchNorm layers synchronized as --norm says."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from syncbn import SyncBatchNorm

TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
NUM_CLASSES = 100  # the default output size: CIFAR-100's classes


class Net(nn.Module):
    """The assignment's net; ``dropout`` is dropout2's rate and dropout1 gets half of it (0.25 and 0.5 as given).
    fc1 takes the 32 channels of (S - 4) / 2 squared pixels left of an S-pixel input (6272 at S = 32)."""

    def __init__(self, dropout: float = 0.5, num_classes: int = NUM_CLASSES, image_size: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 32, 3, 1)
        self.dropout1 = nn.Dropout(dropout / 2)
        self.dropout2 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(32 * ((image_size - 4) // 2) ** 2, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.bn1 = nn.BatchNorm1d(128, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.fc1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.bn1(x)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small CIFAR ResNet: a 3x3 stem and one BasicBlock per stage (16, 32, 64 channels), BatchNorm2d throughout."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), num_classes: int = NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        blocks, channels = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(channels, width, 1 if i == 0 else 2))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(name: str, dropout: float, norm: str, num_classes: int = NUM_CLASSES, image_size: int = 32
                ) -> nn.Module:
    """The model with its BatchNorm layers as --norm says (local = plain per-process BatchNorm)."""
    if name == "net":
        model = Net(dropout, num_classes, image_size)
    elif name == "resnet":
        model = ResNet(num_classes=num_classes)
    else:
        import torchvision

        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if norm == "custom":
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    elif norm == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
