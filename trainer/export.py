"""A trained model out to the formats the ecosystem loads, and back in (the trainer's --init-from).

    python -m trainer.export --checkpoint-dir DIR --out OUT [--format auto|transformers|safetensors]

reads DIR's current checkpoint in one process (either format, written at any world size: checkpoint.read_alone)
and writes a new or empty folder OUT:

- a GPT (--model gpt...), by default as transformers' GPT-2: OUT/config.json and OUT/model.safetensors, which
  ``transformers.GPT2LMHeadModel.from_pretrained(OUT)`` loads offline with no missing, unexpected or mismatched key,
  its float32 logits ours to rounding and its greedy bytes those of ``--generate N --top-k 1`` (tests/test_export.py);
- an image model (net, resnet, vit, torchvision's), or a GPT with --format safetensors: OUT/model.safetensors under
  our own state_dict's names (BatchNorm's running statistics included; a tied tensor once, under its first name)
  and OUT/config.json, {"model": NAME, ...}: what ``build_model`` needs to make the model again.

Our GPT (models.GPT) is GPT-2's architecture (nanoGPT's writing of it) up to names and layout, part by part
(i: a block; W: the width; C: the context):

    ours (models.GPT)                        GPT-2 (transformers)                  how
    token_embedding.weight (256, W)          transformer.wte.weight                as is; vocab_size 256 (a token is
                                                                                   a byte: no tokenizer)
    position_embedding.weight (C, W)         transformer.wpe.weight                as is; n_positions C (--context)
    blocks.i.attention_norm (LayerNorm)      transformer.h.i.ln_1                  eps 1e-5 in both
    blocks.i.attention.qkv (Linear, W->3W)   transformer.h.i.attn.c_attn (Conv1D)  weight transposed (*); q, k, v
                                                                                   in that order in both
    blocks.i.attention.proj (Linear, W->W)   transformer.h.i.attn.c_proj (Conv1D)  weight transposed (*)
    softmax(q k^T / sqrt(W/heads)), causal   scale_attn_weights, not by layer      n_head: the same heads
    blocks.i.mlp_norm (LayerNorm)            transformer.h.i.ln_2
    blocks.i.mlp.0 (Linear, W->4W)           transformer.h.i.mlp.c_fc (Conv1D)     weight transposed (*); n_inner 4W
    blocks.i.mlp.1: nn.GELU(), erf's         activation_function "gelu"            GPT-2's default, "gelu_new", is
                                                                                   tanh's approximation (5e-4 off)
    blocks.i.mlp.2 (Linear, 4W->W)           transformer.h.i.mlp.c_proj (Conv1D)   weight transposed (*)
    final_norm (LayerNorm)                   transformer.ln_f
    head.weight, the token embedding's       lm_head.weight, tied                  not written: from_pretrained
                                                                                   ties it (tie_word_embeddings)
    every Linear's bias; none on the head    the same
    no dropout                               resid_, embd_, attn_pdrop 0           GPT-2's default: 0.1
    a text file's bytes end with a 0 byte    bos_token_id 0, eos_token_id none     --generate's ids are [0] +
                                                                                   the prompt's bytes (the 0 byte
                                                                                   first); it never stops early

(*) Conv1D holds its weight as (in, out) and computes x @ w; nn.Linear holds (out, in) and computes x @ w.T.
Anything else in the checkpoint (a part GPT-2 lacks), a head that is not the token embedding, or tensors of another
shape than the run's recorded configuration are refused in one line naming it. Bad input (no checkpoint in DIR, OUT
not empty, an image model asked as transformers) is one line and exit status 2, as ddp_cifar100.py says a
UsageError.

Checksums: model.safetensors' header metadata carries each tensor's CRC32 ("crc32.NAME": eight hex digits, of the
tensor's bytes as stored), which --init-from checks before a tensor is used; a file without them (another tool's) is
read with a one-line note. A non-finite value in any tensor, exported or read, is refused in one line naming it.

--init-from PATH (``InitFrom``): a run starts from such a file or folder, weights only; the names above read
backwards (a GPT-2 file's Conv1D weights transposed back). Every rank reads the file itself (mmap'd, one tensor at a
time: safetensors' safe_open); a model built on the meta device (--zero 1-3, fsdp) takes its tensors module by
module as the sync materializes it (zero.shard's init=), so at --zero 3 no rank holds the model whole.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import zlib
from typing import Any, Callable

import torch
import torch.nn as nn

from data import BOUNDARY
from files import umasked
from models import GPT_SIZES, LANGUAGE_MODELS
from trainer.checkpoint import non_finite, read_alone
import utils
from utils import UsageError, one_line

WEIGHTS, CONFIG = "model.safetensors", "config.json"  # the names transformers looks for in a model folder
CRC = "crc32."  # model.safetensors' metadata: "crc32.NAME" -> the CRC32 of tensor NAME's bytes, 8 hex digits
# ours -> GPT-2's, each (pattern, replacement, transposed): the table of the module docstring
GPT2_NAMES = [
    (r"token_embedding\.weight", "transformer.wte.weight", False),
    (r"position_embedding\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.attention_norm\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"blocks\.(\d+)\.attention\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"blocks\.(\d+)\.attention\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"blocks\.(\d+)\.attention\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"blocks\.(\d+)\.attention\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"blocks\.(\d+)\.mlp_norm\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"blocks\.(\d+)\.mlp\.0\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.mlp\.0\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.mlp\.2\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.mlp\.2\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"final_norm\.(weight|bias)", r"transformer.ln_f.\1", False),
    (r"head\.weight", "transformer.wte.weight", False),  # tied: the token embedding (lm_head.weight is not written)
]
TIED = ("head.weight", "token_embedding.weight")
# what from_pretrained must take as ours computes (the docstring's table); a folder that says otherwise is refused
GPT2_FIXED = {"model_type": "gpt2", "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
              "add_cross_attention": False, "tie_word_embeddings": True}


def gpt2_name(ours: str) -> tuple[str, bool] | None:
    """Our GPT's state_dict key -> (GPT-2's key, whether the weight is transposed); None where GPT-2 has none."""
    for pattern, replacement, transposed in GPT2_NAMES:
        if re.fullmatch(pattern, ours):
            return re.sub(pattern, replacement, ours), transposed
    return None


# ----------------------------------------------------------------------------------------------------------
# Out: a checkpoint's model as files
# ----------------------------------------------------------------------------------------------------------
def gpt2_tensors(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our GPT's state_dict under GPT-2's names and layout (GPT2_NAMES), each tensor contiguous, the tied head
    left to from_pretrained; a part GPT-2 has no place for refused in one line naming it."""
    if TIED[0] in model and not torch.equal(model[TIED[0]], model[TIED[1]]):
        raise UsageError(f"{TIED[0]} is not {TIED[1]}: GPT-2's lm_head is the token embedding (tied)")
    out = {}
    for ours, tensor in model.items():
        mapped = gpt2_name(ours)
        if mapped is None:
            raise UsageError(f"{ours} {tuple(tensor.shape)}: GPT-2 has no such part; not exported")
        if ours == TIED[0]:
            continue
        name, transposed = mapped
        out[name] = (tensor.t() if transposed else tensor).contiguous()
    return out


def gpt2_config(model: dict[str, torch.Tensor], shape: dict[str, int]) -> dict[str, Any]:
    """config.json of transformers' GPT2Config for our GPT of ``shape`` (the checkpoint's record: layers, width,
    heads, context), checked against the tensors."""
    vocab, width = model["token_embedding.weight"].shape
    layers = len({name.split(".")[1] for name in model if name.startswith("blocks.")})
    context = model["position_embedding.weight"].shape[0]
    if (layers, width, context) != (shape["layers"], shape["width"], shape["context"]):
        raise UsageError(f"the checkpoint's tensors are a GPT of {layers} layers, width {width} and context {context}, "
                         f"not the {shape} its configuration records")
    return {"architectures": ["GPT2LMHeadModel"], **GPT2_FIXED, "vocab_size": vocab, "n_positions": context,
            "n_embd": width, "n_layer": layers, "n_head": shape["heads"], "n_inner": 4 * width,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02,
            "bos_token_id": BOUNDARY, "eos_token_id": None, "use_cache": True,  # --generate's first id
            "dtype": str(model["token_embedding.weight"].dtype).removeprefix("torch.")}


def crc32(tensor: torch.Tensor) -> str:
    """The CRC32 of a tensor's bytes as safetensors stores them (contiguous, little-endian), 8 hex digits."""
    return f"{zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()):08x}"


def own_tensors(model: dict[str, torch.Tensor], tied: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Our state_dict as safetensors takes it: contiguous tensors, the names in ``tied`` (a second name of one
    tensor) left out."""
    return {name: tensor.contiguous() for name, tensor in model.items() if name not in tied}


def export(checkpoint_dir: str, out: str, form: str = "auto") -> str:
    """DIR's current checkpoint to OUT (the module docstring); returns a line saying what was written."""
    from safetensors.torch import save_file

    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {out} exists and is not an empty folder")
    found = read_alone(checkpoint_dir) if os.path.isdir(checkpoint_dir) else None
    if found is None:
        raise UsageError(f"no checkpoint in {checkpoint_dir} (neither last.pt nor latest)")
    path, state = found[0].path, found[1]
    record, model = state["config"], {k: v.detach().cpu() for k, v in state["model"].items()}
    name, gpt = record.get("model"), record.get("model") in LANGUAGE_MODELS
    if form == "auto":
        form = "transformers" if gpt else "safetensors"
    if form == "transformers" and not gpt:
        raise UsageError(f"{path} holds a {name}: --format transformers is for the GPTs (GPT-2's architecture); "
                         f"an image model goes out as --format safetensors")
    metadata = {"format": "pt", "source": path, "optimizer_steps": str(state["optimizer_steps"])}
    if form == "transformers":
        tensors = gpt2_tensors(model)
        config = gpt2_config(model, record.get("gpt") or GPT_SIZES[name])
    else:
        tensors = own_tensors(model, TIED[:1] if gpt else ())
        config = {"model": name, "num_classes": (record.get("sizes") or [0, 0, 100])[2],
                  "image_size": record.get("image_size"), "norm": record.get("norm"),
                  **({"gpt": record.get("gpt")} if gpt else {}), "optimizer_steps": state["optimizer_steps"]}
    bad = non_finite(tensors.items())
    if bad is not None:
        raise UsageError(f"{path}: {bad}; not exported")
    metadata.update({CRC + key: crc32(tensor) for key, tensor in tensors.items()})
    # written whole in a folder beside OUT, then renamed to it: no reader sees half an export
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.", dir=parent)
    try:
        save_file(tensors, os.path.join(partial, WEIGHTS), metadata=metadata)
        with open(os.path.join(partial, CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for name in (WEIGHTS, CONFIG):  # as any file the user writes (safetensors makes its file private)
            os.chmod(os.path.join(partial, name), umasked(0o666))
        os.chmod(partial, umasked(0o777))  # (mkdtemp's is private too)
        os.replace(partial, out)  # onto an empty folder too (rename(2))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return f"{path} ({name}, step {state['optimizer_steps']}) -> {out}: {form}, {len(tensors)} tensors"


# ----------------------------------------------------------------------------------------------------------
# In: --init-from
# ----------------------------------------------------------------------------------------------------------
class InitFrom:
    """--init-from PATH for ``model`` (built, on its device or the meta device): a safetensors file, or a folder
    of this script's (OUT/model.safetensors, with OUT/config.json checked: a transformers GPT-2 must compute what
    ours does, a folder of ours must hold --model's model). Every tensor of the model's state_dict is looked for
    under its name (a tied one under any of its names) or, in a GPT-2 file, GPT-2's (GPT2_NAMES); a file that lacks
    one, holds one more, or holds one of another shape is refused in one line naming the first such tensor, before
    anything is read but the file's header."""

    def __init__(self, path: str, model: nn.Module, model_name: str):
        from safetensors import safe_open

        file = os.path.join(path, WEIGHTS) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise UsageError(f"--init-from {path}: no {WEIGHTS} in that folder")
        config = os.path.join(path, CONFIG) if os.path.isdir(path) else None
        if config is not None and os.path.isfile(config):
            check_folder_config(path, config, model_name)
        try:
            self.file = safe_open(file, framework="pt", device="cpu")
            keys = set(self.file.keys())
        except Exception as exc:  # noqa: BLE001 - not a safetensors file: said in one line
            raise UsageError(f"--init-from {file}: not a safetensors file ({one_line(exc)})") from None
        gpt2 = model_name in LANGUAGE_MODELS and "transformer.wte.weight" in keys
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        names = {name: aliases.get(id(p), [name]) for name, p in model.named_parameters(remove_duplicate=False)}
        self.source: dict[str, tuple[str, bool]] = {}  # our name -> (the file's name, transposed)
        for name, tensor in model.state_dict(keep_vars=True).items():
            candidates = [gpt2_name(n) if gpt2 else (n, False) for n in names.get(name, [name])]
            present = [c for c in candidates if c is not None and c[0] in keys]
            if not present:
                raise UsageError(f"--init-from {file} does not fit --model {model_name}: it has no {name}"
                                 f"{f' ({candidates[0][0]})' if gpt2 and candidates[0] else ''} "
                                 f"{tuple(tensor.shape)}")
            key, transposed = present[0]
            shape = tuple(self.file.get_slice(key).get_shape())
            expected = tuple(reversed(tensor.shape)) if transposed else tuple(tensor.shape)
            if shape != expected:
                raise UsageError(f"--init-from {file} does not fit --model {model_name}: its {key} is {shape}, the "
                                 f"model's {name} {tuple(tensor.shape)}")
            self.source[name] = (key, transposed)
        extra = sorted(keys - {key for key, _ in self.source.values()})
        if extra:
            raise UsageError(f"--init-from {file} does not fit --model {model_name}: the model has no {extra[0]}")
        self.path = file
        self.sums = {key[len(CRC):]: value for key, value in (self.file.metadata() or {}).items()
                     if key.startswith(CRC)}  # trainer.export's checksums (the module docstring)
        if not self.sums:
            utils.print0(f"note: --init-from {file} carries no checksums (not written by python -m trainer.export): "
                         f"its tensors are read unchecked")

    def tensor(self, name: str) -> torch.Tensor:
        """The file's tensor for our ``name``, its CRC32 (where the file has them) and its values checked first."""
        key, transposed = self.source[name]
        tensor = self.file.get_tensor(key)
        if self.sums and self.sums.get(key) != crc32(tensor):
            raise UsageError(f"--init-from {self.path}: tensor {key} does not match its checksum (corrupt: "
                             f"crc32 {crc32(tensor)}, the header says {self.sums.get(key)})")
        bad = non_finite([(key, tensor)])
        if bad is not None:
            raise UsageError(f"--init-from {self.path}: {bad}")
        return tensor.t() if transposed else tensor

    @torch.no_grad()
    def load(self, model: nn.Module) -> None:
        """Into a model built whole: every tensor of its state_dict."""
        for name, target in model.state_dict(keep_vars=True).items():
            target.copy_(self.tensor(name))

    def around(self, init: Callable[[nn.Module], None], model: nn.Module) -> Callable[[nn.Module], None]:
        """zero.shard's init= for a model on the meta device: ``init(module)`` (the fresh build's, so every
        tensor the file does not hold, a non-persistent buffer, is made as it is), then the module's own
        parameters and persistent buffers from the file."""
        prefixes = {id(module): f"{name}." if name else "" for name, module in model.named_modules(
            remove_duplicate=False)}
        source = self.source

        @torch.no_grad()
        def init_from_file(module: nn.Module) -> None:
            init(module)
            prefix = prefixes[id(module)]
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if prefix + name in source:
                    tensor.copy_(self.tensor(prefix + name))

        return init_from_file


def check_folder_config(path: str, config_path: str, model_name: str) -> None:
    """The folder's config.json against --model: a transformers GPT-2 whose settings (GPT2_FIXED) are what ours
    computes, or a folder of ours of that model. (Its dropout is not checked: ours has none and trains without.)"""
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--init-from {path}: unreadable {CONFIG} ({exc})") from None
    if "model_type" in config:
        if model_name not in LANGUAGE_MODELS:
            raise UsageError(f"--init-from {path} is a transformers {config['model_type']}, not --model {model_name}")
        for key, value in GPT2_FIXED.items():
            if key in config and config[key] != value:
                raise UsageError(f"--init-from {path}: {CONFIG} has {key} {config[key]!r}; our GPT computes "
                                 f"{key} {value!r}")
    elif config.get("model") != model_name:
        raise UsageError(f"--init-from {path} holds a {config.get('model')}, not --model {model_name}")


# ----------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """0 when written, 2 for bad input (one line on stderr)."""
    from trainer.config import ArgumentParser  # raises UsageError instead of printing usage

    parser = ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR",
                        help="a run's --checkpoint-dir: its current checkpoint, last.pt or DIR/latest's folder")
    parser.add_argument("--out", required=True, metavar="OUT", help="the folder to write (new, or empty)")
    parser.add_argument("--format", default="auto", choices=("auto", "transformers", "safetensors"),
                        help="transformers: a GPT-2 folder (the GPTs); safetensors: our own names (any model); auto: "
                             "transformers for a GPT, else safetensors (default)")
    try:
        args = parser.parse_args(argv)
        print(export(args.checkpoint_dir, args.out, args.format), flush=True)
        return 0
    except UsageError as exc:
        print(f"trainer.export: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
