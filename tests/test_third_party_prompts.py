"""The third-party-code experiment's prompts: another package's sources, cut to 128 tokens."""

from __future__ import annotations

import pytest

from experiments.third_party_code import PROMPT_TOKENS, package_prompts


class _Bytes:
    """A tokenizer stand-in: one id per UTF-8 byte."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode())


def test_prompts_are_the_first_tokens_of_the_packages_long_files() -> None:
    prompts, files = package_prompts("json", _Bytes(), 2)
    assert len(prompts) == len(files) == 2
    assert files == sorted(files) and all(f.startswith("json/") for f in files)
    assert all(p.numel() == PROMPT_TOKENS for p in prompts)
    with pytest.raises(SystemExit, match="fewer than --prompts 999"):
        package_prompts("json", _Bytes(), 999)
    with pytest.raises(SystemExit, match="not an installed package"):
        package_prompts("no_such_package_here", _Bytes(), 1)
