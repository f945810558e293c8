"""Row-invariant numerics: a position's logits do not depend on how many positions a call runs.

A bfloat16 model made row-invariant (float64 attention, linear layers applied in chunks of the
probed size) gives a verify block's positions exactly the bits they get decoded one by one, split
any other way, or as a row of a ragged batch; so greedy speculative decoding equals plain decoding
and ``model.generate`` of the same bfloat16 model token for token. The float64 attention equals
SDPA's in float64; the chunked layers equal the plain ones; the probe finds where an injected
kernel starts to depend on the row count; bad uses get one clear error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
)
from transformers.pytorch_utils import Conv1D

from circuits_llm.app.verify_packing import Precision, decode_model
from circuits_llm.backbone import HFBackbone
from circuits_llm.backbone.row_invariant import (
    ROW_INVARIANT_ATTENTION,
    RowInvarianceError,
    RowInvariantConv1D,
    RowInvariantLinear,
    _chunked,
    chunk_rows,
    invariant_chunk,
    invariant_rows,
    make_row_invariant,
    priced_rows,
)
from circuits_llm.decoding.autoregressive import AutoregressiveDecoder
from circuits_llm.decoding.decoder import SpeculativeDecoder
from circuits_llm.decoding.lookup import ContextLookup
from circuits_llm.heads import MTPHead

VOCAB, HIDDEN, EOS = 96, 64, 95


def _llama(seed: int = 0, **options: float) -> PreTrainedModel:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True,
        **options)).eval()


def _gpt2(seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      n_positions=256, bos_token_id=0, eos_token_id=EOS,
                                      pad_token_id=0)).eval()


def _mistral(seed: int = 0) -> PreTrainedModel:  # a sliding window narrower than the tests' texts
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        sliding_window=6, bos_token_id=0, eos_token_id=EOS, pad_token_id=0)).eval()


MAKERS = {"llama": _llama, "gpt2": _gpt2, "mistral": _mistral}


def _invariant(name: str) -> PreTrainedModel:
    model = MAKERS[name]()
    make_row_invariant(model, torch.bfloat16, generator=torch.Generator().manual_seed(0))
    return model


@torch.no_grad()
def _logits(model: PreTrainedModel, ids: torch.Tensor, cut: int, splits: list[int]) -> torch.Tensor:
    """Logits of positions ``cut..`` after a cached prefix of ``cut``, in calls of ``splits``."""
    cache = DynamicCache(config=model.config)
    model(ids[:, :cut], past_key_values=cache, use_cache=True)
    out, start = [], cut
    for size in splits:
        out.append(model(ids[:, start:start + size], past_key_values=cache,
                         use_cache=True).logits)
        start += size
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", list(MAKERS))
def test_attention_equals_sdpa_in_float64(name: str) -> None:
    reference = MAKERS[name]().double()
    model = MAKERS[name]().double()
    make_row_invariant(model)
    assert model.config._attn_implementation == ROW_INVARIANT_ATTENTION
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    with torch.no_grad():
        want = reference(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
        assert torch.isfinite(got).all()  # padding positions see nothing, yet stay finite
        real = mask.bool()
        assert torch.allclose(got[real], want[real], atol=1e-10, rtol=0)
        want = _logits(reference, ids[:1], 9, [1, 4, 6])
        got = _logits(model, ids[:1], 9, [1, 4, 6])
        assert torch.allclose(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", list(MAKERS))
def test_bfloat16_block_equals_positions_one_by_one(name: str) -> None:
    model = _invariant(name)
    ids = torch.randint(1, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    block = _logits(model, ids, 40, [20])
    assert block.dtype == torch.bfloat16
    assert torch.equal(block, _logits(model, ids, 40, [1] * 20))
    assert torch.equal(block, _logits(model, ids, 40, [3, 9, 1, 7]))
    # a prefill of more rows than the chunk size, and a prefix cut elsewhere
    assert torch.equal(block, _logits(model, ids, 13, [27, 20])[:, 27:])
    with torch.no_grad():
        whole = model(ids).logits[:, 40:]
    assert torch.equal(block, whole)


def test_bfloat16_row_of_a_batch_equals_the_row_alone() -> None:
    model = _invariant("llama")
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :15] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row counts from its first real token
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions).logits
        for row in range(3):
            start = int((mask[row] == 0).sum())
            alone = model(ids[row:row + 1, start:]).logits
            assert torch.equal(batch[row, start:], alone[0])


def _head(model: PreTrainedModel, architecture: str) -> MTPHead:
    return MTPHead.from_name(architecture, 4, 1 if architecture == "ff" else 2, HIDDEN, VOCAB,
                             lm_head_weight=model.get_output_embeddings().weight.detach().float(),
                             sum_init_std=0.5)


@pytest.mark.parametrize("architecture", ["ff", "btree"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_bfloat16_greedy_speculative_equals_plain_decoding(name: str, architecture: str) -> None:
    model = _invariant(name)
    head = _head(model, architecture)
    generator = torch.Generator().manual_seed(4)
    for length, new in [(1, 10), (7, 24), (30, 40)]:
        prompt = torch.randint(1, VOCAB - 1, (1, length), generator=generator)
        plain = AutoregressiveDecoder(HFBackbone(model)).generate(prompt, new, eos_token_id=())
        for lookup in (None, ContextLookup((0.3, 0.6))):
            spec = SpeculativeDecoder(HFBackbone(model), head, lookup=lookup)
            result = spec.generate(prompt, new, eos_token_id=())
            assert result.tokens.tolist() == plain.tokens.tolist()
            assert result.summary.drafted > 0
        reference = model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                   pad_token_id=0)
        assert plain.tokens.tolist() == reference[0, length:].tolist()


def test_bfloat16_batch_rows_equal_each_prompt_alone() -> None:
    model = _invariant("llama")
    head = _head(model, "btree")
    prompts = [[5, 9, 5, 9, 3, 5, 9], [7], [12, 30, 4, 40, 41, 42, 43, 44, 45, 46, 47, 48], [21, 22]]
    batch = SpeculativeDecoder(HFBackbone(model), head).generate(prompts, 16, eos_token_id=())
    for prompt, tokens in zip(prompts, batch.tokens, strict=True):
        alone = AutoregressiveDecoder(HFBackbone(model)).generate(
            torch.tensor([prompt]), 16, eos_token_id=())
        assert tokens == alone.tokens.tolist()


class _RowByRow(nn.Linear):
    """A kernel that computes every row alone: row-invariant by construction."""

    def __init__(self) -> None:
        super().__init__(8, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([F.linear(row, self.weight, self.bias) for row in x])


class _CountDependent(_RowByRow):
    """A kernel whose rows change once more than ``limit`` come together (the probe's target)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1e-9 if x.shape[0] > self.limit else out


def test_probe_finds_where_rows_start_to_depend_on_each_other() -> None:
    generator = torch.Generator().manual_seed(5)
    assert invariant_rows([_RowByRow()], most=24, generator=generator) == 24
    assert invariant_rows([_RowByRow(), _CountDependent(5)], most=24, generator=generator) == 5
    assert invariant_rows([_CountDependent(9), _CountDependent(1)], most=24,
                          generator=generator) == 1
    assert 1 <= invariant_rows([Conv1D(6, 8).double()], most=12, generator=generator) <= 12


class _LoneRowDiffers(_RowByRow):
    """A kernel that rounds a lone row differently (a one-row path, as oneDNN's bfloat16 kernel
    has on an AMD EPYC), and computes 2 or more rows alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1e-9 if x.shape[0] == 1 else out


class _RarelyDependent(_RowByRow):
    """A kernel whose bits change in calls of ``limit + 1`` to ``limit + 3`` rows, and then only
    for rows whose first input exceeds 1.5 (about 7% of normal rows): a probe of one chunk per
    count can miss it."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.limit < x.shape[0] <= self.limit + 3:
            return out
        return out + 1e-9 * (x[:, :1] > 1.5)


def test_probe_pads_calls_where_a_lone_row_takes_another_kernel() -> None:
    """A lone row that rounds differently leaves 1 row a call; padded to 2, every count agrees,
    and :func:`invariant_chunk` takes that; a kernel whose rows agree from one row on keeps 1."""
    generator = torch.Generator().manual_seed(5)
    assert invariant_rows([_LoneRowDiffers()], most=24, generator=generator) == 1
    assert invariant_rows([_LoneRowDiffers()], most=24, generator=generator, least=2) == 24
    assert invariant_chunk([_LoneRowDiffers()], most=24, generator=generator) == (2, 24)
    assert invariant_chunk([_RowByRow(), _CountDependent(9)], most=24,
                           generator=generator) == (1, 9)
    # none reaches 8 rows: the widest range, the smaller least on a tie
    assert invariant_chunk([_CountDependent(3)], most=24, generator=generator) == (1, 3)
    assert invariant_chunk([_CountDependent(3), _LoneRowDiffers()], most=24,
                           generator=generator) == (2, 3)
    # rare changes are found: every count compares all the probe's rows
    # (this seed's first 9 probe rows never trigger it: a probe of one chunk per count misses it)
    assert invariant_rows([_RarelyDependent(6)], most=48,
                          generator=torch.Generator().manual_seed(2)) == 6


def test_padded_chunks_give_every_row_its_padded_lone_bits() -> None:
    """With ``least = 2`` a one-row call and a short last chunk are padded, and every row gets
    what a padded call of it alone gives, while a plain call of one row (the other kernel) does
    not (negative control)."""
    layer = _LoneRowDiffers()
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    alone = torch.cat([layer(x[i:i + 1].expand(2, -1))[:1] for i in range(7)])
    with torch.no_grad():
        for count in range(1, 8):  # chunks of 2-3 rows: 1 -> (1+1), 4 -> 3 + (1+1), 7 -> ...
            assert torch.equal(_chunked(layer, x[:count], 3, 4, least=2), alone[:count])
        assert torch.equal(_chunked(layer, x[None, :5], 3, 4, least=2), alone[None, :5])
        assert not torch.equal(layer(x[:1]), alone[:1])
        chunked = RowInvariantLinear(nn.Linear(8, 4, dtype=torch.float64), 3, least=2)
        assert torch.allclose(chunked(x), F.linear(x, chunked.weight, chunked.bias), rtol=0,
                              atol=1e-14)
    assert "least=2" in repr(chunked)


def test_chunked_layers_share_parameters_and_equal_the_plain_ones() -> None:
    generator = torch.Generator().manual_seed(6)
    linear = nn.Linear(8, 5, dtype=torch.float64)
    chunked = RowInvariantLinear(linear, 3)
    assert chunked.weight is linear.weight and chunked.bias is linear.bias
    x = torch.randn(2, 7, 8, generator=generator, dtype=torch.float64)
    assert torch.allclose(chunked(x), linear(x), atol=1e-14, rtol=0)
    assert "rows=3" in repr(chunked)
    conv = Conv1D(5, 8).double()
    chunked_conv = RowInvariantConv1D(conv, 4)
    assert chunked_conv.weight is conv.weight
    assert torch.allclose(chunked_conv(x), conv(x), atol=1e-14, rtol=0)
    assert "rows=4" in repr(chunked_conv)


def test_make_row_invariant_reports_what_it_did() -> None:
    model = _llama()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    done = make_row_invariant(model, torch.bfloat16)
    assert done.dtype == torch.bfloat16 and 1 <= done.least <= done.rows
    assert all(m.least == done.least for m in model.modules() if hasattr(m, "least"))
    assert done.linear_layers == 2 * 7 + 1  # q k v o gate up down per layer, the LM head
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert tied == (model.get_output_embeddings().weight is model.get_input_embeddings().weight)
    assert "float64 attention" in done.describe() and "bfloat16" in done.describe()


def test_bad_uses_get_one_clear_error() -> None:
    with pytest.raises(RowInvarianceError, match=r"no nn\.Linear or Conv1D"):
        make_row_invariant(nn.Sequential(nn.ReLU()))
    with pytest.raises(RowInvarianceError, match="custom attention"):
        make_row_invariant(nn.Sequential(nn.Linear(2, 2)))
    model = _llama(attention_dropout=0.5)
    make_row_invariant(model)
    model.train()
    with pytest.raises(RowInvarianceError, match="dropout"):
        model(torch.tensor([[1, 2, 3]]))


def test_precision_choice() -> None:
    cpu = torch.device("cpu")
    assert Precision.FLOAT32.resolve(cpu) is Precision.FLOAT32
    assert Precision.BFLOAT16.resolve(cpu) is Precision.BFLOAT16
    assert Precision.AUTO.resolve(cpu, compile=True) is Precision.FLOAT32
    assert Precision.AUTO.resolve(torch.device("cuda")) is Precision.FLOAT32
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert Precision.AUTO.resolve(cpu) is (Precision.BFLOAT16 if native else Precision.FLOAT32)
    with pytest.raises(ValueError, match="--compile"):
        Precision.BFLOAT16.resolve(cpu, compile=True)


def test_decode_model_copies_for_bfloat16_and_keeps_float32() -> None:
    model = _llama()
    copied, line = decode_model(model, Precision.BFLOAT16, 4, torch.device("cpu"))
    assert copied is not model and "row-invariant bfloat16" in line
    assert next(copied.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    assert model.config._attn_implementation != ROW_INVARIANT_ATTENTION
    same, _ = decode_model(model, Precision.FLOAT32, 4, torch.device("cpu"))
    assert same is model


def test_comparison_sees_a_kernel_that_depends_on_the_row_count() -> None:
    """Negative control: one layer whose rows shift by 1/64 when a call runs more than one row,
    and the block's logits no longer equal the positions one by one."""
    model = _invariant("llama")
    layer = model.model.layers[0].mlp.down_proj
    plain = layer.forward
    layer.forward = lambda x: plain(x) + (x.reshape(-1, x.shape[-1]).shape[0] > 1) / 64
    ids = torch.randint(1, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    assert not torch.equal(_logits(model, ids, 20, [10]), _logits(model, ids, 20, [1] * 10))


def test_batch_depth_within_the_calls_of_one_draft() -> None:
    """Every row's verify block (drafts + 1) takes no more chunked calls of ``rows`` than a round
    of one draft a row, as deep as that allows, at least one draft."""
    from circuits_llm.draft_block import BatchDepth
    from circuits_llm.draft_block.block import DraftBlockError
    rule = BatchDepth.within(32, 5)
    assert [rule.drafts(batch, 5) for batch in range(1, 13)] == [5, 5, 5, 5, 5, 4, 3, 3, 2, 2, 1, 1]
    # a drafter deeper than ``most`` (9 greedy drafts, 5 sampled) still drafts at most 5 in a batch
    assert [rule.drafts(batch, 9) for batch in range(1, 13)] == [5, 5, 5, 5, 5, 4, 3, 3, 2, 2, 1, 1]
    assert [rule.drafts(batch, 5) for batch in (16, 17, 21, 22, 32, 33, 40)] == \
        [1, 2, 2, 1, 1, 1, 1]  # 17 rows: one draft takes two calls, which hold two drafts
    assert [BatchDepth.within(7, 5).drafts(batch, 5) for batch in range(1, 9)] == \
        [5, 2, 1, 2, 1, 1, 1, 1]

    def calls(batch: int, drafts: int, rows: int) -> int:
        return -(-batch * (drafts + 1) // rows)

    for rows in range(1, 65):
        for batch in range(1, 70):
            drafts = BatchDepth.within(rows, 7).drafts(batch, 7)
            assert drafts >= 1
            assert calls(batch, drafts, rows) == calls(batch, 1, rows)
            assert drafts == 7 or calls(batch, drafts + 1, rows) > calls(batch, 1, rows)
    with pytest.raises(DraftBlockError, match="rows >= 1"):
        BatchDepth.within(0)
    model = _llama()
    assert chunk_rows(model) is None and priced_rows(model) is None
    done = make_row_invariant(model, torch.bfloat16)
    assert chunk_rows(model) == done.rows


@pytest.mark.parametrize("amx", [True, False])
def test_a_verify_call_is_priced_by_its_chunk_only_where_amx_makes_it_flat(
        monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    """With AMX tiles a batch's verify calls are sized by the probed chunk; without, at most
    ``ROWS_PRICED_WITHOUT_AMX`` rows (the kernel's cost grows with them)."""
    from circuits_llm.backbone.row_invariant import ROWS_PRICED_WITHOUT_AMX
    model = _llama()
    for module in model.modules():  # a wide chunk, as an AMD EPYC's probe finds (64)
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, RowInvariantLinear(child, 64, least=2))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert priced_rows(model) == (64 if amx else ROWS_PRICED_WITHOUT_AMX)
