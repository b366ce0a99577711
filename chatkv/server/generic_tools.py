"""Tool calls on a model whose chat template has no tools (SmolLM2's, the packaged default's): a
generic format, as llama-server has one, written in plain messages the template can hold.

- The tools are described in a system message (appended to the conversation's own system
  message, or one of its own first): each tool's name, description and JSON-schema parameters,
  and the one form a call takes, a JSON object alone on the reply::

      {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}

- The reply is constrained (a lark grammar, chatkv.engine.constraints): with ``tool_choice``
  "auto", either one such call or plain text that does not begin with ``{``; with "required" or
  a named function, exactly one call of the tools it allows. One call per reply.
- The history: an assistant message's calls become a sentence each, ``I called <name> with
  <arguments as JSON>.`` (after its text, if any); a ``tool`` message becomes a user message
  ``Tool result (<name>): <content>``. Not the call's JSON: shown its own earlier call in that
  form, the default model repeats it instead of answering from the result (9 replies of 9 in a
  trial, greedy and sampled; with the sentence, 9 of 9 were text).

Whether a template renders tools is decided once per template text (``is_generic``): the render
of a one-message conversation with a probe tool against the render without it.
"""

from __future__ import annotations

import functools
import json

from chatkv.sessions.tools import ToolCall, call_schema, new_call_id

GENERIC = "generic"  # the call format of a template without tools (chatkv.sessions.tools: "hermes", "json")
_MARK = "\u2063chatkv-probe\u2063"
_PROBE = [
    {
        "type": "function",
        "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
    }
]


def is_generic(chat_template) -> bool:
    """Whether ``chat_template`` (its text) ignores ``tools``: it renders a user message and the
    same text with tools. One that writes calls in ``<tool_call>`` markup, or cannot render that
    conversation, counts as rendering them (it keeps its own format and refusals), as does no
    template or one that is not a single text."""
    if not isinstance(chat_template, str) or not chat_template or "<tool_call>" in chat_template:
        return False
    return _ignores_tools(chat_template)


@functools.lru_cache(maxsize=16)
def _ignores_tools(chat_template: str) -> bool:
    from transformers.utils.chat_template_utils import render_jinja_template

    one = [[{"role": "user", "content": _MARK}]]
    try:
        plain = render_jinja_template(one, chat_template=chat_template, add_generation_prompt=True)[0][0]
        withs = render_jinja_template(one, tools=_PROBE, chat_template=chat_template, add_generation_prompt=True)[0][0]
    except Exception:  # noqa: BLE001 - a template that raises for this probe: left to its own handling
        return False
    return _MARK in plain and plain == withs


def system_text(specs: list[dict]) -> str:
    """The system message's part that describes ``specs`` (OpenAI-style tool specs) and the call format."""
    lines = ["You can call these tools:", ""]
    for s in specs:
        fn = s["function"]
        lines.append(f"- {fn['name']}: {fn.get('description') or '(no description)'}")
        lines.append(f"  parameters (JSON schema): {json.dumps(fn.get('parameters', {}), ensure_ascii=False)}")
    lines += [
        "",
        "To call a tool, reply with only this JSON object and nothing else:",
        '{"tool_call": {"name": "<tool name>", "arguments": {<the arguments, as its parameters say>}}}',
        "Otherwise answer in plain text.",
    ]
    return "\n".join(lines)


def call_text(name: str, arguments: dict) -> str:
    """An earlier call as the history shows it."""
    return f"I called {name} with {json.dumps(arguments, ensure_ascii=False)}."


def messages(msgs: list[dict], specs: list[dict] | None) -> list[dict]:
    """``msgs`` (chatkv.server.schemas' shapes: assistant ``tool_calls``, ``tool`` messages) as
    plain system/user/assistant messages, with the tools' system text when ``specs`` are given."""
    names: dict[str, str] = {}
    out: list[dict] = []
    for m in msgs:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            name = names.get(m.get("tool_call_id"), "tool")
            out.append({"role": "user", "content": f"Tool result ({name}): {content}"})
            continue
        calls = m.get("tool_calls") or ()
        if calls:
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            text = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls)
            content = f"{content}\n{text}" if content else text
        out.append({"role": role, "content": content})
    if specs:
        tools = system_text(specs)
        if out and out[0]["role"] == "system":
            own = out[0]["content"]
            out[0] = {"role": "system", "content": f"{own}\n\n{tools}" if own else tools}
        else:
            out.insert(0, {"role": "system", "content": tools})
    return out


def grammar(tools: list, forced: bool) -> str:
    """The lark grammar of a reply: one call of ``tools`` (chatkv.sessions.tools.Tool, their
    parameters' ``$ref`` pointers already placed under ``#/properties/tool_call``), or, unless
    ``forced``, text that does not begin with ``{`` (or nothing)."""
    schema = {
        "type": "object",
        "properties": {"tool_call": call_schema(tools)},
        "required": ["tool_call"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    call = f"call: %json {json.dumps(schema)}"
    if forced:
        return f"start: call\n{call}"
    return f"start: call | TEXT | \n{call}\nTEXT: /[^{{][\\s\\S]*/"


ROOT = "#/properties/tool_call"  # where call_schema sits in grammar()'s schema


def parse(text: str, tools: list) -> tuple[str | None, list[ToolCall]]:
    """The reply's content and calls: a reply that is one call of a known tool is (None, [call]);
    anything else is text."""
    body = text.strip()
    if not body.startswith("{"):
        return text, []
    try:
        obj = json.loads(body)
    except ValueError:
        return text, []
    call = obj.get("tool_call") if isinstance(obj, dict) and len(obj) == 1 else None
    known = {t.name for t in tools}
    if not isinstance(call, dict) or call.get("name") not in known or not isinstance(call.get("arguments"), dict):
        return text, []
    return None, [ToolCall(id=new_call_id(), name=call["name"], arguments=call["arguments"])]
