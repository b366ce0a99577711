"""Follow-up questions made standalone by the chat model: an option beside ``standalone_query``'s rule.

``model_rewriter(engine)`` gives a ``rewrite(message, previous_user_message) -> str`` that asks the
engine's chat model, greedily and in at most ``MAX_TOKENS`` tokens, to restate the follow-up with
what it refers to spelled out ("Which scope does it exclude?" after "What does the nonlocal
statement do?" -> "Which scope does the nonlocal statement exclude?"). With it,
``chatkv.rag.context.standalone_query(..., rewrite=...)`` searches a message its rule takes for a
follow-up as the model's question instead of the two questions joined; an unusable reply (empty,
or longer than the two questions together) keeps the joined text.

It is off by default. On benchmarks/rag_eval.py ``--followups`` (22 follow-ups whose subject is in
the previous question; the 30 held-back questions, each after an unrelated one, as the control) the
rule takes 6 of the 22 follow-ups and 10 of the 30 standalone questions for follow-ups. Asked for
those 16, the packaged SmolLM2-135M mostly restates the previous question rather than the
follow-up: hybrid hit@1 / hit@3 stay 16 / 18 of 22 on the follow-ups and drop from 23 / 27 to
22 / 23 of 30 on the control, at a median 448 ms per rewrite (2-core Intel Xeon, one torch thread).
The prompt's examples are about kettles, bicycles and bread, so that none names an evaluation topic.
"""

from __future__ import annotations

from typing import Callable

MAX_TOKENS = 40
SYSTEM = (
    "You rewrite a follow-up question so that it can be understood without the conversation. "
    "Replace words like it, its, they, them, that and this with what they refer to in the previous "
    "question. Reply with the rewritten question only."
)
EXAMPLES = (
    (
        "How do I descale the Zephyr kettle?",
        "How often should I do it?",
        "How often should I descale the Zephyr kettle?",
    ),
    (
        "What tyre pressure does a road bicycle need?",
        "And what about its chain, how often is it oiled?",
        "How often is a road bicycle's chain oiled?",
    ),
    (
        "How long does sourdough starter take to ferment?",
        "What temperature?",
        "What temperature does sourdough starter need to ferment?",
    ),
)

Rewrite = Callable[[str, str], str]


def rewrite_messages(message: str, previous_user_message: str) -> list[dict]:
    """The chat the model is given: the instruction, the worked examples as turns, then this follow-up."""
    messages = [{"role": "system", "content": SYSTEM}]
    for prev, follow, standalone in EXAMPLES:
        messages.append({"role": "user", "content": _ask(prev, follow)})
        messages.append({"role": "assistant", "content": standalone})
    messages.append({"role": "user", "content": _ask(previous_user_message, message)})
    return messages


def _ask(previous: str, follow_up: str) -> str:
    return f"Previous question: {previous.strip()}\nFollow-up question: {follow_up.strip()}\nStandalone question:"


def clean(reply: str, message: str, previous_user_message: str) -> str | None:
    """The model's reply as a query: its first non-empty line without a leading label or quotes;
    None when there is none or it is longer than the two questions together (a ramble, not a
    rewrite)."""
    lines = [ln.strip() for ln in reply.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    text = lines[0]
    for label in ("Standalone question:", "Rewritten question:", "Question:"):
        if text.lower().startswith(label.lower()):
            text = text[len(label) :].strip()
    text = text.strip("\"'“”` ")
    if not text or len(text) > len(message) + len(previous_user_message) + 20:
        return None
    return text


def model_rewriter(engine, max_tokens: int = MAX_TOKENS) -> Rewrite:
    """``rewrite(message, previous_user_message)`` through ``engine`` (a ``chatkv.Engine``): greedy,
    at most ``max_tokens`` tokens, stopping at a new line; returns the cleaned reply, or "" when it
    is unusable (``standalone_query`` then keeps the rule's query)."""
    from chatkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])

    def rewrite(message: str, previous_user_message: str) -> str:
        prompt = engine.encode_chat(rewrite_messages(message, previous_user_message))
        reply = engine.generate(prompt, params).text
        return clean(reply, message, previous_user_message) or ""

    return rewrite
