"""Text is data: only the chat template's own markup may produce special tokens.

A tokenizer turns the string ``<|im_end|>`` into the end-of-turn control token wherever
it appears, so a user who types it could close their turn and open a forged system
turn. Every piece of text chatkv did not write itself (messages, system prompts,
pinned documents, retrieved sources, tool results) is tokenised with special tokens
split: ``<|im_end|>`` in a message becomes the tokens of its characters.

How a rendered conversation is tokenised (``encode_rendered``):

1. the template is rendered twice: with the real contents and with each content
   replaced by a marker; walking the two side by side gives where each content
   lies in the real text (templates that trim content are handled);
2. the real text is tokenised as usual, with character offsets. When no control
   token overlaps a content, those ids are the result: for text without
   special-token strings nothing changes, so canonical token histories, prefix
   caching and stored snapshots of existing conversations keep matching;
3. otherwise the control tokens that come from markup are kept and the text between
   them is tokenised with ``split_special_tokens=True``.

A template that alters a content in a way the walk cannot follow (other than
trimming) while that content holds a special-token string is refused with an
``InvalidRequest`` rather than guessed at.

Raw prompts (``Engine.generate("...")``, ``/v1/completions`` with a string) are the
caller's own template and stay raw: they are not tokenised here.
"""

from __future__ import annotations

import re
import secrets
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from chatkv.errors import InvalidRequest

_NONCE = secrets.token_hex(6)
_MARKER = "\u2063ck" + _NONCE + "-{}\u2063"
_MARKER_RE = re.compile("\u2063ck" + _NONCE + r"-(\d+)\u2063")


def control_ids(tokenizer) -> frozenset[int]:
    """The ids only template markup may produce: every added token flagged special."""
    # a cache chatkv keeps on the caller's tokenizer (a library object it does not own), under
    # a name of its own that no tokenizer attribute takes; a tokenizer without attributes recomputes
    cached = getattr(tokenizer, "_chatkv_control_ids", None)
    if cached is not None:
        return cached
    ids = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", True)}
    ids.update(i for i in tokenizer.all_special_ids if i is not None)
    out = frozenset(ids)
    try:
        tokenizer._chatkv_control_ids = out  # chatkv's cache on the tokenizer (above)
    except AttributeError:  # a tokenizer that takes no attributes: computed each time
        pass
    return out


def control_strings(tokenizer) -> list[str]:
    """The text of every control token (``control_ids``), e.g. ``<|im_start|>``."""
    return _control_strings(tokenizer)


def _control_strings(tokenizer) -> list[str]:
    dec = getattr(tokenizer, "added_tokens_decoder", {})
    ctrl = control_ids(tokenizer)
    return [t.content for i, t in dec.items() if i in ctrl and t.content]


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as data: its special-token strings give the tokens of their characters.

    Through a copy of the tokenizer's backend that always splits special tokens: transformers
    implements ``split_special_tokens=True`` by setting a flag on the shared backend before
    each call, so two threads (a server request, the engine loop, a session) could each get
    the other's mode, markup split or a content's ``<|im_end|>`` parsed."""
    if not text:
        return []
    splitter = _splitter(tokenizer)
    if splitter is not None:
        return list(splitter.encode(text, add_special_tokens=False).ids)
    with _SLOW_LOCK:  # a tokenizer without a backend: its per-call option, one call at a time
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


_SLOW_LOCK = threading.Lock()


def _splitter(tokenizer):
    """The tokenizer's backend copied, set to split special tokens (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_chatkv_splitter", None)  # chatkv's cache on the tokenizer, as control_ids'
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    try:
        tokenizer._chatkv_splitter = copy  # chatkv's cache on the tokenizer (as control_ids')
    except AttributeError:
        pass
    return copy


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation and the character spans of the contents in it."""

    text: str
    spans: tuple[tuple[int, int], ...] | None  # None: the contents could not be located


def render(render_fn: Callable[[list[dict]], str], messages: Sequence[dict]) -> Rendered:
    """``render_fn(messages)`` and where each message's content lies in it."""
    messages = list(messages)
    text = render_fn(messages)
    contents = [m.get("content") for m in messages]
    if not any(isinstance(c, str) and c for c in contents):
        return Rendered(text, ())
    marked = [
        dict(m, content=_MARKER.format(i)) if isinstance(m.get("content"), str) else m for i, m in enumerate(messages)
    ]
    try:
        marked_text = render_fn(marked)
    except InvalidRequest:
        return Rendered(text, None)
    return Rendered(text, _walk(text, marked_text, contents))


def _walk(text: str, marked_text: str, contents: list) -> tuple[tuple[int, int], ...] | None:
    parts = _MARKER_RE.split(marked_text)  # markup, index, markup, index, ..., markup
    pos, spans = 0, []
    for j in range(0, len(parts) - 1, 2):
        markup, idx, nxt = parts[j], int(parts[j + 1]), parts[j + 2]
        last = j + 2 == len(parts) - 1
        if not text.startswith(markup, pos):
            return None
        pos += len(markup)
        c = contents[idx]
        for cand in dict.fromkeys((c, c.strip(), c.lstrip(), c.rstrip())):
            end = pos + len(cand)
            if text.startswith(cand, pos) and (text[end:] == nxt if last else text.startswith(nxt, end)):
                break
        else:
            return None
        if end > pos:
            spans.append((pos, end))
        pos = end
    if len(parts) == 1 and text != marked_text:
        return None
    return tuple(spans)


def encode_rendered(tokenizer, rendered: Rendered, start: int = 0) -> list[int]:
    """Token ids of ``rendered.text[start:]``, the contents' special-token strings split (see module doc)."""
    text = rendered.text[start:]
    if not text:
        return []
    ctrl = control_ids(tokenizer)
    if rendered.spans is None:
        # where the contents are is unknown: fine while no content holds a special-token string
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids
    spans = [(max(a - start, 0), b - start) for a, b in rendered.spans if b > start]
    if not spans:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "is_fast", False):
        return _encode_pieces(tokenizer, text, spans)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    inside = _control_in_content(ids, offsets, spans, ctrl)
    if not any(inside):
        return ids
    out, pos = [], 0
    for k, (t, (a, b)) in enumerate(zip(ids, offsets)):
        if t in ctrl and not inside[k]:
            out += encode_text(tokenizer, text[pos:a])
            out.append(t)
            pos = b
    out += encode_text(tokenizer, text[pos:])
    return out


def _control_in_content(ids, offsets, spans: list[tuple[int, int]], ctrl) -> list[bool]:
    """For each token: whether it is a control token overlapping a content span. One walk over
    the tokens and the spans together (both in text order), so the work is linear in the
    conversation's length, not tokens times messages."""
    out, j, last = [False] * len(ids), 0, 0
    for k, (t, (a, b)) in enumerate(zip(ids, offsets)):
        if t not in ctrl:
            continue
        if a < last:  # offsets out of order (not seen from a fast tokenizer): walk again from the start
            j = 0
        last = a
        while j < len(spans) and spans[j][1] <= a:  # spans ending before this token: passed for good
            j += 1
        # spans are sorted and disjoint: only the first one ending after ``a`` can overlap [a, b)
        out[k] = j < len(spans) and spans[j][0] < b
    return out


def _encode_pieces(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """A tokenizer without offsets: markup and contents tokenised apart."""
    out, pos = [], 0
    for s, e in spans:
        if s > pos:
            out += list(tokenizer(text[pos:s], add_special_tokens=False)["input_ids"])
        out += encode_text(tokenizer, text[s:e])
        pos = e
    if pos < len(text):
        out += list(tokenizer(text[pos:], add_special_tokens=False)["input_ids"])
    return out


def check_locatable(tokenizer, rendered: Rendered, messages: Sequence[dict]) -> None:
    """Refuse a conversation whose contents hold special-token strings the walk could not locate."""
    if rendered.spans is not None:
        return
    strings = _control_strings(tokenizer)
    for i, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, str):
            found = [(c.find(s), -len(s), s) for s in strings if s in c]
            if found:
                hit = min(found)[2]  # the first in the text
                raise InvalidRequest(
                    f"message {i} ({m.get('role')}) contains the special token '{hit}' and the model's chat "
                    f"template changes message text, so chatkv cannot keep it as plain text; remove it"
                )


def encode_chat(
    tokenizer, render_fn: Callable[[list[dict]], str], messages: Sequence[dict], start: int = 0
) -> list[int]:
    """Render ``messages`` with ``render_fn`` and tokenise the text from ``start`` as data."""
    r = render(render_fn, messages)
    check_locatable(tokenizer, r, messages)
    return encode_rendered(tokenizer, r, start)
