"""The exact product of a compiled circuit with a deterministic finite automaton (DFA).

Let ``c(x_0, ..., x_{n-1})`` be a smooth, decomposable circuit over categorical variables and
``A`` a DFA (:class:`~circuits.automata.Automaton`) over their categories that reads the variables
``consume_from .. n-1`` in order (earlier variables are not read: the DFA stays where it is). The
product ``q(x) = c(x) [A accepts x_{consume_from..n-1}]`` is the circuit's law restricted to the
sequences the automaton allows; this module computes its conditionals and draws from it exactly,
without building it.

The lifted semantics. Give every unit ``u`` of a layer whose scope is the interval ``[i, j)``
the matrix ``M_u[a, b] = sum_{x_i..x_{j-1}} u(x_i..x_{j-1}) [A goes from a to b on them]``
(``a``: the state before variable ``i``, ``b``: the state after variable ``j - 1``). Then

* an input unit of variable ``v`` with probabilities ``p_u``: ``M_u[a, b] = sum_x p_u(x)
  [next(a, x) = b]`` (observed ``v = x``: only that ``x``; a variable that is not read: the
  identity times ``sum_x p_u(x)``, or ``p_u(x)`` when observed);
* a sum unit ``sum_i w_i u_i``: ``sum_i w_i M_{u_i}`` (sums are linear);
* a product unit of children over the intervals ``I_1, ..., I_m`` that tile ``[i, j)`` from left
  to right: ``M_{c_1} @ ... @ M_{c_m}``, because a run of the DFA over ``[i, j)`` is a run over
  ``I_1`` followed by one over ``I_2``..., joined at the states between them, and the assignment
  splits the same way (decomposability). A Kronecker unit multiplies the child units its index
  names (first input most significant, as the compiled layers order them).

By induction every ``M_u`` is exact, and the product's mass is ``Z = sum_b M_root[start, b]``.
This is the product of a structured-decomposable circuit with the DFA written as a circuit along
the same vtree (unit ``(a, b)`` of the interval ``[i, j)`` = "the run goes from ``a`` to ``b``"),
contracted as it is built. It needs every layer's scope to be an interval of the variable order
and every product's children to tile it; linear/HMM, CP, fully factorised and balanced-tree
circuits over contiguous intervals have that shape, others are refused with a
:class:`~circuits.errors.StructureError`.

Only reachable states matter: the matrices of ``[i, j)`` are stored as ``(units, |R_i|, |R_j|)``
where ``R_t`` are the states reachable from ``start`` after the variables before ``t``
(:meth:`Automaton.reachable <circuits.automata.Automaton.reachable>`), except that the states
after the last variable are merged into one (only ``sum_b`` of them is ever needed, so the layers
ending with the last variable keep vectors); :meth:`AutomatonProduct.size` is the number of
entries. The input matrices of unobserved variables are sparse: their values at the state pairs
some category connects are one sparse product ``T (E, C) @ P (C, units)`` with the 0/1 pair-by-class
matrix ``T`` over the ``C`` category classes (categories that move every reachable state alike)
and the class sums ``P`` of the probabilities. Everything is float64 in linear space: the entries
are probabilities of at most ``n`` variables' assignments, so windows of a few tens of variables
do not underflow.

Layout: :mod:`~circuits.compiled.automaton_structure` checks the interval structure,
:mod:`~circuits.compiled.automaton_classes` finds category classes,
:mod:`~circuits.compiled.automaton_lifting` holds the automaton side (state sets, classes,
transitions; cached per table, start state and first read variable),
:mod:`~circuits.compiled.automaton_matrices` the lifted matrices,
:mod:`~circuits.compiled.automaton_draw` the sequential draw, and this module the conditionals
and the entry points.

Conditionals. ``Z`` is linear in the matrices of the input units of any one variable ``v`` (each
term of a decomposable circuit holds exactly one of them), so ``q(x_v = x, evidence) = sum_u
sum_a dZ/dM_u[a, next(a, x)] p_u(x)``; :meth:`AutomatonProduct.conditional` gets ``dZ/dM`` with
one top-down pass along the layers that contain ``v``. :meth:`AutomatonProduct.draw` draws
``x_m, ..., x_{n-1}`` one after the other from these conditionals given all earlier values; there
the states before each drawn variable are known, so every top-down quantity is one row of a matrix
(a vector over exit states), the layers left of the drawn variable are plain circuit values, and
the layers right of it are applied to those rows right to left, never multiplied out into
``|R|^3`` matrix products unless that is cheaper (:mod:`~circuits.compiled.automaton_draw`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits.automata import Automaton
from circuits.compiled.automaton_draw import SequentialDraw
from circuits.compiled.automaton_lifting import Lifting, LiftingCache, Transitions
from circuits.compiled.automaton_matrices import lifted_matrices, linear_parameters
from circuits.compiled.automaton_structure import SUPPORTED_SHAPES, ProductStructure
from circuits.compiled.circuit import CompiledCircuit
from circuits.compiled.folding import FoldKind
from circuits.compiled.prepared import ParamsLike
from circuits.errors import InvalidInputError


@dataclass(frozen=True)
class ProductDraw:
    """A sequential draw from the product (see :meth:`AutomatonProduct.draw`).

    Attributes:
        values: (n,) long: the prefix, then the drawn values (0 after ``length``).
        conditionals: (n - m, K) float64: row ``k`` is the exact conditional the ``k``-th drawn
            variable was drawn from; rows from ``length`` on are zero.
        length: how many variables were drawn before one whose conditional has no mass (the
            product gives the evidence probability 0); ``n - m`` when all were drawn.
        size: the lifted product's size (:meth:`AutomatonProduct.size`).
    """

    values: Tensor
    conditionals: Tensor
    length: int
    size: int


class AutomatonProduct:
    """The product of a compiled circuit with DFAs over its variables (module docstring).

    Built once per compiled circuit: it checks the structure and caches the layers' intervals
    (:class:`~circuits.compiled.automaton_structure.ProductStructure`) and, per automaton table,
    start state and first read variable, the automaton's side of the product
    (:class:`~circuits.compiled.automaton_lifting.LiftingCache`). Every variable must be
    Categorical with one number of categories ``K`` (the automaton's).

    Raises:
        StructureError: a layer's scope is not an interval of variables, a product's children do
            not tile it, an input is not Categorical or is integrated, or the circuit does not
            cover ``0 .. n-1``.
    """

    def __init__(self, circuit: CompiledCircuit) -> None:
        self.structure = ProductStructure(circuit)
        self.circuit = circuit
        self.num_variables = self.structure.num_variables
        self.num_categories = self.structure.num_categories
        self._liftings = LiftingCache(self.num_variables, self.num_categories, circuit.device)

    def _lifting(self, automaton: Automaton, consume_from: int) -> Lifting:
        return self._liftings.get(automaton, consume_from)

    def prepare(self, automaton: Automaton) -> None:
        """Build now what every start state of ``automaton``'s table shares (its category
        classes and successor lists, :class:`~circuits.compiled.automaton_lifting.TableIndex`),
        which the first :meth:`draw` or :meth:`conditional` would build otherwise."""
        self._liftings.index(automaton)

    def size(self, automaton: Automaton, consume_from: int = 0) -> int:
        """The lifted product's size: ``sum`` over layers of ``units * |R_lo| * |R_hi|``
        (``|R_n| = 1``: the exit states are merged)."""
        return self._size(self._lifting(automaton, consume_from))

    def _size(self, lifting: Lifting) -> int:
        return sum(node.units * lifting.width(node.lo) * lifting.width(node.hi)
                   for node in self.structure.nodes)

    # ------------------------------------------------------------------ conditional
    def conditional(self, params: ParamsLike | None, automaton: Automaton, values: Tensor,
                    observed: Tensor, query: int, consume_from: int = 0) -> Tensor:
        """The product's exact conditional of variable ``query`` given the observed values.

        Args:
            params: one parameter set of the circuit: :class:`LogParameters` (batch 1 or the
                module's own), a raw external mapping with batch 1, or None (the module's own).
            automaton: over the circuit's ``K`` categories.
            values: (n,) long: read where ``observed``.
            observed: (n,) bool; ``observed[query]`` is ignored.
            query: the variable.
            consume_from: variables before it are not read by the automaton.

        Returns:
            (K,) float64, summing to 1; all zeros when the evidence has no mass under the product.
        """
        lifting = self._lifting(automaton, consume_from)
        values, observed = self._check_evidence(values, observed)
        n, structure = self.num_variables, self.structure
        if isinstance(query, bool) or not isinstance(query, int) or not 0 <= query < n:
            raise InvalidInputError(f"query must be a variable in 0..{n - 1}, got {query!r}")
        with torch.no_grad():
            linear = linear_parameters(structure, params)
            path = structure.containing[query]
            skip = set(path)
            mats = lifted_matrices(structure, [i for i in range(len(structure.nodes))
                                               if i not in skip], linear, lifting, values, observed)
            grads = {structure.root: torch.ones(1, 1, lifting.width(n), dtype=torch.float64,
                                                device=values.device)}
            score = torch.zeros(self.num_categories, dtype=torch.float64, device=values.device)
            for i in path:
                grad = grads.pop(i, None)
                if grad is None:
                    continue
                node = structure.nodes[i]
                if node.kind is FoldKind.INPUT:
                    score += _input_score(linear[i], grad, lifting.moves[query])
                elif node.kind is FoldKind.SUM:
                    weights = linear[i]
                    assert weights is not None
                    for child, offset in zip(node.children, node.offsets, strict=True):
                        width = structure.nodes[child].units
                        part = weights[:, offset:offset + width].T @ grad.flatten(1)
                        _add(grads, child, part.view(width, *grad.shape[1:]))
                else:
                    t = structure.path_child[(i, query)]
                    for right in reversed(range(t + 1, len(node.children))):
                        grad = torch.bmm(grad, structure.gathered(node, right, mats).transpose(1, 2))
                    for left in range(t):
                        grad = torch.bmm(structure.gathered(node, left, mats).transpose(1, 2), grad)
                    _add(grads, node.children[t], structure.to_child(node, t, grad))
            return _normalised(score)

    def _check_evidence(self, values: Tensor, observed: Tensor) -> tuple[Tensor, Tensor]:
        n = self.num_variables
        if not isinstance(values, Tensor) or values.dtype != torch.long or \
                tuple(values.shape) != (n,):
            raise InvalidInputError(f"values must be a long tensor of shape ({n},)")
        if not isinstance(observed, Tensor) or observed.dtype != torch.bool or \
                tuple(observed.shape) != (n,):
            raise InvalidInputError(f"observed must be a bool tensor of shape ({n},)")
        device = self.circuit.device
        values, observed = values.to(device), observed.to(device)
        bad = observed & ((values < 0) | (values >= self.num_categories))
        if bool(bad.any()):
            v = int(bad.nonzero()[0])
            raise InvalidInputError(f"values[{v}] = {int(values[v])} is not a category "
                                    f"(0..{self.num_categories - 1})")
        return values, observed

    # ------------------------------------------------------------------ sequential draw
    def draw(self, params: ParamsLike | None, automaton: Automaton, prefix: Tensor,
             consume_from: int = 0, *, uniforms: Tensor | None = None,
             choose: Callable[[Tensor], int | None] | None = None) -> ProductDraw:
        """Draw variables ``m .. n-1`` one by one from the product's exact conditionals.

        Variables ``0 .. m-1`` are the observed ``prefix`` (read by the automaton from
        ``consume_from`` on, like the drawn ones); variable ``v >= m`` is drawn from its
        conditional given all earlier values: the argmax (greedy, the default), the inverse-CDF
        draw at ``uniforms[v - m]`` (the first category whose cumulative probability exceeds
        it), or ``choose(conditional)``. Drawing stops at a conditional with no mass, or where
        ``choose`` returns None (that variable's conditional is still written to
        ``conditionals``).

        Args:
            params: one parameter set (as in :meth:`conditional`).
            automaton: over the circuit's ``K`` categories.
            prefix: (m,) long, ``m <= n``.
            consume_from: variables before it are not read by the automaton.
            uniforms: (n - m,) float64 in [0, 1), or None.
            choose: a rule ``(K,) float64 conditional -> category`` with positive probability,
                or None to stop drawing there (a caller whose own law leaves the circuit's
                categories at that variable).

        Returns:
            :class:`ProductDraw`.
        """
        lifting = self._lifting(automaton, consume_from)
        n, size = self.num_variables, self.num_categories
        device = self.circuit.device
        if not isinstance(prefix, Tensor) or prefix.dtype != torch.long or prefix.dim() != 1 \
                or prefix.shape[0] > n:
            raise InvalidInputError(f"prefix must be a 1-D long tensor of at most {n} values")
        m = int(prefix.shape[0])
        values = torch.zeros(n, dtype=torch.long, device=device)
        values[:m] = prefix.to(device)
        observed = torch.arange(n, device=device) < m
        values, _ = self._check_evidence(values, observed)
        if uniforms is not None and choose is not None:
            raise InvalidInputError("give uniforms or choose, not both")
        if uniforms is not None and (not isinstance(uniforms, Tensor) or uniforms.dim() != 1
                                     or uniforms.shape[0] != n - m):
            raise InvalidInputError(f"uniforms must be a 1-D tensor of {n - m} values in [0, 1)")
        tape = None if uniforms is None else uniforms.tolist()
        conditionals = torch.zeros(n - m, size, dtype=torch.float64, device=device)
        with torch.no_grad():
            linear = linear_parameters(self.structure, params)
            sequence = SequentialDraw(self.structure, linear, lifting, prefix.tolist())
            length = sequence.run(conditionals, lambda conditional, k: pick_category(
                conditional, None if tape is None else tape[k], choose))
        values[m:m + length] = torch.tensor(sequence.drawn[m:m + length], dtype=torch.long,
                                            device=device)
        return ProductDraw(values, conditionals, length, self._size(lifting))


def pick_category(conditional: Tensor, uniform: float | None,
                  choose: Callable[[Tensor], int | None] | None) -> int | None:
    """The drawn category of a (K,) ``conditional``: ``choose(conditional)`` (None: stop the
    draw), the argmax, or the inverse CDF at ``uniform`` (the first category whose cumulative
    probability exceeds it)."""
    if choose is not None:
        x = choose(conditional)
        if x is None:
            return None
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < conditional.shape[0] \
                or not float(conditional[x]) > 0:
            raise InvalidInputError(f"choose returned {x!r}, not a category with positive "
                                    "probability under the conditional")
        return x
    if uniform is None:
        return int(conditional.argmax())
    if not 0.0 <= uniform < 1.0:
        raise InvalidInputError(f"uniforms must lie in [0, 1), got {uniform}")
    # the number of cdf entries <= u (the cdf of non-negative terms never decreases)
    x = int(torch.searchsorted(torch.cumsum(conditional, 0), uniform, right=True))
    if x < conditional.shape[0]:
        return x  # cdf[x - 1] <= u < cdf[x], so conditional[x] > 0
    return int((conditional > 0).nonzero()[-1])  # u above a rounded-down total


def _add(into: dict[int, Tensor], key: int, value: Tensor) -> None:
    into[key] = into[key] + value if key in into else value


def _input_score(probs: Tensor | None, grad: Tensor, moves: Transitions | None) -> Tensor:
    """``sum_{u, a} grad[u, a, next(a, x)] p_u(x)`` for every ``x``: (K,); ``probs`` (units, K)."""
    assert probs is not None
    if moves is None:
        return grad.diagonal(dim1=1, dim2=2).sum(-1) @ probs
    units, rows = grad.shape[:2]
    padded = torch.cat([grad, grad.new_zeros(units, rows, 1)], 2)
    local_next = moves.local_next()
    index = local_next[None].expand(units, *local_next.shape)
    return (padded.gather(2, index).sum(1) * probs).sum(0)


def _normalised(score: Tensor) -> Tensor:
    total = score.sum()
    return score / total if float(total) > 0 else torch.zeros_like(score)


__all__ = ["SUPPORTED_SHAPES", "AutomatonProduct", "ProductDraw", "pick_category"]
