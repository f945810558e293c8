"""The one ``--device`` option of every command that runs a model: parse it, resolve it, explain it.

Every command (``circuits-llm demo | bench | generate | train-head | pretrain | export-model``,
``python -m benchmarks.decoder_bench | study | kernels_bench``) registers the option with
:func:`add_device_argument` and turns the parsed value into a :class:`torch.device` with
:func:`resolve_device`, so the accepted spellings, the meaning of ``auto`` and the error messages
are the same everywhere. Accepted forms:

* ``auto``: CUDA when ``torch.cuda.is_available()``, else the CPU;
* ``cpu``;
* ``cuda``: CUDA device 0 (or the index the command supplies: ``train-head`` uses ``LOCAL_RANK``
  under ``torchrun``, one GPU per process);
* ``cuda:N``: CUDA device ``N``.

Parsing is syntax only (an argparse error lists the accepted forms). Whether the device exists is
checked at resolution, which raises :class:`DeviceError` with a message that names the device and
says what to use instead, never a raw torch traceback. Resolution always returns an explicit index
for CUDA (``cuda:0``, not ``cuda``) so that a report records the device that actually ran.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from enum import Enum

import torch

#: How the accepted forms are named in help texts and error messages.
ACCEPTED_FORMS = "auto, cpu, cuda or cuda:N (N = a CUDA device index, e.g. cuda:0)"
METAVAR = "{auto,cpu,cuda[:N]}"
_SPEC = re.compile(r"(?P<kind>auto|cpu|cuda)(?::(?P<index>[0-9]+))?")
_FALLBACK = "use --device cpu, or --device auto (CUDA when available, else the CPU)"


class DeviceKind(Enum):
    """What a ``--device`` value asks for, before looking at the machine."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DeviceError(ValueError):
    """A ``--device`` value that is malformed or names a device this machine does not have.

    The message names the value and says what to pass instead; commands print it as their one
    error line.
    """


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed ``--device`` value: a :class:`DeviceKind` and, for CUDA, an optional index.

    Attributes:
        kind: auto, cpu or cuda.
        index: the CUDA device index of ``cuda:N``; None for ``cuda`` (the command's default
            index), ``auto`` and ``cpu``.
    """

    kind: DeviceKind
    index: int | None = None

    def __post_init__(self) -> None:
        if self.index is not None and (self.kind is not DeviceKind.CUDA or self.index < 0):
            raise DeviceError(f"invalid device {self}: only cuda takes an index, and it must be "
                              f">= 0; expected {ACCEPTED_FORMS}")

    @classmethod
    def parse(cls, text: str | DeviceSpec) -> DeviceSpec:
        """``"auto" | "cpu" | "cuda" | "cuda:N"`` (any case, surrounding blanks ignored).

        Raises:
            DeviceError: anything else (``"mps"``, ``"gpu"``, ``"cuda:x"``, ``"cpu:0"``, ...).
        """
        if isinstance(text, DeviceSpec):
            return text
        match = _SPEC.fullmatch(str(text).strip().lower())
        if match is None or (match["index"] is not None and match["kind"] != DeviceKind.CUDA.value):
            raise DeviceError(f"invalid device {str(text)!r}: expected {ACCEPTED_FORMS}")
        index = match["index"]
        return cls(DeviceKind(match["kind"]), None if index is None else int(index))

    def __str__(self) -> str:
        return self.kind.value if self.index is None else f"{self.kind.value}:{self.index}"

    def resolve(self, default_index: int = 0) -> torch.device:
        """The :class:`torch.device` this spec means on this machine.

        Args:
            default_index: the CUDA index of ``cuda`` and of ``auto`` on a CUDA machine (0 unless
                the command knows better, e.g. ``LOCAL_RANK`` under torchrun).

        Raises:
            DeviceError: CUDA asked for (``cuda``, ``cuda:N``, or ``auto`` with an index) but not
                available, or the index is not below ``torch.cuda.device_count()``.
        """
        if self.kind is DeviceKind.CPU:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            if self.kind is DeviceKind.AUTO:
                return torch.device("cpu")
            reason = ("this torch build has no CUDA support" if torch.version.cuda is None
                      else "no CUDA device is visible")
            raise DeviceError(f"--device {self}: CUDA is not available on this machine ({reason}); "
                              f"{_FALLBACK}")
        index = default_index if self.index is None else self.index
        count = torch.cuda.device_count()
        if index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise DeviceError(f"--device {self}: there is no CUDA device cuda:{index} on this "
                              f"machine ({count} visible: {have}); pick an existing index, or "
                              f"{_FALLBACK}")
        return torch.device("cuda", index)


def parse_device(text: str) -> DeviceSpec:
    """argparse ``type=`` of ``--device``: a :class:`DeviceSpec`, or an argparse usage error."""
    try:
        return DeviceSpec.parse(text)
    except DeviceError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def resolve_device(spec: DeviceSpec | str, default_index: int = 0) -> torch.device:
    """Parse (if needed) and resolve a ``--device`` value; see :meth:`DeviceSpec.resolve`.

    Raises:
        DeviceError: a malformed value, or a device this machine does not have.
    """
    return DeviceSpec.parse(spec).resolve(default_index)


def add_device_argument(parser: argparse.ArgumentParser, default: str = DeviceKind.AUTO.value,
                        note: str = "") -> None:
    """Register ``--device`` (parsed into a :class:`DeviceSpec`) on a command's parser.

    Args:
        parser: the command's parser.
        default: the command's default spelling (``auto`` for interactive commands; a command
            whose recorded results must stay comparable may keep ``cpu``).
        note: extra help text, e.g. why the default is what it is.
    """
    DeviceSpec.parse(default)  # a bad default is a programming error: fail at registration
    text = (f"where the model, the heads and every tensor run: auto (CUDA when available, else "
            f"the CPU), cpu, cuda or cuda:N (default: {default})")
    parser.add_argument("--device", type=parse_device, default=default, metavar=METAVAR,
                        help=f"{text}. {note}" if note else text)


def describe_device(device: torch.device) -> str:
    """``"cpu"``, or ``"cuda:N: <GPU name>"``: the device as a report should record it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}: {torch.cuda.get_device_name(index)}"
    return str(device)
