"""Tools a model can call: specs from Python callables or OpenAI-style JSON specs,
the constraint that forces a call (``tool_choice="required"`` or a named function), the parsing
of a reply's tool calls, the tool results as messages, and the loop that runs callables.

The chat template renders the specs (``chatkv.sessions.template``). A call is read in the format the
template itself writes calls in: Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
when the template has ``<tool_call>``, else one bare JSON object ``{"name": ..., "arguments": ...}``.
Every failure of the caller's input is an ``InvalidRequest`` naming where it is.

(A few lines past 400 on purpose: the specs, the forcing constraint, the parsing and the loop
are one tool-call format, written and read in one place.)
"""

from __future__ import annotations

import inspect
import json
import re
import secrets
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from chatkv.errors import InvalidRequest, ToolStepLimit  # noqa: F401  (ToolStepLimit: also importable from here)

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name (MCP tools' names too)
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
tagged_calls = _TAGGED  # the Hermes/Qwen call markup, for a stream that splits text from calls
HERMES = "hermes"  # <tool_call>...</tool_call>
BARE = "json"  # one JSON object


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    fn: Callable | None = None  # the Python callable (run_tools runs it); None for a JSON spec

    def spec(self) -> dict:
        """The OpenAI-style spec the chat template renders (an MCP server's tool too: tui/mcp_tools.py)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict  # parsed JSON

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


# -- specs ---------------------------------------------------------------------------------

_SIMPLE = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
    type(None): "null",
}


def _schema_of_type(t: Any, where: str) -> dict:
    if t is inspect.Parameter.empty or t is Any:
        return {}
    if t in _SIMPLE:
        return {"type": _SIMPLE[t]}
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of_type(a, where) for a in args]}
    if origin in (list, tuple, set, Sequence) or origin is getattr(typing, "List", None):
        return {"type": "array", "items": _schema_of_type(args[0], where)} if args else {"type": "array"}
    if origin in (dict, Mapping):
        return {"type": "object"}
    raise InvalidRequest(
        f"{where}: the type {t!r} has no JSON schema; use str, int, float, bool, list, dict, "
        f"Literal or Optional of these, or give the tool as a JSON spec"
    )


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """The docstring's first paragraph, and per-argument lines of an ``Args:`` section."""
    doc = inspect.getdoc(fn) or ""
    head = doc.split("\n\n", 1)[0].strip()
    args: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if m:
        for line in m.group(1).splitlines():
            a = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line)
            if a:
                args[a.group(1)] = a.group(2).strip()
    return head, args


def tool_from_callable(fn: Callable, where: str = "tool") -> Tool:
    """A tool from a Python function: its name, its docstring's first paragraph, a JSON schema
    of its parameters from the signature's annotations (a default makes one optional)."""
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest(f"{where}: a callable tool needs a name of letters, digits, '_' or '-' (got {name!r})")
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise InvalidRequest(f"{where} ({name}): its signature cannot be read: {e}") from None
    head, described = _doc_parts(fn)
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise InvalidRequest(f"{where} ({name}): *{p.name} has no JSON schema; name each argument")
        s = _schema_of_type(hints.get(p.name, p.annotation), f"{where} ({name}).{p.name}")
        if p.name in described:
            s["description"] = described[p.name]
        props[p.name] = s
        if p.default is p.empty:
            required.append(p.name)
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return Tool(name=name, description=head, parameters=params, fn=fn)


def tool_from_spec(spec: Any, where: str = "tool") -> Tool:
    """A tool from an OpenAI-style spec: ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` (or the inner ``function`` object alone)."""
    if not isinstance(spec, Mapping):
        raise InvalidRequest(f"{where}: a tool is a Python callable or a JSON object, got {type(spec).__name__}")
    if "function" in spec or "type" in spec:
        if spec.get("type", "function") != "function":
            raise InvalidRequest(f"{where}.type: only 'function' tools are supported, got {spec.get('type')!r}")
        fn, where = spec.get("function"), f"{where}.function"
        if not isinstance(fn, Mapping):
            raise InvalidRequest(f"{where}: must be an object with a 'name'")
    else:
        fn = spec
    name = fn.get("name")
    if name is None:
        raise InvalidRequest(f"{where}.name: a tool needs a name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest(f"{where}.name: must be 1-64 letters, digits, '_' or '-', got {name!r}")
    desc = fn.get("description", "")
    if not isinstance(desc, str):
        raise InvalidRequest(f"{where}.description: must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise InvalidRequest(f"{where}.parameters: must be a JSON schema object")
    try:
        params = json.loads(json.dumps(params))
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{where}.parameters: not JSON-serialisable: {e}") from None
    from chatkv.engine.constraints import Constraint, check  # the schema is checked as the engine will enforce it

    try:
        check(Constraint("json_schema", json.dumps(params, sort_keys=True)))
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}.parameters: {e}") from None
    return Tool(name=name, description=desc, parameters=params)


def tools_of(tools: Any) -> list[Tool]:
    """``tools`` (a list of callables and JSON specs) as Tools; names must be unique."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequest("tools must be a list of Python callables or tool specs")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        out.append(
            t if isinstance(t, Tool) else tool_from_callable(t, where) if callable(t) else tool_from_spec(t, where)
        )
    seen = set()
    for i, t in enumerate(out):
        if t.name in seen:
            raise InvalidRequest(f"tools[{i}].name: '{t.name}' is given twice")
        seen.add(t.name)
    return out


# -- tool_choice: the constraint that forces a call ------------------------------------------


def chosen(tools: list[Tool], tool_choice: Any) -> list[Tool] | None:
    """The tools a reply must call one of (None: it may answer in text)."""
    if tool_choice in ("auto", "none", None):
        return None
    if tool_choice == "required":
        if not tools:
            raise InvalidRequest("tool_choice: 'required' needs tools")
        return tools
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise InvalidRequest(
                "tool_choice: must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}"
            )
    if not isinstance(name, str):
        raise InvalidRequest(
            f"tool_choice: must be 'auto', 'none', 'required' or a function's name, got {tool_choice!r}"
        )
    match = [t for t in tools if t.name == name]
    if not match:
        raise InvalidRequest(f"tool_choice.function.name: no tool is named '{name}'")
    return match


def call_format(chat_template: str | None) -> str:
    return HERMES if chat_template and "<tool_call>" in chat_template else BARE


def call_schema(tools: list[Tool]) -> dict:
    """A JSON schema of one call of any of ``tools``."""
    one = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return one[0] if len(one) == 1 else {"anyOf": one}


def forcing(tools: list[Tool], fmt: str) -> dict:
    """SamplingParams fields that make a reply one or more calls of ``tools`` (it always parses)."""
    schema = call_schema(tools)
    if fmt == BARE:
        return {"json_schema": schema}
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # as json_schema's
    body = json.dumps({**schema, "x-guidance": compact})  # in order: "name" before "arguments"
    return {"grammar": f'start: call ("\\n" call)*\ncall: "<tool_call>\\n" args "\\n</tool_call>"\nargs: %json {body}'}


# -- parsing a reply -------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _one_call(obj: Any, known: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in known:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), name=obj["name"], arguments=args)


def parse_calls(text: str, tools: list[Tool], fmt: str) -> tuple[str, list[ToolCall]]:
    """The text outside any calls, and the calls in ``text`` (of known tools, with JSON arguments)."""
    known = {t.name for t in tools}
    calls: list[ToolCall] = []
    if fmt == HERMES:
        for body in _TAGGED.findall(text):
            try:
                c = _one_call(json.loads(body), known)
            except ValueError:
                c = None
            if c is not None:
                calls.append(c)
        return (_TAGGED.sub("", text).strip() if calls else text), calls
    try:
        c = _one_call(json.loads(text), known)
    except ValueError:
        return text, []
    return ("", [c]) if c is not None else (text, [])


# -- results ---------------------------------------------------------------------------------


def result_messages(results: Any, pending: Mapping[str, ToolCall]) -> list[dict]:
    """``{call_id: result}`` as the ``role: "tool"`` messages a template renders: each id one of
    ``pending`` (the last reply's calls), each result a str or JSON-serialisable."""
    if not isinstance(results, Mapping) or not results:
        raise InvalidRequest("tool results must be a non-empty dict of {call_id: result}")
    out = []
    for cid, value in results.items():
        if cid not in pending:
            known = ", ".join(sorted(pending)) or "none: the last reply called no tool"
            raise InvalidRequest(f"tool result for unknown call id {cid!r} (the calls awaiting results: {known})")
        if isinstance(value, str):
            content = value
        else:
            try:
                content = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise InvalidRequest(
                    f"tool result for {cid!r} ({pending[cid].name}) is not JSON-serialisable: {e}"
                ) from None
        out.append({"role": "tool", "content": content, "tool_call_id": cid, "name": pending[cid].name})
    return out


def run_call(tool: Tool | None, call: ToolCall) -> Any:
    """Run a call's callable; an exception it raises is its result (the model reads the error)."""
    if tool is None or tool.fn is None:
        raise InvalidRequest(
            f"tool '{call.name}' has no Python callable to run; give its result with send_tool_results"
        )
    try:
        return tool.fn(**call.arguments)
    except Exception as e:  # noqa: BLE001 - reported to the model, as OpenAI's examples do
        return {"error": f"{type(e).__name__}: {e}"}


# -- a session turn's options ------------------------------------------------------------------


class TurnOptions:
    """What ``json_schema``, ``tools`` and ``tool_choice`` make of one session turn: its
    SamplingParams, how its new message renders, and what its Reply gains (``finish``)."""

    def __init__(
        self,
        session: Any,
        renderer: Any,
        params: Any,
        json_schema: Any = None,
        tools: Any = None,
        tool_choice: Any = "auto",
    ):
        import dataclasses

        self.s, self.renderer = session, renderer
        self.tools = tools_of(tools) if tools is not None else []
        if tool_choice not in ("auto", "none") and not self.tools:
            raise InvalidRequest(f"tool_choice {tool_choice!r} needs tools")
        self.choice = tool_choice
        self.specs = [t.spec() for t in self.tools]
        self.fmt = call_format(getattr(renderer.tokenizer, "chat_template", None))
        if self.specs and not renderer.renders_tools(self.specs):
            raise InvalidRequest("the model's chat template does not render tools (it has no 'tools' support)")
        extra: dict = {}
        if json_schema is not None:
            extra["json_schema"] = json_schema
        forced = chosen(self.tools, tool_choice) if self.tools else None
        if forced is not None:
            if extra:
                raise InvalidRequest("json_schema cannot be combined with a tool_choice that forces a call")
            extra.update(forcing(forced, self.fmt))
        if extra and params.constrained:
            raise InvalidRequest(
                "params already carry a constraint; give json_schema or a forcing tool_choice, not both"
            )
        self.params = dataclasses.replace(params, **extra) if extra else params
        self.wants_json = json_schema is not None or params.json_object or params.json_schema is not None
        self.key = json.dumps(self.specs, sort_keys=True) if self.specs else None

    def render(self, tokens: list[int], system: str | None, content: str) -> list[int]:
        """The new user message's tokens, the tools rendered by the template: in the first
        prompt, or later as the template's tool block when the conversation has not seen them."""
        if not tokens:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": content}
            ]
            return self.renderer.first(messages, self.specs or None)
        new = self.key is not None and self.key != getattr(self.s, "tools_seen", None)
        return self.renderer.user_turn(content, self.specs if new else None)

    def turn_options(self) -> dict:
        return {"render": self.render} if self.specs else {}

    def finish(self, reply: Any) -> Any:
        """The Reply with ``parsed`` and ``tool_calls``; the session learns the calls awaiting results."""
        if self.wants_json and reply.finish_reason == "stop":
            try:
                reply.parsed = json.loads(reply.text)
            except ValueError:  # a stop string cut it: not valid
                reply.parsed = None
        if self.specs:
            self.s.tools_seen = self.key
            self.s.tools = self.tools
            if self.choice != "none" and reply.finish_reason in ("stop", "length"):
                _, reply.tool_calls = parse_calls(reply.text, self.tools, self.fmt)
        self.s.pending_calls = {c.id: c for c in reply.tool_calls}
        return reply


def run_loop(
    session: Any, text: str, tools: Any, params: Any = None, *, tool_choice: Any = "auto", max_steps: int = 5
) -> Any:
    """Ask ``text``; while the reply calls tools, run their callables and send the results back
    (the first step with ``tool_choice``, the later ones "auto"). The Reply that answers in
    text; ToolStepLimit when ``max_steps`` replies all called tools."""
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise InvalidRequest(f"max_steps must be an int >= 1, got {max_steps!r}")
    listed = tools_of(tools)
    for t in listed:
        if t.fn is None:
            raise InvalidRequest(f"run_tools runs Python callables; tool '{t.name}' is a JSON spec")
    by_name = {t.name: t for t in listed}
    reply = session.send(text, params, tools=listed, tool_choice=tool_choice)
    for _ in range(max_steps - 1):
        if not reply.tool_calls:
            return reply
        results = {c.id: run_call(by_name.get(c.name), c) for c in reply.tool_calls}
        reply = session.send_tool_results(results, params, tools=listed)
    if reply.tool_calls:
        raise ToolStepLimit(f"the model still called tools after {max_steps} steps", reply=reply)
    return reply
