"""What the tests of zero.shard over a user's own small model share (test_zero_optimizers, test_zero_matrix,
test_zero_offload: the element-wise optimizers and the settings that give them state; cloned,
attempt and identical for test_zero_contract and the files built on it too): the model made alike in every
process, the global batches and each rank's micro-batches of them, the comparisons of weights and of optimizer
state dicts (the test process computes on one intra-op thread while the workers train: conftest.py; max_difference
for the trainer's tests too). Module level, so the spawned workers import them. Not a test file: pytest collects
nothing here."""
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn


# name -> (class, settings): every element-wise optimizer of torch.optim, and the settings that add state
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.1}),  # no state at all
    "SGD momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 5e-4}),
    "SGD nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adam amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95)}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),  # state before any step
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "RMSprop centered momentum": (torch.optim.RMSprop, {"lr": 1e-2, "centered": True, "momentum": 0.5}),
    "Rprop": (torch.optim.Rprop, {"lr": 1e-2}),
    "ASGD": (torch.optim.ASGD, {"lr": 1e-2, "t0": 1}),  # averaging from the second step: ax, eta and mu move
}


def seeded_model(cls: type[nn.Module], seed: int) -> nn.Module:
    """``cls()`` in float64, drawn after torch.manual_seed(seed): the same weights in every process."""
    torch.manual_seed(seed)
    return cls().double()


@dataclass(frozen=True)
class GlobalBatches:
    """``steps`` global batches of ``size`` samples of ``features`` float64 inputs and a label among ``classes``,
    drawn from ``seed``. Rank r of W takes the r-th W-th of a step's batch, in ``micro_batches`` micro-batches in
    order: micro-batch k of rank r is the (r K + k)-th of the batch's W K equal parts, so every split of the batch
    over ranks and micro-batches sums the same samples (``size`` divisible by W K)."""
    steps: int
    size: int
    features: int
    classes: int
    micro_batches: int
    seed: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every step's global batch: inputs (steps, size, features) and labels (steps, size)."""
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.steps, self.size, self.features, generator=generator, dtype=torch.float64)
        y = torch.randint(0, self.classes, (self.steps, self.size), generator=generator)
        return x, y

    def micro_batch(self, step: int, rank: int, world_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``k`` of ``rank``'s share of step ``step``'s batch."""
        x, y = self.tensors()
        per = self.size // world_size // self.micro_batches
        first = (rank * self.micro_batches + k) * per
        return x[step, first:first + per], y[step, first:first + per]


def cloned(tree):
    """A deep copy of (nested dicts and lists of) tensors, detached: nothing aliases the live model or state."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: cloned(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cloned(v) for v in tree)
    return copy.deepcopy(tree)


def attempt(fn):
    """(exception type name, message) of what ``fn()`` raised, or (None, None)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return type(error).__name__, str(error)
    return None, None


def identical(a, b) -> bool:
    """Nested dicts, lists and tuples of tensors and values: equal keys, types, dtypes, shapes and values."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def state_difference(ours: dict, theirs: dict) -> float:
    """The largest difference between two optimizer state dicts, after checking that they hold the same groups
    (hyperparameters and parameter indices), the same parameters' entries, keys, shapes and dtypes."""
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"]), (sorted(ours["state"]), sorted(theirs["state"]))
    worst = 0.0
    for index, entry in theirs["state"].items():
        mine = ours["state"][index]
        assert mine.keys() == entry.keys(), (index, sorted(mine), sorted(entry))
        for key, value in entry.items():
            if not torch.is_tensor(value):
                assert mine[key] == value, (index, key)
                continue
            assert (mine[key].dtype, mine[key].shape) == (value.dtype, value.shape), (index, key)
            worst = max(worst, (mine[key] - value).abs().max().item() if value.numel() else 0.0)
    return worst


def max_difference(a: dict, b: dict) -> float:
    """The largest difference between two state dicts of the same names, in float64, over their floating tensors: an
    integer one is a count, not a weight (BatchNorm's num_batches_tracked counts micro-batches, which runs that split
    a batch differently make differently)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
