"""Every ```python block of docs/integration.md runs, each in a fresh namespace.

One test per block, its id naming the section it sits in; a block that raises fails its test,
and a page without python blocks fails too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[3] / "docs" / "integration.md"


@dataclass(frozen=True)
class Block:
    """One ```python block: its section's heading, its first line in the page, its code."""

    section: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") + f"-line{self.line}"


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown page, in order, with the ``#``/``##`` heading above."""
    blocks: list[Block] = []
    section, code, start = "", None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        if code is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
            elif line.strip() == "```python":
                code, start = [], number + 1
        elif line.strip() == "```":
            blocks.append(Block(section, start, "\n".join(code) + "\n"))
            code = None
        else:
            code.append(line)
    if code is not None:
        raise ValueError(f"{PAGE}: the ```python block from line {start} is never closed")
    return blocks


BLOCKS = python_blocks(PAGE.read_text())


def test_the_page_has_python_blocks() -> None:
    assert BLOCKS, f"{PAGE} holds no ```python block"


def test_the_extractor_keeps_each_block_with_its_section() -> None:
    page = "# Top\n```python\na = 1\n```\n## Two\ntext\n```python\nb = 2\nc = 3\n```\n```\nx\n```\n"
    assert python_blocks(page) == [Block("Top", 3, "a = 1\n"), Block("Two", 8, "b = 2\nc = 3\n")]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_block_runs(block: Block) -> None:
    code = compile(block.code, f"{PAGE.name}:{block.line}", "exec")
    exec(code, {"__name__": "integration_snippet"})
