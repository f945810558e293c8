"""Files the project writes are readable as the umask says (issue 45, item 5).

Every writer goes through :func:`circuits.files.atomic_write`; its temporary file must not leak
``tempfile.mkstemp``'s 0600 into the result. Under umask 0o022 a written file is 0o644, under
0o077 it is 0o600: what an ordinary ``open(path, "w")`` gives. Each public writer is checked.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import circuits
from circuits import files
from circuits.learn.checkpoint import save_checkpoint as save_learn_checkpoint
from circuits.plotting import Renderer
from circuits.serialization import save_circuit
from circuits.templates import cp
from circuits_llm.app.report import DecodeMode, DecoderRow, write_json
from circuits_llm.app.tradeoff_plot import write_tradeoff_plot
from circuits_llm.decoding.metrics import DecodeSummary
from circuits_llm.heads import MTPHead, save_head
from circuits_llm.runtime.checkpoint import previous_path
from circuits_llm.runtime.checkpoint import save_checkpoint as save_run_checkpoint
from circuits_llm.runtime.timing import publish

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")

UMASKS = {0o022: 0o644, 0o077: 0o600}


@pytest.fixture(params=sorted(UMASKS), ids=lambda mask: f"umask{mask:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test under the umask ``request.param``; the process's umask is restored after."""
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_umask_mode(umask: int, *paths: Path) -> None:
    for path in paths:
        assert mode_of(path) == UMASKS[umask], f"{path}: {oct(mode_of(path))} under umask {umask:03o}"
    leftovers = [p.name for path in paths for p in path.parent.iterdir() if ".tmp" in p.name]
    assert leftovers == []


def _row(decoder: str, throughput: float, accepted: float) -> DecoderRow:
    summary = DecodeSummary(new_tokens=64, rounds=16, backbone_calls=17, drafted=48, accepted=24,
                            acceptance_rate=0.5, tokens_per_round=accepted, tokens_per_call=3.8,
                            acceptance_by_position=(0.75, 0.5, 0.25),
                            conditional_acceptance_by_position=(),
                            mean_latency_s=accepted / throughput, throughput=throughput)
    return DecoderRow.from_summary(decoder, DecodeMode.GREEDY, 4, summary)


def test_atomic_write_ends_with_open_s_mode(tmp_path: Path, umask: int) -> None:
    files.atomic_write_text(tmp_path / "table.txt", "a table\n")
    files.atomic_write_json(tmp_path / "record.json", {"a": 1})
    assert_umask_mode(umask, tmp_path / "table.txt", tmp_path / "record.json")


def test_an_existing_file_gets_open_s_mode_too(tmp_path: Path, umask: int) -> None:
    """Overwriting replaces the file: its mode is the new one's, as after ``open(path, "w")``
    would be for a new file (a 0600 file from before the fix is repaired)."""
    path = tmp_path / "results.json"
    path.write_text("{}")
    path.chmod(0o600)
    files.atomic_write_json(path, {"b": 2})
    assert_umask_mode(umask, path)


def test_a_writer_that_puts_another_file_in_place_gets_open_s_mode(tmp_path: Path,
                                                                  umask: int) -> None:
    """The feature store renames its partial file into the temporary one: a 0600 file from
    ``mkstemp`` still ends with the umask's mode."""
    handle, name = tempfile.mkstemp(dir=tmp_path, suffix=".partial")
    os.close(handle)

    files.atomic_write(tmp_path / "features.bin", lambda tmp: os.replace(name, tmp))
    assert_umask_mode(umask, tmp_path / "features.bin")


def test_the_demo_s_report_files(tmp_path: Path, umask: int) -> None:
    """results.json (report.write_json) and tradeoff.png (write_tradeoff_plot)."""
    results = write_json({"rows": [1, 2]}, tmp_path / "demo" / "results.json")
    png = write_tradeoff_plot([_row("autoregressive", 100.0, 1.0), _row("ff", 200.0, 3.0)],
                              tmp_path / "demo" / "tradeoff.png", "test")
    assert_umask_mode(umask, results, png)


def test_benchmark_records(tmp_path: Path, umask: int) -> None:
    """Every benchmark writes its record with runtime.timing.publish."""
    record = tmp_path / "results" / "bench.json"
    publish("a table", {"rows": []}, record)
    assert_umask_mode(umask, record)


def test_circuits_plot_and_save_circuit(tmp_path: Path, umask: int) -> None:
    circuit = cp(3, 2, 3)
    png = circuits.plot(circuit, tmp_path / "circuit.png", renderer=Renderer.MATPLOTLIB)
    saved = tmp_path / "circuit.json"
    save_circuit(circuit, saved)
    assert_umask_mode(umask, png, saved)


def test_save_head(tmp_path: Path, umask: int) -> None:
    directory = tmp_path / "head"
    save_head(MTPHead.from_name("cp", 4, 2, 8, 16), directory)
    written = sorted(directory.iterdir())
    assert written
    assert_umask_mode(umask, *written)


def test_checkpoints(tmp_path: Path, umask: int) -> None:
    """circuits.learn's checkpoints, and a run's (train-head) with the previous one kept."""
    learned = save_learn_checkpoint(tmp_path / "learn.ckpt", {"w": torch.zeros(2)}, epoch=1)
    run = tmp_path / "run" / "checkpoint.pt"
    for step in range(2):
        save_run_checkpoint(run, "test", {"w": torch.full((2,), float(step))}, keep_previous=True)
    assert_umask_mode(umask, learned, run, previous_path(run))
