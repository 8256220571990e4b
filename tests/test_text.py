"""Byte-level text and the GPT (data.py, models.py, the trainer's --dataset text), tested through the spec's public
names: which files count as text, the hash-ranked split by bytes, the windows and their document separators, the
batches in the trainer's epoch order, the gzip and unigram baselines, the GPT's causality, tied head, context limit
and empty batches, and through the trainer: validation that counts every window once at 1, 2 and 3 processes,
exact resume mid-epoch (plain AdamW, and the recipe: betas, warm-up and cosine, clipping, decay groups),
sampling from a checkpoint, and one-line errors.

Corpora are tiny and written under tmp_path; the trainer runs its small "gpt" at --context 16 (the only model size
the trainer builds; a few seconds of CPU per run), the direct model tests a GPT of width 32.

Why the tolerances hold.
- Validation (test_every_validation_window_is_counted_once_at_any_world_size) runs in float64 (train_in_group's
  dtype argument). A float64 dot product of k terms is within k * 2^-53 relative of exact: k <= 640 (the MLP's
  4 x 160 inputs) gives < 1e-13, and four blocks, the head and the log-softmax compound that to at most ~1e-12
  per predicted byte; the mean over the 736 predicted bytes adds < 736 * 2^-53 < 1e-13. Sharding the windows
  over 1, 2 or 3 processes only changes batch shapes and the order of that sum, so 1e-10 relative leaves a
  factor of 100 over the worst case. The errors it guards against are first order: a fresh model's per-window
  losses spread by ~0.06 nats around 5.5, so one window lost or counted twice moves the mean by ~0.06 / 46 / 5.5
  = 2e-4 relative, six orders above 1e-10 (and val_total pins the count exactly).
- Resume is bit for bit (the spec's claim on the CPU): torch.equal on every tensor.
- Baselines: 8 * len(gzip) / len(bytes) is two correctly rounded float64 operations, so any order of computing it
  agrees within 4 * 2^-53 < 1e-15 relative. The unigram entropy of a stream with 4 byte values whose counts are
  powers of two is exactly 1.75 (or 2.0) bits; computing it as -sum p log2 p (or with ln and / ln 2) costs a few
  roundings per term: 1e-12 relative leaves orders of margin, and the mistakes it catches (separators left out,
  the training stream instead of the validation one) move it by > 0.1.
- val_bits_per_byte = val_loss / ln 2: one division and ln 2's own rounding, 1e-12 relative.
"""
import gzip
import math
import os
import random
import sysconfig
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import ddp_cifar100 as trainer
import models
from trainer_testing import train_in_group, try_train_in_group
from zero_testing import max_difference

CONTEXT = 16  # the trainer's GPT reads 16 bytes: 46 validation windows and 182 training windows below
VAL_FRACTION = 0.2


# ----------------------------------------------------------------------------------------------------------
# A small corpus: 10 UTF-8 files (some non-ASCII bytes, above 127) in 3 sub-folders, ~3.4 kB
# ----------------------------------------------------------------------------------------------------------
WORDS = ("the of and to in is that for it as with was on be by this are from or at which an but not have had "
         "his they you were her all she there been one their has more when will would who so no café naïve "
         "façade — déjà").split()


def corpus_files(seed: int = 1, count: int = 10) -> dict[str, bytes]:
    """{relative path: bytes}: whole words up to 200-500 bytes each (never a character cut in two)."""
    rng = random.Random(seed)
    files = {}
    for i in range(count):
        target, text = rng.randint(200, 500), b""
        while len(text) < target:
            text += (rng.choice(WORDS) + rng.choice("  \n")).encode()
        files[os.path.join(f"part{i % 3}", f"doc{i:02d}.txt")] = text
    return files


def write_files(root, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def expected_split(files: dict[str, bytes], fraction: float) -> tuple[list[str], list[str]]:
    names = sorted(files)
    return data.split_files(names, [len(files[n]) for n in names], fraction)


def expected_stream(files: dict[str, bytes], names: list[str]) -> torch.Tensor:
    """The spec's stream: each file's bytes then one 0 byte, files in sorted path order."""
    joined = b"".join(files[name] + b"\0" for name in sorted(names))
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


def unigram_bits(stream: torch.Tensor) -> float:
    counts = torch.bincount(stream.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = corpus_files()
    write_files(root, files)
    return root, files


def text_argv(root) -> list[str]:
    return ["--device", "cpu", "--dataset", "text", "--data-dir", str(root), "--model", "gpt",
            "--context", str(CONTEXT), "--val-fraction", str(VAL_FRACTION)]


# ----------------------------------------------------------------------------------------------------------
# Workers (module level: the spawned processes of local_group import them)
# ----------------------------------------------------------------------------------------------------------
def split_in_worker(rank, world_size, paths, sizes, fraction):
    return data.split_files(paths, sizes, fraction)


def all_windows(text_set) -> tuple[torch.Tensor, torch.Tensor]:
    return text_set.batch(torch.arange(len(text_set), dtype=torch.int64))


def text_data_views(rank, world_size, root, context, fraction, seed, batch_size):
    """What TextData shows on this rank: sizes, every window of both splits, its micro-batches of two epochs (the
    second from micro-batch 2 on) next to the spec's (epoch_order cut into batch_size pieces, then TextSet.batch),
    validation batches of an index shard next to TextSet.batch."""
    text = data.TextData(str(root), context, fraction, seed, batch_size, torch.device("cpu"))
    try:
        views = {"num_classes": text.num_classes, "val_size": text.val_size,
                 "lengths": (len(text.train), len(text.val)), "train": all_windows(text.train),
                 "val": all_windows(text.val), "batch_sizes": text.batch_sizes(), "epochs": {}}
        for epoch, start in ((0, 0), (1, 2)):
            order = data.epoch_order(len(text.train), rank, world_size, seed, epoch)
            expected = [text.train.batch(indices) for indices in torch.split(order, batch_size)][start:]
            views["epochs"][epoch] = (list(text.train_batches(epoch, start)), expected)
        shard = torch.arange(rank, len(text.val), world_size, dtype=torch.int64)  # any shard of indices
        views["val_batches"] = (list(text.val_batches(shard, 5)),
                                [text.val.batch(indices) for indices in torch.split(shard, 5)])
        return views
    finally:
        text.close()


def text_baselines(rank, world_size, root, context, fraction):
    text = data.TextData(str(root), context, fraction, 0, 4, torch.device("cpu"))
    try:
        return text.baselines(), all_windows(text.val)
    finally:
        text.close()


def usage_errors(rank, world_size, cases):
    """{case: "UsageError: ...", another exception's "Name: message", or the run's result} for each (case, argv):
    one case that fails otherwise does not hide the others."""
    results = {}
    for name, argv in cases.items():
        try:
            results[name] = try_train_in_group(rank, world_size, argv)
        except Exception as exc:  # noqa: BLE001 (reported by the test, case by case)
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


# ----------------------------------------------------------------------------------------------------------
# 1. The split
# ----------------------------------------------------------------------------------------------------------
PATHS = [f"pkg{i % 4}/module_{i:02d}.py" for i in range(24)]


def test_split_files_is_a_disjoint_hash_ranked_prefix_independent_of_input_order(local_group):
    rng = random.Random(0)
    sizes = [rng.randint(1, 5000) for _ in PATHS]
    size_of, total = dict(zip(PATHS, sizes)), sum(sizes)
    splits = {}
    for fraction in (0.05, 0.1, 0.3, 0.5):
        train, val = splits[fraction] = data.split_files(PATHS, sizes, fraction)
        assert train == sorted(train) and val == sorted(val)
        assert not set(train) & set(val) and sorted(train + val) == sorted(PATHS)
        held = sum(size_of[p] for p in val)
        assert held >= fraction * total, fraction
        # the shortest such prefix: without its last-ranked file (at most its largest) it would hold too little
        assert len(val) == 1 or held - max(size_of[p] for p in val) < fraction * total, fraction
        for _ in range(3):  # the input order plays no part
            pairs = list(zip(PATHS, sizes))
            rng.shuffle(pairs)
            assert data.split_files([p for p, _ in pairs], [s for _, s in pairs], fraction) == (train, val)
    # prefixes of one ranking: a larger fraction only adds files
    fractions = sorted(splits)
    for smaller, larger in zip(fractions, fractions[1:]):
        assert set(splits[smaller][1]) <= set(splits[larger][1])
    # a hash that is the same in every process (spawned workers: Python's own str hash is salted per process)
    assert all(result == splits[0.3] for result in local_group(2).run(split_in_worker, PATHS, sizes, 0.3))


def test_split_files_counts_bytes_keeps_a_file_on_each_side_and_refuses_fewer_than_two():
    equal = [100] * len(PATHS)  # equal sizes: the prefix is ceil(fraction * 24) files
    # 0: the empty prefix would do, but validation keeps one file; 0.99: all 24, less the one left to train
    for fraction, count in ((0.0, 1), (0.1, 3), (0.3, 8), (0.99, 23)):
        train, val = data.split_files(PATHS, equal, fraction)
        assert (len(val), len(train)) == (count, len(PATHS) - count), fraction
    # One file holding 98% of the bytes: validation is the files ranked before it and itself, so moving the big
    # file over the 24 paths walks the ranking (a ranking by size would put it first every time); where it ranks
    # last, validation stops one short of it, leaving it to training.
    lengths, left_to_train = [], 0
    for big in range(len(PATHS)):
        sizes = [10_000 if i == big else 10 for i in range(len(PATHS))]
        train, val = data.split_files(PATHS, sizes, 0.5)
        if train == [PATHS[big]]:
            left_to_train += 1
        else:
            assert PATHS[big] in val, big
            lengths.append(len(val))
    assert left_to_train == 1 and sorted(lengths) == list(range(1, len(PATHS)))
    for paths in ([], ["only.txt"]):
        with pytest.raises(data.UsageError):
            data.split_files(paths, [10] * len(paths), 0.1)


# ----------------------------------------------------------------------------------------------------------
# 2. Which files are text
# ----------------------------------------------------------------------------------------------------------
def feed_fifo(path: str, stop: threading.Event) -> None:
    """Writes a line into the named pipe if anyone opens it for reading: a reader that wrongly opens it gets text
    (and the test fails on the list) instead of blocking forever."""
    while not stop.is_set():
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.005)
            continue
        os.write(fd, b"a named pipe, not a regular file\n")
        os.close(fd)
        return


def test_find_text_files_keeps_utf8_text_and_skips_binary_empty_and_pycache(tmp_path):
    write_files(tmp_path, {
        "a.txt": b"plain ascii\n", os.path.join("sub", "b.py"): b"print('x')\n",
        os.path.join("sub", "deep", "c.md"): "café — naïve, déjà vu\n".encode(),
        os.path.join("sub", "nul.txt"): b"text with a\0NUL byte", "latin1.txt": "café".encode("latin-1"),
        "cut.txt": "café".encode()[:-1], "empty.txt": b"", "image.png": b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR",
        os.path.join("__pycache__", "notes.txt"): b"valid text in a skipped folder",
        os.path.join("sub", "__pycache__", "m.cpython-311.pyc"): b"also valid text",
    })
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.txt")  # not a regular file
    os.mkfifo(tmp_path / "pipe.txt")  # nor is a named pipe
    stop = threading.Event()
    feeder = threading.Thread(target=feed_fifo, args=(str(tmp_path / "pipe.txt"), stop), daemon=True)
    feeder.start()
    try:
        found = data.find_text_files(str(tmp_path))
    finally:
        stop.set()
        feeder.join()
    assert found == ["a.txt", os.path.join("sub", "b.py"), os.path.join("sub", "deep", "c.md")]
    assert data.default_text_dir() == sysconfig.get_paths()["stdlib"]


def test_find_text_files_refuses_a_missing_root_a_file_and_a_folder_without_text(tmp_path):
    write_files(tmp_path / "binary", {"x.bin": b"\0\1\2", "empty.txt": b"",
                                      os.path.join("__pycache__", "t.txt"): b"text, but cached"})
    (tmp_path / "file.txt").write_text("a file, not a folder")
    for root in (tmp_path / "missing", tmp_path / "file.txt", tmp_path / "binary"):
        with pytest.raises(data.UsageError) as caught:
            data.find_text_files(str(root))
        assert str(root) in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


# ----------------------------------------------------------------------------------------------------------
# 3. Windows and separators
# ----------------------------------------------------------------------------------------------------------
def test_text_set_windows_are_inputs_and_targets_shifted_by_one_byte():
    stream = torch.tensor([(37 * i + 200) % 256 for i in range(41)], dtype=torch.uint8)  # bytes above 127 too
    windows = data.TextSet(stream, 8)
    assert len(windows) == 5  # (41 - 1) // 8
    indices = torch.tensor([4, 0, 2, 4])
    inputs, targets = windows.batch(indices)
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (4, 8)
    for row, i in enumerate(indices.tolist()):
        window = stream[i * 8:i * 8 + 9].long()  # read as unsigned: 200 stays 200
        assert torch.equal(inputs[row], window[:-1]) and torch.equal(targets[row], window[1:])
    for length, count in ((8, 0), (9, 1), (16, 1), (17, 2), (40, 4)):  # a window needs context + 1 bytes
        assert len(data.TextSet(stream[:length], 8)) == count, length


def test_text_data_is_the_split_files_with_separators_batched_in_epoch_order(local_group, corpus):
    """At 2 processes: each split's windows cover its files (sorted, each followed by a 0 byte) from the first
    byte on; the micro-batches are the spec's; validation batches are the shard's windows in order."""
    root, files = corpus
    train_names, val_names = expected_split(files, VAL_FRACTION)
    batch_size, seed = 6, 9
    ranks = local_group(2).run(text_data_views, root, CONTEXT, VAL_FRACTION, seed, batch_size)
    for rank, views in enumerate(ranks):
        for name, names in (("train", train_names), ("val", val_names)):
            stream = expected_stream(files, names).long()
            inputs, targets = views[name]
            count = (len(stream) - 1) // CONTEXT
            assert inputs.shape == targets.shape == (count, CONTEXT), name
            assert torch.equal(inputs.flatten(), stream[:count * CONTEXT]), name
            assert torch.equal(targets.flatten(), stream[1:count * CONTEXT + 1]), name
        assert views["lengths"] == (len(views["train"][0]), len(views["val"][0]))
        assert views["val_size"] == views["lengths"][1] and views["num_classes"] == 256
        assert views["batch_sizes"] == data.micro_batch_sizes(views["lengths"][0], 2, batch_size)
        for epoch, (got, expected) in views["epochs"].items():
            assert len(got) == len(expected) > 0, (rank, epoch)
            assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, expected)), epoch
        got, expected = views["val_batches"]
        assert len(got) == len(expected) and all(torch.equal(a, c) and torch.equal(b, d)
                                                 for (a, b), (c, d) in zip(got, expected))
    # the two ranks' first micro-batches are different windows (each rank its own shard)
    assert not torch.equal(ranks[0]["epochs"][0][0][0][0], ranks[1]["epochs"][0][0][0][0])


# ----------------------------------------------------------------------------------------------------------
# 8. Baselines
# ----------------------------------------------------------------------------------------------------------
def test_baselines_are_gzip_and_unigram_entropy_of_the_validation_stream(local_group, corpus, tmp_path):
    root, files = corpus
    baselines, _ = local_group(1).run(text_baselines, root, CONTEXT, VAL_FRACTION)[0]
    val = bytes(expected_stream(files, expected_split(files, VAL_FRACTION)[1]).tolist())
    assert baselines["gzip_bits_per_byte"] == pytest.approx(8 * len(gzip.compress(val, compresslevel=9)) / len(val),
                                                            rel=1e-15)
    assert baselines["unigram_bits_per_byte"] == pytest.approx(unigram_bits(torch.tensor(list(val))), rel=1e-12)
    # Two files, so one of each split; with its separator, "aaaabbc" has byte counts 4, 2, 1, 1 of 8: 1.75 bits
    # exactly, "abc" 1, 1, 1, 1 of 4: 2 bits (without the separator: 1.38 and 1.58; the two files together 1.89)
    small = {"one.txt": b"aaaabbc", "two.txt": b"abc"}
    write_files(tmp_path, small)
    baselines, (inputs, targets) = local_group(1).run(text_baselines, tmp_path, 2, 0.1)[0]
    (val_name,) = expected_split(small, 0.1)[1]
    assert baselines["unigram_bits_per_byte"] == pytest.approx(1.75 if val_name == "one.txt" else 2.0, rel=1e-12)
    assert inputs[0, 0] == small[val_name][0]  # the validation set is the file the split named


# ----------------------------------------------------------------------------------------------------------
# 7. The GPT
# ----------------------------------------------------------------------------------------------------------
def tiny_gpt(seed: int = 0, context: int = 8) -> models.GPT:
    torch.manual_seed(seed)
    return models.GPT(vocab_size=256, context=context, layers=2, width=32, heads=4)


def test_gpt_is_causal_and_refuses_a_sequence_longer_than_its_context():
    model = tiny_gpt().eval()
    tokens = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[:, 5] = (tokens[:, 5] + 1) % 256
    with torch.no_grad():
        before, after = model(tokens), model(changed)
        assert before.shape == (3, 8, 256) and before.dtype == torch.float32
        assert torch.equal(before[:, :5], after[:, :5])  # positions 0-4 never see byte 5: not a bit moves
        assert (before[:, 5:] != after[:, 5:]).any(-1).all()  # every later position of every row does
        assert model(tokens[:, :1]).shape == (3, 1, 256)
        assert model(torch.zeros(0, 4, dtype=torch.int64)).shape == (0, 4, 256)
        with pytest.raises(ValueError):
            model(torch.zeros(1, 9, dtype=torch.int64))


def test_gpt_head_is_the_token_embedding_and_stays_so():
    model = tiny_gpt()
    assert model.head.weight is model.token_embedding.weight and model.head.bias is None
    assert isinstance(model.final_norm, nn.LayerNorm) and model.position_embedding.weight.shape == (8, 32)
    assert len(model.blocks) == 2 and all(isinstance(b, models.GPTBlock) for b in model.blocks)
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.head.weight.detach().clone()
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert model.head.weight is model.token_embedding.weight and not torch.equal(before, model.head.weight)
    model.load_state_dict(tiny_gpt(seed=3).state_dict())
    assert model.head.weight is model.token_embedding.weight
    model.double()
    assert model.head.weight is model.token_embedding.weight


def test_gpt_has_no_dropout_and_draws_nothing_from_the_rng():
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(4))
    rng = torch.get_rng_state()
    with torch.no_grad():
        training = model.train()(tokens)
        evaluating = model.eval()(tokens)
    assert torch.equal(training, evaluating) and torch.equal(torch.get_rng_state(), rng)


def test_gpt_sizes_and_blocks():
    """"gpt": 1-3M parameters at 256 bytes. "gpt2": GPT-2 small's shape, on the meta device. Its count from the
    shapes: tied embedding V x W, positions C x W, final LayerNorm 2W, and per block the attention's 4 W x W and the
    MLP's 2 x 4 W x W matrices, plus at most 13 W of biases and LayerNorm parameters (nanoGPT's full set: qkv 3W,
    projections W and W, MLP 4W, two LayerNorms 4W). With V = 50257 the upper end is nanoGPT's 124,439,808."""
    assert models.LANGUAGE_MODELS == ("gpt", "gpt-tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
    assert set(models.LANGUAGE_MODELS) <= set(models.MODELS)
    assert models.GPT_SIZES["gpt2"] == {"layers": 12, "width": 768, "heads": 12, "context": 1024}
    assert models.GPT_SIZES["gpt2-medium"] == {"layers": 24, "width": 1024, "heads": 16, "context": 1024}  # GPT-2's
    assert models.GPT_SIZES["gpt2-large"] == {"layers": 36, "width": 1280, "heads": 20, "context": 1024}  # paper
    assert models.GPT_SIZES["gpt2-xl"] == {"layers": 48, "width": 1600, "heads": 25, "context": 1024}
    small = models.build_model("gpt", 0.0, "custom", 256, context=CONTEXT)
    size = models.GPT_SIZES["gpt"]
    assert isinstance(small, models.GPT) and 1_000_000 <= sum(p.numel() for p in small.parameters()) <= 3_000_000
    assert small.position_embedding.weight.shape == (CONTEXT, size["width"]) and len(small.blocks) == size["layers"]
    assert small.token_embedding.weight.shape == (256, size["width"])
    assert models.blocks(small) == list(small.blocks)
    assert models.build_model("gpt", 0.0, "custom", 256).position_embedding.num_embeddings == size["context"]
    with torch.device("meta"):
        gpt2 = models.build_model("gpt2", 0.0, "custom", 50257)
    V, C, W, L = 50257, 1024, 768, 12
    count = sum(p.numel() for p in gpt2.parameters())
    assert V * W + C * W + 2 * W + L * 12 * W * W <= count <= V * W + C * W + 2 * W + L * (12 * W * W + 13 * W)
    assert V * W + C * W + 2 * W + L * (12 * W * W + 13 * W) == 124_439_808
    assert gpt2.head.weight is gpt2.token_embedding.weight and models.blocks(gpt2) == list(gpt2.blocks)
    assert len(gpt2.blocks) == L and gpt2.position_embedding.weight.shape == (C, W)


# ----------------------------------------------------------------------------------------------------------
# 4. Scattered validation through the trainer
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluations(local_group, corpus):
    """--eval-only without a checkpoint (the fresh model) at 1, 2 and 3 processes, in float64; rank 0's view."""
    root, _ = corpus
    argv = text_argv(root) + ["--eval-only", "--seed", "11", "--batch-size", "8"]
    return {n: local_group(n).run(train_in_group, argv, "float64")[0] for n in (1, 2, 3)}


def test_every_validation_window_is_counted_once_at_any_world_size(evaluations, corpus):
    root, files = corpus
    val = expected_stream(files, expected_split(files, VAL_FRACTION)[1]).long()
    count = (len(val) - 1) // CONTEXT
    assert count >= 40
    windows = torch.stack([val[i * CONTEXT:i * CONTEXT + CONTEXT + 1] for i in range(count)])
    # my own loop over every window, with the model the trainer evaluated (the same on every world size)
    state = evaluations[1]["state"]
    assert all(max_difference(state, run["state"]) == 0 for run in evaluations.values())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = models.build_model("gpt", 0.0, "custom", 256, context=CONTEXT)
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model.eval()(windows[:, :-1]).flatten(0, 1)
    targets = windows[:, 1:].flatten()
    loss = F.cross_entropy(logits, targets, reduction="sum").item() / targets.numel()
    correct = int((logits.argmax(1) == targets).sum())
    gzip_bits = 8 * len(gzip.compress(bytes(val.tolist()), compresslevel=9)) / len(val)
    for world_size, run in evaluations.items():
        metrics = run["metrics"]
        assert metrics["val_total"] == count * CONTEXT, world_size
        assert metrics["val_loss"] == pytest.approx(loss, rel=1e-10), world_size
        assert metrics["val_loss"] == pytest.approx(evaluations[1]["metrics"]["val_loss"], rel=1e-10), world_size
        assert metrics["val_acc"] == correct / (count * CONTEXT), world_size
        assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / math.log(2), rel=1e-12)
        assert metrics["val_gzip_bits_per_byte"] == pytest.approx(gzip_bits, rel=1e-15)
        assert metrics["val_unigram_bits_per_byte"] == pytest.approx(unigram_bits(val), rel=1e-12)
        assert metrics["num_classes"] == 256 and metrics["optimizer_steps"] == 0


# ----------------------------------------------------------------------------------------------------------
# 5. Exact resume, plain and with the recipe flags; sampling from the checkpoint
# ----------------------------------------------------------------------------------------------------------
# 2 processes, micro-batches of 8 windows, grad-accum 2: 6 optimizer steps an epoch (182 training windows, 91 per
# rank, 12 micro-batches). {variant: (flags, epochs, the interrupted run's --max-steps)}
RECIPE = ["--optimizer", "adamw", "--lr", "3e-3", "--betas", "0.9", "0.95", "--weight-decay", "0.1",
          "--norm-weight-decay", "0", "--scheduler", "cosine", "--warmup-steps", "3", "--min-lr", "3e-4",
          "--clip-grad-norm", "1.0"]
RESUMES = {
    # plain AdamW, 2 epochs, stopped at step 8: inside the second epoch, after an epoch boundary
    "adamw": (["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.1"], 2, 8),
    # the GPT recipe (betas, decay on matrices only, warm-up then cosine, a clip): every piece of state a resume
    # must restore, the schedule's position included; 1 epoch, stopped at step 3
    "recipe": (RECIPE, 1, 3),
}


@pytest.fixture(scope="module")
def resumed_runs(local_group, corpus, tmp_path_factory):
    """Per variant: the uninterrupted run, the run stopped by --max-steps, and the same command again without it
    (a refusal comes back as its message)."""
    root, _ = corpus
    group = local_group(2)
    runs = {}
    for variant, (flags, epochs, stop) in RESUMES.items():
        base = text_argv(root) + ["--batch-size", "8", "--grad-accum", "2", "--epochs", str(epochs),
                                  "--seed", "3"] + flags
        whole_dir, resumed_dir = tmp_path_factory.mktemp("text_whole"), tmp_path_factory.mktemp("text_resumed")
        runs[variant] = {
            "whole": group.run(train_in_group, base + ["--checkpoint-dir", str(whole_dir)]),
            "first": group.run(train_in_group, base + ["--checkpoint-dir", str(resumed_dir), "--max-steps", str(stop)]),
            "second": group.run(try_train_in_group, base + ["--checkpoint-dir", str(resumed_dir)]),
            "dir": resumed_dir, "base": base}
    return runs


@pytest.mark.parametrize("variant", RESUMES)
def test_resume_mid_epoch_reproduces_the_uninterrupted_text_run(resumed_runs, corpus, variant):
    flags, epochs, stop = RESUMES[variant]
    runs = resumed_runs[variant]
    whole, first, second = runs["whole"][0], runs["first"][0], runs["second"][0]
    assert not isinstance(second, str), second  # the resuming command was refused
    _, files = corpus
    train_windows = (len(expected_stream(files, expected_split(files, VAL_FRACTION)[0])) - 1) // CONTEXT
    steps_per_epoch = math.ceil(len(data.micro_batch_sizes(train_windows, 2, 8)) / 2)
    assert stop % steps_per_epoch and stop < epochs * steps_per_epoch  # stopped inside an epoch
    assert first["metrics"]["optimizer_steps"] == stop and first["metrics"]["epochs"][-1].get("complete") is False
    assert second["metrics"]["optimizer_steps"] == whole["metrics"]["optimizer_steps"] == epochs * steps_per_epoch
    assert max_difference(first["state"], whole["state"]) > 0  # the resumed run had steps left to take
    assert all(torch.equal(whole["state"][k], second["state"][k]) for k in whole["state"])
    assert all(torch.equal(r["state"][k], whole["state"][k]) for r in runs["whole"] for k in whole["state"])
    for ours, theirs in zip(second["metrics"]["epochs"], whole["metrics"]["epochs"], strict=True):
        assert ours["val_loss"] == theirs["val_loss"] and ours["val_acc"] == theirs["val_acc"]
    metrics = whole["metrics"]
    assert metrics["tokens_per_s"] > 0 and metrics["val_total"] % CONTEXT == 0
    assert metrics["val_bits_per_byte"] == pytest.approx(metrics["val_loss"] / math.log(2), rel=1e-12)
    if "--clip-grad-norm" in flags:  # measured on every step
        assert len(metrics["grad_norms"]) == epochs * steps_per_epoch


def test_generate_samples_from_the_checkpoint_without_training(resumed_runs, capfdbinary):
    """The command line (main(argv), what `python ddp_cifar100.py` runs; a world of 1, in this process):
    --top-k 1 is greedy, so neither the seed nor the temperature changes the sample; without --top-k, at
    temperature 2, another seed gives other bytes. The checkpoint stays as it was and nothing else is written."""
    run = resumed_runs["adamw"]
    checkpoint = run["dir"] / "last.pt"
    saved = checkpoint.read_bytes()
    n = 40
    base = run["base"] + ["--checkpoint-dir", str(run["dir"]), "--generate", str(n), "--prompt", "the "]
    outputs = []
    for flags in (["--top-k", "1", "--seed", "1", "--temperature", "0.7"],
                  ["--top-k", "1", "--seed", "2", "--temperature", "2.0"], ["--seed", "2", "--temperature", "2.0"]):
        capfdbinary.readouterr()
        assert trainer.main(base + flags) == 0
        out, err = capfdbinary.readouterr()
        assert len(out) >= n, (out, err[-2000:])  # N bytes (more if shown with replacement characters)
        outputs.append(out)
    assert outputs[0] == outputs[1] and outputs[2] != outputs[1], outputs
    assert checkpoint.read_bytes() == saved  # nothing trained, nothing written
    assert sorted(os.listdir(run["dir"])) == ["last.pt"]


# ----------------------------------------------------------------------------------------------------------
# 6. One-line errors before any training
# ----------------------------------------------------------------------------------------------------------
def test_bad_text_inputs_are_one_line_on_every_rank_before_training(local_group, corpus, tmp_path):
    """At 2 processes (utils.UsageError: every rank exits with status 2, rank 0 says why in one line). Each case
    has a --checkpoint-dir, so that a run that trained would leave a last.pt behind."""
    root, _ = corpus
    write_files(tmp_path / "no_text", {"blob.bin": b"\0\1\2\3", "empty.txt": b""})
    write_files(tmp_path / "short", {"a.txt": b"twenty bytes of text", "b.txt": b"and twenty more here"})
    cases = {  # case: (data dir, extra flags, a phrase of the message)
        "missing dir": (tmp_path / "missing", [], str(tmp_path / "missing")),
        "no text files": (tmp_path / "no_text", [], str(tmp_path / "no_text")),
        "context longer than a split": (tmp_path / "short", ["--context", "64"], "--context"),
        "text with resnet": (root, ["--model", "resnet"], "resnet"),
    }
    argvs = {}
    for name, (data_dir, extra, _) in cases.items():
        (tmp_path / "ckpt" / name).mkdir(parents=True)
        argvs[name] = text_argv(data_dir) + ["--checkpoint-dir", str(tmp_path / "ckpt" / name)] + extra
    cases["synthetic with gpt"] = (None, [], "gpt")
    (tmp_path / "ckpt" / "synthetic with gpt").mkdir()
    argvs["synthetic with gpt"] = ["--device", "cpu", "--dataset", "synthetic", "--train-size", "16", "--val-size",
                                   "8", "--batch-size", "8", "--model", "gpt", "--checkpoint-dir",
                                   str(tmp_path / "ckpt" / "synthetic with gpt")]
    results = local_group(2).run(usage_errors, argvs)
    for name, (_, _, phrase) in cases.items():
        messages = [r[name] for r in results]
        assert all(isinstance(m, str) and m.startswith("UsageError: ") for m in messages), (name, messages)
        assert "\n" not in messages[0] and phrase in messages[0], (name, messages[0])
        assert not os.listdir(tmp_path / "ckpt" / name), name
