"""MTPHead: shapes, normalisation, initialisations, gradients, parameter counts, save/load, errors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from circuits import (
    Categorical,
    Circuit,
    Exp,
    InputLayer,
    ProductKind,
    ProductLayer,
    StructureError,
    SumLayer,
    UnknownArchitectureError,
)
from circuits.errors import InvalidInputError
from circuits_llm.heads import (
    HeadConfigError,
    HeadVariant,
    MTPHead,
    load_head,
    parameter_count,
    save_head,
)
from circuits_llm.protocols import draft_head_problem

ARCHITECTURES = ["ff", "cp", "hmm", "btree"]
VARIANTS = [HeadVariant.FULL, HeadVariant.LEAN]


def lm_head(vocab: int, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def named(name: str, window: int = 4, rank: int = 3, hidden: int = 8, vocab: int = 5,
          variant: HeadVariant = HeadVariant.FULL, **options: object) -> MTPHead:
    weight = lm_head(vocab, hidden, dtype=options.get("dtype", torch.float32))  # type: ignore[arg-type]
    return MTPHead.from_name(name, window, 1 if name == "ff" else rank, hidden, vocab, variant,
                             weight, **options)


def custom_circuit(vocab: int) -> Circuit:
    """Two decompositions of {0, 1, 2} mixed: (x0)(x1 x2) with a latent, and (x0 ⊗ x1)(x2)."""
    x2_wide = InputLayer(2, 4, Categorical(vocab))  # created first: creation order != topological
    x0 = InputLayer(0, 2, Categorical(vocab))
    x1 = InputLayer(1, 2, Categorical(vocab))
    x2 = InputLayer(2, 2, Categorical(vocab))
    right = SumLayer([ProductLayer([x1, x2])], 2)
    first = ProductLayer([x0, right])
    second = ProductLayer([ProductLayer([x0, x1], ProductKind.KRONECKER), x2_wide])
    return Circuit(SumLayer([first, second], 1))


def all_windows(window: int, vocab: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(vocab), repeat=window)))


# ---------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_outputs_cover_every_fold_with_batched_shapes(name: str, variant: HeadVariant) -> None:
    head = named(name, variant=variant)
    assert draft_head_problem(head) is None
    assert (head.window, head.vocab_size, head.hidden_size) == (4, 5, 8)
    params = head(torch.randn(6, 8))
    shapes = head.circuit.parameter_shapes()
    assert set(params) == set(shapes)
    for fold, value in params.items():
        assert tuple(value.shape) == (6, *shapes[fold])
    log_likelihood = head.circuit.log_likelihood(torch.randint(0, 5, (6, 4)), params=params)
    assert log_likelihood.shape == (6,) and bool(torch.isfinite(log_likelihood).all())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", [*ARCHITECTURES, "custom"])
def test_windows_distribution_sums_to_one(name: str, variant: HeadVariant) -> None:
    vocab, window, hidden = 3, 3, 4
    options = {"dtype": torch.float64, "sum_init_std": 0.5, "init_noise": 0.5, "seed": 1}
    if name == "custom":
        head = MTPHead(custom_circuit(vocab), hidden, vocab, variant,
                       lm_head(vocab, hidden, dtype=torch.float64), **options)  # type: ignore[arg-type]
    else:
        head = named(name, window, 2, hidden, vocab, variant, **options)
    if variant is HeadVariant.LEAN:  # move off the LM head so rows differ
        with torch.no_grad():
            for up in head.inputs.up.values():
                up.normal_()
    rows = 2
    windows = all_windows(window, vocab)
    params = head(torch.randn(rows, hidden, dtype=torch.float64).repeat_interleave(len(windows), 0))
    assert all(value.dtype == torch.float64 for value in params.values())
    log_likelihood = head.circuit.log_likelihood(windows.repeat(rows, 1), params=params)
    totals = torch.logsumexp(log_likelihood.view(rows, -1), dim=1).exp()
    torch.testing.assert_close(totals, torch.ones(rows, dtype=torch.float64), rtol=0, atol=1e-10)


def test_custom_circuit_becomes_a_head() -> None:
    head = MTPHead(custom_circuit(7), hidden_size=5, vocab_size=7)
    assert head.window == 3 and head.architecture is None
    kinds = sorted(name.split("_")[0] for name in head.circuit.parameter_shapes())
    assert kinds.count("input") == 2 and kinds.count("sum") == 2
    params = head(torch.randn(3, 5))
    assert head.circuit.log_likelihood(torch.randint(0, 7, (3, 3)), params=params).shape == (3,)


def test_lean_decoding_and_training_paths_agree() -> None:
    head = named("btree", variant=HeadVariant.LEAN, lean_rank=2, dtype=torch.float64)
    with torch.no_grad():
        for up in head.inputs.up.values():
            up.normal_()
    states = torch.randn(10, 8, dtype=torch.float64)
    batched = head(states)  # B > rho
    for row in range(10):
        single = head(states[row:row + 1])  # B <= rho (decoding)
        for fold, value in single.items():
            torch.testing.assert_close(value[0], batched[fold][row], rtol=1e-12, atol=1e-12)


def _lean_reference(head: MTPHead, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """``W_lm (e + U (V^T e)) + bias`` unit by unit, the LEAN definition written out."""
    inputs = head.inputs
    out = {}
    for name, down in inputs.down.items():
        folded, units = down.shape[:2]
        logits = torch.empty(states.shape[0], folded, units, head.vocab_size, dtype=states.dtype)
        for f in range(folded):
            for k in range(units):
                moved = states + (states @ down[f, k]) @ inputs.up[name][f, k]  # (B, d)
                logits[:, f, k] = moved @ inputs.lm_head.T + inputs.bias[name][f, k]
        out[name] = logits
    return out


def test_lean_cached_maps_are_exact_and_follow_parameter_updates() -> None:
    """The decode-time caches (LEAN's derived maps, the sum map's transposed weight) give bitwise
    the outputs of the differentiable path, equal the definition, and are rebuilt whenever the
    parameters change."""
    head = named("btree", variant=HeadVariant.LEAN, lean_rank=2, dtype=torch.float64)
    other = named("btree", variant=HeadVariant.LEAN, lean_rank=2, dtype=torch.float64, seed=4)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lean in (head, other):
            for tensor in [*lean.inputs.up.values(), *lean.inputs.bias.values()]:
                tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64))
    inputs = head.inputs
    (name,) = list(inputs.down)
    states = torch.randn(3, 8, generator=generator, dtype=torch.float64)

    def check(reference_head: MTPHead) -> None:
        fresh = head(states)  # grad enabled and parameters trainable: no cache
        assert fresh[name].requires_grad
        with torch.no_grad():
            first, second = head(states), head(states)
            maps = inputs.derived_maps(name)
            assert all(a is b for a, b in zip(maps, inputs.derived_maps(name), strict=True))
        for fold, value in fresh.items():  # input logits and sum weights
            assert torch.equal(first[fold], value.detach())
            assert torch.equal(second[fold], first[fold])
        expected = _lean_reference(reference_head, states)[name]
        torch.testing.assert_close(first[name], expected.detach(), rtol=1e-12, atol=1e-12)

    check(head)
    with torch.no_grad():  # an optimiser step: in place, bumps the version counters
        inputs.up[name].add_(0.5)
        inputs.down[name].mul_(1.5)
    check(head)
    head.load_state_dict(other.state_dict())
    check(other)
    inputs.up[name].data = 2 * inputs.up[name].data  # new storage: a new address
    check(head)
    with torch.no_grad():
        inputs.bias[name].add_(1.0)  # the bias is not part of the cached maps
    check(head)
    # maps cached in inference mode never enter an autograd graph later
    with torch.inference_mode():
        head(states)
    head.requires_grad_(False)
    wanted = states.clone().requires_grad_(True)
    head(wanted)[name].sum().backward()
    assert wanted.grad is not None and bool(torch.isfinite(wanted.grad).all())
    head.clear_cache()
    assert not inputs.cache.entries and not head.sums.cache.entries
    with torch.no_grad():
        assert torch.equal(head(states)[name], head(states)[name])


# ---------------------------------------------------------------------------------- initialisation
@pytest.mark.parametrize("variant", VARIANTS)
def test_cp_equals_ff_at_initialisation(variant: HeadVariant) -> None:
    vocab, hidden, window = 50, 16, 4
    weight = lm_head(vocab, hidden) * 0.3
    ff = MTPHead.from_name("ff", window, 1, hidden, vocab, variant, weight)
    cp = MTPHead.from_name("cp", window, 8, hidden, vocab, variant, weight, seed=3)
    hidden_states = torch.randn(64, hidden)
    x = torch.randint(0, vocab, (64, window))
    ll_ff = ff.circuit.log_likelihood(x, params=ff(hidden_states))
    ll_cp = cp.circuit.log_likelihood(x, params=cp(hidden_states))
    torch.testing.assert_close(ll_cp, ll_ff, rtol=0, atol=1e-3)
    # FF is exactly the LM head applied at every position (the paper's initialisation)
    expected = torch.log_softmax(hidden_states @ weight.T, -1).gather(1, x).sum(1)
    torch.testing.assert_close(ll_ff, expected, rtol=0, atol=1e-5)
    if variant is HeadVariant.FULL:  # CP's components differ (symmetry breaking), but barely
        components = cp.inputs.weight["input_0"].detach()
        assert 0 < float((components[:, 0] - components[:, 1]).abs().max()) < 1e-4


def _hmm_like_cp(identity_bias: float, identity_init: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-likelihoods of a CP head and an HMM head sharing the CP's (distinct) input units."""
    vocab, hidden, window, rank = 6, 8, 4, 3
    cp = MTPHead.from_name("cp", window, rank, hidden, vocab, dtype=torch.float64, seed=0)
    hmm = MTPHead.from_name("hmm", window, rank, hidden, vocab, dtype=torch.float64, seed=5,
                            identity_init=identity_init, identity_bias=identity_bias)
    cp_spec = cp.circuit.parameter_specs()["input_0"]
    hmm_spec = hmm.circuit.parameter_specs()["input_0"]
    assert cp_spec.variables == hmm_spec.variables and cp_spec.shape == hmm_spec.shape
    hmm.inputs.load_state_dict(cp.inputs.state_dict())
    states = torch.randn(32, hidden, dtype=torch.float64)
    x = torch.randint(0, vocab, (32, window))
    return (cp.circuit.log_likelihood(x, params=cp(states)),
            hmm.circuit.log_likelihood(x, params=hmm(states)))


def test_hmm_identity_initialisation_matches_cp() -> None:
    ll_cp, ll_hmm = _hmm_like_cp(identity_bias=40.0)
    torch.testing.assert_close(ll_hmm, ll_cp, rtol=0, atol=1e-10)
    # The default bias 8 leaks (r-1)e^-8 ~ 7e-4 of each transition's mass off the diagonal; how much
    # that moves a log-likelihood depends on how unequal the components' likelihoods are, so the
    # exact check is the bias-40 one above and this one only bounds the size of the effect.
    ll_cp, ll_hmm = _hmm_like_cp(identity_bias=8.0)
    torch.testing.assert_close(ll_hmm, ll_cp, rtol=0, atol=5e-2)
    ll_cp, ll_hmm = _hmm_like_cp(identity_bias=8.0, identity_init=False)
    assert float((ll_hmm - ll_cp).detach().abs().max()) > 0.05  # uniform transitions are not a CP


def test_identity_init_defaults_and_needs_a_square_sum() -> None:
    assert named("hmm").identity_init and not named("btree").identity_init
    assert named("btree", identity_init=True).identity_init
    bias = named("hmm").sums.bias.detach()
    assert float(bias.max()) == 8.0 and int((bias == 8.0).sum()) == 3 * 3  # 3 transitions, r=3
    with pytest.raises(HeadConfigError, match="no square sum layer"):
        named("cp", identity_init=True)


# ---------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["cp", "hmm", "btree"])
def test_gradients_reach_every_head_parameter(name: str, variant: HeadVariant) -> None:
    head = named(name, variant=variant, init_noise=0.3)
    optimiser = torch.optim.SGD(head.parameters(), lr=0.1)
    x = torch.randint(0, 5, (16, 4))
    states = torch.randn(16, 8)
    for _ in range(2):  # LEAN's `down` gets gradient once `up` has left zero (as in LoRA)
        optimiser.zero_grad()
        loss = -head.circuit.log_likelihood(x, params=head(states)).mean()
        loss.backward()
        optimiser.step()
    for parameter_name, parameter in head.named_parameters():
        if parameter_name.startswith("circuit."):
            assert parameter.grad is None  # the compiled circuit's own parameters are unused
            continue
        assert parameter.grad is not None, parameter_name
        assert bool(torch.isfinite(parameter.grad).all()), parameter_name
        assert float(parameter.grad.abs().max()) > 0, parameter_name


# ---------------------------------------------------------------------------------- counts
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("name", "units", "sum_weights"), [
    ("ff", 4, 0),
    ("cp", 4 * 3, 3),
    ("hmm", 4 * 3, 3 * 3 * 3 + 3),       # (n-1) r x r transitions + initial distribution
    ("btree", 4 * 3, 2 * 3 * 3 + 3),     # two inner r x r sums + the root
])
def test_parameter_count_formulas(name: str, units: int, sum_weights: int,
                                  variant: HeadVariant) -> None:
    vocab, hidden, rho = 5, 8, 2
    for input_bias in (True, False):
        head = named(name, variant=variant, lean_rank=rho, input_bias=input_bias)
        assert (head.input_units, head.sum_weights) == (units, sum_weights)
        bias = units * vocab if input_bias else 0
        inputs = units * vocab * hidden if variant is HeadVariant.FULL else 2 * units * hidden * rho
        expected = inputs + bias + sum_weights * (hidden + 1)
        assert head.num_parameters() == expected == head.expected_num_parameters()
        assert parameter_count(variant, units, sum_weights, hidden, vocab, input_bias, rho) == expected


# ---------------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", [*ARCHITECTURES, "custom"])
def test_save_load_round_trip(tmp_path: Path, name: str, variant: HeadVariant) -> None:
    if name == "custom":
        head = MTPHead(custom_circuit(5), 8, 5, variant, lm_head(5, 8))
    else:
        head = named(name, variant=variant)
    with torch.no_grad():  # trained-looking values everywhere
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head", expected_hidden_size=8, expected_vocab_size=5)
    assert loaded.architecture == head.architecture and loaded.rank == head.rank
    assert loaded.variant is variant and loaded.window == head.window
    states = torch.randn(3, 8)
    expected, got = head(states), loaded(states)
    assert set(got) == set(expected)
    for fold in expected:
        assert torch.equal(got[fold], expected[fold]), fold
    x = torch.randint(0, 5, (3, head.window))
    assert torch.equal(head.circuit.log_likelihood(x, params=expected),
                       loaded.circuit.log_likelihood(x, params=got))
    assert not list((tmp_path / "head").glob(".*tmp"))  # no temporary files left behind


def test_save_in_float16_with_tied_token_rows_stored_once(tmp_path: Path) -> None:
    """``save_head(..., storage_dtype=torch.float16)``: floats in half the bytes, read back as the
    head's dtype; a LEAN head whose token input reads the LM head's own rows (tied embeddings)
    stores them once, and a file that disagrees with its config is refused."""
    from safetensors.torch import load_file, save_file

    from circuits.files import sha256_file
    weight = lm_head(5, 8)
    head = MTPHead.from_name("btree", 4, 3, 8, 5, "lean", weight, token_embedding=weight)
    untied = MTPHead.from_name("btree", 4, 3, 8, 5, "lean", weight,
                               token_embedding=lm_head(5, 8, seed=1))
    save_head(head, tmp_path / "tied", storage_dtype=torch.float16)
    save_head(untied, tmp_path / "untied")
    stored = load_file(str(tmp_path / "tied" / "head.safetensors"))
    assert "token_input.embedding" not in stored and "inputs.lm_head" in stored
    assert all(v.dtype == torch.float16 for v in stored.values() if v.is_floating_point())
    config = json.loads((tmp_path / "tied" / "head_config.json").read_text())
    assert config["storage_dtype"] == "float16" and config["tied_token_embedding"]
    assert config["format_version"] == 4
    loaded = load_head(tmp_path / "tied")
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded.token_input.embedding, weight.half().float())
    for name, value in head.state_dict().items():
        if value.is_floating_point() and not name.startswith("circuit."):
            assert torch.equal(loaded.state_dict()[name], value.half().float()), name
    assert "token_input.embedding" in load_file(str(tmp_path / "untied" / "head.safetensors"))
    assert not json.loads((tmp_path / "untied" / "head_config.json").read_text())[
        "tied_token_embedding"]
    with pytest.raises(HeadConfigError, match="storage_dtype must be None"):
        save_head(head, tmp_path / "int", storage_dtype=torch.int8)
    # a tensor of another float type than the config records is refused, with a valid checksum
    path = tmp_path / "tied" / "head.safetensors"
    save_file({**stored, "inputs.lm_head": stored["inputs.lm_head"].float()}, str(path))
    config_path = tmp_path / "tied" / "head_config.json"
    config_path.write_text(json.dumps({**config, "tensors_sha256": sha256_file(path)}))
    with pytest.raises(HeadConfigError, match=r"inputs\.lm_head'\] are not float16"):
        load_head(tmp_path / "tied")
    save_file({**stored, "token_input.embedding": stored["inputs.lm_head"].clone()}, str(path))
    config_path.write_text(json.dumps({**config, "tensors_sha256": sha256_file(path)}))
    with pytest.raises(HeadConfigError, match="but the file holds both"):
        load_head(tmp_path / "tied")
    config_path.write_text(json.dumps({**config, "variant": "full"}))
    with pytest.raises(HeadConfigError, match="tied_token_embedding needs a LEAN head"):
        load_head(tmp_path / "tied")


def test_load_rejects_mismatches_and_damage(tmp_path: Path) -> None:
    directory = tmp_path / "head"
    save_head(named("hmm"), directory)
    with pytest.raises(HeadConfigError, match="hidden size is 16"):
        load_head(directory, expected_hidden_size=16)
    with pytest.raises(HeadConfigError, match="vocabulary has 6"):
        load_head(directory, expected_vocab_size=6)
    with pytest.raises(HeadConfigError, match="does not exist"):
        load_head(tmp_path / "nowhere")

    tensors = directory / "head.safetensors"
    original = tensors.read_bytes()
    tensors.write_bytes(original[:-7] + b"garbage")
    with pytest.raises(HeadConfigError, match="checksum"):
        load_head(directory)
    tensors.write_bytes(original)

    config_path = directory / "head_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text("{not json")
    with pytest.raises(HeadConfigError, match="not valid JSON"):
        load_head(directory)
    config_path.write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(HeadConfigError, match="format_version 99"):
        load_head(directory)
    config_path.write_text(json.dumps({**config, "rank": 4}))  # tensors no longer fit
    with pytest.raises(HeadConfigError, match="wrong shapes"):
        load_head(directory)
    config_path.write_text(json.dumps({**config, "tensors_sha256": None}))
    tensors.write_bytes(b"\x00" * 5)
    with pytest.raises(HeadConfigError, match="cannot be read"):
        load_head(directory)


# ---------------------------------------------------------------------------------- bad input
def test_bad_circuits_are_rejected_with_one_clear_error() -> None:
    def inputs(vocab: int = 5, variables: tuple[int, ...] = (0, 1)) -> list[InputLayer]:
        return [InputLayer(v, 2, Categorical(vocab)) for v in variables]

    with pytest.raises(StructureError, match=r"Categorical\(5\)"):
        MTPHead(Circuit(SumLayer([ProductLayer(inputs(vocab=4))], 1)), 8, 5)
    with pytest.raises(StructureError, match=r"variables \[1\] are missing"):
        MTPHead(Circuit(SumLayer([ProductLayer(inputs(variables=(0, 2)))], 1)), 8, 5)
    a, b = inputs()
    overlapping = ProductLayer([ProductLayer([a, b]), InputLayer(1, 2, Categorical(5))])
    with pytest.raises(StructureError, match="not decomposable"):
        MTPHead(Circuit(SumLayer([overlapping], 1)), 8, 5)
    unnormalised = SumLayer([ProductLayer(inputs())], 1, parameterization=Exp())
    with pytest.raises(StructureError, match="normalised"):
        MTPHead(Circuit(unnormalised), 8, 5)
    integrated = InputLayer(2, 2, Categorical(5), integrated=True)
    with pytest.raises(StructureError, match="integrated"):
        MTPHead(Circuit(SumLayer([ProductLayer([*inputs(), integrated])], 1)), 8, 5)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(UnknownArchitectureError, match="ff, cp, hmm, btree"):
        MTPHead.from_name("mlp", 4, 2, 8, 5)
    with pytest.raises(HeadConfigError, match="window must be an int >= 2"):
        MTPHead.from_name("cp", 1, 2, 8, 5)
    with pytest.raises(HeadConfigError, match="pass lm_head_weight"):
        MTPHead.from_name("cp", 4, 2, 8, 5, HeadVariant.LEAN)
    with pytest.raises(HeadConfigError, match=r"\(5, 8\)"):
        MTPHead.from_name("cp", 4, 2, 8, 5, "full", torch.randn(8, 5))
    with pytest.raises(HeadConfigError, match="unknown head variant"):
        MTPHead.from_name("cp", 4, 2, 8, 5, "medium")
    head = named("cp")
    with pytest.raises(InvalidInputError, match=r"shape \(batch, 8\)"):
        head(torch.randn(2, 3, 8))
    with pytest.raises(InvalidInputError, match="floating-point"):
        head(torch.ones(2, 8, dtype=torch.long))
