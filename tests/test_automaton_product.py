"""AutomatonProduct: exact conditionals and draws of a circuit times a DFA, against enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from torch import Tensor

from circuits.automata import REJECT, Automaton
from circuits.compiled import (
    CompiledCircuit,
    LogParameters,
    automaton_classes,
    automaton_lifting,
    automaton_matrices,
    compile,
)
from circuits.compiled.automaton_draw import RightContext
from circuits.compiled.automaton_product import AutomatonProduct
from circuits.compiled.folding import FoldKind
from circuits.errors import InvalidInputError, StructureError
from circuits.operations import multiply, snapshot
from circuits.parameterizations import Exp
from circuits.symbolic import (
    Categorical,
    Circuit,
    InputLayer,
    Layer,
    ProductKind,
    ProductLayer,
    SumLayer,
)
from circuits.templates import build

ARCHITECTURES = ("ff", "cp", "hmm", "btree", "kronecker")
TOLERANCE = 1e-10


def kronecker_chain(num_variables: int, rank: int, num_categories: int) -> Circuit:
    """A right-leaning tree of Kronecker products whose inputs are listed right to left."""
    def region(lo: int) -> Layer:
        leaf = InputLayer(lo, rank, Categorical(num_categories))
        if lo == num_variables - 1:
            return leaf
        product = ProductLayer([region(lo + 1), leaf], ProductKind.KRONECKER)
        return SumLayer([product], rank)

    return Circuit(SumLayer([region(0)], 1))


def make_circuit(name: str, num_variables: int, rank: int, num_categories: int,
                 seed: int) -> CompiledCircuit:
    if name == "kronecker":
        symbolic = kronecker_chain(num_variables, rank, num_categories)
    else:
        symbolic = build(name, num_variables, num_categories, 1 if name == "ff" else rank)
    compiled = compile(symbolic, dtype=torch.float64, seed=seed)
    with torch.no_grad():  # sharper than the default initialisation: conditionals far from uniform
        for parameter in compiled.parameters():
            parameter.mul_(2.0)
    return compiled


def random_automaton(states: int, categories: int, seed: int, reject: float = 0.3) -> Automaton:
    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(0, states, (states, categories), generator=generator)
    table[torch.rand(states, categories, generator=generator) < reject] = REJECT
    start = int(torch.randint(0, states, (1,), generator=generator))
    return Automaton(table, start)


def enumerate_product(compiled: CompiledCircuit, automaton: Automaton, consume_from: int,
                      params: LogParameters | None = None) -> tuple[Tensor, Tensor]:
    """All ``K^n`` assignments (rows) and the product's unnormalised law on them."""
    n, size = compiled.num_variables, compiled.category_sizes[0]
    xs = torch.tensor(list(itertools.product(range(size), repeat=n)), dtype=torch.long)
    expanded = None if params is None else params.expand(xs.shape[0])
    with torch.no_grad():
        law = compiled.log_likelihood(xs, params=expanded).exp()
    state = torch.full((xs.shape[0],), automaton.start, dtype=torch.long)
    alive = torch.ones(xs.shape[0], dtype=torch.bool)
    for v in range(consume_from, n):
        state = automaton.next_state[state.clamp(min=0), xs[:, v]]
        alive &= state != REJECT
    return xs, torch.where(alive, law, 0.0)


def enumerated_conditional(xs: Tensor, law: Tensor, values: Tensor, observed: Tensor,
                           query: int, size: int) -> Tensor:
    keep = ((xs == values) | ~observed).all(1)
    scores = torch.stack([law[keep & (xs[:, query] == x)].sum() for x in range(size)])
    total = scores.sum()
    return scores / total if total > 0 else torch.zeros_like(scores)


def sequential_reference(xs: Tensor, law: Tensor, prefix: list[int], size: int,
                         uniforms: Tensor | None) -> tuple[list[int], list[Tensor]]:
    """Draw the rest of the sequence from the enumerated conditionals (argmax or inverse CDF)."""
    n = xs.shape[1]
    values, rows = list(prefix), []
    for v in range(len(prefix), n):
        observed = torch.arange(n) < v
        known = torch.tensor(values + [0] * (n - v))
        row = enumerated_conditional(xs, law, known, observed, v, size)
        if not row.sum() > 0:
            break
        rows.append(row)
        if uniforms is None:
            values.append(int(row.argmax()))
        else:
            x = int((torch.cumsum(row, 0) <= float(uniforms[v - len(prefix)])).sum())
            values.append(min(x, int((row > 0).nonzero()[-1])))
    return values, rows


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    name = draw(st.sampled_from(ARCHITECTURES))
    n = draw(st.integers(2, 5))
    size = draw(st.integers(2, 4 if n <= 4 else 3))
    return {
        "compiled": make_circuit(name, n, draw(st.integers(1, 3)), size, draw(st.integers(0, 99))),
        "automaton": random_automaton(draw(st.integers(1, 4)), size, draw(st.integers(0, 10**6)),
                                      draw(st.sampled_from([0.0, 0.3, 0.5]))),
        "consume_from": draw(st.integers(0, n)),
        "seed": draw(st.integers(0, 10**6)),
    }


@settings(deadline=None, max_examples=30)
@given(cases())
def test_conditional_matches_enumeration(case: dict[str, object]) -> None:
    compiled, automaton = case["compiled"], case["automaton"]
    assert isinstance(compiled, CompiledCircuit) and isinstance(automaton, Automaton)
    consume_from, seed = int(case["consume_from"]), int(case["seed"])  # type: ignore[call-overload]
    n, size = compiled.num_variables, compiled.category_sizes[0]
    product = AutomatonProduct(compiled)
    xs, law = enumerate_product(compiled, automaton, consume_from)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(3):
        values = torch.randint(0, size, (n,), generator=generator)
        observed = torch.rand(n, generator=generator) < 0.5
        query = int(torch.randint(0, n, (1,), generator=generator))
        observed[query] = False
        expected = enumerated_conditional(xs, law, values, observed, query, size)
        got = product.conditional(None, automaton, values, observed, query, consume_from)
        assert got.dtype == torch.float64 and got.shape == (size,)
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)


@settings(deadline=None, max_examples=30)
@given(cases(), st.booleans())
def test_draw_matches_sequential_enumeration(case: dict[str, object], sampled: bool) -> None:
    compiled, automaton = case["compiled"], case["automaton"]
    assert isinstance(compiled, CompiledCircuit) and isinstance(automaton, Automaton)
    consume_from, seed = int(case["consume_from"]), int(case["seed"])  # type: ignore[call-overload]
    n, size = compiled.num_variables, compiled.category_sizes[0]
    product = AutomatonProduct(compiled)
    xs, law = enumerate_product(compiled, automaton, consume_from)
    generator = torch.Generator().manual_seed(seed)
    m = int(torch.randint(0, n + 1, (1,), generator=generator))
    prefix = xs[int(torch.multinomial(law + 1e-3, 1, generator=generator))][:m]
    uniforms = torch.rand(n - m, generator=generator, dtype=torch.float64) if sampled else None
    result = product.draw(None, automaton, prefix, consume_from, uniforms=uniforms)
    values, rows = sequential_reference(xs, law, prefix.tolist(), size, uniforms)
    assert result.length == len(rows) == len(values) - m
    assert result.values[:len(values)].tolist() == values
    assert result.values[len(values):].eq(0).all()
    assert result.conditionals.shape == (n - m, size)
    for k, row in enumerate(rows):
        torch.testing.assert_close(result.conditionals[k], row, rtol=0, atol=TOLERANCE)
    assert result.conditionals[len(rows):].eq(0).all()
    assert result.size == product.size(automaton, consume_from) >= 0


def test_external_parameters() -> None:
    compiled = make_circuit("btree", 4, 2, 3, seed=3)
    generator = torch.Generator().manual_seed(5)
    raw = {name: torch.randn((1, *shape), generator=generator, dtype=torch.float64) * 2
           for name, shape in compiled.parameter_shapes().items()}
    prepared = compiled.log_parameters(raw)
    automaton = random_automaton(3, 3, seed=11)
    product = AutomatonProduct(compiled)
    xs, law = enumerate_product(compiled, automaton, 1, prepared)
    values = torch.tensor([2, 0, 0, 1])
    observed = torch.tensor([True, False, False, True])
    expected = enumerated_conditional(xs, law, values, observed, 2, 3)
    for params in (prepared, raw):
        got = product.conditional(params, automaton, values, observed, 2, consume_from=1)
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)
    result = product.draw(prepared, automaton, torch.tensor([2]), consume_from=1)
    expected_values, _ = sequential_reference(xs, law, [2], 3, None)
    assert result.values.tolist()[:len(expected_values)] == expected_values


def test_choose_may_stop_the_draw() -> None:
    """``choose`` returning None stops the draw there: the values before it are the ones drawn,
    and that variable's conditional is written (a caller's own law may leave the circuit's
    categories there); a category without mass is refused."""
    compiled = make_circuit("btree", 4, 2, 3, seed=1)
    product = AutomatonProduct(compiled)
    automaton = random_automaton(3, 3, seed=4)
    full = product.draw(None, automaton, torch.tensor([1]), consume_from=1)
    seen: list[Tensor] = []

    def stop_at_second(conditional: Tensor) -> int | None:
        seen.append(conditional.clone())
        return None if len(seen) == 2 else int(conditional.argmax())

    stopped = product.draw(None, automaton, torch.tensor([1]), consume_from=1,
                           choose=stop_at_second)
    assert full.length == 3 and stopped.length == 1 and len(seen) == 2
    assert stopped.values.tolist() == [*full.values[:2].tolist(), 0, 0]
    torch.testing.assert_close(stopped.conditionals[:2], full.conditionals[:2], rtol=0, atol=0)
    assert stopped.conditionals[2:].eq(0).all()
    assert full.conditionals[0, 2] == 0  # this automaton forbids category 2 there
    with pytest.raises(InvalidInputError, match="not a category with positive probability"):
        product.draw(None, automaton, torch.tensor([1]), consume_from=1,
                     choose=lambda conditional: 2)


def test_zero_mass_stops_the_draw() -> None:
    compiled = make_circuit("hmm", 4, 2, 3, seed=0)
    product = AutomatonProduct(compiled)
    # state 0 allows every category once (to state 1); state 1 allows nothing
    once = Automaton(torch.tensor([[1, 1, 1], [REJECT, REJECT, REJECT]]))
    result = product.draw(None, once, torch.tensor([2]), consume_from=0)
    assert result.length == 0 and result.conditionals.eq(0).all()
    assert result.values.tolist() == [2, 0, 0, 0]
    # reading variables 1..3 needs three moves: no sequence has mass, so nothing is drawn
    result = product.draw(None, once, torch.tensor([2]), consume_from=1, uniforms=torch.zeros(3))
    assert result.length == 0 and result.conditionals.eq(0).all()
    # reading only variable 3 is possible; a positive prefix never meets a massless conditional
    result = product.draw(None, once, torch.tensor([2]), consume_from=3, uniforms=torch.zeros(3))
    assert result.length == 3
    torch.testing.assert_close(result.conditionals.sum(1), torch.ones(3, dtype=torch.float64))
    # a prefix the automaton rejects, and a conditional of impossible evidence
    never = Automaton(torch.tensor([[REJECT, 0, 0]]))
    assert product.draw(None, never, torch.tensor([0]), consume_from=0).length == 0
    zero = product.conditional(None, never, torch.tensor([0, 0, 0, 0]),
                               torch.tensor([True, False, False, False]), 1)
    assert zero.eq(0).all()


def test_refuses_non_interval_vtrees() -> None:
    x0, x1, x2 = (InputLayer(v, 2, Categorical(3)) for v in range(3))
    gapped = ProductLayer([x0, x2])  # scope {0, 2}: not an interval
    circuit = Circuit(SumLayer([ProductLayer([gapped, x1])], 1))
    with pytest.raises(StructureError, match=r"not a contiguous interval.*btree"):
        AutomatonProduct(compile(circuit, dtype=torch.float64))


def test_rejects_bad_automata_and_inputs() -> None:
    with pytest.raises(InvalidInputError, match="neither a state"):
        Automaton(torch.tensor([[0, 2]]))
    with pytest.raises(InvalidInputError, match="start"):
        Automaton(torch.tensor([[0, 0]]), start=1)
    with pytest.raises(InvalidInputError, match="integer tensor"):
        Automaton(torch.zeros(2, 2))
    automaton = Automaton(torch.tensor([[0, 1], [REJECT, 0]]))
    assert automaton.accepts_path([0, 1, 1]) and not automaton.accepts_path(torch.tensor([1, 0]))
    assert [r.tolist() for r in automaton.reachable(2)] == [[0], [0, 1], [0, 1]]
    product = AutomatonProduct(make_circuit("cp", 3, 2, 3, seed=0))
    with pytest.raises(InvalidInputError, match="categories"):
        product.conditional(None, automaton, torch.zeros(3, dtype=torch.long),
                            torch.zeros(3, dtype=torch.bool), 0)


def locally_masked_draw(xs: Tensor, head: Tensor, automaton: Automaton, uniforms: Tensor) -> int:
    """Naive constrained decoding: each variable from the head's conditional with the categories
    the automaton rejects *now* masked out (it ignores the future, so its law is not the
    product's). Returns the row of ``xs`` drawn."""
    n, size = xs.shape[1], automaton.num_categories
    values: list[int] = []
    state = automaton.start
    for v in range(n):
        observed = torch.arange(n) < v
        row = enumerated_conditional(xs, head, torch.tensor(values + [0] * (n - v)), observed, v, size)
        row = torch.where(automaton.next_state[state] != REJECT, row, 0.0)
        row = row / row.sum()
        x = int((torch.cumsum(row, 0) <= float(uniforms[v])).sum())
        values.append(min(x, int((row > 0).nonzero()[-1])))
        state = automaton.step(state, values[-1])
    return int(((xs == torch.tensor(values)).all(1)).nonzero())


def test_draws_follow_the_product_law() -> None:
    """Many inverse-CDF draws against the enumerated law (G-test); a negative control (the head
    masked by the automaton one step at a time, which ignores the future) is refuted."""
    compiled = make_circuit("btree", 3, 2, 3, seed=7)
    automaton = Automaton(torch.tensor([[1, 0, REJECT], [0, REJECT, 1]]))
    product = AutomatonProduct(compiled)
    xs, law = enumerate_product(compiled, automaton, 0)
    _, head = enumerate_product(compiled, Automaton(torch.zeros(1, 3, dtype=torch.long)), 0)
    generator = torch.Generator().manual_seed(0)
    draws = 3000
    tape = torch.rand(draws, 3, generator=generator, dtype=torch.float64)
    index = {tuple(x): k for k, x in enumerate(xs.tolist())}
    counts = torch.zeros(xs.shape[0])
    control = torch.zeros(xs.shape[0])
    for uniforms in tape:
        values = product.draw(None, automaton, torch.zeros(0, dtype=torch.long),
                              uniforms=uniforms).values
        counts[index[tuple(values.tolist())]] += 1
        control[locally_masked_draw(xs, head, automaton, uniforms)] += 1
    support = law > 0
    assert counts[~support].sum() == 0 and control[~support].sum() == 0
    expected = ((law / law.sum())[support] * draws).numpy()
    test = stats.power_divergence(counts[support].numpy(), expected, lambda_="log-likelihood")
    assert test.pvalue > 1e-3
    refuted = stats.power_divergence(control[support].numpy(), expected, lambda_="log-likelihood")
    assert refuted.pvalue < 1e-6


# ---------------------------------------------------------------------------------- multiply
def constraint_circuit(head: Circuit, automaton: Automaton, consume_from: int) -> Circuit:
    """The DFA as a circuit along ``head``'s vtree: the unit ``(a, b)`` of the interval
    ``[i, j)`` is 1 when the run goes from state ``a`` before ``i`` to ``b`` after ``j - 1``."""
    size = automaton.num_categories
    table = automaton.next_state.tolist()
    made: dict[Layer, tuple[Layer, list[tuple[int, int]]]] = {}
    for layer in head.layers:
        if isinstance(layer, InputLayer):
            v = layer.variable
            states = automaton.reachable(max(0, v - consume_from))[-1].tolist()
            if v < consume_from:
                pairs = [(a, a) for a in states]
                raw = torch.zeros(len(pairs), size, dtype=torch.float64)
            else:
                pairs = sorted({(a, table[a][x]) for a in states for x in range(size)
                                if table[a][x] != REJECT})
                raw = torch.tensor([[0.0 if table[a][x] == b else -math.inf for x in range(size)]
                                    for a, b in pairs], dtype=torch.float64)
            made[layer] = (InputLayer(v, len(pairs), Categorical(size), Exp(), initial=raw), pairs)
        elif isinstance(layer, SumLayer):
            made[layer] = made[layer.inputs[0]]
        else:
            assert isinstance(layer, ProductLayer)
            children = [made[child] for child in layer.inputs]
            order = sorted(range(len(children)), key=lambda k: min(layer.inputs[k].scope))
            units = list(itertools.product(*[range(len(pairs)) for _, pairs in children]))
            ends: dict[tuple[int, int], list[int]] = {}
            for unit, digits in enumerate(units):
                chain = [children[k][1][digits[k]] for k in order]
                if all(chain[t][1] == chain[t + 1][0] for t in range(len(chain) - 1)):
                    ends.setdefault((chain[0][0], chain[-1][1]), []).append(unit)
            pairs = sorted(ends)
            weights = torch.full((len(pairs), len(units)), -math.inf, dtype=torch.float64)
            for row, pair in enumerate(pairs):
                weights[row, ends[pair]] = 0.0
            kron = ProductLayer([c for c, _ in children], ProductKind.KRONECKER)
            made[layer] = (SumLayer([kron], len(pairs), Exp(), initial=weights), pairs)
    top, pairs = made[head.output]
    return Circuit(SumLayer([top], 1, Exp(), initial=torch.zeros(1, len(pairs), dtype=torch.float64)))


@settings(deadline=None, max_examples=15)
@given(cases())
def test_matches_multiply_with_the_automaton_circuit(case: dict[str, object]) -> None:
    """``circuits.multiply(snapshot(head), automaton circuit)`` gives the same conditionals."""
    compiled, automaton = case["compiled"], case["automaton"]
    assert isinstance(compiled, CompiledCircuit) and isinstance(automaton, Automaton)
    consume_from, seed = int(case["consume_from"]), int(case["seed"])  # type: ignore[call-overload]
    n, size = compiled.num_variables, compiled.category_sizes[0]
    _, law = enumerate_product(compiled, automaton, consume_from)
    if not law.sum() > 0:
        return  # the automaton circuit would hold a sum without mass
    constraint = constraint_circuit(compiled.circuit, automaton, consume_from)
    multiplied = compile(multiply(snapshot(compiled), constraint), dtype=torch.float64)
    product = AutomatonProduct(compiled)
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, size, (n,), generator=generator)
    observed = torch.rand(n, generator=generator) < 0.4
    query = int(torch.randint(0, n, (1,), generator=generator))
    observed[query] = False
    got = product.conditional(None, automaton, values, observed, query, consume_from)
    if got.sum() == 0:
        return  # impossible evidence: the compiled query answers NaN
    with torch.no_grad():
        expected = multiplied.log_conditional(values[None], observed, [query])[0, 0].exp()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)


# ---------------------------------------------------------------------------- category classes
def json_like_automaton(categories: int, seed: int) -> Automaton:
    """'String' states allow every category but a few (most stay, one or two 'quote' categories
    move on); 'structure' states allow one or two categories. Most categories share one class."""
    generator = torch.Generator().manual_seed(seed)
    states = 5
    table = torch.full((states, categories), REJECT, dtype=torch.long)
    for s in range(states):
        if s % 2 == 0:
            table[s] = s
            table[s, 0] = (s + 1) % states
            table[s, 1] = REJECT
        else:
            allowed = torch.randperm(categories, generator=generator)[:2]
            table[s, allowed] = torch.randint(0, states, (2,), generator=generator)
    return Automaton(table, 0)


def test_category_classes_match_brute_force() -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        states = int(torch.randint(1, 30, (1,), generator=generator))
        size = int(torch.randint(1, 40, (1,), generator=generator))
        kinds = int(torch.randint(1, 6, (1,), generator=generator))
        distinct = torch.randint(-1, states, (states, kinds), generator=generator)
        rows = distinct[:, torch.randint(0, distinct.shape[1], (size,), generator=generator)]
        classes, count = automaton_lifting.category_classes(rows, states)
        columns = [tuple(rows[:, x].tolist()) for x in range(size)]
        assert count == len(set(columns)), trial
        assert sorted(set(classes.tolist())) == list(range(count))
        for x in range(size):
            for y in range(size):
                assert (classes[x] == classes[y]) == (columns[x] == columns[y])


def test_category_classes_pack_many_rows() -> None:
    """Many rows and states: the packed labels are renumbered between batches, still exact."""
    generator = torch.Generator().manual_seed(1)
    distinct = torch.randint(-1, 300, (300, 7), generator=generator)
    pick = torch.randint(0, 7, (500,), generator=generator)
    classes, count = automaton_lifting.category_classes(distinct[:, pick], 300)
    assert count == len(set(pick.tolist()))
    assert torch.equal(classes[:, None] == classes[None], pick[:, None] == pick[None])


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_classes_and_restarts_match_enumeration(name: str, dense: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A JSON-like automaton (few category classes) restarted in every state, in any order: the
    conditionals and draws match enumeration (the liftings are cached per start state), with
    sparse and with dense transition matrices."""
    monkeypatch.setattr(automaton_lifting, "DENSE_TRANSITIONS_FILL", 0.0 if dense else 2.0)
    compiled = make_circuit(name, 4, 2, 5, seed=2)
    base = json_like_automaton(5, seed=3)
    product = AutomatonProduct(compiled)
    generator = torch.Generator().manual_seed(4)
    for start in (0, 1, 2, 0, 3, 4, 2):
        automaton = base.restart(start)
        lifting = product._lifting(automaton, 1)
        assert lifting.num_classes < 5 and lifting.widths[-1] == 1
        assert all(move is None or move.matrix.is_sparse_csr != dense for move in lifting.moves)
        xs, law = enumerate_product(compiled, automaton, 1)
        values = torch.randint(0, 5, (4,), generator=generator)
        observed = torch.tensor([True, False, True, False])
        for query in (1, 3):
            expected = enumerated_conditional(xs, law, values, observed, query, 5)
            got = product.conditional(None, automaton, values, observed, query, consume_from=1)
            torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)
        uniforms = torch.rand(3, generator=generator, dtype=torch.float64)
        result = product.draw(None, automaton, xs[int(law.argmax())][:1], 1, uniforms=uniforms)
        reference, rows = sequential_reference(xs, law, xs[int(law.argmax())][:1].tolist(), 5,
                                               uniforms)
        assert result.values[:len(reference)].tolist() == reference
        for k, row in enumerate(rows):
            torch.testing.assert_close(result.conditionals[k], row, rtol=0, atol=TOLERANCE)


def test_lifting_cache_is_keyed_by_table_and_start() -> None:
    product = AutomatonProduct(make_circuit("btree", 3, 2, 4, seed=0))
    automaton = json_like_automaton(4, seed=5)
    first = product._lifting(automaton, 1)
    assert product._lifting(automaton.restart(0), 1) is first  # same table and start
    assert product._lifting(automaton.restart(2), 1) is not first
    assert product._lifting(automaton, 0) is not first
    copy = Automaton(automaton.next_state.clone(), 0)
    assert product._lifting(copy, 1) is not first  # another table


def test_column_classes_match_packed_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hashed classes (over all entries, or over the allowed ones only) are the packed
    labels' partition; colliding hashes (all weights 1: columns with one sum collide) fall back
    to the packed labels."""
    generator = torch.Generator().manual_seed(7)
    def on_host(rows: Tensor, states: int) -> tuple[Tensor, int]:
        classes, count = automaton_classes.host_column_classes(rows.numpy(), states)
        return torch.from_numpy(classes), count

    for weight_bound in (automaton_classes._HASH_WEIGHT, 2):
        monkeypatch.setattr(automaton_classes, "_HASH_WEIGHT", weight_bound)
        monkeypatch.setattr(automaton_classes, "_WEIGHTS", {})
        for trial in range(10):
            states = int(torch.randint(2, 30, (1,), generator=generator))
            distinct = torch.randint(-1, states, (states, 6), generator=generator)
            rows = distinct[:, torch.randint(0, 6, (50,), generator=generator)]
            expected, expected_count = automaton_lifting.category_classes(rows, states)
            for method in (automaton_classes.column_classes,
                           automaton_classes.sparse_column_classes, on_host):
                classes, count = method(rows, states)
                assert count == expected_count, trial
                assert torch.equal(classes[:, None] == classes[None],
                                   expected[:, None] == expected[None])


def test_reachable_sets_match_the_automaton() -> None:
    """The breadth-first search over the table index's successor lists is
    :meth:`Automaton.reachable`."""
    for seed in range(5):
        automaton = random_automaton(6, 5, seed, reject=0.5)
        index = automaton_lifting.TableIndex.build(automaton, torch.device("cpu"))
        for start in range(automaton.num_states):
            found = automaton_lifting._reachable(index.offsets, index.targets, start, 4)
            expected = automaton.restart(start).reachable(4)
            assert [f.tolist() for f in found] == [e.tolist() for e in expected]


def test_lifted_inputs_apply_as_their_dense_matrices() -> None:
    """A sparse lifted input applied to shared and per-block vectors (with a unit map) equals its
    dense matrices applied the same way, and its dense matrices are ``T @ P``'s."""
    compiled = make_circuit("btree", 4, 3, 5, seed=1)
    product = AutomatonProduct(compiled)
    automaton = random_automaton(5, 5, seed=2, reject=0.3)
    lifting = product._lifting(automaton, 0)
    linear = automaton_matrices.linear_parameters(product.structure, None)
    nodes = product.structure.nodes
    ids = [i for i, node in enumerate(nodes) if node.kind is FoldKind.INPUT]
    lifted = automaton_matrices.lifted_inputs(product.structure, ids, linear, lifting)
    generator = torch.Generator().manual_seed(3)
    for i in ids:
        node, probs = nodes[i], linear[i]
        assert probs is not None
        dense = lifted[i].dense()
        moves = lifting.moves[node.lo]
        assert moves is not None
        expected = torch.zeros_like(dense)  # M[u, a, b] = sum_x p_u(x) [next(a, x) = b]
        local = moves.local_next()
        for a in range(local.shape[0]):
            for x in range(local.shape[1]):
                if int(local[a, x]) < dense.shape[2]:
                    expected[:, a, int(local[a, x])] += probs[:, x]
        torch.testing.assert_close(dense, expected, rtol=0, atol=1e-15)
        right = torch.rand(dense.shape[2], 3, dtype=torch.float64, generator=generator)
        torch.testing.assert_close(lifted[i].apply_shared(right),
                                   torch.einsum("uab,bk->uak", dense, right))
        index = torch.tensor([2, 0, 0, 1])
        blocks = torch.rand(4, dense.shape[2], 2, dtype=torch.float64, generator=generator)
        torch.testing.assert_close(lifted[i].apply_mapped(blocks, index),
                                   torch.bmm(dense[index], blocks))
        torch.testing.assert_close(lifted[i].apply_mapped(blocks[:3], None),
                                   torch.bmm(dense, blocks[:3]))


@pytest.mark.parametrize("few", [0.0, 1.0])
@pytest.mark.parametrize("order", ["pushed", "materialised", "estimated"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_draw_is_exact_in_every_evaluation_order(name: str, order: str, few: float,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sums applied to per-unit vectors through their inputs, materialised, or as the flop
    estimate picks, and the scores computed on every category or on the allowed ones only: the
    same exact conditionals and draws (eight variables, a deep tree)."""
    monkeypatch.setattr(automaton_lifting, "FEW_ALLOWED", few)
    if order != "estimated":
        cost = 0.0 if order == "pushed" else math.inf
        monkeypatch.setattr(RightContext, "_push_cost", lambda self, i, k, blocks: cost)
    compiled = make_circuit(name, 8 if name != "kronecker" else 6, 2, 2, seed=4)
    automaton = random_automaton(5, 2, seed=6, reject=0.2)
    product = AutomatonProduct(compiled)
    xs, law = enumerate_product(compiled, automaton, 1)
    generator = torch.Generator().manual_seed(8)
    for m in (1, 2, 3):
        prefix = xs[int(torch.multinomial(law, 1, generator=generator))][:m]
        uniforms = torch.rand(xs.shape[1] - m, generator=generator, dtype=torch.float64)
        result = product.draw(None, automaton, prefix, 1, uniforms=uniforms)
        values, rows = sequential_reference(xs, law, prefix.tolist(), 2, uniforms)
        assert result.values[:len(values)].tolist() == values and result.length == len(rows)
        for k, row in enumerate(rows):
            torch.testing.assert_close(result.conditionals[k], row, rtol=0, atol=TOLERANCE)
