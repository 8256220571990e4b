"""Tests for diloco.py, its module docstring taken as the contract.

What is proved here:
- the encodings: ``encoded_bytes`` is the length of ``encode``'s message for every codec and length (0 and the
  block edges 255-257 included); a round trip errs by at most half a scale per element (int8, int4), by at most
  one bf16 rounding (bf16), not at all (none); all-zero blocks come back as exact zeros; int4's codes stay in
  [-7, 7] and an absmax element comes back as itself;
- the compressed ring at 2 and 3 ranks (lengths 1000, 7, and 2 < 3 ranks): the same bits on every rank;
  R * result + sum_r error_r = sum_r input_r; the error against the float64 mean within the docstring's bound;
  the returned bytes are those posted and ``ring_bytes``'s, and ``outer_step_bytes`` is their maximum;
- error feedback over successive all-reduces: nothing is lost over time, and without it the loss grows with the
  number of all-reduces;
- DiLoCo at 3 replicas, float64, on a small MLP with a tied weight: data parallelism exactly at H = 1 (inner SGD,
  outer lr 1); model averaging exactly every H steps at lr 1; the outer step moves toward the replicas' mean;
  Nesterov momentum as SGD's; ``global_weights`` restores the replica bit for bit; with int4 the outer state
  conserves what the replicas sent (error feedback in DiLoCo itself);
- streaming: ``split_fragments``' runs, the schedule ``due``, one log entry per launch with ``ring_bytes``' bytes,
  fragments of about 1/F of the model, a launched fragment applied exactly ``delay`` steps later with the local
  progress made meanwhile kept on top, and delay > H // F refused;
- an exact resume from the middle of a window with a fragment in flight (fragments 2, delay 1, int4, Nesterov,
  inner AdamW): bit for bit the run that did not stop.

Each world size is one LocalGroup (the session's ``local_group``); every ring case for one world runs in one
``group.run`` call and every DiLoCo run in another (module-scoped fixtures); the results are checked here.

Why the tolerances hold. All the arithmetic the exact claims rest on is float64 (the encodings' scales travel as
float32, whose rounding the bounds carry explicitly). The exact identities (data parallelism, averaging, the outer
step, conservation) differ from their references only by the order of float64 sums over 3 ranks and a handful of
steps of a network whose weights are of order 1: a few units of 2^-53, ~1e-15; 1e-12 keeps a factor of a
thousand. A real error moves them at first order: a wrong sign moves the shared point by lr * |Delta| ~ 1e-2, a
skipped all-reduce leaves each rank at its own replica ~1e-2 away, a dropped error feedback loses int4 rounding
errors ~|Delta| / 14. The error bounds of the compressed ring are derived in ``ring_error_bound``.
"""
import io
import math
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from diloco import (BLOCK, CODECS, DiLoCo, decode, encode, encoded_bytes, outer_step_bytes, ring_allreduce_compressed,
                    ring_bytes, split_fragments)

LEVELS = {"int8": 127, "int4": 7}
ENCODING_LENGTHS = (0, 1, 2, 255, 256, 257, 1000)
RING_LENGTHS = (1000, 2, 7)  # 2 < 3 ranks (an empty chunk), 7 divisible by neither 2 nor 3
FEEDBACK_WINDOWS = 6
SCALE_SLACK = 1e-6  # relative: the float32 scale's own rounding is 2^-24 ~ 6e-8 of it
BF16_UNIT = 2.0 ** -8  # round to nearest with bf16's 8-bit significand errs by at most 2^-8 of the value
EXACT = 1e-12  # float64 identities (module docstring: "Why the tolerances hold")
DILOCO_RANKS = 3
INNER_LR = 0.1


# ----------------------------------------------------------------------------------------------------------
# Encodings (no group)
# ----------------------------------------------------------------------------------------------------------
def expected_message_bytes(n: int, codec: str, dtype: torch.dtype) -> int:
    blocks = math.ceil(n / 256)
    return {"none": n * dtype.itemsize, "bf16": 2 * n, "int8": n + 4 * blocks,
            "int4": math.ceil(n / 2) + 4 * blocks}[codec]


def encoding_input(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of magnitudes 1e-3 .. 1e3 (so that blocks get different scales), the second block all zeros."""
    generator = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=generator, dtype=torch.float64)
    values *= 10.0 ** (6 * torch.rand(n, generator=generator, dtype=torch.float64) - 3)
    values[BLOCK:2 * BLOCK] = 0.0
    return values.to(dtype)


def block_absmax(values: torch.Tensor) -> torch.Tensor:
    """The largest |value| of each element's block of BLOCK, in float64, one per element."""
    padded = torch.zeros(math.ceil(values.numel() / BLOCK) * BLOCK, dtype=torch.float64)
    padded[:values.numel()] = values.double()
    return padded.view(-1, BLOCK).abs().amax(1).repeat_interleave(BLOCK)[:values.numel()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codec", CODECS)
def test_encoded_bytes_is_the_message_length(codec, dtype):
    for n in ENCODING_LENGTHS:
        message = encode(encoding_input(n, dtype), codec)
        assert message.dtype == torch.uint8 and message.dim() == 1, (codec, n)
        assert encoded_bytes(n, codec, dtype) == expected_message_bytes(n, codec, dtype) == message.numel(), \
            (codec, n, dtype, encoded_bytes(n, codec, dtype), message.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_error_is_within_half_a_scale(codec, dtype):
    """int8/int4, scale s = block absmax / L: the code is round(x / s) (clamping changes it only when x / s exceeds
    L by the roundings, i.e. by less than 1/2), so |x - code * s| <= s / 2 in exact arithmetic. What the float
    arithmetic adds: the scale travels as float32 (relative 2^-24 of s, within SCALE_SLACK), the division x / s
    and the product code * s each round in the values' dtype (unit u): at most |x| u + L s u <= 2 L s u more.
    So |error| <= (s / 2 + (2 L + 1) u s) (1 + SCALE_SLACK): float64's u makes the second term ~1e-14 s,
    float32's ~1.5e-5 s.
    bf16: a float32 rounds to bf16 within 2^-8 of its value (8-bit significand); a float64 is rounded to float32
    first (2^-24 more): |error| <= |x| (2^-8 + 2^-23). The module docstring's "2^-9 of the value" is half of what
    round to nearest guarantees (1 + 2^-8 sits halfway between 1 and 1 + 2^-7): reported, not asserted."""
    unit = torch.finfo(dtype).eps / 2
    worst = 0.0
    for n in ENCODING_LENGTHS:
        values = encoding_input(n, dtype)
        message = encode(values, codec)
        decoded = decode(message, codec, n, dtype)
        assert decoded.dtype == dtype and decoded.shape == values.shape, (codec, n)
        error = (decoded.double() - values.double()).abs()
        if codec == "none":
            assert torch.equal(decoded, values), (codec, n)
        elif codec == "bf16":
            bound = values.double().abs() * (BF16_UNIT + 2.0 ** -23)
            assert torch.all(error <= bound), (codec, n, float((error - bound).max()))
            if n:
                worst = max(worst, float((error / values.double().abs()).nan_to_num().max()) / BF16_UNIT)
        else:
            levels = LEVELS[codec]
            absmax = block_absmax(values)
            scale = absmax / levels
            bound = (scale / 2 + (2 * levels + 1) * unit * scale) * (1 + SCALE_SLACK)
            assert torch.all(error <= bound), (codec, n, float((error - bound).max()))
            if n:
                worst = max(worst, float((error / scale).nan_to_num().max()))
            # an element equal to its block's absmax comes back as itself, up to the float32 scale's rounding
            at_absmax = values.double().abs() == absmax
            if n:
                assert at_absmax.any()
                assert torch.all(error[at_absmax] <= values.double().abs()[at_absmax] * SCALE_SLACK), (codec, n)
        if n > BLOCK:  # the all-zero block (the whole second block, or what of it there is)
            zeros = decoded[BLOCK:2 * BLOCK]
            assert torch.equal(zeros, torch.zeros_like(zeros)), (codec, n)
    if codec in LEVELS:
        print(f"\n{codec} {dtype}: worst error {worst:.6f} of a scale (bound 0.5)")
    elif codec == "bf16":
        print(f"\nbf16 {dtype}: worst relative error {worst:.4f} x 2^-8 ({worst * 2:.4f} x 2^-9)")


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_codes_stay_within_the_levels(codec):
    """The codes in the message itself: int8's in [-127, 127] (never -128), int4's nibbles code + 8 in 1..15 (a
    zero nibble only as the pad of an odd count), for values whose absmax reaches the top level in every block."""
    levels = LEVELS[codec]
    for n in ENCODING_LENGTHS:
        values = encoding_input(n, torch.float64)
        message = encode(values, codec)
        blocks = math.ceil(n / BLOCK)
        packed = message[4 * blocks:]
        if codec == "int8":
            codes = packed.view(torch.int8).long()
        else:
            nibbles = torch.stack([packed & 15, packed >> 4], 1).view(-1).long()
            if n % 2:
                assert nibbles[-1] == 0, n
            nibbles = nibbles[:n]
            assert torch.all((nibbles >= 1) & (nibbles <= 15)), n
            codes = nibbles - 8
        assert codes.numel() == n
        assert torch.all(codes.abs() <= levels), (codec, n)
        if n:
            assert codes.abs().max() == levels  # an absmax element takes the top code


# ----------------------------------------------------------------------------------------------------------
# The compressed ring (2 and 3 ranks)
# ----------------------------------------------------------------------------------------------------------
def ring_input(rank: int, n: int, window: int = 0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_000 * seed + 10_000 * window + 100 * n + rank)
    return torch.randn(n, generator=generator, dtype=torch.float64)


@contextmanager
def posted_bytes():
    """Counts the bytes this rank posts with dist.isend during the block (dist restored afterwards)."""
    original, posted = dist.isend, {"bytes": 0}

    def isend(tensor, *args, **kwargs):
        posted["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.isend = isend
    try:
        yield posted
    finally:
        dist.isend = original


def ring_cases(rank: int, world_size: int) -> dict:
    """Every (codec, length) ring on this rank, then the error-feedback sequences."""
    cases = {}
    for n in RING_LENGTHS:
        for codec in CODECS:
            flat = ring_input(rank, n)
            error = torch.full_like(flat, float("nan"))  # SET by the call: nothing of this may survive
            with posted_bytes() as posted:
                returned = ring_allreduce_compressed(flat, rank, world_size, None, None, codec=codec, error=error)
            cases[(codec, n)] = {"result": flat, "error": error, "returned": returned, "posted": posted["bytes"]}
    feedback = {}
    for codec in ("int8", "int4"):
        # "varying": a new input each window; "steady": the same input every window, with and without feedback
        for inputs, fed_back in (("varying", True), ("steady", True), ("steady", False)):
            error, results = torch.zeros(1000, dtype=torch.float64), []
            for window in range(FEEDBACK_WINDOWS):
                raw = ring_input(rank, 1000, window if inputs == "varying" else 0, seed=1)
                flat = raw + error if fed_back else raw
                ring_allreduce_compressed(flat, rank, world_size, None, None, codec=codec, error=error)
                results.append(flat)
            feedback[(codec, inputs, fed_back)] = {"results": results, "error": error}
    return {"cases": cases, "feedback": feedback}


@pytest.fixture(scope="module", params=[2, 3])
def rings(request, local_group):
    world_size = request.param
    return world_size, local_group(world_size).run(ring_cases)


def ring_error_bound(codec: str, size: int, largest: float) -> float:
    """The most the ring's result may differ from the exact mean, per element, with M = ``largest`` the largest
    |input| over all ranks and elements (every block of every chunk has absmax <= that, so the bound is valid
    wherever the ring cuts its chunks and blocks, and looser than the per-block one).

    The module docstring's argument, kept exact to second order: hop k = 1 .. R-1 of the reduce-scatter encodes a
    partial sum of k inputs plus the errors E of the hops before it, so of size <= k M + E, and errs by at most
    enc(k M + E); the owner's sum is off by E = sum of those, its mean by E / R, and the mean (size <= M + E / R)
    is encoded once more. enc(m) = m / (2L) for int8/int4 (times the float32 scale's and float64's slack of
    ``test_round_trip_error_is_within_half_a_scale``), m (2^-8 + 2^-23) for bf16 (not the docstring's 2^-9: see
    that test). To first order this is ((R - 1) / 4 + 1/2) M / L, the docstring's bound. The float64 adds and the
    division add at most R^2 u M; 2^-50 R^2 M covers them."""
    if codec == "none":
        # the only roundings are the float64 adds (partials of <= k M, k = 2 .. R) and the division: at most
        # (sum_{k=2}^{R} k / R + 1) u M < (R + 1) u M; for R <= 3, under 5e-16 M: 1e-15 M holds with room
        return 1e-15 * largest
    if codec == "bf16":
        def encoding_error(magnitude: float) -> float:
            return magnitude * (BF16_UNIT + 2.0 ** -23)
    else:
        levels = LEVELS[codec]

        def encoding_error(magnitude: float) -> float:
            scale = magnitude / levels
            return (scale / 2 + (2 * levels + 1) * 2.0 ** -53 * scale) * (1 + SCALE_SLACK)
    summed = 0.0
    for k in range(1, size):
        summed += encoding_error(k * largest + summed)
    return summed / size + encoding_error(largest + summed / size) + 2.0 ** -50 * size ** 2 * largest


def test_ring_gives_every_rank_the_same_bits(rings):
    world_size, per_rank = rings
    for key, first in per_rank[0]["cases"].items():
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank]["cases"][key]["result"], first["result"]), (key, rank)


def test_ring_conserves_the_sum_up_to_the_charged_errors(rings):
    """R * result + sum_r error_r = sum_r input_r, to 1e-12 of the inputs' largest magnitude (float64 adds)."""
    world_size, per_rank = rings
    worst = 0.0
    for (codec, n), first in per_rank[0]["cases"].items():
        inputs = [ring_input(rank, n) for rank in range(world_size)]
        largest = max(float(x.abs().max()) for x in inputs)
        errors = [per_rank[rank]["cases"][(codec, n)]["error"] for rank in range(world_size)]
        assert all(not e.isnan().any() for e in errors), (codec, n, "error not set everywhere")
        gap = float((world_size * first["result"] + sum(errors) - sum(inputs)).abs().max())
        assert gap <= EXACT * largest, (codec, n, gap)
        worst = max(worst, gap / largest)
        if codec == "none":
            assert all(float(e.abs().max()) <= EXACT * largest for e in errors), (n, "none charged")
    print(f"\nR={world_size}: worst conservation gap {worst:.2e} of the largest input")


def test_ring_error_is_within_the_docstring_bound(rings):
    world_size, per_rank = rings
    worst = {}
    for (codec, n), first in per_rank[0]["cases"].items():
        inputs = [ring_input(rank, n) for rank in range(world_size)]
        largest = max(float(x.abs().max()) for x in inputs)
        mean = sum(inputs) / world_size
        error = float((first["result"] - mean).abs().max())
        bound = ring_error_bound(codec, world_size, largest)
        assert error <= bound, (codec, n, error, bound)
        worst[codec] = max(worst.get(codec, 0.0), error / bound)
    print(f"\nR={world_size}: worst error / bound " + ", ".join(f"{c} {r:.3f}" for c, r in worst.items()))


def test_ring_bytes_are_those_sent(rings):
    world_size, per_rank = rings
    for codec, n in per_rank[0]["cases"]:
        sent = [per_rank[rank]["cases"][(codec, n)]["returned"] for rank in range(world_size)]
        posted = [per_rank[rank]["cases"][(codec, n)]["posted"] for rank in range(world_size)]
        expected = [ring_bytes(n, rank, world_size, codec, torch.float64) for rank in range(world_size)]
        assert sent == posted == expected, (codec, n, sent, posted, expected)
        assert outer_step_bytes(n, world_size, codec, torch.float64) == max(sent), (codec, n)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_feedback_loses_nothing_over_windows(rings, codec):
    """Each window the rank's input is its raw value plus its last error: the per-window conservation telescopes to
    R * sum_t result_t + sum_r error_r(T) = sum_t sum_r raw_r,t (to 1e-12 of T times the largest input).

    Without feeding the error back, the same raw input every window gives the same result every window, so the
    drift R * sum_t result_t - sum_t sum_r raw_r,t is exactly T times one window's loss; with feedback it is
    -sum_r error_r(T), one window's loss. The two losses are of the same size (the same encodings of nearly the
    same values), so the ratio of the drifts is about T; at least T / 2 leaves room for the fluctuation of a
    1000-element norm."""
    world_size, per_rank = rings
    raw_sum = {inputs: sum(ring_input(rank, 1000, window if inputs == "varying" else 0, seed=1)
                           for rank in range(world_size) for window in range(FEEDBACK_WINDOWS))
               for inputs in ("varying", "steady")}
    largest = max(float(ring_input(rank, 1000, window, seed=1).abs().max())
                  for rank in range(world_size) for window in range(FEEDBACK_WINDOWS))
    drift = {}
    for (name, inputs, fed_back), first in per_rank[0]["feedback"].items():
        if name != codec:
            continue
        for rank in range(1, world_size):
            for mine, theirs in zip(per_rank[rank]["feedback"][(name, inputs, fed_back)]["results"], first["results"]):
                assert torch.equal(mine, theirs)
        applied = world_size * sum(first["results"])
        drift[(inputs, fed_back)] = float((applied - raw_sum[inputs]).norm())
        if fed_back:
            errors = sum(per_rank[rank]["feedback"][(name, inputs, True)]["error"] for rank in range(world_size))
            gap = float((applied + errors - raw_sum[inputs]).abs().max())
            assert gap <= EXACT * FEEDBACK_WINDOWS * largest, (codec, inputs, gap)
    assert drift[("steady", False)] >= FEEDBACK_WINDOWS / 2 * drift[("steady", True)], drift
    print(f"\nR={world_size} {codec}: drift over {FEEDBACK_WINDOWS} windows without feedback "
          f"{drift[('steady', False)]:.3e}, with {drift[('steady', True)]:.3e}")


# ----------------------------------------------------------------------------------------------------------
# DiLoCo (3 replicas, float64)
# ----------------------------------------------------------------------------------------------------------
def make_model() -> nn.Sequential:
    """6 -> 16 -> 16 -> 16 -> 3 with tanh, float64; the two 16 x 16 layers share one weight (a tied weight:
    parameters() lists it once). Its weights come from a seeded generator: the same on every rank."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3)).double()
    model[4].weight = model[2].weight
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) / math.sqrt(p.shape[-1]))
    return model


def batch(rank: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``rank``'s batch for inner step ``step`` (counted from 1)."""
    generator = torch.Generator().manual_seed(1_000_000 * seed + 1000 * rank + step)
    inputs = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    return inputs, torch.randn(8, 3, generator=generator, dtype=torch.float64)


def loss_of(model: nn.Module, rank: int, step: int, seed: int) -> torch.Tensor:
    inputs, targets = batch(rank, step, seed)
    return ((model(inputs) - targets) ** 2).mean()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def write(model: nn.Module, values: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def fragment_slices(fragments: int) -> list[slice]:
    """Where each of split_fragments' runs lies in ``flat``."""
    slices, offset = [], 0
    for run in split_fragments(list(make_model().parameters()), fragments):
        size = sum(p.numel() for p in run)
        slices.append(slice(offset, offset + size))
        offset += size
    return slices


def train(rank: int, steps: int, seed: int, optimizer: str = "sgd", resume_from: dict | None = None,
          first_step: int = 1, save_at: int | None = None, **options) -> dict:
    """One replica's run as a user writes it: inner steps, ``outer.step()`` after each. Records, per step, the
    local weights before ``outer.step()`` ("pre") and after it ("post") and the shared point read through
    ``global_weights()`` ("shared", from step first_step - 1: the point it starts from). ``save_at``: a checkpoint
    after that step (bytes of torch.save), the run going on; ``resume_from``: the model, inner optimizer and DiLoCo
    loaded from one."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR) if optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    outer = DiLoCo(model, None, **options)
    record = {"pre": {}, "post": {}, "shared": {}, "due": {}}
    try:
        if resume_from is not None:
            model.load_state_dict(resume_from["model"])
            inner.load_state_dict(resume_from["inner"])
            outer.load_state_dict(resume_from["outer"])
        with outer.global_weights():
            record["shared"][first_step - 1] = flat(model)
        for step in range(first_step, first_step + steps):
            loss_of(model, rank, step, seed).backward()
            inner.step()
            inner.zero_grad()
            record["pre"][step] = flat(model)
            outer.step()
            record["post"][step] = flat(model)
            with outer.global_weights():
                record["shared"][step] = flat(model)
            if step == save_at:
                state = {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()}
                buffer = io.BytesIO()
                torch.save(state, buffer)
                record["checkpoint"] = buffer.getvalue()
        record["due"] = {t: outer.due(t) for t in range(1, 3 * options["local_steps"] + 1)}
        record["final_state"] = outer.state_dict()
    finally:
        outer.close()
    record["log"] = outer.log
    return record


def global_weights_round_trip(rank: int, steps: int, **options) -> dict:
    """``steps`` steps, then the weights before, inside and after ``with outer.global_weights():``."""
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    outer = DiLoCo(model, None, **options)
    try:
        for step in range(1, steps + 1):
            loss_of(model, rank, step, 0).backward()
            inner.step()
            inner.zero_grad()
            outer.step()
        before = flat(model)
        with outer.global_weights():
            inside = flat(model)
        after = flat(model)
        start = torch.cat(outer.state_dict()["start"])
    finally:
        outer.close()
    return {"before": before, "inside": inside, "after": after, "start": start}


# The DiLoCo runs: name -> (train's keyword arguments). All are float64 with inner SGD unless said.
AVERAGING_H = 4
RUNS = {
    # (a) H = 1, outer SGD lr 1 without momentum: data parallelism's step
    "data_parallel": dict(steps=4, seed=1, local_steps=1, outer_lr=1.0, outer_momentum=0.0, compress="none"),
    # (b) H = 4, lr 1, no momentum: model averaging every H steps
    "averaging": dict(steps=2 * AVERAGING_H, seed=2, local_steps=AVERAGING_H, outer_lr=1.0, outer_momentum=0.0,
                      compress="none"),
    # (c) one window, lr in (0, 1), no momentum
    "partial_step": dict(steps=3, seed=3, local_steps=3, outer_lr=0.4, outer_momentum=0.0, compress="none"),
    # (d) two windows, Nesterov 0.9, lr 0.7
    "nesterov": dict(steps=6, seed=4, local_steps=3, outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                     compress="none"),
    # int4 across 4 windows, lr 1, no momentum: the outer state conserves what the replicas sent
    "compressed": dict(steps=8, seed=5, local_steps=2, outer_lr=1.0, outer_momentum=0.0, compress="int4"),
    # streaming: H 8, F 4, delay 2, int8, the paper's outer optimizer; two windows
    "stream_8": dict(steps=16, seed=6, local_steps=8, fragments=4, delay=2, compress="int8", outer_lr=0.7,
                     outer_momentum=0.9),
    # streaming: H 10, F 4 (H mod F = 2), delay 1, averaging (lr 1, none); two windows
    "stream_10": dict(steps=20, seed=7, local_steps=10, fragments=4, delay=1, compress="none", outer_lr=1.0,
                      outer_momentum=0.0),
}
# Exact resume: fragments 2 (offsets 3, 0 of H = 6), delay 1, int4, Nesterov, inner AdamW. At step 9 fragment 0 was
# launched and is applied after step 10: the checkpoint holds it in flight. 14 steps: not a multiple of H.
RESUME = dict(seed=8, optimizer="adamw", local_steps=6, fragments=2, delay=1, compress="int4", outer_lr=0.7,
              outer_momentum=0.9, nesterov=True)
RESUME_TOTAL, RESUME_AT = 14, 9


def diloco_runs(rank: int, world_size: int) -> dict:
    out = {name: train(rank, **options) for name, options in RUNS.items()}
    # (e) model averaging (H = 4, lr 1) stopped in the middle of its second window, after H + 1 steps
    out["round_trip"] = global_weights_round_trip(rank, AVERAGING_H + 1, local_steps=AVERAGING_H, outer_lr=1.0,
                                                  outer_momentum=0.0, compress="none")
    out["straight"] = train(rank, RESUME_TOTAL, **RESUME)
    stopped = train(rank, RESUME_AT, save_at=RESUME_AT, **RESUME)
    checkpoint = torch.load(io.BytesIO(stopped["checkpoint"]))
    out["in_flight_at_checkpoint"] = [item["fragment"] for item in checkpoint["outer"]["in_flight"]]
    out["resumed"] = train(rank, RESUME_TOTAL - RESUME_AT, first_step=RESUME_AT + 1, resume_from=checkpoint,
                           **RESUME)
    return out


@pytest.fixture(scope="module")
def runs(local_group):
    return local_group(DILOCO_RANKS).run(diloco_runs)


def gradients(model: nn.Module, rank: int, step: int, seed: int) -> list[torch.Tensor]:
    model.zero_grad()
    loss_of(model, rank, step, seed).backward()
    return [p.grad.clone() for p in model.parameters()]


def sgd_step(model: nn.Module, grads: list[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p -= lr * g


def max_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_one_local_step_is_data_parallelism(runs):
    """H = 1, inner SGD, outer SGD lr 1 without momentum: after every step each replica holds the weights of ONE
    model taking gradient-descent steps with the mean of the replicas' gradients."""
    options = RUNS["data_parallel"]
    reference, worst = make_model(), 0.0
    for step in range(1, options["steps"] + 1):
        per_rank = [gradients(reference, rank, step, options["seed"]) for rank in range(DILOCO_RANKS)]
        sgd_step(reference, [sum(g) / DILOCO_RANKS for g in zip(*per_rank)], INNER_LR)
        for rank in range(DILOCO_RANKS):
            gap = max_gap(runs[rank]["data_parallel"]["post"][step], flat(reference))
            assert gap <= EXACT, (step, rank, gap)
            worst = max(worst, gap)
    assert max_gap(flat(reference), flat(make_model())) > 1e-3  # the steps did move the weights
    print(f"\ndata parallelism: worst gap {worst:.2e}")


def test_outer_lr_one_is_model_averaging(runs):
    """H = 4, lr 1, no momentum: every replica trains alone for H steps, then all hold the mean, twice. The
    reference simulates the 3 replicas itself. Mid-window (step H + 1) the replicas differ."""
    options = RUNS["averaging"]
    replicas, worst = [make_model() for _ in range(DILOCO_RANKS)], 0.0
    for step in range(1, options["steps"] + 1):
        for rank, replica in enumerate(replicas):
            sgd_step(replica, gradients(replica, rank, step, options["seed"]), INNER_LR)
        if step % AVERAGING_H == 0:
            mean = sum(flat(replica) for replica in replicas) / DILOCO_RANKS
            for replica in replicas:
                write(replica, mean)
        for rank, replica in enumerate(replicas):
            gap = max_gap(runs[rank]["averaging"]["post"][step], flat(replica))
            assert gap <= EXACT, (step, rank, gap)
            worst = max(worst, gap)
    middle = [runs[rank]["averaging"]["post"][AVERAGING_H + 1] for rank in range(DILOCO_RANKS)]
    assert all(max_gap(middle[0], other) > 1e-9 for other in middle[1:]), "replicas equal mid-window"
    print(f"\nmodel averaging: worst gap {worst:.2e}")


def test_outer_step_moves_toward_the_replicas_mean(runs):
    """lr 0.4 in (0, 1), no momentum, one window: new = old + lr (mean - old), strictly between old and mean on
    every coordinate where they differ; every replica then holds the new shared point."""
    options = RUNS["partial_step"]
    steps, lr = options["steps"], options["outer_lr"]
    old = runs[0]["partial_step"]["shared"][0]
    mean = sum(runs[rank]["partial_step"]["pre"][steps] for rank in range(DILOCO_RANKS)) / DILOCO_RANKS
    for rank in range(DILOCO_RANKS):
        new = runs[rank]["partial_step"]["shared"][steps]
        gap = max_gap(new, old + lr * (mean - old))
        assert gap <= EXACT, (rank, gap)
        moved = (mean - old).abs() > 1e-9
        assert moved.any()
        fraction = (new - old)[moved] / (mean - old)[moved]
        assert torch.all((fraction > 0) & (fraction < 1)), fraction
        assert torch.equal(runs[rank]["partial_step"]["post"][steps], new)
    print(f"\nouter step toward the mean: gap {gap:.2e}")


def test_nesterov_outer_step_is_sgd_on_the_averaged_pseudo_gradients(runs):
    """Nesterov 0.9, lr 0.7, two windows of H = 3. By hand, as torch.optim.SGD(nesterov=True) defines it:
    g = old - mean of the replicas' weights; b = g (first), b = mu b + g (later); new = old - lr (g + mu b)."""
    options = RUNS["nesterov"]
    lr, mu, window = options["outer_lr"], options["outer_momentum"], options["local_steps"]
    shared, buffer, worst = runs[0]["nesterov"]["shared"][0], None, 0.0
    for end in (window, 2 * window):
        mean = sum(runs[rank]["nesterov"]["pre"][end] for rank in range(DILOCO_RANKS)) / DILOCO_RANKS
        pseudo = shared - mean
        buffer = pseudo.clone() if buffer is None else mu * buffer + pseudo
        shared = shared - lr * (pseudo + mu * buffer)
        for rank in range(DILOCO_RANKS):
            gap = max_gap(runs[rank]["nesterov"]["shared"][end], shared)
            assert gap <= EXACT, (end, rank, gap)
            worst = max(worst, gap)
    print(f"\nNesterov outer step: worst gap {worst:.2e}")


def test_global_weights_restores_the_replica_bit_for_bit(runs):
    for rank in range(DILOCO_RANKS):
        trip = runs[rank]["round_trip"]
        assert torch.equal(trip["after"], trip["before"]), rank
        assert torch.equal(trip["inside"], trip["start"]), rank
        assert max_gap(trip["before"], trip["inside"]) > 1e-9, "mid-window the replica equals the shared point"


def test_compressed_outer_state_conserves_what_the_replicas_sent(runs):
    """int4, lr 1, no momentum, windows of H = 2: the shared point moves by the averaged pseudo-gradient, so
    R (theta_0 - theta_T) + sum_r error_r(T) = sum_t sum_r (theta_{t-1} - theta_r,t): the ring's conservation,
    telescoped by the error feedback DiLoCo adds to each pseudo-gradient. Without the feedback the rounding
    lost in every window but the last would be missing (~|Delta| / 14 per window)."""
    options = RUNS["compressed"]
    window, steps = options["local_steps"], options["steps"]
    records = [runs[rank]["compressed"] for rank in range(DILOCO_RANKS)]
    for step in range(window, steps + 1, window):
        for record in records[1:]:
            assert torch.equal(record["shared"][step], records[0]["shared"][step]), step
    sent = sum(records[0]["shared"][end - window] - record["pre"][end]
               for end in range(window, steps + 1, window) for record in records)
    errors = sum(torch.cat(record["final_state"]["error"]) for record in records)
    applied = DILOCO_RANKS * (records[0]["shared"][0] - records[0]["shared"][steps])
    gap = max_gap(applied + errors, sent)
    assert gap <= EXACT, gap
    assert float(errors.abs().max()) > 1e-9  # int4 did round
    print(f"\ncompressed DiLoCo conservation gap {gap:.2e}")


def check_runs(params: list[nn.Parameter], fragments: int) -> None:
    """F consecutive non-empty runs covering ``params`` in order, none above 1/F of the elements plus one
    parameter (a cut comes at the first parameter that reaches k/F of the total)."""
    pieces = split_fragments(params, fragments)
    assert [len(run) for run in pieces].count(0) == 0 and len(pieces) == fragments, \
        (fragments, [[p.numel() for p in run] for run in pieces])
    assert [id(p) for run in pieces for p in run] == [id(p) for p in params], fragments
    total, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    assert max(sum(p.numel() for p in run) for run in pieces) <= total / fragments + largest, fragments


@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
def test_split_fragments_gives_consecutive_runs(fragments):
    check_runs(list(make_model().parameters()), fragments)


def test_split_fragments_one_parameter_each():
    """F = the number of parameters: one parameter a run, whatever their sizes. The model's 7 parameters
    (96, 16, 256, 16, 16, 48, 3 elements), and the smallest case: two parameters of 1 and 2 elements, F = 2."""
    params = list(make_model().parameters())
    check_runs(params, len(params))
    check_runs([nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(2))], 2)


def test_split_fragments_refuses_more_fragments_than_parameters():
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match="fragments"):
        split_fragments(params, len(params) + 1)
    with pytest.raises(ValueError, match="fragments"):
        split_fragments(params, 0)


def test_delay_longer_than_a_fragment_slot_is_refused():
    """Refused in the constructor, before any group is made (so this runs without one: match the message, lest a
    missing default group's ValueError pass for it)."""
    with pytest.raises(ValueError, match="delay"):
        DiLoCo(make_model(), local_steps=8, fragments=4, delay=3)
    with pytest.raises(ValueError, match="delay"):
        DiLoCo(make_model(), local_steps=10, fragments=4, delay=3)


@pytest.mark.parametrize("name", ["stream_8", "stream_10"])
def test_streaming_schedule_and_log(runs, name):
    """Fragment f meets after inner steps t = (f + 1) floor(H / F) mod H, the last at multiples of H; the log has
    one entry per launch, with ring_bytes' bytes for this rank and the fragment's elements; no fragment holds
    more than 1/F of the model plus one parameter."""
    options = RUNS[name]
    window, fragments = options["local_steps"], options["fragments"]
    offsets = [((f + 1) * (window // fragments)) % window for f in range(fragments - 1)] + [0]
    assert offsets == {8: [2, 4, 6, 0], 10: [2, 4, 6, 0]}[window]
    slices = fragment_slices(fragments)
    sizes = [s.stop - s.start for s in slices]
    params = list(make_model().parameters())
    assert max(sizes) <= sum(sizes) / fragments + max(p.numel() for p in params)
    expected_launches = [(t, f) for t in range(1, options["steps"] + 1) for f in range(fragments)
                         if t % window == offsets[f]]
    for rank in range(DILOCO_RANKS):
        record = runs[rank][name]
        assert record["due"] == {t: [f for f in range(fragments) if t % window == offsets[f]]
                                 for t in range(1, 3 * window + 1)}, rank
        assert [(e["step"], e["fragment"]) for e in record["log"]] == expected_launches, rank
        for entry in record["log"]:
            size = sizes[entry["fragment"]]
            assert entry["elements"] == size
            assert entry["bytes"] == ring_bytes(size, rank, DILOCO_RANKS, options["compress"], torch.float64), entry


@pytest.mark.parametrize("name", ["stream_8", "stream_10"])
def test_streamed_fragment_is_applied_after_its_delay(runs, name):
    """A fragment launched after step t is applied after step t + delay: its shared point is unchanged through
    t + delay - 1 and changed at t + delay, the same bits on every rank; the replica then holds the new shared
    point plus the local progress made since the launch (pre(t + d) - pre(t)). With lr 1 and no momentum
    (stream_10), the new shared point is the mean of the replicas' fragment at the launch."""
    options = RUNS[name]
    delay, steps = options["delay"], options["steps"]
    slices = fragment_slices(options["fragments"])
    records = [runs[rank][name] for rank in range(DILOCO_RANKS)]
    checked = 0
    for entry in records[0]["log"]:
        launch, where = entry["step"], slices[entry["fragment"]]
        applied = launch + delay
        if applied > steps:
            continue
        for rank, record in enumerate(records):
            before = record["shared"][launch - 1][where]
            for step in range(launch, applied):
                assert torch.equal(record["shared"][step][where], before), (rank, launch, step)
            new = record["shared"][applied][where]
            assert not torch.equal(new, before), (rank, launch)
            assert torch.equal(new, records[0]["shared"][applied][where]), (rank, launch)
            kept = new + (record["pre"][applied][where] - record["pre"][launch][where])
            assert max_gap(record["post"][applied][where], kept) <= EXACT, (rank, launch)
        if options["outer_lr"] == 1.0 and options["outer_momentum"] == 0.0:
            mean = sum(record["pre"][launch][where] for record in records) / DILOCO_RANKS
            assert max_gap(records[0]["shared"][applied][where], mean) <= EXACT, launch
        checked += 1
    assert checked >= 2 * options["fragments"] - 1


def test_resume_mid_window_with_a_fragment_in_flight_is_exact(runs):
    for rank in range(DILOCO_RANKS):
        assert runs[rank]["in_flight_at_checkpoint"] == [0], rank
        straight, resumed = runs[rank]["straight"], runs[rank]["resumed"]
        assert torch.equal(resumed["post"][RESUME_TOTAL], straight["post"][RESUME_TOTAL]), rank
        assert all(torch.equal(a, b) for a, b in zip(resumed["final_state"]["start"],
                                                     straight["final_state"]["start"])), rank
        assert all(torch.equal(a, b) for a, b in zip(resumed["final_state"]["error"],
                                                     straight["final_state"]["error"])), rank
        assert resumed["final_state"]["inner_steps"] == straight["final_state"]["inner_steps"] == RESUME_TOTAL
    assert max_gap(runs[0]["straight"]["post"][RESUME_TOTAL], runs[0]["straight"]["shared"][0]) > 1e-3
