"""Training towards the model's own law (``HeadTrainingConfig.target_law = model``).

* the config: parsing, JSON, defaults, clear errors, and caching off by default where the cache
  could not give the LM's last hidden state (LoRA);
* the law a step reads: from cached features it equals the live logits up to float16 rounding;
  a model whose logits are not its LM head applied to that state is one clear error;
* weight 0 is the token loss; whole runs train towards the model's law from cached features and
  live; the CLI flags reach the config;
* a LEAN head starts from a saved head of a smaller lean rank at the saved head's law.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from test_training import config, make_corpus, tiny_llama, train

from circuits_llm.heads import load_head
from circuits_llm.training import TargetLaw, read_record
from circuits_llm.training import features as feats
from circuits_llm.training.cli import add_train_head_command, config_from_args
from circuits_llm.training.config import DataSource, HeadTrainingConfig, TrainingConfigError
from circuits_llm.training.datasets import TensorSequences
from circuits_llm.training.distributed import distributed_context
from circuits_llm.training.features import FeatureRows
from circuits_llm.training.trainer import Trainer

DISTILLED = {"data": "self-distilled", "seq_len": 16, "distill_prompt_len": 8,
             "distill_samples": 6, "eval_windows": 2, "steps": 3}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _private_feature_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(feats.FEATURE_CACHE_ENV, str(tmp_path / "feature-cache"))


# ------------------------------------------------------------------------------- config
def test_config_parses_round_trips_and_defaults() -> None:
    cfg = config(target_law="model", teacher_top_k=4, teacher_weight=0.5, **DISTILLED)
    assert cfg.target_law is TargetLaw.MODEL
    assert HeadTrainingConfig.from_json(cfg.to_json()) == cfg
    assert cfg.teacher_law_temperature == cfg.distill_temperature  # the decode temperature
    assert config(target_law="model", distill_temperature=0.0,
                  **DISTILLED).teacher_law_temperature == 0.0
    assert config(target_law="model").teacher_law_temperature == 1.0  # corpus data
    assert config(target_law="model", teacher_temperature=0.5).teacher_law_temperature == 0.5
    assert config().target_law is TargetLaw.TOKENS
    # read from a record written before the fields existed
    old = config().to_dict()
    for key in ("target_law", "teacher_top_k", "teacher_temperature", "teacher_weight"):
        del old[key]
    assert HeadTrainingConfig.from_dict(old) == config()


@pytest.mark.parametrize(("changes", "message"), [
    ({"target_law": "soft"}, "target_law"),
    ({"teacher_top_k": 0}, "teacher_top_k"),
    ({"teacher_weight": 1.5}, "teacher_weight"),
    ({"teacher_weight": -0.1}, "teacher_weight"),
    ({"teacher_temperature": -1.0}, "teacher_temperature"),
    ({"target_law": "model", "lora_layers": 1, "cache_features": "on"},
     "does not hold.*--lora-layers 0"),
])
def test_bad_teacher_settings_are_clear_errors(changes: dict, message: str) -> None:
    with pytest.raises(TrainingConfigError, match=message):
        config(**changes)


def test_lora_runs_towards_the_model_law_run_the_backbone() -> None:
    distilled = {**DISTILLED, "lora_layers": 1, "lora_rank": 4}
    assert feats.caching_wanted(config(**distilled))
    assert not feats.caching_wanted(config(target_law="model", **distilled))
    assert feats.caching_wanted(config(target_law="model", **DISTILLED))


# ------------------------------------------------------------------------------- runs
def built_trainer(model: torch.nn.Module, cfg: HeadTrainingConfig, run_dir: Path,
                  ) -> tuple[Trainer, FeatureRows]:
    """A trainer whose head is built, on 4 random rows with cached features."""
    trainer = Trainer(model, cfg, run_dir, distributed_context(model.device, 4), False)
    sequences = TensorSequences(torch.randint(0, 250, (4, 16),
                                              generator=torch.Generator().manual_seed(0)))
    train_set, _ = trainer.cached_features(sequences, sequences)
    assert isinstance(train_set, FeatureRows)
    trainer.build_head(train_set)
    return trainer, train_set


def test_weight_zero_is_the_token_loss(tmp_path: Path) -> None:
    """A step's loss and gradients: equal up to float32 rounding (the teacher's extra circuit
    rows change how the batched products block their sums, nothing else)."""
    runs = {}
    for name, cfg in (("tokens", config(**DISTILLED)),
                      ("zero", config(target_law="model", teacher_weight=0.0, **DISTILLED))):
        trainer, rows = built_trainer(tiny_llama(), cfg, tmp_path / name)
        index = torch.arange(4)
        loss, _, _ = trainer.draft(rows.rows(index)[0], None, rows.features(index))
        loss.backward()
        runs[name] = (loss.detach(), {n: p.grad for n, p in trainer.head.named_parameters()
                                      if p.grad is not None})
    torch.testing.assert_close(runs["zero"][0], runs["tokens"][0], rtol=1e-6, atol=0)
    assert runs["zero"][1].keys() == runs["tokens"][1].keys()
    for name, grad in runs["tokens"][1].items():
        torch.testing.assert_close(runs["zero"][1][name], grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("caching", ["on", "off"])
def test_model_law_training_runs_cached_and_live(tmp_path: Path, corpus: Path,
                                                 caching: str) -> None:
    cfg = config(target_law="model", teacher_top_k=5, cache_features=caching, steps=4,
                 draft_vocab=64, **{k: v for k, v in DISTILLED.items() if k != "steps"})
    result = train(tmp_path / "run", corpus, cfg)
    counted = [v for v, n in zip(result.validation.nll, result.validation.tokens, strict=True)
               if n > 0]  # slots with a target inside the 64-token draft vocabulary
    assert counted and all(math.isfinite(v) for v in counted)
    assert bool(read_record(tmp_path / "run")["feature_cache"]) == (caching == "on")
    tokens = train(tmp_path / "tokens", corpus, dataclasses.replace(cfg,
                                                                    target_law=TargetLaw.TOKENS))
    assert result.validation.nll != tokens.validation.nll  # the target changed the training


def test_the_law_from_cached_features_is_the_live_one(tmp_path: Path) -> None:
    model = tiny_llama()
    trainer, train_set = built_trainer(model, config(target_law="model", draft_vocab=64,
                                                     **DISTILLED), tmp_path)
    assert trainer.draft.teacher is not None
    rows = torch.arange(4)
    tokens, _ = train_set.rows(rows)
    cached = trainer.draft.states(tokens, train_set.features(rows))[1]
    live = trainer.draft.states(tokens)[1]
    assert cached is not None and live is not None
    assert cached.logits.shape == (4, 16, trainer.head.draft_vocab_size)
    # float16 features: each product of d = 32 terms moves by at most 2^-11 of its magnitude
    state = train_set.features(rows).float().abs()
    bound = 2.0 ** -11 * float(state.sum(-1).max()) * \
        float(model.get_output_embeddings().weight.abs().max())
    assert float((cached.logits - live.logits).abs().max()) <= bound
    # a model whose logits are not its LM head applied to the cached state is refused
    size = model.get_output_embeddings().weight.shape[0]
    model.get_output_embeddings = lambda: torch.nn.Linear(32, size, bias=False)
    with pytest.raises(TrainingConfigError, match=r"not its LM head applied.*--no-cache-features"):
        trainer.build_head(train_set)


def test_cli_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_train_head_command(parser.add_subparsers())
    args = parser.parse_args(["train-head", "--run-dir", "r", "--target-law", "model",
                              "--teacher-top-k", "8", "--teacher-temperature", "0",
                              "--teacher-weight", "0.7", "--self-distill"])
    cfg = config_from_args(args)
    assert cfg.target_law is TargetLaw.MODEL and cfg.teacher_top_k == 8
    assert cfg.teacher_temperature == 0.0 and cfg.teacher_weight == 0.7
    assert cfg.data is DataSource.SELF_DISTILLED
    default = config_from_args(parser.parse_args(["train-head", "--run-dir", "r"]))
    assert default.target_law is TargetLaw.TOKENS and default.teacher_temperature is None


def test_init_from_a_smaller_lean_rank_keeps_the_law(tmp_path: Path, corpus: Path) -> None:
    """A LEAN head grows its lean rank from a saved head: the saved components first, the new
    ones with ``up = 0``, so the run starts at the saved head's law."""
    model = tiny_llama(seed=2)
    small = config(architecture="ff", rank=1, lean_rank=2, draft_vocab=64, steps=3, eval_every=3)
    first = train(tmp_path / "small", corpus, small, model)
    wider = dataclasses.replace(small, lean_rank=5, init_from=str(tmp_path / "small" / "head"))
    second = train(tmp_path / "wide", corpus, wider, model)
    assert second.initial_validation.nll == pytest.approx(first.validation.nll, abs=1e-5)
    saved = load_head(tmp_path / "small" / "head")
    grown = load_head(tmp_path / "wide" / "head")
    assert grown.inputs.down["input_0"].shape[-1] == 5
    assert not torch.equal(grown.inputs.up["input_0"][:, :, 2:],
                           torch.zeros_like(grown.inputs.up["input_0"][:, :, 2:]))  # it trained
    assert saved.inputs.down["input_0"].shape[-1] == 2
    narrower = dataclasses.replace(small, lean_rank=1, init_from=str(tmp_path / "small" / "head"))
    with pytest.raises(TrainingConfigError, match="does not fit this run's head"):
        train(tmp_path / "narrow", corpus, narrower, model)
