"""How big a head is, and the default size that keeps it a small fraction of its backbone.

Speculative decoding pays when the draft is much cheaper than the backbone. By default a head
has at most :data:`DEFAULT_HEAD_BUDGET` (5%) of the backbone's parameters: :func:`fit_head_size`
picks the rank and the draft vocabulary ``K`` (the most frequent tokens,
:mod:`circuits_llm.heads.vocab`) that are left to it, from fixed ladders in a fixed order of
preference:

* ranks :data:`RANK_LADDER` (32, 16, 8, 4, 2, 1; ``ff`` has rank 1), largest first;
* for each rank, draft vocabularies :data:`DRAFT_VOCAB_LADDER` (8192 then 4096) when the model's
  vocabulary is larger than 8192, else the whole vocabulary (small vocabularies are never
  compressed by default).

The first (rank, K) whose head fits the budget is chosen; when none does, the smallest. A size
the caller fixed (an explicit rank or ``K``) is kept whatever it costs: the caller is told, with
the numbers, by :class:`HeadBudgetWarning` (see :meth:`HeadSize.over_budget_message`).

Counts come from the symbolic circuit (input units ``N`` and sum weights ``S`` do not depend on the
number of categories) and :func:`~circuits_llm.heads.head.parameter_count`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from circuits.symbolic import Circuit, InputLayer, SumLayer
from circuits_llm.heads.config import HeadConfigError, HeadVariant
from circuits_llm.heads.head import parameter_count
from circuits_llm.heads.kinds import head_kind

__all__ = ["DEFAULT_HEAD_BUDGET", "DRAFT_VOCAB_LADDER", "RANK_LADDER", "HeadBudgetWarning",
           "HeadSize", "circuit_sizes", "fit_head_size", "kind_parameters"]

#: the default fraction of the backbone's parameters a head may have
DEFAULT_HEAD_BUDGET = 0.05
#: ranks tried by default, in order of preference
RANK_LADDER = (32, 16, 8, 4, 2, 1)
#: draft vocabulary sizes tried by default (for vocabularies larger than the first), in order
DRAFT_VOCAB_LADDER = (8192, 4096)


class HeadBudgetWarning(UserWarning):
    """A head has more parameters than its budget (an explicit choice, or a tiny backbone)."""


def circuit_sizes(circuit: Circuit) -> tuple[int, int]:
    """``(N, S)``: input units and sum weights of a head over ``circuit`` (what
    ``MTPHead.input_units`` and ``MTPHead.sum_weights`` will be)."""
    units = sum(layer.num_units for layer in circuit.layers if isinstance(layer, InputLayer))
    weights = sum(layer.num_units * sum(child.num_units for child in layer.inputs)
                  for layer in circuit.layers if isinstance(layer, SumLayer))
    return units, weights


def kind_parameters(kind: str, window: int, rank: int, hidden_size: int, categories: int,
                    variant: HeadVariant, lean_rank: int = 8, input_bias: bool = True) -> int:
    """Trainable parameters of ``MTPHead.from_name(kind, window, rank, ...)`` with ``categories``
    per variable (the vocabulary or the draft vocabulary ``K``), without building it."""
    units, weights = circuit_sizes(head_kind(kind).circuit(window, rank, 2))
    return parameter_count(variant, units, weights, hidden_size, categories, input_bias, lean_rank)


@dataclass(frozen=True)
class HeadSize:
    """The size chosen for a head.

    Attributes:
        rank: the kind's rank (None for a circuit given whole).
        draft_vocab: ``K`` of the compressed draft vocabulary, or None (the whole vocabulary).
        parameters: the head's trainable parameters.
        budget: the most parameters the budget allows (``fraction x backbone``).
        backbone_parameters: the backbone's parameters.
        fraction: the budget as a fraction of the backbone.
        automatic: the sizes chosen here (``"rank"``, ``"draft_vocab"``).
        fixed: the sizes the caller fixed, e.g. ``("rank=32", "draft_vocab=8192")``, or
            ``("circuit",)`` for a circuit given whole.
    """

    rank: int | None
    draft_vocab: int | None
    parameters: int
    budget: int
    backbone_parameters: int
    fraction: float
    automatic: tuple[str, ...]
    fixed: tuple[str, ...] = ()

    @property
    def within_budget(self) -> bool:
        return self.parameters <= self.budget

    def over_budget_message(self, what: str) -> str:
        """Why ``what`` (a description of the head) is over its budget, with the numbers."""
        why = (f"explicitly chosen: {', '.join(self.fixed)}" if self.fixed else
               "even the smallest default size is over it (a very small backbone)")
        return (f"{what} has {self.parameters:,} trainable parameters, more than "
                f"{self.fraction:.0%} of the backbone's {self.backbone_parameters:,} "
                f"({self.budget:,}); {why}. Lower the rank, the window or --draft-vocab to stay "
                "within the budget")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "automatic": list(self.automatic), "fixed": list(self.fixed),
                "within_budget": self.within_budget}


def _check(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HeadConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def fit_head_size(kind: str | None, window: int, hidden_size: int, vocab_size: int,
                  variant: HeadVariant, backbone_parameters: int, *, rank: int | None = None,
                  draft_vocab: int | None = None, lean_rank: int = 8, input_bias: bool = True,
                  fraction: float = DEFAULT_HEAD_BUDGET,
                  circuit: Circuit | None = None, token_embedding_size: int | None = None
                  ) -> HeadSize:
    """The rank and draft vocabulary of a head within ``fraction`` of its backbone (see the
    module docstring).

    Args:
        kind: a registered head kind (``ff``, ``cp``, ``hmm``, ``btree``...), or None with
            ``circuit`` (a circuit given whole: only ``K`` is chosen; its rank is None).
        window: ``n``.
        hidden_size, vocab_size: the backbone's ``d`` and ``V``.
        variant: FULL or LEAN.
        backbone_parameters: the backbone's parameter count.
        rank: fixed rank, or None to choose it (``ff``: always 1).
        draft_vocab: fixed ``K`` (``>= V``: the whole vocabulary), or None to choose it (a
            circuit given whole has its own ``K``: pass its categories).
        lean_rank, input_bias: as in :class:`~circuits_llm.heads.MTPHead`.
        fraction: the budget, a fraction of ``backbone_parameters`` in ``(0, 1]``.
        circuit: the head's circuit when ``kind`` is None.
        token_embedding_size: ``d_e`` of the input embedding when the head reads the verified
            token (a :class:`~circuits_llm.heads.token_input.TokenInput` of width ``d``: its
            ``d (2 d + d_e + 1)`` parameters count against the budget); None: it does not.

    Raises:
        HeadConfigError: bad sizes.
    """
    _check("window", window, 2)
    _check("hidden_size", hidden_size, 1)
    _check("vocab_size", vocab_size, 1)
    _check("backbone_parameters", backbone_parameters, 1)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise HeadConfigError(f"the head budget must be a fraction in (0, 1], got {fraction!r}")
    automatic: list[str] = []
    fixed: list[str] = []
    if kind is None:
        if circuit is None:
            raise HeadConfigError("fit_head_size needs a head kind or a circuit")
        sizes = circuit_sizes(circuit)
        ranks: tuple[int | None, ...] = (None,)
        fixed.append("circuit")
    else:
        sizes = None
        if rank is not None:
            ranks = (_check("rank", rank, 1),)
            fixed.append(f"rank={rank}")
        elif head_kind(kind).name == "ff":
            ranks = (1,)
        else:
            ranks, automatic = RANK_LADDER, ["rank"]
    if draft_vocab is not None:
        ks: tuple[int | None, ...] = (None if _check("draft_vocab", draft_vocab, 1) >= vocab_size
                                      else draft_vocab,)
        if kind is not None or draft_vocab < vocab_size:
            fixed.append(f"draft_vocab={draft_vocab}")
    elif vocab_size > DRAFT_VOCAB_LADDER[0]:
        ks, automatic = DRAFT_VOCAB_LADDER, [*automatic, "draft_vocab"]
    else:
        ks, automatic = (None,), [*automatic, "draft_vocab"]
    budget = int(fraction * backbone_parameters)
    candidates = []
    for r in ranks:
        units, weights = sizes if sizes is not None else \
            circuit_sizes(head_kind(kind).circuit(window, r, 2))  # type: ignore[arg-type]
        for k in ks:
            count = parameter_count(variant, units, weights, hidden_size,
                                    vocab_size if k is None else k, input_bias, lean_rank,
                                    0 if token_embedding_size is None else hidden_size,
                                    token_embedding_size or 0)
            candidates.append(HeadSize(r, k, count, budget, backbone_parameters, float(fraction),
                                       tuple(automatic), tuple(fixed)))
    fitting = [c for c in candidates if c.within_budget]
    return fitting[0] if fitting else min(candidates, key=lambda c: c.parameters)
