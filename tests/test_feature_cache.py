"""Backbone features computed once (issue 25, item 1): cached losses equal live ones up to the
stored dtype's rounding, the cache is streamed, checksummed, resumable and atomic, and training
from it resumes exactly.

A tiny float64 Llama (``test_training.tiny_llama``) makes the comparison sharp: with features
stored in the model's dtype (``exact``) the cached loss and gradients equal the live ones, and
with float16 features they equal the live ones computed from features rounded to float16, which
differ from the unrounded ones by no more than that rounding allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_training import config, make_corpus, tiny_llama, train
from transformers import PreTrainedModel

from circuits_llm.backbone import UnsupportedModelError
from circuits_llm.backbone._features import _template, branch_input
from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.training import CHECKPOINT_FILE, read_record
from circuits_llm.training import feature_store as store
from circuits_llm.training import features as feats
from circuits_llm.training.cli import add_train_head_command, config_from_args
from circuits_llm.training.config import (
    DataSource,
    FeatureCaching,
    FeatureDtype,
    HeadTrainingConfig,
    TrainingConfigError,
)
from circuits_llm.training.datasets import StreamWindows, TensorSequences, training_sets
from circuits_llm.training.distributed import distributed_context
from circuits_llm.training.trainer import Trainer

#: float16 keeps 11 significant bits: a feature moves by at most 2^-11 of itself.
FP16_RELATIVE = 2.0 ** -11


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _private_feature_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "feature-cache"
    monkeypatch.setenv(feats.FEATURE_CACHE_ENV, str(directory))
    return directory


def trainer_on(model: PreTrainedModel, cfg: HeadTrainingConfig, run_dir: Path, corpus: Path,
               ) -> tuple[Trainer, object, object]:
    """A trainer with its head built on ``cfg``'s (cached) data, LoRA adapters made non-zero."""
    trainer = Trainer(model, cfg, run_dir, distributed_context(model.device, cfg.batch_size),
                      False, notify=lambda message: None)
    sets = training_sets(model, cfg, run_dir, writer=True, root=corpus)
    data, validation = trainer.cached_features(*sets)
    trainer.build_head(data)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in trainer.backbone.draft_parameters():  # lora_B starts at zero: make it count
            p.copy_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return trainer, data, validation


def loss_and_gradients(trainer: Trainer, tokens: torch.Tensor, mask: torch.Tensor | None,
                       features: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    trainer.optimizer.zero_grad(set_to_none=True)
    loss, _, _ = trainer.draft(tokens, mask, features)
    loss.backward()
    return float(loss), torch.cat([p.grad.flatten() for p in trainer.parameters])


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("lora_layers", [0, 1, 2])
def test_cached_loss_equals_live_loss_up_to_the_stored_rounding(
        tmp_path: Path, corpus: Path, lora_layers: int) -> None:
    model = tiny_llama().double()
    rows = torch.tensor([0, 3, 5, 7, 3])
    for dtype in ("exact", "float16"):
        cfg = config(lora_layers=lora_layers, lora_rank=4, cache_features="on",
                     feature_dtype=dtype)
        trainer, data, _ = trainer_on(model, cfg, tmp_path / dtype, corpus)
        assert isinstance(data, feats.FeatureRows) and isinstance(data.sequences, StreamWindows)
        assert data.sequences.stride == cfg.seq_len  # cached corpus data: disjoint windows
        tokens, mask = data.rows(rows)
        cached_features = data.features(rows)
        live_loss, live_grad = loss_and_gradients(trainer, tokens, mask, None)
        loss, grad = loss_and_gradients(trainer, tokens, mask, cached_features)
        if dtype == "exact":
            assert cached_features.dtype == torch.float64
            assert loss == live_loss and torch.equal(grad, live_grad)
            continue
        assert cached_features.dtype == torch.float16
        # exactly the live computation on features rounded to float16 ...
        rounded = branch_input(trainer.backbone, tokens).to(torch.float16)
        assert torch.equal(rounded, cached_features)
        again_loss, again_grad = loss_and_gradients(trainer, tokens, mask, rounded)
        assert loss == again_loss and torch.equal(grad, again_grad)
        # ... which moves the loss and the gradients by no more than that rounding allows
        assert abs(loss - live_loss) <= FP16_RELATIVE * abs(live_loss)
        assert float((grad - live_grad).abs().max()) <= 2 * FP16_RELATIVE * \
            float(live_grad.abs().max())


def test_cached_training_follows_live_training(tmp_path: Path, corpus: Path) -> None:
    """Self-distilled data (cached by default), features in the model's dtype: a whole run from
    the cache gives the live run's validations and parameters."""
    base = config(data="self-distilled", seq_len=16, distill_prompt_len=8, distill_samples=6,
                  eval_windows=2, steps=4, eval_every=2, lora_layers=1, lora_rank=4,
                  feature_dtype="exact")
    assert base.cache_features is FeatureCaching.AUTO and feats.caching_wanted(base)
    cached = train(tmp_path / "cached", corpus, base, tiny_llama().double())
    live = train(tmp_path / "live", corpus, dataclasses.replace(base, cache_features="off"),
                 tiny_llama().double())
    assert len(read_record(tmp_path / "cached")["feature_cache"]) == 2
    assert read_record(tmp_path / "live")["feature_cache"] == []
    for a, b in zip(cached.history, live.history, strict=True):
        np.testing.assert_allclose(a["validation"]["nll"], b["validation"]["nll"], rtol=1e-6)
    a = load_checkpoint(tmp_path / "cached" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "live" / CHECKPOINT_FILE, "circuits_llm.train_head")
    for group in ("head", "lora"):
        for name, value in a[group].items():
            torch.testing.assert_close(value, b[group][name], rtol=1e-5, atol=1e-6, msg=name)


def test_resumed_cached_run_equals_uninterrupted_and_builds_once(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(lora_layers=1, lora_rank=4, steps=5, cache_features="on")
    builds: list[str] = []
    original = store.build_entry

    def counted(directory: Path, spec: store.EntrySpec, *args: object, **kwargs: object):
        builds.append(spec.name)
        return original(directory, spec, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(feats, "build_entry", counted)
    whole = train(tmp_path / "whole", corpus, cfg)
    first = train(tmp_path / "split", corpus, cfg, max_steps=3)
    second = train(tmp_path / "split", corpus, cfg)
    assert not first.finished and second.finished and second.session_steps == 2
    a = load_checkpoint(tmp_path / "whole" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "split" / CHECKPOINT_FILE, "circuits_llm.train_head")
    for group in ("head", "lora"):
        for name, value in a[group].items():
            assert torch.equal(value, b[group][name]), name
    assert whole.validation == second.validation
    # three runs, two entries (train, validation) each opened, but each built only once
    record = read_record(tmp_path / "split")["feature_cache"]
    assert len(set(builds)) == 2 and len(record) == 2 and all(Path(p).is_file() for p in record)
    markers = [json.loads(Path(p).with_suffix(".json").read_text()) for p in record]
    assert [m["shape"][1:] for m in markers] == [[24, 32], [24, 32]]


# ------------------------------------------------------------------------------ the store
def spec_of(rows: int = 10, length: int = 3, width: int = 4) -> store.EntrySpec:
    return store.EntrySpec({"test": True}, rows, length, width, torch.float16)


def values_of(first: int, last: int, length: int = 3, width: int = 4) -> torch.Tensor:
    grid = torch.arange(first * length * width, last * length * width, dtype=torch.float64)
    return (grid.reshape(last - first, length, width) / 7).to(torch.float16)


@pytest.fixture()
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(store, "CHUNK_BYTES", 2 * 3 * 4 * 2)  # two rows per durable chunk
    yield


def test_interrupted_build_continues_and_nothing_partial_is_read(
        tmp_path: Path, small_chunks: None) -> None:
    spec = spec_of()
    whole = store.build_entry(tmp_path / "whole", spec, values_of, forward_rows=1)
    assert torch.equal(whole.rows(torch.arange(10)), values_of(0, 10))

    def interrupt(done: int) -> None:
        if done == 4:
            raise KeyboardInterrupt  # as SIGINT after the second chunk was recorded

    directory = tmp_path / "split"
    with pytest.raises(KeyboardInterrupt):
        store.build_entry(directory, spec, values_of, forward_rows=1, on_chunk=interrupt)
    paths = spec.paths(directory)
    assert store.open_entry(directory, spec) is None  # nothing half-written reads as complete
    assert not paths["features"].exists() and not paths["marker"].exists()
    with paths["partial"].open("ab") as stream:  # bytes written after the last record
        stream.write(b"\x01" * 13)
    computed: list[tuple[int, int]] = []

    def counted(first: int, last: int) -> torch.Tensor:
        computed.append((first, last))
        return values_of(first, last)

    notes: list[str] = []
    entry = store.build_entry(directory, spec, counted, forward_rows=1, notify=notes.append)
    assert computed == [(i, i + 1) for i in range(4, 10)] and notes == []
    assert paths["features"].read_bytes() == whole.path.read_bytes()
    assert not paths["partial"].exists() and not paths["progress"].exists()
    assert torch.equal(entry.rows(torch.tensor([9, 0, 9])), values_of(0, 10)[[9, 0, 9]])


def test_a_damaged_partial_build_starts_over(tmp_path: Path, small_chunks: None) -> None:
    spec = spec_of()

    def interrupt(done: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.build_entry(tmp_path, spec, values_of, forward_rows=1, on_chunk=interrupt)
    partial = spec.paths(tmp_path)["partial"]
    data = partial.read_bytes()
    partial.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    notes: list[str] = []
    entry = store.build_entry(tmp_path, spec, values_of, forward_rows=1, notify=notes.append)
    assert len(notes) == 1 and "fail their checksum); starting it over" in notes[0]
    assert torch.equal(entry.rows(torch.arange(10)), values_of(0, 10))


def test_a_damaged_entry_is_detected_and_rebuilt(tmp_path: Path) -> None:
    spec = spec_of()
    entry = store.build_entry(tmp_path, spec, values_of, forward_rows=4)
    good = entry.path.read_bytes()
    entry.path.write_bytes(good[:5] + bytes([good[5] ^ 1]) + good[6:])
    assert store.open_entry(tmp_path, spec) is None
    again = store.build_entry(tmp_path, spec, values_of, forward_rows=4)
    assert again.path.read_bytes() == good
    other = dataclasses.replace(spec, key={"test": False})  # another key: another entry
    assert other.name != spec.name and store.open_entry(tmp_path, other) is None


def test_values_and_room_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_of()
    with pytest.raises(store.FeatureCacheError, match=r"came out as torch\.float32"):
        store.build_entry(tmp_path, spec, lambda a, b: values_of(a, b).float(), forward_rows=2)

    class Full:
        free = 1000

    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: Full)
    with pytest.raises(store.FeatureCacheError, match="more than the disk has free"):
        store.build_entry(tmp_path / "full", spec, values_of, forward_rows=2)


# ------------------------------------------------------------------------------ decisions
def test_auto_caches_self_distilled_rows_and_corpus_windows_only_when_asked(
        tmp_path: Path, corpus: Path) -> None:
    assert not feats.caching_wanted(config())
    assert feats.caching_wanted(config(data="self-distilled", seq_len=16, distill_prompt_len=8))
    assert not feats.caching_wanted(config(data="self-distilled", seq_len=16,
                                           distill_prompt_len=8, cache_features="off"))
    model = tiny_llama()
    data, _ = training_sets(model, config(), tmp_path, writer=True, root=corpus)
    assert isinstance(data, StreamWindows) and data.stride == 1
    trainer = Trainer(model, config(), tmp_path, distributed_context(model.device, 4), False)
    assert trainer.cached_features(data, data) == (data, data)
    assert trainer.feature_entries == []


def test_auto_trains_live_when_the_disk_is_full_and_on_refuses(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Full:
        free = 0

    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: Full)
    model = tiny_llama()
    sequences = TensorSequences(torch.randint(0, 250, (6, 24)))
    notes: list[str] = []
    for caching, data in (("auto", DataSource.SELF_DISTILLED), ("on", DataSource.CORPUS)):
        cfg = config(cache_features=caching, data=data, distill_prompt_len=8)
        trainer = Trainer(model, cfg, tmp_path, distributed_context(model.device, 4), False,
                          notify=notes.append)
        if caching == "auto":
            assert trainer.cached_features(sequences, sequences) == (sequences, sequences)
            assert len(notes) == 1 and "training from the backbone instead" in notes[0]
        else:
            with pytest.raises(TrainingConfigError, match="more than the disk has free"):
                trainer.cached_features(sequences, sequences)


def test_features_float16_cannot_hold_are_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    trainer = Trainer(model, config(cache_features="on"), tmp_path,
                      distributed_context(model.device, 4), False)
    sequences = TensorSequences(torch.randint(0, 250, (6, 24)))
    real = feats.branch_input
    monkeypatch.setattr(feats, "branch_input", lambda backbone, tokens: real(backbone, tokens) * 1e6)
    with pytest.raises(TrainingConfigError, match=r"beyond what torch\.float16 holds.*"
                                                  r"--feature-dtype exact"):
        trainer.cached_features(sequences, sequences)


def test_token_dependent_branch_arguments_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _private_feature_cache: Path) -> None:
    one, other = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(UnsupportedModelError, match="depends on the tokens"):
        _template("per_layer_input", one, other, torch.cat([one, other]))
    assert _template("position_ids", one, one, one) == ("same", one)
    assert _template("mask", one, one, torch.cat([one, one]))[0] == "batch"

    class TokenDependent:
        @staticmethod
        def record(backbone: object, row: torch.Tensor) -> None:
            _template("per_layer_input", one, other, torch.cat([one, other]))

    monkeypatch.setattr(feats, "BranchArguments", TokenDependent)
    model, sequences = tiny_llama(), TensorSequences(torch.randint(0, 250, (6, 24)))
    notes: list[str] = []
    for caching in ("on", "auto"):
        cfg = config(cache_features=caching, data="self-distilled", distill_prompt_len=8,
                     lora_layers=1)
        trainer = Trainer(model, cfg, tmp_path, distributed_context(model.device, 4), False,
                          notify=notes.append)
        if caching == "on":
            with pytest.raises(TrainingConfigError, match="cannot cache this model's features: "
                                                          "the draft layers' argument"):
                trainer.cached_features(sequences, sequences)
        else:  # not exact to cache: AUTO trains from the backbone, and says so
            assert trainer.cached_features(sequences, sequences) == (sequences, sequences)
            assert len(notes) == 1 and "training from the backbone" in notes[0]
    assert not _private_feature_cache.exists()  # refused before anything was built


def test_cli_options(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_train_head_command(parser.add_subparsers())
    run = ["train-head", "--run-dir", str(tmp_path)]
    default = config_from_args(parser.parse_args(run))
    assert default.cache_features is FeatureCaching.AUTO
    assert default.feature_dtype is FeatureDtype.FLOAT16 and default.distill_batch == 16
    on = config_from_args(parser.parse_args([*run, "--cache-features", "--feature-dtype", "exact",
                                             "--distill-batch", "4"]))
    assert on.cache_features is FeatureCaching.ON and on.feature_dtype is FeatureDtype.EXACT
    assert on.distill_batch == 4
    off = config_from_args(parser.parse_args([*run, "--no-cache-features"]))
    assert off.cache_features is FeatureCaching.OFF
    assert HeadTrainingConfig.from_json(on.to_json()) == on
    for changes, message in (({"cache_features": "maybe"}, "unknown cache_features setting"),
                             ({"feature_dtype": "int8"}, "unknown feature_dtype"),
                             ({"distill_batch": 0}, "distill_batch must be an int >= 1")):
        with pytest.raises(TrainingConfigError, match=message):
            config(**changes)


def test_other_ranks_wait_for_the_entry_rank_0_builds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    monkeypatch.setattr(feats, "_POLL_S", 0.01)
    spec, notes = spec_of(), []
    builder = threading.Timer(0.2, lambda: store.build_entry(tmp_path, spec, values_of,
                                                             forward_rows=5))
    builder.start()
    entry = feats._wait_for(tmp_path, spec, notes.append)
    builder.join()
    assert torch.equal(entry.rows(torch.arange(10)), values_of(0, 10))
    assert notes == [f"waiting for rank 0 to cache the features in {tmp_path}"]
