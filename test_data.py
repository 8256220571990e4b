"""data.py: the in-memory batches against torchvision's transforms, their device traffic on CUDA (traced), and
the image-folder samples' independence from order, worker and the caller's RNG."""
import os

import pytest
import torch

import data


def test_cifar_augmentation_is_torchvisions_random_crop_and_flip():
    import torchvision.transforms.functional as TF

    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    ours = data.crop_flip(images, data.crop_flip_draws(6, torch.Generator().manual_seed(0)))
    draws = torch.Generator().manual_seed(0)  # the same draws, in the same order
    top, left = torch.randint(0, 9, (6,), generator=draws), torch.randint(0, 9, (6,), generator=draws)
    flip = torch.rand(6, generator=draws) < 0.5
    for i in range(6):  # RandomCrop(32, padding=4) then RandomHorizontalFlip, with those parameters
        expected = TF.crop(TF.pad(images[i], [4]), int(top[i]), int(left[i]), 32, 32)
        assert torch.equal(ours[i], TF.hflip(expected) if flip[i] else expected)
    assert 0 < int(flip.sum()) < 6


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
        batch, labels = memory.train.batch(torch.arange(16), torch.Generator().manual_seed(0))
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
