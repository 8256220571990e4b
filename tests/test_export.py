"""trainer/export.py: a trained GPT out as transformers' GPT-2 (from either checkpoint format), an image model out as
safetensors, and a run started from either by --init-from.

The GPT is gpt-tiny at a context of 32, trained a few steps on 2 processes twice: at --zero 3 (a DCP folder) and at
--zero 0 with another seed (last.pt, and other weights) at a rate far too high. A GPT this small and this briefly
trained decodes greedily to one byte repeated: at a sound rate the space, the commonest byte and the prompt's last
(near its start the tied head maps a byte to itself); at the high rate another byte, with logits some ten times
larger, where 1e-5 of absolute difference is a tighter bound. transformers is imported once, by the fixture ``gpt2``,
offline: the folder is loaded from disk and nothing is fetched. Ours and GPT-2's compute the same operations in
the same order (SDPA both), so their float32 logits agree to rounding; 1e-5 is the bound asked, and a part mapped
wrong (a weight not transposed, tanh's GELU for erf's, a head untied) moves them by far more.
"""
import json
import os
import shutil

import pytest
import torch

import ddp_cifar100 as trainer
from models import GPT, build_model
from trainer import export
from trainer.checkpoint import read_alone
from trainer_testing import TINY, main_in_group, train_in_group
from zero_testing import max_difference

GPT_RUN = ["--device", "cpu", "--dataset", "text", "--model", "gpt-tiny", "--context", "32", "--val-fraction", "0.3",
           "--batch-size", "4", "--epochs", "1", "--max-steps", "5", "--optimizer", "adamw", "--lr", "1e-2"]
NET_RUN = TINY + ["--model", "net", "--epochs", "1", "--max-steps", "2", "--seed", "1"]
PROMPT, SAMPLED = b"def ", 24  # 1 + 4 + 24 bytes: inside the context of 32, which GPT-2 cannot slide


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Eight text files of 2 kB (the standard library's), so both splits hold several."""
    import data

    root = tmp_path_factory.mktemp("export-corpus")
    for name in ("abc", "bisect", "calendar", "copy", "enum", "heapq", "random", "string"):
        with open(f"{data.default_text_dir()}/{name}.py", "rb") as f:
            (root / f"{name}.py").write_bytes(f.read()[:2000])
    return root


@pytest.fixture(scope="module")
def runs(local_group, corpus, tmp_path_factory):
    """The three checkpoints: {"folder": the GPT at --zero 3, "file": the GPT at --zero 0, "net": the small net},
    each its --checkpoint-dir and its flags."""
    group, made = local_group(2), {}
    for name, argv in (("folder", GPT_RUN + ["--data-dir", str(corpus), "--zero", "3", "--seed", "3"]),
                       ("file", GPT_RUN + ["--data-dir", str(corpus), "--zero", "0", "--seed", "4", "--lr", "0.3"]),
                       ("net", NET_RUN)):
        directory = tmp_path_factory.mktemp(f"export-{name}")
        argv = argv + ["--checkpoint-dir", str(directory)]
        group.run(train_in_group, argv)
        made[name] = directory, argv
    assert os.path.isfile(made["folder"][0] / "latest") and os.path.isfile(made["file"][0] / "last.pt")
    return made


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """Each checkpoint exported in its default format: {name: OUT}."""
    out = {}
    for name, (directory, _) in runs.items():
        out[name] = tmp_path_factory.mktemp("exported") / name
        assert export.main(["--checkpoint-dir", str(directory), "--out", str(out[name])]) == 0
    return out


@pytest.fixture(scope="module")
def gpt2():
    """transformers' GPT2LMHeadModel, imported once (some 4 s), offline while this module's tests run."""
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import GPT2LMHeadModel

    yield GPT2LMHeadModel
    if saved is None:
        del os.environ["HF_HUB_OFFLINE"]
    else:
        os.environ["HF_HUB_OFFLINE"] = saved


def docs_snippet(out):
    """What docs/language-models.md's snippet that reproduces --generate with transformers alone prints, run on the
    export ``out`` (its folder, prompt and length made the test's)."""
    import contextlib
    import io
    import re

    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "language-models.md"), encoding="utf-8").read()
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "bos_token_id" in block)
    code = "\n".join(line.removeprefix("  ") for line in code.splitlines())
    code = code.replace('"exports/gpt"', repr(str(out))).replace('"def "', repr(PROMPT.decode()))
    code = code.replace("max_new_tokens=400", f"max_new_tokens={SAMPLED}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/language-models.md", "exec"), {})
    return printed.getvalue()


def our_gpt(directory):
    state = read_alone(str(directory))[1]
    model = GPT(vocab_size=256, **state["config"]["gpt"]).eval()
    model.load_state_dict(state["model"])
    return model


@pytest.mark.parametrize("name", ["folder", "file"])
def test_a_gpt_goes_out_as_a_transformers_gpt2_that_computes_ours(name, runs, exported, gpt2, corpus, capsysbinary):
    """from_pretrained takes every tensor (none missing, unexpected or mismatched), its logits on real bytes are
    ours to 1e-5 (in training mode too), and its greedy bytes are those of --generate N --top-k 1."""
    directory, _ = runs[name]
    theirs, info = gpt2.from_pretrained(exported[name], output_loading_info=True)
    theirs.eval()
    assert not any(info.values()), info
    assert theirs.lm_head.weight is theirs.transformer.wte.weight  # tied, as ours
    ours = our_gpt(directory)
    window = torch.tensor([list((corpus / "random.py").read_bytes()[:32])])  # a validation file or not: any bytes
    with torch.no_grad():  # in training mode too: GPT-2's dropout is 0, as ours has none
        logits = ours(window)
        worst = max((logits - theirs.train(mode)(window).logits).abs().max().item() for mode in (True, False))
    assert worst <= 1e-5
    assert trainer.main(["--checkpoint-dir", str(directory), "--generate", str(SAMPLED), "--top-k", "1",
                         "--prompt", PROMPT.decode()]) == 0
    sampled = capsysbinary.readouterr().out
    assert theirs.config.bos_token_id == 0  # --generate starts every prompt after the 0 byte: the export says so
    start = torch.tensor([[theirs.config.bos_token_id, *PROMPT]])
    greedy = theirs.generate(start, attention_mask=torch.ones_like(start), do_sample=False, max_new_tokens=SAMPLED)
    assert bytes(greedy[0, 1:].tolist()) + b"\n" == sampled
    assert docs_snippet(exported[name]) == sampled.decode(errors="replace")  # docs/language-models.md's, as it is
    print(f"\n{name}: GPT-2's logits against ours, max |difference| {worst:.1e} (largest logit "
          f"{logits.abs().max().item():.1f}); greedy bytes {sampled[:-1]!r}")


def test_an_image_model_goes_out_as_safetensors_under_its_own_names(runs, exported):
    from safetensors.torch import load_file

    state = read_alone(str(runs["net"][0]))[1]
    tensors = load_file(exported["net"] / "model.safetensors")
    assert tensors.keys() == state["model"].keys()
    assert all(torch.equal(tensors[k], state["model"][k]) for k in tensors)  # BatchNorm's statistics included
    config = json.loads((exported["net"] / "config.json").read_text())
    assert config["model"] == "net"
    from files import umasked
    for path, mode in ((exported["net"], 0o777), (exported["net"] / "model.safetensors", 0o666),
                       (exported["net"] / "config.json", 0o666)):  # as any file the user writes (on main: 0600)
        assert os.stat(path).st_mode & 0o777 == umasked(mode), path
    build_model("net", 0.5, "local", config["num_classes"]).load_state_dict(tensors)  # strict: every name, every shape


def test_bad_input_is_one_line_and_status_2(runs, exported, tmp_path, capsys):
    cases = [(["--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "a")], "no checkpoint in"),
             (["--checkpoint-dir", str(runs["file"][0]), "--out", str(exported["file"])], "is not an empty folder"),
             (["--checkpoint-dir", str(runs["net"][0]), "--out", str(tmp_path / "b"), "--format", "transformers"],
              "holds a net: --format transformers is for the GPTs"),
             (["--out", str(tmp_path / "c")], "--checkpoint-dir")]
    for argv, phrase in cases:
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("trainer.export: error: ") and phrase in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_what_gpt2_has_no_place_for_is_refused_in_one_line():
    """A tensor the table does not map (a part GPT-2 lacks) and a head that is not the token embedding."""
    state = GPT(vocab_size=256, layers=1, width=8, heads=2, context=4).state_dict()
    assert len(export.gpt2_tensors(state)) == len(state) - 1  # all but the tied head
    for key, value in (("blocks.0.attention.rotary", torch.zeros(2)), ("head.weight", torch.ones(256, 8))):
        with pytest.raises(export.UsageError, match=rf"^{key.replace('.', '[.]')} "):
            export.gpt2_tensors({**state, key: value})


# ----------------------------------------------------------------------------------------------------------
# --init-from
# ----------------------------------------------------------------------------------------------------------
def first_step(rank, world_size, argv):
    """train() in a worker: the whole state_dict (rank 0's) as the first optimizer step begins, and what rank 0
    printed."""
    import contextlib
    import io

    taken, step, out = {}, trainer.optimizer_step, io.StringIO()

    def taking(parts, *args):
        if not taken:
            taken["state"] = {k: v.clone() for k, v in parts.sync.model_state_dict().items()}  # not the live ones
        return step(parts, *args)

    trainer.optimizer_step = taking
    try:
        with contextlib.redirect_stdout(out):
            trainer.train(trainer.parse_args(argv))
    finally:
        trainer.optimizer_step = step
    return {"state": taken["state"], "stdout": out.getvalue()}


def without_checkpoint_dir(argv):
    at = argv.index("--checkpoint-dir")
    return argv[:at] + argv[at + 2:]


@pytest.mark.parametrize("name, flags", [("folder", ["--zero", "3"]), ("net", ["--zero", "0"])])
def test_init_from_starts_a_fresh_run_at_the_exported_weights(name, flags, local_group, runs, exported):
    """The GPT from its transformers folder at --zero 3 (each module's tensors read as its shards are made), the
    net from its safetensors file at --zero 0 (read into the whole model): the first step begins at the weights of
    the run that wrote them, exactly (its seed another, and no checkpoint)."""
    directory, argv = runs[name]
    source = exported[name] if name == "folder" else exported[name] / "model.safetensors"
    argv = without_checkpoint_dir(argv) + ["--max-steps", "1", *flags, "--seed", "9", "--init-from", str(source)]
    started = local_group(2).run(first_step, argv)[0]
    assert max_difference(started["state"], dict(read_alone(str(directory))[1]["model"])) == 0


def test_init_from_of_another_shape_is_refused_in_one_line(local_group, runs, exported):
    argv = without_checkpoint_dir(runs["file"][1]) + ["--context", "16", "--init-from", str(exported["file"])]
    ranks = local_group(2).run(main_in_group, argv)
    assert [r["code"] for r in ranks] == [2, 2]
    assert ranks[0]["stderr"].count("\n") == 1, ranks[0]["stderr"]
    assert "its transformer.wpe.weight is (32, 64), the model's position_embedding.weight (16, 64)" in \
        ranks[0]["stderr"]


def test_a_checkpoint_in_the_directory_wins_over_init_from(local_group, runs, exported, tmp_path):
    """The --zero 3 run resumed (its folder copied) with --init-from naming the other run's export: the note says
    the file is not read, and the step begins at the checkpoint's weights."""
    directory, argv = runs["folder"]
    shutil.copytree(directory, tmp_path / "resumed")
    argv = without_checkpoint_dir(argv) + ["--checkpoint-dir", str(tmp_path / "resumed"), "--max-steps", "6",
                                           "--init-from", str(exported["file"])]
    resumed = local_group(2).run(first_step, argv)[0]
    assert f"note: --init-from {exported['file']} not read" in resumed["stdout"]
    assert max_difference(resumed["state"], dict(read_alone(str(directory))[1]["model"])) == 0


def flip_an_exponent(file, key):
    """The high byte of tensor ``key``'s first float32 inverted in a safetensors file (its header left as is)."""
    raw = bytearray(file.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    start = 8 + size + json.loads(raw[8:8 + size])[key]["data_offsets"][0]
    raw[start + 3] ^= 0x7F
    file.write_bytes(bytes(raw))


def test_exports_carry_checksums_and_init_from_refuses_a_flipped_or_non_finite_tensor(local_group, runs, exported,
                                                                                       tmp_path):
    """One exponent byte flipped in the net's export (on main: a weight of -2.4e37, read in silence, and the run
    trained on at a NaN loss) is refused by its CRC32, in one line naming the tensor; a file of another tool's (no
    checksums) is read with a one-line note, and a NaN in it refused in one line naming the tensor; a checkpoint
    that holds a NaN weight is refused by --eval-only, --generate's reader and the export alike."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(exported["net"] / "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
    assert all(f"crc32.{key}" in metadata for key in load_file(exported["net"] / "model.safetensors"))
    key = "conv1.weight"
    shutil.copytree(exported["net"], tmp_path / "flipped")
    flip_an_exponent(tmp_path / "flipped" / "model.safetensors", key)
    tensors = load_file(exported["net"] / "model.safetensors")
    tensors[key][0, 0, 0, 0] = float("nan")
    save_file(tensors, str(tmp_path / "other.safetensors"))  # another tool's: no checksums
    argv = without_checkpoint_dir(runs["net"][1]) + ["--max-steps", "1"]
    ranks = {name: local_group(2).run(main_in_group, argv + ["--init-from", str(source)])
             for name, source in (("flipped", tmp_path / "flipped"), ("other", tmp_path / "other.safetensors"))}
    for name, phrase in (("flipped", f"tensor {key} does not match its checksum"),
                         ("other", f"tensor {key} holds 1 non-finite values (nan)")):
        assert [r["code"] for r in ranks[name]] == [2, 2], ranks[name][0]["stderr"]
        assert ranks[name][0]["stderr"].count("\n") == 1 and phrase in ranks[name][0]["stderr"], ranks[name][0]
    assert ranks["other"][0]["stdout"].count("carries no checksums") == 1
    # a checkpoint with a NaN weight (written as a run before the non-finite check could have)
    directory = tmp_path / "nan-checkpoint"
    shutil.copytree(runs["file"][0], directory)
    state = torch.load(directory / "last.pt", weights_only=True)
    state["model"]["final_norm.weight"][0] = float("nan")
    torch.save(state, directory / "last.pt")
    with pytest.raises(export.UsageError, match="tensor final_norm.weight holds 1 non-finite values"):
        read_alone(str(directory))
    evaluated = local_group(2).run(main_in_group, runs["file"][1][:-2] + ["--checkpoint-dir", str(directory),
                                                                          "--eval-only"])
    assert [r["code"] for r in evaluated] == [2, 2], evaluated[0]
    assert "tensor final_norm.weight holds 1 non-finite values" in evaluated[0]["stderr"]
