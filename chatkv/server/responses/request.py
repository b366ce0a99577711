"""The Responses API's request bodies (``POST /v1/responses``), validated by hand as the other
bodies are (``schemas.py``: a 400 naming the field), and the response ids.

A stored response is a node of a conversation tree: ``resp_<conversation id>_<message id>``,
where the message is the response's input, the user message its request added; its output is
that message's first assistant reply. The id names the user message, not the reply, because a
stream announces its id (``response.created``) before the reply is stored. Both parts are
checked strictly (32 hex digits, a positive integer), so nothing else is ever looked up. A
response made with ``store=false`` is ``resp_<48 hex digits>``: it names nothing, and is never
found (404 on GET, 400 ``previous_response_not_found`` as ``previous_response_id``).

Taken besides OpenAI's own fields: chatkv's sampling extensions ``top_k``,
``repetition_penalty``, ``seed``. Accepted and changing nothing: ``user`` (the API key says
whose request it is), ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``parallel_tool_calls``, ``max_tool_calls``, ``stream_options``; ``metadata`` is validated and
echoed in the response made, not stored. ``text.format`` (json_object, json_schema) and
function ``tools`` with ``function_call`` / ``function_call_output`` input items (store=false):
``resp_tools.py``. Refused as ``unsupported_parameter``: ``reasoning``, ``include``,
``background``, ``top_logprobs``, ``conversation`` and ``prompt`` objects, non-function tools,
and non-text input (images, files).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from dataclasses import dataclass, field

from chatkv.engine.sampling import SamplingParams
from chatkv.server import limits
from chatkv.server.errors import APIError, bad_value, unsupported
from chatkv.server.responses import tools as resp_tools
from chatkv.server.schemas import (
    ROLES,
    bool_field,
    check_fields,
    is_int,
    max_tokens_field,
    model_field,
    refuse_unless,
    sampling_params,
)

RESPONSE_FIELDS = {
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "stream_options",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "user",
    "metadata",
    "truncation",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tool_calls",
    "text",
    "reasoning",
    "include",
    "service_tier",
    "top_logprobs",
    "background",
    "prompt_cache_key",
    "safety_identifier",
    "conversation",
    "prompt",
    "response_format",  # refused, naming text.format (resp_tools.py)
}
STORED_ID = re.compile(r"resp_([0-9a-f]{32})_([1-9][0-9]{0,17})")
TEXT_PARTS = {"input_text", "output_text", "text"}


@dataclass
class ResponsesRequest:
    model: str | None  # None: not given (schemas._model)
    messages: list[dict]  # [{"role": system|user|assistant, "content": str}], the last the user's
    params: SamplingParams
    max_output_tokens: int | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict = field(default_factory=dict)
    echo: dict = field(default_factory=dict)  # request fields the response object repeats
    tools: list = field(default_factory=list)  # chatkv.sessions.tools.Tool (resp_tools.py; store=false only)
    tool_choice: object = "none"  # in chat completions' form


def stored_id(conv_id: str, message_id: int) -> str:
    return f"resp_{conv_id}_{message_id}"


def unstored_id() -> str:
    return "resp_" + uuid.uuid4().hex + uuid.uuid4().hex[:16]


def parse_id(response_id) -> tuple[str, int] | None:
    """(conversation id, input message id) of a stored response's id, or None."""
    m = STORED_ID.fullmatch(response_id) if isinstance(response_id, str) else None
    return (m.group(1), int(m.group(2))) if m else None


def short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def previous_not_found(response_id: str) -> APIError:
    """The one answer for a previous_response_id that is unknown, another user's, or store=false's."""
    return APIError(
        400,
        f"Previous response with id '{short(response_id)}' not found.",
        "previous_response_not_found",
        "previous_response_id",
    )


def response_not_found(response_id: str) -> APIError:
    """The one answer (GET, DELETE) for a response id that is unknown, another user's, or store=false's."""
    return APIError(404, f"Response with id '{short(response_id)}' not found.", "response_not_found", "response_id")


def _content(where: str, c) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list) and c:
        texts = []
        for j, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if not isinstance(part, dict) or kind not in TEXT_PARTS:
                raise unsupported(
                    f"{where}.content[{j}]",
                    f"{where}.content[{j}] is of type {kind!r}: only text parts (input_text) are supported",
                )
            if not isinstance(part.get("text"), str):
                raise bad_value(f"{where}.content[{j}].text", f"{where}.content[{j}].text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_value(
        f"{where}.content",
        f"{where}.content must be a string or a non-empty list of input_text parts, got {short(repr(c))}",
    )


def _input(body: dict, store: bool) -> list[dict]:
    inp = body.get("input")
    if inp is None:
        raise APIError(400, "input is required", "missing_parameter", "input")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad_value("input", "input must be a string or a non-empty list of message items")
    limits.check_count(inp, "input", "items")
    out = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_value(where, f"{where} must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind in resp_tools.FUNCTION_ITEMS:
            resp_tools.input_item(i, item, kind, out, store)
            continue
        if kind != "message":
            raise unsupported(
                f"{where}.type",
                f"{where} is of type {kind!r}: only message, function_call and "
                "function_call_output items are supported",
            )
        role = item.get("role")
        if role not in ROLES:
            raise bad_value(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)}, got {short(repr(role))}")
        out.append({"role": ROLES[role], "content": _content(where, item.get("content"))})
    if out[-1]["role"] not in ("user", "tool"):
        raise bad_value(
            "input",
            f"the last input item must be the user's message or a function_call_output, got {out[-1]['role']!r}",
        )
    resp_tools.check_call_ids(out)
    return out


def _metadata(body: dict) -> dict:
    md = body.get("metadata")
    if md is None:
        return {}
    if (
        not isinstance(md, dict)
        or len(md) > 16
        or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in md.items())
    ):
        raise bad_value(
            "metadata",
            "metadata must be an object of at most 16 string values (keys up to 64 characters, values up to 512)",
        )
    return dict(md)


def _optional_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_value(name, f"{name} must be a string, got {short(repr(v))}")
    return v


def parse_responses(body: dict) -> ResponsesRequest:
    check_fields(body, RESPONSE_FIELDS)
    model = model_field(body)
    store = body.get("store")
    if store is None:
        store = True
    elif not isinstance(store, bool):
        raise bad_value("store", f"store must be a boolean, got {short(repr(store))}")
    messages = _input(body, store)
    instructions = _optional_str(body, "instructions")
    prev = _optional_str(body, "previous_response_id")
    if prev == "":
        raise bad_value("previous_response_id", "previous_response_id must be a non-empty string")
    for name in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        _optional_str(body, name)
    stream = bool_field(body, "stream")
    if body.get("stream_options") is not None and not stream:
        raise bad_value("stream_options", "stream_options is only allowed when stream is true")
    bool_field(body, "parallel_tool_calls")
    listed, tool_choice, tools_echo = resp_tools.tools(body, store)
    constraint, text_echo = resp_tools.text_format(body)
    refuse_unless(body, "reasoning", lambda v: v == {} or (isinstance(v, dict) and not any(v.values())), "no reasoning")
    refuse_unless(body, "include", lambda v: v == [], "nothing to include")
    refuse_unless(body, "background", lambda v: v is False, "responses are answered in the request")
    refuse_unless(body, "top_logprobs", lambda v: v == 0, "no log probabilities")
    refuse_unless(body, "max_tool_calls", lambda v: is_int(v), "an integer, accepted and changing nothing")
    refuse_unless(body, "conversation", lambda v: False, "chain responses with previous_response_id")
    refuse_unless(body, "prompt", lambda v: False, "no stored prompt templates; send instructions and input")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise bad_value("truncation", f"truncation must be 'auto' or 'disabled', got {short(repr(truncation))}")
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty", "seed") if k in body}
    params = sampling_params(sampling)
    if constraint:
        params = dataclasses.replace(params, **constraint)
    echo = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "truncation": truncation,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice") or "auto",
        "user": body.get("user"),
        "tools": tools_echo,
        "text": text_echo,
    }
    return ResponsesRequest(
        model,
        messages,
        params,
        max_tokens_field(body, "max_output_tokens"),
        instructions,
        prev,
        store,
        stream,
        _metadata(body),
        echo,
        listed,
        tool_choice,
    )
