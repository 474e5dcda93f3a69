"""A newcomer's walk through README.md and docs/: every Python block there is read out of the
Markdown itself, so a doc change cannot silently break one. Each block must compile, every
`tskv.NAME` it uses must exist, and the README's publisher program runs as written, on loopback,
read by a real subscriber."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import tskv

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) for every ```python block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = python_blocks()


def test_the_docs_have_python_to_walk_through() -> None:
    assert len(BLOCKS) >= 15, [where for where, _ in BLOCKS]


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_every_block_compiles_and_names_only_what_tskv_has(where: str, code: str) -> None:
    tree = ast.parse(code, where)  # a syntax error fails here, naming the page and line
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "tskv"
    }
    missing = sorted(name for name in used if not hasattr(tskv, name))
    assert not missing, f"{where} uses tskv names that do not exist: {missing}"


def readme_block(starting: str) -> str:
    [code] = [code for where, code in BLOCKS if where.startswith("README") and starting in code]
    return code


async def test_the_readmes_publisher_and_router_run_as_written_and_end_on_their_own() -> None:
    """The README's two programs, each its own process exactly as the page has it: the
    scheduler prints where it publishes and waits for a subscriber; the router starts from its
    whole cache, and ends when the scheduler does, having seen all ten blocks."""
    scheduler = await trio.lowlevel.open_process(
        [sys.executable, "-c", readme_block("async def scheduler()")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert scheduler.stdout is not None
        with trio.fail_after(30):
            line = b""
            while not line.endswith(b"\n"):
                line += await scheduler.stdout.receive_some(1)
        words = line.decode().split()
        assert words[:2] == ["publishing", "on"], line
        endpoint, replay = words[2], words[-1]
        assert endpoint.startswith("tcp://127.0.0.1:")
        program = readme_block("async def router(")
        with trio.fail_after(60):
            router = await trio.run_process(
                [sys.executable, "-c", program, endpoint, replay], capture_stdout=True
            )
            assert await scheduler.wait() == 0
    finally:
        scheduler.kill()
    assert router.stdout.decode().splitlines()[-1] == "the publisher is gone; it held 10 blocks"
