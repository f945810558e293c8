"""``circuits-llm train-head`` under torchrun (2 CPU processes, gloo) against a 1-process run.

Every rank draws the same global batch and trains on its half; DDP averages the gradients. The
loss is a mean over equally weighted sequences, so a data-parallel step is the single-process step
on the whole global batch up to the order of floating-point sums. Bit-for-bit equality is not
achievable, and float-tolerance equality of the parameters is not guaranteed in general: Adam
divides each gradient coordinate by its own running magnitude, so coordinates whose gradient is
close to zero (e.g. FULL-head unembedding rows of tokens absent from the batch, or sum weights
of heads whose units start identical) turn summation-order noise of ~1e-9 into steps of up to
``learning_rate``. The test therefore checks:

* the replicas hold bitwise identical parameters after every step (the run records the largest
  difference from rank 0 at every validation; ``eval_every=1``);
* on a well-conditioned configuration (LEAN head + LoRA), the parameters, the validation NLL per
  window position and the training losses equal those of a single-process run with the same
  global batch to float tolerance (a wrong data shard would differ by ~``learning_rate``);
* the validation loss falls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from test_training import make_corpus, tiny_llama

from circuits_llm.runtime.checkpoint import load_checkpoint
from circuits_llm.training import (
    CHECKPOINT_FILE,
    HeadTrainingConfig,
    load_trained_head,
    read_record,
    train_head,
)

ARGS = {"--arch": "btree", "--window": "4", "--rank": "3", "--variant": "lean",
        "--lora-layers": "1", "--lora-rank": "4", "--seq-len": "24", "--batch-size": "4",
        "--lr": "0.01", "--steps": "5", "--eval-every": "1", "--eval-windows": "3", "--seed": "2"}
CONFIG = HeadTrainingConfig(architecture="btree", window=4, rank=3, variant="lean", lora_layers=1,
                            lora_rank=4, seq_len=24, batch_size=4, learning_rate=0.01, steps=5,
                            eval_every=1, eval_windows=3, seed=2)


def test_torchrun_two_processes_match_a_single_process_run(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "circuits_llm", "train-head", "--model", str(model_dir),
               "--run-dir", str(tmp_path / "ddp"), "--corpus-root", str(corpus), "--no-progress",
               "--threads", "1", *(item for pair in ARGS.items() for item in pair)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = read_record(tmp_path / "ddp")
    assert record["world_size"] == 2 and record["finished"] and record["step"] == 5
    assert HeadTrainingConfig.from_dict(record["config"]) == CONFIG
    assert [h["step"] for h in record["history"]] == [0, 1, 2, 3, 4, 5]
    assert all(h["replica_max_abs_diff"] == 0.0 for h in record["history"])

    single = train_head(tiny_llama(), CONFIG, tmp_path / "single", progress=False,
                        corpus_root=corpus)
    a = load_checkpoint(tmp_path / "ddp" / CHECKPOINT_FILE, "circuits_llm.train_head")
    b = load_checkpoint(tmp_path / "single" / CHECKPOINT_FILE, "circuits_llm.train_head")
    for group in ("head", "lora"):
        assert a[group].keys() == b[group].keys()
        for name, value in a[group].items():
            torch.testing.assert_close(value, b[group][name], atol=1e-4, rtol=1e-3, msg=name)
    assert all(bool(v.abs().max() > 1e-3) for k, v in a["lora"].items() if "lora_B" in k)
    for ddp_entry, single_entry in zip(record["history"], single.history, strict=True):
        torch.testing.assert_close(torch.tensor(ddp_entry["validation"]["nll"]),
                                   torch.tensor(single_entry["validation"]["nll"]),
                                   atol=1e-4, rtol=1e-4)
        if single_entry["train_loss"] is not None:
            assert abs(ddp_entry["train_loss"] - single_entry["train_loss"]) < 1e-4
    assert record["validation"]["mean_bits"] < record["initial_validation"]["mean_bits"]
    head, backbone = load_trained_head(tmp_path / "ddp", tiny_llama())
    assert head.window == 4 and backbone.lora_layers == 1
