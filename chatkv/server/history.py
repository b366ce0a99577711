"""Canonical tokens for stateless clients that send their whole history with every request.

Re-tokenising a conversation's text rarely gives back the ids the model produced: a reply's
tokens are whatever was sampled (" Par" + "is" where the tokenizer would say " Paris"),
and bytes that were no whole character come back as U+FFFD. One differing id early in the
history and the radix cache misses everything after it. So, per server process, a small
LRU maps a hash of a message prefix ending in an assistant reply to the exact token ids
the engine had for it: the prompt it was given, the reply's tokens as generated, and the
template's end-of-turn tokens (as a session appends them, ``chatkv.TurnRenderer``). The next
request that starts with that prefix gets those ids, followed by its new messages rendered
on their own (the text the chat template adds after the prefix), so its prompt is the
previous request's prompt + reply, token for token, and hits the KV those left in the
radix cache.

The prefix is matched by content (role and text of every message), so any client that
sends back what it received hits, whichever connection or process asked first. A reply
cut by a stop string is not recorded (its tokens hold text the client never saw), nor is
one the template would render differently after more messages (the match checks that the
new messages' text follows the prefix's text exactly, else the whole conversation is
rendered and tokenised as usual: slower, never wrong).
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from itertools import islice

from chatkv import LOCAL_USER, TurnRenderer
from chatkv.errors import InvalidRequest, check_text
from chatkv.server import generic_tools


def prefix_keys(messages: list[dict], user: str | None = None) -> list[bytes]:
    """``keys[i]``: the hash of ``messages[: i + 1]`` (roles and contents, in order), salted with
    ``user`` (a ``chatkv serve`` API key's user; None or "local": the local user, unsalted), so one
    user's history never maps onto another's tokens."""
    keys, h = [], b"chatkv-history-v1"
    if user is not None and user != LOCAL_USER:
        h = hashlib.sha256(h + b"\0user\0" + user.encode()).digest()
    for m in messages:
        h = hashlib.sha256(
            h + json.dumps([m["role"], m["content"]], ensure_ascii=False).encode("utf-8", "surrogatepass")
        ).digest()
        keys.append(h)
    return keys


class HistoryTokens:
    """The LRU; thread-safe. ``max_tokens`` bounds the ids held (4 bytes each)."""

    def __init__(self, tokenizer, max_tokens: int = 4_000_000):
        self._turns = TurnRenderer(tokenizer)
        self._lru: OrderedDict[bytes, array] = OrderedDict()
        self._size = 0
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self.hits = 0  # requests whose history came from the map
        self.misses = 0  # requests with an assistant message whose history was not found

    def __len__(self) -> int:
        return len(self._lru)

    def prompt(
        self, messages: list[dict], user: str | None = None, tools: list[dict] | None = None
    ) -> tuple[list[int], int]:
        """The prompt's token ids for ``messages`` (ending with a user message), and how many
        leading messages came from the map (0: the whole conversation was tokenised). With
        ``tools`` (specs the template renders) it is rendered whole: the map is not used. A
        template without tools gets them, and any calls and results in the history, as plain
        messages (chatkv.server.generic_tools), also rendered whole."""
        for i, m in enumerate(messages):
            check_text(f"messages[{i}].content", m["content"])
        calls = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if (tools or calls) and generic_tools.is_generic(self._turns.tokenizer.chat_template):
            return self._turns.first(generic_tools.messages(messages, tools)), 0
        if tools:
            if not self._turns.renders_tools(tools):
                raise InvalidRequest(
                    "tools: the model's chat template does not render tools (it has no 'tools' support)"
                )
            return self._turns.first(messages, tools), 0
        keys = prefix_keys(messages, user)
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1]["role"] != "assistant":
                continue
            with self._lock:
                ids = self._lru.get(keys[k - 1])
                if ids is not None:
                    self._lru.move_to_end(keys[k - 1])
            if ids is None:
                continue
            rest = self._turns.continuation(messages, k)  # a client's text is data (chatkv.engine.text_tokens)
            if rest is None:  # the template rewrites earlier turns
                break
            with self._lock:
                self.hits += 1
            return ids.tolist() + rest, k
        if any(m["role"] == "assistant" for m in messages):
            with self._lock:
                self.misses += 1
        return self._turns.first(messages), 0

    def recent_keys(self, n: int) -> list[bytes]:
        """The ``n`` most recently used prefix keys (newest last): what a replica reports to
        ``chatkv serve --ray``'s router (``affinity.py``)."""
        with self._lock:
            keys = list(islice(reversed(self._lru), max(n, 0)))
        return keys[::-1]

    def record(
        self,
        messages: list[dict],
        reply: str,
        prompt_ids: list[int],
        generated: list[int],
        stopped_by_string: bool = False,
        user: str | None = None,
    ) -> None:
        """Remember the ids of ``messages`` + the assistant's ``reply`` for the next request."""
        if stopped_by_string or self.max_tokens <= 0:
            return
        ids = array("l", prompt_ids)
        ids.extend(generated)
        ids.extend(self._turns.close_reply(list(generated)))
        key = prefix_keys(messages + [{"role": "assistant", "content": reply}], user)[-1]
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._lru[key] = ids
            self._size += len(ids)
            while self._size > self.max_tokens and self._lru:
                _, dropped = self._lru.popitem(last=False)
                self._size -= len(dropped)
