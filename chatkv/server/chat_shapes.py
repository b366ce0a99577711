"""Response bodies in OpenAI's shapes: chat completions and their chunks, text completions,
usage, and server-sent events.

``usage.prompt_tokens_details.cached_tokens`` counts every prompt token whose KV the request
did not compute: device prefix-cache hits, tokens copied back from the host tier, and tokens
restored from a snapshot on disk. ``usage.chatkv`` splits them (an extra field; OpenAI's
clients keep unknown fields) and adds the computed tokens and the time to first token.
With n > 1 choices (samples.py) the prompt is counted once (``n_usage``) and
``usage.chatkv.choices`` lists each sample's cached, computed and completion tokens.

Log probabilities (``chatkv.outputs.TokenLogprob``, one per generated token, the stop token
excluded) in OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``
(``chat_logprobs``) and completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``
(``completion_logprobs``). A token's ``bytes`` are its own UTF-8 bytes, also when it holds part
of a character (its ``token`` text then shows U+FFFD). Streamed, each chunk carries the tokens
generated since the previous one, so a token's logprob may come a chunk before its text (which
the stop-string and whole-character hold-back keep back).
"""

from __future__ import annotations

import functools
import json
import time
import uuid

from chatkv.outputs import TokenLogprob, Usage

FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_json(u: Usage, choices: list[Usage] | None = None) -> dict:
    """OpenAI's ``usage`` of ``u``; ``choices`` (n > 1): each sample's own usage, listed in
    ``usage.chatkv.choices`` (its cached and computed prompt tokens: what it shared)."""
    out = _usage_json(u)
    if choices is not None:
        out["chatkv"]["choices"] = [
            {
                "cached_tokens": c.cached_tokens + c.host_tokens + c.restored_tokens,
                "computed_tokens": c.computed_tokens,
                "completion_tokens": c.generated_tokens,
            }
            for c in choices
        ]
    return out


def _usage_json(u: Usage) -> dict:
    hit = u.cached_tokens + u.host_tokens + u.restored_tokens
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        # reused/recomputed: RAG sources' tokens placed from chunk KV / recomputed over it (rag_kv_reuse)
        "prompt_tokens_details": {
            "cached_tokens": hit,
            "reused_tokens": u.reused_tokens,
            "recomputed_tokens": u.recomputed_tokens,
        },
        "chatkv": {
            "cached_tokens": u.cached_tokens,
            "host_tokens": u.host_tokens,
            "restored_tokens": u.restored_tokens,
            "computed_tokens": u.computed_tokens,
            "proposed_tokens": u.proposed_tokens,  # speculative decoding (prompt lookup): drafted
            "accepted_tokens": u.accepted_tokens,  # ... and of those, generated
            "ttft_s": round(u.ttft_s, 6),
            "tokens_per_s": round(u.tokens_per_s, 3),
        },
    }


def sum_usage(usages: list[Usage]) -> Usage:
    out = Usage()
    for u in usages:
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "host_tokens",
            "restored_tokens",
            "computed_tokens",
            "generated_tokens",
            "proposed_tokens",
            "accepted_tokens",
            "reused_tokens",
            "recomputed_tokens",
        ):
            setattr(out, name, getattr(out, name) + getattr(u, name))
    out.ttft_s = max((u.ttft_s for u in usages), default=0.0)
    return out


def n_usage(usages: list[Usage], prefill: Usage | None = None, waited_s: float = 0.0) -> Usage:
    """The usage of one request's n samples of one prompt, as OpenAI counts it: the prompt once,
    the completion tokens of every choice summed. Its cached tokens are those of the request that
    computed the prompt once (``prefill``; None: the first sample's), its computed tokens every
    prompt token computed for it (that request's and each sample's partial last block), its time
    to first token the last choice's first token, counted from the start (``waited_s``: the
    prompt's computing before the samples were submitted)."""
    first = prefill if prefill is not None else usages[0]
    out = Usage(
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        host_tokens=first.host_tokens,
        restored_tokens=first.restored_tokens,
    )
    out.computed_tokens = (prefill.computed_tokens if prefill is not None else 0) + sum(
        u.computed_tokens for u in usages
    )
    for name in ("generated_tokens", "proposed_tokens", "accepted_tokens", "reused_tokens", "recomputed_tokens"):
        setattr(out, name, sum(getattr(u, name) for u in usages))
    out.ttft_s = waited_s + max((u.ttft_s for u in usages), default=0.0)
    return out


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's ``bytes_to_unicode``) back to their bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=65536)
def token_text(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(the text, the UTF-8 bytes) of one token: its decoded text, or where that is part of a
    character, the bytes its vocabulary entry stands for (byte-level BPE, or SentencePiece's
    ``<0xNN>``)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if "\ufffd" not in text:
        return text, text.encode("utf-8")
    try:
        piece = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # noqa: BLE001 - a tokenizer without it: its decoded text is all there is
        piece = None
    if isinstance(piece, str):
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            return text, bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return text, bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
    return text, text.encode("utf-8")


def chat_logprobs(entries: list[TokenLogprob] | None, tokenizer) -> dict | None:
    """Chat's ``choices[i].logprobs`` of ``entries`` (None: not asked for)."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> dict:
        text, raw = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob] | None, tokenizer, offset: int = 0) -> dict | None:
    """Completions' ``choices[i].logprobs`` of ``entries`` (None: not asked for); ``text_offset``
    counts characters from ``offset`` (the text of the tokens before them, streamed)."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        text = token_text(tokenizer, e.token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t)[0]: v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def sse(obj) -> bytes:
    """One server-sent event: ``data: <json>`` (or ``data: [DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class Chat:
    """The ids and shapes of one chat completion, streamed or not."""

    def __init__(self, model: str, session_id: str | None = None, include_usage: bool = False):
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.model = model
        self.session_id = session_id
        self.include_usage = include_usage

    def _base(self, obj: str) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}
        if self.session_id is not None:
            out["session_id"] = self.session_id
        return out

    def completion(self, text: str, finish: str, usage: Usage, logprobs: dict | None = None) -> dict:
        return {
            **self._base("chat.completion"),
            "choices": [self.choice(0, text, finish, logprobs)],
            "usage": usage_json(usage),
        }

    @staticmethod
    def choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": FINISH.get(finish, finish),
        }

    def completion_n(self, choices: list[dict], usage: Usage, per_choice: list[Usage]) -> dict:
        """A chat completion of n > 1 ``choices`` (``choice``'s dicts); ``per_choice``: each one's usage."""
        return {**self._base("chat.completion"), "choices": choices, "usage": usage_json(usage, per_choice)}

    def chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
        out = {
            **self._base("chat.completion.chunk"),
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": FINISH.get(finish, finish) if finish else None,
                }
            ],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage, per_choice: list[Usage] | None = None) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage_json(usage, per_choice)}


class Completion:
    """The ids and shapes of one text completion."""

    def __init__(self, model: str, include_usage: bool = False):
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _base(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def completion(
        self,
        texts_and_finishes: list[tuple[str, str]],
        usage: Usage,
        logprobs: list[dict | None] | None = None,
        per_choice: list[Usage] | None = None,
    ) -> dict:
        logprobs = logprobs or [None] * len(texts_and_finishes)
        return {
            **self._base(),
            "choices": [
                {"index": i, "text": text, "logprobs": lp, "finish_reason": FINISH.get(f, f)}
                for i, ((text, f), lp) in enumerate(zip(texts_and_finishes, logprobs))
            ],
            "usage": usage_json(usage, per_choice),
        }

    def chunk(self, text: str, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
        out = {
            **self._base(),
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": FINISH.get(finish, finish) if finish else None,
                }
            ],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage, per_choice: list[Usage] | None = None) -> dict:
        return {**self._base(), "choices": [], "usage": usage_json(usage, per_choice)}
