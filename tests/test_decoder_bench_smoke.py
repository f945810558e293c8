"""benchmarks.decoder_bench on tiny sizes: JSON schema, exactness of greedy decoding, tools."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.decoder_bench import (
    FIRST_HEAD_TARGET,
    PHASES,
    SCHEMA_VERSION,
    BenchConfig,
    build_model,
    first_head_costs,
    format_first_head,
    format_tables,
    run_benchmark,
)
from benchmarks.spec_tools import ForcedAcceptance
from circuits.files import atomic_write_json
from circuits_llm.backbone import HFBackbone
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.heads import MTPHead
from circuits_llm.heads.vocab import DraftVocab

TINY = BenchConfig(hidden_size=16, layers=2, attention_heads=2, intermediate_size=32,
                   architectures=("ff", "btree"), windows=(4,), rank=2, variants=("lean", "full"),
                   prompt_tokens=12, new_tokens=7, repeats=1, timing_rounds=1, threads=1,
                   compiled_windows=())
DECODE_KEYS = {"new_tokens", "rounds", "tokens_per_call", "tokens_per_round", "acceptance_rate",
               "acceptance_by_position", "mean_latency_s", "mean_split_s", "throughput_tok_s"}


def test_tiny_run_schema_and_greedy_exactness(tmp_path: Path) -> None:
    result = run_benchmark(TINY, log=lambda _line: None)
    path = tmp_path / "out" / "bench.json"
    atomic_write_json(path, result, sort_keys=True)
    loaded = json.loads(path.read_text())
    assert not list(path.parent.glob("*.tmp"))
    assert loaded["schema_version"] == SCHEMA_VERSION
    assert {"machine", "model", "config", "note", "backbone_s", "heads", "target"} <= set(loaded)
    assert loaded["machine"]["torch_threads"] == 1 and "random weights" in loaded["note"]
    assert loaded["model"]["parameters"] == sum(
        p.numel() for p in build_model(TINY).parameters())
    assert {"verify_4", "ar_step"} == set(loaded["backbone_s"])
    assert loaded["target"] is None  # no btree n=16 r=32 head at these sizes
    heads = loaded["heads"]
    assert [(h["architecture"], h["variant"]) for h in heads] == [
        ("ff", "lean"), ("ff", "full"), ("btree", "lean"), ("btree", "full")]
    for head in heads:
        assert "compiled" not in head  # compiled_windows=()
        costs = head["eager"]
        assert set(PHASES) <= set(costs["phases_s"])
        assert all(costs["phases_s"][k] > 0 for k in PHASES)
        assert costs["round_over_verify"]["sampling"] > 0
        for kind in ("dispatched", "kernels"):
            ops = costs["ops"][kind]
            assert ops["verify"] > 0 and ops["ar_step"] > 0 and ops["draft_sampling"] > 0
            assert ops["head_sampling"] == ops["draft_sampling"] + ops["accept_sampling"]
            assert ops["head_greedy"] == ops["draft_greedy"] + ops["accept_greedy"]
        # the greedy round needs no conditionals: fewer ops than the sampling round
        assert costs["ops"]["dispatched"]["draft_greedy"] < costs["ops"]["dispatched"]["draft_sampling"]
        for mode in ("greedy", "sampling"):
            decode = costs["decode"][mode]
            for name in ("autoregressive", "speculative", "forced"):
                assert set(decode[name]) >= DECODE_KEYS
                assert decode[name]["new_tokens"] == TINY.new_tokens
            assert decode["forced"]["acceptance_rate"] == 1.0
            assert "speedup_vs_ar" in decode["speculative"]
        assert costs["decode"]["greedy"]["matches_ar"] is True
    table = format_tables(loaded)
    assert "btree n=4 full" in table and "forced" in table


def test_forced_acceptance_accepts_every_draft() -> None:
    model = build_model(TINY)
    backbone = HFBackbone(model)
    weight = model.get_output_embeddings().weight.detach()
    head = MTPHead.from_name("cp", 3, 2, TINY.hidden_size, TINY.vocab_size, "lean", weight)
    decoder = SpeculativeDecoder(ForcedAcceptance(backbone), head)
    result = decoder.generate(list(range(5)), 9, temperature=1.0,
                              generator=torch.Generator().manual_seed(0))
    assert result.summary.rounds == 3 and result.summary.acceptance_rate == 1.0


def test_kernel_backend_is_recorded_and_an_impossible_one_is_refused() -> None:
    import dataclasses

    import pytest

    from circuits import kernels

    small = dataclasses.replace(TINY, architectures=("ff",), variants=("lean",),
                                kernels="torch")
    result = run_benchmark(small, log=lambda _line: None)
    assert result["machine"]["kernels"] == "torch" and result["machine"]["device"] == "cpu"
    assert result["config"]["kernels"] == "torch"
    assert result["machine"]["kernel_fallbacks"] == {}
    if not kernels.interpreter_usable():
        # triton on CPU tensors needs TRITON_INTERPRET=1, and triton itself may be absent: the
        # one error says whichever applies
        why = "the tensors are on the CPU" if kernels.triton_available() else "not importable"
        with pytest.raises(kernels.KernelBackendError, match=why):
            run_benchmark(dataclasses.replace(small, kernels="triton"), log=lambda _line: None)


def test_the_resolved_device_is_recorded() -> None:
    import dataclasses

    from circuits_llm.runtime.devices import resolve_device

    small = dataclasses.replace(TINY, architectures=("ff",), variants=("lean",),
                                device="auto", kernels="torch")
    result = run_benchmark(small, log=lambda _line: None)
    resolved = str(resolve_device("auto"))  # "cpu" here; "cuda:0" on a CUDA machine
    assert result["config"]["device"] == resolved
    assert result["machine"]["device"].split(": ")[0] == resolved


def test_first_head_costs_on_a_tiny_model(tmp_path: Path) -> None:
    """``--first-head``'s measurement runs end to end (on a tiny subword model, whose small
    vocabulary the default leaves whole) and reports the default head's ratio to the target."""
    from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer
    model_dir = save_model_dir(tmp_path / "model", tiny_subword_model(300), tiny_tokenizer())
    result = first_head_costs(str(model_dir), (DraftVocab.AUTO, 50), timing_rounds=1,
                              log=lambda _line: None)
    default, sized = result["rows"]
    assert default["draft_vocab"] == "auto" and default["draft_vocab_size"] == 300
    assert sized["draft_vocab_size"] == 50 and "leading ids" in sized["described"]
    assert result["target"] == FIRST_HEAD_TARGET
    assert result["default_round_over_verify"] == max(default["round_over_verify"].values()) > 0
    assert isinstance(result["met"], bool) and "torch_threads" in result["machine"]
    assert "TARGET the default head's round" in format_first_head(result)


def test_the_batch_axis() -> None:
    """``--batch-size``: the eager decodes also run a batch of prompts of different lengths (AR
    and speculative), whose greedy rows agree."""
    import dataclasses
    small = dataclasses.replace(TINY, architectures=("btree",), variants=("lean",), batch_size=3)
    result = run_benchmark(small, log=lambda _line: None)
    decode = result["heads"][0]["eager"]["decode"]
    for mode in ("greedy", "sampling"):
        batch = decode[mode]["batch"]
        assert batch["batch_size"] == 3 and batch["speedup_vs_ar"] > 0
        assert batch["speculative"]["tok_s"] > 0 and batch["autoregressive"]["rounds"] == TINY.new_tokens
        assert set(batch["speculative"]["ms_per_round_phase"]) == {"draft", "verify", "accept"}
    assert decode["greedy"]["batch"]["matches_ar"] is True
    assert "batch 3" in format_tables(result)
