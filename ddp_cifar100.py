"""Data-parallel training of image classifiers: hand-written gradient averaging next to PyTorch's
DistributedDataParallel, on CIFAR-100, a synthetic set, or any image folder up to ImageNet scale.

    torchrun --standalone --nproc_per_node N ddp_cifar100.py [flags]     (python ddp_cifar100.py: a world of 1)

Every rank holds a full replica of the model and sees its own shard of each epoch's data (DistributedSampler,
seeded by --seed and the epoch). A micro-batch is B samples per rank; K = --grad-accum micro-batches make one
optimizer step, so one step consumes K*B*W samples on W ranks.

Gradient averaging (--grad-sync custom). Let n be the number of samples this rank sees in the current window of
K micro-batches (the same on every rank: the sampler pads the shards to equal length). Each micro-batch's loss
is its summed cross-entropy divided by n, so after K backward passes a rank holds sum_i grad l_i / n over its
n samples; averaging that over W ranks gives

    g = 1/W sum_r 1/n sum_{i in window of r} grad l_i = 1/(W n) sum_{i in window} grad l_i,

the gradient of the mean loss of one batch of K*B*W samples. An epoch whose last window is shorter than K
micro-batches (or whose last micro-batch is short) gets the same formula with its own n, so it still steps with
the exact mean. BatchNorm statistics are taken per micro-batch (over all ranks with SyncBatchNorm), which is what
a single process would do with micro-batches of B*W.

Only the last micro-batch of a window communicates: gradients live in flat buckets (each parameter's .grad is
a view into one), filled in reverse parameter order the way backward produces them. With --sync-mode overlap a
post-accumulate-grad hook counts each bucket's parameters down and, once it is complete, divides it by W and
starts an asynchronous all_reduce (SUM), so communication of late layers overlaps the backward of early ones;
buckets are launched strictly in index order so every rank issues the same collectives in the same order.
--sync-mode after launches every bucket once backward is over. Before the optimizer step all handles are waited
on; with fp16 the gradient scaler unscales the synchronized gradients. The K-1 other micro-batches do no
all_reduce at all. Parameters and buffers are broadcast from rank 0 at start. --allreduce ring|butterfly hands
each complete bucket instead to allreduce.py's own algorithm (which averages, so there is no division first),
run by a thread of its own over a process group of its own, so it still overlaps backward and never interleaves
with SyncBatchNorm's collectives on the default group.

--grad-sync ddp does the same with DistributedDataParallel, skipping its all-reduce on the K-1 micro-batches.

Data. Two sources behind one interface (micro-batch sizes of an epoch, the micro-batches from a given one on,
validation batches of an index shard): CIFAR-100 and the synthetic set sit in memory as uint8 tensors on the
training device and are gathered, cropped and flipped there; an image folder (--dataset imagefolder,
torchvision's ImageFolder layout DIR/train/<class>/*, DIR/val/<class>/*) is streamed: DataLoader worker
processes (--workers) decode with PIL and augment with torchvision's transforms, the sample list is two numpy
arrays (paths, labels) so it costs the workers no copy. Every sample's augmentation is drawn from a generator
seeded by (seed, epoch, sample index), so it does not depend on --workers. A file that cannot be decoded is
marked, not raised, by whoever decodes it; the ranks agree on such marks with one small all_reduce per
micro-batch (before any collective of the forward pass), so every rank stops at the same point and rank 0
names the file.

Validation: rank 0 splits the validation indices into W contiguous shards (sizes differ by at most one), pads
them to equal length with the true length in front, and sends them with dist.scatter; every rank evaluates its
shard with the running BatchNorm statistics (broadcast from rank 0 first) and the float64 loss sums and int64
top-1/top-5 counts are dist.reduce'd to rank 0, so the accuracy equals a single-process evaluation for any world
size.

Checkpoints and exact resume: rank 0 writes DIR/last.pt atomically (temporary file, flush, fsync, os.replace)
at epoch ends, every --checkpoint-every steps and when --max-steps stops the run. Nothing random is carried from
step to step: the data order comes from (seed, epoch), in-memory augmentation from (seed, epoch, rank,
micro-batch), image-folder augmentation from (seed, epoch, sample) and dropout from a reseed with (seed, rank,
optimizer step) before every step, so the checkpoint (model, optimizer, scheduler, scaler, position in the epoch)
is all a resumed run needs to continue bit for bit; a resumed image-folder run decodes none of the samples it
skips. On resume rank 0 reads the file and broadcasts it, so other nodes need no shared file system.

Bit-for-bit claims (resume, restarts, two nodes, custom == DDP) are facts of the CPU kernels. On CUDA,
convolutions pick nondeterministic algorithms unless asked: --deterministic sets
torch.use_deterministic_algorithms (warn_only: ops without a deterministic CUDA kernel, such as adaptive average
pooling's backward in the ResNets, warn instead of stopping, and break the claim where they warn), turns off
cuDNN benchmarking and sets CUBLAS_WORKSPACE_CONFIG.

Fault injection, for tests of elastic restarts: DDP_CIFAR100_FAULT="RANK:STEP" makes that rank SIGKILL itself
right after optimizer step STEP, but only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT
unset or 0), so that the restarted group runs through.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

import utils
from syncbn import SyncBatchNorm

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 100  # CIFAR-100 and the synthetic set
TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
WARMUP_STEPS = 3  # optimizer steps left out of the step-time statistics (allocator and autograd warm-up)
FAULT_ENV = "DDP_CIFAR100_FAULT"
NORM_TORCH_ON_CPU = ("--norm torch (nn.SyncBatchNorm) needs CUDA: use --device cuda (with a GPU), or --norm custom "
                     "or --norm local on the CPU")


class UsageError(Exception):
    """Bad flags or inputs: rank 0 reports it in one line and every rank exits with status 2."""


def derive_seed(a: int, b: int, c: int) -> int:
    """A seed from three integers (seed, rank or epoch, step or index): nothing that would need saving."""
    return ((a * 1_000_003 + b) * 1_000_003 + c) % (2**63)


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
              memory_format: torch.memory_format) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> normalized floats of mean's dtype, laid out as the model wants."""
    return ((images.to(mean.dtype) / 255 - mean) / std).contiguous(memory_format=memory_format)


def micro_batch_sizes(dataset_size: int, world_size: int, batch_size: int) -> list[int]:
    """Sizes of one rank's micro-batches in an epoch: DistributedSampler pads every shard to ceil(N / W)."""
    per_rank = math.ceil(dataset_size / world_size)
    return [min(batch_size, per_rank - start) for start in range(0, per_rank, batch_size)]


def epoch_order(dataset_size: int, rank: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: DistributedSampler's shuffled, padded, strided shard."""
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=False)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler), dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------
# Data in memory: uint8 images on the training device, batches gathered, cropped and flipped there
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ImageSet:
    images: torch.Tensor  # (N, 3, 32, 32) uint8
    labels: torch.Tensor  # (N,) int64
    augment: bool  # random crop (padding 4) + horizontal flip, as torchvision's CIFAR recipe

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device) -> "ImageSet":
        return ImageSet(self.images.to(device), self.labels.to(device), self.augment)

    def batch(self, indices: torch.Tensor, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images and labels of ``indices`` (CPU int64), augmented with draws from ``generator``.

        The indices and the crop/flip draws travel to the device as one tensor, pinned and non-blocking on CUDA:
        nothing here waits for the device, and the draws (made on the CPU) are the same on every device.
        """
        host = indices[None] if not self.augment else torch.cat([indices[None], crop_flip_draws(len(indices),
                                                                                                generator)])
        if self.images.is_cuda:
            host = host.pin_memory()
        moved = host.to(self.images.device, non_blocking=True)  # (1 or 4, n): indices, then top, left, flip
        images = self.images[moved[0]]
        if self.augment:
            images = crop_flip(images, moved[1:])
        return images, self.labels[moved[0]]


def crop_flip_draws(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """(3, n) int64: crop top, crop left (0..8) and flip (0/1) per image, in torchvision's order of draws."""
    top = torch.randint(0, 9, (n,), generator=generator)
    left = torch.randint(0, 9, (n,), generator=generator)
    flip = (torch.rand(n, generator=generator) < 0.5).long()
    return torch.stack([top, left, flip])


def crop_flip(images: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """RandomCrop(32, padding=4) then RandomHorizontalFlip on a uint8 batch, with ``draws`` (crop_flip_draws)."""
    n, _, h, w = images.shape
    device = images.device
    padded = F.pad(images, (4, 4, 4, 4))  # zero padding, as RandomCrop(padding=4)
    top, left, flip = draws[0], draws[1], draws[2].bool()
    rows = (top[:, None] + torch.arange(h, device=device))[:, None, :, None]
    cols = (left[:, None] + torch.arange(w, device=device))[:, None, None, :]
    cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
    channels = torch.arange(3, device=device)[None, :, None, None]
    batch = torch.arange(n, device=device)[:, None, None, None]
    return padded[batch, channels, rows, cols]


def make_synthetic(train_size: int, val_size: int, seed: int, num_classes: int = NUM_CLASSES
                   ) -> tuple[ImageSet, ImageSet]:
    """A deterministic CIFAR-100-shaped set: each class a smooth random prototype image (a common background
    plus its own fainter pattern); each sample its class's prototype shifted by up to 4 pixels, blended with
    another class's (weaker) prototype, colour-jittered per channel and noisy.

    Learnable (the prototypes are fixed) but not at once: shifts, distractors, colour and noise keep accuracy
    rising for several epochs. Labels are uniform over the classes; train and validation come from separate
    streams.
    """
    generator = torch.Generator().manual_seed(seed)
    # A shared background plus a fainter class-specific pattern: classes resemble one another.
    coarse = 0.6 * torch.rand(1, 3, 8, 8, generator=generator) + 0.4 * torch.rand(num_classes, 3, 8, 8,
                                                                                 generator=generator)
    prototypes = F.interpolate(coarse, size=(40, 40), mode="bicubic", align_corners=False).clamp(0, 1)

    def sample(size: int, stream: int) -> ImageSet:
        g = torch.Generator().manual_seed(seed * 1000 + stream)
        labels = torch.randint(0, num_classes, (size,), generator=g)
        images = torch.empty(size, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, size, 4096):  # bounded temporary memory for large sets
            y = labels[start:start + 4096]
            n = len(y)
            top = torch.randint(0, 9, (n,), generator=g)
            left = torch.randint(0, 9, (n,), generator=g)
            rows = (top[:, None] + torch.arange(32))[:, None, :, None]
            cols = (left[:, None] + torch.arange(32))[:, None, None, :]
            idx = torch.arange(n)[:, None, None, None]
            ch = torch.arange(3)[None, :, None, None]
            own = prototypes[y][idx, ch, rows, cols]
            other = prototypes[torch.randint(0, num_classes, (n,), generator=g)][idx, ch, rows, cols]
            mix = 0.3 + 0.2 * torch.rand(n, 1, 1, 1, generator=g)
            colour = 0.7 + 0.6 * torch.rand(n, 3, 1, 1, generator=g)
            noise = 0.25 * torch.randn(n, 3, 32, 32, generator=g)
            x = ((1 - mix) * own + mix * other) * colour + noise
            images[start:start + n] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
        return ImageSet(images, labels, augment=False)

    return sample(train_size, 1), sample(val_size, 2)


def load_cifar100(data_dir: str, ctx: utils.DistContext, comm_device: torch.device) -> tuple[ImageSet, ImageSet]:
    """torchvision's CIFAR-100: local rank 0 of each node downloads while the others wait; the test split validates."""
    import torchvision

    failure = ""
    if ctx.local_rank == 0:
        quiet = contextlib.redirect_stdout(io.StringIO()) if ctx.rank != 0 else contextlib.nullcontext()
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)  # torchvision's download sets none: an unreachable mirror must not hang
        try:
            with quiet:
                for train in (True, False):
                    torchvision.datasets.CIFAR100(data_dir, train=train, download=True)
        except Exception as exc:  # no network, bad folder, corrupt archive: all end in the same advice
            failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            socket.setdefaulttimeout(previous_timeout)
    failed = torch.tensor([1 if failure else 0], device=comm_device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # also the barrier the other local ranks wait at
    if failed.item():
        raise UsageError(f"CIFAR-100 is not in --data-dir {data_dir!r} and could not be downloaded"
                         f"{' (' + failure + ')' if failure else ' on another node'}; put it there or use "
                         f"--dataset synthetic")
    sets = []
    for train in (True, False):
        raw = torchvision.datasets.CIFAR100(data_dir, train=train, download=False)
        images = torch.from_numpy(raw.data).permute(0, 3, 1, 2).contiguous()
        sets.append(ImageSet(images, torch.tensor(raw.targets, dtype=torch.int64), augment=train))
    return sets[0], sets[1]


@dataclass
class MemoryData:
    """CIFAR-100 or the synthetic set on the training device, behind the data interface the trainer uses."""
    train: ImageSet
    val: ImageSet
    num_classes: int
    seed: int
    batch_size: int
    memory_format: torch.memory_format = torch.contiguous_format
    mean: torch.Tensor = field(init=False)
    std: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        device = self.train.images.device  # constants made once, on the device
        self.mean = torch.tensor(CIFAR100_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(CIFAR100_STD, device=device).view(1, 3, 1, 1)

    def batch_sizes(self) -> list[int]:
        return micro_batch_sizes(len(self.train), dist.get_world_size(), self.batch_size)

    def train_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches ``start``, ``start + 1``, ... of ``epoch``: normalized images and labels on the device."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        batches = torch.split(epoch_order(len(self.train), rank, world_size, self.seed, epoch), self.batch_size)
        for j in range(start, len(batches)):
            augment = torch.Generator().manual_seed(derive_seed(self.seed + epoch, rank, j))
            images, labels = self.train.batch(batches[j], augment)
            yield normalize(images, self.mean, self.std, self.memory_format), labels

    def val_batches(self, shard: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(shard), batch_size):
            images, labels = self.val.batch(shard[start:start + batch_size])
            yield normalize(images, self.mean, self.std, self.memory_format), labels

    def close(self) -> None:
        pass

    @property
    def val_size(self) -> int:
        return len(self.val)


# ----------------------------------------------------------------------------------------------------------
# Image folders: decoded and augmented in DataLoader workers, streamed from disk
# ----------------------------------------------------------------------------------------------------------
def scan_image_folder(root: str, classes: list[str] | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Class names, relative paths (numpy bytes) and labels (numpy int64) of an ImageFolder tree, sorted.

    Files are kept by extension as torchvision's ImageFolder does (other files are skipped). Numpy arrays, not a
    list of tuples: DataLoader workers share them without the reference-count writes that copy Python objects
    page by page into every worker. ``classes`` (train's) makes a validation class absent from them an error.
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

    if not os.path.isdir(root):
        raise UsageError(f"{root} is not a folder: --data-dir must hold train/<class>/* and val/<class>/*")

    def refuse(error: OSError) -> None:
        raise error  # os.walk (and so torchvision's make_dataset) would skip an unreadable folder silently

    paths: list[bytes] = []
    labels: list[int] = []
    try:
        found, class_to_index = find_classes(root)
        unknown = sorted(set(found) - set(classes)) if classes is not None else []
        if unknown:
            raise UsageError(f"{root} has classes that train/ lacks: {', '.join(unknown[:5])}"
                             f"{' ...' if len(unknown) > 5 else ''}")
        for name in found:
            before = len(paths)
            for folder, _, files in sorted(os.walk(os.path.join(root, name), onerror=refuse, followlinks=True)):
                paths += [os.fsencode(os.path.relpath(os.path.join(folder, f), root)) for f in sorted(files)
                          if f.lower().endswith(IMG_EXTENSIONS)]
            if len(paths) == before:
                raise UsageError(f"{root}: class folder {name!r} has no images ({', '.join(IMG_EXTENSIONS)})")
            labels += [classes.index(name) if classes is not None else class_to_index[name]] * (len(paths) - before)
    except FileNotFoundError as exc:  # find_classes: no class folder at all
        raise UsageError(f"{root}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:  # unreadable folder (permissions, I/O)
        raise UsageError(f"cannot read {exc.filename or root}: {exc.strerror or exc}") from None
    return (classes if classes is not None else found), np.array(paths), np.array(labels, dtype=np.int64)


def folder_transforms(augment: str, size: int) -> tuple[Any, Any]:
    """torchvision transforms (PIL in, uint8 tensor out) for training and validation at ``size`` pixels."""
    from torchvision.transforms import v2

    resized = round(size * 256 / 224) if augment == "imagenet" else size  # ImageNet: Resize(256), crop 224
    evaluation = [v2.Resize(resized), v2.CenterCrop(size)]
    training = {"imagenet": [v2.RandomResizedCrop(size), v2.RandomHorizontalFlip()],
                "cifar": [v2.Resize(size), v2.CenterCrop(size), v2.RandomCrop(size, padding=size // 8),
                          v2.RandomHorizontalFlip()],
                "none": evaluation}[augment]
    return v2.Compose([*training, v2.PILToTensor()]), v2.Compose([*evaluation, v2.PILToTensor()])


class FolderSamples(torch.utils.data.Dataset):
    """The samples of one split. An item is keyed by (epoch, index): its augmentation draws from the torch RNG
    seeded with (seed, epoch, index), so it is the same in any worker, with any --workers. A file that cannot be
    decoded gives a zero image and label -1 (marked, not raised: the trainer stops every rank together)."""

    def __init__(self, root: str, paths: np.ndarray, labels: np.ndarray, transform: Any, size: int, seed: int):
        self.root, self.paths, self.labels = root, paths, labels
        self.transform, self.size, self.seed = transform, size, seed

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.paths[index]))

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        from PIL import Image

        epoch, index = key
        try:
            with open(self.path(index), "rb") as f, Image.open(f) as image:
                image = image.convert("RGB")  # decodes; truncated or corrupt files raise here
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), -1
        with torch.random.fork_rng(devices=[]):  # the caller's RNG (dropout, with --workers 0) stays untouched
            torch.manual_seed(derive_seed(self.seed, epoch, index))
            return self.transform(image), int(self.labels[index])


class Batches:
    """A DataLoader batch_sampler whose batches are set before each pass (persistent workers keep the loader)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class FolderData:
    """An image folder streamed through DataLoader workers, behind the data interface the trainer uses."""

    def __init__(self, root: str, augment: str, size: int, workers: int, seed: int, batch_size: int,
                 device: torch.device, memory_format: torch.memory_format, check_group: Any):
        classes, train_paths, train_labels = scan_image_folder(os.path.join(root, "train"))
        _, val_paths, val_labels = scan_image_folder(os.path.join(root, "val"), classes)
        train_transform, val_transform = folder_transforms(augment, size)
        self.classes, self.num_classes = classes, len(classes)
        self.train = FolderSamples(os.path.join(root, "train"), train_paths, train_labels, train_transform, size,
                                   seed)
        self.val = FolderSamples(os.path.join(root, "val"), val_paths, val_labels, val_transform, size, seed)
        self.seed, self.batch_size, self.device, self.memory_format = seed, batch_size, device, memory_format
        self.check_group = check_group  # gloo: agreeing on bad files never waits for the GPU
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
        self.loaders = {}
        for name, samples in (("train", self.train), ("val", self.val)):
            self.loaders[name] = torch.utils.data.DataLoader(
                samples, batch_sampler=Batches(), num_workers=workers, persistent_workers=workers > 0,
                pin_memory=device.type == "cuda")

    @property
    def val_size(self) -> int:
        return len(self.val)

    def batch_sizes(self) -> list[int]:
        return micro_batch_sizes(len(self.train), dist.get_world_size(), self.batch_size)

    def signature(self) -> list[int]:
        """What every rank must see alike: sample and class counts, and a hash of the file lists."""
        digest = hashlib.sha256(b"".join(self.train.paths) + b"".join(self.val.paths)).digest()
        return [len(self.train), len(self.val), self.num_classes, int.from_bytes(digest[:7], "little")]

    def _stream(self, name: str, batches: list[list[int]], epoch: int
                ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
        loader = self.loaders[name]
        loader.batch_sampler.batches = [[(epoch, index) for index in batch] for batch in batches]
        for indices, (images, labels) in zip(batches, loader):
            images = normalize(images.to(self.device, non_blocking=True), self.mean, self.std, self.memory_format)
            yield indices, images, labels

    def _agree_on_bad_file(self, samples: FolderSamples, bad_index: int) -> None:
        """All ranks learn the largest bad sample index any of them found (-1: none) and stop together."""
        flag = torch.tensor([bad_index], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.check_group)
        if flag.item() >= 0:
            raise UsageError(f"cannot decode {samples.path(flag.item())}: corrupt, truncated or not an image; "
                             f"remove or replace it")

    def train_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches ``start``, ``start + 1``, ... of ``epoch`` (the ones before are not decoded)."""
        rank, world_size = dist.get_rank(), dist.get_world_size()
        order = epoch_order(len(self.train), rank, world_size, self.seed, epoch)
        batches = [b.tolist() for b in torch.split(order, self.batch_size)][start:]
        for indices, images, labels in self._stream("train", batches, epoch):
            bad = (labels < 0).nonzero()
            # Before the forward pass and its collectives, so a bad file anywhere stops every rank here.
            self._agree_on_bad_file(self.train, indices[int(bad[0])] if len(bad) else -1)
            yield images, labels.to(self.device, non_blocking=True)

    def val_batches(self, shard: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of the shard; shards differ in length, so bad files are agreed on once, at the end."""
        bad_index = -1
        batches = [b.tolist() for b in torch.split(shard, batch_size)]
        for indices, images, labels in self._stream("val", batches, epoch=0):
            good = labels >= 0
            if not good.all():
                bad_index = max(bad_index, indices[int((~good).nonzero()[0])])
                images, labels = images[good.to(self.device)], labels[good]
            yield images, labels.to(self.device, non_blocking=True)
        self._agree_on_bad_file(self.val, bad_index)

    def close(self) -> None:
        """Stop the persistent workers now rather than at interpreter exit."""
        self.loaders = {}


def load_data(args: argparse.Namespace, ctx: utils.DistContext, comm_device: torch.device
              ) -> MemoryData | FolderData:
    """The data ``args`` name, agreed on by every rank (a rank that fails to read it stops them all)."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.dataset == "imagefolder":
        check_group = dist.new_group(backend="gloo") if ctx.backend == "nccl" else None  # every rank calls it
        failure, data = "", None
        try:
            data = FolderData(args.data_dir, args.augment, args.image_size, args.workers, args.seed, args.batch_size,
                              ctx.device, memory_format, check_group)
        except UsageError as exc:
            failure = str(exc)
        views: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(views, (failure, data.signature() if data else None))
        failures = [f for f, _ in views if f]
        if failures:
            raise UsageError(failures[0])
        if any(signature != views[0][1] for _, signature in views):
            raise UsageError(f"--data-dir {args.data_dir} holds different files on different ranks")
        return data
    if args.dataset == "synthetic":
        train_set, val_set = make_synthetic(args.train_size, args.val_size, args.seed)
    else:
        train_set, val_set = load_cifar100(args.data_dir, ctx, comm_device)
    train_set.augment = args.augment == "cifar"
    return MemoryData(train_set.to(ctx.device), val_set.to(ctx.device), NUM_CLASSES, args.seed, args.batch_size,
                      memory_format)


# ----------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------
# Gradient averaging: hand-written, or DistributedDataParallel behind the same interface
# ----------------------------------------------------------------------------------------------------------
class GradientSync:
    """Averages gradients over the process group in flat buckets, one all_reduce per bucket (see the docstring
    at the top). Call ``prepare(sync)`` before each backward, ``finish()`` before the optimizer step of a window
    and ``zero_grad()`` after it; parameters' .grad are views into the buckets and must not be set to None.

    Buckets follow DistributedDataParallel's sizing: reverse parameter order, the first at most 1 MB, the others
    at most ``bucket_mb``. ``allreduce`` "torch" divides a bucket by W and all_reduces it (SUM) asynchronously;
    "ring" or "butterfly" hands it to allreduce.py's algorithm on an AllreduceThread (its own thread and
    process group, so SyncBatchNorm's collectives on the default group meanwhile cannot interleave with it),
    which averages it; either way the buckets are launched in index order and ranks end bit-identical.
    """

    def __init__(self, model: nn.Module, bucket_mb: float, overlap: bool, allreduce: str = "torch",
                 timeout_s: float | None = None):
        self.world_size = dist.get_world_size()
        # ring/butterfly: allreduce.py's algorithms average the buckets on a thread of their own, over a
        # process group of their own (made here, by every rank at the same point); torch: all_reduce (SUM).
        from allreduce import AllreduceThread
        self.averager = None if allreduce == "torch" else AllreduceThread(allreduce, timeout_s)
        params = [p for p in model.parameters() if p.requires_grad]
        cap_bytes = int(bucket_mb * 2**20)
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            limit = min(cap_bytes, 2**20) if len(buckets) == 1 else cap_bytes
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and (size + nbytes > limit or p.dtype != buckets[-1][0].dtype):
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        self.flats: list[torch.Tensor] = []
        self.sizes = [len(b) for b in buckets]
        for index, bucket in enumerate(buckets):
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if overlap:
                    p.register_post_accumulate_grad_hook(partial(self._grad_ready, index))
            self.flats.append(flat)
        self.sync = False
        self.pending: list[int] = []
        self.launched = 0
        self.handles: list[Any] = []

    def prepare(self, sync: bool) -> None:
        """Before a backward: ``sync`` is True only on the last micro-batch of a window."""
        self.sync = sync
        if sync:
            self.pending = list(self.sizes)
            self.launched = 0
            self.handles = []

    def _grad_ready(self, index: int, _param: torch.Tensor) -> None:
        if not self.sync:
            return
        self.pending[index] -= 1
        while self.launched < len(self.flats) and self.pending[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        flat = self.flats[self.launched]
        if self.averager is not None:
            self.handles.append(self.averager.submit(flat))  # averages: no division here
        else:
            flat.div_(self.world_size)
            self.handles.append(dist.all_reduce(flat, async_op=True))
        self.launched += 1

    def finish(self) -> None:
        """Launch what the hooks have not (all of it in after-backward mode) and wait for every bucket."""
        while self.launched < len(self.flats):
            self._launch()
        for handle in self.handles:
            handle.wait() if self.averager is None else handle.result()  # a Future re-raises the thread's error
        self.handles = []
        self.sync = False

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.zero_()


class DDPSync:
    """DistributedDataParallel behind GradientSync's interface, so the training step has no branch for it."""

    def __init__(self, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer):
        self.ddp, self.optimizer = ddp, optimizer

    def prepare(self, sync: bool) -> None:
        # What no_sync() does, as a setting: DDP reads it in forward and keeps it for that backward.
        self.ddp.require_backward_grad_sync = sync

    def finish(self) -> None:
        pass  # DDP waits for its buckets at the end of backward

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def broadcast_state(model: nn.Module, buffers_only: bool = False) -> None:
    """Rank 0's parameters (unless ``buffers_only``) and buffers to every rank."""
    with torch.no_grad():
        tensors = list(model.buffers()) + ([] if buffers_only else list(model.parameters()))
        for t in tensors:
            dist.broadcast(t, src=0)


# ----------------------------------------------------------------------------------------------------------
# Validation: index shards scattered from rank 0, sums reduced to rank 0
# ----------------------------------------------------------------------------------------------------------
def scatter_shard(total: int, comm_device: torch.device) -> torch.Tensor:
    """This rank's contiguous slice of range(total), sent by rank 0 with dist.scatter.

    dist.scatter needs tensors of one size: each shard is padded to ceil(total / W) and carries its true
    length in front.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    width = math.ceil(total / world_size) + 1
    received = torch.empty(width, dtype=torch.int64, device=comm_device)
    shards = None
    if rank == 0:
        shards = []
        for shard in torch.tensor_split(torch.arange(total, dtype=torch.int64), world_size):
            message = torch.full((width,), -1, dtype=torch.int64)
            message[0] = len(shard)
            message[1:1 + len(shard)] = shard
            shards.append(message.to(comm_device))
    dist.scatter(received, shards, src=0)
    return received[1:1 + int(received[0])].cpu()


@torch.no_grad()
def evaluate(model: nn.Module, data: MemoryData | FolderData, batch_size: int, device: torch.device,
             comm_device: torch.device, amp_dtype: torch.dtype | None) -> dict[str, Any]:
    """Loss, top-1 and top-5 accuracy over all of ``data``'s validation set (exact on rank 0; the other ranks
    get their shard's figures)."""
    was_training = model.training
    model.eval()
    shard = scatter_shard(data.val_size, comm_device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # correct top-1, correct top-5, seen
    for images, labels in data.val_batches(shard, batch_size):
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(images)
        loss_sum += F.cross_entropy(logits.float() if amp_dtype else logits, labels, reduction="none").double().sum()
        top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
        counts[0] += (logits.argmax(1) == labels).sum()
        counts[1] += (top5 == labels[:, None]).any(1).sum()
        counts[2] += len(labels)
    loss_sum, counts = loss_sum.to(comm_device), counts.to(comm_device)
    dist.reduce(loss_sum, dst=0)
    dist.reduce(counts, dst=0)
    model.train(was_training)
    correct, correct5, total = (int(c) for c in counts)
    return {"val_loss": float(loss_sum) / max(total, 1), "val_acc": correct / max(total, 1),
            "val_acc5": correct5 / max(total, 1), "val_correct": correct, "val_correct5": correct5,
            "val_total": total}


# ----------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------
def trajectory_config(args: argparse.Namespace, world_size: int, schedule_steps: int,
                      data: MemoryData | FolderData) -> dict[str, Any]:
    """The settings that decide the sequence of weights; a checkpoint resumes only a run that agrees on all."""
    config = {key: getattr(args, key) for key in
              ("model", "dataset", "batch_size", "grad_accum", "epochs", "lr", "momentum", "weight_decay",
               "scheduler", "amp", "seed", "augment", "image_size")}
    config["dropout"] = args.dropout if args.model == "net" else None
    config["sizes"] = [len(data.train), data.val_size, data.num_classes] if args.dataset != "cifar100" else None
    config["norm"] = "local" if args.norm == "local" else "synchronized"  # custom and torch compute the same
    config["world_size"] = world_size
    config["schedule_steps"] = schedule_steps if args.scheduler == "onecycle" else None
    return config


def fingerprint(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves the old file or the new one, never half of one."""
    with utils.atomic_write(path, "wb") as f:
        torch.save(state, f)


def read_checkpoint(path: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(f"cannot read checkpoint {path}: corrupt or not written by torch.save "
                         f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); "
                         f"delete it to start afresh") from None
    required = ("model", "optimizer", "scheduler", "scaler", "epoch", "micro_batch", "optimizer_steps",
                "micro_batches_total", "fingerprint", "config", "history", "epoch_sums")
    if not isinstance(state, dict) or any(key not in state for key in required):
        raise UsageError(f"cannot read checkpoint {path}: not a checkpoint of this script; delete it to start afresh")
    return state


def load_on_rank0(path: str) -> dict[str, Any] | None:
    """Rank 0 reads ``path`` (if it exists) and broadcasts it, so other nodes need not see the file."""
    message: list[Any] = [None]
    if dist.get_rank() == 0 and os.path.exists(path):
        try:
            message[0] = ("ok", read_checkpoint(path))
        except UsageError as exc:
            message[0] = ("error", str(exc))
    dist.broadcast_object_list(message, src=0)
    if message[0] is None:
        return None
    status, payload = message[0]
    if status == "error":
        raise UsageError(payload)
    return payload


def check_compatible(state: dict[str, Any], config: dict[str, Any], path: str) -> None:
    if state["fingerprint"] == fingerprint(config):
        return
    saved = state["config"]
    differences = [f"{key} {saved.get(key)!r} != {config.get(key)!r}" for key in sorted(config)
                   if saved.get(key) != config.get(key)]
    raise UsageError(f"checkpoint {path} is from another configuration ({', '.join(differences) or 'fingerprint'})"
                     f"; use another --checkpoint-dir or delete it")


# ----------------------------------------------------------------------------------------------------------
# Training: set-up, resume, one epoch of optimizer steps, evaluation, checkpoint, summary
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Position:
    """Where a run stands: the epoch, its next micro-batch, and the totals so far (with the weights, all a resume
    needs)."""
    epoch: int = 0
    micro_batch: int = 0
    optimizer_steps: int = 0
    micro_batches: int = 0


@dataclass
class EpochSums:
    """This rank's running sums over the epoch so far, float64 on the device (adding never waits for it)."""
    loss: torch.Tensor
    correct: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def of(cls, values: list[float], device: torch.device) -> "EpochSums":
        return cls(*(torch.tensor(v, dtype=torch.float64, device=device) for v in values))

    @torch.no_grad()
    def add(self, per_sample_loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.loss += per_sample_loss.detach().double().sum()
        self.correct += (logits.argmax(1) == labels).sum()
        self.seen += len(labels)

    def gather(self, comm_device: torch.device) -> list[list[float]]:
        """Every rank's [loss, correct, seen]: what a checkpoint keeps, and what the epoch's figures sum."""
        mine = torch.stack([self.loss, self.correct, self.seen]).to(comm_device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [t.tolist() for t in everyone]


@dataclass
class Run:
    """What the set-up builds; the loop changes only the model's state, the Position and the timings."""
    args: argparse.Namespace
    ctx: utils.DistContext
    comm_device: torch.device  # where collectives' tensors live: the GPU with nccl, else the CPU
    data: MemoryData | FolderData
    model: nn.Module  # the bare model: checkpoints and evaluation
    forward: nn.Module  # what the training step calls: the model, or DDP around it
    sync: GradientSync | DDPSync
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    steps_per_epoch: int
    config: dict[str, Any]
    checkpoint_path: str | None
    writer: Any = None
    timer: utils.IntervalTimer = None  # type: ignore[assignment]
    data_wait_ms: list[float] = field(default_factory=list)  # per optimizer step, host time waiting for batches

    @property
    def device(self) -> torch.device:
        return self.ctx.device


def make_deterministic() -> None:
    """--deterministic: deterministic kernels on CUDA (the CPU ones used here already are; see the docstring)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def set_up(args: argparse.Namespace) -> Run:
    """Process group, data, model (same weights everywhere), optimizer, schedule and gradient sync."""
    try:
        ctx = utils.init_distributed(args.device, args.backend, args.timeout)
    except ValueError as exc:  # e.g. --device cuda on a machine without a GPU: before any collective
        raise UsageError(str(exc)) from None
    device = ctx.device
    comm_device = device if ctx.backend == "nccl" else torch.device("cpu")
    if args.norm == "torch" and device.type != "cuda":
        raise UsageError(NORM_TORCH_ON_CPU)
    if args.deterministic:
        make_deterministic()
    data = load_data(args, ctx, comm_device)

    torch.manual_seed(args.seed)
    model = build_model(args.model, args.dropout, args.norm, data.num_classes, args.image_size)
    model = model.to(device, memory_format=data.memory_format)
    broadcast_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(data.batch_sizes()) / args.grad_accum)
    schedule_steps = args.epochs * steps_per_epoch
    if args.max_steps:
        schedule_steps = min(schedule_steps, args.max_steps)
    scheduler = None
    if args.scheduler == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=schedule_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    forward: nn.Module = model
    if args.grad_sync == "ddp":
        forward = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                          bucket_cap_mb=args.bucket_mb, forward_sync_buffers=False,
                                          gradient_as_bucket_view=True)
        sync: GradientSync | DDPSync = DDPSync(forward, optimizer)
    else:
        sync = GradientSync(model, args.bucket_mb, args.sync_mode == "overlap", args.allreduce, args.timeout)
    writer = None
    if ctx.rank == 0 and args.log_dir:
        from torch.utils.tensorboard import SummaryWriter  # slow to import; only when asked for
        writer = SummaryWriter(args.log_dir)
    return Run(args, ctx, comm_device, data, model, forward, sync, optimizer, scheduler, scaler,
               {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp], steps_per_epoch,
               trajectory_config(args, ctx.world_size, schedule_steps, data),
               os.path.join(args.checkpoint_dir, "last.pt") if args.checkpoint_dir else None, writer,
               utils.IntervalTimer(device))


def resume(run: Run) -> tuple[Position, list[dict[str, Any]], list[float]]:
    """Position, finished epochs and this rank's sums of the current epoch, from DIR/last.pt if there is one."""
    path = run.checkpoint_path
    state = load_on_rank0(path) if path else None
    if state is None:
        return Position(), [], [0.0, 0.0, 0.0]
    position = Position(optimizer_steps=state["optimizer_steps"], micro_batches=state["micro_batches_total"])
    if run.args.eval_only:
        try:
            run.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise UsageError(f"checkpoint {path} does not fit --model {run.args.model}: "
                             f"{str(exc).splitlines()[0]}") from None
        return position, list(state["history"]), [0.0, 0.0, 0.0]
    check_compatible(state, run.config, path)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if run.scheduler is not None:
        run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    position.epoch, position.micro_batch = state["epoch"], state["micro_batch"]
    utils.print0(f"resuming from {path}: epoch {position.epoch + 1}, micro-batch {position.micro_batch}, "
                 f"optimizer step {position.optimizer_steps}")
    sums = list(state["epoch_sums"][run.ctx.rank]) if position.micro_batch else [0.0, 0.0, 0.0]
    return position, list(state["history"]), sums


def checkpoint(run: Run, position: Position, history: list[dict[str, Any]], sums: list[list[float]]) -> None:
    """Rank 0 writes the run's state at ``position`` (every rank's epoch sums included) to DIR/last.pt."""
    if run.checkpoint_path is None or run.ctx.rank != 0:
        return
    save_checkpoint(run.checkpoint_path, {
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict() if run.scheduler is not None else None,
        "scaler": run.scaler.state_dict(), "epoch": position.epoch, "micro_batch": position.micro_batch,
        "optimizer_steps": position.optimizer_steps, "micro_batches_total": position.micro_batches,
        "history": history, "epoch_sums": sums, "fingerprint": fingerprint(run.config), "config": run.config,
        "rng_seed": run.args.seed,  # every random draw derives from it and the position (module docstring)
    })


def optimizer_step(run: Run, position: Position, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                   sizes: list[int], sums: EpochSums) -> int:
    """The window of up to K micro-batches from ``position``, then one update; returns the global sample count."""
    args = run.args
    window = range(position.micro_batch, min(position.micro_batch + args.grad_accum, len(sizes)))
    window_samples = sum(sizes[j] for j in window)  # the n of the module docstring
    torch.manual_seed(derive_seed(args.seed, run.ctx.rank, position.optimizer_steps))  # dropout
    run.timer.start()
    waited = 0.0
    for j in window:
        # next micro-batch (already being decoded by the loader's workers on the streaming path)
        start = time.perf_counter()
        images, labels = next(batches)
        waited += time.perf_counter() - start
        # forward and backward; the gradient average starts on the window's last micro-batch only
        run.sync.prepare(sync=j == window[-1])
        with torch.autocast(run.device.type, dtype=run.amp_dtype or torch.float32,
                            enabled=run.amp_dtype is not None):
            logits = run.forward(images)
            per_sample = F.cross_entropy(logits.float() if run.amp_dtype else logits, labels, reduction="none")
        run.scaler.scale(per_sample.sum() / window_samples).backward()
        sums.add(per_sample, logits, labels)
    # wait for the average, then update
    run.sync.finish()
    run.scaler.unscale_(run.optimizer)  # after the sync: every rank unscales (and inf-checks) the same gradients
    run.scaler.step(run.optimizer)
    run.scaler.update()
    if run.scheduler is not None:
        run.scheduler.step()
    run.sync.zero_grad()
    run.timer.stop()
    run.data_wait_ms.append(waited * 1e3)
    position.optimizer_steps += 1
    position.micro_batches += len(window)
    position.micro_batch = window[-1] + 1
    return window_samples * run.ctx.world_size


def stop_requested(args: argparse.Namespace, position: Position) -> bool:
    return bool(args.max_steps) and position.optimizer_steps >= args.max_steps


def train_epoch(run: Run, position: Position, history: list[dict[str, Any]], sums: EpochSums) -> tuple[int, int]:
    """Optimizer steps from ``position`` to the epoch's end or --max-steps; returns (steps, samples) taken."""
    args, rank = run.args, run.ctx.rank
    fault_rank, fault_step = -1, -1
    if os.environ.get(FAULT_ENV) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        fault_rank, fault_step = (int(v) for v in os.environ[FAULT_ENV].split(":"))
    sizes = run.data.batch_sizes()
    batches = run.data.train_batches(position.epoch, position.micro_batch)
    bar = tqdm(total=run.steps_per_epoch, initial=position.micro_batch // args.grad_accum,
               desc=f"epoch {position.epoch + 1}", disable=not (rank == 0 and sys.stderr.isatty()), leave=False)
    steps, samples = 0, 0
    run.model.train()
    while position.micro_batch < len(sizes) and not stop_requested(args, position):
        # one optimizer step
        samples += optimizer_step(run, position, batches, sizes, sums)
        steps += 1
        # progress
        bar.update(1)
        if not bar.disable and bar.n % 10 == 0:
            bar.set_postfix(loss=f"{float(sums.loss / sums.seen):.3f}")
        # checkpoint inside the epoch (its end is checkpointed after evaluation)
        at_interval = args.checkpoint_every and position.optimizer_steps % args.checkpoint_every == 0
        if (stop_requested(args, position) or at_interval) and position.micro_batch < len(sizes):
            epoch_sums = sums.gather(run.comm_device)
            checkpoint(run, position, history, epoch_sums)
        # fault injection (see the module docstring)
        if rank == fault_rank and position.optimizer_steps == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)
    batches.close()  # a run stopped mid-epoch leaves the rest undecoded
    bar.close()
    run.timer.collect()
    return steps, samples


def validate(run: Run) -> dict[str, Any]:
    broadcast_state(run.model, buffers_only=True)  # evaluate with rank 0's running statistics everywhere
    return evaluate(run.model, run.data, max(run.args.batch_size, 256), run.device, run.comm_device, run.amp_dtype)


def end_epoch(run: Run, position: Position, history: list[dict[str, Any]], sums: EpochSums,
              samples: int, train_time: float, epoch_start: float) -> dict[str, Any]:
    """Evaluate, record and print an epoch (or the part of it --max-steps allowed); checkpoint a finished one."""
    args = run.args
    loss_sum, correct, seen = (sum(column) for column in zip(*sums.gather(run.comm_device)))
    val = validate(run)
    entry = {"epoch": position.epoch + 1, "optimizer_steps": position.optimizer_steps,
             "train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1), **val,
             "epoch_time_s": time.perf_counter() - epoch_start, "samples_per_s": samples / max(train_time, 1e-9),
             "lr": run.optimizer.param_groups[0]["lr"]}
    complete = position.micro_batch >= len(run.data.batch_sizes())
    if complete:
        history.append(entry)
        position.epoch, position.micro_batch = position.epoch + 1, 0
        checkpoint(run, position, history, [[0.0, 0.0, 0.0]] * run.ctx.world_size)
    else:
        entry["complete"] = False
    if run.writer is not None:
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "val_acc5", "samples_per_s", "lr"):
            run.writer.add_scalar(key, entry[key], position.optimizer_steps)
    utils.print0(f"epoch {entry['epoch']}/{args.epochs}{'' if complete else ' (stopped by --max-steps)'} | "
                 f"train loss {entry['train_loss']:.4f} acc {100 * entry['train_acc']:.2f}% | "
                 f"val loss {entry['val_loss']:.4f} acc {100 * entry['val_acc']:.2f}% "
                 f"top-5 {100 * entry['val_acc5']:.2f}% ({entry['val_correct']}/{entry['val_total']}) | "
                 f"{entry['samples_per_s']:.0f} samples/s | {entry['epoch_time_s']:.1f} s")
    return entry


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training (or evaluation) ``args`` describe; returns the metrics and, on every rank, the model."""
    wall_start = time.perf_counter()
    # set-up and resume
    run = set_up(args)
    try:
        position, history, epoch_sums = resume(run)
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        utils.print0(f"{args.model} ({trainable:,} parameters, {run.data.num_classes} classes) on "
                     f"{run.ctx.world_size} x {run.device.type} ({run.ctx.backend}), grad-sync {args.grad_sync}, "
                     f"norm {args.norm}, {args.batch_size} x {args.grad_accum} x {run.ctx.world_size} samples "
                     f"per step, {run.steps_per_epoch} steps per epoch")
        utils.reset_peak_memory(run.device)
        train_time, samples_trained, run_steps, final = 0.0, 0, 0, None
        while not args.eval_only and final is None and position.epoch < args.epochs \
                and not stop_requested(args, position):
            # train until the epoch ends or --max-steps
            epoch_start = time.perf_counter()
            sums = EpochSums.of(epoch_sums if position.micro_batch else [0.0, 0.0, 0.0], run.device)
            steps, samples = train_epoch(run, position, history, sums)
            epoch_time = time.perf_counter() - epoch_start
            train_time, samples_trained = train_time + epoch_time, samples_trained + samples
            run_steps += steps
            # evaluate, log, checkpoint
            entry = end_epoch(run, position, history, sums, samples, epoch_time, epoch_start)
            final = entry if entry.get("complete") is False else None
        # the final figures: the last epoch's, or one evaluation when nothing was trained
        if run.writer is not None:
            run.writer.close()
        if final is None and run_steps and history:
            final = history[-1]
        if final is None:  # --eval-only, or a checkpoint with nothing left to train
            val = validate(run)
            final = {"train_loss": history[-1]["train_loss"] if history else None, **val}
            utils.print0(f"evaluation | val loss {val['val_loss']:.4f} acc {100 * val['val_acc']:.2f}% top-5 "
                         f"{100 * val['val_acc5']:.2f}% ({val['val_correct']}/{val['val_total']})")
        metrics = summarize(run, position, history, final, trainable, train_time, samples_trained, wall_start)
    finally:
        run.data.close()
    if run.ctx.rank == 0 and args.metrics_out:
        utils.write_json(args.metrics_out, metrics)
    metrics["model"] = run.model  # for in-process callers (tests); not part of the JSON
    return metrics


def summarize(run: Run, position: Position, history: list[dict[str, Any]], final: dict[str, Any], trainable: int,
              train_time: float, samples_trained: int, wall_start: float) -> dict[str, Any]:
    """The metrics JSON: the final figures, step-time statistics (warm-up left out) and the configuration."""
    times = run.timer.times_ms
    steps = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times
    waits = run.data_wait_ms[len(times) - len(steps):]
    return {
        "world_size": run.ctx.world_size, "device": run.device.type, "backend": run.ctx.backend,
        "optimizer_steps": position.optimizer_steps, "micro_batches": position.micro_batches,
        "trainable_parameters": trainable, "num_classes": run.data.num_classes,
        **{key: final[key] for key in ("train_loss", "val_loss", "val_acc", "val_acc5", "val_correct",
                                       "val_correct5", "val_total")},
        "peak_memory_mb": utils.max_across_ranks(utils.peak_memory_mb(run.device)),
        "wall_time_s": time.perf_counter() - wall_start, "train_time_s": train_time,
        "samples_per_s": samples_trained / train_time if train_time else 0.0,
        "step_time_ms_median": statistics.median(steps) if steps else None,
        "step_time_ms_p10": utils.percentile(steps, 10), "step_time_ms_p90": utils.percentile(steps, 90),
        "step_time_ms_mean": statistics.fmean(steps) if steps else None,
        "step_time_warmup_steps": len(times) - len(steps), "step_times_ms": [round(t, 4) for t in steps],
        "data_wait_ms_median": statistics.median(waits) if waits else None,
        "epochs": history + ([final] if final.get("complete") is False else []),
        "fingerprint": fingerprint(run.config), "config": vars(run.args),
    }


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line, from rank 0) instead of printing usage on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--dataset", choices=("cifar100", "synthetic", "imagefolder"), default="cifar100",
        help="imagefolder: DIR/train/<class>/* and DIR/val/<class>/* (torchvision's ImageFolder layout)")
    add("--data-dir", default="data", help="where CIFAR-100 is (or is downloaded to by local rank 0), or the folder")
    add("--train-size", type=int, default=10000, help="synthetic training set size")
    add("--val-size", type=int, default=2000, help="synthetic validation set size")
    add("--image-size", type=int, default=None, help="imagefolder: side of the crops (default 224)")
    add("--augment", choices=("imagenet", "cifar", "none"), default=None,
        help="training augmentation: imagenet = RandomResizedCrop + flip (validation: Resize + CenterCrop), cifar "
             "= RandomCrop with padding S/8 + flip; default imagenet for folders, cifar for cifar100, none for "
             "synthetic")
    add("--workers", type=int, default=0, help="imagefolder: DataLoader processes that decode and augment")
    add("--model", choices=("net", "resnet") + TORCHVISION_RESNETS, default="net",
        help="net and resnet: small models for 32-pixel images; resnet18... : torchvision's (weights=None)")
    add("--channels-last", action="store_true", help="model and batches in channels-last memory format")
    add("--dropout", type=float, default=0.5, help="net: dropout2 rate, dropout1 gets half (0 disables both)")
    add("--grad-sync", choices=("custom", "ddp"), default="custom")
    add("--allreduce", choices=("torch", "ring", "butterfly"), default="torch",
        help="custom: which all-reduce averages the buckets (torch.distributed's, or allreduce.py's own)")
    add("--sync-mode", choices=("overlap", "after"), default="overlap",
        help="custom: all_reduce buckets from gradient hooks during backward, or after it")
    add("--bucket-mb", type=float, default=25.0, help="gradient bucket size cap (DDP's bucket_cap_mb)")
    add("--norm", choices=("custom", "torch", "local"), default="custom")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--batch-size", type=int, default=128, help="per-process micro-batch")
    add("--epochs", type=int, default=10)
    add("--max-steps", type=int, default=0, help="stop after this many optimizer steps in all (0: no limit)")
    add("--lr", type=float, default=0.05)
    add("--momentum", type=float, default=0.9)
    add("--weight-decay", type=float, default=5e-4)
    add("--scheduler", choices=("none", "onecycle"), default="none")
    add("--amp", choices=("off", "bf16", "fp16"), default="off")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto")
    add("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    add("--seed", type=int, default=0)
    add("--deterministic", action="store_true",
        help="deterministic CUDA kernels, so that bit-for-bit resume holds on a GPU too (slower)")
    add("--checkpoint-dir", default=None, help="DIR/last.pt is written by rank 0 and resumed from when present")
    add("--checkpoint-every", type=int, default=0, help="also checkpoint every N optimizer steps (0: epoch ends)")
    add("--eval-only", action="store_true", help="evaluate DIR/last.pt (or the fresh model) and exit")
    add("--log-dir", default=None, help="TensorBoard scalars from rank 0")
    add("--metrics-out", default=None, help="JSON summary from rank 0")
    add("--timeout", type=float, default=1800.0, help="seconds, for process-group set-up and collectives")
    args = parser.parse_args(argv)
    positive = {"--grad-accum": args.grad_accum, "--batch-size": args.batch_size, "--epochs": args.epochs,
                "--train-size": args.train_size, "--val-size": args.val_size, "--lr": args.lr,
                "--bucket-mb": args.bucket_mb, "--timeout": args.timeout}
    for flag, value in positive.items():
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    for flag, value in {"--max-steps": args.max_steps, "--checkpoint-every": args.checkpoint_every,
                        "--momentum": args.momentum, "--weight-decay": args.weight_decay}.items():
        if value < 0:
            raise UsageError(f"{flag} must not be negative, got {value}")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.allreduce != "torch" and args.grad_sync == "ddp":
        raise UsageError(f"--allreduce {args.allreduce} is for --grad-sync custom (DDP uses its own all-reduce)")
    return resolve_data_flags(args)


def resolve_data_flags(args: argparse.Namespace) -> argparse.Namespace:
    """Dataset-dependent defaults (--augment, --image-size), and the flags that only an image folder takes."""
    if args.workers < 0:
        raise UsageError(f"--workers must not be negative, got {args.workers}")
    if args.dataset == "imagefolder":
        args.augment = args.augment or "imagenet"
        args.image_size = 224 if args.image_size is None else args.image_size
        minimum = 10 if args.model == "net" else 1  # net: two 3x3 convolutions and a 2x2 pool before fc1
        if args.image_size < minimum:
            raise UsageError(f"--image-size must be at least {minimum} for --model {args.model}, "
                             f"got {args.image_size}")
        return args
    if args.augment == "imagenet":
        raise UsageError("--augment imagenet is for --dataset imagefolder; in-memory sets take cifar or none")
    if args.image_size not in (None, 32):
        raise UsageError(f"--image-size is for --dataset imagefolder ({args.dataset} images are 32 pixels)")
    if args.workers:
        raise UsageError(f"--workers is for --dataset imagefolder ({args.dataset} sits in memory)")
    args.augment = args.augment or ("cifar" if args.dataset == "cifar100" else "none")
    args.image_size = 32
    return args


def is_distributed_failure(exc: BaseException) -> bool:
    """A peer that never joined, died or stalled past --timeout (gloo raises some of these as RuntimeError)."""
    if isinstance(exc, dist.DistError):
        return True
    message = str(exc).lower()
    return any(marker in message for marker in ("gloo", "nccl", "connection closed by peer", "connection reset",
                                                "timed out", "timeout"))


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    launched_by_torchrun = utils.launched_by_torchrun()
    try:
        args = parse_args(argv)
        if args.norm == "torch" and (args.device == "cpu" or not torch.cuda.is_available()):
            raise UsageError(NORM_TORCH_ON_CPU)  # before the process group: no rank waits for another
        train(args)
        dist.barrier()  # destroy the group together (rank 0 may still be writing the metrics), as c10d advises
        return 0
    except UsageError as exc:
        if rank == 0:
            print(f"ddp_cifar100.py: error: {exc}", file=sys.stderr, flush=True)
        elif launched_by_torchrun:
            time.sleep(5)  # torchrun stops the group when one worker exits: let rank 0 be heard first
        return 2
    except RuntimeError as exc:
        if not is_distributed_failure(exc):
            raise  # a bug: keep its traceback
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"ddp_cifar100.py: rank {rank}: distributed failure (peer missing, dead or past --timeout): "
              f"{first_line[:300]}", file=sys.stderr, flush=True)
        return 1
    finally:
        utils.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
