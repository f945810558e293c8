"""Issue 18, the checkpoint files themselves: header and checksum, every flipped byte, format 1
files, rotation that never lets a corrupt file displace a good one, and a full disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_run_safety import failing_fsync

from circuits_llm.runtime.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    UnverifiableCheckpointError,
    inspect_checkpoint,
    load_checkpoint,
    previous_path,
    save_checkpoint,
)


def test_checkpoint_header_round_trip_and_rotation(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    first = save_checkpoint(path, "job", {"x": torch.arange(3)}, summary={"step": 1})
    assert inspect_checkpoint(path, "job") == first and first.summary == {"step": 1}
    save_checkpoint(path, "job", {"x": torch.arange(4)}, summary={"step": 2}, keep_previous=True)
    assert previous_path(path) == tmp_path / "state.prev.pt"
    assert torch.equal(load_checkpoint(previous_path(path), "job")["x"], torch.arange(3))
    assert torch.equal(load_checkpoint(path, "job")["x"], torch.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.prev.pt", "state.pt"]
    with pytest.raises(CheckpointError, match=r"written by 'job', expected 'other'"):
        load_checkpoint(path, "other")


def test_every_flipped_byte_and_every_truncation_is_an_error_naming_the_file(
        tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    save_checkpoint(good, "job", {"x": torch.arange(8, dtype=torch.float32)}, summary={"step": 7})
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    for index in range(len(data)):
        flipped = bytearray(data)
        flipped[index] ^= 0xFF
        bad.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError) as raised:
            load_checkpoint(bad, "job")
        assert str(bad) in str(raised.value), index
        with pytest.raises(CheckpointError):
            inspect_checkpoint(bad, "job")
    for size in (0, 10, len(data) // 2, len(data) - 1):
        bad.write_bytes(data[:size])
        with pytest.raises(CheckpointCorruptError, match="corrupt") as raised:
            load_checkpoint(bad, "job")
        assert str(bad) in str(raised.value)
    bad.write_bytes(data + b"\0")
    with pytest.raises(CheckpointCorruptError, match="truncated or appended to"):
        load_checkpoint(bad, "job")


def test_legacy_checkpoint_without_checksum_is_loaded_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"kind": "job", "format": 1, "x": 3}, path)
    with pytest.raises(UnverifiableCheckpointError, match="has no checksum"):
        load_checkpoint(path, "job")
    assert load_checkpoint(path, "job", allow_unverified=True)["x"] == 3


def test_a_corrupt_file_never_displaces_the_previous_good_one(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    save_checkpoint(path, "job", {"x": 1}, summary={"step": 1})
    save_checkpoint(path, "job", {"x": 2}, summary={"step": 2}, keep_previous=True)
    path.write_bytes(path.read_bytes()[:-3])
    save_checkpoint(path, "job", {"x": 3}, summary={"step": 3}, keep_previous=True)
    assert load_checkpoint(previous_path(path), "job")["x"] == 1  # not the corrupt step 2
    assert load_checkpoint(path, "job")["x"] == 3


def test_full_disk_keeps_the_previous_checkpoint(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state.pt"
    save_checkpoint(path, "job", {"x": 1}, summary={"step": 1})
    failing_fsync(monkeypatch, ".state.")
    with pytest.raises(CheckpointWriteError) as raised:
        save_checkpoint(path, "job", {"x": 2}, keep_previous=True)
    message = str(raised.value)
    assert "\n" not in message and str(path) in message and "No space left on device" in message
    assert "free disk space" in message
    assert load_checkpoint(path, "job")["x"] == 1
    assert load_checkpoint(previous_path(path), "job")["x"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.prev.pt", "state.pt"]
