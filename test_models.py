"""models.py: output sizes for any number of classes and image size, and --norm's BatchNorm layers."""
import pytest
import torch
import torch.nn as nn

from models import Net, build_model
from syncbn import SyncBatchNorm


@pytest.mark.parametrize("name,image_size", [("net", 32), ("net", 16), ("net", 10), ("resnet", 32),
                                             ("resnet18", 24)])
def test_output_size_is_the_number_of_classes(name, image_size):
    model = build_model(name, 0.5, "local", num_classes=7, image_size=image_size).eval()
    assert model(torch.randn(2, 3, image_size, image_size)).shape == (2, 7)


def test_net_dropout_rates_are_half_and_full():
    net = Net(dropout=0.4)
    assert (net.dropout1.p, net.dropout2.p) == (0.2, 0.4)
    assert net.fc1.in_features == 6272  # 32 channels x 14 x 14 at 32 pixels, as the assignment's net


@pytest.mark.parametrize("norm,kind", [("custom", SyncBatchNorm), ("torch", nn.SyncBatchNorm),
                                       ("local", nn.BatchNorm2d)])
def test_norm_chooses_the_batchnorm_layers(norm, kind):
    model = build_model("resnet", 0.0, norm)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(type(m) is kind for m in norms)
