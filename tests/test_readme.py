"""README.md against the code it describes: every flag the trainer's sections name exists, so the README cannot
fall behind the parser (it names flags; `python ddp_cifar100.py --help` lists them all)."""
import contextlib
import io
import os
import re

from torch.distributed.run import get_args_parser

import ddp_cifar100 as trainer

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")  # tests/ -> root
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
OTHER_PROGRAM = re.compile(r"python3? (?!ddp_cifar100\.py)\S+\.py|tensorboard")


def trainer_flags() -> set[str]:
    """The flags `python ddp_cifar100.py --help` prints."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            trainer.parse_args(["--help"])
        except SystemExit:
            pass
    return set(FLAG.findall(shown.getvalue()))


def test_every_flag_the_trainers_sections_name_exists():
    text = open(README).read()
    sections = text[text.index("### ddp_cifar100.py"):text.index("### allreduce.py")]  # the trainer's and zero.py's
    named = {flag for line in sections.splitlines() if not OTHER_PROGRAM.search(line) for flag in FLAG.findall(line)}
    torchrun = set(get_args_parser()._option_string_actions)
    assert len(named) > 40  # the sections were found
    unknown = sorted(named - trainer_flags() - torchrun)
    assert not unknown, f"README names flags the trainer does not have: {unknown}"
