"""Incremental text of a generated sequence: detokenisation, stop strings, streaming hold-back.

``TextStream`` turns generated token ids into text one token at a time without
re-decoding the whole output: it decodes only a short window of recent tokens
(from ``prefix_offset``), the same way for the text already read and for the text
with the new token, and appends the difference. Decoding both from the same first
token keeps tokenizers that treat a leading space specially (SentencePiece) exact.
A window that ends in half a multi-byte character (U+FFFD) is held until the
character is complete; when the sequence ends inside one, the half is dropped, so
stored text is always whole characters. Special tokens never enter the window (they
decode to nothing), and bytes that never form a character are given up on after a few
tokens, so the decode cost stays linear in the output.

Stop strings end the text at their first occurrence. Streaming hold-back: text
that may still turn out to be the start of a stop string, or half a character,
is not handed to ``take`` until it is settled.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
# tokens held for an unfinished character before its bytes are taken as invalid: a UTF-8
# character has at most 4 bytes, so this many byte tokens that still end in U+FFFD never will
_MAX_PENDING = 8


def _special_ids(tokenizer) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops: the named special tokens and
    every added token marked special (e.g. ChatML's ``<|im_start|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return frozenset(ids)


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self._tok = tokenizer
        self._special = _special_ids(tokenizer)
        self._ids: list[int] = []  # visible generated tokens (stop tokens excluded)
        self._prefix_offset = 0  # first token of the window decoded for the next delta
        self._read_offset = 0  # tokens whose text is already in ``text``
        self._stop = list(stop or [])
        self._hold = max(map(len, self._stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters already handed out by ``take``
        self.stopped = False  # a stop string ended the text
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one visible token. Returns True when a stop string ended the text."""
        assert not self.finished, "add after finish"
        if token_id in self._special:
            return False  # decoded without special tokens anyway: it would only widen the window
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and pending < _MAX_PENDING):
            return False  # nothing printable yet, or half a character: wait for more tokens
        self._append(after[len(before) :])
        if after.endswith(_REPLACEMENT):  # bytes that never formed a character: start a fresh window
            self._prefix_offset = self._read_offset = len(self._ids)
        else:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self.stopped

    def _append(self, delta: str) -> None:
        start = max(len(self.text) - self._hold, 0)  # a stop string may straddle the old end
        self.text += delta
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def finish(self) -> str:
        """The sequence ended: settle the text (whole characters only) and return it."""
        if not self.finished and not self.stopped and self._read_offset < len(self._ids):
            before = self._decode(self._ids[self._prefix_offset : self._read_offset])
            after = self._decode(self._ids[self._prefix_offset :]).rstrip(_REPLACEMENT)
            if len(after) > len(before):
                self._append(after[len(before) :])
        self.finished = True
        return self.text

    def take(self) -> str:
        """Text that is settled and not yet handed out (all of it once finished)."""
        end = len(self.text) if self.finished else len(self.text) - self._hold
        if end <= self.emitted:
            return ""
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece
