"""The trainer's models: the assignment's small net (BatchNorm1d, dropout), a small CIFAR ResNet (BatchNorm2d),
torchvision's ResNets, a small Vision Transformer for 32-pixel images and torchvision's ViTs (all weights=None),
with their BatchNorm layers synchronized as --norm says.

The ViTs normalize with LayerNorm, per token: they have no BatchNorm, so --norm leaves them as they are. Their
dropout and attention dropout are torchvision's defaults, 0, so nothing in their forward pass draws from the RNG
and a step does not depend on how the global batch is split over ranks.

With few tokens a ViT's weights, gradients and optimizer state outweigh its activations, which is what sharding
them (ZeRO) saves: vit_b_16 on 32-pixel images (4 patches and the class token) has 86M parameters (327 MB in
float32, twice that again as gradients and momentum) against about 3 MB of saved activations per sample; the
small `vit` (0.8M parameters, 65 tokens) only at batches of a few samples (2.2 MB of activations per sample
against 9.4 MB of parameters, gradients and momentum).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from syncbn import SyncBatchNorm
from zero import init as zero_init
from utils import UsageError

TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
# Byte-level GPTs (vocabulary 256): a small one that learns in minutes on 2 CPU cores, a tiny one whose gradient
# crosses a 100 Mbit/s link in a fraction of a second (the slow-link benchmark), and GPT-2's shapes (small, medium,
# large: the model ZeRO-3 is for, at the scale of a machine's memory; xl: 1.48 billion parameters, whose AdamW state
# is larger than a 24 GB machine's memory: what offload is for)
GPT_SIZES = {"gpt": dict(layers=4, width=160, heads=5, context=128),
             "gpt-tiny": dict(layers=2, width=64, heads=4, context=64),
             "gpt2": dict(layers=12, width=768, heads=12, context=1024),
             "gpt2-medium": dict(layers=24, width=1024, heads=16, context=1024),
             "gpt2-large": dict(layers=36, width=1280, heads=20, context=1024),
             "gpt2-xl": dict(layers=48, width=1600, heads=25, context=1024)}
LANGUAGE_MODELS = tuple(GPT_SIZES)
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")  # patch size after the last _
MODELS = ("net", "resnet", "vit") + TORCHVISION_RESNETS + TORCHVISION_VITS + LANGUAGE_MODELS
NUM_CLASSES = 100  # the default output size: CIFAR-100's classes
SMALL_VIT = dict(patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512)  # 8x8 patches at 32 px


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


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions 0..t only (PyTorch's fused kernel)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise UsageError(f"a GPT's width ({width}) must be divisible by its heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.proj.into_residual = True  # GPT-2 scales the initial weights of the projections into the residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = (z.view(b, t, self.heads, width // self.heads).transpose(1, 2)  # (B, heads, T, head width)
                   for z in self.qkv(x).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class GPTBlock(nn.Module):
    """A pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x)) with a 4x GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp[2].into_residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """A GPT over bytes (GPT-2's design, as nanoGPT's model.py writes it): token and learned position
    embeddings, pre-LayerNorm blocks, a final LayerNorm, and an output head that shares the token embedding's
    weight (tied: one tensor, so a sharded model must keep it one). No dropout, so a step does not depend on how
    the batch is split over processes. Weights start as GPT-2's: normal(0, 0.02), the projections into the
    residual stream scaled by 1/sqrt(2 layers), biases 0 (``init_weights``, module by module: also what
    zero.shard(init=) takes for a GPT built on the meta device).

    forward: int64 bytes (B, T), T <= context -> logits (B, T, vocab_size) for the byte after each position.
    """

    def __init__(self, vocab_size: int = 256, context: int = 128, layers: int = 4, width: int = 128,
                 heads: int = 4):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(GPTBlock(width, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied
        self.layers = layers
        for module in self.modules():
            self.init_weights(module)

    def init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialization of one module's own parameters: matrices (and embeddings) normal(0, 0.02), the
        projections into the residual stream normal(0, 0.02 / sqrt(2 layers)), biases 0, LayerNorms 1 and 0. The
        tied head is the token embedding's, which initializes it."""
        if module is self.head:
            return
        if isinstance(module, nn.LayerNorm):
            module.reset_parameters()
            return
        for name, p in module.named_parameters(recurse=False):
            if name == "bias":
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / (2 * self.layers) ** 0.5 if getattr(module, "into_residual", False) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"a sequence of {t} bytes is longer than the model's context of {self.context}")
        x = self.token_embedding(tokens) + self.position_embedding(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in module order: the units that ZeRO stage 3 and FSDP2 gather one at a time.
    torchvision's BasicBlock and Bottleneck (ResNets) and EncoderBlock (ViTs), the small ResNet's BasicBlock,
    the GPT's blocks;
    a model with none of them (the small net) has its layers that hold parameters. What no block owns (a
    ResNet's stem and classifier, a ViT's patch embedding, class token, position embedding, last LayerNorm and
    head; a GPT's embeddings, tied head and last LayerNorm) stays with the root."""
    from torchvision.models.resnet import BasicBlock as TorchvisionBasicBlock, Bottleneck
    from torchvision.models.vision_transformer import EncoderBlock

    kinds = (BasicBlock, TorchvisionBasicBlock, Bottleneck, EncoderBlock, GPTBlock)
    found = [m for m in model.modules() if isinstance(m, kinds)]
    return found or [child for child in model.children() if any(True for _ in child.parameters())]


# ----------------------------------------------------------------------------------------------------------
# Built on the meta device: the eager build's weights, module by module (zero.shard's init=)
# ----------------------------------------------------------------------------------------------------------
def initializer(model: nn.Module, device: torch.device | str = "cpu") -> zero_init.Replay:
    """zero.shard(init=)'s fn for a model of build_model made under torch.device("meta"): bit for bit the weights
    build_model gives eagerly on ``device`` from the same generator state, at any world size. Each constructor
    draws its random numbers in its own order (every nn.Linear its reset_parameters as it is made, then the model's
    own loop over all of them); zero.init.Replay replays that order module by module: ``construction`` lists the
    steps of the eager build."""
    return zero_init.Replay(construction(model), device)


def construction(model: nn.Module) -> list[tuple[Any, ...]]:
    """The eager build's initializations in the order it runs them, each (module, what it does to that module's
    own tensors), and False after them where the eager build drops the values (zero.init.Replay)."""
    from torchvision.models import ResNet as TorchvisionResNet, VisionTransformer

    if isinstance(model, GPT):  # every layer's reset_parameters as made (the head's on its own, untied weight:
        # those draws are taken, their values dropped), then GPT-2's initialization
        made = [(m, zero_init.reset_parameters, m is not model.head) for m in model.modules()]
        return made + [(m, model.init_weights) for m in model.modules()]
    if isinstance(model, TorchvisionResNet):
        return [(m, zero_init.reset_parameters) for m in resnet_construction_order(model)] + \
               [(m, torchvision_resnet_init) for m in model.modules()]
    if isinstance(model, VisionTransformer):
        return vit_construction(model)
    return [(m, zero_init.reset_parameters) for m in model.modules()]  # net, resnet: made in module order


def resnet_construction_order(model: nn.Module) -> list[nn.Module]:
    """torchvision's ResNet makes a layer's downsample before the block that holds it."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        downsample = getattr(module, "downsample", None)
        if isinstance(downsample, nn.Module):
            order.extend(downsample.modules())
        order.append(module)
        for child in module.children():
            if child is not downsample:
                visit(child)

    visit(model)
    return order


def torchvision_resnet_init(module: nn.Module) -> None:
    """torchvision ResNet's loop after construction (zero_init_residual off, as build_model makes it)."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):  # SyncBatchNorm'd or not
        nn.init.constant_(module.weight, 1)
        nn.init.constant_(module.bias, 0)


def vit_construction(model: nn.Module) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
    """torchvision's VisionTransformer (patchify stem, no representation layer), as its constructors run: the
    stem's reset_parameters, the position embedding's normal draw, each block's attention (its out_proj made and
    reset inside MultiheadAttention's constructor, then its _reset_parameters) and MLP (both Linears made, then
    MLPBlock's xavier and normal loop), the head; then the stem's truncated normal and the head's zeros."""
    reset = zero_init.reset_parameters
    steps: list[tuple[nn.Module, Callable[[nn.Module], None]]] = [(model.conv_proj, reset),
                                                                    (model, lambda m: nn.init.zeros_(m.class_token))]
    steps.append((model.encoder, lambda m: nn.init.normal_(m.pos_embedding, std=0.02)))
    for block in model.encoder.layers:
        attention, first, second = block.self_attention, block.mlp[0], block.mlp[3]
        steps += [(block.ln_1, reset), (attention.out_proj, reset), (attention, attention_reset),
                  (attention.out_proj, lambda m: nn.init.zeros_(m.bias)), (block.ln_2, reset),
                  (first, reset), (second, reset), (first, mlp_init), (second, mlp_init)]
    steps += [(model.encoder.ln, reset), (model.heads.head, reset), (model.conv_proj, vit_stem_init),
              (model.heads.head, lambda m: (nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)))]
    return steps


def attention_reset(module: nn.Module) -> None:
    """nn.MultiheadAttention._reset_parameters on its own tensors (its out_proj's bias is a step of its own)."""
    nn.init.xavier_uniform_(module.in_proj_weight)
    nn.init.zeros_(module.in_proj_bias)


def mlp_init(module: nn.Module) -> None:
    nn.init.xavier_uniform_(module.weight)
    nn.init.normal_(module.bias, std=1e-6)


def vit_stem_init(module: nn.Module) -> None:
    fan_in = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
    nn.init.trunc_normal_(module.weight, std=math.sqrt(1 / fan_in))
    nn.init.zeros_(module.bias)


def build_model(name: str, dropout: float, norm: str, num_classes: int = NUM_CLASSES, image_size: int = 32,
                context: int | None = None) -> nn.Module:
    """The model with its BatchNorm layers as --norm says (local = plain per-process BatchNorm).

    A GPT (``name`` in LANGUAGE_MODELS) predicts ``num_classes`` symbols (256: bytes) over ``context`` positions
    (default its size's); it has no BatchNorm and no dropout.

    A ViT cuts the image into patches: its image size must be a multiple of the patch size (a UsageError
    otherwise), and it takes only that size (torchvision's ViT checks the input's height and width).
    """
    if name in ("vit",) + TORCHVISION_VITS:
        patch = SMALL_VIT["patch_size"] if name == "vit" else int(name.rsplit("_", 1)[1])
        if image_size % patch:
            raise UsageError(f"--model {name} needs an image size divisible by {patch}, got {image_size}")
    if name in LANGUAGE_MODELS:
        size = dict(GPT_SIZES[name], **({"context": context} if context else {}))
        return GPT(vocab_size=num_classes, **size)
    if name == "net":
        model = Net(dropout, num_classes, image_size)
    elif name == "resnet":
        model = ResNet(num_classes=num_classes)
    elif name == "vit":
        import torchvision

        model = torchvision.models.VisionTransformer(image_size=image_size, num_classes=num_classes, **SMALL_VIT)
    else:
        import torchvision

        size = {"image_size": image_size} if name in TORCHVISION_VITS else {}
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **size)
    if norm == "custom":
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    elif norm == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model
