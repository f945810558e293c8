"""Weight layouts (circuits_llm/backbone/weight_layout.py): the same values in another memory
layout, ties kept, packed copies refreshed, and the choice rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from circuits_llm.backbone.packed_linear import (
    PackedLinear,
    PackingBackend,
    linear_packing_available,
    pack_linear_layers,
)
from circuits_llm.backbone.weight_layout import (
    MIN_GAIN,
    LayoutChoice,
    WeightLayout,
    choose_layout,
    set_weight_layout,
    tune_weight_layout,
    weight_layout,
)


class TiedModel(nn.Module):
    """An embedding tied to the output layer, two hidden linears (one without bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 12)
        self.hidden = nn.Linear(12, 24)
        self.back = nn.Linear(24, 12, bias=False)
        self.head = nn.Linear(12, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.back(torch.relu(self.hidden(self.embed(ids)))))


def _model() -> TiedModel:
    torch.manual_seed(0)
    return TiedModel().eval()


def test_layouts_of_tensors() -> None:
    weight = torch.randn(5, 3)
    assert weight_layout(weight) is WeightLayout.ROW_MAJOR
    stored = WeightLayout.COLUMN_MAJOR.store(weight)
    assert weight_layout(stored) is WeightLayout.COLUMN_MAJOR
    assert stored.shape == weight.shape and torch.equal(stored, weight)
    assert stored.stride() == (1, 5)
    assert torch.equal(WeightLayout.ROW_MAJOR.store(stored), weight)
    assert WeightLayout.ROW_MAJOR.store(stored).is_contiguous()
    assert weight_layout(torch.randn(2, 3, 4)) is None
    assert weight_layout(torch.randn(6, 8)[::2, ::2]) is None  # neither layout


def test_set_weight_layout_keeps_values_parameters_and_ties() -> None:
    model = _model()
    ids = torch.tensor([[1, 5, 7, 39]])
    before = model(ids)
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    # three distinct linear weights (the head's is the embedding's)
    assert set_weight_layout(model, WeightLayout.COLUMN_MAJOR) == 3
    for name, p in model.named_parameters():
        assert p is params[name]
        assert torch.equal(p, values[name])
    for layer in (model.hidden, model.back, model.head):
        assert weight_layout(layer.weight) is WeightLayout.COLUMN_MAJOR
    assert model.head.weight is model.embed.weight  # still tied
    assert weight_layout(model.hidden.bias.unsqueeze(0)) is WeightLayout.ROW_MAJOR  # biases untouched
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # back again; a second call in the same layout changes nothing
    assert set_weight_layout(model, WeightLayout.ROW_MAJOR) == 3
    pointer = model.hidden.weight.data_ptr()
    set_weight_layout(model, WeightLayout.ROW_MAJOR)
    assert model.hidden.weight.data_ptr() == pointer
    for name, value in model.state_dict().items():
        assert value.is_contiguous() and torch.equal(value, state[name])


def test_a_relaid_model_trains_and_loads_state() -> None:
    model = _model().train()
    set_weight_layout(model, WeightLayout.COLUMN_MAJOR)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.tensor([[3, 4]])).logsumexp(-1).sum()
    loss.backward()
    optimiser.step()  # gradients and updates follow the parameter whatever its strides
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not linear_packing_available(), reason="no packed GEMM in this torch build")
def test_packed_layers_repack_after_a_relayout() -> None:
    model = _model()
    backend = next(b for b in PackingBackend if b.available())
    pack_linear_layers(model, rows=4, min_rows=2, backend=backend)
    assert isinstance(model.hidden, PackedLinear)
    x = torch.randn(3, 12)
    before = model.hidden(x)
    set_weight_layout(model, WeightLayout.COLUMN_MAJOR)  # visits PackedLinear weights too
    assert weight_layout(model.hidden.weight) is WeightLayout.COLUMN_MAJOR
    # the packed copy is rebuilt from the new storage and gives the same product
    torch.testing.assert_close(model.hidden(x), before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.hidden(x), F.linear(x, model.hidden.weight, model.hidden.bias),
                               rtol=1e-5, atol=1e-6)


@settings(max_examples=200, deadline=None)
@given(row=st.floats(1.0, 1e4), ratio=st.floats(0.5, 1.5))
def test_column_major_is_chosen_only_when_clearly_faster(row: float, ratio: float) -> None:
    column = row * ratio
    chosen = choose_layout({WeightLayout.ROW_MAJOR: row, WeightLayout.COLUMN_MAJOR: column})
    expected = WeightLayout.COLUMN_MAJOR if column <= (1 - MIN_GAIN) * row else WeightLayout.ROW_MAJOR
    assert chosen is expected
    assert choose_layout({WeightLayout.ROW_MAJOR: row}) is WeightLayout.ROW_MAJOR


def test_tune_weight_layout_leaves_the_chosen_layout() -> None:
    model = _model()
    ids = torch.tensor([[2, 9]])
    before = model(ids)
    choice = tune_weight_layout(model, repeats=1)
    assert isinstance(choice, LayoutChoice)
    assert set(choice.milliseconds) == set(WeightLayout)
    assert all(ms > 0 for ms in choice.milliseconds.values())
    assert choice.layout is choose_layout(choice.milliseconds)
    for layer in (model.hidden, model.back, model.head):
        assert weight_layout(layer.weight) is choice.layout
    torch.testing.assert_close(model(ids), before, rtol=1e-5, atol=1e-6)
    assert choice.layout.value in choice.describe()
    assert tune_weight_layout(nn.Sequential(nn.ReLU())) is None  # no linear weight: nothing done
    with pytest.raises(ValueError, match="repeats"):
        tune_weight_layout(model, repeats=0)
    with pytest.raises(ValueError, match="WeightLayout"):
        set_weight_layout(model, "column-major")  # type: ignore[arg-type]
