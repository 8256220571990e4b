"""README.md and the pages under docs/ against what they describe: every flag the trainer's pages name exists, so
they cannot fall behind the parser (they name flags; `python ddp_cifar100.py --help` lists them all); and every flag
any page names belongs to one of the programs it runs."""
import contextlib
import glob
import io
import os
import re

from torch.distributed.run import get_args_parser

import ddp_cifar100 as trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
# What the README's sections from ddp_cifar100.py to allreduce.py held: the trainer's and zero.py's flags.
TRAINER_PAGES = [os.path.join(ROOT, "docs", name) for name in
                 ("trainer.md", "zero.md", "language-models.md", "slow-links.md")]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
OTHER_PROGRAM = re.compile(r"python3? (?!ddp_cifar100\.py)\S+\.py|python3? -m (?!torch\.distributed\.run\b)\S+|"
                           r"tensorboard")
# Flags of the outside tools the pages run (pytest, jupyter, tensorboard) that no parser of this repository defines.
OUTSIDE_FLAGS = {"--durations", "--inplace", "--logdir"}


def trainer_flags() -> set[str]:
    """The flags `python ddp_cifar100.py --help` prints."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        try:
            trainer.parse_args(["--help"])
        except SystemExit:
            pass
    return set(FLAG.findall(shown.getvalue()))


def repository_flags() -> set[str]:
    """Every option string an argparse parser of the repository's scripts and benchmarks declares."""
    declared = set()
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        for call in re.findall(r"add_argument\(\s*((?:[\"']-{1,2}[\w-]+[\"']\s*,\s*)+)", open(path).read()):
            declared.update(FLAG.findall(call))
    return declared


def test_every_flag_the_trainers_pages_name_exists():
    named = {flag for page in TRAINER_PAGES for line in open(page).read().splitlines()
             if not OTHER_PROGRAM.search(line) for flag in FLAG.findall(line)}
    torchrun = set(get_args_parser()._option_string_actions)
    assert len(named) > 40  # the pages were found
    unknown = sorted(named - trainer_flags() - torchrun)
    assert not unknown, f"the trainer's pages name flags the trainer does not have: {unknown}"


def test_every_flag_any_page_names_belongs_to_a_program():
    named = {flag for page in PAGES for flag in FLAG.findall(open(page).read())}
    known = trainer_flags() | set(get_args_parser()._option_string_actions) | repository_flags() | OUTSIDE_FLAGS
    assert len(repository_flags()) > 50  # the parsers were found
    unknown = sorted(named - known)
    assert not unknown, f"the README and docs/ name flags no program has: {unknown}"
