"""README.md and docs/ against the code they describe: every `tskv/...` path exists, every
`tskv ...` command line names a real command and only flags it takes, every `tskv.NAME` is
there, and no page carries run history (a commit hash, a run's date): that belongs in
CHANGELOG.md and the commit messages."""

from __future__ import annotations

import argparse
import importlib
import logging
import re
from pathlib import Path

import pytest

import tskv
from tskv._cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}

PATH = re.compile(r"(?<![\w./-])(tskv/[\w./-]*\w)")
NAME = re.compile(r"(?<![\w.])tskv\.([A-Za-z_][\w.]*)")
# A command as a user types it: `tskv listen ...` in inline code, or a line of a code block
# (its output, `tskv listen: 7 batches ...`, is not one)
INLINE = re.compile(r"`(tskv [a-z][\w-]*(?: [^`]*)?)`")
LINE = re.compile(r"^\s*(?:\$ )?(tskv [a-z][\w-]*(?: [^\n]*)?)$", re.MULTILINE)
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
OLDER = {"--replay": "--replay-endpoint", "--from-seq": "--from"}  # still taken, not shown
# History: a commit hash (seven or more hex digits with a letter and a digit, standing alone)
# or a date with a time, as a run is dated
HASH = re.compile(r"(?<![\w\[.<-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w\].])")
RUN_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CODE_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def found(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted(
        {(page, m.group(1)) for page, text in TEXT.items() for m in pattern.finditer(text)}
    )


@pytest.mark.parametrize(("page", "path"), found(PATH))
def test_every_tskv_path_the_docs_name_exists(page: str, path: str) -> None:
    assert (ROOT / path).exists(), f"{page} names {path}, which is not in the repository"


def _resolves(dotted: str) -> bool:
    obj: object = tskv
    for part in dotted.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(f"{getattr(obj, '__name__', 'tskv')}.{part}")
        except ImportError:
            return False
    return True


@pytest.mark.parametrize(("page", "name"), found(NAME))
def test_every_tskv_name_the_docs_use_exists(page: str, name: str) -> None:
    dotted = name.rstrip(".")
    # `tskv.Match.block_size` is an attribute of instances: its class is what must be there
    head = dotted.split(".")[0]
    assert hasattr(tskv, head) or _resolves(dotted), f"{page} uses tskv.{dotted}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


COMMANDS = _subcommands()


def command_lines() -> list[tuple[str, str]]:
    lines = set()
    for page, text in TEXT.items():
        blocks = "\n".join(block.group(0) for block in CODE_BLOCK.finditer(text))
        for pattern, where in ((INLINE, CODE_BLOCK.sub("", text)), (LINE, blocks)):
            for match in pattern.finditer(where):
                lines.add((page, " ".join(match.group(1).split())))
    return sorted(lines)


def _parser_of(words: list[str]) -> argparse.ArgumentParser:
    """The (sub)command's own parser: `tskv keys generate ...` is `generate`'s."""
    parser = COMMANDS[words[1]]
    for word in words[2:]:
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested or word not in nested[0].choices:
            break
        parser = nested[0].choices[word]
    return parser


@pytest.mark.parametrize(("page", "line"), command_lines())
def test_every_command_line_names_a_command_and_flags_it_takes(page: str, line: str) -> None:
    words = line.split()
    command = words[1]
    if command == "bench":  # run from a clone: its flags are the benchmark's
        from benchmarks.__main__ import main  # noqa: F401  (it is there)

        return
    assert command in COMMANDS, f"{page}: `{line}` names no command (there are {sorted(COMMANDS)})"
    takes = {option for action in _parser_of(words)._actions for option in action.option_strings}
    flags = FLAG.findall(line)
    unknown = [flag for flag in flags if flag not in takes]
    assert not unknown, f"{page}: `{line}` uses {unknown}, which tskv {command} does not take"
    older = [f"{flag} (now {OLDER[flag]})" for flag in flags if flag in OLDER]
    assert not older, f"{page}: `{line}` uses the older spelling {older}"


def test_the_clear_text_warning_security_md_shows_is_the_one_printed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tskv.curve.policy import warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="tskv"):
        warn_if_exposed(["tcp://0.0.0.0:5557"], 10000)
    [record] = caplog.records
    printed = f"{record.name}: {record.levelname}: {record.getMessage()}"
    assert printed in TEXT["docs/security.md"]


@pytest.mark.parametrize("page", sorted(TEXT))
def test_no_page_carries_run_history(page: str) -> None:
    prose = CODE_BLOCK.sub("", TEXT[page])  # sample output and payload bytes are not history
    hashes = HASH.findall(prose)
    dates = RUN_DATE.findall(prose)
    assert not hashes and not dates, (
        f"{page} carries run history (commit hashes {hashes}, dates {dates}): say what holds "
        "now and how to reproduce it; the history goes in CHANGELOG.md"
    )


def test_the_performance_page_is_a_page() -> None:
    lines = TEXT["docs/performance.md"].count("\n")
    assert lines <= 300, f"docs/performance.md is {lines} lines: at most 300 (history: CHANGELOG)"


# A figure of one machine's run: a number with a unit of time or of instructions, or a share of
# a profile. Code comments keep the reason; the figure goes to the benchmark that reproduces it.
RUN_FIGURE = re.compile(r"\d[\d.,–-]*\s?(?:ns|µs|us|instructions)\b|\d+(?:\.\d+)?% of (?:a|the)\b")
SOURCES = sorted(
    path
    for pattern in ("*.py", "*.c", "*.h")
    for path in (ROOT / "tskv").rglob(pattern)
    if "_cli" not in path.parts and "sim" not in path.parts
)


def comments(path: Path) -> str:
    """The comments and docstrings of a source file (a C file's comments, a Python file's `#`
    comments and string literals that stand alone)."""
    text = path.read_text()
    if path.suffix in (".c", ".h"):
        return "\n".join(re.findall(r"/\*.*?\*/", text, re.DOTALL))
    lines = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    docstrings = re.findall(r'"""(.*?)"""', text, re.DOTALL)
    return "\n".join(lines + docstrings)


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_no_code_comment_carries_a_figure_of_one_run(path: Path) -> None:
    figures = RUN_FIGURE.findall(comments(path))
    assert not figures, (
        f"{path.relative_to(ROOT)} has figures of one machine's run in its comments "
        f"({figures}): keep the reason, put the figure in the benchmark that measures it"
    )


def test_the_api_reference_has_every_public_name() -> None:
    reference = (ROOT / "docs" / "api.rst").read_text()
    # names of `tskv` itself; a dotted one is another module's (the service's), which Sphinx
    # imports or fails the docs build
    documented = set(
        re.findall(r"^\.\. (?:auto\w+|py:data):: (\w+)(?:\(\))?\s*$", reference, re.MULTILINE)
    )
    assert sorted(set(tskv.__all__) - documented) == []
    assert sorted(documented - set(tskv.__all__)) == []
