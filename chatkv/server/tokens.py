"""``POST /tokenize`` and ``POST /detokenize`` (also under ``/v1``), in the shapes llama-server and
vLLM give them, with the served model's own tokenizer:

- ``/tokenize``: ``{"content": "..."}`` (llama-server; ``add_special``, default false, and
  ``with_pieces``: each token as ``{"id", "piece"}``) or ``{"prompt": "..."}`` (vLLM;
  ``add_special_tokens``, default true). The answer: ``{"tokens": [...], "count": n,
  "max_model_len": context}`` (and ``token_strs`` when ``return_token_strs`` is true). The text is
  tokenised as ``/v1/completions`` takes a prompt: raw, its special-token strings parsed.
  vLLM's ``{"messages": [...]}`` is rendered with the chat template first, as
  ``/v1/chat/completions`` renders them (``add_generation_prompt``, default true: up to the
  assistant's reply; the contents are data, their special-token strings plain text), so
  ``count`` is the prompt_tokens a chat completion of those messages reports.
- ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"content": text, "prompt": text}`` (llama-server's
  key and vLLM's). Each id must be an integer of the vocabulary, at most ``MAX_TOKENS`` of them.

A ``model`` field, when given, is checked as every route checks it. Every refusal is a 400
naming the field (an id that is not an integer, outside the vocabulary, a list too long).
"""

from __future__ import annotations

from anyio import to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatkv.errors import check_text
from chatkv.server.errors import APIError, bad_value, from_chatkv, unsupported
from chatkv.server.limits import check_count, check_text_size
from chatkv.server.routes import check_model, read_request
from chatkv.server.schemas import ROLES, bool_field

MAX_TOKENS = 1 << 17  # ids one /detokenize takes (or the context, if larger)
TOKENIZE_FIELDS = {
    "model",
    "content",
    "prompt",
    "messages",
    "add_generation_prompt",
    "add_special",
    "add_special_tokens",
    "with_pieces",
    "return_token_strs",
}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _check(body: dict, known: set[str], state) -> None:
    extra = sorted(k for k in body if k not in known)
    if extra:
        raise APIError(400, f"Unrecognized request argument supplied: {extra[0]}", "unknown_parameter", extra[0])
    if "model" in body and body["model"] is not None:
        if not isinstance(body["model"], str):
            raise bad_value("model", "model must be a string")
        check_model(state, body["model"])


def _chat_messages(body: dict) -> list[dict]:
    """``messages`` as ``Engine.encode_chat`` takes them: ``{role, content}`` each, the content a
    string or a list of text parts (joined by newlines, as chat completions join them)."""
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise bad_value("messages", "messages must be a non-empty array of {role, content}")
    check_count(msgs, "messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_value(where, f"{where} must be an object, got {type(m).__name__}")
        extra = sorted(k for k in m if k not in ("role", "content", "name"))
        if extra:
            raise unsupported(f"{where}.{extra[0]}", f"/tokenize renders role and content only, not {extra[0]!r}")
        role = m.get("role")
        if role not in ROLES and role != "tool":
            raise bad_value(f"{where}.role", f"{where}.role must be one of {sorted(ROLES)} or 'tool'")
        c = m.get("content")
        if isinstance(c, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c
        ):
            c = "\n".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise bad_value(f"{where}.content", f"{where}.content must be a string or a list of text parts")
        out.append({"role": ROLES.get(role, role), "content": c})
    return out


async def _tokenize_chat(state, body: dict) -> Response:
    messages = _chat_messages(body)
    check_text_size(messages, state.context)
    if "content" in body or "prompt" in body:
        raise bad_value("messages", "send messages or a text (content, prompt), not both")
    if bool_field(body, "add_special_tokens", False) or bool_field(body, "add_special", False):
        raise unsupported("add_special_tokens", "the chat template places the special tokens of messages")
    gen = bool_field(body, "add_generation_prompt", True)
    strs = bool_field(body, "return_token_strs", False)
    if bool_field(body, "with_pieces", False):
        raise unsupported("with_pieces", "with_pieces goes with content; send return_token_strs with messages")
    tok = state.engine.tokenizer

    def run():
        ids = [int(i) for i in state.engine.encode_chat(messages, add_generation_prompt=gen)]
        return ids, [tok.decode([i]) for i in ids] if strs else None

    return await _tokens(state, run, strs=strs)


async def _tokens(state, run, pieces: bool = False, strs: bool = False) -> Response:
    """The reply of ``/tokenize``: ``run()`` (in a worker thread) gives the ids and, when asked
    (``pieces``, ``strs``), each id's text."""
    try:
        ids, shown = await to_thread.run_sync(run)
    except Exception as e:  # noqa: BLE001 - text that is not valid Unicode, a template that refuses
        raise from_chatkv(e) from e
    out: dict = {
        "tokens": [{"id": i, "piece": p} for i, p in zip(ids, shown)] if pieces else ids,
        "count": len(ids),
        "max_model_len": state.context,
    }
    if strs:
        out["token_strs"] = shown
    return JSONResponse(out)


async def tokenize(request: Request) -> Response:
    state = request.app.state.chatkv
    _, body = await read_request(request)
    _check(body, TOKENIZE_FIELDS, state)
    if "messages" in body:
        return await _tokenize_chat(state, body)
    if "add_generation_prompt" in body:
        raise bad_value("add_generation_prompt", "add_generation_prompt goes with messages")
    name = "content" if "content" in body else "prompt"
    text = body.get(name)
    if not isinstance(text, str):
        raise APIError(
            400, "send the text to tokenize as 'content' (or vLLM's 'prompt'): a string", "missing_parameter", name
        )
    check_text_size([{"content": text}], state.context, name)
    add = bool_field(body, "add_special", False) if name == "content" else bool_field(body, "add_special_tokens", True)
    pieces, strs = bool_field(body, "with_pieces", False), bool_field(body, "return_token_strs", False)
    tok = state.engine.tokenizer

    def run():
        ids = [int(i) for i in tok(check_text(name, text), add_special_tokens=add)["input_ids"]]
        shown = [tok.decode([i]) for i in ids] if pieces or strs else None
        return ids, shown

    return await _tokens(state, run, pieces, strs)


async def detokenize(request: Request) -> Response:
    state = request.app.state.chatkv
    _, body = await read_request(request)
    _check(body, DETOKENIZE_FIELDS, state)
    ids = body.get("tokens")
    if ids is None:
        raise APIError(400, "tokens is required: a list of token ids", "missing_parameter", "tokens")
    if not isinstance(ids, list):
        raise bad_value("tokens", f"tokens must be a list of token ids, got {type(ids).__name__}")
    limit = max(MAX_TOKENS, state.context)
    if len(ids) > limit:
        raise bad_value("tokens", f"tokens holds {len(ids)} ids; /detokenize takes at most {limit}")
    tok = state.engine.tokenizer
    vocab = len(tok)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_value(f"tokens[{i}]", f"tokens[{i}] must be an integer token id, got {type(t).__name__}")
        if not 0 <= t < vocab:
            shown = str(t) if len(str(t)) <= 24 else str(t)[:24] + "..."
            raise bad_value(f"tokens[{i}]", f"tokens[{i}] is {shown}: not a token id of this model (0 to {vocab - 1})")
    text = await to_thread.run_sync(lambda: tok.decode(ids, skip_special_tokens=False))
    return JSONResponse({"content": text, "prompt": text})
