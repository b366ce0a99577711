"""Token deltas of a conversation: render the chat template for new messages only.

A session's history is a list of token ids that only grows. Each turn appends
the tokens of the new user message (with the assistant's generation prompt),
the generated tokens verbatim, and the template's end-of-turn tokens. History
is never re-rendered or re-tokenised, so a template that rewrites earlier turns
(e.g. strips a thinking section) or a reply that would tokenise differently on
a second pass cannot break the cached prefix.

Deltas are cut out of renders of a fixed reference conversation: the text a
template adds for one more user message after a closed assistant turn.

Every failure is an ``InvalidRequest``: text that is not valid Unicode (a lone
surrogate), a template that raises for a conversation (``raise_exception``, e.g.
a template without a system role), a template that rewrites earlier turns.
"""

from __future__ import annotations

from jinja2 import TemplateError  # what a template's raise_exception() raises (a dependency of chatkv)

from chatkv.engine import text_tokens
from chatkv.errors import InvalidRequest, check_text

_MARK = "\u2063chatkv-reply\u2063"


class TurnRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the model's tokenizer has no chat template; sessions need one")
        system = [{"role": "system", "content": "S"}]
        try:
            self._render(system + [{"role": "user", "content": "U"}], True)
        except InvalidRequest:
            system = []  # a template without a system role (it raises for one): the reference has none
        base = system + [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}]
        closed = self._render(base, False)
        at = closed.index(_MARK) + len(_MARK)
        self._closing = self._encode(closed[at:])
        self._base = base[:-1] + [{"role": "assistant", "content": "A"}]
        self._base_text = self._render(self._base, False)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if tools:
            self._check_tools(tools)
        extra = {"tools": tools} if tools else {}  # the template's own tool rendering
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except TemplateError as e:
            raise InvalidRequest(f"the model's chat template rejects this conversation: {e}") from None

    def _check_tools(self, tools: list[dict]) -> None:
        """Tool specs are rendered inside the template's markup and tokenised with it, so a
        control token's text in a name, a description or a schema would become that control
        token (a forged turn, as a message's text would be without chatkv.engine.text_tokens): such a
        spec is refused."""
        controls = text_tokens.control_strings(self.tokenizer)
        if not controls:
            return
        stack: list[tuple[str, object]] = [(f"tools[{i}]", t) for i, t in enumerate(tools)]
        while stack:
            where, v = stack.pop()
            if isinstance(v, dict):
                stack.extend((f"{where}.{k}", x) for k, x in v.items())
                stack.extend((f"{where} (a key)", k) for k in v)
            elif isinstance(v, (list, tuple)):
                stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
            elif isinstance(v, str):
                hit = next((c for c in controls if c in v), None)
                if hit is not None:
                    raise InvalidRequest(
                        f"{where} holds the model's control token {hit!r}; a tool's name, description "
                        "and schema are rendered as template markup, so they may not contain it"
                    )

    def _encode(self, text: str) -> list[int]:
        """Template markup only (no content of anyone's): special-token strings are control tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _rendered(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> text_tokens.Rendered:
        """The render and where its contents lie: contents are data (``chatkv.engine.text_tokens``)."""
        r = text_tokens.render(lambda ms: self._render(ms, add_generation_prompt, tools), messages)
        text_tokens.check_locatable(self.tokenizer, r, messages)
        return r

    def first(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The whole prompt of a conversation's first turn (system prompt included; ``tools``:
        OpenAI-style tool specs the template renders where it puts them)."""
        for i, m in enumerate(messages):
            check_text(f"message {i} ({m.get('role')})", m.get("content"))
        return text_tokens.encode_rendered(self.tokenizer, self._rendered(messages, True, tools))

    def user_turn(self, content: str, tools: list[dict] | None = None) -> list[int]:
        """Tokens to append after a closed assistant turn for a new user message, up to the reply
        (``tools``: first the template's tool block, for tools the conversation has not seen)."""
        check_text("the message", content)
        r = self._rendered(self._base + [{"role": "user", "content": content}], True)
        if not r.text.startswith(self._base_text):
            raise InvalidRequest(
                "the chat template rewrites earlier turns when a message is added; cannot take a delta"
            )
        header = self.tools_header(tools) if tools else []
        return header + text_tokens.encode_rendered(self.tokenizer, r, len(self._base_text))

    def tool_turn(self, results: list[dict]) -> list[int]:
        """Tokens to append after a closed assistant turn that called tools: the template's
        rendering of ``results`` (``role: "tool"`` messages, their contents data), up to the reply."""
        for i, m in enumerate(results):
            check_text(f"tool result {i}", m.get("content"))
        r = self._rendered(self._base + list(results), True)
        if not r.text.startswith(self._base_text):
            raise InvalidRequest(
                "the chat template rewrites earlier turns when a tool result is added; cannot take a delta"
            )
        return text_tokens.encode_rendered(self.tokenizer, r, len(self._base_text))

    def renders_tools(self, tools: list[dict]) -> bool:
        """Whether the chat template shows ``tools`` to the model at all (one without tool
        support ignores them)."""
        one = [{"role": "user", "content": _MARK}]
        return self._render(one, True, tools) != self._render(one, True)

    def tools_header(self, tools: list[dict]) -> list[int]:
        """The template's tool block alone (what it renders before the first user message with
        ``tools`` and not without them), for tools added to a conversation already begun."""
        one = [{"role": "user", "content": _MARK}]
        plain, withs = self._render(one, False), self._render(one, False, tools)
        a, b = plain[: plain.index(_MARK)], withs[: withs.index(_MARK)]
        n = 0
        while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
            n += 1
        block = b[: len(b) - n]
        if not block.strip():
            raise InvalidRequest(
                "the model's chat template renders tools only at the start of a conversation, or not "
                "at all; give the tools with the conversation's first message"
            )
        return self._encode(block)

    def continuation(self, messages: list[dict], k: int) -> list[int] | None:
        """The prompt of ``messages`` (up to the reply) after its first ``k`` messages, when those
        are a closed conversation whose ids the caller holds: the tokens of the whole render from
        where the render of ``messages[:k]`` alone ends. None when the template renders those
        ``k`` messages differently once more follow (it rewrites earlier turns): no delta then."""
        full = self._rendered(messages, True)
        before = self._render(messages[:k], False)
        if not full.text.startswith(before):
            return None
        return text_tokens.encode_rendered(self.tokenizer, full, len(before))

    def close_reply(self, generated: list[int]) -> list[int]:
        """End-of-turn tokens after a reply; a stop token the model already produced is not repeated."""
        closing = self._closing
        if generated and closing and generated[-1] == closing[0]:
            return closing[1:]
        return list(closing)

    def system_prefix(self, system: str | None) -> list[int]:
        """Tokens of the system prompt alone, the prefix every session with it shares.

        Always a prefix of ``first([system, user])``; empty when the template has no system role.
        A template that refuses a conversation without a user message (Qwen3: "No user query
        found") gets the text before the first user message's content instead.
        """
        if not system:
            return []
        check_text("the system prompt", system)
        sys_msg = {"role": "system", "content": system}
        try:
            full = self.first([sys_msg, {"role": "user", "content": _MARK}])
        except InvalidRequest:
            return []
        try:
            alone = text_tokens.encode_rendered(self.tokenizer, self._rendered([sys_msg], False))
        except InvalidRequest:
            r = self._rendered([sys_msg, {"role": "user", "content": _MARK}], False)
            cut = r.text.find(_MARK)
            spans = None if r.spans is None else tuple((a, min(b, cut)) for a, b in r.spans if a < cut)
            alone = (
                text_tokens.encode_rendered(self.tokenizer, text_tokens.Rendered(r.text[:cut], spans))
                if cut >= 0
                else []
            )
        n = 0
        while n < min(len(alone), len(full)) and alone[n] == full[n]:
            n += 1
        return alone[:n]
