"""Incremental text of a generated sequence: detokenisation, stop strings, streaming hold-back.

``TextStream`` turns generated token ids into text one token at a time without
re-decoding the whole output: it decodes only a short window of recent tokens
(from ``prefix_offset``), the same way for the text already read and for the text
with the new token, and appends the difference. Decoding both from the same first
token keeps tokenizers that treat a leading space specially (SentencePiece) exact.
A window that ends in half a multi-byte character (U+FFFD) is held until the
character is complete; when the sequence ends inside one, the half is dropped, so
stored text is always whole characters.

Stop strings end the text at their first occurrence. Streaming hold-back: text
that may still turn out to be the start of a stop string, or half a character,
is not handed to ``take`` until it is settled.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self._tok = tokenizer
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
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return False  # nothing printable yet, or half a character: wait for more tokens
        self._append(after[len(before) :])
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
