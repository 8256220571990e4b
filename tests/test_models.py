"""models.py: output sizes for any number of classes and image size, --norm's BatchNorm layers, and the ViTs
(the small one trains, torchvision's are sized by the data, a size that does not fit the patches is refused)."""
import pytest
import torch
import torch.nn as nn

from models import MODELS, TORCHVISION_VITS, Net, build_model
from syncbn import SyncBatchNorm
from utils import UsageError


@pytest.mark.parametrize("name,image_size", [("net", 32), ("net", 16), ("net", 10), ("resnet", 32),
                                             ("resnet18", 24), ("vit", 16)])
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


def test_the_small_vit_trains_without_batchnorm_or_random_draws():
    torch.manual_seed(0)
    model = build_model("vit", 0.5, "custom", num_classes=100, image_size=32)
    assert 700_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())  # --norm: nothing
    assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))  # torchvision's default
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([3, 97])
    rng = torch.get_rng_state()
    loss = nn.functional.cross_entropy(model(images), labels)  # training mode: dropout would draw here
    loss.backward()
    assert torch.equal(torch.get_rng_state(), rng) and torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_torchvision_vit_takes_the_data_image_size_and_classes():
    """vit_b_16 on 32-pixel images: 2x2 patches of 16. Built on the meta device (shapes only: 86M parameters
    are not initialized). Its count is torchvision's 86,567,656 at 224 pixels and 1000 classes, less 192 of the
    197 position embeddings (x 768) and the head's 990 classes (x 769): 85,658,890."""
    import torchvision

    assert MODELS[:3] == ("net", "resnet", "vit") and "vit_b_16" in TORCHVISION_VITS
    with torch.device("meta"):
        model = build_model("vit_b_16", 0.5, "custom", num_classes=10, image_size=32)
        reference = torchvision.models.vit_b_16(num_classes=10, image_size=32)
        assert model(torch.empty(2, 3, 32, 32)).shape == (2, 10)
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == 86_567_656 - 192 * 768 - 990 * 769


@pytest.mark.parametrize("name,image_size,patch", [("vit_b_16", 20, 16), ("vit_h_14", 32, 14), ("vit", 30, 4)])
def test_a_vit_refuses_an_image_size_its_patches_do_not_tile(name, image_size, patch):
    with pytest.raises(UsageError, match=f"^--model {name} needs an image size divisible by {patch}, "
                                         f"got {image_size}$"):
        build_model(name, 0.5, "local", num_classes=10, image_size=image_size)
