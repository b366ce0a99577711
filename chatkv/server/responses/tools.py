"""Structured output and function tools on ``/v1/responses``, in the Responses API's
own shapes (the chat completions forms are ``tool_calls.py``):

- ``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "name": ..., "schema": {...}, "strict": ...}``; the schema is a constraint of the request's
  SamplingParams, as ``response_format`` is on chat completions (an output that ends by stop is
  valid). ``response_format`` itself is refused, naming ``text.format``, as OpenAI refuses it.
- ``tools``: function tools, flat (``{"type": "function", "name", "description", "parameters",
  "strict"}``), and ``tool_choice`` ``auto``, ``none``, ``required`` or ``{"type": "function",
  "name": ...}``. The reply's calls are ``function_call`` output items (``call_id``, ``name``,
  ``arguments`` as a JSON string); their results come back as ``function_call_output`` input
  items, and earlier calls as ``function_call`` input items.
- Tools and function call items are taken with ``store=false`` (the whole input sent each
  time, as a stateless chat completion): a stored chain of responses does not hold tool calls
  yet, so with ``store`` true they are a 400 that says so.

Every refusal is an OpenAI-shaped 400 whose ``param`` is the path of the problem
(``text.format.schema``, ``tools[1].name``, ``input[3].call_id``, ...).
"""

from __future__ import annotations

import json
import uuid

from chatkv.errors import InvalidRequest
from chatkv.server.errors import APIError, bad_value, unsupported
from chatkv.server.tool_calls import call_arguments, path_of, schema_fields
from chatkv.sessions.tools import ToolCall, tools_of

FUNCTION_ITEMS = ("function_call", "function_call_output")
STORED_TOOLS = (
    "tools on /v1/responses are taken with store=false (a stored chain of responses does not hold "
    "tool calls yet): send store=false with the whole input, function_call and function_call_output "
    "items included"
)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def text_format(body: dict) -> tuple[dict, dict]:
    """(SamplingParams fields, the ``text`` object the response repeats) of ``text.format``."""
    if body.get("response_format") is not None:
        raise unsupported(
            "response_format",
            "Unsupported parameter: 'response_format'. In the Responses API, this "
            "parameter has moved to 'text.format'.",
        )
    text = body.get("text")
    if text is None:
        return {}, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad_value("text", f"text must be an object, got {_short(text)}")
    for k in text:
        if k not in ("format", "verbosity"):
            raise APIError(400, f"Unknown parameter: 'text.{k}'.", "unknown_parameter", f"text.{k}")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_value("text.format", f"text.format must be an object, got {_short(fmt)}")
    kind = fmt.get("type")
    echo = {"format": dict(fmt), **({"verbosity": text["verbosity"]} if "verbosity" in text else {})}
    if kind == "text":
        return {}, echo
    if kind == "json_object":
        return {"json_object": True}, echo
    if kind != "json_schema":
        raise bad_value(
            "text.format.type", f"text.format.type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}"
        )
    name = fmt.get("name")
    if name is None:
        raise APIError(400, "Missing required parameter: 'text.format.name'.", "missing_parameter", "text.format.name")
    if not isinstance(name, str) or not name:
        raise bad_value("text.format.name", f"text.format.name must be a non-empty string, got {_short(name)}")
    for field, kinds, what in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if fmt.get(field) is not None and not isinstance(fmt[field], kinds):
            raise bad_value(f"text.format.{field}", f"text.format.{field} must be {what}")
    if "schema" not in fmt:
        raise APIError(
            400, "Missing required parameter: 'text.format.schema'.", "missing_parameter", "text.format.schema"
        )
    return schema_fields(fmt["schema"], "text.format.schema"), echo


def tools(body: dict, store: bool) -> tuple[list, object, list]:
    """(the request's tools as chatkv.sessions.tools.Tool, its tool_choice in chat completions' form, the
    tools as the response repeats them)."""
    raw, choice = body.get("tools"), body.get("tool_choice", "auto")
    if raw is None or raw == []:
        if choice not in (None, "auto", "none"):
            raise bad_value("tool_choice", "tool_choice needs tools")
        return [], "none", []
    if not isinstance(raw, list):
        raise bad_value("tools", f"tools must be an array of function tools, got {_short(raw)}")
    if store:
        raise unsupported("tools", STORED_TOOLS)
    flat = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise bad_value(f"tools[{i}]", f"tools[{i}] must be an object, got {_short(t)}")
        if t.get("type") != "function":
            raise unsupported(
                f"tools[{i}].type", f"tools[{i}].type: only function tools are supported, got {_short(t.get('type'))}"
            )
        if "function" in t:
            raise bad_value(
                f"tools[{i}].function",
                f"tools[{i}]: the Responses API takes a function tool flat "
                "({'type': 'function', 'name', 'description', 'parameters'}), "
                "not under 'function'",
            )
        if t.get("strict") is not None and not isinstance(t["strict"], bool):
            raise bad_value(f"tools[{i}].strict", f"tools[{i}].strict must be a boolean")
        inner = {"name": t.get("name")}
        if t.get("description") is not None:
            inner["description"] = t["description"]
        if t.get("parameters") is not None:
            inner["parameters"] = t["parameters"]
        flat.append(inner)
    try:
        listed = tools_of(flat)
    except InvalidRequest as e:
        raise bad_value(path_of(e, "tools"), str(e)) from None
    names = {t.name for t in listed}
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise unsupported(
                "tool_choice.type", f"tool_choice.type: only 'function' is supported, got {_short(choice.get('type'))}"
            )
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_value("tool_choice.name", "tool_choice.name must be the name of one of the tools")
        if name not in names:
            raise bad_value("tool_choice.name", f"tool_choice.name: no tool is named {name!r}")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in ("auto", "none", "required"):
        raise bad_value(
            "tool_choice",
            f"tool_choice must be 'auto', 'none', 'required' or "
            f"{{'type': 'function', 'name': ...}}, got {_short(choice)}",
        )
    echo = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description or None,
            "parameters": t.parameters,
            "strict": raw[i].get("strict"),
        }
        for i, t in enumerate(listed)
    ]
    return listed, choice, echo


def input_item(i: int, item: dict, kind: str, out: list[dict], store: bool) -> None:
    """Append a ``function_call`` (to an assistant message's ``tool_calls``) or a
    ``function_call_output`` (a ``tool`` message) input item to the chat messages ``out``."""
    where = f"input[{i}]"
    if store:
        raise unsupported(f"{where}.type", f"{where} is of type {kind!r}: {STORED_TOOLS}")
    cid = item.get("call_id")
    if not isinstance(cid, str) or not cid:
        raise bad_value(f"{where}.call_id", f"{where}.call_id must be the id of a function call")
    if kind == "function_call_output":
        output = item.get("output")
        if isinstance(output, list):
            if not all(
                isinstance(p, dict)
                and p.get("type") in ("input_text", "output_text")
                and isinstance(p.get("text"), str)
                for p in output
            ):
                raise unsupported(f"{where}.output", f"{where}.output: only text parts (input_text) are supported")
            output = "\n".join(p["text"] for p in output)
        if not isinstance(output, str):
            raise bad_value(f"{where}.output", f"{where}.output must be a string, got {_short(output)}")
        out.append({"role": "tool", "content": output, "tool_call_id": cid, "item": i})
        return
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise bad_value(f"{where}.name", f"{where}.name: a function call needs a name")
    args = call_arguments(item.get("arguments", "{}"), f"{where}.arguments")
    call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
    if out and out[-1]["role"] == "assistant":  # a reply's text, or its calls before this one
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def check_call_ids(messages: list[dict]) -> None:
    """Each function_call_output answers a function_call before it; the item indices dropped."""
    seen: set[str] = set()
    for m in messages:
        for c in m.get("tool_calls") or ():
            seen.add(c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in seen:
            raise bad_value(
                f"input[{m['item']}].call_id",
                f"input[{m['item']}].call_id {m['tool_call_id']!r} answers no function_call item before it",
            )
    for m in messages:
        m.pop("item", None)


def call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict:
    """A ``function_call`` output item."""
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid5(uuid.NAMESPACE_OID, call.id).hex,
        "call_id": call.id,
        "name": call.name,
        "arguments": json.dumps(call.arguments) if arguments is None else arguments,
        "status": status,
    }
