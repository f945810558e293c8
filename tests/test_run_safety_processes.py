"""Issue 18 with real processes: ``circuits-llm train-head`` under SIGTERM and SIGKILL.

One run directory goes through every fault a long CPU job meets, in order:

1. a ``train-head`` process trains (a checkpoint after every step); a second run on the same
   directory fails at once with one line naming the first one's pid;
2. SIGTERM: the first process finishes its step, writes a checkpoint, says how to resume and
   exits 143, without a traceback;
3. a resumed process is killed with SIGKILL: its lock file stays behind;
4. a third run takes the dead process's lock over (saying so) and continues to step ``k + 2``;
   its parameters, data order, losses and validation equal those of one uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_run_safety import assert_same_training, cli, one_error_line, step_of
from test_training import config, make_corpus, tiny_llama, train

from circuits_llm.app.cli import main
from circuits_llm.runtime.checkpoint import CheckpointError
from circuits_llm.training import CHECKPOINT_FILE
from circuits_llm.training.lock import LOCK_FILE

LONG = ("--steps", "100000", "--eval-every", "100000", "--threads", "1")
CONFIG = config(steps=100000, eval_every=100000)


def wait_for(condition: Callable[[], bool], process: subprocess.Popen[str], what: str) -> None:
    """Poll ``condition`` until it holds; fail if ``process`` ends first or after 180 s."""
    deadline = time.monotonic() + 180
    while not condition():
        if process.poll() is not None:
            _, err = process.communicate()
            pytest.fail(f"train-head ended (status {process.returncode}) before {what}:\n{err}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def saved_step(path: Path) -> int:
    """The step of the checkpoint at ``path`` (-1 while there is none)."""
    try:
        return step_of(path)
    except CheckpointError:
        return -1


def test_sigterm_lock_sigkill_and_exact_resume(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging
    corpus = make_corpus(tmp_path / "corpus")
    model = tmp_path / "model"
    hf_logging.disable_progress_bar()
    try:
        tiny_llama().save_pretrained(model)
    finally:
        hf_logging.enable_progress_bar()
    run = tmp_path / "run"
    checkpoint = run / CHECKPOINT_FILE
    command = [sys.executable, "-m", "circuits_llm", *cli(model, run, corpus, *LONG)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    wait_for(lambda: saved_step(checkpoint) >= 2, first, "its second checkpoint")
    assert main(cli(model, run, corpus, *LONG)) == 2  # the directory is taken
    line = one_error_line(capsys.readouterr().err)
    assert f"{run} is in use by another run (train-head pid {first.pid} on host " in line

    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    found = re.fullmatch(r"circuits-llm train-head: stopped by SIGTERM after step (\d+); the "
                         r"checkpoint is in (\S+); run the same command again to resume", last)
    assert found is not None and found[2] == str(checkpoint), last
    stopped = int(found[1])
    assert saved_step(checkpoint) == stopped >= 2 and f'"step": {stopped}' in out
    assert not (run / LOCK_FILE).exists()

    second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    wait_for(lambda: saved_step(checkpoint) >= stopped + 2, second, "two more checkpoints")
    second.kill()
    second.communicate(timeout=60)
    assert second.returncode == -signal.SIGKILL
    killed = saved_step(checkpoint)
    assert killed >= stopped + 2 and (run / LOCK_FILE).exists()

    resumed = train(run, corpus, CONFIG, max_steps=killed + 2)
    assert f"took over the lock of {run} left by train-head pid {second.pid}" in \
        capsys.readouterr().err
    assert resumed.step == killed + 2 and resumed.session_steps == 2
    whole = train(tmp_path / "whole", corpus, CONFIG, max_steps=killed + 2)
    assert_same_training(checkpoint, tmp_path / "whole" / CHECKPOINT_FILE)
    assert resumed.validation == whole.validation and resumed.train_loss == whole.train_loss
