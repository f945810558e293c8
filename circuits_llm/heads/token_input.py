"""The token the verifier just decided, read by the head: ``e_t`` and ``c`` -> a context ``e'_t``.

A round drafts ``d_1 .. d_{n-1}`` after ``c``, the token the verifier has just emitted; the head
reads the hidden state ``e_t`` of the position before ``c``. Without this module the head learns
about ``c`` only through its circuit: conditioning ``X_0 = c`` reweighs the circuit's latent
units (a rank-``r`` bottleneck; none at all for an FF head, whose positions are independent).
EAGLE, Hydra and FastMTP feed the drafted-after token to the draft model itself; so does this
module, before any circuit parameter is computed:

    e'_t = e_t + W_out silu(W_h rms(e_t) + W_c rms(E[c]) + b),

``E`` being the model's input embedding (frozen, only the rows of the head's categories kept),
``rms`` a parameter-free RMS normalisation (the two inputs live at different scales). ``W_out``
starts at zero, so a head starts exactly where it would without the token (a trained head can
be extended and fine-tuned). Every map from ``e'_t`` to circuit parameters is unchanged.

Exactness does not depend on it: ``c`` is known when the round drafts, so the draft law is still
a function of draft-side quantities only (docs/decoder-exactness.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn

from circuits.errors import InvalidInputError
from circuits_llm.heads.config import HeadConfigError


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TokenInput(nn.Module):
    """``(e_t (B, d), category of c (B,) long) -> e'_t (B, d)`` (see the module docstring).

    Args:
        embedding: (C, d_e) the input-embedding rows of the head's ``C`` categories (the whole
            vocabulary, or the draft vocabulary's rows), kept as a frozen buffer.
        hidden_size: ``d``.
        width: the inner width ``m`` of the mixing map.
        generator, dtype: the initialisation's generator and the parameters' dtype.

    Parameters: ``hidden_map`` (m, d), ``token_map`` (m, d_e), ``bias`` (m,) drawn
    ``N(0, 1/fan_in)`` / zero; ``out`` (d, m) zero. Trainable count ``m (d + d_e + 1) + d m``.
    """

    def __init__(self, embedding: Tensor, hidden_size: int, width: int,
                 generator: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        embed = embedding.shape[1]
        self.hidden_size = hidden_size
        self.width = width
        self.register_buffer("embedding", embedding.detach().to(dtype).clone())

        def draw(*shape: int) -> Tensor:
            scale = 1.0 / math.sqrt(shape[-1])
            return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

        self.hidden_map = nn.Parameter(draw(width, hidden_size))
        self.token_map = nn.Parameter(draw(width, embed))
        self.bias = nn.Parameter(torch.zeros(width, dtype=dtype))
        self.out = nn.Parameter(torch.zeros(hidden_size, width, dtype=dtype))

    @property
    def categories(self) -> int:
        """``C``: the categories the module has an embedding row for."""
        return int(self.embedding.shape[0])

    @property
    def embedding_size(self) -> int:
        """``d_e``: the size of an embedding row."""
        return int(self.embedding.shape[1])

    def forward(self, hidden: Tensor, token: Tensor) -> Tensor:
        """``hidden`` (B, d), ``token`` (B,) long categories in ``[0, C)`` -> (B, d).

        A category of -1 marks a token the head has no row for (outside a compressed draft
        vocabulary): that row is returned unchanged, the head's context without the token
        (fixed shapes, no host read)."""
        known = token >= 0
        mixed = nnf.linear(_rms(hidden), self.hidden_map, self.bias) \
            + nnf.linear(_rms(self.embedding[token.clamp(min=0)]), self.token_map)
        update = nnf.linear(nnf.silu(mixed), self.out)
        return hidden + torch.where(known[:, None], update, torch.zeros_like(update))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def check_token_options(embedding: object, width: object, vocab_size: int) -> None:
    """Refuse, in one :class:`~circuits_llm.heads.HeadConfigError`, a token embedding that is not
    a float ``(vocab_size, d_e)`` tensor or a width that is not None or an int >= 1."""
    if embedding is not None and (
            not isinstance(embedding, Tensor) or not embedding.is_floating_point()
            or embedding.dim() != 2 or embedding.shape[0] != vocab_size):
        got = tuple(embedding.shape) if isinstance(embedding, Tensor) else type(embedding).__name__
        raise HeadConfigError(
            f"token_embedding must be a float tensor of shape (vocab_size, embedding size) = "
            f"({vocab_size}, d_e), e.g. model.get_input_embeddings().weight; got {got}")
    if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
        raise HeadConfigError(f"token_width must be None or an int >= 1, got {width!r}")


def mix_token(module: TokenInput | None, hidden: Tensor, token: Tensor | None) -> Tensor:
    """``hidden`` (B, d) as a head's maps read it: mixed with ``token`` (B,) long by ``module``
    when the head reads the token, else unchanged. A missing, misshapen or unexpected ``token``
    is one :class:`~circuits.errors.InvalidInputError`."""
    if module is None:
        if token is not None:
            raise InvalidInputError("this head reads the hidden state only (reads_token is "
                                    "False); call it without a token")
        return hidden
    if not isinstance(token, Tensor) or token.dtype != torch.long \
            or tuple(token.shape) != (hidden.shape[0],):
        got = tuple(token.shape) if isinstance(token, Tensor) else type(token).__name__
        raise InvalidInputError(
            f"this head reads the verified token: pass token, a long tensor of shape "
            f"({hidden.shape[0]},) holding X_0's category (a draft-vocabulary index with a "
            f"compressed vocabulary), got {got}")
    return module(hidden, token.to(hidden.device))
