"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A stored response (``store``, the default) is a node of a conversation tree (ids:
``resp_request.py``). Without ``previous_response_id`` it opens a new conversation: its system
prompt is ``instructions`` and the input's leading system/developer messages, and its input
is then one user message. With one, the conversation is that response's, and its input is one
user message, asked after that response's reply: the branch is switched to end there
(``session.switch(reply, descend=False)``), so two requests naming the same previous response
make two branches, each sharing the KV of the history before it. A chained request keeps the
conversation's instructions (another ``instructions`` is a 400: it would change every turn's
prompt). The chain is the database's, so it survives a restart; its KV comes back from the
session's snapshot, not recomputed (``usage.input_tokens_details.cached_tokens``).

``store=false``: answered as a stateless chat completion (its input may be a whole history);
with ``previous_response_id`` the stored branch up to that response comes first. Nothing is
stored and its id is never found again.

Another user's response id is unknown in the very words of an id never used (400
``previous_response_not_found``; 404 ``response_not_found`` for GET and DELETE). A
conversation answering another request is a 409 ``session_busy``, as for chat completions
(another process: ``ConversationBusy``). DELETE deletes a chain's first response together with
every response chained from it (its conversation); a later response is a 400, since chatkv
deletes no part of a conversation tree.
"""

from __future__ import annotations

from datetime import datetime, timezone

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatkv.errors import SessionError
from chatkv.outputs import Usage
from chatkv.server import generation as gen
from chatkv.server import limits, tool_calls
from chatkv.server.errors import APIError, bad_value, from_chatkv, unsupported
from chatkv.server.guards import check_api_key
from chatkv.server.responses.request import (
    ResponsesRequest,
    parse_id,
    parse_responses,
    previous_not_found,
    response_not_found,
    stored_id,
    unstored_id,
)
from chatkv.server.responses.shapes import EventStream, ResponseShape
from chatkv.server.routes import check_model, read_request, stream_response, until_cut


def _epoch(t: datetime) -> float:
    """A stored time in seconds since the epoch (the store's times are UTC; SQLite gives them back naive)."""
    return (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)).timestamp()


def _busy(conv_id: str, param: str = "previous_response_id") -> APIError:
    return APIError(
        409, f"conversation '{conv_id}' is answering another request; retry when it is done", "session_busy", param
    )


def _sdk_error(e: Exception, not_found: APIError) -> APIError:
    """An SDK error while finding a response: an unknown (or another user's) conversation is ``not_found``."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SessionError) and str(e).startswith("unknown conversation id"):
        return not_found
    err = from_chatkv(e)
    if err.param == "session_id":  # busy: the conversation is named by the response id
        err.param = not_found.param
    return err


class Node:
    """A stored response found in its conversation: the session, its input (user) message, its
    output (the input's first assistant reply; None while it is being generated), the response
    before it and the conversation's messages (every branch)."""

    def __init__(self, engine, response_id: str, user: str, not_found: APIError):
        ids = parse_id(response_id)
        if ids is None:
            raise not_found
        conv_id, message_id = ids
        try:
            self.session = engine.resume(conv_id, user=user)
            self.tree = self.session.tree()
        except Exception as e:  # noqa: BLE001
            raise _sdk_error(e, not_found) from e
        by_id = {m.id: m for m in self.tree}
        self.input = by_id.get(message_id)
        if self.input is None or self.input.role != "user":
            raise not_found
        replies = [m for m in self.tree if m.parent_id == message_id and m.role == "assistant"]
        self.output = replies[0] if replies else None
        before = by_id.get(self.input.parent_id)
        grand = by_id.get(before.parent_id) if before is not None else None
        self.previous_id = stored_id(conv_id, grand.id) if grand is not None and grand.role == "user" else None
        self.by_id = by_id

    def history(self) -> list[dict]:
        """The branch up to this response's reply, oldest first, as chat messages (system first)."""
        chain, m = [], self.output
        while m is not None:
            chain.append({"role": m.role, "content": m.content})
            m = self.by_id.get(m.parent_id)
        system = [{"role": "system", "content": self.session.system}] if self.session.system else []
        return system + chain[::-1]


def _one_question(req: ResponsesRequest, chained: bool) -> tuple[str | None, str]:
    """(the new conversation's system prompt, the user message) of a stored response's input."""
    msgs = req.messages
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys]["role"] == "system":
        n_sys += 1
    if chained and n_sys:
        raise unsupported(
            "input",
            "a response with previous_response_id keeps its conversation's instructions: "
            "its input is one user message, with no system or developer message",
        )
    if len(msgs) - n_sys != 1:
        raise unsupported(
            "input",
            "a stored response's input is one user message (after any system or developer "
            "messages): send the earlier turns as a chain of responses with "
            "previous_response_id, or the whole history with store=false",
        )
    if not msgs[-1]["content"].strip():
        raise APIError(400, "the user message is empty", "invalid_value", "input")
    parts = ([req.instructions] if req.instructions else []) + [m["content"] for m in msgs[:n_sys]]
    return ("\n\n".join(parts) if parts else None), msgs[-1]["content"]


def _check_instructions(req: ResponsesRequest, system: str | None) -> None:
    if req.instructions is not None and req.instructions != (system or ""):
        raise unsupported(
            "instructions",
            "a response with previous_response_id keeps its conversation's "
            "instructions; send the same instructions, or none",
        )


def _shape(state, req: ResponsesRequest, response_id: str, instructions, created_at=None) -> ResponseShape:
    return ResponseShape(
        response_id,
        state.model_name,
        instructions=instructions,
        previous_response_id=req.previous_response_id,
        store=req.store,
        max_output_tokens=req.max_output_tokens,
        metadata=req.metadata,
        echo=req.echo,
        created_at=created_at,
    )


async def _stored(state, req: ResponsesRequest, who: str):
    """(the shape, the events) of a stored response: a new conversation, or a branch of one."""
    prev = req.previous_response_id
    engine = state.engine
    conv_id = None
    if prev is not None:
        ids = parse_id(prev)
        if ids is None:
            raise previous_not_found(prev)
        conv_id = ids[0]
        if conv_id in state.responding:
            raise _busy(conv_id)
        state.responding.add(conv_id)  # until the turn has begun (the session is busy from then on)
    try:
        if prev is not None:
            node = await to_thread.run_sync(Node, engine, prev, who, previous_not_found(prev))
            s = node.session
            _check_instructions(req, s.system)
            text = _one_question(req, chained=True)[1]
            if node.output is None or s.busy:
                raise _busy(conv_id)

            def branch():
                if s.messages()[-1].id != node.output.id:
                    s.switch(node.output.id, descend=False)

            try:
                await to_thread.run_sync(branch)
            except Exception as e:  # noqa: BLE001
                raise _sdk_error(e, previous_not_found(prev)) from e
        else:
            system, text = _one_question(req, chained=False)
            try:
                s = await to_thread.run_sync(lambda: engine.session(system=system, user=who))
            except Exception as e:  # noqa: BLE001
                raise from_chatkv(e) from e
        try:
            events = await gen.session_turn(state, s, text, req.params, req.max_output_tokens)
        except BaseException as e:
            if prev is None:  # nothing of it was asked: no empty conversation is left behind
                await to_thread.run_sync(_forget, s)
            if isinstance(e, APIError) and e.param == "session_id":  # busy: the conversation is named by the id
                e.param = "previous_response_id"
            raise
        try:
            asked = [m for m in await to_thread.run_sync(s.messages) if m.role == "user"][-1]
        except BaseException:
            await events.aclose()
            raise
    finally:
        if conv_id is not None:
            state.responding.discard(conv_id)
    return _shape(state, req, stored_id(s.id, asked.id), s.system, _epoch(asked.created_at)), events


def _forget(s) -> None:
    try:
        if not s.messages():
            s.delete()
    except Exception:  # noqa: BLE001 - best effort; the request's own error is what is answered
        pass


async def _unstored(state, req: ResponsesRequest, who: str):
    messages, instructions = req.messages, req.instructions
    if req.previous_response_id is not None:
        prev = req.previous_response_id
        node = await to_thread.run_sync(Node, state.engine, prev, who, previous_not_found(prev))
        _check_instructions(req, node.session.system)
        if any(m["role"] == "system" for m in messages):
            _one_question(req, chained=True)  # its 400
        if node.output is None:
            raise _busy(node.session.id)
        messages, instructions = node.history() + messages, node.session.system
    elif instructions:
        messages = [{"role": "system", "content": instructions}] + messages
    events = await gen.stateless_chat(
        state, messages, req.params, req.max_output_tokens, who, tool_calls.specs(req.tools)
    )
    return _shape(state, req, unstored_id(), instructions), events


def _calling(state, req: ResponsesRequest):
    """(the function reading a reply's calls: text -> (content, calls), or None without tools;
    the chat template)."""
    template = getattr(state.engine.tokenizer, "chat_template", None)
    parallel = req.echo["parallel_tool_calls"] is not False  # false: at most one call
    if not req.tools or req.tool_choice == "none":
        return None, template
    if tool_calls.chosen(req.tools, req.tool_choice) is not None:  # a forcing choice: the reply is calls
        if req.params.constrained:
            raise bad_value(
                "tool_choice", "a tool_choice that forces a call cannot be combined with a json text.format"
            )
        req.params = tool_calls.constrain(req.params, req.tools, req.tool_choice, template, parallel)
    return (lambda text: tool_calls.reply_calls(text, req.tools, req.tool_choice, template, parallel)), template


async def create_response(request: Request) -> Response:
    state = request.app.state.chatkv
    who, body = await read_request(request)
    req = parse_responses(body)
    check_model(state, req.model)
    limits.check_text_size(req.messages, state.context, "input")
    calls, template = _calling(state, req)
    slot = state.limit.acquire()
    streaming = False
    try:
        shape, events = await (_stored if req.store else _unstored)(state, req, who)
        if req.stream:
            streaming = True
            out = EventStream(shape)
            return stream_response(
                _events(out, until_cut(state, events), calls, template), events, slot, state, error_events=out.error
            )
        done = None
        async for item in until_cut(state, events):
            if isinstance(item, gen.Done):
                done = item
        content, found = calls(done.text) if calls else (done.text, [])
        return JSONResponse(shape.finished(content or "", done.finish_reason, done.usage, found))
    finally:
        if not streaming:
            slot.release()
            state.metrics_tick()


async def _events(out: EventStream, events, calls=None, template=None):
    """The stream's events; with tools (``calls``) text streams until a call begins and the
    calls are sent once the reply is complete (tool_calls.CallStream)."""
    split = tool_calls.CallStream(template) if calls is not None else None
    for piece in out.opening(lazy=split is not None):
        yield piece
    sent = []
    async for item in events:
        if isinstance(item, gen.Done):
            found = []
            text = item.text
            if split is not None:
                rest, found = split.finish(calls)
                text = "".join(sent) + rest
            for piece in out.closing(text, item.finish_reason, item.usage, found):
                yield piece
        else:
            now = split.feed(item) if split is not None else item
            sent.append(now)
            for piece in out.delta(now):
                yield piece


def _found(request: Request):
    state = request.app.state.chatkv
    state.check_open()
    who = check_api_key(request, state.users)
    rid = request.path_params["response_id"]
    return state, who, rid


async def get_response(request: Request) -> Response:
    state, who, rid = _found(request)
    node = await to_thread.run_sync(Node, state.engine, rid, who, response_not_found(rid))
    shape = ResponseShape(
        rid,
        state.model_name,
        instructions=node.session.system,
        previous_response_id=node.previous_id,
        store=True,
        max_output_tokens=None,
        created_at=_epoch(node.input.created_at),
    )
    out = node.output
    if out is None:
        return JSONResponse(shape.object("in_progress"))
    finish = "stop" if out.status == "complete" else "aborted"
    return JSONResponse(shape.finished(out.content, finish, Usage.from_message(out)))


async def delete_response(request: Request) -> Response:
    state, who, rid = _found(request)
    node = await to_thread.run_sync(Node, state.engine, rid, who, response_not_found(rid))
    s = node.session
    roots = [m for m in node.tree if m.parent_id is None]
    if node.input.parent_id is not None or len(roots) != 1:
        raise unsupported(
            "response_id",
            "chatkv deletes a response with every response chained from it, and only "
            "where that is a whole conversation: delete the chain's first response "
            "(the one made without previous_response_id)",
        )
    if s.id in state.responding or s.busy:
        raise _busy(s.id, "response_id")
    try:
        await to_thread.run_sync(s.delete)
    except Exception as e:  # noqa: BLE001
        raise _sdk_error(e, response_not_found(rid)) from e
    return JSONResponse({"id": rid, "object": "response", "deleted": True})
