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

Stateless requests use the user's own part of the history map and of the prefix cache. A
stateless request may ask for n samples of its prompt (``submit_n``; samples.py answers them):
the prompt is computed once and its whole blocks shared, and ``merged`` reads the n runs' events
as one stream of ``(index, item)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import AsyncIterator

from anyio import to_thread

from chatkv.engine.sampling import SEED_LIMIT, SamplingParams
from chatkv.errors import check_text
from chatkv.outputs import Reply, TokenLogprob, Usage
from chatkv.server.errors import APIError, from_chatkv

NEW_SESSION = "new"


@dataclass
class Done:
    text: str
    finish_reason: str  # "stop" | "length" | "aborted"
    usage: Usage
    logprobs: list[TokenLogprob] | None = None  # every generated token's, when the request asked (stateless only)


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
    """Text pieces, then one Done. ``aclose()`` stops the request, even one never iterated.
    ``take_logprobs()``: the logprobs of the tokens generated since its last call (streaming)."""

    def __init__(self, agen: AsyncIterator[str | Done], cancel=None, stream=None):
        self._agen = agen
        self._cancel = cancel
        self._stream = stream  # the engine's RequestStream (stateless requests)
        self._taken = 0

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs not taken yet of the tokens generated so far (None: not asked for)."""
        got = self._stream.token_logprobs(self._taken) if self._stream is not None else None
        if got is not None:
            self._taken += len(got)
        return got

    def __aiter__(self):
        return self._agen

    def cancel(self) -> None:
        """Stop the request (its generator is left to whoever reads it)."""
        if self._cancel is not None:
            self._cancel()

    async def aclose(self) -> None:
        self.cancel()
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
    yield Done(result.text, result.finish_reason, result.usage, result.logprobs)


def _sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample ``i``'s params: its own copy, and with a ``seed``, ``seed + i`` (mod 2**63), so the n
    samples of a seeded request are n distinct streams, each reproducible; without one each draws its own."""
    out = dataclasses.replace(params, stop=list(params.stop))
    if params.seed is not None:
        out.seed = (params.seed + i) % SEED_LIMIT
    return out


async def _prefill_once(engine, ids: list[int], user: str | None) -> Usage:
    """Compute the prompt's KV once into the prefix cache: a one-token greedy request of ``ids``
    whose whole blocks enter the radix tree as it finishes (the engine inserts a request's computed
    full blocks then). The n samples submitted after it attach those blocks, each computing only the
    prompt's last partial block (a private block, so a sample's writes never touch another's KV)."""
    stream = await _submit(engine, ids, SamplingParams(max_tokens=1, temperature=0.0), user)
    try:
        return (await stream.aresult()).usage
    except Exception as e:  # noqa: BLE001
        raise from_chatkv(e) from e
    finally:
        stream.cancel()  # no-op once finished; stops it when this request was cancelled


@dataclass
class Shared:
    """What the n samples of one prompt shared: the usage of the request that computed the
    prompt once (None: none ran, each sample computed its own) and the seconds it took."""

    prefill: Usage | None = None
    waited_s: float = 0.0


async def submit_n(
    engine, ids: list[int], params: SamplingParams, n: int, user: str | None = None
) -> tuple[list, Shared]:
    """The RequestStreams of ``n`` samples of one prompt, and what they shared. For n > 1 with
    prefix caching on and at least one whole block to share, the prompt is computed once first
    (``_prefill_once``), so its blocks are shared by the n samples; else each sample is a request
    of its own (prefix caching off: nothing can be shared)."""
    shared = Shared()
    if n > 1 and engine.kv.sharing and (len(ids) - 1) // engine.kv.block_size > 0:
        t0 = time.monotonic()
        shared.prefill = await _prefill_once(engine, ids, user)
        shared.waited_s = time.monotonic() - t0
    if n == 1:
        return [await _submit(engine, ids, params, user)], shared

    def submit_all() -> list:  # in one round of the engine loop: the samples start in the same step
        streams = []
        try:
            for i in range(n):
                streams.append(engine.submit(ids, _sample_params(params, i), user=user))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return streams

    try:
        return await to_thread.run_sync(engine.on_loop, submit_all), shared
    except Exception as e:  # noqa: BLE001 - InvalidRequest and friends become OpenAI errors
        raise from_chatkv(e) from e


async def stateless_chat(
    state,
    messages: list[dict],
    params: SamplingParams,
    max_tokens: int | None,
    user: str | None = None,
    tools: list[dict] | None = None,
):
    return (await stateless_chats(state, messages, params, max_tokens, user, tools))[0][0]


async def stateless_chats(
    state,
    messages: list[dict],
    params: SamplingParams,
    max_tokens: int | None,
    user: str | None = None,
    tools: list[dict] | None = None,
    n: int = 1,
) -> tuple[list[Events], Shared]:
    """The events of ``n`` samples of one stateless chat (``submit_n``), and what they shared;
    each reply that ends normally is remembered in the history map."""
    try:
        ids, _ = await to_thread.run_sync(state.history.prompt, messages, user, tools)
    except Exception as e:  # noqa: BLE001 - text that is not valid Unicode, a template that refuses
        raise from_chatkv(e) from e
    params.max_tokens = fit_max_tokens(state.context, len(ids), max_tokens)

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

    streams, shared = await submit_n(state.engine, ids, params, n, user)
    return [Events(_events(s, remember), s.cancel, s) for s in streams], shared


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


async def completion(
    state, ids: list[int], params: SamplingParams, user: str | None = None, n: int = 1
) -> tuple[list[Events], Shared]:
    """The events of ``n`` samples of one completion prompt (``submit_n``), and what they shared."""
    streams, shared = await submit_n(state.engine, ids, params, n, user)
    return [Events(_events(s), s.cancel, s) for s in streams], shared


async def merged(runs: list[Events]) -> AsyncIterator[tuple[int, str | Done]]:
    """``(i, item)`` of every run's events as they come (one task per run); the first error
    raises here and stops the others' reading (closing the runs is the caller's ``aclose``)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, run: Events) -> None:
        try:
            async for item in run:
                await queue.put((i, item, None))
        except Exception as e:  # noqa: BLE001 - raised again below, in the reader's task
            await queue.put((i, None, e))
        else:
            await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled: all that is wanted here
                pass


class Runs:
    """Several runs' events closed together (``aclose``), as ``Events`` is for one."""

    def __init__(self, runs: list[Events]):
        self.runs = runs

    async def aclose(self) -> None:
        for r in self.runs:  # every request stopped first, whatever closing one of them raises
            r.cancel()
        for r in self.runs:
            try:
                await r.aclose()
            except RuntimeError:  # its generator is running in a reader's task (merged): that ends with it
                pass


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
    a turn that does not fit is refused with a status. Log probabilities are a stateless
    request's only (a 400 here)."""
    if params.logprobs is not None:
        raise APIError(400, "logprobs are taken without a session only", "unsupported_parameter", "logprobs")
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
