"""``--device``: the shared parser and resolver, and every model-running command's use of it.

No test needs a GPU: the presence and absence of CUDA are simulated by monkeypatching
``torch.cuda.is_available`` and ``torch.cuda.device_count`` (resolution only builds
``torch.device`` objects, which needs no GPU).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks import decoder_bench, kernels_bench, study
from circuits_llm.app.cli import build_parser
from circuits_llm.app.cli import main as cli_main
from circuits_llm.runtime.devices import (
    ACCEPTED_FORMS,
    DeviceError,
    DeviceKind,
    DeviceSpec,
    add_device_argument,
    describe_device,
    parse_device,
    resolve_device,
)
from circuits_llm.training import cli as training_cli

BAD_SPECS = ["mps", "gpu", "cuda:x", "cuda:", "cuda0", "cpu:0", "auto:1", "cuda:-1", "", "cuda:0:1",
             "xla"]


def _cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Pretend this machine has ``count`` CUDA devices (0: CUDA unavailable)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# ---------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("text", "kind", "index"), [
    ("auto", DeviceKind.AUTO, None), ("cpu", DeviceKind.CPU, None), ("cuda", DeviceKind.CUDA, None),
    ("cuda:0", DeviceKind.CUDA, 0), ("cuda:12", DeviceKind.CUDA, 12), ("CUDA:1", DeviceKind.CUDA, 1),
    (" cpu ", DeviceKind.CPU, None), ("Auto", DeviceKind.AUTO, None),
])
def test_accepted_forms(text: str, kind: DeviceKind, index: int | None) -> None:
    spec = DeviceSpec.parse(text)
    assert spec == DeviceSpec(kind, index) == parse_device(text)
    assert DeviceSpec.parse(str(spec)) == spec  # str() is a valid spelling of the same spec
    assert DeviceSpec.parse(spec) is spec


@pytest.mark.parametrize("text", BAD_SPECS)
def test_rejected_forms_name_the_accepted_ones(text: str) -> None:
    with pytest.raises(DeviceError) as raised:
        DeviceSpec.parse(text)
    assert f"invalid device {text!r}" in str(raised.value) and ACCEPTED_FORMS in str(raised.value)
    with pytest.raises(argparse.ArgumentTypeError, match="expected auto, cpu, cuda or cuda:N"):
        parse_device(text)


def test_only_cuda_takes_a_non_negative_index() -> None:
    with pytest.raises(DeviceError, match="only cuda takes an index"):
        DeviceSpec(DeviceKind.CPU, 0)
    with pytest.raises(DeviceError, match="only cuda takes an index"):
        DeviceSpec(DeviceKind.CUDA, -1)


def test_argparse_error_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tool")
    add_device_argument(parser)
    assert parser.parse_args([]).device == DeviceSpec(DeviceKind.AUTO)
    assert parser.parse_args(["--device", "cuda:3"]).device == DeviceSpec(DeviceKind.CUDA, 3)
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(["--device", "mps"])
    assert stop.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"tool: error: argument --device: invalid device 'mps': expected {ACCEPTED_FORMS}"]


def test_a_bad_default_fails_at_registration() -> None:
    with pytest.raises(DeviceError, match="invalid device 'gpu'"):
        add_device_argument(argparse.ArgumentParser(), default="gpu")


# ---------------------------------------------------------------------------- resolution
def test_auto_follows_this_machine() -> None:
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == torch.device("cpu")
    assert describe_device(torch.device("cpu")) == "cpu"


def test_resolution_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(DeviceSpec(DeviceKind.AUTO), default_index=3) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for text in ("cuda", "cuda:0", "cuda:1"):
        with pytest.raises(DeviceError) as raised:
            resolve_device(text)
        message = str(raised.value)
        assert message.startswith(f"--device {text}: CUDA is not available on this machine")
        assert "use --device cpu, or --device auto" in message


def test_resolution_with_two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda", default_index=1) == torch.device("cuda", 1)
    assert resolve_device("auto", default_index=1) == torch.device("cuda", 1)
    assert resolve_device("cuda:0", default_index=1) == torch.device("cuda", 0)  # explicit wins
    with pytest.raises(DeviceError) as raised:
        resolve_device("cuda:2")
    message = str(raised.value)
    assert "--device cuda:2: there is no CUDA device cuda:2" in message
    assert "2 visible: cuda:0, cuda:1" in message and "--device cpu" in message
    with pytest.raises(DeviceError, match="--device auto: there is no CUDA device cuda:5"):
        resolve_device("auto", default_index=5)


@pytest.mark.parametrize(("local_rank", "spec", "expected"), [
    (None, "cuda", "cuda:0"), ("1", "cuda", "cuda:1"), ("1", "auto", "cuda:1"), ("1", "cpu", "cpu"),
    ("0", "cuda:1", "cuda:1"),
])
def test_train_head_uses_local_rank(local_rank: str | None, spec: str, expected: str,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, 2)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert training_cli._device(spec) == torch.device(expected)
    monkeypatch.setenv("LOCAL_RANK", "2")  # a third process on a 2-GPU machine
    if spec in ("cuda", "auto"):
        with pytest.raises(DeviceError, match="no CUDA device cuda:2"):
            training_cli._device(spec)


# ---------------------------------------------------------------------------- the commands
#: Minimal argv of each ``circuits-llm`` subcommand that runs a model, and its default device.
COMMANDS = {
    "demo": ([], "auto"), "bench": ([], "auto"), "generate": (["--prompt", "x"], "auto"),
    "train-head": (["--run-dir", "r"], "cpu"), "pretrain": ([], "cpu"), "export-model": ([], "cpu"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_cli_command_takes_device(command: str) -> None:
    argv, default = COMMANDS[command]
    parser = build_parser()
    assert parser.parse_args([command, *argv]).device == DeviceSpec.parse(default)
    for text in ("auto", "cpu", "cuda", "cuda:1"):
        assert parser.parse_args([command, *argv, "--device", text]).device == DeviceSpec.parse(text)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_cli_command_rejects_a_bad_device(command: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv, _ = COMMANDS[command]
    with pytest.raises(SystemExit) as stop:
        cli_main([command, *argv, "--device", "gpu"])
    assert stop.value.code == 2
    assert "argument --device: invalid device 'gpu'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "bench", "generate", "train-head", "pretrain",
                                     "export-model"])
def test_cuda_without_cuda_is_one_error_line(command: str, monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _cuda(monkeypatch, 0)
    monkeypatch.chdir(tmp_path)  # nothing may be written: the device is checked first
    argv, _ = COMMANDS[command]
    threads = [] if command == "export-model" else ["--threads", "1"]
    assert cli_main([command, *argv, "--device", "cuda:0", *threads]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"circuits-llm {command}: error: --device cuda:0: CUDA is not available")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


BENCHMARKS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "decoder_bench": (decoder_bench.main, "cpu"), "study": (study.main, "cpu"),
    "kernels_bench": (kernels_bench.main, "auto"),
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmarks_take_device(name: str, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    main, default = BENCHMARKS[name]
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--device {auto,cpu,cuda[:N]}" in shown and f"(default: {default})" in shown
    with pytest.raises(SystemExit) as stop:
        main(["--device", "mps"])
    assert stop.value.code == 2
    assert "argument --device: invalid device 'mps'" in capsys.readouterr().err
    _cuda(monkeypatch, 0)
    with pytest.raises(SystemExit) as stop:
        main(["--device", "cuda"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --device cuda: CUDA is not available on this machine" in err
    assert "Traceback" not in err

