"""Running one generation for a route: a stateless request through ``engine.submit`` (its
history mapped onto canonical tokens, ``history.py``), or a turn of a stored session.

Both are prepared first (everything that can refuse the request does so before the first
byte of the response, so a refusal is an HTTP status, not an error event in a stream) and
then give an async iterator of text pieces ending with one ``Done``.

Sessions (``X-Session-Id`` header or ``session_id`` body field; both given and different: a 400
naming both). Each belongs to the user whose API key made it (``guards.Users``):

- ``new``: a new stored conversation; its system prompt is the request's leading system
  message(s), and the request holds that and one user message. The response carries the new
  id (header ``X-Session-Id`` and body field ``session_id``).
- an existing id: the last user message is the conversation's next turn; its history and KV
  come from the store. The client may send just that message, or the whole conversation: then
  every earlier message must equal the stored one (role and text, in order) and a system
  message the stored system prompt, else 409 ``session_history_mismatch`` (nothing is stored).
- an unknown id, or another user's: 404 ``session_not_found``, the same status and body (the
  id given back, cut to 80 characters) for both, before any history is compared, so neither
  the status nor ``session_history_mismatch`` tells whether another user's id exists or what it
  holds; a conversation answering another request: 409 ``session_busy``.

Stateless requests use the user's own part of the history map and of the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from anyio import to_thread

from chatkv.engine.sampling import SamplingParams
from chatkv.errors import check_text
from chatkv.outputs import Reply, Usage
from chatkv.server.errors import APIError, from_chatkv

NEW_SESSION = "new"


@dataclass
class Done:
    text: str
    finish_reason: str  # "stop" | "length" | "aborted"
    usage: Usage


def fit_max_tokens(context: int, prompt_len: int, max_tokens: int | None, param: str = "messages") -> int:
    """``max_tokens``, or what the context leaves; 400 ``context_length_exceeded`` if they do not fit."""
    if prompt_len >= context or (max_tokens is not None and prompt_len + max_tokens > context):
        asked = prompt_len + (max_tokens or 1)
        raise APIError(
            400,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{asked} tokens ({prompt_len} in the {param}, {asked - prompt_len} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            "context_length_exceeded",
            param,
        )
    return max_tokens if max_tokens is not None else context - prompt_len


async def _submit(engine, ids: list[int], params: SamplingParams, user: str | None = None):
    try:
        return await to_thread.run_sync(lambda: engine.submit(ids, params, user=user))
    except Exception as e:  # noqa: BLE001 - InvalidRequest and friends become OpenAI errors
        raise from_chatkv(e) from e


class Events:
    """Text pieces, then one Done. ``aclose()`` stops the request, even one never iterated."""

    def __init__(self, agen: AsyncIterator[str | Done], cancel=None):
        self._agen = agen
        self._cancel = cancel

    def __aiter__(self):
        return self._agen

    async def aclose(self) -> None:
        if self._cancel is not None:
            self._cancel()
        await self._agen.aclose()


async def _events(stream, on_done=None) -> AsyncIterator[str | Done]:
    try:
        async for piece in stream:
            yield piece
        result = await stream.aresult()
    except Exception as e:  # noqa: BLE001 - the request's own error
        raise from_chatkv(e) from e
    finally:
        stream.cancel()  # no-op once finished; frees the blocks when the client went away
    if on_done is not None:
        on_done(result)
    yield Done(result.text, result.finish_reason, result.usage)


async def stateless_chat(
    state,
    messages: list[dict],
    params: SamplingParams,
    max_tokens: int | None,
    user: str | None = None,
    tools: list[dict] | None = None,
):
    try:
        ids, _ = await to_thread.run_sync(state.history.prompt, messages, user, tools)
    except Exception as e:  # noqa: BLE001 - text that is not valid Unicode, a template that refuses
        raise from_chatkv(e) from e
    params.max_tokens = fit_max_tokens(state.context, len(ids), max_tokens)
    stream = await _submit(state.engine, ids, params, user)

    def remember(result) -> None:
        if result.finish_reason in ("stop", "length"):
            state.history.record(
                messages,
                result.text,
                ids,
                result.token_ids,
                stopped_by_string=bool(params.stop) and result.finish_reason == "stop",
                user=user,
            )

    return Events(_events(stream, remember), stream.cancel)


def completion_prompt(state, prompt, max_tokens: int) -> tuple[list[int], int]:
    """The token ids of one prompt (text or ids) of /v1/completions, and its max_tokens."""
    try:
        ids = (
            list(state.engine.tokenizer(check_text("prompt", prompt))["input_ids"])
            if isinstance(prompt, str)
            else list(prompt)
        )
    except Exception as e:  # noqa: BLE001
        raise from_chatkv(e) from e
    return ids, fit_max_tokens(state.context, len(ids), max_tokens, "prompt")


async def completion(state, ids: list[int], params: SamplingParams, user: str | None = None) -> Events:
    stream = await _submit(state.engine, ids, params, user)
    return Events(_events(stream), stream.cancel)


def _open_session(engine, messages: list[dict], session_id: str, user: str | None = None):
    n_sys = 0
    while n_sys < len(messages) and messages[n_sys]["role"] == "system":
        n_sys += 1
    system = "\n\n".join(m["content"] for m in messages[:n_sys]) if n_sys else None
    rest = messages[n_sys:]
    if any(m["role"] == "system" for m in rest):
        raise APIError(
            400, "with a session, system messages may only open the conversation", "invalid_value", "messages"
        )
    if session_id == NEW_SESSION:
        if len(rest) != 1:
            raise APIError(
                400,
                "a new session (X-Session-Id: new) starts from its system message(s) and one user "
                "message; send earlier turns without a session, or one by one",
                "invalid_value",
                "messages",
            )
        return engine.session(system=system, user=user)
    s = engine.resume(session_id, user=user)  # another user's id: unknown, before any comparison below
    mismatch = APIError(
        409,
        f"the messages sent do not match the stored history of session '{session_id}'; send "
        "only the new user message, or the conversation exactly as stored",
        "session_history_mismatch",
        "messages",
    )
    if system is not None and system != (s.system or ""):
        raise mismatch
    if len(rest) > 1:
        stored = [{"role": m.role, "content": m.content} for m in s.messages() if m.role in ("user", "assistant")]
        if rest[:-1] != stored:
            raise mismatch
    return s


async def session_chat(
    state,
    messages: list[dict],
    params: SamplingParams,
    max_tokens: int | None,
    session_id: str,
    user: str | None = None,
):
    """(the session's id, its events). The first piece is awaited here, so a busy session or
    a turn that does not fit is refused with a status."""
    try:
        s = await to_thread.run_sync(_open_session, state.engine, messages, session_id, user)
    except Exception as e:  # noqa: BLE001
        raise from_chatkv(e) from e
    return s.id, await session_turn(state, s, messages[-1]["content"], params, max_tokens)


async def session_turn(state, s, text: str, params: SamplingParams, max_tokens: int | None) -> Events:
    """The events of the next turn of the open session ``s`` (a ``chatkv`` Session): ``text``
    asked after its current branch. The first piece is awaited here, as in ``session_chat``."""
    params.max_tokens = max_tokens if max_tokens is not None else state.context
    gen = s.astream(text, params)
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "the session's turn ended without a reply", "internal_error") from None
    except Exception as e:  # noqa: BLE001
        await gen.aclose()
        raise from_chatkv(e) from e

    async def events() -> AsyncIterator[str | Done]:
        item = first
        try:
            while True:
                if isinstance(item, Reply):
                    async for _ in gen:  # the turn ends, its lease given back, before the reply is answered:
                        pass  # a client's next request at once must not find the conversation still busy
                    yield Done(item.text, item.finish_reason, item.usage)
                    return
                yield item
                item = await gen.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the session's turn ended without a reply", "internal_error") from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise from_chatkv(e) from e
        finally:
            await gen.aclose()  # an early stop: the reply so far is stored, marked interrupted

    return Events(events())
