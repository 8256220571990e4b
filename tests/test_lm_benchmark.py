"""lm_benchmark.py: the trainer flags each run gets, the timed runs' steps from the sweep's timings, the summary of
a run's metrics and the one-line refusals. (A run is a 2-10 minute torchrun: the benchmark's, not the suite's;
test_language_model.py checks the recipe's optimizers through every sync.)"""
import pytest

import trainer.config
from benchmarks import lm_benchmark


def test_each_run_is_the_trainer_s_recipe_with_its_rates():
    adamw = lm_benchmark.recipe("adamw", 4e-3, None, 1000, 100, 0)
    muon = lm_benchmark.recipe("muon", 4e-3, 0.02, 1000, 100, 3)
    for flags in (adamw, muon):  # the trainer's own parser takes them
        config = trainer.config.parse_args(flags)
        assert (config.model, config.dataset, config.decay_steps, config.max_steps, config.eval_every) == \
            ("gpt", "text", 1000, 1000, 100)
        assert config.min_lr == pytest.approx(config.lr / 10) and config.scheduler == "cosine"
    assert trainer.config.parse_args(muon).muon_lr == 0.02 and trainer.config.parse_args(muon).zero == 3
    assert "--muon-lr" not in adamw


def test_the_timed_runs_get_the_steps_the_slowest_optimizer_fits():
    runs = [{"optimizer": "adamw", "steps": 600, "train_time_s": 120.0, "clock_s": 150.0},
            {"optimizer": "adamw", "steps": 600, "train_time_s": 126.0, "clock_s": 150.0},
            {"optimizer": "muon", "steps": 600, "train_time_s": 150.0, "clock_s": 180.0}]
    # muon: 0.25 s a step, 30 s outside training: (600 * 0.95 - 30) / 0.25 = 2160, down to whole hundreds
    assert lm_benchmark.steps_within(600, 0.05, runs) == 2100
    assert lm_benchmark.steps_within(600, 0.05, runs[:2]) == 2500  # adamw alone: 0.21 s, 30 s: 2571


def test_a_run_s_summary_reads_the_curve_and_when_it_passed_gzip():
    metrics = {"optimizer_steps": 300, "val_gzip_bits_per_byte": 1.85, "val_bits_per_byte": 1.8,
               "train_time_s": 36.0, "step_time_ms_median": 100.0, "tokens_per_s": 1e4,
               "evals": [{"step": 100, "time_s": 10.0, "val_bits_per_byte": 2.05, "val_loss": 1.42},
                         {"step": 200, "time_s": 20.0, "val_bits_per_byte": 1.95, "val_loss": 1.35},
                         {"step": 300, "time_s": 30.0, "val_bits_per_byte": 1.75, "val_loss": 1.21}]}
    run = lm_benchmark.summary("timed muon", "timed", "muon", 4e-3, 0.02, ["--x"], metrics, 40.0)
    assert run["val_bits_per_byte"] == 1.75 and run["train_time_s"] == 30.0 and run["wall_time_s"] == 40.0
    assert run["curve_evaluation_s"] == 6.0 and run["clock_s"] == 34.0  # the 3 evaluations' 6 s left out
    assert run["training_seconds_to_gzip"] == pytest.approx(25.0)  # half-way from 1.95 to 1.75
    assert [e["step"] for e in run["evals"]] == [100, 200, 300]


@pytest.mark.parametrize("argv,message", [
    (["--lrs", "adamw"], "--lrs takes optimizer=rate"),
    (["--lrs", "sgd=0.1"], "'sgd' is not one of"),
])
def test_bad_rates_are_refused_in_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        lm_benchmark.parse_args(argv)


def test_bad_numbers_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        lm_benchmark.parse_args(["--sweep", "muon=fast"])
    assert "--sweep takes optimizer=r1,r2" in capsys.readouterr().err
