"""Issue 18, in process: verified and rotated checkpoints, failed writes, the run directory lock,
non-finite training, signals and one-line errors of ``train-head``.

The checkpoint files themselves are tested in ``test_run_safety_checkpoints.py``; real SIGTERM
and SIGKILL, and a lock held by another live process, in ``test_run_safety_processes.py``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_training import config, make_corpus, snapshot, tiny_llama, train

from circuits import files
from circuits_llm.app.cli import main
from circuits_llm.heads import MTPHead
from circuits_llm.heads.projections import SumProjection
from circuits_llm.runtime.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from circuits_llm.training import (
    CHECKPOINT_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    NonFiniteTrainingError,
    RunDirectoryBusy,
    TrainingInterrupted,
)
from circuits_llm.training import results as training_results
from circuits_llm.training.lock import LOCK_FILE, LockHolder, RunLock
from circuits_llm.training.resume import CHECKPOINT_KIND

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers.utils import logging as hf_logging
    directory = tmp_path_factory.mktemp("model")
    hf_logging.disable_progress_bar()
    try:
        tiny_llama().save_pretrained(directory)
    finally:
        hf_logging.enable_progress_bar()
    return directory


def cli(model: Path, run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    """``train-head`` argv of :func:`test_training.config` (6 steps, a checkpoint every step)."""
    return ["train-head", "--model", str(model), "--run-dir", str(run_dir), "--corpus-root",
            str(corpus), "--no-progress", "--arch", "btree", "--window", "4", "--rank", "4",
            "--seq-len", "24", "--batch-size", "4", "--lr", "0.01", "--steps", "6",
            "--eval-every", "3", "--eval-windows", "4", "--checkpoint-every", "0", "--seed", "1",
            *extra]


def one_error_line(err: str) -> str:
    """The single stderr line of a failed command (fails if there is more or a traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("circuits-llm train-head: error: "), lines[0]
    return lines[0]


def step_of(path: Path) -> int:
    """The step of a verified head-training checkpoint."""
    return int(inspect_checkpoint(path, CHECKPOINT_KIND).summary["step"])


def assert_same_training(a: Path, b: Path) -> None:
    """Two checkpoints hold bit-identical trained tensors and data order."""
    first, second = load_checkpoint(a, CHECKPOINT_KIND), load_checkpoint(b, CHECKPOINT_KIND)
    assert first["step"] == second["step"]
    for group in ("head", "lora"):
        assert first[group].keys() == second[group].keys()
        for name, value in first[group].items():
            assert torch.equal(value, second[group][name]), name
    assert torch.equal(first["data_generator"], second["data_generator"])
    assert [(h["step"], h["train_loss"], h["validation"]) for h in first["history"]] == \
        [(h["step"], h["train_loss"], h["validation"]) for h in second["history"]]


# ------------------------------------------------------------------------------ helpers
def failing_fsync(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Make :func:`circuits.files.atomic_write` fail with ENOSPC for temporary files ``prefix*``."""
    original = files.fsync

    def fsync(path: Path) -> None:
        if Path(path).name.startswith(prefix):
            raise ENOSPC
        original(path)

    monkeypatch.setattr(files, "fsync", fsync)


# ------------------------------------------------------------------------------ resume
def test_flipped_byte_is_refused_and_resume_from_the_previous_equals_uninterrupted(
        tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    train(run, corpus, config(steps=4))
    checkpoint, previous = run / CHECKPOINT_FILE, run / PREVIOUS_CHECKPOINT_FILE
    assert (step_of(checkpoint), step_of(previous)) == (4, 3)
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(data))
    before = snapshot(run)
    with pytest.raises(CheckpointError) as raised:
        train(run, corpus, config(steps=6))
    message = str(raised.value)
    assert f"checkpoint {checkpoint} is corrupt: its SHA-256 does not match" in message
    assert f"{previous} (step 3) is intact: resume from it with --resume-from {previous}" in message
    assert snapshot(run) == before  # nothing written, the lock file gone again
    resumed = train(run, corpus, config(steps=6), resume_from=previous)
    assert resumed.session_steps == 3 and resumed.finished
    whole = train(tmp_path / "whole", corpus, config(steps=6))
    assert_same_training(checkpoint, tmp_path / "whole" / CHECKPOINT_FILE)
    assert resumed.validation == whole.validation


def test_missing_latest_with_a_previous_and_bad_resume_from_are_errors(tmp_path: Path,
                                                                       corpus: Path) -> None:
    run = tmp_path / "run"
    train(run, corpus, config(steps=2, eval_every=1))
    (run / "training.json").unlink()
    (run / CHECKPOINT_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"has no checkpoint\.pt but an older "
                                              r"checkpoint\.prev\.pt; resume from it"):
        train(run, corpus, config(steps=4))
    with pytest.raises(CheckpointError, match=r"--resume-from .*nothing\.pt: no such file"):
        train(run, corpus, config(steps=4), resume_from=run / "nothing.pt")
    with pytest.raises(CheckpointError, match=r"different configuration \(learning_rate"):
        train(run, corpus, config(steps=4, learning_rate=0.5),
              resume_from=run / PREVIOUS_CHECKPOINT_FILE)


def test_checkpoint_with_non_finite_tensors_is_refused(tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    train(run, corpus, config(steps=2))
    state = load_checkpoint(run / CHECKPOINT_FILE, CHECKPOINT_KIND)
    name = next(iter(state["head"]))
    state["head"][name] = torch.full_like(state["head"][name], float("nan"))
    save_checkpoint(run / CHECKPOINT_FILE, CHECKPOINT_KIND,
                    {k: v for k, v in state.items() if k not in ("kind", "format")})
    with pytest.raises(CheckpointError, match=f"non-finite values in head tensor {name}"):
        train(run, corpus, config(steps=4))


# ------------------------------------------------------------------------------ full disk
def test_full_disk_while_saving_is_one_line_and_keeps_the_checkpoint(
        tmp_path: Path, corpus: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(cli(model_dir, run, corpus, "--max-steps", "2")) == 0
    capsys.readouterr()
    failing_fsync(monkeypatch, ".checkpoint.")
    assert main(cli(model_dir, run, corpus)) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write checkpoint {run / CHECKPOINT_FILE} (No space left on device)" in line
    assert "free disk space" in line
    assert step_of(run / CHECKPOINT_FILE) == 2 and step_of(run / PREVIOUS_CHECKPOINT_FILE) == 2
    assert not list(run.glob(".*")) and not (run / LOCK_FILE).exists()
    monkeypatch.undo()
    assert main(cli(model_dir, run, corpus)) == 0  # resumes once there is space again
    assert step_of(run / CHECKPOINT_FILE) == 6


def test_full_disk_while_exporting_is_one_line(tmp_path: Path, corpus: Path, model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    def full(head: MTPHead, directory: object) -> None:
        raise ENOSPC

    monkeypatch.setattr(training_results, "save_head", full)
    assert main(cli(model_dir, tmp_path / "run", corpus, "--max-steps", "2")) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "cannot write the exported head" in line and "No space left on device" in line
    assert "the last good checkpoint, step 2, is kept" in line


# ------------------------------------------------------------------------------ non-finite
def poison(kind: str, at_step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From training step ``at_step`` on, make the head's outputs, gradients or parameters bad."""
    calls = {"n": 0}
    if kind == "parameter":
        step = torch.optim.AdamW.step

        def poisoned_step(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
            out = step(self, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] >= at_step:
                with torch.no_grad():
                    self.param_groups[0]["params"][0].fill_(float("nan"))
            return out

        monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
        return
    forward = SumProjection.forward
    values = {"nan-output": float("nan"), "no-mass": float("-inf"), "inf-output": float("inf")}

    def poisoned(self: SumProjection, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        out = forward(self, hidden)
        if torch.is_grad_enabled():
            calls["n"] += 1
        if calls["n"] >= at_step and torch.is_grad_enabled():
            name = next(iter(out))
            if kind == "inf-gradient":
                out[name] = out[name] + 0.0
                out[name].register_hook(lambda grad: grad * float("inf"))
            else:  # every weight of a sum fold: a unit without mass, or NaN / +inf
                out[name] = torch.full_like(out[name], values[kind])
        return out

    monkeypatch.setattr(SumProjection, "forward", poisoned)


@pytest.mark.parametrize(("kind", "what"), [
    ("nan-output", r"the head's output params\['sum_\d+'\]\[0, 0, 0, 0\] is NaN \(unit 0 of "),
    ("no-mass", r"the head's output params\['sum_\d+'\]\[0, 0, 0, :\] has no mass \(unit 0 of "),
    ("inf-output", r"the head's output params\['sum_\d+'\]\[0, 0, 0, 0\] is \+inf \(unit 0 of "),
    ("inf-gradient", r"the gradient norm is (nan|inf); "),
    ("parameter", r"parameter \S+ is NaN or infinite; "),
])
def test_non_finite_training_stops_and_keeps_the_last_good_checkpoint(
        kind: str, what: str, tmp_path: Path, corpus: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    poison(kind, 3, monkeypatch)
    with pytest.raises(NonFiniteTrainingError) as raised:
        train(run, corpus, config(steps=6, eval_every=4))  # no validation between 3 and its save
    message = str(raised.value)
    assert re.match(f"step 3: {what}", message) and "\n" not in message, message
    assert f"the last good checkpoint, step 2, is kept in {run / CHECKPOINT_FILE}" in message
    assert "new run directory with a lower --lr" in message
    assert step_of(run / CHECKPOINT_FILE) == 2 and step_of(run / PREVIOUS_CHECKPOINT_FILE) == 1
    state = load_checkpoint(run / CHECKPOINT_FILE, CHECKPOINT_KIND)
    assert all(bool(torch.isfinite(v).all()) for v in state["head"].values())
    assert not (run / "training.json").exists() and not (run / LOCK_FILE).exists()


# ------------------------------------------------------------------------------ the lock
def test_a_held_lock_refuses_a_second_run_and_names_the_holder(
        tmp_path: Path, corpus: Path, model_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with RunLock(run) as lock:  # another open file description: flock conflicts as across processes
        holder = lock.holder
        assert holder is not None and holder.pid == os.getpid()
        with pytest.raises(RunDirectoryBusy, match=re.escape(
                f"pid {os.getpid()} on host {holder.host}, started {holder.started}")):
            train(run, corpus, config())
        assert main(cli(model_dir, run, corpus)) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"{run} is in use by another run (train-head pid {os.getpid()}" in line
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]
    assert not run.exists()  # the lock created the directory and nothing else was written


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_message(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    dead = LockHolder(pid=999_999_999, host="gone", started="2020-01-01T00:00:00+00:00",
                      command="train-head")
    (run / LOCK_FILE).write_text(dead.to_json())
    train(run, corpus, config(steps=2))
    err = capsys.readouterr().err
    assert f"took over the lock of {run} left by train-head pid 999999999 on host gone" in err
    assert "no longer running" in err
    assert not (run / LOCK_FILE).exists()


def test_lock_retries_a_removed_file_and_holds_nothing_after_an_interrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import circuits_llm.training.lock as lock_module
    open_files = len(os.listdir("/proc/self/fd"))
    real = lock_module._same_file
    calls: list[bool] = []

    def same_file(handle: int, path: Path) -> bool:  # the first file locked had been removed
        calls.append(bool(calls) and real(handle, path))
        return calls[-1]

    monkeypatch.setattr(lock_module, "_same_file", same_file)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert calls == [False, True]
    assert lock.held and json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock.held and not (tmp_path / LOCK_FILE).exists()

    def interrupted(command: str) -> LockHolder:
        raise KeyboardInterrupt

    monkeypatch.setattr(LockHolder, "current", interrupted)
    with pytest.raises(KeyboardInterrupt):
        RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_FILE).exists()
    assert len(os.listdir("/proc/self/fd")) == open_files  # every lock file closed again
    monkeypatch.undo()
    with RunLock(tmp_path) as again:  # nothing is left held
        assert again.held


# ------------------------------------------------------------------------------ signals
def signal_at(step: int, signals: list[signal.Signals], monkeypatch: pytest.MonkeyPatch) -> None:
    """Send ``signals`` to this process during the forward pass of training step ``step``."""
    forward = SumProjection.forward
    calls = {"n": 0}

    def sending(self: SumProjection, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == step:
                for number in signals:
                    os.kill(os.getpid(), number)
        return forward(self, hidden)

    monkeypatch.setattr(SumProjection, "forward", sending)


def test_first_signal_finishes_the_step_and_checkpoints_then_resume_is_exact(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    handler = signal.getsignal(signal.SIGINT)
    signal_at(3, [signal.SIGINT], monkeypatch)
    run = tmp_path / "run"
    result = train(run, corpus, config(steps=6), handle_signals=True)
    assert result.interrupted_by is signal.SIGINT and result.step == 3 and not result.finished
    assert "SIGINT received: finishing this step and writing a checkpoint" in capfd.readouterr().err
    assert step_of(run / CHECKPOINT_FILE) == 3
    assert not (run / "training.json").exists() and not (run / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGINT) is handler
    monkeypatch.undo()
    assert train(run, corpus, config(steps=6)).session_steps == 3
    train(tmp_path / "whole", corpus, config(steps=6))
    assert_same_training(run / CHECKPOINT_FILE, tmp_path / "whole" / CHECKPOINT_FILE)


def test_second_signal_stops_at_once_and_keeps_the_last_checkpoint(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    signal_at(3, [signal.SIGTERM, signal.SIGTERM], monkeypatch)
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as raised:
        train(run, corpus, config(steps=6), handle_signals=True)
    stop = raised.value
    assert stop.signal is signal.SIGTERM and stop.second and stop.exit_status == 143
    assert str(stop) == (f"stopped at once by a second SIGTERM after step 2; the last good "
                         f"checkpoint, step 2, is kept in {run / CHECKPOINT_FILE}; run the same "
                         "command to resume")
    assert step_of(run / CHECKPOINT_FILE) == 2 and not (run / LOCK_FILE).exists()


def test_signal_during_setup_stops_at_once(tmp_path: Path, corpus: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import circuits_llm.training.loop as loop

    def interrupted_sets(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop, "training_sets", interrupted_sets)
    with pytest.raises(TrainingInterrupted) as raised:
        train(tmp_path / "run", corpus, config(), handle_signals=True)
    assert not raised.value.second and raised.value.exit_status == 130
    assert "no checkpoint was written; run the same command to start again" in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_cli_signal_exit_status_and_resume_advice(tmp_path: Path, corpus: Path, model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    signal_at(2, [signal.SIGTERM], monkeypatch)
    run = tmp_path / "run"
    assert main(cli(model_dir, run, corpus)) == 143
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 2
    assert captured.err.strip().splitlines()[-1] == (
        f"circuits-llm train-head: stopped by SIGTERM after step 2; the checkpoint is in "
        f"{run / CHECKPOINT_FILE}; run the same command again to resume")
    monkeypatch.undo()
    signal_at(1, [signal.SIGINT, signal.SIGINT], monkeypatch)
    assert main(cli(model_dir, run, corpus)) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"circuits-llm train-head: stopped at once by a second SIGINT after step 2; the last good "
        f"checkpoint, step 2, is kept in {run / CHECKPOINT_FILE}; run the same command to resume")


# ------------------------------------------------------------------------------ bad input
def corrupt_weights(model_dir: Path, tmp_path: Path, how: Callable[[bytes], bytes]) -> Path:
    copy = tmp_path / "model"
    copy.mkdir()
    for item in model_dir.iterdir():
        data = item.read_bytes()
        (copy / item.name).write_bytes(how(data) if item.suffix == ".safetensors" else data)
    return copy


@pytest.mark.parametrize("how", [lambda d: d[: len(d) // 2], lambda d: b"", lambda d: b"\xff" + d[1:]],
                         ids=["truncated", "empty", "bad-header"])
def test_corrupt_model_weights_are_one_line(how: Callable[[bytes], bytes], tmp_path: Path,
                                            corpus: Path, model_dir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    model = corrupt_weights(model_dir, tmp_path, how)
    assert main(cli(model, tmp_path / "run", corpus)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"model.safetensors in {model} is corrupt or truncated" in line
    assert f"copy or export the model to --model {model} again" in line
    assert not (tmp_path / "run").exists()


def test_empty_missing_or_short_corpus_is_one_line_naming_it(
        tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    short = make_corpus(tmp_path / "short")
    for item in short.iterdir():
        item.write_text("")
    cases = {tmp_path / "missing": "the corpus directory {root} does not exist; give --corpus-root",
             empty: "the corpus {root} has no training files",
             short: "the training split of the corpus {root} has 8 tokens, fewer than one sequence"
                    " of seq_len + 1 = 25"}
    for root, expected in cases.items():
        assert main(cli(model_dir, tmp_path / "run", root, "--seq-len", "24",
                        "--max-train-bytes", "1000")) == 2
        line = one_error_line(capsys.readouterr().err)
        assert expected.format(root=root) in line and "max_train_bytes" not in line
        assert not (tmp_path / "run").exists()
    for item in short.iterdir():
        item.write_text("x = 1\n" * 3)
    assert main(cli(model_dir, tmp_path / "run", short)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"the validation split of the corpus {short} has 40 tokens, fewer than eval_windows * " \
        "seq_len = 96" in line
    assert "lower --eval-windows or --seq-len, or add .py files to the corpus" in line
