"""A head kind added outside ``circuits_llm/heads``: registered here, built, decoded, saved, loaded.

This file does what a researcher's own module does: it registers a new named circuit with
:func:`circuits_llm.heads.register_head_kind` and uses it by name everywhere a template name works.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from toy import ToyLM

from circuits import Categorical, Circuit, InputLayer, ProductKind, ProductLayer, SumLayer
from circuits.errors import UnknownArchitectureError
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.heads import (
    HeadConfigError,
    MTPHead,
    head_kind,
    head_kind_names,
    load_head,
    register_head_kind,
    save_head,
)
from circuits_llm.heads.kinds import unregister_head_kind
from circuits_llm.protocols import draft_head_problem
from circuits_llm.training import HeadTrainingConfig

KIND = "split-cp"


@register_head_kind(KIND)
def split_cp(num_variables: int, rank: int, num_categories: int) -> Circuit:
    """The window cut in two halves, independent of each other, each a mixture of ``rank``
    factorised components."""

    def mixture(variables: range) -> SumLayer:
        inputs = [InputLayer(v, rank, Categorical(num_categories)) for v in variables]
        body = inputs[0] if len(inputs) == 1 else ProductLayer(inputs, ProductKind.HADAMARD)
        return SumLayer([body], 1)

    half = num_variables // 2
    return Circuit(ProductLayer([mixture(range(half)), mixture(range(half, num_variables))],
                                ProductKind.HADAMARD))


def head(window: int = 4, variant: str = "full", vocab: int = 5, hidden: int = 8) -> MTPHead:
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    return MTPHead.from_name(KIND, window, 3, hidden, vocab, variant, weight, dtype=torch.float64)


def test_registered_kind_builds_a_draft_head() -> None:
    built = head()
    assert KIND in head_kind_names() and head_kind(KIND.upper()).build is split_cp
    assert built.architecture == KIND and built.rank == 3 and built.window == 4
    assert draft_head_problem(built) is None
    params = built(torch.randn(2, 8, dtype=torch.float64))
    torch.testing.assert_close(built.circuit.log_partition(params),
                               torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)
    assert "architecture=split-cp" in built.extra_repr()


def test_registered_kind_decodes_like_the_autoregressive_decoder() -> None:
    lm = ToyLM(vocab_size=3, draft_branch=True)
    draft = MTPHead.from_name(KIND, 3, 2, lm.hidden_size, 3, dtype=torch.float64)
    greedy = SpeculativeDecoder(lm, draft).generate([0, 1], 8, temperature=0.0)
    reference = AutoregressiveDecoder(lm).generate([0, 1], 8, temperature=0.0)
    assert torch.equal(greedy.tokens, reference.tokens)


@pytest.mark.parametrize("variant", ["full", "lean"])
def test_registered_kind_saves_and_loads_by_name(tmp_path: Path, variant: str) -> None:
    built = head(variant=variant)
    with torch.no_grad():
        for parameter in built.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    save_head(built, tmp_path / "head")
    record = json.loads((tmp_path / "head" / "head_config.json").read_text())
    assert record["architecture"] == KIND and record["circuit"] is None and record["rank"] == 3
    loaded = load_head(tmp_path / "head", expected_hidden_size=8, expected_vocab_size=5)
    assert loaded.architecture == KIND and loaded.rank == 3 and loaded.variant is built.variant
    states = torch.randn(3, 8, dtype=torch.float64)
    expected, got = built(states), loaded(states)
    assert set(got) == set(expected)
    for fold in expected:
        torch.testing.assert_close(got[fold], expected[fold], atol=0, rtol=0)


def test_loading_an_unregistered_kind_says_to_register_it(tmp_path: Path) -> None:
    @register_head_kind("short-lived")
    def short_lived(num_variables: int, rank: int, num_categories: int) -> Circuit:
        return split_cp(num_variables, rank, num_categories)

    save_head(MTPHead.from_name("short-lived", 4, 2, 8, 5), tmp_path / "head")
    unregister_head_kind("short-lived")
    with pytest.raises(HeadConfigError, match="register_head_kind"):
        load_head(tmp_path / "head")
    with pytest.raises(UnknownArchitectureError, match=f"ff, cp, hmm, btree, {KIND}"):
        MTPHead.from_name("short-lived", 4, 2, 8, 5)


@pytest.mark.parametrize(("name", "message"), [
    ("btree", "built-in"), (KIND, "registered already"), ("Has Spaces", "must match"), ("", "must match")])
def test_bad_registrations_are_refused(name: str, message: str) -> None:
    with pytest.raises(HeadConfigError, match=message):
        register_head_kind(name)(split_cp)
    assert head_kind("btree").name == "btree" and head_kind(KIND).build is split_cp


def test_training_config_accepts_a_registered_kind() -> None:
    config = HeadTrainingConfig(architecture=KIND, window=4, rank=3, seq_len=16)
    assert config.architecture == KIND
    assert HeadTrainingConfig.from_dict(config.to_dict()) == config
