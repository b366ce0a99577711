"""``n`` > 1: several samples of one prompt in one request, on /v1/chat/completions (stateless
requests only) and /v1/completions.

The prompt is computed once and its KV shared (``generation.submit_n``): its whole blocks go
into the prefix cache, and each sample attaches them and computes only the prompt's last,
partial block, a block of its own (so no sample writes into KV another one reads). With a
``seed``, sample ``i`` samples with ``seed + i``: the n choices differ, and the same request
gives the same n choices again; without one each sample draws its own seed.

Each choice is a reply of its own: its stop strings, constraint (``response_format``, a tool
grammar), tool calls (parsed from its own text) and log probabilities. The usage counts the
prompt once and sums the choices' completion tokens, as OpenAI does (``chat_shapes.n_usage``);
``usage.chatkv.choices`` gives each sample's cached and computed prompt tokens. Streamed, every
chunk names its choice's ``index``; the usage chunk comes once, after the last choice finished.
"""

from __future__ import annotations

from chatkv.server import generation as gen
from chatkv.server import tool_calls
from chatkv.server.chat_shapes import Chat, Completion, chat_logprobs, completion_logprobs, n_usage, sse, sum_usage


def _apply_calls(choice: dict, text: str, calls) -> dict:
    """``choice`` with its tool calls parsed from its own ``text`` (``calls``: None without tools)."""
    content, found = calls(text) if calls else (text, [])
    if found:
        choice["message"] = tool_calls.message(content, found)
        choice["finish_reason"] = "tool_calls"
    return choice


async def chat_reply(chat: Chat, items, runs: list, shared: gen.Shared, calls, tokenizer) -> dict:
    """The chat completion of ``runs`` (one per choice); ``items``: their merged events
    (``generation.merged``, through the route's shutdown cut)."""
    dones: list[gen.Done | None] = [None] * len(runs)
    async for i, item in items:
        if isinstance(item, gen.Done):
            dones[i] = item
    choices = [
        _apply_calls(Chat.choice(i, d.text, d.finish_reason, chat_logprobs(d.logprobs, tokenizer)), d.text, calls)
        for i, d in enumerate(dones)
    ]
    usages = [d.usage for d in dones]
    return chat.completion_n(choices, n_usage(usages, shared.prefill, shared.waited_s), usages)


async def chat_sse(chat: Chat, items, runs: list, shared: gen.Shared, calls, template, tokenizer):
    """The chunks of ``runs`` as their pieces come, each naming its choice's ``index``; with
    tools (``calls``) each choice streams text until a call begins and sends its calls as it
    finishes (``tool_calls.CallStream``, one per choice); ``tokenizer`` (None: no logprobs):
    each chunk carries its choice's logprobs since that choice's last chunk."""

    def lp(i: int):
        return chat_logprobs(runs[i].take_logprobs(), tokenizer) if tokenizer is not None else None

    for i in range(len(runs)):
        yield sse(chat.chunk({"role": "assistant", "content": None}, index=i))
    splits = [tool_calls.CallStream(template) if calls is not None else None for _ in runs]
    usages = [None] * len(runs)
    async for i, item in items:
        split = splits[i]
        if isinstance(item, gen.Done):
            usages[i] = item.usage
            finish = item.finish_reason
            if split is not None:
                content, found = split.finish(calls)
                if content:
                    yield sse(chat.chunk({"content": content}, index=i))
                for delta in tool_calls.deltas(found):
                    yield sse(chat.chunk(delta, index=i))
                finish = "tool_calls" if found else finish
            yield sse(chat.chunk({}, finish, lp(i), index=i))
        elif split is not None:
            now = split.feed(item)
            if now:
                yield sse(chat.chunk({"content": now}, None, lp(i), index=i))
        else:
            yield sse(chat.chunk({"content": item}, None, lp(i), index=i))
    if chat.include_usage:
        yield sse(chat.usage_chunk(n_usage(usages, shared.prefill, shared.waited_s), usages))
    yield sse("[DONE]")


def completion_usage(dones: list, groups: list[tuple[int, gen.Shared]]):
    """(the usage, each choice's) of a completion's choices ``dones``, in prompt order: ``groups``
    gives each prompt's (number of choices, what they shared)."""
    total, start = [], 0
    for count, shared in groups:
        total.append(n_usage([d.usage for d in dones[start : start + count]], shared.prefill, shared.waited_s))
        start += count
    return sum_usage(total), [d.usage for d in dones]


async def completion_sse(out: Completion, items, runs: list, shared: gen.Shared, tokenizer=None):
    """The chunks of one prompt's ``runs`` (n samples), each naming its ``index``; ``tokenizer``
    (None: no logprobs): each chunk carries its choice's logprobs, offsets running on per choice."""
    offsets = [0] * len(runs)
    usages = [None] * len(runs)

    def lp(i: int):
        if tokenizer is None:
            return None
        got = completion_logprobs(runs[i].take_logprobs(), tokenizer, offsets[i])
        if got is not None and got["tokens"]:
            offsets[i] = got["text_offset"][-1] + len(got["tokens"][-1])
        return got

    async for i, item in items:
        if isinstance(item, gen.Done):
            usages[i] = item.usage
            yield sse(out.chunk("", item.finish_reason, lp(i), index=i))
        else:
            yield sse(out.chunk(item, None, lp(i), index=i))
    if out.include_usage:
        yield sse(out.usage_chunk(n_usage(usages, shared.prefill, shared.waited_s), usages))
    yield sse("[DONE]")
