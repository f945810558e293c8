"""The tutorials run as written: each page's python blocks execute in order in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"
RUNNABLE_PAGES = ["tutorial-circuits.md", "tutorial-llm.md", "decoder-exactness.md"]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def run_blocks(page: Path) -> None:
    """Execute the page's python blocks in order in one namespace; a failure names the block."""
    blocks = python_blocks(page)
    assert blocks, f"{page.name} has no python blocks"
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page.name}[block {index}]", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message is the point
            raise AssertionError(f"{page.name} block {index} failed:\n{block}") from error


@pytest.mark.parametrize("name", RUNNABLE_PAGES)
def test_tutorial_runs(name: str) -> None:
    run_blocks(DOCS / name)


def test_readme_runs() -> None:
    """The README's first looks run as written (the LLM one on the real SmolLM2 that `make test`
    installs, with the shipped BTree head and a head built by name)."""
    assert len(python_blocks(DOCS.parent / "README.md")) >= 2, "README.md lost its first looks"
    run_blocks(DOCS.parent / "README.md")
