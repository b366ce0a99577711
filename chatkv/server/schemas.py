"""Request bodies of the OpenAI API, validated by hand so every refusal is OpenAI's own
(status 400, ``param`` naming the field, ``code`` saying why; see ``errors.py``).

What is taken, besides OpenAI's own fields: vLLM's sampling extensions ``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, and chatkv's ``session_id``.
Fields a client library commonly sends that change nothing here (``user``, ``metadata``,
``store``, ``service_tier``) are accepted and ignored. Anything asking for what chatkv does
not do (images, ``best_of`` > 1) is
refused with ``unsupported_parameter`` instead of being silently dropped; an unknown field
is refused with ``unknown_parameter``, as OpenAI does.

(Past ~400 lines on purpose: the three request kinds share most fields, and their checks stay
together so a field is refused in the same words and with the same code wherever it comes.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from chatkv.engine.sampling import SamplingParams
from chatkv.errors import InvalidRequest
from chatkv.server import limits, tool_calls
from chatkv.server.errors import APIError, bad_value, unsupported

IGNORED = {"user", "metadata", "store", "service_tier"}
_SAMPLING = {
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "stream",
    "stream_options",
    "model",
}
CHAT_FIELDS = (
    _SAMPLING
    | IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        "modalities",
        "session_id",
    }
)
COMPLETION_FIELDS = _SAMPLING | IGNORED | {"prompt", "echo", "suffix", "best_of"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ChatRequest:
    model: str | None  # None: not given (schemas._model)
    messages: list[dict]  # [{"role": system|user|assistant, "content": str}]
    params: SamplingParams
    max_tokens: int | None  # None: what the context leaves
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    tools: list = field(default_factory=list)  # chatkv.sessions.tools.Tool (tool_calls.py)
    tool_choice: object = "none"
    n: int = 1  # samples of the one prompt (chatkv.server.samples)


@dataclass
class CompletionRequest:
    model: str | None  # None: not given (schemas._model)
    prompts: list  # each a str or a list of token ids
    params: SamplingParams
    max_tokens: int
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # samples of each prompt (chatkv.server.samples)


@dataclass
class EmbeddingRequest:
    model: str | None  # None: not given (any name, or none, unless names are strict: embeddings.py)
    inputs: list = field(default_factory=list)  # texts, or arrays of token ids (token_ids)
    encoding_format: str = "float"
    dimensions: int | None = None  # must be the model's own when given
    token_ids: bool = False  # inputs are arrays of the embedding model's token ids, not texts


def parse_json(raw: bytes) -> dict:
    try:
        body = limits.loads(raw)  # nesting bounded: a 400, never a RecursionError
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def _check_fields(body: dict, known: set[str]) -> None:
    extra = sorted(k for k in body if k not in known)
    if extra:
        raise APIError(400, f"Unrecognized request argument supplied: {extra[0]}", "unknown_parameter", extra[0])


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _model(body: dict, required: bool = False) -> str | None:
    """The request's ``model``: a non-empty string, or None when absent and not ``required`` (a
    chat, completion or Responses request may leave it out, as llama-server takes; the route's
    ``check_model`` asks for it under ``--strict-model-names``; embeddings likewise)."""
    model = body.get("model")
    if model is None:
        if not required:
            return None
        raise APIError(400, "you must provide a model parameter", "missing_parameter", "model")
    if not isinstance(model, str) or not model:
        raise bad_value("model", f"model must be a non-empty string, got {type(model).__name__}")
    return model


def _bool(body: dict, name: str, default: bool = False) -> bool:
    """The request's boolean ``name``, ``default`` when absent (the error names its type, never
    echoes a value that may be megabytes)."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_value(name, f"{name} must be a boolean, got {type(v).__name__}")
    return v


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise bad_value(name, f"{name} must be an integer >= 1, got {v!r}")
        return v
    return None


def _refuse_unless(body: dict, name: str, ok, what: str) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise unsupported(name, f"{name}={body[name]!r} is not supported by chatkv ({what})")


MAX_TOP_LOGPROBS = 20  # chatkv.engine.sampling.MAX_LOGPROBS
MAX_LOGIT_BIAS = 1024  # chatkv.engine.sampling.MAX_LOGIT_BIAS


def _within(v, bound: float) -> bool:
    """``v`` is a number (not a bool) in ``[-bound, bound]``: NaN, infinities and huge ints are not."""
    return _is_number(v) and -bound <= v <= bound  # NaN compares false; an int of any size compares exactly


def _finite_in(body: dict, name: str, bound: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _within(v, bound):
        raise bad_value(name, f"{name} must be a number in [{-bound:g}, {bound:g}], got {str(v)[:80]}")
    return float(v)


def _penalties_bias_logprobs(body: dict) -> dict:
    """SamplingParams values of OpenAI's ``presence_penalty``, ``frequency_penalty``, ``logit_bias``
    (keys: token ids as strings of ints) and log probabilities: chat's ``logprobs`` (a bool) with
    ``top_logprobs`` (an int in [0, 20]), or completions' ``logprobs`` (an int in [0, 20])."""
    out: dict = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _finite_in(body, name, 2.0)
        if v:
            out[name] = v
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_value(
                "logit_bias", f"logit_bias must be an object of token id to bias, got {type(bias).__name__}"
            )
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad_value("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        ids = {}
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise bad_value(
                    "logit_bias", f"logit_bias keys must be token ids (strings of integers >= 0), got {k[:80]!r}"
                )
            if not _within(v, 100):
                raise bad_value("logit_bias", f"logit_bias[{k!r}] must be a number in [-100, 100], got {str(v)[:80]}")
            ids[int(k)] = float(v)
        if ids:
            out["logit_bias"] = ids
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_value(
            "top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {str(top)[:80]}"
        )
    if lp is None or lp is False or (lp == 0 and _is_int(lp) and "messages" in body):
        if top:
            raise bad_value("top_logprobs", "top_logprobs needs logprobs: true")
    elif lp is True:
        out["logprobs"] = top or 0
    elif _is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS and "messages" not in body:
        out["logprobs"] = lp
    else:
        what = "a boolean" if "messages" in body else f"an integer in [0, {MAX_TOP_LOGPROBS}]"
        raise bad_value("logprobs", f"logprobs must be {what}, got {str(lp)[:80]}")
    return out


MAX_N = 16  # choices of one request (``n``): each is a sequence in the batch
MAX_CHOICES = 64  # /v1/completions: prompts x n


def _n(body: dict) -> int:
    """OpenAI's ``n``: an int in [1, MAX_N] (a bool, a float, 0, a negative or a huge one: a 400)."""
    v = body.get("n")
    if v is None:
        return 1
    if not _is_int(v) or not 1 <= v <= MAX_N:
        raise bad_value("n", f"n must be an integer in [1, {MAX_N}], got {str(v)[:80]}")
    return v


def _params(body: dict) -> SamplingParams:
    """SamplingParams from OpenAI's fields (max_tokens is set later, once the prompt's length is
    known; ``n`` is the parsers' own, ``_n``)."""
    _refuse_unless(body, "best_of", lambda v: v == 1 and _is_int(v), "send best_of=1")
    openai_sampling = _penalties_bias_logprobs(body)
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise bad_value("temperature", f"temperature must be a number in [0, 2], got {temperature!r}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise bad_value("stop", f"stop must be a non-empty string or a list of at most 4 of them, got {stop!r}")
    values = {"temperature": float(temperature), "stop": stop, "max_tokens": 1, **openai_sampling}
    for name in ("top_p", "top_k", "repetition_penalty", "seed", "stop_token_ids", "ignore_eos"):
        if body.get(name) is not None:
            values[name] = body[name]
    try:
        params = SamplingParams.from_dict(values)
    except InvalidRequest as e:
        name = str(e).split(" ", 1)[0]
        raise bad_value(name if name in values else None, str(e)) from None
    return params


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_value("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad_value("stream_options", f"stream_options must be {{'include_usage': bool}}, got {opts!r}")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_value("stream_options", f"stream_options.include_usage must be a boolean, got {include!r}")
    return stream, include


def _content(i: int, m: dict) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(
                    f"messages[{i}].content", f"content part of type {kind!r}: only text parts are supported"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_value(
        f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts, got {c!r}"
    )


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "messages is required", "missing_parameter", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_value("messages", "messages must be a non-empty array of {role, content}")
    limits.check_count(msgs, "messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_value(f"messages[{i}]", f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES and role != "tool":
            if role == "function":
                raise unsupported(
                    f"messages[{i}].role", f"messages[{i}].role 'function' is the deprecated form; use 'tool'"
                )
            raise bad_value(
                f"messages[{i}].role", f"messages[{i}].role must be one of {sorted(ROLES)} or 'tool', got {role!r}"
            )
        if m.get("function_call"):
            raise unsupported(f"messages[{i}].function_call", "function_call is the deprecated form; use tool_calls")
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):  # tool_calls.py
            content = _content(i, m) if m.get("content") is not None else ""
            out.append(tool_calls.history_message(i, m, role, content))
            continue
        out.append({"role": ROLES[role], "content": _content(i, m)})
    if out[-1]["role"] not in ("user", "tool"):
        raise bad_value("messages", f"the last message must be the user's or a tool result, got {out[-1]['role']!r}")
    tool_calls.check_call_ids(out)
    return out


def parse_chat(body: dict) -> ChatRequest:
    _check_fields(body, CHAT_FIELDS)
    model = _model(body)
    messages = _messages(body)
    listed, choice = tool_calls.tools(body)
    _bool(body, "parallel_tool_calls")  # false: at most one call (tool_calls.py)
    constraint = tool_calls.response_format(body)
    _refuse_unless(body, "modalities", lambda v: v == ["text"], "text output only")
    session_id = body.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise bad_value("session_id", f"session_id must be a non-empty string, got {session_id!r}")
    stream, include_usage = _stream(body)
    params = _params(body)
    if constraint:
        params = dataclasses.replace(params, **constraint)
    return ChatRequest(
        model,
        messages,
        params,
        _max_tokens(body, "max_completion_tokens", "max_tokens"),
        stream,
        include_usage,
        session_id,
        listed,
        choice,
        _n(body),
    )


def parse_completion(body: dict) -> CompletionRequest:
    _check_fields(body, COMPLETION_FIELDS)
    model = _model(body)
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "prompt is required", "missing_parameter", "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)) for p in prompt)
    ):
        prompts = list(prompt)
    else:
        raise bad_value("prompt", "prompt must be a string, an array of token ids, or a non-empty array of either")
    if len(prompts) > 64:
        raise bad_value("prompt", f"at most 64 prompts in one request, got {len(prompts)}")
    _refuse_unless(body, "echo", lambda v: v is False, "the prompt is not echoed")
    _refuse_unless(body, "suffix", lambda v: v == "", "no insertion")
    stream, include_usage = _stream(body)
    if stream and len(prompts) > 1:
        raise unsupported("prompt", "streaming takes one prompt per request")
    n = _n(body)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_value("n", f"{len(prompts)} prompts x n={n} is over {MAX_CHOICES} choices in one request")
    return CompletionRequest(
        model, prompts, _params(body), _max_tokens(body, "max_tokens") or 16, stream, include_usage, n
    )


def parse_embedding(body: dict) -> EmbeddingRequest:
    _check_fields(body, EMBEDDING_FIELDS)
    model = _model(body, required=False)
    inp = body.get("input")
    if isinstance(inp, str) or (isinstance(inp, list) and inp and all(_is_int(t) for t in inp)):
        inp = [inp]  # one text, or one array of token ids
    texts = isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp)
    ids = isinstance(inp, list) and inp and all(isinstance(t, list) and t and all(_is_int(i) for i in t) for t in inp)
    if not (texts or ids):
        raise bad_value(
            "input",
            "input must be a string, an array of strings, an array of token ids or an array of such arrays "
            "(none empty)",
        )
    if len(inp) > 2048:
        raise bad_value("input", f"at most 2048 inputs in one request, got {len(inp)}")
    if ids and sum(len(t) for t in inp) > 2048 * 512:
        raise bad_value("input", "at most 1,048,576 token ids in one request")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_value("encoding_format", f"encoding_format must be 'float' or 'base64', got {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or dims < 1):
        raise bad_value("dimensions", f"dimensions must be an integer >= 1, got {dims!r}")
    return EmbeddingRequest(model, inp, fmt, dims, token_ids=bool(ids))


# what resp_request.py (the Responses API's bodies) shares with the parsers above
check_fields, model_field, bool_field, max_tokens_field, refuse_unless = (
    _check_fields,
    _model,
    _bool,
    _max_tokens,
    _refuse_unless,
)
sampling_params, is_int = _params, _is_int
