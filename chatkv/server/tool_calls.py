"""Structured output and tool calls on /v1/chat/completions: ``response_format``
(``json_object``, ``json_schema``) as a constraint of the request's SamplingParams; ``tools`` and
``tool_choice`` (auto, none, required, a named function; the forcing ones constrain the output
to calls, chatkv.sessions.tools); ``role: "tool"`` messages and assistant ``tool_calls`` in the history,
rendered by the model's own chat template; the reply's calls as ``message.tool_calls``. A template
without tools gets the generic format of ``generic_tools.py`` instead.

Every refusal is an OpenAI-shaped 400 whose ``param`` is the path of the problem.
"""

from __future__ import annotations

import dataclasses

from chatkv.errors import InvalidRequest
from chatkv.server import generic_tools, limits
from chatkv.server.errors import APIError, bad_value, unsupported
from chatkv.sessions.tools import ToolCall, call_format, chosen, forcing, parse_calls, tagged_calls, tools_of


def path_of(e: InvalidRequest, default: str) -> str:
    """chatkv.sessions.tools' messages start with the path ("tools[0].function.name: ..."); both faces'
    400s name it (resp_tools.py too)."""
    head = str(e).split(":", 1)[0]
    return head if " " not in head else default


def call_arguments(args, where: str) -> dict:
    """A tool call's ``arguments`` in a request's history (a JSON string, or an object) as the
    object the chat template renders; ``where`` is their path. Chat completions' assistant
    ``tool_calls`` and the Responses API's ``function_call`` items both come here."""
    try:
        args = limits.loads(args, where) if isinstance(args, str) else args  # nesting bounded: a 400
    except ValueError:
        raise bad_value(where, f"{where} is not JSON") from None
    if not isinstance(args, dict):
        raise bad_value(where, f"{where} must be a JSON object")
    return args


def response_format(body: dict) -> dict:
    """SamplingParams fields for ``response_format`` (empty for text)."""
    rf = body.get("response_format")
    if rf is None:
        return {}
    if not isinstance(rf, dict):
        raise bad_value("response_format", f"response_format must be an object, got {rf!r}")
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_value(
            "response_format.type", f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_value("response_format.json_schema", "response_format.json_schema must be an object with a 'schema'")
    name = js.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_value("response_format.json_schema.name", "response_format.json_schema.name must be a string")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_value("response_format.json_schema.strict", "response_format.json_schema.strict must be a boolean")
    return schema_fields(js.get("schema"), "response_format.json_schema.schema")


def schema_fields(schema, where: str) -> dict:
    """SamplingParams fields for the JSON schema ``schema`` found at ``where``: a 400 naming
    ``where`` if it is not one chatkv can enforce (invalid, or a keyword it cannot keep)."""
    if not isinstance(schema, dict):
        raise bad_value(where, f"{where} must be a JSON schema object")
    from chatkv.engine.sampling import SamplingParams

    try:
        SamplingParams(json_schema=schema).validate()
    except InvalidRequest as e:
        code = (
            "unsupported_parameter" if "Unimplemented" in str(e) or "unsupported" in str(e).lower() else "invalid_value"
        )
        raise APIError(400, f"{where}: {e}", code, where) from None
    return {"json_schema": schema}


def tools(body: dict) -> tuple[list, object]:
    """The request's tools (chatkv.sessions.tools.Tool) and its tool_choice."""
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, []):
            raise unsupported(name, f"{name} is the deprecated form; send tools and tool_choice")
    raw, choice = body.get("tools"), body.get("tool_choice", "auto")
    if raw is None or raw == []:
        if choice not in (None, "auto", "none"):
            raise bad_value("tool_choice", "tool_choice needs tools")
        return [], "none"
    try:
        listed = tools_of(raw)
        chosen(listed, choice if choice is not None else "auto")
    except InvalidRequest as e:
        where = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise bad_value(path_of(e, where), str(e)) from None
    return listed, choice if choice is not None else "auto"


def history_message(i: int, m: dict, role: str, content) -> dict:
    """A ``tool`` message or an assistant message with ``tool_calls``, as the template reads them."""
    if role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise bad_value(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id must be the id of a tool call")
        return {"role": "tool", "content": content, "tool_call_id": cid}
    calls = m.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise bad_value(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a non-empty array")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(fn, dict):
            raise bad_value(where, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_value(f"{where}.function.name", f"{where}.function.name: a tool call needs a name")
        args = call_arguments(fn.get("arguments", "{}"), f"{where}.function.arguments")
        out.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return {"role": "assistant", "content": content or "", "tool_calls": out}


def check_call_ids(messages: list[dict]) -> None:
    """Each tool message answers a call of an earlier assistant message."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            seen.add(c["id"])
        if m["role"] == "tool" and m["tool_call_id"] not in seen:
            raise bad_value(
                f"messages[{i}].tool_call_id",
                f"messages[{i}].tool_call_id {m['tool_call_id']!r} answers no tool call of an earlier message",
            )


def constrain(params, listed: list, choice, chat_template: str | None, parallel: bool = True):
    """``params`` with the constraint a forcing tool_choice needs (or as they are). ``parallel``
    False (``parallel_tool_calls: false``): the reply is exactly one call."""
    forced = chosen(listed, choice) if listed else None
    if generic_tools.is_generic(chat_template):
        return _generic_constraint(params, listed, choice, forced)
    if forced is None:
        return params
    if params.constrained:
        raise bad_value("tool_choice", "a tool_choice that forces a call cannot be combined with response_format")
    fields = forcing(_placed(listed, forced), call_format(chat_template))
    if not parallel and "grammar" in fields:
        fields["grammar"] = fields["grammar"].replace(_MANY_CALLS, "start: call", 1)
    return dataclasses.replace(params, **fields)


def _generic_constraint(params, listed: list, choice, forced: list | None):
    """The generic format's grammar (generic_tools.grammar): a forced call, or under "auto" a call
    or text (left as they are with response_format, whose constraint the reply keeps)."""
    if forced is None and (not listed or choice == "none" or params.constrained):
        return params
    if forced is not None and params.constrained:
        raise bad_value("tool_choice", "a tool_choice that forces a call cannot be combined with response_format")
    placed = _placed(listed, forced or listed, generic_tools.ROOT)
    return dataclasses.replace(params, grammar=generic_tools.grammar(placed, forced is not None))


_MANY_CALLS = 'start: call ("\\n" call)*'  # chatkv.sessions.tools.forcing's first rule: one call or more


def _placed(listed: list, forced: list, root: str = "#") -> list:
    """The forced tools as their parameters must be once nested in the call's schema
    (``chatkv.sessions.tools.call_schema``: ``{"properties": {"arguments": <parameters>}}``, under
    ``anyOf[i]`` for several tools; ``root``: where that schema sits): root-relative ``$ref``
    pointers (pydantic's ``#/$defs/...``) moved to where the parameters now are (the grammar
    bounds their numbers: chatkv.engine.constraints), and a schema no finite call satisfies
    refused with a 400 naming the tool."""
    from chatkv.engine.sampling import SamplingParams

    out = []
    for i, t in enumerate(forced):
        where = f"tools[{listed.index(t)}].function.parameters"
        try:  # the schema on its own: an unsupported keyword, or no finite value (a $ref loop)
            SamplingParams(json_schema=t.parameters).validate()
        except InvalidRequest as e:
            raise bad_value(where, f"{where}: {str(e).split(': ', 1)[-1]}") from None
        at = f"{root}/properties/arguments" if len(forced) == 1 else f"{root}/anyOf/{i}/properties/arguments"
        out.append(dataclasses.replace(t, parameters=_rebased(t.parameters, at)))
    return out


_VALUES = {"const", "enum", "default", "examples"}  # keywords holding JSON values, not schemas


def _rebased(schema, prefix: str):
    """A copy of ``schema`` whose local ``$ref`` pointers (``#``, ``#/...``) point into ``prefix``."""
    if isinstance(schema, list):
        return [_rebased(v, prefix) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = prefix + v[1:]
        else:
            out[k] = v if k in _VALUES else _rebased(v, prefix)
    return out


def specs(listed: list) -> list[dict] | None:
    return [t.spec() for t in listed] or None


def reply_calls(
    text: str, listed: list, choice, chat_template: str | None, parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """The reply's content (None when it is calls only) and its calls (the first only, when
    ``parallel`` is False)."""
    if not listed or choice == "none":
        return text, []
    if generic_tools.is_generic(chat_template):
        return generic_tools.parse(text, listed)
    content, calls = parse_calls(text, listed, call_format(chat_template))
    if not calls:
        return text, []
    if not parallel:
        calls = calls[:1]
    return (content or None), calls


def message(content: str | None, calls: list[ToolCall]) -> dict:
    return {"role": "assistant", "content": content, "refusal": None, "tool_calls": [c.as_openai() for c in calls]}


def deltas(calls: list[ToolCall]) -> list[dict]:
    """The stream's ``delta.tool_calls`` pieces: one per call, whole (id, name, arguments)."""
    return [{"tool_calls": [{"index": i, **c.as_openai()}]} for i, c in enumerate(calls)]


class CallStream:
    """A streamed reply that may hold tool calls: text before a call streams as content as it
    comes (only a tail that could begin ``<tool_call>`` waits); from the first call on it is held
    and read whole at the end. A template whose calls are bare JSON holds the whole reply; the
    generic format (generic_tools.py) holds a reply that begins with ``{`` and streams any other."""

    TAG = "<tool_call>"

    def __init__(self, chat_template: str | None):
        self.text, self.sent = "", 0
        self.generic = generic_tools.is_generic(chat_template)
        self.holding = not self.generic and call_format(chat_template) != "hermes"
        self.plain = False  # a generic reply that began as text: all of it is content

    def feed(self, piece: str) -> str:
        """What may be sent as content now."""
        self.text += piece
        if self.holding:
            return ""
        if self.generic and not self.plain:
            lead = self.text.lstrip()
            if not lead:
                return ""
            self.plain, self.holding = not lead.startswith("{"), lead.startswith("{")
            if self.holding:
                return ""
        if self.plain:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        at = self.text.find(self.TAG, self.sent)
        if at >= 0:
            end, self.holding = at, True
        else:
            keep = next((k for k in range(len(self.TAG) - 1, 0, -1) if self.text.endswith(self.TAG[:k])), 0)
            end = len(self.text) - keep
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self, calls) -> tuple[str, list[ToolCall]]:
        """The content not yet sent, and the reply's calls (``calls``: text -> (content, calls))."""
        _, found = calls(self.text)
        rest = self.text[self.sent :]
        if found:
            rest = "" if self.generic else tagged_calls.sub("", rest).strip()
        return rest, found
