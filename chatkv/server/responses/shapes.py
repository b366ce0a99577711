"""Response objects and stream events of the Responses API, in OpenAI's shapes.

``usage.input_tokens_details.cached_tokens`` counts every input token whose KV the request did
not compute, as chat completions' ``prompt_tokens_details.cached_tokens`` does: device
prefix-cache hits, tokens copied back from host memory and tokens restored from a snapshot on
disk; ``usage.chatkv`` splits them. A stream is ``event: <type>`` / ``data: <json>`` pairs
with a ``sequence_number`` each, ending with ``response.completed`` (``response.incomplete``
when the reply was cut); no ``[DONE]``. An error after the first event is an ``error`` event,
which the openai client raises as an ``APIError``.

With tools (``resp_tools.py``) the output is the message (when the reply has text) and then one
``function_call`` item per call; a stream opens the message item with its first text, and
sends each call once the reply is complete (``output_item.added``, one
``function_call_arguments.delta`` with the whole arguments, ``.done``, ``output_item.done``).
"""

from __future__ import annotations

import json
import time

from chatkv.outputs import Usage
from chatkv.server.chat_shapes import usage_json
from chatkv.server.errors import APIError
from chatkv.server.responses.tools import call_item

INCOMPLETE = {"length": "max_output_tokens", "aborted": "interrupted"}


def usage_object(u: Usage) -> dict:
    chat = usage_json(u)
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "chatkv": chat["chatkv"],
    }


class ResponseShape:
    """One response's object, as it is when made, in progress and finished."""

    def __init__(
        self,
        response_id: str,
        model: str,
        *,
        instructions: str | None,
        previous_response_id: str | None,
        store: bool,
        max_output_tokens: int | None,
        metadata: dict | None = None,
        echo: dict | None = None,
        created_at: float | None = None,
    ):
        self.id = response_id
        self.item_id = "msg_" + response_id[len("resp_") :]
        self.base = {
            "id": response_id,
            "object": "response",
            "created_at": int(created_at or time.time()),
            "model": model,
            "instructions": instructions,
            "previous_response_id": previous_response_id,
            "store": store,
            "max_output_tokens": max_output_tokens,
            "metadata": dict(metadata or {}),
            "temperature": 1.0,
            "top_p": 1.0,
            "truncation": "disabled",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "reasoning": {"effort": None, "summary": None},
            "user": None,
            "error": None,
            "incomplete_details": None,
            **(echo or {}),
        }

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict:
        """The output message; ``text`` None: no content part yet."""
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [self.part(text)],
        }

    def object(
        self,
        status: str = "in_progress",
        text: str | None = None,
        finish: str | None = None,
        usage: Usage | None = None,
        calls: list | None = None,
    ) -> dict:
        out = {**self.base, "status": status, "output": [], "usage": None}
        if text is not None and (text or not calls):
            out["output"] = [self.item(text, "incomplete" if finish in INCOMPLETE else "completed")]
        out["output"] += [call_item(c) for c in calls or ()]
        if finish in INCOMPLETE:
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": INCOMPLETE[finish]}
        if usage is not None:
            out["usage"] = usage_object(usage)
        return out

    def finished(self, text: str, finish: str, usage: Usage | None, calls: list | None = None) -> dict:
        """``text``: the reply's text outside any ``calls`` (chatkv.sessions.tools.ToolCall)."""
        return self.object("completed", text, finish, usage, calls)


class EventStream:
    """The events of one streamed response, numbered in order."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.opened = False  # the message item (it opens with the first text, or at the end)

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def opening(self, lazy: bool = False) -> list[bytes]:
        """The first events; ``lazy``: the message item waits for the reply's first text."""
        s = self.shape
        out = [
            self.event("response.created", response=s.object()),
            self.event("response.in_progress", response=s.object()),
        ]
        return out if lazy else out + self._open()

    def _open(self) -> list[bytes]:
        s, at = self.shape, {"output_index": 0}
        self.opened = True
        return [
            self.event("response.output_item.added", **at, item=s.item(None, "in_progress")),
            self.event("response.content_part.added", item_id=s.item_id, **at, content_index=0, part=s.part("")),
        ]

    def delta(self, text: str) -> list[bytes]:
        if not text:
            return []
        head = [] if self.opened else self._open()
        return head + [
            self.event(
                "response.output_text.delta",
                item_id=self.shape.item_id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def closing(self, text: str, finish: str, usage: Usage, calls: list | None = None) -> list[bytes]:
        """``text``: the reply's whole text outside any ``calls``."""
        s, at = self.shape, {"item_id": self.shape.item_id, "output_index": 0, "content_index": 0}
        final = s.finished(text, finish, usage, calls)
        out = []
        if self.opened or text or not calls:
            out = ([] if self.opened else self._open()) + [
                self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=s.part(text)),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
            ]
        for k, item in enumerate(final["output"][1 if out else 0 :], 1 if out else 0):
            fc = {"output_index": k, "item_id": item["id"]}
            out += [
                self.event(
                    "response.output_item.added",
                    output_index=k,
                    item={**item, "arguments": "", "status": "in_progress"},
                ),
                self.event("response.function_call_arguments.delta", **fc, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **fc, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=k, item=item),
            ]
        return out + [
            self.event(
                "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
            )
        ]

    def error(self, error: APIError) -> list[bytes]:
        e = error.body()["error"]
        return [self.event("error", code=e["code"], message=e["message"], param=e["param"], error=e)]
