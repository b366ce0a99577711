"""Text that is safe to show on a terminal.

Stored text (titles, messages, model replies, document sources, error messages that echo
user input) may hold terminal control sequences: a title of ``"\\x1b]0;pwned\\x07"`` would
retitle the user's terminal, ``"\\x1b[2J"`` clear it, ``"\\r"`` overwrite a line. Everything
that prints stored text passes it through :func:`safe_text` first (or, for text that
arrives in pieces, :class:`SafeStream`).
"""

from __future__ import annotations

import re

# Complete escape sequences (7-bit and 8-bit forms), removed whole:
_SEQUENCE = re.compile(
    r"""
      (?:\x1b\[|\x9b) [\x30-\x3f]* [\x20-\x2f]* [\x40-\x7e]          # CSI: cursor, colours, clear screen...
    | (?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]) .*? (?:\x07|\x1b\\|\x9c)  # OSC/DCS/SOS/PM/APC ... BEL or ST
    | \x1b [\x20-\x2f]* [\x30-\x7e]                                  # other ESC sequences (ESC c resets)
    """,
    re.VERBOSE | re.DOTALL,
)
# What is left of an incomplete sequence is harmless once its ESC / C1 introducer is gone:
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 except \t \n, DEL, C1
# A piece ending inside a sequence that may still be completed by the next piece:
_PARTIAL_TAIL = re.compile(
    r"(?:\x1b|\x1b\[[\x30-\x3f]*[\x20-\x2f]*|\x9b[\x30-\x3f]*[\x20-\x2f]*|\x1b[\x20-\x2f]+"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x9c\x1b]{0,512}\x1b?)\Z",
    re.DOTALL,
)


def safe_text(s: str | None, *, oneline: bool = False) -> str:
    """``s`` without terminal control sequences: ESC-based CSI/OSC/DCS/other sequences, their
    8-bit forms, and every C0/C1 control character except newline and tab (``\\r\\n`` becomes
    ``\\n``). ``oneline``: newlines and tabs become spaces too (titles, list rows)."""
    if not s:
        return ""
    s = s.replace("\r\n", "\n")
    s = _SEQUENCE.sub("", s)
    s = _CONTROL.sub("", s)
    if oneline:
        s = s.replace("\n", " ").replace("\t", " ")
    return s


class SafeStream:
    """:func:`safe_text` for text that arrives in pieces (a streamed reply): a piece that ends
    inside an escape sequence holds that tail back until the next piece completes it."""

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        s = self._held + piece
        m = _PARTIAL_TAIL.search(s)
        if m is not None and m.start() < len(s):
            self._held, s = s[m.start() :], s[: m.start()]
        else:
            self._held = ""
        if s.endswith("\r"):  # may be the first half of \r\n
            self._held, s = "\r" + self._held, s[:-1]
        return safe_text(s)

    def flush(self) -> str:
        s, self._held = self._held, ""
        return safe_text(s)
