"""A sample from a trained GPT: --generate N continues --prompt by N bytes with the GPT of --checkpoint-dir's
checkpoint, last.pt or a sharded run's folder (no process group: rank 0 samples alone).

The ids the GPT sees are the 0 byte (data.BOUNDARY: the text set ends every document with it, so a document starts
after it), then the prompt's bytes: ``[0] + list(prompt.encode())``. The export says the same as GPT-2's
``bos_token_id`` 0, so transformers' greedy continuation of ``[bos_token_id, *prompt.encode()]`` is ``--generate N
--top-k 1``'s (docs/language-models.md shows it; tests/test_export.py runs it)."""
from __future__ import annotations

import math
import sys

import torch
from tqdm import tqdm

from data import BOUNDARY
from models import GPT, LANGUAGE_MODELS
from trainer.checkpoint import read_alone
from trainer.config import Config
from utils import UsageError


@torch.no_grad()
def generate(config: Config) -> bytes:
    """--generate N: the GPT of --checkpoint-dir's checkpoint continues --prompt by N bytes, each drawn from its
    softmax(logits / --temperature) (among the --top-k likeliest), on the CPU with a generator seeded by --seed.
    The text set ends every file with a 0 byte, so an empty prompt starts from that: the beginning of a file."""
    found = read_alone(config.checkpoint_dir)
    if found is None:
        raise UsageError(f"--generate: no checkpoint in {config.checkpoint_dir} (neither last.pt nor latest)")
    path, state = found[0].path, found[1]
    record = state["config"]  # the run's trajectory: its GPT's shape included
    if record.get("model") not in LANGUAGE_MODELS:
        raise UsageError(f"--generate: {path} holds a {record.get('model')}, not a GPT trained on --dataset text")
    model = GPT(vocab_size=256, **record["gpt"]).eval()
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise UsageError(f"--generate: {path} does not hold the GPT its configuration names: "
                         f"{str(exc).splitlines()[1].strip()}") from None
    prompt = config.prompt.encode()
    tokens = torch.tensor([[BOUNDARY, *prompt]], dtype=torch.int64)  # the module docstring's ids
    generator = torch.Generator().manual_seed(config.seed)
    for _ in tqdm(range(config.generate), desc="sampling", unit="B", disable=not sys.stderr.isatty(), leave=False):
        logits = model(tokens[:, -model.context:])[0, -1] / config.temperature
        if config.top_k is not None and config.top_k < len(logits):
            logits[logits < logits.topk(config.top_k).values[-1]] = -math.inf
        drawn = torch.multinomial(torch.softmax(logits, dim=0), 1, generator=generator)
        tokens = torch.cat([tokens, drawn[None]], dim=1)
    return bytes(tokens[0, 1:].tolist())
