"""TextStream: incremental text equals a full decode, whole characters only, stop strings,
the streaming hold-back, and a decode cost linear in the output length.

Runs against a real byte-level BPE tokenizer (tests/support/tiny.py), whose tokens split multi-byte
characters, and against the packaged SmolLM2 tokenizer when its converted model is already
on this machine (it is never converted here: that takes far longer than these tests).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatkv.engine.detokenize import TextStream
from tests.support.tiny import make_tokenizer

FFFD = "\ufffd"


def _smollm2_dir() -> Path | None:
    """The converted default model's directory if it already exists (nothing is created)."""
    try:
        import torch

        from chatkv.weights.gguf import MARKER, default_model_dir

        home = os.environ.get("CHATKV_HOME")
        if home:
            root = Path(home).expanduser()
        else:
            from platformdirs import user_data_dir

            root = Path(user_data_dir("chatkv", appauthor=False))
        path = default_model_dir(root, torch.bfloat16)
        return path if (path / MARKER).is_file() else None
    except Exception:
        return None


TOKENIZERS = ["tiny"] + (["smollm2"] if _smollm2_dir() is not None else [])


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module", params=TOKENIZERS)
def tok(request, tiny_tok):
    if request.param == "tiny":
        return tiny_tok
    from chatkv.weights import load_tokenizer

    return load_tokenizer(_smollm2_dir())


class Counting:
    """A tokenizer wrapper that counts decode calls and the ids they decode."""

    def __init__(self, tok):
        self.tok = tok
        self.calls = 0
        self.ids = 0

    def __getattr__(self, name):  # everything else (special ids...) as the real tokenizer has it
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        self.ids += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def full(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def feed(tok, ids, stop=None):
    """Add ``ids`` one by one until a stop string; return (stream, take() pieces, index that stopped)."""
    ts = TextStream(tok, stop)
    pieces, stopped_at = [], None
    for i, t in enumerate(ids):
        hit = ts.add(t)
        pieces.append(ts.take())
        if hit:
            stopped_at = i
            break
    ts.finish()
    pieces.append(ts.take())
    return ts, pieces, stopped_at


ALPHABET = list("abcdefghijklmnopqrstuvwxyz ABC,.?!'-\n0123456789") + [
    "é",
    "ß",
    "ж",
    "你",
    "好",
    "界",
    "🎉",
    "😀",
    "👍🏽",
    "€",
]
texts = st.lists(st.sampled_from(ALPHABET), max_size=60).map("".join)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- equals a full decode ----------------------------------------------------------------------


@SETTINGS
@given(text=texts)
def test_incremental_text_equals_the_full_decode(tok, text):
    ids = encode(tok, text)
    ts = TextStream(tok)
    for i, t in enumerate(ids):
        assert not ts.add(t)
        assert FFFD not in ts.text  # never half a character, even mid-stream
        assert full(tok, ids[: i + 1]).startswith(ts.text)
    assert ts.finish() == full(tok, ids) == ts.text
    assert ts.take() == ts.text


@SETTINGS
@given(data=st.data())
def test_random_token_ids_equal_the_full_decode_without_a_trailing_half(tok, data):
    """Any ids at all (bytes that are no character, special tokens): the text is the full decode,
    less a character cut off at the end."""
    n = len(tok)
    ids = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=40))
    ts = TextStream(tok)
    for t in ids:
        ts.add(t)
    assert ts.finish() == full(tok, ids).rstrip(FFFD)


def test_special_tokens_are_skipped(tiny_tok):
    tok = tiny_tok
    ids = encode(tok, "Hello") + [tok.convert_tokens_to_ids("<|im_start|>")] + encode(tok, " you")
    ts, pieces, _ = feed(tok, ids)
    assert ts.text == "Hello you" == "".join(pieces)


# -- whole characters -------------------------------------------------------------------------------

MULTI = "a你好🎉b😀ж👍🏽"


def test_multibyte_characters_are_split_across_tokens_in_this_tokenizer(tiny_tok):
    ids = encode(tiny_tok, MULTI)
    assert any(FFFD in tiny_tok.decode([t]) for t in ids)  # the premise of the tests below


def test_a_split_character_is_held_until_whole(tok):
    ids = encode(tok, MULTI)
    ts = TextStream(tok)
    seen = []
    for i, t in enumerate(ids):
        ts.add(t)
        piece = ts.take()
        assert FFFD not in ts.text and FFFD not in piece
        seen.append(piece)
        # whatever is shown is a prefix of the final text, in whole characters
        assert MULTI.startswith(ts.text)
    ts.finish()
    seen.append(ts.take())
    assert "".join(seen) == ts.text == MULTI
    # each character appeared whole, in one piece or with others, never in parts
    for ch in ["你", "好", "🎉", "😀", "ж"]:
        assert any(ch in p for p in seen)


def test_finish_in_the_middle_of_a_character_drops_the_half(tok):
    text = "ok 🎉"
    ids = encode(tok, text)
    # the last prefix of ids whose decode ends with half a character
    cut = max(i for i in range(1, len(ids) + 1) if full(tok, ids[:i]).endswith(FFFD))
    ts = TextStream(tok)
    for t in ids[:cut]:
        ts.add(t)
    assert FFFD not in ts.take()
    final = ts.finish()
    assert FFFD not in final and final == "ok "
    assert FFFD not in ts.take()


def test_finish_keeps_an_invalid_byte_in_the_middle_as_the_full_decode_does(tiny_tok):
    tok = tiny_tok
    lone = tok.convert_tokens_to_ids("Ģ")  # byte 0x80: a continuation byte, never valid alone
    ids = encode(tok, "a") + [lone] + encode(tok, "b")
    ts, _, _ = feed(tok, ids)
    assert ts.text == full(tok, ids) == "a" + FFFD + "b"


# -- stop strings ------------------------------------------------------------------------------------------


def boundaries(tok, ids):
    """Character offsets in the decoded text where one token ends and the next begins (clean cuts only)."""
    out = []
    for i in range(1, len(ids)):
        prefix = full(tok, ids[:i])
        if FFFD not in prefix:
            out.append(len(prefix))
    return out


def test_a_stop_string_straddling_two_tokens_cuts_the_text(tok):
    text = "Hello, how are you today? Fine."
    ids = encode(tok, text)
    cuts = [b for b in boundaries(tok, ids) if 3 <= b <= len(text) - 3]
    b = cuts[len(cuts) // 2]
    stop = text[b - 2 : b + 2]
    assert not any(stop in full(tok, [t]) for t in ids)  # no single token holds it
    ts, pieces, at = feed(tok, ids, [stop])
    assert ts.stopped and ts.text == text[: text.find(stop)]
    assert at is not None
    assert "".join(pieces) == ts.text


def test_the_first_occurrence_wins_and_the_earliest_of_several_stops():
    class Chars:  # one character per token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "xx STOP yy STOP zz END"]
    ts, pieces, at = feed(Chars(), ids, ["END", "STOP"])
    assert ts.text == "xx " and at == ids.index(ord("P"))
    assert "".join(pieces) == "xx "
    # two stops completed by the same token: the one that starts first cuts
    ts, _, _ = feed(Chars(), [ord("a"), ord("b"), ord("c")], ["bc", "c"])
    assert ts.text == "a"


def test_the_hold_back_is_released_on_finish():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    ts = TextStream(Chars(), ["xyz"])
    for c in "abcd":
        ts.add(ord(c))
    assert ts.take() == "ab"  # len("xyz") - 1 characters are held: they might begin the stop string
    ts.add(ord("x"))
    assert ts.take() == "c"
    ts.finish()
    assert ts.take() == "dx" and ts.text == "abcdx"
    assert ts.take() == ""


@SETTINGS
@given(data=st.data(), text=texts)
def test_take_never_hands_out_what_becomes_a_stop_string(tok, data, text):
    """Whatever stop string is drawn (from the text itself, so it occurs): every piece handed out
    is a prefix of the final text, which ends before the stop string's first occurrence."""
    if len(text) < 2:
        text += "ab"
    i = data.draw(st.integers(0, len(text) - 1))
    j = data.draw(st.integers(i + 1, min(len(text), i + 6)))
    stop = text[i:j]
    ids = encode(tok, text)
    decoded = full(tok, ids)
    assert decoded == text
    ts, pieces, at = feed(tok, ids, [stop])
    assert ts.text == text[: text.find(stop)]
    assert ts.stopped
    shown = ""
    for piece in pieces:
        assert FFFD not in piece
        shown += piece
        assert ts.text.startswith(shown)
    assert shown == ts.text
    # the stop fired at the first token whose text completes the stop string, not before
    assert stop in full(tok, ids[: at + 1])
    for k in range(1, at + 1):  # the text settled after each earlier token did not hold it yet
        settled = full(tok, ids[:k])
        assert settled.endswith(FFFD) or stop not in settled


@SETTINGS
@given(text=texts, stops=st.lists(st.sampled_from(["zz", "qq", "\n\n", "🎉🎉", "你好界"]), max_size=3))
def test_pieces_concatenate_to_the_final_text(tok, text, stops):
    ids = encode(tok, text)
    ts, pieces, _ = feed(tok, ids, stops)
    assert "".join(pieces) == ts.text
    hits = [text.find(s) for s in stops if s in text]
    # the earliest-completed stop cuts; with these stops that is the earliest occurrence
    if hits:
        assert ts.stopped and ts.text == text[: min(hits)]
    else:
        assert ts.text == text and not ts.stopped


# -- cost ----------------------------------------------------------------------------------------------


def long_ids(tok, n=500):
    text = "The quick brown fox, 你好世界 🎉 jumps over the lazy dog; émigré café! " * 60
    ids = encode(tok, text)[:n]
    assert len(ids) == n
    return ids


@pytest.mark.parametrize("stop", [None, ["never appears here"]])
def test_decode_cost_is_linear_in_the_output(tok, stop):
    ids = long_ids(tok)
    n = len(ids)
    counting = Counting(tok)
    ts = TextStream(counting, stop)
    for t in ids:
        ts.add(t)
        ts.take()
    ts.finish()
    assert ts.text == full(tok, ids).rstrip(FFFD)
    assert counting.calls <= 2 * n + 2
    assert counting.ids < 20 * n, f"{counting.ids} ids decoded for {n} tokens"


@pytest.mark.parametrize("kind", ["special", "invalid-bytes"])
def test_decode_cost_is_linear_for_tokens_that_print_nothing(tiny_tok, kind):
    tok = tiny_tok
    t = tok.convert_tokens_to_ids("<|im_start|>" if kind == "special" else "Ģ")
    n = 500
    counting = Counting(tok)
    ts = TextStream(counting)
    for _ in range(n):
        ts.add(t)
    ts.finish()
    assert counting.ids < 20 * n, f"{counting.ids} ids decoded for {n} tokens"
