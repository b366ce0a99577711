"""Cache-affinity routing for ``chatkv serve --ray``, without Ray: what a request is keyed by,
what the router knows about each replica, and the choice itself. ``request_routers.py`` is the
thin Ray Serve ``RequestRouter`` around this; keeping the policy here makes it testable
without a cluster.

Keys (``route_keys``), computed by the ingress from the request before it is routed:

- ``session``: the ``X-Session-Id`` header or ``session_id`` field, unless it is ``new``;
- ``prefixes``: for a chat, the hash of every leading run of messages (``history.prefix_keys``:
  role and text of messages ``[: i + 1]``; the same hashes the replica's canonical-token map
  uses); for a completion, the hash of every block-aligned leading run of the prompt (16
  token ids, or 64 characters of a text prompt). A match of key ``i`` is *strong* (worth
  moving a request for) when the run holds an assistant message (a conversation's own
  history), is long (``STRONG_CHARS`` characters / ``STRONG_IDS`` ids: pinned documents, a
  long system prompt), or was the whole prompt of a request that replica answered and this
  request extends it (a stateless client's next turn: the previous prompt and its reply are
  in that replica's cache). A shorter shared run (a short system prompt) is cheap to
  recompute once per replica, so it only breaks ties between equally loaded replicas.

What the router knows (``AffinityTable``), learnt two ways:

1. **answers** (immediate): the ingress sees which replica answered each request (the
   replica names itself in the answer's head) and records, under that replica, the
   request's session id (for ``new``: the id the answer carries) and its prefix keys. A
   session's next turn, or a stateless client's next request (whose messages start with
   this request's messages), finds it there at once.
2. **reports** (every ``request_routing_stats_period_s``, default 2 s): each replica's
   ``record_routing_stats`` lists the sessions whose KV it holds in memory and its most
   recent canonical-history keys. Reports fill in what this ingress never saw (another
   ingress replica's traffic, a restart of the ingress) and take back what a replica no
   longer holds (spilled to disk, evicted, closed). A report never moves a session that an
   answer placed on another live replica (the replica it left may still hold stale KV).

How stale: an answer is known before the client sees it. A report is at most one period
plus the controller's broadcast old (about 2-3 s here). Until then a replica that has just
evicted a session still looks like its holder; the cost of that is a restore from the shared
snapshots on that replica, the same as on any other, never a wrong answer (the KV is always
checked against the stored history). A dead replica is forgotten as soon as Ray reports it
gone; its sessions then go to the least-loaded replica, which restores them from disk.

The choice (``choose``): a pinned replica (``pin``; the ingress's /metrics fan-out) if it is
up; else the holder of the session, or of the longest strong prefix, unless it has more than
``imbalance`` requests in flight beyond the least-loaded replica (then affinity yields); else
the least-loaded replicas (fewer sessions held, then a weak prefix match, break ties).
Each rank returned is tried in order by Ray (a full replica rejects and the next rank goes).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from chatkv.server.history import prefix_keys

NEW_SESSION = "new"
STRONG_CHARS = 2048  # a shared run of messages this long is worth routing for (~500 tokens)
STRONG_IDS = 512
TEXT_BLOCK_CHARS = 64  # a text prompt's keys: one per 64 characters (about a 16-token block)
ID_BLOCK = 16  # a token-id prompt's keys: one per KV block of the default block size
KEY_BYTES = 12  # hex digest characters kept per key (48 bits: collisions only cost a miss)
MAX_PROMPT_KEYS = 256


@dataclass
class RouteKeys:
    """What the router routes one request by (built by the ingress, read by the router)."""

    session: str | None = None
    prefixes: list[str] = field(default_factory=list)  # shortest first
    strong: list[bool] = field(default_factory=list)  # per prefix: worth moving the request for
    pin: str | None = None  # a replica id that must answer (falls back to any when it is gone)
    kind: str = "other"  # chat | completion | other: only for the decision counters


def _short(digest: bytes) -> str:
    return digest.hex()[:KEY_BYTES]


def chat_keys(messages: list[dict]) -> tuple[list[str], list[bool]]:
    """The prefix keys of a chat's messages, and which are strong."""
    keys = [_short(k) for k in prefix_keys(messages)]
    strong, chars, seen_assistant = [], 0, False
    for m in messages:
        chars += len(m["content"])
        seen_assistant = seen_assistant or m["role"] == "assistant"
        strong.append(seen_assistant or chars >= STRONG_CHARS)
    return keys, strong


def prompt_keys(prompt) -> tuple[list[str], list[bool]]:
    """Block-aligned prefix keys of a completion prompt (text or token ids), one hash chain."""
    if isinstance(prompt, str):
        step, strong_at = TEXT_BLOCK_CHARS, STRONG_CHARS
        piece = lambda a, b: prompt[a:b].encode("utf-8", "surrogatepass")  # noqa: E731
    else:
        step, strong_at = ID_BLOCK, STRONG_IDS
        piece = lambda a, b: "".join(f"{i}," for i in prompt[a:b]).encode()  # noqa: E731
    keys, strong, h = [], [], hashlib.sha256(b"chatkv-prompt-v1")
    for n in range(step, min(len(prompt), step * MAX_PROMPT_KEYS) + 1, step):
        h.update(piece(n - step, n))
        keys.append(_short(h.copy().digest()))
        strong.append(n >= strong_at)
    return keys, strong


def _messages_ok(messages) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )


def route_keys(path: str, headers: dict[str, str], body: bytes) -> RouteKeys:
    """The keys of one HTTP request. Never raises: a body the router cannot read is routed
    by load, and the replica answers it with the proper error."""
    keys = RouteKeys()
    body_session = None
    try:
        parsed = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if not isinstance(parsed, dict):
        parsed = {}
    if path.endswith("/chat/completions"):
        keys.kind = "chat"
        body_session = parsed.get("session_id") if isinstance(parsed.get("session_id"), str) else None
        messages = parsed.get("messages")
        if _messages_ok(messages):
            keys.prefixes, keys.strong = chat_keys(messages)
    elif path.endswith("/completions"):
        keys.kind = "completion"
        prompt = parsed.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)):
            keys.prefixes, keys.strong = prompt_keys(prompt)
    session = headers.get("x-session-id") or body_session
    if session and session != NEW_SESSION:
        keys.session = session
    return keys


@dataclass
class _Entry:
    replica: str
    at: float  # when it was learnt (time.time())
    whole: bool = False  # the whole prompt of an answered request: its reply's KV follows it there


class AffinityTable:
    """What each replica holds, as far as this process knows; thread-safe (the ingress writes
    from its event loop, the router reads from Ray's router loop). Bounded LRU maps."""

    def __init__(self, max_sessions: int = 200_000, max_prefixes: int = 1_000_000):
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Entry] = OrderedDict()
        self._prefixes: OrderedDict[str, _Entry] = OrderedDict()
        self.max_sessions, self.max_prefixes = max_sessions, max_prefixes
        self.replicas: set[str] = set()  # the live replicas Ray last told the router about
        self.decisions: Counter = Counter()  # reason -> requests routed so

    # -- learning ---------------------------------------------------------------

    @staticmethod
    def _put(lru: OrderedDict, key: str, entry: _Entry, bound: int) -> None:
        lru[key] = entry
        lru.move_to_end(key)
        while len(lru) > bound:
            lru.popitem(last=False)

    def learn(self, keys: RouteKeys, replica: str, session: str | None = None, at: float | None = None) -> None:
        """``replica`` answered a request with ``keys`` (and ``session``, the id it answered with)."""
        entry = _Entry(replica, time.time() if at is None else at)
        with self._lock:
            for sid in {s for s in (keys.session, session) if s and s != NEW_SESSION}:
                self._put(self._sessions, sid, entry, self.max_sessions)
            for i, k in enumerate(keys.prefixes):
                whole = i == len(keys.prefixes) - 1
                old = self._prefixes.get(k)
                if old is not None and old.replica == replica and old.whole:
                    whole = True  # a shorter request of the same conversation does not undo it
                self._put(self._prefixes, k, _Entry(entry.replica, entry.at, whole), self.max_prefixes)

    def merge_report(self, replica: str, stats: dict) -> None:
        """A replica's ``record_routing_stats``: {"at": time, "sessions": [...], "prefixes": [...]}.
        Adds what no live replica is known to hold; drops what this replica no longer holds (if
        learnt before the report). It never moves a session known to be on another live replica:
        a replica a session has left may still hold its old KV, and an answer is newer news."""
        if not isinstance(stats, dict) or "sessions" not in stats:
            return
        at = float(stats.get("at", 0.0))
        held = set(stats.get("sessions") or ())
        with self._lock:
            for sid in held:
                old = self._sessions.get(sid)
                if old is None or old.replica not in self.replicas:
                    self._put(self._sessions, sid, _Entry(replica, at), self.max_sessions)
            for sid, e in list(self._sessions.items()):
                if e.replica == replica and sid not in held and e.at < at:
                    del self._sessions[sid]
            for k in stats.get("prefixes") or ():
                old = self._prefixes.get(k)
                if old is None or old.replica not in self.replicas:
                    self._put(self._prefixes, k, _Entry(replica, at), self.max_prefixes)

    def set_replicas(self, replicas) -> None:
        """The live replicas; what the others held is forgotten."""
        with self._lock:
            self.replicas = set(replicas)
            for lru in (self._sessions, self._prefixes):
                for k in [k for k, e in lru.items() if e.replica not in self.replicas]:
                    del lru[k]

    # -- reading ----------------------------------------------------------------

    def session_holder(self, session: str) -> str | None:
        with self._lock:
            e = self._sessions.get(session)
            return e.replica if e is not None and e.replica in self.replicas else None

    def prefix_holder(self, keys: RouteKeys) -> tuple[str | None, bool]:
        """(the replica holding the longest known prefix, whether that prefix is strong)."""
        with self._lock:
            for i in range(len(keys.prefixes) - 1, -1, -1):
                e = self._prefixes.get(keys.prefixes[i])
                if e is not None and e.replica in self.replicas:
                    strong = (i < len(keys.strong) and keys.strong[i]) or (e.whole and i < len(keys.prefixes) - 1)
                    return e.replica, bool(strong)
        return None, False

    def sessions_held(self) -> Counter:
        with self._lock:
            return Counter(e.replica for e in self._sessions.values())

    def count(self, reason: str) -> None:
        with self._lock:
            self.decisions[reason] += 1


def choose(
    keys: RouteKeys,
    replicas: list[str],
    load: dict[str, int],
    table: AffinityTable,
    imbalance: int,
    rng: random.Random | None = None,
) -> tuple[list[list[str]], str]:
    """Ranks of replica ids to try in order, and the reason (a decision counter's name):
    ``pinned``, ``session``, ``prefix``, ``yielded`` (the holder was overloaded),
    ``shared_prefix`` (a weak match broke a tie), ``least_loaded``."""
    if not replicas:
        return [], "none"
    rng = rng or random
    if keys.pin in replicas:
        return [[keys.pin]], "pinned"
    lowest = min(load.get(r, 0) for r in replicas)
    holder, strong, reason = None, False, "least_loaded"
    if keys.session:
        holder, strong, reason = table.session_holder(keys.session), True, "session"
    if holder is None and keys.prefixes:
        holder, strong = table.prefix_holder(keys)
        reason = "prefix" if strong else "shared_prefix"
    if holder in replicas and strong:
        if load.get(holder, 0) - lowest <= imbalance:
            return [[holder], [r for r in replicas if r != holder]], reason
        reason = "yielded"
    held = table.sessions_held()

    def rank_key(r: str):
        weak_hit = 0 if (r == holder and not strong) else 1
        return (load.get(r, 0), held.get(r, 0), weak_hit, rng.random())

    ordered = sorted(replicas, key=rank_key)
    if reason not in ("yielded",):
        reason = "shared_prefix" if holder is not None and ordered[0] == holder and not strong else "least_loaded"
    return [[r] for r in ordered], reason


_TABLES: dict[str, AffinityTable] = {}
_TABLES_LOCK = threading.Lock()


def table_for(deployment: str) -> AffinityTable:
    """The one table of ``deployment`` in this process (the ingress and its router share it)."""
    with _TABLES_LOCK:
        return _TABLES.setdefault(deployment, AffinityTable())
