#!/usr/bin/env bash
# The recipe of a draft block for SmolLM2-135M-Instruct (issue 44, item 4): FastMTP's recursive MTP
# block (one decoder layer of the model's shape over W[rms(h_t); rms(E[x_{t+1}])], its own KV
# cache, the model's final norm and LM head over the 8,192 most frequent tokens), trained with
# `circuits-llm train-head --draft-block` on cached prefill features of stdlib text towards the
# model's own law (--target-law model: the cross-entropy to its 16 most likely tokens at T = 1),
# 3 recursive depths (window 4), depth a weighted 0.6^(a-1), depths >= 2 reading the block's own
# outputs as when it drafts. The run exports RUN_DIR/block (save_draft_block: block_config.json +
# block.safetensors, the block's own weights only); `circuits-llm ship` stores it in float16 in
# heads_shipped/ (the command is printed at the end). Decode with it:
#   SpeculativeDecoder(model, BlockDrafter(load_trained_block(RUN_DIR, model)))
#
#   scripts/train_draft_block.sh [RUN_ROOT]      (default: runs/draft-block)
#
# Environment: PY (python3), DEVICE (cpu; `cuda` on a GPU), THREADS (torch threads, 2), MODEL
# (smollm2: the demo's GGUF; or any --model reference), TOKENS (training tokens, i.e. prefill
# positions of the feature cache: 524,288 = 4,096 windows of 128), STEPS (1,500), BATCH_SIZE (8),
# LR (5e-4), LAYERS (1), INIT (identity | last_layer), WINDOW (4: the verified token's position and
# 3 recursive depths), INIT_FROM (a saved
# block directory to continue from, e.g. circuits_llm/heads_shipped/smollm2-block), MINUTES (a time cap on the whole run,
# feature prefill included: 90 on the CPU; unset on a GPU), DATA (corpus | self-distilled: the model's
# own continuations of corpus prompts at DISTILL_TEMPERATURE, default 1.0, TOKENS / 128 rows of 32
# prompt + 96 generated tokens, DISTILL_BATCH rows generated together, 16 on the CPU and 256 on a
# GPU), FUSED_LAYERS (e.g. 2,14,26: the block also reads those layers' outputs, EAGLE-3's fused
# features; with INIT_FROM a block without them continues exactly where it stood; FUSION_LR: the
# fusion's learning rate, default 10x LR). At T = 1 a
# decoder drafts on the model's own samples, where the corpus-trained block accepts
# less (journal section 19: 0.49-0.53 against 0.59 for the first draft); self-distilled data trains it
# on that text.
#
# Budget on the 2-core CPU of the project's machine (2 threads; estimates, not yet measured on
# SmolLM2): the prefill of the 0.5M positions at 2-5 ms a position is 20-40 minutes (once: the
# features are cached, float16, 4,096 x 128 x 576 x 2 bytes = 604 MB, in
# $CIRCUITS_LLM_FEATURE_CACHE, default features/ in the corpus cache, and shared by every rerun);
# a step (8 windows, 1,008 block rows per depth, K = 8,192) took 1.2-1.4 s on one thread with
# random weights of SmolLM2's shape, so the 1,500 steps (1.5M rows, 3 passes over the data) take
# 30-50 minutes. MINUTES=90 stops the run there in any case (it is exported as it stands; run the
# script again to continue from the checkpoint). A 30-step probe on SmolLM2's real features (16
# windows, batch 4, 1 thread, under 1 s a step) took the validation loss from 14.0 to 7.4 bits at
# LR 1e-3 and to 7.5 at 1e-4; 1e-3 first rose (the identity start is fragile to Adam's first,
# sign-sized steps), hence 5e-4.
# On a GPU (DEVICE=cuda) the defaults are 20x the data (10.5M positions, 12 GB of features), a
# batch of 64 windows and 6,000 steps (48M rows, about 4.6 passes). Measured on an H200 (journal
# section 12): with WINDOW=6, continuing the shipped block (INIT_FROM) on 2.1M positions, a step of
# 64 windows took 46.5 ms: 4,491 steps (36.8M rows) in 209 s, the whole run with the model's load,
# the tokenization and the feature prefill in under 5 minutes; that run is the shipped block.
# Every step resumes where it stopped (train-head checkpoints, the feature cache is resumable), so
# the script can be interrupted and run again with the same settings.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
ROOT=${1:-runs/draft-block}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-2}
MODEL=${MODEL:-smollm2}
if [ "${DEVICE%%:*}" = cuda ]; then
  TOKENS=${TOKENS:-10485760}; BATCH_SIZE=${BATCH_SIZE:-64}; STEPS=${STEPS:-6000}
else
  MINUTES=${MINUTES-90}
fi
TOKENS=${TOKENS:-524288}
BATCH_SIZE=${BATCH_SIZE:-8}
STEPS=${STEPS:-1500}
DATA=${DATA:-corpus}
case "$DATA" in
  corpus) SOURCE=(--data corpus --max-train-bytes "$TOKENS") ;;
  self-distilled)
    if [ "${DEVICE%%:*}" = cuda ]; then DISTILL_BATCH=${DISTILL_BATCH:-256}; fi
    SOURCE=(--self-distill --distill-samples "$((TOKENS / 128))" --distill-prompt-len 32
            --distill-temperature "${DISTILL_TEMPERATURE:-1.0}"
            --distill-batch "${DISTILL_BATCH:-16}") ;;
  *) echo "DATA must be corpus or self-distilled, got '$DATA'" >&2; exit 2 ;;
esac
LIMIT=()
FROM=()
FUSED=()
if [ -n "${INIT_FROM:-}" ]; then FROM=(--init-from "$INIT_FROM"); fi
if [ -n "${FUSED_LAYERS:-}" ]; then FUSED=(--fused-layers "$FUSED_LAYERS"); fi
if [ -n "${FUSION_LR:-}" ]; then FUSED+=(--fusion-lr "$FUSION_LR"); fi
if [ -n "${MINUTES:-}" ]; then LIMIT=(--minutes "$MINUTES"); fi
RUN="$ROOT/smollm2-block${RUN_SUFFIX:-}"
mkdir -p "$RUN"

echo "== train-head --draft-block ($TOKENS positions, $STEPS steps of $BATCH_SIZE) in $RUN"
"$PY" -m circuits_llm train-head --model "$MODEL" --run-dir "$RUN" --draft-block \
  --window "${WINDOW:-4}" --gamma 0.6 --block-layers "${LAYERS:-1}" --block-init "${INIT:-identity}" \
  --draft-vocab 8192 --target-law model --teacher-top-k 16 --teacher-temperature 1.0 \
  "${SOURCE[@]}" --cache-features --seq-len 128 \
  --batch-size "$BATCH_SIZE" --lr "${LR:-5e-4}" --steps "$STEPS" --seed 0 \
  --eval-every 250 --eval-windows 64 --device "$DEVICE" --threads "$THREADS" --no-progress \
  "${LIMIT[@]}" "${FROM[@]}" "${FUSED[@]}"

echo "float16 and shipped (at most 20 MB, verified on load): circuits-llm ship "$RUN" --name smollm2-block --model "$MODEL""
