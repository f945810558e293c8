"""Reading a safetensors file that a JSON record vouches for: written once for every such pair
the project saves (heads, draft blocks).

The record (``head_config.json``, ``block_config.json``) holds the tensor file's SHA-256, so a
file that was cut short, edited or swapped for another save's is refused before its tensors are
used, with one message that names both files.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from circuits.files import sha256_file

__all__ = ["read_verified_tensors"]


def read_verified_tensors(path: Path, expected_sha256: str | None, record: str | Path,
                          error: type[Exception]) -> dict[str, Tensor]:
    """The tensors of ``path``, after its SHA-256 matched ``expected_sha256`` (not checked when
    None: files older than the checksum).

    Raises:
        error: the checksum differs, or the file cannot be read as safetensors; the message
            names ``path`` and the ``record`` that vouches for it.
    """
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise error(f"{path} does not match the checksum recorded in {record}: the file is "
                    "corrupt or was written by another save")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise error(f"{path} cannot be read ({exc}); the file is corrupt") from None
