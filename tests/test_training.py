"""circuits_llm.training: loss falls, exact resume, export round trip, clear errors, LoRA, data."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from circuits import templates
from circuits.serialization import save_circuit
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.heads import HeadVariant
from circuits_llm.heads.io import head_tensors
from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.text.byte_level import Split, split_of
from circuits_llm.training import (
    CHECKPOINT_FILE,
    CheckpointError,
    DataSource,
    HeadTrainingConfig,
    TrainingConfigError,
    load_trained_head,
    read_record,
    train_head,
)
from circuits_llm.training.datasets import DISTILL_FILE, DISTILL_KIND

V = 260


def tiny_llama(seed: int = 0, hidden: int = 32) -> PreTrainedModel:
    """A tiny random byte-vocabulary Llama (2 layers, d = 32)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=256, eos_token_id=257,
        pad_token_id=258)).eval()


def make_corpus(root: Path) -> Path:
    """Write a small corpus into ``root``: 4 training and 2 validation files (fast to scan)."""
    root.mkdir(parents=True, exist_ok=True)
    text = (Path(json.__file__).parent / "decoder.py").read_bytes()
    wanted = {Split.TRAIN: 4, Split.VALIDATION: 2}
    index = 0
    while any(wanted.values()):
        name = f"module_{index}.py"
        split = split_of(name)
        if wanted.get(split, 0) > 0:
            (root / name).write_bytes(text[index * 97 % 2000:])
            wanted[split] -= 1
        index += 1
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def config(**changes: object) -> HeadTrainingConfig:
    base = HeadTrainingConfig(architecture="btree", window=4, rank=4, seq_len=24, batch_size=4,
                              learning_rate=1e-2, steps=6, eval_every=3, eval_windows=4,
                              checkpoint_every_s=0.0, seed=1)
    return dataclasses.replace(base, **changes)


def train(run_dir: Path, corpus: Path, cfg: HeadTrainingConfig, model: PreTrainedModel | None = None,
          **kwargs: object):
    return train_head(model or tiny_llama(), cfg, run_dir, progress=False, corpus_root=corpus,
                      **kwargs)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------------------- config
def test_config_json_round_trip_and_parsing() -> None:
    cfg = config(architecture="HMM", variant="full", data="self-distilled", gamma=0.7,
                 distill_prompt_len=8, max_train_bytes=5000)
    assert cfg.variant is HeadVariant.FULL and cfg.data is DataSource.SELF_DISTILLED
    assert cfg.architecture is templates.Architecture.HMM
    again = HeadTrainingConfig.from_json(cfg.to_json())
    assert again == cfg
    assert json.loads(cfg.to_json())["architecture"] == "hmm"


@pytest.mark.parametrize(("changes", "message"), [
    ({"window": 1}, "window must be an int >= 2"),
    ({"architecture": "mlp"}, "unknown architecture 'mlp'"),
    ({"architecture": "ff", "rank": 4}, "ff (fully factorised) head has rank 1"),
    ({"circuit_file": "c.json"}, "either architecture or circuit_file"),
    ({"architecture": None}, "give an architecture"),
    ({"seq_len": 4}, "seq_len must be an int >= 5"),
    ({"gamma": 1.5}, "gamma must be in (0, 1]"),
    ({"variant": "medium"}, "unknown head variant"),
    ({"data": "web"}, "unknown data source"),
    ({"data": "self-distilled", "distill_prompt_len": 22}, "fewer than the window"),
    ({"learning_rate": -1.0}, "learning_rate must be a finite number > 0"),
])
def test_bad_config_values_are_clear_errors(changes: dict, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=None) as error:
        config(**changes)
    assert message in str(error.value)


def test_unknown_config_key_is_an_error() -> None:
    with pytest.raises(TrainingConfigError, match="unknown training config keys"):
        HeadTrainingConfig.from_dict({**config().to_dict(), "epochs": 3})


# ------------------------------------------------------------------------------- training
def test_loss_falls_and_run_is_exported(tmp_path: Path, corpus: Path) -> None:
    cfg = config(steps=24, eval_every=8, variant="full")
    result = train(tmp_path, corpus, cfg)
    assert result.finished and result.step == 24 and result.session_steps == 24
    before, after = result.initial_validation, result.validation
    assert len(after.nll) == 4 and after.step == 24
    assert after.mean_bits < before.mean_bits - 0.5, (before.mean_bits, after.mean_bits)
    assert after.loss < before.loss
    losses = [h["train_loss"] for h in result.history[1:]]
    assert losses[-1] < losses[0]
    record = read_record(tmp_path)
    assert record["finished"] and record["step"] == 24
    assert record["validation"]["bits"] == pytest.approx(list(after.bits))
    assert HeadTrainingConfig.from_dict(record["config"]) == cfg
    assert {"head/head.safetensors", "head/head_config.json", "training.json",
            CHECKPOINT_FILE} <= set(snapshot(tmp_path))
    assert not (tmp_path / "adapter").exists()


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path: Path, corpus: Path) -> None:
    cfg = config(lora_layers=1, lora_rank=4, steps=7)
    whole = train(tmp_path / "whole", corpus, cfg)
    first = train(tmp_path / "split", corpus, cfg, max_steps=4)
    assert not first.finished and first.step == 4
    assert not read_record(tmp_path / "split")["finished"]
    second = train(tmp_path / "split", corpus, cfg)
    assert second.finished and second.session_steps == 3
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "split" / CHECKPOINT_FILE, "circuits_llm.train_head")
    assert a["head"].keys() == b["head"].keys() and a["lora"].keys() == b["lora"].keys()
    for group in ("head", "lora"):
        for name, value in a[group].items():
            assert torch.equal(value, b[group][name]), name
    assert torch.equal(a["data_generator"], b["data_generator"])
    assert whole.validation == second.validation
    assert whole.train_loss == second.train_loss


def test_export_round_trip_decodes_like_autoregressive(tmp_path: Path, corpus: Path) -> None:
    cfg = config(lora_layers=1, lora_rank=4, architecture="cp", steps=4)
    model = tiny_llama()
    train(tmp_path, corpus, cfg, model)
    trained = load_checkpoint(tmp_path / CHECKPOINT_FILE, "circuits_llm.train_head")
    fresh = tiny_llama()
    head, backbone = load_trained_head(tmp_path, fresh)
    for name, value in head_tensors(head).items():
        assert torch.equal(value, trained["head"][name]), name
    for name, value in backbone.lora_state_dict().items():
        assert torch.equal(value, trained["lora"][name]), name
    assert any(bool(v.abs().sum() > 0) for k, v in backbone.lora_state_dict().items()
               if "lora_B" in k)
    prompt = torch.tensor([256, *b"def f(x):\n    return"])
    expected = AutoregressiveDecoder(fresh).generate(prompt, 24).tokens
    result = SpeculativeDecoder(backbone, head).generate(prompt, 24)
    assert result.tokens.tolist() == expected.tolist()


def test_lora_trains_adapters_and_leaves_the_base_frozen(tmp_path: Path, corpus: Path) -> None:
    model = tiny_llama()
    base = {name: value.clone() for name, value in model.state_dict().items()}
    train(tmp_path, corpus, config(lora_layers=2, lora_rank=4, steps=3), model)
    assert all(torch.equal(value, base[name]) for name, value in model.state_dict().items())
    assert not any(p.requires_grad for p in model.parameters())
    adapter = load_checkpoint(tmp_path / CHECKPOINT_FILE, "circuits_llm.train_head")["lora"]
    assert adapter and all(bool(v.abs().sum() > 0) for k, v in adapter.items() if "lora_B" in k)
    assert (tmp_path / "adapter" / "adapter.safetensors").is_file()
    assert read_record(tmp_path)["lora_parameters"] == sum(v.numel() for v in adapter.values())


def test_self_distilled_data_is_the_models_own_continuation(tmp_path: Path, corpus: Path) -> None:
    cfg = config(data="self-distilled", seq_len=16, distill_prompt_len=8, distill_samples=6,
                 eval_windows=2, distill_temperature=1.0, steps=3)
    model = tiny_llama()
    result = train(tmp_path, corpus, cfg, model)
    cache = load_checkpoint(tmp_path / DISTILL_FILE, DISTILL_KIND)
    sequences = cache["train"]
    assert tuple(sequences.shape) == (6, 16) and tuple(cache["validation"].shape) == (2, 16)
    # Regenerate the first sequence with the same decoder, prompt and seed.
    again = AutoregressiveDecoder(model).generate(
        sequences[0, :8], 8, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert again.tokens.tolist() == sequences[0, 8:].tolist()
    # The loss covers the responses: every window position has 8 - j + 1 targets per sequence.
    assert result.validation.tokens == tuple(2 * (9 - j) for j in range(1, 5))
    assert all(math.isfinite(v) for v in result.validation.nll)
    before = snapshot(tmp_path)
    train(tmp_path, corpus, dataclasses.replace(cfg, steps=4))  # resumes from the cached data
    assert snapshot(tmp_path)[DISTILL_FILE] == before[DISTILL_FILE]
    other = tmp_path / "other"
    other.mkdir()
    (other / DISTILL_FILE).write_bytes(before[DISTILL_FILE])
    with pytest.raises(CheckpointError, match="generated with other settings"):
        train(other, corpus, dataclasses.replace(cfg, distill_temperature=0.5))


def test_head_from_a_circuit_file_trains(tmp_path: Path, corpus: Path) -> None:
    path = tmp_path / "cp3.json"
    save_circuit(templates.build("cp", num_variables=4, num_categories=V, rank=3), path)
    cfg = config(architecture=None, circuit_file=str(path), steps=12, eval_every=12)
    result = train(tmp_path / "run", corpus, cfg)
    assert result.validation.mean_bits < result.initial_validation.mean_bits
    head, _ = load_trained_head(tmp_path / "run", tiny_llama())
    assert head.architecture is None and head.window == 4 and head.rank is None


# ------------------------------------------------------------------------------- errors
def test_corrupt_checkpoint_is_a_clear_error_and_nothing_is_overwritten(tmp_path: Path,
                                                                      corpus: Path) -> None:
    train(tmp_path, corpus, config(steps=2))
    checkpoint = tmp_path / CHECKPOINT_FILE
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match="corrupt"):
        train(tmp_path, corpus, config(steps=4))
    assert snapshot(tmp_path) == before


def test_checkpoint_of_another_config_or_model_is_refused(tmp_path: Path, corpus: Path) -> None:
    train(tmp_path, corpus, config(steps=2))
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=r"different configuration \(learning_rate"):
        train(tmp_path, corpus, config(steps=2, learning_rate=0.5))
    with pytest.raises(CheckpointError, match="another model"):
        train(tmp_path, corpus, config(steps=2), tiny_llama(seed=5))
    assert snapshot(tmp_path) == before
    (tmp_path / CHECKPOINT_FILE).unlink()  # an export without its checkpoint is not restarted
    with pytest.raises(CheckpointError, match=r"no checkpoint\.pt"):
        train(tmp_path, corpus, config(steps=2))
    with pytest.raises(TrainingConfigError, match="another configuration"):
        load_trained_head(tmp_path, tiny_llama(hidden=48))


def test_heads_that_do_not_fit_the_model_are_clear_errors(tmp_path: Path, corpus: Path) -> None:
    wrong = tmp_path / "wrong.json"
    save_circuit(templates.build("cp", num_variables=4, num_categories=V - 4, rank=2), wrong)
    with pytest.raises(TrainingConfigError, match=r"Categorical\(260\)"):
        train(tmp_path / "a", corpus, config(architecture=None, circuit_file=str(wrong)))
    right = tmp_path / "right.json"
    save_circuit(templates.build("cp", num_variables=3, num_categories=V, rank=2), right)
    with pytest.raises(TrainingConfigError, match="set window=3"):
        train(tmp_path / "b", corpus, config(architecture=None, circuit_file=str(right)))
    torch.manual_seed(0)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4))
    with pytest.raises(TrainingConfigError, match=r"vocabulary 200\) is not byte-level"):
        train(tmp_path / "c", corpus, config(), small)
    with pytest.raises(TrainingConfigError, match="lora_layers"):
        train(tmp_path / "d", corpus, config(lora_layers=5))
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_cli_reports_bad_arguments_in_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from circuits_llm.app.cli import main
    status = main(["train-head", "--model", str(tmp_path / "missing"), "--run-dir",
                   str(tmp_path / "run"), "--window", "1"])
    assert status == 2
    assert capsys.readouterr().err.strip() == \
        "circuits-llm train-head: error: window must be an int >= 2, got 1"
    assert main(["train-head", "--model", str(tmp_path / "missing"), "--run-dir",
                 str(tmp_path / "run")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_head_fingerprint_ignores_how_the_file_stores_tensors() -> None:
    """A run checkpointed before head format 4 (float16 storage, tied rows) still resumes: the
    fingerprint of a head's structure is the one format 3 wrote (recorded value)."""
    from circuits_llm.heads import MTPHead
    from circuits_llm.training.build import head_fingerprint
    head = MTPHead.from_name("btree", window=4, rank=4, hidden_size=16, vocab_size=64,
                             variant="lean", lm_head_weight=torch.randn(64, 16),
                             draft_vocab=torch.arange(10))
    assert head_fingerprint(head) == \
        "9d0961b0025b45c0bfe70adb122755005fccd6af8973850579255665f83ad2f2"


def test_init_from_a_float16_head_keeps_the_models_exact_rows(tmp_path: Path) -> None:
    """``init_from`` a head stored in float16 (as the shipped heads are) copies its trained
    tensors, but the frozen copies of the model's rows (LEAN LM head, token embedding) stay the
    model's own, not their float16 rounding."""
    from circuits_llm.heads import MTPHead, save_head
    from circuits_llm.training.build import start_from
    torch.manual_seed(0)
    rows = torch.randn(64, 16)

    def build() -> MTPHead:
        return MTPHead.from_name("btree", window=4, rank=4, hidden_size=16, vocab_size=64,
                                 variant="lean", lm_head_weight=rows, token_embedding=rows,
                                 draft_vocab=torch.arange(10))

    saved = build()
    with torch.no_grad():
        saved.sums.weight.normal_()
    save_head(saved, tmp_path / "head", storage_dtype=torch.float16)
    head = build()
    start_from(head, tmp_path / "head")
    assert torch.equal(head.inputs.lm_head, rows[:10])
    assert torch.equal(head.token_input.embedding, saved.token_input.embedding)
    torch.testing.assert_close(head.sums.weight, saved.sums.weight.half().float())
