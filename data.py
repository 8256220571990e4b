"""The trainer's data: in-memory sets (CIFAR-100, a synthetic set), image folders streamed from disk, and text
read as bytes, behind one interface (micro-batch sizes of an epoch, the micro-batches from a given one on,
validation batches of an index shard), and the per-rank epoch order they share.

CIFAR-100 and the synthetic set sit in memory as uint8 tensors on the training device and are gathered, cropped
and flipped there; an image folder (torchvision's ImageFolder layout DIR/train/<class>/*, DIR/val/<class>/*) is
streamed: DataLoader worker processes decode with PIL and augment with torchvision's transforms, the sample list
is two numpy arrays (paths, labels) so it costs the workers no copy.

Nothing random is carried from one batch to the next: the order comes from DistributedSampler seeded with
(seed, epoch), and every sample's augmentation from (seed, epoch, sample index) alone: in memory as a hash of the
three (SplitMix64, vectorized over the batch), in an image folder from the torch RNG seeded with them. So a
sample's crop and flip do not depend on --workers, nor on the rank, micro-batch, batch size or number of
processes it falls into, and a resumed run needs only its position (on any number of processes). Nor does
loading draw from the caller's global RNG (which the trainer reseeds for dropout): the DataLoaders have
generators of their own.

Text (--dataset text): every text file under a folder (by default the Python standard library's source), split
into training and validation by whole files ranked by a hash of their path, each split one byte stream cut into
windows of the context length that do not overlap; a sample is a window, its labels the next byte at each
position. The order is the same per-rank epoch order, so resume and validation work as for images.

A file that cannot be decoded is marked, not raised, by whoever decodes it; the ranks agree on such marks with
one small all_reduce per micro-batch (before any collective of the forward pass), so every rank stops at the
same point and rank 0 names the file.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import math
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

import utils
from utils import UsageError, one_line

CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 100  # CIFAR-100 and the synthetic set


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



class Splits:
    """What every data set of the trainer shares: ``train`` and ``val`` (anything with a length: samples or
    windows) and ``batch_size``, from which an epoch's micro-batch sizes on this rank follow. ``placement``: this
    process's rank and world in the training data's order, the process group's unless ``placed`` elsewhere (a
    replica group's place j of group I is rank I P + j of R P: trainer/replica_groups.py)."""
    train: Any
    val: Any
    batch_size: int
    placed: tuple[int, int] | None = None

    @property
    def val_size(self) -> int:
        return len(self.val)

    def placement(self) -> tuple[int, int]:
        return self.placed if self.placed is not None else (dist.get_rank(), dist.get_world_size())

    def batch_sizes(self) -> list[int]:
        return micro_batch_sizes(len(self.train), self.placement()[1], self.batch_size)



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

    def batch(self, indices: torch.Tensor, epoch_key: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images and labels of ``indices`` (CPU int64), augmented if the set is and ``epoch_key`` = (seed,
        epoch) is given (None: no augmentation, as for validation).

        The indices and the crop/flip draws travel to the device as one tensor, pinned and non-blocking on CUDA:
        nothing here waits for the device, and the draws (made on the CPU) are the same on every device.
        """
        augment = self.augment and epoch_key is not None
        host = torch.cat([indices[None], crop_flip_draws(indices, *epoch_key)]) if augment else indices[None]
        if self.images.is_cuda:
            host = host.pin_memory()
        moved = host.to(self.images.device, non_blocking=True)  # (1 or 4, n): indices, then top, left, flip
        images = self.images[moved[0]]
        if augment:
            images = crop_flip(images, moved[1:])
        return images, self.labels[moved[0]]


# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; Vigna's
# splitmix64.c): its n-th output for a seed s is mix(s + n * GAMMA), on uint64. Once on Python ints (the epoch's
# key), once on int64 tensors (a batch's samples).
GAMMA, MIX_1, MIX_2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(seed: int) -> int:
    """SplitMix64's first output for ``seed`` (taken mod 2**64), as a uint64 value in a Python int."""
    z = (seed + GAMMA) % 2**64
    z = (z ^ z >> 30) * MIX_1 % 2**64
    z = (z ^ z >> 27) * MIX_2 % 2**64
    return z ^ z >> 31


def int64(u: int) -> int:
    """The int64 value with the bits of the uint64 ``u``: how torch, which has no uint64 arithmetic, holds it."""
    return u - 2**64 if u >= 2**63 else u


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's mixing on int64 tensors, bit for bit its uint64 arithmetic.

    Two's complement makes +, * and ^ on int64 the same bits as on uint64 (torch's int64 arithmetic wraps). Only
    the right shift differs: on int64 it copies the sign bit, so each shift by k is masked to its low 64 - k bits,
    which makes it the logical shift of uint64.
    """
    z = (z ^ ((z >> 30) & (2**34 - 1))) * int64(MIX_1)
    z = (z ^ ((z >> 27) & (2**37 - 1))) * int64(MIX_2)
    return z ^ ((z >> 31) & (2**33 - 1))


def crop_flip_draws(indices: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """(3, n) int64: crop top, crop left (0..8) and flip (0/1) of each sample in ``indices`` (CPU int64) in
    ``epoch``: a function of (seed, epoch, index) alone, whatever batch, rank or world size the sample is in.

    The epoch's key is splitmix64(splitmix64(seed) + epoch); sample i's 64 bits h are output i + 1 of SplitMix64
    seeded with the key. No generator is made per sample: some twenty vectorized integer operations serve the
    whole batch (about 0.1 ms for 128 samples on one CPU core).

    Why uniform: SplitMix64's outputs pass BigCrush (the paper above), and within an epoch they are distinct
    (the mixing is a bijection of distinct states). r = (h's low 63 bits) mod 162 is uniform over 0..161 up to a
    relative bias of 162 / 2**63, and r <-> (top, left, flip) = (r mod 9, r // 9 mod 9, r // 81) is a bijection,
    so the three are uniform and independent of one another (test_data.py checks it with a chi-square bound).
    """
    key = int64(splitmix64(splitmix64(seed) + epoch))
    h = mix64((indices.to(torch.int64) + 1) * int64(GAMMA) + key)
    r = (h & (2**63 - 1)) % 162
    return torch.stack([r % 9, r // 9 % 9, r // 81])


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
    # every 32 x 32 crop of every prototype, as a view (class, channel, top, left, row, column): a sample's crop is
    # read from it alone, not from a copy of its prototype's whole 40 x 40 first
    crops = prototypes.unfold(2, 32, 1).unfold(3, 32, 1)

    def sample(size: int, stream: int) -> ImageSet:
        g = torch.Generator().manual_seed(seed * 1000 + stream)
        labels = torch.randint(0, num_classes, (size,), generator=g)
        images = torch.empty(size, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, size, 4096):  # bounded temporary memory for large sets
            y = labels[start:start + 4096]
            n = len(y)
            top = torch.randint(0, 9, (n,), generator=g)
            left = torch.randint(0, 9, (n,), generator=g)
            own = crops[y, :, top, left]  # (n, 3, 32, 32)
            other = crops[torch.randint(0, num_classes, (n,), generator=g), :, top, left]
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
            failure = one_line(exc)
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
class MemoryData(Splits):
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

    def train_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches ``start``, ``start + 1``, ... of ``epoch``: normalized images and labels on the device."""
        rank, world_size = self.placement()
        batches = torch.split(epoch_order(len(self.train), rank, world_size, self.seed, epoch), self.batch_size)
        for j in range(start, len(batches)):
            images, labels = self.train.batch(batches[j], (self.seed, epoch))
            yield normalize(images, self.mean, self.std, self.memory_format), labels

    def val_batches(self, shard: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(shard), batch_size):
            images, labels = self.val.batch(shard[start:start + batch_size])
            yield normalize(images, self.mean, self.std, self.memory_format), labels

    def close(self) -> None:
        pass


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
        raise UsageError(f"{root}: {one_line(exc)}") from None
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


class FolderData(Splits):
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
            # A generator of its own: without one, every iter() of a DataLoader draws its base seed from the
            # global RNG, which the trainer reseeds for dropout at each step, so the step that opens an epoch's
            # stream (the first of an epoch, or the first after a resume) would see other dropout masks.
            self.loaders[name] = torch.utils.data.DataLoader(
                samples, batch_sampler=Batches(), num_workers=workers, persistent_workers=workers > 0,
                pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed))

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
        order = epoch_order(len(self.train), *self.placement(), self.seed, epoch)
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


# ----------------------------------------------------------------------------------------------------------
# Text: the bytes of every text file under a folder, in windows of the model's context
# ----------------------------------------------------------------------------------------------------------
def default_text_dir() -> str:
    """The Python standard library's own source: tens of MB of real text on every machine that has Python (its
    site-packages, where installed packages go, is left out when reading it)."""
    import sysconfig

    return sysconfig.get_paths()["stdlib"]


def is_text(content: bytes) -> bool:
    """Non-empty, no NUL byte (the document separator below) and valid UTF-8."""
    if not content or b"\0" in content:
        return False
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_text_files(root: str) -> tuple[list[str], list[bytes]]:
    """The sorted relative paths and the bytes of every text file under ``root`` (``__pycache__`` skipped, and
    in the standard library's folder the installed packages)."""
    skipped = {"__pycache__"}
    if os.path.realpath(root) == os.path.realpath(default_text_dir()):
        skipped |= {"site-packages", "dist-packages"}
    if not os.path.isdir(root):
        raise UsageError(f"--data-dir {root} is not a folder (--dataset text reads every text file under it)")

    def refuse(error: OSError) -> None:
        raise error  # os.walk would skip an unreadable folder silently

    found: list[tuple[str, bytes]] = []
    try:
        for folder, folders, files in os.walk(root, onerror=refuse):
            folders[:] = sorted(f for f in folders if f not in skipped)
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.isfile(path):  # sockets, fifos, dangling links
                    continue
                with open(path, "rb") as f:
                    content = f.read()
                if is_text(content):
                    found.append((os.path.relpath(path, root), content))
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename or root}: {exc.strerror or exc}") from None
    if not found:
        raise UsageError(f"--data-dir {root} holds no text file (non-empty, UTF-8, no NUL byte)")
    found.sort()
    return [path for path, _ in found], [content for _, content in found]


def find_text_files(root: str) -> list[str]:
    """The sorted paths, relative to ``root``, of every text file under it (see read_text_files)."""
    return read_text_files(root)[0]


def path_rank(path: str) -> bytes:
    """A file's place in the split's ranking: the SHA-256 of its relative path (stable across machines)."""
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).digest()


def split_files(paths: list[str], sizes: list[int], val_fraction: float) -> tuple[list[str], list[str]]:
    """(training, validation) paths, each sorted: whole files, so no file is in both. The files are ranked by a
    hash of their path; validation takes the shortest prefix of that ranking that holds ``val_fraction`` of the
    bytes (at least one file, and never the last one)."""
    if len(paths) < 2:
        raise UsageError(f"--dataset text splits whole files into training and validation, so it needs at least 2 "
                         f"text files; found {len(paths)}")
    ranked = sorted(zip(paths, sizes), key=lambda item: path_rank(item[0]))
    wanted, taken, count = val_fraction * sum(sizes), 0, 0
    while count < len(ranked) - 1 and (count == 0 or taken < wanted):
        taken += ranked[count][1]
        count += 1
    return sorted(p for p, _ in ranked[count:]), sorted(p for p, _ in ranked[:count])


@dataclass
class TextSet:
    """One split as one byte stream (each file's bytes, then a 0 byte to end the document), read as windows of
    ``context`` + 1 bytes that do not overlap: window i is stream[i T : i T + T + 1], its first T bytes the
    inputs and its last T the targets (the byte after each input), so every byte after the first is predicted
    once per epoch, but for the fewer than T after the last whole window. The bytes live once, in a uint8 tensor (not one Python object per byte); a batch gathers its
    windows from it."""
    stream: torch.Tensor  # uint8 (n,)
    context: int

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.context

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 (B, context), of the windows ``indices`` (CPU int64)."""
        starts = indices.to(torch.int64)[:, None] * self.context
        windows = self.stream[starts + torch.arange(self.context + 1)].to(torch.int64)
        return windows[:, :-1], windows[:, 1:]


BOUNDARY = 0  # the byte that ends every document of the text set, so the one a document starts after: a GPT's
# begin-of-sequence (--generate starts every prompt after it; the export's bos_token_id)


def text_stream(contents: list[bytes]) -> torch.Tensor:
    """The files' bytes as one uint8 tensor, each file followed by a 0 byte (BOUNDARY: the end of a document)."""
    if not contents:
        return torch.zeros(0, dtype=torch.uint8)
    end = bytes([BOUNDARY])
    return torch.frombuffer(bytearray(end.join(contents) + end), dtype=torch.uint8)


class TextData(Splits):
    """Every text file under ``root`` split by file into training and validation, in windows of ``context``
    bytes, behind the data interface the trainer uses (labels are the next bytes: 256 classes per position)."""
    num_classes = 256
    memory_format = torch.contiguous_format

    def __init__(self, root: str, context: int, val_fraction: float, seed: int, batch_size: int,
                 device: torch.device):
        paths, contents = read_text_files(root)
        train_paths, val_paths = split_files(paths, [len(c) for c in contents], val_fraction)
        content_of = dict(zip(paths, contents))
        self.root, self.files = root, {"train": train_paths, "val": val_paths}
        self.train = TextSet(text_stream([content_of[p] for p in train_paths]), context)
        self.val = TextSet(text_stream([content_of[p] for p in val_paths]), context)
        for name, key in (("training", "train"), ("validation", "val")):
            split = getattr(self, key)
            if not len(split):
                raise UsageError(f"--context {context} is longer than the {name} split ({len(split.stream) - 1} "
                                 f"bytes to predict in {len(self.files[key])} files of {root}): lower --context "
                                 f"or add text")
        self.context, self.seed, self.batch_size, self.device = context, seed, batch_size, device

    def signature(self) -> list[int]:
        """What every rank must see alike: the splits' file lists and sizes."""
        digest = hashlib.sha256("\0".join(self.files["train"] + ["|"] + self.files["val"]).encode(
            "utf-8", "surrogateescape")).digest()
        return [len(self.train.stream), len(self.val.stream), int.from_bytes(digest[:7], "little")]

    def _on_device(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cuda":
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def train_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches ``start``, ``start + 1``, ... of ``epoch``: (inputs, targets) windows on the device."""
        order = epoch_order(len(self.train), *self.placement(), self.seed, epoch)
        for indices in torch.split(order, self.batch_size)[start:]:
            yield self._on_device(*self.train.batch(indices))

    def val_batches(self, shard: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(shard), batch_size):
            yield self._on_device(*self.val.batch(shard[start:start + batch_size]))

    def baselines(self) -> dict[str, float]:
        """What a model of the validation bytes must beat, in bits per byte of the validation stream: gzip -9
        (DEFLATE over the whole stream, gzip's header included), and the entropy of the bytes' histogram (the
        best code that ignores context: the floor any learning must go below)."""
        import gzip

        raw = self.val.stream.numpy().tobytes()
        counts = torch.bincount(self.val.stream.to(torch.int64), minlength=256).double()
        p = counts[counts > 0] / counts.sum()
        return {"gzip_bits_per_byte": 8 * len(gzip.compress(raw, compresslevel=9)) / len(raw),
                "unigram_bits_per_byte": float(-(p * p.log2()).sum())}

    def close(self) -> None:
        pass


def load_data(args: argparse.Namespace, ctx: utils.DistContext, comm_device: torch.device
              ) -> MemoryData | FolderData | TextData:
    """The data ``args`` name, agreed on by every rank (a rank that fails to read it stops them all)."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.dataset in ("imagefolder", "text"):  # read from --data-dir by every rank: they must agree
        check_group = None
        if args.dataset == "imagefolder" and ctx.backend == "nccl":
            check_group = dist.new_group(backend="gloo")  # every rank calls it
        failure, data = "", None
        try:
            if args.dataset == "text":
                data = TextData(args.data_dir, args.context, args.val_fraction, args.seed, args.batch_size,
                                ctx.device)
            else:
                data = FolderData(args.data_dir, args.augment, args.image_size, args.workers, args.seed,
                                  args.batch_size, ctx.device, memory_format, check_group)
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
