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


@pytest.mark.parametrize("name", RUNNABLE_PAGES)
def test_tutorial_runs(name: str) -> None:
    blocks = python_blocks(DOCS / name)
    assert blocks, f"{name} has no python blocks"
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"docs.{name}"}
    for index, block in enumerate(blocks):
        try:
            exec(compile(block, f"{name}[block {index}]", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message is the point
            raise AssertionError(f"{name} block {index} failed:\n{block}") from error
