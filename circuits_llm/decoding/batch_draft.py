"""The draft side of a batch round in one pass: every drafting row's head forward, conditioned
bottom-up pass, top-down draw and prefix conditionals together, each row's draft and ``q``
exactly what :meth:`~circuits_llm.decoding.round.RoundProgram.draft` gives it alone.

Why it is exact per row. The pass is the single-row draft program run on ``B`` rows with one
parameter set per row (the circuit's passes keep rows apart: set ``b`` serves row ``b``, and the
prefix conditionals give each row's ``n - 1`` prefixes its own set):

* evidence: row ``b`` observes ``X_0 = c_b``'s draft index, or leaves it unobserved when ``c_b``
  is outside a compressed draft vocabulary (its stand-in is drawn with its drafts), per row;
* randomness: the top-down pass asks for uniforms of shapes ``(F, B, ...)`` (the batch on axis
  1) in a fixed order; :class:`RowTapes` hands row ``b`` the next values of *its own* tape, in
  the order the single-row pass reads them (``(F, 1, ...)`` from the same offsets). So each row
  draws from its round's uniforms (:meth:`RoundProgram.draw_uniforms`, drawn per row from its
  generator, in row order as before) what it draws alone;
* greedy: the max-product completion is row-wise;
* the draft's ``q`` is computed in the same pass as the draft it scores, so the acceptance test
  sees the law the draft was drawn from (the proof of docs/decoder-exactness.md needs nothing
  else); the validity flags (``head_ok``, ``possible``) are per row;
* the context copy and a dynamic draft length are row-wise functions of the pass's outputs
  (:func:`~circuits_llm.decoding.lookup.overlay`, ``mixed_conditionals``,
  :meth:`~circuits_llm.decoding.draft_length.DraftLength.decide`), applied to each row's slice:
  the head forward and the circuit passes stay batched for them too.

Up to float rounding, batched and single-row matrix products agree (the tests compare tokens on
float64 models; a rounding-level difference could flip a tie, never the law). The pass runs eager
(the compiled draft program is single-row).

On a CPU a batch drafts in passes of at most :func:`rows_per_pass` rows (all of them for small
heads; two for a head of SmolLM2's size, whose 2 MB of outputs a row would otherwise leave the
caches: :data:`CPU_PASS_BYTES`). Rows are independent, so how they are grouped changes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from circuits.compiled.layers import Semiring
from circuits.compiled.prepared import Trace
from circuits.compiled.sampling import argmax_chooser, descend
from circuits.kernels import GumbelChooser
from circuits_llm.decoding.lookup import mixed_conditionals, overlay
from circuits_llm.decoding.round import RoundProgram
from circuits_llm.decoding.round_data import DraftResult

__all__ = ["CPU_PASS_BYTES", "RowTapes", "draft_in_passes", "draft_rows", "rows_per_pass"]

#: on a CPU, about the most bytes of raw head outputs one draft pass should make. Past the
#: caches every elementwise pass over them (normalisation, checks, the prefix conditionals' input
#: tables) runs at memory speed, and one big pass loses to several small ones. Measured on the
#: 2-core machine with SmolLM2's head size (BTree, window 8, rank 16, LEAN, 4,096-token draft
#: vocabulary: 2.1 MB a row), 16 rows: 2 rows a pass 73 ms, 1 row 83, 3 or 4 rows 114, all 16 in
#: one pass 130; with the embedded model's vocabulary (0.14 MB a row) one pass of 16 rows is 5x
#: faster than row by row. On other devices there is no limit.
CPU_PASS_BYTES = 6 * 2 ** 20


class RowTapes(GumbelChooser):
    """A Gumbel-max chooser reading each row's uniforms from that row's own pre-drawn tape.

    Args:
        tapes: (B, T) float64, row ``b``'s tape (:meth:`RoundProgram.draw_uniforms`).

    A request of shape ``(F, B, *rest)`` returns row ``b``'s next ``F * prod(rest)`` values as
    ``[:, b]``, laid out as the single-row request ``(F, 1, *rest)`` reads them.
    """

    def __init__(self, tapes: Tensor) -> None:
        super().__init__(None)
        self.tapes = tapes
        self.used = 0

    def uniforms(self, shape: tuple[int, ...], device: torch.device) -> Tensor:
        batch = self.tapes.shape[0]
        if len(shape) < 2 or shape[1] != batch:
            raise ValueError(f"a batched top-down pass asks for uniforms of shape (F, {batch}, "
                             f"...), got {shape}")
        count = math.prod(shape) // batch
        start, self.used = self.used, self.used + count
        values = self.tapes[:, start:start + count].reshape(batch, shape[0], *shape[2:])
        return values.movedim(0, 1)


def _usable_rows(raw: dict[str, Tensor], batch: int) -> Tensor:
    """(B,) bool: row ``b``'s raw head outputs hold no NaN and no ``+inf`` and each of their
    last-dimension rows has mass (a tensor with batch 1, or without a batch axis of ``B``, is
    shared by every row: it is checked whole). One pass over the outputs: a last-dimension row's
    maximum is finite exactly when the row has none of those faults (``amax`` keeps a NaN)."""
    ok = torch.ones(batch, dtype=torch.bool, device=next(iter(raw.values())).device)
    for value in raw.values():
        if value.dim() < 2 or value.shape[0] not in (1, batch):
            value = value.reshape(1, *value.shape) if value.dim() else value.reshape(1, 1)
        ok = ok & torch.isfinite(value.amax(-1)).reshape(value.shape[0], -1).all(-1)
    return ok


def _evidence(program: RoundProgram, c: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (B, n) with ``X_0`` = each ``c_b``'s draft index and the observed mask (B, n):
    ``X_0`` only, and only where ``c_b`` is in the draft vocabulary (the single-row rule)."""
    n = program.window
    index = c if program.position is None else program.position[c]
    x = torch.zeros(c.shape[0], n, dtype=torch.long, device=c.device)
    x[:, 0] = index.clamp(min=0)
    first = torch.arange(n, device=c.device)[None, :] == 0
    return x, first & (index >= 0)[:, None]


def rows_per_pass(program: RoundProgram) -> int | None:
    """The most rows one :func:`draft_rows` pass should take: on a CPU, as many as
    :data:`CPU_PASS_BYTES` of raw head outputs hold (at least one); elsewhere ``None`` (all)."""
    circuit = program.circuit
    if circuit.device.type != "cpu":
        return None
    per_row = sum(math.prod(shape) for shape in circuit.parameter_shapes().values())
    size = torch.empty((), dtype=circuit.dtype).element_size()
    return max(1, CPU_PASS_BYTES // max(1, per_row * size))


def draft_rows(program: RoundProgram, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
               components: list[Tensor] | None = None) -> list[DraftResult]:
    """Every row's draft of one round, in one pass (see the module docstring).

    Args:
        program: the configuration's round program (its head, circuit, draft vocabulary, draft
            length rule and copy lookup).
        hidden: (B, d) each row's draft hidden state.
        c: (B,) long each row's verified token (model ids).
        uniforms: (B, T) float64 each row's round uniforms (``None`` when greedy).
        components: each row's copy component (n+1,) float64, exactly when ``program.lookup``.

    Returns:
        One :class:`~circuits_llm.decoding.round_data.DraftResult` per row, equal to
        ``program.draft(hidden[b:b+1], c[b:b+1], uniforms[b], components[b])``: ``block`` (1, n),
        ``q`` (n-1, K) or ``None`` (greedy with a rule that reads no ``q``), the flags and ``L``.
    """
    if (components is None) != (program.lookup is None):
        raise ValueError("pass copy components exactly when the program has a ContextLookup")
    batch = hidden.shape[0]
    circuit, rule = program.circuit, program.draft_length
    with torch.no_grad():
        raw = program.head_parameters(hidden, c)
        head_ok = _usable_rows(raw, batch)
        prepared = circuit.resolve_params(raw, None, check=False)
        x, observed = _evidence(program, c)
        trace = Trace()
        semiring = Semiring.MAX if uniforms is None else Semiring.SUM
        value = circuit.evaluate(x, observed, prepared, semiring=semiring, trace=trace)
        chooser = argmax_chooser if uniforms is None else RowTapes(uniforms)
        state = descend(circuit, trace, x, observed, chooser)  # (B, n)
        drafted = state[:, 1:]
        cuts: list[Tensor | None] = [None] * batch
        if components is not None:
            rows = []
            for b, component in enumerate(components):
                choose = None if uniforms is None else uniforms[b, program.tape_length]
                row, cuts[b] = overlay(drafted[b], component, choose)
                rows.append(row)
            drafted = torch.stack(rows)
            state = torch.cat([state[:, :1], drafted], 1)
        tokens = drafted if program.draft_tokens is None else program.draft_tokens[drafted]
        block = torch.cat([c[:, None], tokens], 1)  # (B, n)
        possible = torch.isfinite(value)
        q: Tensor | None = None
        if uniforms is not None or rule.needs_conditionals:
            q = program._conditionals(prepared, state)  # (B, n-1, K): set b serves row b
            if components is not None:
                q = torch.stack([mixed_conditionals(q[b], drafted[b], components[b])
                                 for b in range(batch)])
            q = torch.where(possible[:, None, None] & torch.isfinite(q).all(-1, keepdim=True),
                            q, 0.0)
        results = []
        for b in range(batch):
            length = rule.decide(None if q is None else q[b], drafted[b])
            cut = cuts[b]
            results.append(DraftResult(
                block[b, 1:], block[b:b + 1], None if uniforms is None else q[b],  # type: ignore[index]
                head_ok[b], possible[b], length if cut is None else torch.minimum(length, cut)))
    return results


def draft_in_passes(program: RoundProgram, hidden: Tensor, c: Tensor, uniforms: Tensor | None,
                    components: list[Tensor] | None = None) -> list[DraftResult]:
    """:func:`draft_rows` over every row, in passes of at most :func:`rows_per_pass` rows (on a
    CPU a pass then keeps a big head's outputs within the caches); the same arguments and
    results."""
    step = rows_per_pass(program) or len(hidden)
    drafts: list[DraftResult] = []
    for start in range(0, len(hidden), step):
        part = slice(start, start + step)
        drafts += draft_rows(program, hidden[part], c[part],
                             None if uniforms is None else uniforms[part],
                             None if components is None else components[part])
    return drafts
