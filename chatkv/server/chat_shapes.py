"""Response bodies in OpenAI's shapes: chat completions and their chunks, text completions,
usage, and server-sent events.

``usage.prompt_tokens_details.cached_tokens`` counts every prompt token whose KV the request
did not compute: device prefix-cache hits, tokens copied back from the host tier, and tokens
restored from a snapshot on disk. ``usage.chatkv`` splits them (an extra field; OpenAI's
clients keep unknown fields) and adds the computed tokens and the time to first token.
"""

from __future__ import annotations

import json
import time
import uuid

from chatkv.outputs import Usage

FINISH = {"stop": "stop", "length": "length", "aborted": "abort"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_json(u: Usage) -> dict:
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

    def completion(self, text: str, finish: str, usage: Usage) -> dict:
        return {
            **self._base("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": FINISH.get(finish, finish),
                }
            ],
            "usage": usage_json(usage),
        }

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        out = {
            **self._base("chat.completion.chunk"),
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": FINISH.get(finish, finish) if finish else None,
                }
            ],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._base("chat.completion.chunk"), "choices": [], "usage": usage_json(usage)}


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

    def completion(self, texts_and_finishes: list[tuple[str, str]], usage: Usage) -> dict:
        return {
            **self._base(),
            "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": FINISH.get(f, f)}
                for i, (text, f) in enumerate(texts_and_finishes)
            ],
            "usage": usage_json(usage),
        }

    def chunk(self, text: str, finish: str | None = None) -> dict:
        out = {
            **self._base(),
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": FINISH.get(finish, finish) if finish else None,
                }
            ],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        return {**self._base(), "choices": [], "usage": usage_json(usage)}
