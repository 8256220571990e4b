"""trainer/finite.py's check alone, in one process: fp16's skipped steps are its normal path up to MAX_SKIPS in a row,
a non-finite norm is a stop only without fp16, and a stop is read a step late or at settle (before a save)."""
import pytest
import torch

from trainer.finite import MAX_SKIPS, FiniteCheck, NonFiniteError


class Scaler:
    def __init__(self):
        self.found = 0.0

    def _found_inf_per_device(self, optimizer):
        return {torch.device("cpu"): torch.tensor([self.found])}  # shape (1,), as GradScaler's


def test_fp16_skips_are_normal_until_more_than_max_skips_in_a_row():
    check, scaler = FiniteCheck(1, 0, torch.device("cpu"), fp16=True), Scaler()
    loss, norm = torch.tensor(1.0, dtype=torch.float64), torch.tensor(float("inf"))
    scaler.found = 1.0
    for step in range(1, MAX_SKIPS + 1):  # an overflow skipped: no stop
        check.step(step, loss, norm, scaler, None)
    scaler.found = 0.0
    check.step(MAX_SKIPS + 1, loss, torch.tensor(1.0), scaler, None)
    check.settle()  # the run of skips ended: counted afresh
    scaler.found = 1.0
    for step in range(1, MAX_SKIPS + 2):
        check.step(step, loss, norm, scaler, None)
    with pytest.raises(NonFiniteError, match=f"skipped {MAX_SKIPS + 1} optimizer steps in a row"):
        check.settle()


def test_a_non_finite_norm_stops_without_fp16_and_is_read_a_step_late():
    check = FiniteCheck(1, 0, torch.device("cpu"), fp16=False)
    check.step(1, torch.tensor(1.0), torch.tensor(float("nan")), None, None)  # read at the next step
    with pytest.raises(NonFiniteError, match="non-finite gradient norm at optimizer step 1 .*this run saved no"):
        check.step(2, torch.tensor(1.0), torch.tensor(1.0), None, None)
    check = FiniteCheck(1, 0, torch.device("cpu"), fp16=False)
    check.saved(6)
    check.step(7, torch.tensor(float("inf")), None, None, None)
    with pytest.raises(NonFiniteError, match="non-finite loss at optimizer step 7 on rank 0.*step 6 is still current"):
        check.settle()
