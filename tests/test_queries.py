"""Every exact query of a compiled circuit against brute-force enumeration (float64, 1e-10).

The expected values come from :mod:`factories`: an independent numpy evaluation of the symbolic
circuit (linear space, no code shared with :mod:`circuits.compiled`) on every assignment of the
scope, summed or maximised by plain enumeration.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from factories import (
    Exact,
    any_circuits,
    compile64,
    copy_parameters,
    deterministic_circuits,
    log,
    random_circuit,
    random_circuits,
    raw_from_compiled,
    raw_from_initial,
    reference_values,
    region_graph_circuit,
    region_graph_names,
    seeds,
    set_row_parameters,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import circuits
from circuits import Categorical, Circuit, Exp, InputLayer, ProductKind, ProductLayer, SumLayer
from circuits import templates as tpl
from circuits.errors import ZeroProbabilityEvidenceError

ATOL = 1e-10
RTOL = 1e-12


def as_numpy(values: Tensor | np.ndarray) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().double().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


def assert_log_close(actual: Tensor | np.ndarray, expected: np.ndarray, atol: float = ATOL,
                     rtol: float = RTOL) -> None:
    """Equal log-values: never NaN, ``-inf`` exactly where expected, close elsewhere."""
    got = as_numpy(actual)
    want = np.asarray(expected, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not np.isnan(got).any(), f"NaN in result: {got}"
    assert not np.isnan(want).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol)


def random_rows(ex: Exact, rng: np.random.Generator, count: int, positive: bool) -> np.ndarray:
    """``count`` complete assignments (of positive probability when ``positive``)."""
    pool = ex.states[ex.values > 0] if positive else ex.states
    return pool[rng.integers(0, len(pool), size=count)]


def random_mask(rng: np.random.Generator, count: int, num_variables: int) -> np.ndarray:
    return rng.random((count, num_variables)) < rng.random()


def possible_rows(compiled: circuits.CompiledCircuit, ex: Exact, x: np.ndarray,
                  mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``(x, mask)`` whose evidence has positive probability (brute force), after
    checking that MAP on all rows raises ZeroProbabilityEvidenceError naming exactly the others."""
    possible = np.array([ex.marginal(x[b], mask[b]) > 0 for b in range(len(x))], dtype=bool)
    if not possible.all():
        with pytest.raises(ZeroProbabilityEvidenceError, match=r"map_state.*probability zero") as info:
            compiled.map_state(torch.tensor(x), torch.tensor(mask))
        assert info.value.rows == tuple(int(i) for i in np.flatnonzero(~possible))
        assert info.value.log_probability == -np.inf
    return x[possible], mask[possible]


# ------------------------------------------------------------------------ likelihood & partition


@settings(max_examples=40)
@given(circuit=any_circuits())
def test_log_likelihood_folded_unfolded_and_reference_agree(circuit: Circuit) -> None:
    folded = compile64(circuit, fold=True)
    unfolded = compile64(circuit, fold=False)
    copy_parameters(folded, unfolded)  # templates draw random parameters in fold order
    ex = Exact.of(folded)
    x = torch.tensor(ex.states)
    expected = log(ex.values)
    assert_log_close(folded.log_likelihood(x), expected)
    assert_log_close(unfolded.log_likelihood(x), expected)
    assert_log_close(folded(x), expected)  # forward == log_likelihood
    assert len(unfolded.plans) == len(circuit.layers)
    assert len(folded.plans) <= len(circuit.layers)


@settings(max_examples=30)
@given(circuit=random_circuits())
def test_initial_parameters_are_used_exactly_in_float64(circuit: Circuit) -> None:
    compiled = compile64(circuit)
    from_initial = raw_from_initial(circuit)
    from_module = raw_from_compiled(compiled)
    assert from_initial.keys() == from_module.keys()
    for uid, value in from_initial.items():
        np.testing.assert_array_equal(from_module[uid], value)  # bit-exact, -inf included


@settings(max_examples=40)
@given(circuit=any_circuits())
def test_log_partition_matches_enumeration(circuit: Circuit) -> None:
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    log_z = compiled.log_partition()
    assert log_z.shape == ()
    assert_log_close(log_z, np.log(ex.partition))
    all_states = compiled.log_likelihood(torch.tensor(ex.states))
    assert_log_close(torch.logsumexp(all_states, 0), np.log(ex.partition))
    if compiled.normalized:
        assert abs(float(log_z.detach())) < ATOL


def test_exp_circuits_have_a_non_trivial_partition_function() -> None:
    compiled = compile64(random_circuit(3, 4, 3, exp_prob=1.0))
    assert not compiled.normalized
    assert abs(float(compiled.log_partition())) > 0.1
    assert_log_close(compiled.log_partition(), np.log(Exact.of(compiled).partition))


@pytest.mark.parametrize("name", region_graph_names())
@pytest.mark.parametrize("pattern", ["CP", "TUCKER"])
@pytest.mark.parametrize("unnormalised", [False, True])
def test_every_region_graph_circuit_matches_enumeration(name: str, pattern: str,
                                                        unnormalised: bool) -> None:
    circuit = region_graph_circuit(name, pattern, 2, 3, 3, seed=1, unnormalised=unnormalised)
    folded = compile64(circuit)
    unfolded = compile64(circuit, fold=False)
    copy_parameters(folded, unfolded)
    ex = Exact.of(folded)
    x = torch.tensor(ex.states)
    assert_log_close(folded.log_likelihood(x), log(ex.values))
    assert_log_close(unfolded.log_likelihood(x), log(ex.values))
    assert_log_close(folded.log_partition(), np.log(ex.partition))
    rng = np.random.default_rng(0)
    rows = random_rows(ex, rng, 6, positive=True)
    mask = random_mask(rng, 6, circuit.num_variables)
    expected = log(np.array([ex.marginal(rows[b], mask[b]) for b in range(6)]))
    assert_log_close(folded.log_marginal(torch.tensor(rows), torch.tensor(mask)), expected)
    order = [int(v) for v in rng.permutation(list(ex.scope))]
    got = folded.log_prefix_conditionals(torch.tensor(rows[:2]), order)
    for i, variable in enumerate(order):
        prefix = np.zeros(circuit.num_variables, dtype=bool)
        prefix[order[:i]] = True
        for b in range(2):
            assert_log_close(got[b, i], log(ex.conditional(rows[b], prefix, variable)))


# ------------------------------------------------------------------------ marginals


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds)
def test_log_marginal_with_per_row_masks(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    x = random_rows(ex, rng, 8, positive=False)
    mask = random_mask(rng, 8, circuit.num_variables)
    mask[0] = False  # nothing observed: Z
    mask[1] = True  # everything observed: the likelihood
    expected = log(np.array([ex.marginal(x[b], mask[b]) for b in range(8)]))
    got = compiled.log_marginal(torch.tensor(x), torch.tensor(mask))
    assert_log_close(got, expected)
    assert_log_close(got[0], np.log(ex.partition))
    # unobserved entries are never read: scribbling on them changes nothing
    scribbled = np.where(mask, x, rng.integers(-5, 9, size=x.shape))
    assert_log_close(compiled.log_marginal(torch.tensor(scribbled), torch.tensor(mask)), expected)


@settings(max_examples=25)
@given(circuit=any_circuits(), seed=seeds)
def test_log_marginal_with_one_shared_mask(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    x = random_rows(ex, rng, 5, positive=False)
    mask = rng.random(circuit.num_variables) < 0.5
    expected = log(np.array([ex.marginal(row, mask) for row in x]))
    assert_log_close(compiled.log_marginal(torch.tensor(x), torch.tensor(mask)), expected)
    assert_log_close(compiled.log_marginal(torch.tensor(x), torch.tensor(mask[None, :])), expected)


# ------------------------------------------------------------------------ conditionals


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds)
def test_log_conditional_full_vectors_for_several_variables(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    scope = list(ex.scope)
    count = int(rng.integers(1, len(scope) + 1))
    query = [int(v) for v in rng.permutation(scope)[:count]]  # random order, not sorted
    x = random_rows(ex, rng, 6, positive=True)  # evidence of positive probability
    mask = random_mask(rng, 6, circuit.num_variables)
    mask[:, query] = False
    got = compiled.log_conditional(torch.tensor(x), torch.tensor(mask), query)
    size = circuit.num_categories[query[0]]
    assert got.shape == (6, len(query), size)
    expected = np.stack([np.stack([log(ex.conditional(x[b], mask[b], v)) for v in query])
                         for b in range(6)])
    assert_log_close(got, expected)
    np.testing.assert_allclose(as_numpy(got.exp().sum(-1)), 1.0, atol=1e-12)


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds, shared_set=st.booleans())
def test_row_conditionals_query_one_variable_per_row(circuit: Circuit, seed: int,
                                                     shared_set: bool) -> None:
    """What the speculative round's prefix conditionals use: row ``b`` asks about its own
    variable only, on the module's parameters or on one external set shared by every row."""
    from circuits.compiled.queries import row_conditionals
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    first = int(rng.choice(list(ex.scope)))
    size = circuit.num_categories[first]
    candidates = [v for v in ex.scope if circuit.num_categories[v] == size]
    rows = 5
    query = [int(v) for v in rng.choice(candidates, size=rows)]
    x = random_rows(ex, rng, rows, positive=True)
    mask = random_mask(rng, rows, circuit.num_variables)
    mask[np.arange(rows), query] = False
    params = compiled.internal_parameters(1) if shared_set else None
    prepared = compiled.resolve_params(params, 1 if shared_set else None)
    got = row_conditionals(compiled, torch.tensor(x), torch.tensor(mask), prepared, size,
                           torch.tensor(query))
    got = got / got.sum(-1, keepdim=True)
    expected = np.stack([ex.conditional(x[b], mask[b], query[b]) for b in range(rows)])
    np.testing.assert_allclose(as_numpy(got), expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=20)
@given(circuit=any_circuits(), seed=seeds)
def test_log_conditional_default_queries_every_unobserved_variable(circuit: Circuit,
                                                                   seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    x = random_rows(ex, rng, 3, positive=True)
    observed = np.zeros(circuit.num_variables, dtype=bool)
    observed[min(ex.scope)] = True
    free = [v for v in ex.scope if not observed[v]]
    if not free:  # a single-variable circuit: condition on nothing instead
        observed[:] = False
        free = list(ex.scope)
    got = compiled.log_conditional(torch.tensor(x), torch.tensor(observed))
    expected = np.stack([np.stack([log(ex.conditional(row, observed, v)) for v in free])
                         for row in x])
    assert_log_close(got, expected)


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds)
def test_log_prefix_marginals_with_random_order(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    order = [int(v) for v in rng.permutation(list(ex.scope))]
    x = random_rows(ex, rng, 5, positive=False)
    got = compiled.log_prefix_marginals(torch.tensor(x), order)
    assert got.shape == (5, len(order))
    expected = np.zeros((5, len(order)))
    for i in range(len(order)):
        mask = np.zeros(circuit.num_variables, dtype=bool)
        mask[order[: i + 1]] = True
        expected[:, i] = log(np.array([ex.marginal(row, mask) for row in x]))
    assert_log_close(got, expected)
    assert_log_close(got[:, -1], log(reference_values(circuit, ex.raw, x, np.ones_like(x, bool))))
    default = compiled.log_prefix_marginals(torch.tensor(x))
    sorted_mask = np.zeros(circuit.num_variables, dtype=bool)
    sorted_mask[min(ex.scope)] = True
    assert_log_close(default[:, 0], log(np.array([ex.marginal(row, sorted_mask) for row in x])))


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds)
def test_log_prefix_conditionals_with_random_order(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    order = [int(v) for v in rng.permutation(list(ex.scope))]
    x = random_rows(ex, rng, 4, positive=True)
    got = compiled.log_prefix_conditionals(torch.tensor(x), order)
    size = circuit.num_categories[order[0]]
    assert got.shape == (4, len(order), size)
    expected = np.zeros((4, len(order), size))
    for i, variable in enumerate(order):
        mask = np.zeros(circuit.num_variables, dtype=bool)
        mask[order[:i]] = True
        for b in range(4):
            expected[b, i] = log(ex.conditional(x[b], mask, variable))
    assert_log_close(got, expected)
    # chain rule: the picked conditionals add up to the normalised log-likelihood
    picked = got.gather(2, torch.tensor(x[:, order])[:, :, None]).squeeze(2).sum(1)
    normalised = compiled.log_likelihood(torch.tensor(x)) - compiled.log_partition()
    assert_log_close(picked, as_numpy(normalised), atol=1e-9)


# ------------------------------------------------------------------------ MAP


@settings(max_examples=40)
@given(circuit=deterministic_circuits(), seed=seeds)
def test_map_state_is_exact_on_deterministic_circuits(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    state, value = compiled.map_state()
    assert state.shape == (1, circuit.num_variables)
    assert_log_close(value, np.log([ex.values.max()]))
    assert_log_close(compiled.log_likelihood(state), np.log([ex.values.max()]))
    # with per-row evidence: the best completion of each row
    x = random_rows(ex, rng, 6, positive=False)
    mask = random_mask(rng, 6, circuit.num_variables)
    x, mask = possible_rows(compiled, ex, x, mask)  # impossible evidence raises
    state, value = compiled.map_state(torch.tensor(x), torch.tensor(mask))
    best = np.array([ex.values[ex.consistent(x[b], mask[b])].max() for b in range(len(x))])
    assert_log_close(value, log(best))
    np.testing.assert_array_equal(state.numpy()[mask], x[mask])
    positive = best > 0
    assert_log_close(compiled.log_likelihood(state)[torch.tensor(positive)],
                     log(best[positive]))


@settings(max_examples=20)
@given(circuit=deterministic_circuits())
def test_deterministic_factory_is_deterministic(circuit: Circuit) -> None:
    """Checks the generator the MAP test relies on: for every complete assignment, every sum
    unit has at most one non-zero term ``w_kj * c_j(x)``."""
    ex = Exact.of(compile64(circuit))
    values: dict[int, np.ndarray] = {}
    reference_values(circuit, ex.raw, ex.states, np.ones_like(ex.states, bool), every_layer=values)
    assert circuit.sum_layers
    for layer in circuit.sum_layers:
        joined = np.concatenate([values[child.uid] for child in layer.inputs], axis=1)  # (S, D)
        weights = np.exp(ex.raw[layer.uid])  # same support as the weights, either parameterisation
        terms = np.broadcast_to(weights, (len(ex.states), *layer.parameter_shape)) * joined[:, None]
        assert ((terms > 0).sum(-1) <= 1).all(), layer.describe()


@settings(max_examples=40)
@given(circuit=any_circuits(), seed=seeds)
def test_map_state_is_the_best_induced_tree_on_any_circuit(circuit: Circuit, seed: int) -> None:
    """Max-product MAP: its value is ``max_x max_T c_T(x)`` (brute force over x; the max over
    induced trees ``T`` at a complete ``x`` is the reference evaluated in the max semiring), the
    returned state attains it, and it lower-bounds the true value of that state."""
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    full = np.ones_like(ex.states, dtype=bool)
    tree_best = reference_values(circuit, ex.raw, ex.states, full, semiring="max")
    x = random_rows(ex, rng, 6, positive=False)
    mask = random_mask(rng, 6, circuit.num_variables)
    mask[0] = False
    x, mask = possible_rows(compiled, ex, x, mask)  # impossible evidence raises; row 0 stays
    state, value = compiled.map_state(torch.tensor(x), torch.tensor(mask))
    expected = np.array([tree_best[ex.consistent(x[b], mask[b])].max() for b in range(len(x))])
    assert_log_close(value, log(expected))
    assert_log_close(value, log(reference_values(circuit, ex.raw, x, mask, semiring="max")))
    got_state = state.numpy()
    np.testing.assert_array_equal(got_state[mask], x[mask])
    assert_log_close(value, log(reference_values(circuit, ex.raw, got_state,
                                                 np.ones_like(got_state, bool), semiring="max")))
    likelihood = as_numpy(compiled.log_likelihood(state))
    assert np.all(likelihood >= as_numpy(value) - 1e-10)
    assert as_numpy(value)[0] <= np.log(ex.values.max()) + 1e-10


# ------------------------------------------------------------------------ external parameters


@settings(max_examples=25)
@given(circuit=any_circuits(), seed=seeds)
def test_internal_parameters_as_external_equal_internal(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    ex = Exact.of(compiled)
    x = torch.tensor(random_rows(ex, rng, 5, positive=False))
    mask = torch.tensor(random_mask(rng, 5, circuit.num_variables))
    params = compiled.internal_parameters(5)
    assert set(params) == set(compiled.parameter_shapes())
    for name, shape in compiled.parameter_shapes().items():
        assert tuple(params[name].shape) == (5, *shape)
    assert_log_close(compiled(x, params=params), as_numpy(compiled(x)), atol=1e-12)
    assert_log_close(compiled.log_marginal(x, mask, params=params),
                     as_numpy(compiled.log_marginal(x, mask)), atol=1e-12)
    assert_log_close(compiled.log_partition(params), np.full(5, float(compiled.log_partition())),
                     atol=1e-12)


def perturbed_params(compiled: circuits.CompiledCircuit, batch: int, rng: np.random.Generator,
                     subset: bool) -> dict[str, Tensor]:
    """Random per-row raw parameters: the internal ones plus noise (exact zeros kept)."""
    names = list(compiled.parameter_shapes())
    if subset and len(names) > 1:
        names = [n for n in names if rng.random() < 0.6] or names[:1]
    out = {}
    for name, base in compiled.internal_parameters(batch).items():
        if name in names:
            noise = torch.tensor(rng.normal(size=tuple(base.shape)))
            out[name] = (base.detach() + noise).contiguous()
    return out


@settings(max_examples=25)
@given(circuit=any_circuits(), seed=seeds, subset=st.booleans())
def test_per_row_external_parameters_equal_one_circuit_per_row(circuit: Circuit, seed: int,
                                                               subset: bool) -> None:
    rng = np.random.default_rng(seed)
    compiled = compile64(circuit)
    batch = 3
    params = perturbed_params(compiled, batch, rng, subset)
    ex = Exact.of(compiled)
    x = random_rows(ex, rng, batch, positive=True)
    mask = random_mask(rng, batch, circuit.num_variables)
    xt, maskt = torch.tensor(x), torch.tensor(mask)
    query = [int(rng.choice(list(ex.scope)))]
    order = [int(v) for v in rng.permutation(list(ex.scope))]
    free = mask.copy()
    free[:, query] = False
    results = {
        "likelihood": compiled.log_likelihood(xt, params=params),
        "marginal": compiled.log_marginal(xt, maskt, params=params),
        "partition": compiled.log_partition(params),
        "prefix": compiled.log_prefix_marginals(xt, order, params=params),
        "map": compiled.map_state(xt, maskt, params=params)[1],
    }
    for b in range(batch):
        row = copy.deepcopy(compiled)
        set_row_parameters(row, params, b)
        xb, mb = xt[b: b + 1], maskt[b: b + 1]
        expected = {
            "likelihood": row.log_likelihood(xb),
            "marginal": row.log_marginal(xb, mb),
            "partition": row.log_partition()[None],
            "prefix": row.log_prefix_marginals(xb, order),
            "map": row.map_state(xb, mb)[1],
        }
        for key, value in expected.items():
            assert_log_close(results[key][b: b + 1], as_numpy(value), atol=1e-11)
        # and against the independent reference with that row's parameters
        row_ex = Exact.of(compiled, params, row=b)
        everything = np.ones_like(mask[b])
        assert_log_close(results["likelihood"][b], log(np.array(row_ex.marginal(x[b], everything))))
        assert_log_close(results["marginal"][b], log(np.array(row_ex.marginal(x[b], mask[b]))))
        assert_log_close(results["partition"][b], np.log(row_ex.partition))
    # conditionals read the evidence of positive probability under each row's parameters
    cond = compiled.log_conditional(xt, torch.tensor(free), query, params=params)
    for b in range(batch):
        row_ex = Exact.of(compiled, params, row=b)
        if row_ex.marginal(x[b], free[b]) > 0:
            assert_log_close(cond[b, 0], log(row_ex.conditional(x[b], free[b], query[0])))


def test_external_parameters_propagate_gradients() -> None:
    compiled = compile64(random_circuit(11, 3, 3))
    params = {k: v.detach().clone().requires_grad_(True)
              for k, v in compiled.internal_parameters(4).items()}
    x = torch.tensor(Exact.of(compiled).states[:4])
    compiled.log_likelihood(x, params=params).sum().backward()
    grads = [p.grad for p in params.values()]
    assert all(g is not None and not torch.isnan(g).any() for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads if g is not None)
    assert all(p.grad is None for p in compiled.parameters())


# ------------------------------------------------------------------------ float32, stability


@settings(max_examples=20)
@given(circuit=any_circuits(), seed=seeds)
def test_float32_agrees_with_float64(circuit: Circuit, seed: int) -> None:
    rng = np.random.default_rng(seed)
    c64 = compile64(circuit)
    c32 = circuits.compile(circuit, dtype=torch.float32)
    copy_parameters(c64, c32)
    assert c32.dtype == torch.float32
    ex = Exact.of(c64)
    x = torch.tensor(random_rows(ex, rng, 6, positive=False))
    mask = torch.tensor(random_mask(rng, 6, circuit.num_variables))
    out = c32.log_marginal(x, mask)
    assert out.dtype == torch.float32
    assert_log_close(out, as_numpy(c64.log_marginal(x, mask)), atol=1e-4, rtol=1e-5)
    assert_log_close(c32.log_partition(), as_numpy(c64.log_partition()), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deep_hmm_is_stable_and_exact(dtype: torch.dtype) -> None:
    circuit = tpl.hmm(30, rank=4, num_categories=3)
    assert circuit.depth() >= 20
    compiled = circuits.compile(circuit, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert abs(float(compiled.log_partition())) < tol
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, size=(16, 30))
    ll = compiled.log_likelihood(torch.tensor(x))
    assert torch.isfinite(ll).all() and (ll < 0).all()
    expected = log(reference_values(circuit, raw_from_compiled(compiled), x, np.ones_like(x, bool)))
    assert_log_close(ll, expected, atol=tol, rtol=1e-6 if dtype == torch.float32 else RTOL)
    mask = torch.tensor(rng.random((16, 30)) < 0.5)
    expected = log(reference_values(circuit, raw_from_compiled(compiled), x, mask.numpy()))
    assert_log_close(compiled.log_marginal(torch.tensor(x), mask), expected, atol=tol,
                     rtol=1e-6 if dtype == torch.float32 else RTOL)
    cond = compiled.log_prefix_conditionals(torch.tensor(x[:2]))
    assert torch.isfinite(cond).all()
    np.testing.assert_allclose(as_numpy(cond.exp().sum(-1)), 1.0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_btree_is_stable_and_normalised(dtype: torch.dtype) -> None:
    circuit = tpl.btree(784, rank=2, num_categories=4)
    compiled = circuits.compile(circuit, dtype=dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    assert abs(float(compiled.log_partition())) < tol
    rng = np.random.default_rng(1)
    x = torch.tensor(rng.integers(0, 4, size=(3, 784)))
    ll = compiled.log_likelihood(x)
    assert torch.isfinite(ll).all()
    assert (ll < -784 * 0.1).all()  # far below float32's smallest normal in linear space
    # one variable left free: its marginal sums to the marginal of the rest
    observed = torch.ones(784, dtype=torch.bool)
    observed[400] = False
    rest = compiled.log_marginal(x, observed)
    each = torch.stack([compiled.log_likelihood(torch.where(
        torch.arange(784) == 400, torch.full_like(x, c), x)) for c in range(4)])
    assert_log_close(torch.logsumexp(each, 0), as_numpy(rest), atol=tol, rtol=1e-6)
    # chain rule over all 784 positions
    cond = compiled.log_prefix_conditionals(x[:1])
    assert torch.isfinite(cond).all()
    picked = cond[0].gather(1, x[0][:, None]).sum()
    assert abs(float(picked - ll[0])) < (1e-8 if dtype == torch.float64 else 0.05)


def _exp_chain(length: int, rank: int, categories: int, seed: int) -> Circuit:
    """A deep unnormalised HMM-like chain with large Exp weights (Z overflows linear space)."""
    gen = torch.Generator().manual_seed(seed)
    def raw(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) + 3.0)
    layer: circuits.Layer = InputLayer(length - 1, rank, Categorical(categories), Exp(),
                                       initial=raw(rank, categories))
    for v in range(length - 2, -1, -1):
        emit = InputLayer(v, rank, Categorical(categories), Exp(), initial=raw(rank, categories))
        layer = ProductLayer([emit, SumLayer([layer], rank, Exp(), initial=raw(rank, rank))],
                             ProductKind.HADAMARD)
    return Circuit(SumLayer([layer], 1, Exp(), initial=raw(1, rank)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deep_unnormalised_circuit_stays_finite(dtype: torch.dtype) -> None:
    circuit = _exp_chain(100, 3, 3, seed=5)
    assert circuit.depth() >= 100
    c64 = compile64(circuit)
    compiled = circuits.compile(circuit, dtype=dtype)
    log_z = compiled.log_partition()
    assert torch.isfinite(log_z) and float(log_z) > 700  # exp(log Z) overflows float64
    assert abs(float(log_z) - float(c64.log_partition())) < 1e-3 * float(log_z)
    x = torch.zeros(3, 100, dtype=torch.long)
    x[1] = 1
    x[2] = torch.arange(100) % 3
    observed = torch.zeros(100, dtype=torch.bool)
    observed[0] = True
    first = torch.stack([compiled.log_marginal(torch.full_like(x[:1], c), observed)[0]
                         for c in range(3)])
    assert abs(float(torch.logsumexp(first, 0) - log_z)) < (1e-9 if dtype == torch.float64
                                                            else 1e-3) * float(log_z)
    ll = compiled.log_likelihood(x)
    assert torch.isfinite(ll).all() and (ll < log_z).all()


# ------------------------------------------------------------------------ zeros: -inf, never NaN


@settings(max_examples=25)
@given(seed=seeds, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_zero_probabilities_give_minus_inf_and_no_nan_gradients(seed: int,
                                                                dtype: torch.dtype) -> None:
    circuit = random_circuit(seed, zero_prob=0.4)
    compiled = circuits.compile(circuit, dtype=dtype)
    ex = Exact.of(compiled)
    x = torch.tensor(ex.states)
    ll = compiled.log_likelihood(x)
    zero = ex.values == 0
    assert not torch.isnan(ll).any()
    np.testing.assert_array_equal(np.isneginf(as_numpy(ll)), zero)
    ll.sum().backward()  # -inf when some state has probability zero
    for name, p in compiled.named_parameters():
        assert p.grad is not None and not torch.isnan(p.grad).any(), name
    compiled.zero_grad()
    finite = ll.detach().isfinite()
    if bool(finite.any()):
        compiled.log_likelihood(x[finite]).sum().backward()
        for name, p in compiled.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    mask = torch.tensor(np.random.default_rng(seed).random(x.shape) < 0.5)
    assert not torch.isnan(compiled.log_marginal(x, mask)).any()
    assert not torch.isnan(compiled.log_prefix_marginals(x)).any()
    positive = torch.tensor(~zero)
    cond = compiled.log_prefix_conditionals(x[positive][:8])
    assert not torch.isnan(cond).any()
    possible = torch.isfinite(compiled.log_marginal(x, mask)).detach()
    if not bool(possible.all()):
        with pytest.raises(ZeroProbabilityEvidenceError):
            compiled.map_state(x, mask)
    _state, value = compiled.map_state(x[possible], mask[possible])
    assert not torch.isnan(value).any()


def test_fixed_zero_pattern_gives_minus_inf() -> None:
    """``p(x0 = 1) = 0`` exactly: every state with ``x0 = 1`` is ``-inf``, marginals too."""
    zero_one = torch.tensor([[0.3, -torch.inf, 0.1]], dtype=torch.float64)
    x0 = InputLayer(0, 1, Categorical(3), Exp(), initial=zero_one)
    x1 = InputLayer(1, 1, Categorical(3), initial=torch.zeros(1, 3, dtype=torch.float64))
    compiled = compile64(Circuit(ProductLayer([x0, x1])))
    x = torch.tensor([[1, 0], [1, 2], [0, 2]])
    ll = compiled.log_likelihood(x)
    assert torch.isneginf(ll[:2]).all() and torch.isfinite(ll[2])
    marginal = compiled.log_marginal(x, torch.tensor([True, False]))
    assert torch.isneginf(marginal[:2]).all()
    cond = compiled.log_conditional(x, torch.tensor([False, True]), [0])
    assert torch.isneginf(cond[:, 0, 1]).all() and not torch.isnan(cond).any()
    ll.sum().backward()
    for p in compiled.parameters():
        assert p.grad is not None and not torch.isnan(p.grad).any()


# ------------------------------------------------------------------------ empty batches


@pytest.mark.parametrize("seed", range(4))
def test_empty_batches_give_empty_results(seed: int) -> None:
    """A batch of 0 rows (e.g. the last, empty chunk of a data loader) is not an error."""
    compiled = compile64(random_circuit(seed, 3, 2))
    variables = compiled.num_variables
    x = torch.zeros(0, variables, dtype=torch.long)
    nothing = torch.zeros(variables, dtype=torch.bool)
    none = compiled.internal_parameters(0)
    assert compiled.log_likelihood(x).shape == (0,)
    assert compiled.log_likelihood(x, params=none).shape == (0,)
    assert compiled.log_marginal(x, nothing).shape == (0,)
    assert compiled.log_partition(none).shape == (0,)
    assert compiled.log_conditional(x, nothing, [0]).shape == (0, 1, 2)
    assert compiled.log_prefix_marginals(x).shape == (0, 3)
    assert compiled.log_prefix_conditionals(x).shape == (0, 3, 2)
    assert compiled.map_state(x, nothing)[0].shape == (0, variables)
    assert compiled.map_state(params=none)[1].shape == (0,)
    assert compiled.conditional_sample(x, nothing).shape == (0, variables)
    assert compiled.sample(params=none).shape == (0, variables)
