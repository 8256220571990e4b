"""What the trainer's tests share (test_ddp_cifar100, test_zero_stage0, test_zero, the replica groups'): the tiny run's
flags, the worker functions a LocalGroup runs (module level, so the spawned workers import them), a seeded model with
a labelled set, a corpus of words for --dataset text, and the replay of a commit log. Not a test file: pytest collects
nothing here."""
import io
import os
import random
import traceback
from contextlib import redirect_stderr, redirect_stdout

import torch

import ddp_cifar100 as trainer
from data import CIFAR100_MEAN, CIFAR100_STD, derive_seed, make_synthetic, normalize
from models import build_model
from trainer.build import build

TINY = ["--device", "cpu", "--dataset", "synthetic", "--train-size", "128", "--val-size", "50", "--batch-size", "8",
        "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "5e-4"]
WORDS = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "while", "data", "model", "rank"]


def word_corpus(folder):
    """Ten files of whole words in ``folder`` (made if needed), 400-800 bytes each, the same bytes every time
    (Random(7)): --dataset text's two splits both hold several. Each file is written whole or not at all, so that
    two processes writing one folder at once (the replica scenarios' two batches) leave it whole. Returns ``folder``."""
    rng = random.Random(7)
    os.makedirs(folder, exist_ok=True)
    for i in range(10):
        path = os.path.join(folder, f"doc{i}.py")
        with open(f"{path}.{os.getpid()}", "w") as f:
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 160))))
        os.replace(f"{path}.{os.getpid()}", path)
    return folder


def train_in_group(rank, world_size, argv, dtype="float32"):
    """train() in a worker; the bare model's state on every rank and the metrics (rank 0's are the global ones).
    ``dtype`` is the default dtype the model and data are made in (float64: exactness beyond fp32 rounding)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        trained = trainer.train(trainer.parse_args(argv))
    finally:
        torch.set_default_dtype(previous)
    metrics, model, outer = trained.metrics, trained.model, trained.outer
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {"state": {k: v.detach().clone() for k, v in state.items()}, "metrics": metrics,  # FSDP2: DTensors
            "outer": outer}  # diloco's outer state (its shared point, momentum, ...), else None


def try_train_in_group(rank, world_size, argv):
    """Like train_in_group, but a UsageError comes back as its message instead of breaking the group."""
    try:
        return train_in_group(rank, world_size, argv)
    except trainer.UsageError as exc:
        return f"UsageError: {exc}"


def main_in_group(rank, world_size, argv):
    """ddp_cifar100.main(argv) in a worker, as a torchrun worker runs it but on the worker's group: its exit code,
    and what it printed (stdout, stderr), an escaped exception's traceback included."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = trainer.main(argv)
        except Exception:  # a bug: its traceback, as the interpreter would print it
            traceback.print_exc()
            code = 1
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def collect_all(pending):
    """{key: results} of LocalGroup.submit calls in flight, every one waited for even if one fails (so that no
    group is left busy), then the first failure raised."""
    outcomes = {}
    for key, results in pending.items():
        try:
            outcomes[key] = results()
        except Exception as error:  # noqa: BLE001 - raised below, once the others have landed
            outcomes[key] = error
    failures = [value for value in outcomes.values() if isinstance(value, Exception)]
    if failures:
        raise failures[0]
    return outcomes


def normalized_batch(image_set, indices, epoch_key=None):
    """An in-memory batch as the trainer feeds it to the model: normalized with CIFAR-100's mean and std."""
    images, labels = image_set.batch(indices, epoch_key)
    mean = torch.tensor(CIFAR100_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR100_STD).view(1, 3, 1, 1)
    return normalize(images, mean, std, torch.contiguous_format), labels


def model_and_labelled_set(val_size, seed):
    torch.manual_seed(seed)
    model = build_model("resnet", 0.0, "local")
    with torch.no_grad():  # non-trivial running statistics, so that eval-mode BatchNorm matters
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    model.eval()
    _, data = make_synthetic(8, val_size, seed)
    with torch.no_grad():
        predictions = model(normalized_batch(data, torch.arange(val_size))[0]).argmax(1)
    wrong = torch.arange(val_size) % 3 == 0
    data.labels = torch.where(wrong, (predictions + 1) % 100, predictions)
    return model, data


def replay_in_group(rank, world_size, argv, log, data_world):
    """One process replaying a commit log (float64): for each committed step, every participant's data ranks'
    micro-batches (data.py's order at ``data_world``), their mean gradient, the trainer's update. The reference
    the groups' weights are held to; returns the model's state."""
    torch.set_default_dtype(torch.float64)
    try:
        config = trainer.parse_args(argv)
        parts = build(config)
        for entry in log:
            ranks = [r for group in entry["participants"] for r in entry["samples"][str(group)]["ranks"]]
            sample = entry["samples"][str(entry["participants"][0])]  # every group takes the same window
            for data_rank in ranks:
                parts.data.placed = (data_rank, data_world)
                torch.manual_seed(derive_seed(config.seed, data_rank, entry["step"]))
                start, end = sample["micro_batches"]
                sizes = parts.data.batch_sizes()
                batches = parts.data.train_batches(sample["epoch"], start)
                for j in range(start, end):
                    inputs, labels = next(batches)
                    loss = trainer.per_sample_loss(parts.model(inputs), labels).sum()
                    (loss / sum(sizes[start:end]) / len(ranks)).backward()
                batches.close()
            parts.optimizer.step()
            if parts.scheduler is not None:
                parts.scheduler.step()
            parts.optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in parts.model.state_dict().items()}
    finally:
        parts.sync.close()
        torch.set_default_dtype(torch.float32)
