"""README.md and the pages under docs/ against what they describe: every relative link resolves (to a file or folder
of the repository, and to a heading where it names one); every flag the trainer's pages name exists, so they cannot
fall behind the parser (they name flags; `python ddp_cifar100.py --help` lists them all); and every flag any page
names belongs to one of the programs it runs."""
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
# What the README's sections from ddp_cifar100.py to allreduce.py held: the trainer's and zero's flags.
TRAINER_PAGES = [os.path.join(ROOT, "docs", name) for name in
                 ("trainer.md", "zero.md", "language-models.md", "slow-links.md")]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
OTHER_PROGRAM = re.compile(r"python3? (?!ddp_cifar100\.py)\S+\.py|python3? -m (?!torch\.distributed\.run\b)\S+|"
                           r"tensorboard")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# Flags of the outside tools the pages run (pytest, jupyter, tensorboard) that no parser of this repository defines.
OUTSIDE_FLAGS = {"--durations", "--inplace", "--logdir", "--deselect", "--junitxml"}


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
    """Every option string an argparse parser of the repository's scripts, benchmarks, trainer/ tools and the
    coordinator (replicas/) declares."""
    declared = set()
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "benchmarks", "*.py")) + \
            glob.glob(os.path.join(ROOT, "trainer", "*.py")) + glob.glob(os.path.join(ROOT, "replicas", "*.py")):
        for call in re.findall(r"add_argument\(\s*((?:[\"']-{1,2}[\w-]+[\"']\s*,\s*)+)", open(path).read()):
            declared.update(FLAG.findall(call))
    return declared


def prose(path: str) -> list[str]:
    """The page's lines outside code blocks (where a '#' line is a shell comment, not a heading)."""
    lines, fenced = [], False
    for line in open(path).read().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to hyphens, a repeat
    numbered."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(path: str, root: str = ROOT) -> list[str]:
    """The page's relative links that do not resolve: no such file or folder, a path outside the repository, or an
    anchor no heading of the target page has."""
    broken = []
    text = "\n".join(prose(path))  # a link's text may wrap
    for target in LINK.findall(re.sub(r"`[^`]*`", "", text)):  # code spans hold no links
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this test's business
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if os.path.commonpath([resolved, root]) != root:
            broken.append(f"{target} (outside the repository)")
        elif not os.path.exists(resolved):
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_orients_and_the_chapters_have_pages():
    lines = open(README).read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines"
    assert "python3 -m pytest -q" in lines  # the test command CI (.ci/run) runs
    assert len(PAGES) - 1 >= 3 and all(os.path.exists(page) for page in TRAINER_PAGES)


def test_every_relative_link_resolves():
    broken = {os.path.relpath(page, ROOT): found for page in PAGES if (found := broken_links(page))}
    assert not broken, f"links that do not resolve: {broken}"


def test_a_broken_link_is_found(tmp_path):
    """The check above can fail: a missing file, a missing heading, a path out of the repository."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Its part\n")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](docs/page.md) [ok](docs/page.md#its-part) [ok](#top) [web](https://pytorch.org)\n\n"
                      "# Top\n\n[gone](docs/gone.md) [no\nheading](docs/page.md#no-such-part) [out](../elsewhere.md)\n"
                      "`[in code](docs/gone.md)`\n\n```\n[in a block](docs/gone.md)\n```\n")
    assert broken_links(str(readme), str(tmp_path)) == [
        "docs/gone.md (no such file)", "docs/page.md#no-such-part (no such heading)",
        "../elsewhere.md (outside the repository)"]


def commands_and_lines(page: str) -> list[str]:
    """The page's lines, a shell command continued over several lines (ending in a backslash) joined into one, so
    that the flags on its later lines are read as the program's on its first."""
    return re.sub(r"\\\n", " ", open(page).read()).splitlines()


def test_every_flag_the_trainers_pages_name_exists():
    named = {flag for page in TRAINER_PAGES for line in commands_and_lines(page)
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
