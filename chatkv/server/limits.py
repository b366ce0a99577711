"""Bounds on a request's work, checked before any loop over its parts: how deeply its JSON nests
(the body, and a tool call's ``arguments`` string inside it), how many messages or input items
it holds, and how much text they add up to. Each is a 400 naming the limit, so a hostile body
costs one linear pass over its bytes and never reaches the template, the tokenizer or Python's
recursion limit (a ``RecursionError`` would otherwise be a 500).

- ``MAX_DEPTH``: JSON nesting, arrays and objects together (a tool's parameter schema of
  pydantic's, with its ``$defs``, is a dozen levels deep).
- ``MAX_MESSAGES``: messages of a chat completion, items of a Responses ``input``.
- the text of the messages together: at most ``CHARS_PER_TOKEN`` characters per token of the
  context (no tokenizer gives a real conversation more characters a token than that), so a
  prompt that cannot fit is refused before it is rendered and tokenised.
"""

from __future__ import annotations

import json

from chatkv.server.errors import APIError, bad_value

MAX_DEPTH = 100
MAX_MESSAGES = 4096
CHARS_PER_TOKEN = 32


def _path(keys: list) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".") or "the body"


def too_deep(value, limit: int = MAX_DEPTH) -> str | None:
    """Where ``value`` (parsed JSON) nests past ``limit`` levels (a path), or None. Iterative."""
    stack = [(value, 1, [])]
    while stack:
        v, depth, keys = stack.pop()
        if isinstance(v, dict):
            items = v.items()
        elif isinstance(v, list):
            items = enumerate(v)
        else:
            continue
        if depth > limit:
            return _path(keys)
        for k, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, keys + [k] if depth < 8 else keys))  # the path's first levels
    return None


def nested_error(where: str, at: str | None = None) -> APIError:
    """The 400 for JSON at ``where`` (the body, or a field holding a JSON string) nested too deeply."""
    body = where == "the request body"
    inside = f" (at {at})" if at and at != "the body" else ""
    return APIError(
        400,
        f"{where} nests JSON arrays and objects more than {MAX_DEPTH} levels deep{inside}; "
        f"chatkv serve takes at most {MAX_DEPTH}",
        "invalid_json" if body else "invalid_value",
        None if body else where,
    )


def loads(text: str | bytes, where: str = "the request body"):
    """``json.loads(text)``, its nesting bounded: a 400 naming ``where`` (and the path) when it is
    too deep. ValueError (not JSON) is the caller's to answer."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise nested_error(where) from None
    deep = too_deep(value)
    if deep is not None:
        raise nested_error(where, deep)
    return value


def check_count(items: list, where: str, what: str) -> None:
    if len(items) > MAX_MESSAGES:
        raise bad_value(where, f"{where} holds {len(items)} {what}; chatkv serve takes at most {MAX_MESSAGES}")


def check_text_size(messages: list[dict], context: int, where: str = "messages") -> None:
    """A 400 ``context_length_exceeded`` when the messages' text cannot fit ``context`` tokens."""
    limit = context * CHARS_PER_TOKEN
    total = 0
    for m in messages:
        c = m.get("content")
        total += len(c) if isinstance(c, str) else 0
    if total > limit:
        raise APIError(
            400,
            f"{total} characters of text in {where}: more than this model's context of {context} tokens "
            f"can take (at most {limit} characters); send less text",
            "context_length_exceeded",
            where,
        )
