"""Chat requests for an instruct model, built offline: what its users ask besides code to continue.

A head trained only on continuations of source files drafts a chat reply poorly: on SmolLM2's
chat prompts the code-trained shipped heads accepted 1.1-1.3 tokens per round, against 2.7 greedy
on code (docs/journal.md, section 6). Training on the model's own replies to chat requests
(:mod:`circuits_llm.training.chat_distill`) needs requests, and nothing may be downloaded, so they
are built here from two offline sources:

* **requests about code**: an instruction (explain, comment, document, review, test...) applied
  to a snippet of a corpus file: a ``def`` or ``class`` line and the lines after it, at most
  :data:`SNIPPET_LINES` lines and :data:`SNIPPET_CHARS` characters, dedented;
* **everyday requests**: an instruction (explain, list, compare, a poem, an email, a JSON
  description...) applied to a subject from :data:`SUBJECTS`.

Requests alternate between the two kinds. Splits are disjoint: training requests read the
training split's files and the subjects not held out; evaluation requests (:attr:`Split.TEST`)
read the test split's files and the held-out subjects (every fifth); the validation split reads
its own files and the held-out subjects too. Everything is seeded: the same arguments give the
same requests. :func:`chat_prompts` wraps each request in the model's chat template
(:meth:`~circuits_llm.text.tokens.TextTokenizer.encode_prompt` with ``chat=True``), as
``circuits-llm generate --chat`` does.
"""

from __future__ import annotations

import random
import textwrap
from enum import Enum
from pathlib import Path

import torch
from torch import Tensor

from circuits_llm.text.byte_level import Split, corpus_files
from circuits_llm.text.tokens import TextTokenizer

__all__ = ["CODE_INSTRUCTIONS", "SUBJECTS", "TOPIC_INSTRUCTIONS", "ChatRequestError", "PromptSet",
           "chat_prompts", "chat_requests", "code_snippets", "evaluation_chat_prompts",
           "subjects_of"]

#: Lines and characters a code snippet holds at most.
SNIPPET_LINES = 5
SNIPPET_CHARS = 150

CODE_INSTRUCTIONS = (
    "Explain what this Python code does:\n\n```python\n{code}\n```",
    "Add comments to this code:\n\n```python\n{code}\n```",
    "Write a docstring for this code:\n\n```python\n{code}\n```",
    "Is there a bug in this code? Explain.\n\n```python\n{code}\n```",
    "Rewrite this code to make it easier to read:\n\n```python\n{code}\n```",
    "Write a unit test for this code:\n\n```python\n{code}\n```",
    "Describe in plain English, step by step, what this code does.\n\n{code}",
    "How could this code be made faster?\n\n```python\n{code}\n```",
)

TOPIC_INSTRUCTIONS = (
    "Tell me about {subject}.",
    "Explain {subject} to a beginner.",
    "Give me three interesting facts about {subject}.",
    "Write a short poem about {subject}.",
    "Write a short story that involves {subject}.",
    "What are the pros and cons of {subject}?",
    "Describe {subject} as a JSON object with a name, a category and a list of three facts.",
    "Write a friendly email to a colleague about {subject}.",
    "How can I learn more about {subject}?",
    "Summarize the history of {subject} in one paragraph.",
    "Write a list of five questions a student might ask about {subject}.",
    "Explain {subject} in two sentences.",
)

SUBJECTS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution",
    "machine learning", "recursion", "coffee", "volcanoes", "the stock market", "climate change",
    "the Roman Empire", "chess", "gardening", "the immune system", "electric cars", "jazz",
    "the moon landing", "sleep", "exercise", "databases", "the internet", "honeybees",
    "the pyramids of Egypt", "rainbows", "vaccines", "the Renaissance", "cooking pasta",
    "time management", "public speaking", "dinosaurs", "earthquakes", "the Olympic Games",
    "sorting algorithms", "binary numbers", "encryption", "the human heart", "solar panels", "tea",
    "the ocean", "migrating birds", "friendship", "personal budgeting", "learning a new language",
    "mountains", "the printing press", "bicycles", "robots", "the periodic table", "music theory",
    "cats", "dogs", "rain forests", "the Great Wall of China", "electricity", "gravity",
    "human memory", "social media", "recycling", "the solar system", "baking bread", "marathons",
    "photography", "operating systems", "compilers", "the theory of evolution", "Shakespeare",
    "prime numbers", "probability", "weather forecasting", "airplanes", "trains", "libraries",
    "museums", "hiking", "meditation", "volunteering", "startups", "renewable energy",
    "artificial intelligence", "the Python programming language",
)


class PromptSet(Enum):
    """What a benchmark decodes: held-out code to continue (``CODE``, the demo's prompts:
    :func:`circuits_llm.text.corpus.evaluation_prompts`) or held-out chat requests (``CHAT``:
    :func:`evaluation_chat_prompts`)."""

    CODE = "code"
    CHAT = "chat"


class ChatRequestError(ValueError):
    """Chat requests cannot be built as asked (too few snippets in a split, or a bad count)."""


def subjects_of(split: Split) -> tuple[str, ...]:
    """The subjects of ``split``: every fifth subject is held out for validation and test."""
    held_out = split is not Split.TRAIN
    return tuple(s for i, s in enumerate(SUBJECTS) if (i % 5 == 4) == held_out)


def _snippets_of(text: str) -> list[str]:
    lines = text.splitlines()
    found = []
    for start, line in enumerate(lines):
        if not line.lstrip().startswith(("def ", "class ")):
            continue
        chosen: list[str] = []
        for part in lines[start:start + SNIPPET_LINES]:
            if sum(len(x) + 1 for x in chosen) + len(part) > SNIPPET_CHARS:
                break
            chosen.append(part)
        snippet = textwrap.dedent("\n".join(chosen)).strip("\n")
        if snippet.count("\n") >= 1:  # a signature and at least one line of body
            found.append(snippet)
    return found


def code_snippets(split: Split, root: Path | None = None) -> list[str]:
    """Every snippet (see the module docstring) of ``split``'s files, in file order."""
    snippets = []
    for path in corpus_files(split, root):
        snippets.extend(_snippets_of(path.read_text(encoding="utf-8", errors="replace")))
    return snippets


def chat_requests(split: Split, count: int, seed: int, root: Path | None = None) -> list[str]:
    """``count`` chat requests of ``split`` (see the module docstring): even indices ask about
    code, odd ones about a subject; instruction, snippet and subject drawn with ``seed``.

    Raises:
        ChatRequestError: ``count`` < 1, or ``split`` has no code snippet.
    """
    if count < 1:
        raise ChatRequestError(f"chat requests: count must be >= 1, got {count}")
    snippets = code_snippets(split, root)
    if not snippets:
        raise ChatRequestError(f"the {split.value} split of the corpus has no def/class snippet "
                               "to ask about; add .py files to the corpus")
    subjects = subjects_of(split)
    draw = random.Random(f"chat-requests/{split.value}/{seed}")
    requests = []
    for index in range(count):
        if index % 2 == 0:
            request = draw.choice(CODE_INSTRUCTIONS).format(code=draw.choice(snippets))
        else:
            request = draw.choice(TOPIC_INSTRUCTIONS).format(subject=draw.choice(subjects))
        requests.append(request)
    return requests


def chat_prompts(tokenizer: TextTokenizer, split: Split, count: int, seed: int, *,
                 max_tokens: int | None = None, root: Path | None = None) -> list[Tensor]:
    """``count`` chat prompts (1-D int64 ids, the request in the model's chat template, the
    assistant's turn opened), skipping requests longer than ``max_tokens`` ids.

    Raises:
        ChatTemplateError: the tokenizer has no chat template.
        ChatRequestError: fewer than ``count`` requests fit ``max_tokens`` (among 4x as many).
    """
    prompts: list[Tensor] = []
    for request in chat_requests(split, 4 * count, seed, root):
        ids = tokenizer.encode_prompt(request, chat=True)
        if max_tokens is None or len(ids) <= max_tokens:
            prompts.append(torch.tensor(ids, dtype=torch.long))
            if len(prompts) == count:
                return prompts
    raise ChatRequestError(f"only {len(prompts)} of {4 * count} chat requests fit in {max_tokens} "
                           f"tokens, fewer than the {count} asked; allow longer prompts "
                           "(a larger seq_len)")


def evaluation_chat_prompts(tokenizer: TextTokenizer, count: int, root: Path | None = None
                            ) -> list[Tensor]:
    """``count`` held-out chat prompts (the test split's snippets and the held-out subjects,
    seed 0), what benchmarks decode with ``--prompt-set chat``."""
    return chat_prompts(tokenizer, Split.TEST, count, 0, root=root)
