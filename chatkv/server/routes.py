"""The HTTP routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics`` (``/v1/embeddings``: ``embeddings.py``; ``/tokenize``: ``tokens.py``; the Responses
API: ``responses/``). Each handler checks the key, reads and validates the body, takes a
concurrency slot, runs the request (``generation.py``) and answers in OpenAI's shape
(``chat_shapes.py``); every refusal is an OpenAI error (``errors.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from anyio import to_thread
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatkv.server import generation as gen
from chatkv.server import limits, samples, tool_calls
from chatkv.server.chat_shapes import Chat, Completion, chat_logprobs, completion_logprobs, sse, sum_usage
from chatkv.server.errors import APIError, from_chatkv
from chatkv.server.guards import check_api_key, read_body
from chatkv.server.schemas import parse_chat, parse_completion, parse_json

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_request(request: Request) -> tuple[str, dict]:
    """(the request's user, its JSON body)."""
    state = request.app.state.chatkv
    state.check_open()
    who = check_api_key(request, state.users)
    return who, parse_json(await read_body(request, state.max_request_bytes))


CUT = "the server is shutting down: the reply was stopped (a session stores it as interrupted); retry on another server"


async def until_cut(state, items):
    """``items`` as they come, until the server's graceful shutdown is nearly out of time
    (``state.cut``): then the request is stopped and this raises a 503 ``shutting_down``."""
    it = items.__aiter__()
    cut = asyncio.ensure_future(state.cut.wait())
    nxt = None
    try:
        while True:
            nxt = asyncio.ensure_future(it.__anext__())
            await asyncio.wait({nxt, cut}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                raise APIError(503, CUT, "shutting_down")
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        cut.cancel()
        if nxt is not None and not nxt.done():  # cut, or this request was cancelled (the client went away)
            nxt.cancel()  # the generator sees the cancellation, as when a client goes away: its reply is stored
            try:
                await nxt
            except BaseException:  # noqa: BLE001 - stopping it is all that is wanted here
                pass


def _session_id(request: Request, body_id: str | None) -> str | None:
    """The session id of the ``X-Session-Id`` header or the body's ``session_id``; a 400 naming
    both when both are given and differ (neither silently wins)."""
    header = request.headers.get("x-session-id") or None
    if header and body_id and header != body_id:
        raise APIError(
            400,
            f"the X-Session-Id header ({_short(header)}) and the body's session_id ({_short(body_id)}) "
            "name different sessions; send one of them, or the same id in both",
            "invalid_value",
            "session_id",
        )
    return header or body_id


def _short(text: str, limit: int = 80) -> str:
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_model(state, model: str | None) -> None:
    """Any name, or none (``model`` None: not given, as llama-server takes), reaches the one served
    model, unless ``chatkv serve --strict-model-names``: then a request must name one of its names
    (``--served-model-name``, the model directory's); none is a 400, another a 404 that gives the
    name back cut to 80 characters."""
    if not state.strict_model_names:
        return
    if model is None:
        raise APIError(400, "you must provide a model parameter", "missing_parameter", "model")
    if model not in state.model_names:
        raise APIError(
            404,
            f"The model {_short(model)} does not exist (this server has {state.model_name!r}).",
            "model_not_found",
            "model",
        )


def _chat_error_events(error: APIError) -> list[bytes]:
    return [sse(error.body()), sse("[DONE]")]


def stream_response(chunks, events, slot, state, headers=None, error_events=_chat_error_events) -> StreamingResponse:
    """SSE of ``chunks`` (made from ``events``); an error after the first byte is an error event
    (``error_events(APIError)``: its bytes; chat's by default)."""

    async def body():
        try:
            async for item in chunks:
                yield item
        except Exception as e:  # noqa: BLE001 - the status is sent: the error goes in the stream, as OpenAI's does
            for piece in error_events(from_chatkv(e)):
                yield piece
        finally:
            slot.release()  # first: a cancelled task may not get past the next await
            state.metrics_tick()
            try:
                await events.aclose()  # the client went away: stop the request now
            except RuntimeError:  # already closing (the cancellation went through it)
                pass

    return StreamingResponse(body(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


async def chat_completions(request: Request) -> Response:
    state = request.app.state.chatkv
    who, body = await read_request(request)
    req = parse_chat(body)
    check_model(state, req.model)
    limits.check_text_size(req.messages, state.context)
    session_id = _session_id(request, req.session_id)
    template = getattr(state.engine.tokenizer, "chat_template", None)
    parallel = body.get("parallel_tool_calls") is not False  # validated by parse_chat
    params = tool_calls.constrain(req.params, req.tools, req.tool_choice, template, parallel)
    calling = bool(req.tools) and req.tool_choice != "none"  # the reply may be tool calls
    if session_id and (req.tools or any(m["role"] == "tool" for m in req.messages)):
        raise APIError(
            400,
            "tools and tool messages are taken without a session only (not with session_id yet)",
            "unsupported_parameter",
            "tools",
        )
    if session_id and req.n > 1:
        raise APIError(
            400,
            "n > 1 is taken without a session only (a session stores one reply a turn)",
            "unsupported_parameter",
            "n",
        )
    calls = (
        (lambda text: tool_calls.reply_calls(text, req.tools, req.tool_choice, template, parallel)) if calling else None
    )
    slot = state.limit.acquire()
    streaming = False
    try:
        if req.n > 1:  # samples.py
            runs, shared = await gen.stateless_chats(
                state, req.messages, params, req.max_tokens, who, tool_calls.specs(req.tools), req.n
            )
            group = gen.Runs(runs)
            chat = Chat(state.model_name, None, req.include_usage)
            tok = state.engine.tokenizer
            items = until_cut(state, gen.merged(runs))
            if req.stream:
                streaming = True
                lp_tok = tok if req.params.logprobs is not None else None
                return stream_response(
                    samples.chat_sse(chat, items, runs, shared, calls, template, lp_tok), group, slot, state
                )
            try:
                return JSONResponse(await samples.chat_reply(chat, items, runs, shared, calls, tok))
            finally:
                await group.aclose()
        if session_id:
            sid, events = await gen.session_chat(state, req.messages, params, req.max_tokens, session_id, who)
        else:
            sid, events = (
                None,
                await gen.stateless_chat(state, req.messages, params, req.max_tokens, who, tool_calls.specs(req.tools)),
            )
        chat = Chat(state.model_name, sid, req.include_usage)
        headers = {"X-Session-Id": sid} if sid else None
        if req.stream:
            streaming = True
            lp = (
                (lambda: chat_logprobs(events.take_logprobs(), state.engine.tokenizer))
                if req.params.logprobs is not None
                else None
            )
            return stream_response(
                _chat_sse(chat, until_cut(state, events), calls, template, lp), events, slot, state, headers
            )
        done = None
        async for item in until_cut(state, events):
            if isinstance(item, gen.Done):
                done = item
        out = chat.completion(
            done.text, done.finish_reason, done.usage, chat_logprobs(done.logprobs, state.engine.tokenizer)
        )
        content, found = calls(done.text) if calls else (done.text, [])
        if found:
            out["choices"][0]["message"] = tool_calls.message(content, found)
            out["choices"][0]["finish_reason"] = "tool_calls"
        return JSONResponse(out, headers=headers)
    finally:
        if not streaming:
            slot.release()
            state.metrics_tick()


async def _chat_sse(chat: Chat, events, calls=None, template=None, logprobs=None):
    """Text pieces as they come; with tools (``calls``) text streams until a call begins, the
    calls are sent at the end as delta.tool_calls (one whole call each; tool_calls.CallStream).
    ``logprobs()``: the logprobs of the tokens since the last chunk's, for each content chunk
    and the finishing one (None: not asked for)."""
    lp = logprobs or (lambda: None)
    yield sse(chat.chunk({"role": "assistant", "content": None}))  # llama-server's and vLLM's role chunk
    split = tool_calls.CallStream(template) if calls is not None else None
    async for item in events:
        if isinstance(item, gen.Done):
            finish = item.finish_reason
            if split is not None:
                content, found = split.finish(calls)
                if content:
                    yield sse(chat.chunk({"content": content}))
                for delta in tool_calls.deltas(found):
                    yield sse(chat.chunk(delta))
                finish = "tool_calls" if found else finish
            yield sse(chat.chunk({}, finish, lp()))
            if chat.include_usage:
                yield sse(chat.usage_chunk(item.usage))
        elif split is not None:
            now = split.feed(item)
            if now:
                yield sse(chat.chunk({"content": now}, None, lp()))
        else:
            yield sse(chat.chunk({"content": item}, None, lp()))
    yield sse("[DONE]")


async def completions(request: Request) -> Response:
    state = request.app.state.chatkv
    who, body = await read_request(request)
    req = parse_completion(body)
    check_model(state, req.model)
    limits.check_text_size([{"content": p} for p in req.prompts if isinstance(p, str)], state.context, "prompt")
    slot = state.limit.acquire()
    streaming = False
    runs = []
    groups = []  # each prompt's (number of choices, what they shared)
    try:
        prompts = [gen.completion_prompt(state, p, req.max_tokens) for p in req.prompts]  # all checked first
        for ids, max_tokens in prompts:
            params = dataclasses.replace(req.params, stop=list(req.params.stop), max_tokens=max_tokens)
            got, shared = await gen.completion(state, ids, params, who, req.n)
            runs.extend(got)
            groups.append((len(got), shared))
        out = Completion(state.model_name, req.include_usage)
        if req.stream and req.n > 1:  # one prompt's n samples (samples.py)
            streaming = True
            tok = state.engine.tokenizer if req.params.logprobs is not None else None
            items = until_cut(state, gen.merged(runs))
            return stream_response(
                samples.completion_sse(out, items, runs, groups[0][1], tok), gen.Runs(runs), slot, state
            )
        if req.stream:
            streaming = True
            tok = state.engine.tokenizer if req.params.logprobs is not None else None
            return stream_response(_completion_sse(out, until_cut(state, runs[0]), runs[0], tok), runs[0], slot, state)

        async def finish(events):
            async for item in until_cut(state, events):
                if isinstance(item, gen.Done):
                    return item

        dones = await asyncio.gather(*(finish(e) for e in runs))
        usage, per_choice = (
            samples.completion_usage(dones, groups) if req.n > 1 else (sum_usage([d.usage for d in dones]), None)
        )
        return JSONResponse(
            out.completion(
                [(d.text, d.finish_reason) for d in dones],
                usage,
                [completion_logprobs(d.logprobs, state.engine.tokenizer) for d in dones],
                per_choice,
            )
        )
    finally:
        if not streaming:
            slot.release()
            state.metrics_tick()
            for events in runs:
                await events.aclose()  # a failed batch: cancel the others


async def _completion_sse(out: Completion, events, run=None, tokenizer=None):
    """Text pieces as they come; with ``tokenizer`` (logprobs asked for) each chunk carries the
    logprobs of the tokens since the last one (``run``: the request's events), offsets running on."""
    offset = 0

    def lp():
        nonlocal offset
        if tokenizer is None:
            return None
        got = completion_logprobs(run.take_logprobs(), tokenizer, offset)
        if got is not None and got["tokens"]:
            offset = got["text_offset"][-1] + len(got["tokens"][-1])
        return got

    async for item in events:
        if isinstance(item, gen.Done):
            yield sse(out.chunk("", item.finish_reason, lp()))
            if out.include_usage:
                yield sse(out.usage_chunk(item.usage))
        else:
            yield sse(out.chunk(item, None, lp()))
    yield sse("[DONE]")


async def models(request: Request) -> Response:
    state = request.app.state.chatkv
    check_api_key(request, state.users)
    created = int(state.started_at)
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "chatkv", "max_model_len": state.context}
        for name in [state.model_name, *state.aliases]
    ]
    if state.embedding_available():
        data.append({"id": state.embedding_name, "object": "model", "created": created, "owned_by": "chatkv"})
    return JSONResponse({"object": "list", "data": data})


async def health(request: Request) -> Response:
    state = request.app.state.chatkv
    if state.stopping or not state.engine.started:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse(
        {"status": "ok", "model": state.model_name, "uptime_s": round(time.time() - state.started_at, 3)}
    )


async def metrics(request: Request) -> Response:
    state = request.app.state.chatkv
    text = await to_thread.run_sync(state.metrics.render)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
