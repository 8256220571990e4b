"""data.py: the in-memory batches against torchvision's transforms, their device traffic on CUDA (traced), their
per-sample draws (SplitMix64 bit for bit, the same on any split of the batch, uniform), and the image-folder
samples' independence from order, worker and the caller's RNG."""
import os

import pytest
import torch

import data


def test_cifar_augmentation_is_torchvisions_random_crop_and_flip():
    import torchvision.transforms.functional as TF

    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    draws = data.crop_flip_draws(torch.arange(6), 0, 0)
    ours = data.crop_flip(images, draws)
    for i, (top, left, flip) in enumerate(draws.T.tolist()):  # RandomCrop(32, padding=4), RandomHorizontalFlip
        expected = TF.crop(TF.pad(images[i], [4]), top, left, 32, 32)
        assert torch.equal(ours[i], TF.hflip(expected) if flip else expected)
    assert 0 < int(draws[2].sum()) < 6


def test_the_hash_is_splitmix64_bit_for_bit():
    """mix64 on int64 tensors and splitmix64 on Python ints against SplitMix64's published outputs for seed
    1234567 (Rosetta Code, "Pseudo-random numbers/Splitmix64"): their intermediate values are negative as int64,
    so an arithmetic shift would show."""
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                16408922859458223821]
    outputs = data.mix64(1234567 + torch.arange(1, 6) * data.int64(data.GAMMA))
    assert [v % 2**64 for v in outputs.tolist()] == expected
    assert [data.splitmix64(1234567 + n * data.GAMMA) for n in range(5)] == expected  # the epoch key's twin


def augmented_epoch(rank, world_size, batch_size, epoch, start):
    """{sample index: augmented, normalized image} of this rank's micro-batches ``start``... of ``epoch``."""
    train, _ = data.make_synthetic(48, 8, seed=4)
    train.augment = True
    memory = data.MemoryData(train, train, 100, 7, batch_size)
    order = data.epoch_order(48, rank, world_size, 7, epoch)[start * batch_size:]
    images = torch.cat([images for images, _ in memory.train_batches(epoch, start)])
    return dict(zip(order.tolist(), images))


def test_in_memory_augmentation_depends_on_seed_epoch_and_index_only(local_group):
    """Each sample gets the same crop and flip on 1 process x 16, 2 processes x 8, and 2 x 4 resumed at
    micro-batch 2: whatever rank, micro-batch and batch size it falls into (what resuming on another number of
    processes with the same global batch needs)."""
    one = local_group(1).run(augmented_epoch, 16, 1, 0)[0]
    two = {k: v for ranks in local_group(2).run(augmented_epoch, 8, 1, 0) for k, v in ranks.items()}
    resumed = {k: v for ranks in local_group(2).run(augmented_epoch, 4, 1, 2) for k, v in ranks.items()}
    assert sorted(one) == sorted(two) == list(range(48)) and len(resumed) == 32
    assert all(torch.equal(one[i], two[i]) for i in range(48))
    assert all(torch.equal(one[i], image) for i, image in resumed.items())


def test_in_memory_augmentation_differs_between_epochs_and_seeds():
    train, _ = data.make_synthetic(64, 8, seed=4)
    train.augment = True
    indices = torch.arange(64)
    draws = {key: data.crop_flip_draws(indices, *key) for key in ((7, 0), (7, 1), (8, 0))}
    assert torch.equal(draws[(7, 0)], data.crop_flip_draws(indices, 7, 0))
    for other in ((7, 1), (8, 0)):  # a sample keeps its draws with probability 1/162 only
        assert int((draws[(7, 0)] != draws[other]).any(0).sum()) >= 56
        epoch_images, _ = train.batch(indices, other)
        assert int((train.batch(indices, (7, 0))[0] != epoch_images).flatten(1).any(1).sum()) >= 56
    assert torch.equal(train.batch(indices)[0], train.images)  # no key: no augmentation


def test_crop_flip_draws_are_uniform():
    """The 9 x 9 x 2 outcomes over 20k samples of one epoch: Pearson's chi-square (161 degrees of freedom) inside
    its two-sided 1e-5 band (95, 250): neither biased nor too regular (a counter without the mixing would be)."""
    for seed, epoch in ((0, 0), (7, 3)):
        top, left, flip = data.crop_flip_draws(torch.arange(20000), seed, epoch)
        counts = torch.bincount(top * 18 + left * 2 + flip, minlength=162).double()
        assert len(counts) == 162 and counts.min() > 0
        expected = 20000 / 162
        assert 95 < float(((counts - expected) ** 2 / expected).sum()) < 250


def test_in_memory_batches_make_one_non_blocking_copy_and_no_sync_on_cuda(monkeypatch):
    """Traced with FakeTensorMode (no GPU needed): an augmented micro-batch on a CUDA-resident set costs one
    host-to-device copy, non-blocking, and nothing that waits for the device (.item(), a blocking copy)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopyLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.to_device, self.syncs = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            source = [a.device.type for a in args if isinstance(a, torch.Tensor)]
            if func is torch.ops.aten._to_copy.default and source == ["cpu"] and out.device.type == "cuda":
                self.to_device.append((kwargs or {}).get("non_blocking", False))
            self.syncs += func is torch.ops.aten._local_scalar_dense.default
            return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # fake tensors cannot be pinned
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        images = torch.zeros(100, 3, 32, 32, dtype=torch.uint8, device="cuda")
        memory = data.MemoryData(data.ImageSet(images, torch.zeros(100, dtype=torch.int64, device="cuda"),
                                               augment=True), None, 100, 0, 16)
    log = CopyLog()
    with fake, log:
        batch, labels = memory.train.batch(torch.arange(16), (0, 0))
        batch = data.normalize(batch, memory.mean, memory.std, torch.channels_last)
    assert batch.device.type == labels.device.type == "cuda" and batch.shape == (16, 3, 32, 32)
    assert log.to_device == [True] and log.syncs == 0


def test_image_folder_augmentation_depends_on_seed_epoch_and_index_only(image_folder):
    """Per-sample seeding: the same item whatever the order of fetches, the process fetching it (DataLoader
    workers of this process) or the caller's RNG; another epoch gives another crop."""
    folder = data.FolderData(str(image_folder), "imagenet", 16, 0, 5, 4, torch.device("cpu"),
                              torch.contiguous_format, None)
    assert (len(folder.train), folder.val_size, folder.num_classes) == (40, 23, 8)  # notes.txt skipped
    keys = [(epoch, index) for epoch in (0, 1) for index in range(12)]
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    forward = {key: folder.train[key] for key in keys}
    assert torch.equal(torch.get_rng_state(), rng_before)  # --workers 0 leaves dropout's RNG alone
    torch.manual_seed(456)
    assert all(torch.equal(folder.train[key][0], forward[key][0]) for key in reversed(keys))
    assert sum(not torch.equal(forward[(0, i)][0], forward[(1, i)][0]) for i in range(12)) >= 10
    for workers in (1, 2):  # one or two worker processes, batches split across them
        sampler = data.Batches()
        sampler.batches = [keys[i:i + 3] for i in range(0, len(keys), 3)]
        loader = torch.utils.data.DataLoader(folder.train, batch_sampler=sampler, num_workers=workers)
        fetched = torch.cat([images for images, _ in loader])
        assert torch.equal(fetched, torch.stack([forward[key][0] for key in keys]))


def test_an_unreadable_folder_is_one_clear_error(image_folder, monkeypatch):
    real_scandir = os.scandir

    def refusing_scandir(path="."):
        if os.path.basename(os.fspath(path)) == "class003":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refusing_scandir)
    with pytest.raises(data.UsageError, match="cannot read .*class003: Permission denied"):
        data.scan_image_folder(str(image_folder / "train"))


@pytest.mark.parametrize("workers", [0, 1])
def test_image_folder_batches_draw_nothing_from_the_global_rng(image_folder, workers):
    """The trainer reseeds the global RNG for dropout before every step; streaming a folder's batches (opening
    the DataLoader's iterator included) must leave it as it was, or resumed runs see other dropout masks."""
    folder = data.FolderData(str(image_folder), "imagenet", 16, workers, 5, 4, torch.device("cpu"),
                             torch.contiguous_format, None)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for epoch in (0, 1):  # the persistent workers' second pass too
        assert len(list(folder._stream("train", [[0, 1, 2, 3], [4, 5]], epoch))) == 2
        assert torch.equal(torch.get_rng_state(), before)
    folder.close()
