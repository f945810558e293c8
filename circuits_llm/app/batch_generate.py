"""``circuits-llm generate --prompts-file FILE.jsonl``: many requests decoded in batches.

The file holds one request per line, a JSON object (blank lines are skipped):

* ``"prompt"`` (string, required): the text to continue;
* ``"max_new_tokens"`` (int >= 0): this request's limit (default: ``--max-new-tokens``);
* ``"stop"`` (a string or a list of strings): this request's stop strings, matched as
  ``model.generate(stop_strings=...)`` matches them (default: the ``--stop`` strings); the model's
  EOS ids always stop;
* ``"chat"`` (bool) and ``"system"`` (string): wrap this prompt in the chat template (default:
  ``--chat`` and ``--system``);
* ``"id"`` (any JSON value): echoed in the output line, to match answers to requests.

Any other field is refused (the sampling settings, ``--temperature``, ``--top-k``, ``--top-p``
and ``--seed``, are the command's, shared by every request). The requests are decoded
``--batch-size`` at a time (one backbone call per round for the batch,
:mod:`circuits_llm.decoding.batch`), request ``i`` with its own generator seeded ``--seed + i``, so
its output does not depend on which requests share its batch. One JSON line per request, in the
file's order, goes to stdout or, written atomically (:func:`circuits.files.atomic_write_text`),
to ``--output``: ``{"index", "id" (when given), "text", "new_tokens"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from circuits.files import atomic_write_text
from circuits_llm.app.demo import DemoError

__all__ = ["REQUEST_FIELDS", "Request", "add_batch_arguments", "check_batch_arguments",
           "decode_requests", "read_requests", "run_prompts_file"]

#: the fields a request line may have
REQUEST_FIELDS = ("prompt", "max_new_tokens", "stop", "chat", "system", "id")


@dataclass(frozen=True)
class Request:
    """One line of a prompts file, with the command's defaults filled in.

    Attributes:
        index: the request's place among the file's requests (0-based).
        prompt: the text to continue.
        max_new_tokens: the most tokens to generate.
        stop: stop strings.
        chat: wrap the prompt in the model's chat template.
        system: the chat's system message (``None``: none).
        id: the request's own id, echoed (``None``: not given).
    """

    index: int
    prompt: str
    max_new_tokens: int
    stop: tuple[str, ...]
    chat: bool
    system: str | None
    id: Any = None


def add_batch_arguments(parser: argparse.ArgumentParser, source: Any) -> None:
    """``generate``'s ``--prompts-file`` (in ``source``, the group it shares with ``--prompt``),
    ``--output`` and ``--batch-size``."""
    source.add_argument("--prompts-file", type=Path, default=None, metavar="FILE.jsonl",
                        help="decode many requests, one JSON object per line ({\"prompt\": ..., "
                             "optional \"max_new_tokens\", \"stop\", \"chat\", \"system\", "
                             "\"id\"}), in batches; one JSON line per request out, in order "
                             "(instead of --prompt)")
    parser.add_argument("--output", type=Path, default=None, metavar="FILE",
                        help="with --prompts-file: write the JSON lines to FILE (atomically) "
                             "instead of stdout")
    parser.add_argument("--batch-size", type=int, default=8, metavar="B",
                        help="with --prompts-file: requests decoded together (default 8)")


def check_batch_arguments(args: argparse.Namespace) -> bool:
    """Whether ``generate`` decodes a prompts file (argparse makes ``--prompt`` and
    ``--prompts-file`` exclusive); its options checked.

    Raises:
        DemoError: an option a batch does not take (a constraint, ``--compile``, ``--echo``), or
            ``--output`` without a prompts file.
    """
    if args.prompts_file is None:
        if args.output is not None:
            raise DemoError("--output writes the JSON lines of --prompts-file: give one, or "
                            "leave --output out")
        return False
    refused = [name for name, given in (("--regex", args.regex is not None),
                                        ("--json-schema", args.json_schema is not None),
                                        ("--constraint-walk", bool(args.constraint_walk)),
                                        ("--compile", args.compile), ("--echo", args.echo)) if given]
    if refused:
        raise DemoError(f"--prompts-file decodes its requests in batches, which take no "
                        f"{', '.join(refused)}: decode such prompts one at a time with --prompt")
    if args.batch_size < 1:
        raise DemoError(f"--batch-size must be >= 1, got {args.batch_size}")
    return True


def _field(record: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any,
           where: str) -> Any:
    value = record.get(name, default)
    if (isinstance(value, bool) and kind is int) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DemoError(f"{where}: \"{name}\" must be {expected}, got {json.dumps(value)}")
    return value


def read_requests(path: Path, max_new_tokens: int, stop: Sequence[str], chat: bool,
                  system: str | None) -> list[Request]:
    """The requests of ``path`` (see the module docstring), the other arguments their defaults.

    Raises:
        DemoError: an unreadable file, no request, or a bad line (the message names the line).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DemoError(f"cannot read the prompts file {path}: "
                        f"{getattr(error, 'strerror', None) or error}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DemoError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise DemoError(f"{where}: a request is a JSON object with a \"prompt\"")
        unknown = sorted(set(record) - set(REQUEST_FIELDS))
        if unknown:
            raise DemoError(f"{where}: unknown field(s) {', '.join(unknown)}; a request has "
                            f"{', '.join(REQUEST_FIELDS)}")
        if "prompt" not in record:
            raise DemoError(f"{where}: a request needs a \"prompt\"")
        limit = _field(record, "max_new_tokens", int, max_new_tokens, where)
        if limit < 0:
            raise DemoError(f"{where}: \"max_new_tokens\" must be >= 0, got {limit}")
        stops = _field(record, "stop", (str, list), list(stop), where)
        stops = [stops] if isinstance(stops, str) else stops
        if not all(isinstance(s, str) and s for s in stops):
            raise DemoError(f"{where}: \"stop\" must be a non-empty string or a list of them")
        system_value = record.get("system", system)
        if system_value is not None and not isinstance(system_value, str):
            raise DemoError(f"{where}: \"system\" must be a string, got {json.dumps(system_value)}")
        requests.append(Request(len(requests), _field(record, "prompt", str, None, where), limit,
                                tuple(stops), _field(record, "chat", bool, chat, where),
                                system_value, record.get("id")))
    if not requests:
        raise DemoError(f"the prompts file {path} holds no request")
    return requests


def decode_requests(decoder: Any, loaded: Any, requests: list[Request], batch_size: int,
                    temperature: float, top_k: int | None, top_p: float | None, seed: int
                    ) -> tuple[list[dict[str, Any]], float, int]:
    """Decode ``requests`` ``batch_size`` at a time -> (one output record per request, in
    order; seconds spent; rounds, over the batches)."""
    from circuits_llm.decoding.metrics import BatchResult
    from circuits_llm.decoding.stopping import StopCondition
    tokenizer = loaded.tokenizer
    records: list[dict[str, Any]] = []
    seconds, rounds = 0.0, 0
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        prompts = [tokenizer.encode_prompt(r.prompt, chat=r.chat, system=r.system) for r in chunk]
        stops = [StopCondition.for_model(loaded.model, r.max_new_tokens, r.stop, tokenizer)
                 for r in chunk]
        generators = [torch.Generator(device=decoder.device).manual_seed(seed + r.index)
                      for r in chunk]
        began = time.perf_counter()
        result = decoder.generate(prompts, [r.max_new_tokens for r in chunk], temperature, top_k,
                                  top_p, generator=generators, stop=stops)
        seconds += time.perf_counter() - began
        assert isinstance(result, BatchResult)
        rounds += result.summary.rounds
        for request, tokens in zip(chunk, result.tokens, strict=True):
            record: dict[str, Any] = {"index": request.index}
            if request.id is not None:
                record["id"] = request.id
            record.update(text=tokenizer.decode(tokens), new_tokens=len(tokens))
            records.append(record)
    return records, seconds, rounds


def run_prompts_file(args: Any, decoder: Any, description: str, loaded: Any) -> int:
    """The body of ``generate --prompts-file`` once the model and decoder are loaded."""
    from circuits_llm.decoding.stopping import unescape_stop
    requests = read_requests(Path(args.prompts_file), args.max_new_tokens,
                             [unescape_stop(s) for s in args.stop], args.chat, args.system)
    records, seconds, rounds = decode_requests(decoder, loaded, requests, args.batch_size,
                                               args.temperature, args.top_k, args.top_p, args.seed)
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    if args.output is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(args.output, text)
    tokens = sum(record["new_tokens"] for record in records)
    print(f"[{description} on {decoder.device}] {len(records)} requests in batches of "
          f"{args.batch_size}: {tokens} tokens in {seconds:.2f} s "
          f"({tokens / seconds if seconds > 0 else 0.0:.1f} tokens/s over the batch), "
          f"{rounds} rounds", file=sys.stderr)
    return 0
