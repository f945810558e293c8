"""EM (:class:`circuits.learn.EM`) against an independent brute-force reference, in float64.

The reference shares no code with the library: it evaluates the symbolic circuit in numpy with
*linear* parameters, and gets every expected count from the circuit's multilinearity. In a smooth,
decomposable circuit each induced tree uses a unit at most once, so ``c(x)`` is linear in every
single parameter ``t`` (a sum weight, or one category's probability of an input unit), and the
posterior expected count of ``t`` in row ``x`` is the share of ``c(x)`` that involves it:

    n_t(x) = (c(x) - c(x)|_{t = 0}) / c(x)

for observed entries and missing ones alike (a missing variable's terms are summed out, so the
count of ``(u, c)`` is the posterior of "unit u used and X = c"). The closed-form EM update then
follows on the circuit's normal form (unit partition functions computed by the same evaluator):
``new = (1 - s) old + s (n + a) / sum(n + a)`` over each row's support.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from factories import compile64, random_circuit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from circuits import (
    Bernoulli,
    Binomial,
    Categorical,
    Circuit,
    Exp,
    Gaussian,
    InputLayer,
    InvalidInputError,
    Parameterization,
    ProductKind,
    ProductLayer,
    Softmax,
    SumLayer,
    region_graphs,
    templates,
)
from circuits.compiled import CompiledCircuit, LogParameters
from circuits.learn import EM
from circuits.learn.families import CategoricalCounts, FamilyEstimate
from circuits.learn.fit import normalised_log_likelihood
from circuits.learn.flows import circuit_flows
from circuits.learn.normal_form import normalised_log_parameters

SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------- the reference
def linear_parameters(model: CompiledCircuit) -> dict[int, np.ndarray]:
    """``{layer uid: (K, D) linear weights}`` as the model's parameterisations define them."""
    out: dict[int, np.ndarray] = {}
    for plan, module in zip(model.plans, model.folds, strict=True):
        if not hasattr(module, "raw"):
            continue
        raw = module.raw.detach().double().numpy()
        for slot, layer in enumerate(plan.layers):
            table = raw[slot]
            if isinstance(layer.parameterization, Softmax):
                top = table.max(-1, keepdims=True)
                e = np.exp(table - top)
                out[layer.uid] = e / e.sum(-1, keepdims=True)
            else:
                assert isinstance(layer.parameterization, Exp)
                out[layer.uid] = np.exp(table)
    return out


def layer_values(circuit: Circuit, params: dict[int, np.ndarray], x: np.ndarray,
                 observed: np.ndarray) -> dict[int, np.ndarray]:
    """Every layer's ``(N, K)`` linear values: unobserved and integrated variables summed out."""
    n = x.shape[0]
    values: dict[int, np.ndarray] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            w = params[layer.uid]
            free = np.broadcast_to(w.sum(-1), (n, layer.num_units))
            if layer.integrated:
                values[layer.uid] = free
                continue
            column = np.clip(x[:, layer.variable], 0, w.shape[1] - 1)
            values[layer.uid] = np.where(observed[:, layer.variable, None], w[:, column].T, free)
        elif isinstance(layer, SumLayer):
            joined = np.concatenate([values[i.uid] for i in layer.inputs], axis=1)
            values[layer.uid] = joined @ params[layer.uid].T
        else:
            assert isinstance(layer, ProductLayer)
            result = values[layer.inputs[0].uid]
            for child in layer.inputs[1:]:
                other = values[child.uid]
                if layer.kind is ProductKind.HADAMARD:
                    result = result * other
                else:
                    result = (result[:, :, None] * other[:, None, :]).reshape(n, -1)
            values[layer.uid] = result
    return values


def root_value(circuit: Circuit, params: dict[int, np.ndarray], x: np.ndarray,
               observed: np.ndarray) -> np.ndarray:
    return layer_values(circuit, params, x, observed)[circuit.output.uid][:, 0]


def expected_counts(circuit: Circuit, params: dict[int, np.ndarray], x: np.ndarray,
                    observed: np.ndarray) -> dict[int, np.ndarray]:
    """``{uid: (K, D)}`` posterior expected counts summed over the rows, by multilinearity."""
    base = root_value(circuit, params, x, observed)
    keep = base > 0
    counts: dict[int, np.ndarray] = {}
    for uid, table in params.items():
        result = np.zeros_like(table)
        for index in np.ndindex(*table.shape):
            saved = table[index]
            if saved == 0:
                continue
            table[index] = 0.0
            reduced = root_value(circuit, params, x, observed)
            table[index] = saved
            result[index] = ((base - reduced)[keep] / base[keep]).sum()
        counts[uid] = result
    return counts


def normal_form(circuit: Circuit, params: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """``w_kd Z_d / Z_k`` and ``phi / Z``: the same distribution with every unit of mass 1."""
    x = np.zeros((1, circuit.num_variables), dtype=np.int64)
    mass = layer_values(circuit, params, x, np.zeros_like(x, dtype=bool))
    out: dict[int, np.ndarray] = {}
    for layer in circuit.layers:
        if isinstance(layer, InputLayer):
            w = params[layer.uid]
            out[layer.uid] = w / w.sum(-1, keepdims=True)
        elif isinstance(layer, SumLayer):
            inputs = np.concatenate([mass[i.uid][0] for i in layer.inputs])
            out[layer.uid] = params[layer.uid] * inputs[None, :] / mass[layer.uid][0][:, None]
    return out


def em_reference(model: CompiledCircuit, x: np.ndarray, observed: np.ndarray, step: float,
                 pseudocount: float) -> dict[int, np.ndarray]:
    """The closed-form EM update of every layer's normal-form parameters."""
    circuit = model.circuit
    params = linear_parameters(model)
    counts = expected_counts(circuit, params, x, observed)
    old = normal_form(circuit, params)
    new: dict[int, np.ndarray] = {}
    for uid, table in old.items():
        support = table > 0
        numerator = np.where(support, counts[uid] + pseudocount, 0.0)
        total = numerator.sum(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            estimate = numerator / total
        mixed = (1 - step) * table + step * estimate
        new[uid] = np.where(total > 0, mixed, table)
    return new


# --------------------------------------------------------------------------- helpers
def sampled_rows(model: CompiledCircuit, rows: int, seed: int) -> torch.Tensor:
    """Rows drawn from the model (every row has positive probability)."""
    return model.sample(rows, generator=torch.Generator().manual_seed(seed))


def missing_mask(model: CompiledCircuit, rows: int, seed: int, keep: float) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.random((rows, model.num_variables)) < keep)


def assert_parameters(model: CompiledCircuit, expected: dict[int, np.ndarray]) -> None:
    got = linear_parameters(model)
    for uid, table in expected.items():
        np.testing.assert_allclose(got[uid], table, rtol=1e-9, atol=1e-11)


# --------------------------------------------------------------------------- exactness
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), step=st.sampled_from([1.0, 0.3]),
       pseudocount=st.sampled_from([0.0, 0.2]))
def test_one_em_step_is_the_closed_form_update(seed: int, step: float, pseudocount: float) -> None:
    """Softmax and Exp layers, exact zeros, shared layers, Kronecker products, integrated inputs."""
    model = compile64(random_circuit(seed, num_variables=int(seed % 3) + 2, num_categories=2))
    x = sampled_rows(model, 7, seed)
    observed = torch.ones_like(x, dtype=torch.bool)
    expected = em_reference(model, x.numpy(), observed.numpy(), step, pseudocount)
    optimizer = EM(model, step_size=step, pseudocount=pseudocount)
    optimizer.accumulate(x)
    optimizer.step()
    assert_parameters(model, expected)
    assert abs(model.log_partition().item()) < 1e-10  # the normal form: every unit has mass 1


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), step=st.sampled_from([1.0, 0.5]))
def test_missing_value_em_uses_the_marginal_likelihood_counts(seed: int, step: float) -> None:
    model = compile64(random_circuit(seed, num_variables=int(seed % 3) + 2, num_categories=3))
    x = sampled_rows(model, 6, seed)
    observed = missing_mask(model, 6, seed, keep=0.6)
    expected = em_reference(model, x.numpy(), observed.numpy(), step, 0.05)
    optimizer = EM(model, step_size=step, pseudocount=0.05)
    optimizer.accumulate(x, observed)
    optimizer.step()
    assert_parameters(model, expected)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), missing=st.booleans())
def test_statistics_are_the_gradients_of_the_normalised_log_parameters(seed: int,
                                                                       missing: bool) -> None:
    """The definition: expected counts = d sum_b log p(x_b) / d (normalised log-parameters).

    Exp layers throughout: their input units compute a missing variable's mass as
    ``logsumexp(log phi)``, which autograd differentiates (Softmax units take it to be 1)."""
    model = compile64(random_circuit(seed, num_categories=2, exp_prob=1.0))
    x = sampled_rows(model, 5, seed)
    observed = missing_mask(model, 5, seed, 0.5 if missing else 1.0)
    optimizer = EM(model, step_size=1.0, pseudocount=0.0)
    log_likelihood = optimizer.accumulate(x, observed)
    normal = normalised_log_parameters(model, model.log_parameters())
    leaves = {fold: value.detach().clone().requires_grad_(True) for fold, value in normal.items()}
    checked, mask = model.validate_data(x, observed)
    values = model.evaluate(checked, mask, LogParameters(dict(leaves), None))
    torch.testing.assert_close(values.detach(), log_likelihood, rtol=1e-10, atol=1e-10)
    values.sum().backward()
    counts = optimizer.expected_counts()
    for plan in model.plans:
        if plan.fold_id in leaves:
            gradient = leaves[plan.fold_id].grad
            assert gradient is not None
            torch.testing.assert_close(counts[plan.name], gradient, rtol=1e-9, atol=1e-10)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), missing=st.booleans())
def test_full_batch_em_never_decreases_the_training_log_likelihood(seed: int, missing: bool) -> None:
    model = compile64(random_circuit(seed, num_variables=4, num_categories=3))
    x = sampled_rows(model, 12, seed)
    observed = missing_mask(model, 12, seed, 0.7 if missing else 1.0)
    optimizer = EM(model, step_size=1.0, pseudocount=0.0)
    previous = -math.inf
    for _ in range(6):
        with torch.no_grad():
            current = float(normalised_log_likelihood(model, x, observed).sum())
        assert current >= previous - 1e-9 * max(1.0, abs(previous))
        previous = current
        optimizer.accumulate(x, observed)
        optimizer.step()


def test_em_increases_the_likelihood_strictly_somewhere() -> None:
    """Negative control for the monotonicity test: EM does move (a frozen model would pass it)."""
    model = compile64(templates.cp(4, rank=3, num_categories=3))
    x = sampled_rows(compile64(templates.cp(4, rank=2, num_categories=3)), 40, 1)
    optimizer = EM(model, step_size=1.0, pseudocount=0.0)
    with torch.no_grad():
        before = float(normalised_log_likelihood(model, x).sum())
        for _ in range(3):
            optimizer.accumulate(x)
            optimizer.step()
        assert float(normalised_log_likelihood(model, x).sum()) > before + 1.0


@pytest.mark.parametrize("pseudocount", [0.0, 0.01])
def test_a_pseudocount_keeps_every_parameter_strictly_positive(pseudocount: float) -> None:
    """One repeated row leaves most counts at 0; with a pseudocount no probability reaches 0."""
    graph = region_graphs.quad_tree(2, 2)
    circuit = region_graphs.build_circuit(graph, "cp", 3, 3, num_categories=4,
                                          sum_parameterization=Exp())
    model = compile64(circuit)
    x = torch.zeros(20, 4, dtype=torch.long)
    optimizer = EM(model, step_size=1.0, pseudocount=pseudocount)
    for _ in range(3):
        optimizer.accumulate(x)
        optimizer.step()
    probabilities = np.concatenate([t.ravel() for t in linear_parameters(model).values()])
    assert np.isfinite(probabilities).all()
    if pseudocount > 0:
        assert probabilities.min() > 0
        assert all(torch.isfinite(p).all() for p in model.parameters())
    else:  # the negative control: without it, unseen categories get probability exactly 0
        assert probabilities.min() == 0


def test_exact_zeros_stay_exact_zeros() -> None:
    model = compile64(random_circuit(11, num_variables=3, num_categories=3, zero_prob=0.4))
    zeros_before = {uid: t == 0 for uid, t in linear_parameters(model).items()}
    assert any(mask.any() for mask in zeros_before.values())
    optimizer = EM(model, step_size=0.5, pseudocount=0.5)
    optimizer.accumulate(sampled_rows(model, 10, 0))
    optimizer.step()
    for uid, table in linear_parameters(model).items():
        assert ((table == 0) == zeros_before[uid]).all()


def test_accumulating_batches_equals_one_full_batch() -> None:
    model = compile64(templates.btree(5, rank=3, num_categories=3))
    twin = compile64(templates.btree(5, rank=3, num_categories=3))
    twin.load_state_dict(model.state_dict())
    x = sampled_rows(model, 30, 3)
    split = EM(model, step_size=1.0, pseudocount=0.1)
    for part in x.split(7):
        split.accumulate(part)
    split.step()
    whole = EM(twin, step_size=1.0, pseudocount=0.1)
    whole.accumulate(x)
    whole.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_frozen_folds_stay_fixed_in_a_normalised_circuit() -> None:
    model = compile64(templates.hmm(4, rank=2, num_categories=3))
    inputs = [m for m in model.folds if isinstance(m, torch.nn.Module) and hasattr(m, "variables")]
    before = [m.raw.detach().clone() for m in inputs]
    for module in inputs:
        module.raw.requires_grad_(False)
    optimizer = EM(model, step_size=1.0, pseudocount=0.0)
    optimizer.accumulate(sampled_rows(model, 10, 0))
    optimizer.step()
    for module, old in zip(inputs, before, strict=True):
        assert torch.equal(module.raw, old)


def test_em_state_dict_round_trip_keeps_pending_statistics() -> None:
    model = compile64(templates.cp(3, rank=2, num_categories=3))
    twin = compile64(templates.cp(3, rank=2, num_categories=3))
    twin.load_state_dict(model.state_dict())
    x = sampled_rows(model, 9, 2)
    first = EM(model, step_size=0.5, pseudocount=0.1)
    first.accumulate(x)
    second = EM(twin, step_size=0.5, pseudocount=0.1)
    second.load_state_dict(first.state_dict())
    first.step()
    second.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- input families
@pytest.mark.parametrize(("step", "pseudocount"), [(1.0, 0.0), (0.4, 0.0), (1.0, 0.3)])
def test_the_em_estimate_route_agrees_with_the_counts(step: float, pseudocount: float) -> None:
    """FamilyEstimate (rows kept, the old statistics as one more row, the fold's em_estimate),
    run on a categorical fold's own em_estimate, against the categorical counts route."""
    model = compile64(templates.cp(3, rank=2, num_categories=3))
    x = sampled_rows(model, 10, 5)
    observed = missing_mask(model, 10, 5, 0.7)
    (module,) = [m for m in model.folds if hasattr(m, "variables")]
    optimizer = EM(model, step_size=step, pseudocount=pseudocount)
    optimizer.accumulate(x[:6], observed[:6])
    optimizer.accumulate(x[6:], observed[6:])
    normal = torch.log_softmax(module.raw.detach(), -1)
    counted = CategoricalCounts(module).new_raw(optimizer.state[module.raw], normal, step, pseudocount)
    family = FamilyEstimate(module)
    state: dict[str, object] = {}
    family.reset(state)
    checked, mask = model.validate_data(x, observed)
    prepared = model.resolve_params(None, None)
    for rows in (slice(0, 6), slice(6, 10)):
        flows = circuit_flows(model, prepared, checked[rows], mask[rows])
        fold = module.plan.fold_id
        family.accumulate(state, flows.inputs[fold], flows.input_flows[fold], normal)
    estimated = family.new_raw(state, normal, step, pseudocount)
    torch.testing.assert_close(torch.log_softmax(estimated, -1), counted, rtol=1e-10, atol=1e-10)


def bernoulli_and_categorical_twins(seed: int) -> tuple[CompiledCircuit, CompiledCircuit]:
    """The same distribution with Bernoulli inputs and with Categorical(2) inputs (logits 0, l)."""
    graph = region_graphs.quad_tree(2, 2)
    bernoulli = compile64(region_graphs.build_circuit(graph, "cp", 2, 3,
                                                      input_distribution=Bernoulli()), seed=seed)
    categorical = compile64(region_graphs.build_circuit(graph, "cp", 2, 3, num_categories=2),
                            seed=seed)
    with torch.no_grad():
        for source, target in zip(bernoulli.folds, categorical.folds, strict=True):
            if hasattr(source, "raw"):
                raw = source.raw
                if raw.shape[-1] == 1:  # success logit l -> categorical logits (0, l)
                    raw = torch.cat([torch.zeros_like(raw), raw], dim=-1)
                target.raw.copy_(raw)
    return bernoulli, categorical


@pytest.mark.parametrize(("step", "pseudocount"), [(1.0, 0.0), (0.5, 0.0), (1.0, 0.2)])
def test_bernoulli_em_equals_categorical_em_on_two_categories(step: float, pseudocount: float) -> None:
    bernoulli, categorical = bernoulli_and_categorical_twins(3)
    x = sampled_rows(categorical, 12, 4)
    observed = missing_mask(categorical, 12, 4, 0.75)
    torch.testing.assert_close(bernoulli.log_marginal(x, observed), categorical.log_marginal(x, observed))
    for model in (bernoulli, categorical):
        optimizer = EM(model, step_size=step, pseudocount=pseudocount)
        optimizer.accumulate(x, observed)
        optimizer.step()
    for source, target in zip(bernoulli.folds, categorical.folds, strict=True):
        if hasattr(source, "raw"):
            if source.raw.shape[-1] == 1:
                torch.testing.assert_close(torch.sigmoid(source.raw[..., 0]),
                                           torch.softmax(target.raw, -1)[..., 1], rtol=1e-10, atol=1e-12)
            else:
                torch.testing.assert_close(torch.softmax(source.raw, -1), torch.softmax(target.raw, -1),
                                           rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("step", [1.0, 0.5])
def test_gaussian_mixture_em_is_the_textbook_update(step: float) -> None:
    """A mixture of K diagonal Gaussians: responsibilities, weighted means and variances; with a
    step below 1, mixed with the old parameters in (mean, second moment) space."""
    variables, components, rows = 3, 4, 30
    inputs = [InputLayer(v, components, Gaussian()) for v in range(variables)]
    model = compile64(Circuit(SumLayer([ProductLayer(inputs)], 1)), seed=2)
    x = torch.randn(rows, variables, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[:, 0] += 3 * (torch.arange(rows) % 2)
    (gauss,) = [m for m in model.folds if hasattr(m, "variables")]
    (mixing,) = [m for m in model.folds if hasattr(m, "raw") and not hasattr(m, "variables")]
    order = gauss.variables.numpy()
    mean = gauss.raw.detach()[..., 0].numpy()[np.argsort(order)]  # (V, K)
    std = np.exp(gauss.raw.detach()[..., 1].numpy()[np.argsort(order)])
    weights = torch.softmax(mixing.raw.detach()[0, 0], -1).numpy()  # (K,)
    data = x.numpy()
    log_density = (-0.5 * ((data[:, :, None] - mean[None]) / std[None]) ** 2 - np.log(std[None])
                   - 0.5 * np.log(2 * np.pi)).sum(1)  # (N, K)
    joint = np.log(weights)[None] + log_density
    resp = np.exp(joint - joint.max(1, keepdims=True))
    resp /= resp.sum(1, keepdims=True)
    total = resp.sum(0)  # (K,)
    est_mean = (resp[:, None, :] * data[:, :, None]).sum(0) / total  # (V, K)
    est_square = (resp[:, None, :] * data[:, :, None] ** 2).sum(0) / total
    new_mean = (1 - step) * mean + step * est_mean
    new_square = (1 - step) * (std ** 2 + mean ** 2) + step * est_square
    new_weights = (1 - step) * weights + step * total / rows
    optimizer = EM(model, step_size=step, pseudocount=0.0)
    optimizer.accumulate(x)
    optimizer.step()
    got = gauss.raw.detach().numpy()[np.argsort(order)]
    np.testing.assert_allclose(got[..., 0], new_mean, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np.exp(2 * got[..., 1]), new_square - new_mean ** 2, rtol=1e-9)
    np.testing.assert_allclose(torch.softmax(mixing.raw.detach()[0, 0], -1).numpy(), new_weights,
                               rtol=1e-9)


def test_mixed_families_learn_with_missing_values() -> None:
    """Gaussian, Binomial and Categorical variables in one circuit; NaN where values are missing."""
    distributions = {0: Gaussian(), 1: Binomial(4), 2: Categorical(3), 3: Gaussian()}
    circuit = region_graphs.build_circuit(region_graphs.quad_tree(2, 2), "cp", 3, 3,
                                          input_distribution=distributions)
    model = compile64(circuit)
    data = model.sample(40, generator=torch.Generator().manual_seed(1))
    observed = missing_mask(model, 40, 1, 0.8)
    data = torch.where(observed, data, torch.nan)
    optimizer = EM(model, step_size=1.0, pseudocount=0.0)
    previous = -math.inf
    for _ in range(4):
        with torch.no_grad():
            current = float(normalised_log_likelihood(model, data, observed).sum())
        assert current >= previous - 1e-9 * abs(previous)
        previous = current
        optimizer.accumulate(data, observed)
        optimizer.step()


# --------------------------------------------------------------------------- errors
def test_step_without_statistics_says_what_to_do() -> None:
    model = compile64(templates.cp(3, rank=2, num_categories=3))
    optimizer = EM(model)
    (-model.log_likelihood(torch.zeros(2, 3, dtype=torch.long)).sum()).backward()
    with pytest.raises(InvalidInputError, match=r"accumulate\(x\)"):
        optimizer.step()


@pytest.mark.parametrize(("step", "pseudocount", "message"),
                         [(0.0, 0.1, "step_size"), (1.5, 0.1, "step_size"),
                          (0.5, -1.0, "pseudocount"), (0.5, math.inf, "pseudocount")])
def test_bad_hyperparameters(step: float, pseudocount: float, message: str) -> None:
    model = compile64(templates.cp(3, rank=2, num_categories=3))
    with pytest.raises(InvalidInputError, match=message):
        EM(model, step_size=step, pseudocount=pseudocount)


class Square(Parameterization):
    """A parameterisation EM cannot invert (weights ``raw ** 2``)."""

    normalized = False

    def log_weights(self, raw: torch.Tensor) -> torch.Tensor:
        return 2 * torch.log(raw.abs())


def test_unsupported_parameterisations_and_models_are_refused() -> None:
    layer = InputLayer(0, 2, Categorical(3))
    other = InputLayer(1, 2, Categorical(3))
    root = SumLayer([ProductLayer([layer, other])], 1, parameterization=Square(),
                    initial=torch.ones(1, 2))
    with pytest.raises(InvalidInputError, match="Square"):
        EM(compile64(Circuit(root)))
    with pytest.raises(InvalidInputError, match="compiled circuit"):
        EM(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_freezing_a_fold_of_an_unnormalised_circuit_is_refused() -> None:
    circuit = region_graphs.build_circuit(region_graphs.linear(3), "cp", 2, 2, 3,
                                          input_parameterization=Exp())
    model = compile64(circuit)
    next(model.parameters()).requires_grad_(False)
    with pytest.raises(InvalidInputError, match="frozen"):
        EM(model)


def test_bad_data_leaves_the_statistics_and_parameters_untouched() -> None:
    model = compile64(templates.cp(3, rank=2, num_categories=3))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = EM(model, step_size=1.0)
    with pytest.raises(InvalidInputError, match="out of range for variable 1"):
        optimizer.accumulate(torch.tensor([[0, 3, 1]]))
    with pytest.raises(InvalidInputError, match="accumulate"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
