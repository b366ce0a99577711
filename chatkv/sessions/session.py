"""Sessions: conversations that keep their KV between turns, while idle, and across restarts.

``engine.session(...)`` opens a new conversation, ``engine.resume(id)`` an old one.
Between turns a session holds its KV in memory: its history's full blocks locked
in the radix tree and its own partial last block. When idle (or when memory runs
short) the KV is spilled to a safetensors snapshot and released; the next turn
loads it back instead of recomputing. Messages live in the database and are
committed before the turn reports done.

(A few lines past 400: the Session handle's public methods, each a short checked hand-off to
the session manager.)
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator, Protocol

from chatkv.engine.sampling import SamplingParams
from chatkv.errors import EngineClosed, InvalidRequest, SessionError, check_text
from chatkv.outputs import Reply
from chatkv.sessions.context_window import check_overflow

if TYPE_CHECKING:
    from chatkv.kvcache.types import RetainedKV
    from chatkv.storage.repository import Store


_DONE = object()


def _last(pieces: Iterator[str | Reply]) -> Reply:
    """Run a turn's stream to its end; its Reply."""
    reply = None
    for piece in pieces:
        if isinstance(piece, Reply):
            reply = piece
    assert reply is not None
    return reply


def _depth_first(msgs: list) -> list:
    """Messages in reading order: each followed by its replies, a message's versions one after another."""
    children: dict = {}
    for m in msgs:
        children.setdefault(m.parent_id, []).append(m)
    out, stack = [], list(reversed(children.get(None, [])))
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(reversed(children.get(m.id, [])))
    return out


def _finished(pieces: Iterator[str | Reply], opts) -> Iterator[str | Reply]:
    """A turn's pieces, its Reply completed by its options (parsed, tool_calls)."""
    for piece in pieces:
        yield opts.finish(piece) if isinstance(piece, Reply) else piece


async def _alast(pieces: AsyncIterator[str | Reply]) -> Reply:
    reply = None
    async for piece in pieces:
        if isinstance(piece, Reply):
            reply = piece
    assert reply is not None
    return reply


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class _Starts(Protocol):
    def start(self): ...


class Manager(Protocol):
    """What a Session asks of the manager that made it (``chatkv.sessions.manager.SessionManager``
    is one); this module names it, never the SessionManager class, so the two modules do not
    import each other."""

    closed: bool
    store: Store
    engine: _Starts

    renderer: object  # chatkv.sessions.template.TurnRenderer

    def turn(self, s: Session, text: str, params: SamplingParams, **options) -> Iterator[str | Reply]: ...

    def regenerate(self, s: Session, params: SamplingParams) -> Iterator[str | Reply]: ...

    def edit(self, s: Session, message_id: int, text: str, params: SamplingParams) -> Iterator[str | Reply]: ...

    def switch(self, s: Session, message_id: int, descend: bool = True): ...

    def save_params(self, s: Session, params: dict) -> None: ...

    def set_overflow(self, s: Session, policy: str) -> None: ...

    def rename(self, s: Session, title: str) -> None: ...

    def delete(self, s: Session) -> None: ...

    def spill(self, s: Session) -> bool: ...

    def close_session(self, s: Session) -> None: ...


class Session:
    """One conversation. Use it from one thread; close it (or use ``with``) to spill and release its KV.
    Its state is written by its manager alone (``chatkv.sessions.manager``); it reads it and asks."""

    def __init__(self, manager: Manager, conv_id: str, title: str, system: str | None, params: dict, tokens: list[int]):
        self._m = manager
        self.id = conv_id
        self.title = title
        self.system = system
        self.params = dict(params)
        self.tokens: list[int] = list(tokens)  # the canonical history
        self.kept: RetainedKV | None = None  # KV resident in memory between turns
        self.pinned: tuple[int, ...] | None = None  # the KV manager's pin of the shared system-prompt prefix
        self.knowledge = None  # a chatkv.retrieval.KnowledgeBase searched every turn (RAG), or None
        self.top_k = 4  # sources retrieved per turn
        self.documents: list[str] = []  # pinned documents (sources in the knowledge base)
        self.system_content = system  # the system message as rendered: the system prompt, then pinned documents
        self.last_question: str | None = None  # the previous user message (follow-ups search with it)
        self.window = None  # chatkv.sessions.context_window.ContextState: what the KV window holds, the overflow policy
        self.closed = False
        self.busy = False
        self.ending = None  # the turn in flight's end (chatkv.sessions.turn.TurnEnd), which close() may run
        self.last_used = time.monotonic()
        self.owner = "local"  # the user it belongs to (chatkv serve's API keys; the app and SDK: "local")
        self.tools: list = []  # the last turn's tools (chatkv.sessions.tools.Tool), tools_seen their specs as rendered
        self.tools_seen: str | None = None
        self.pending_calls: dict = {}  # the last reply's tool calls awaiting results, by id

    # -- turns --------------------------------------------------------------

    def send(
        self, text: str, params: SamplingParams | None = None, *, json_schema=None, tools=None, tool_choice="auto"
    ) -> Reply:
        """Ask and wait for the whole reply. ``json_schema``: the reply is constrained to it and
        ``reply.parsed`` is the object (None when it ended by length). ``tools`` (Python callables
        or OpenAI-style specs, rendered by the chat template): ``reply.tool_calls`` are the calls
        it made; ``tool_choice`` "required" or a function's name forces one (chatkv.sessions.tools)."""
        return _last(self.stream(text, params, json_schema=json_schema, tools=tools, tool_choice=tool_choice))

    def stream(
        self, text: str, params: SamplingParams | None = None, *, json_schema=None, tools=None, tool_choice="auto"
    ) -> Iterator[str | Reply]:
        """Yield the reply's text pieces as they are generated, then the Reply (options: ``send``).

        Stopping early (closing the generator) keeps what was generated, marked interrupted.
        """
        params = self._turn_checks(params, text)
        if json_schema is None and tools is None:
            yield from self._m.turn(self, text, params)
            return
        from chatkv.sessions.tools import TurnOptions  # only a turn with options needs it

        opts = TurnOptions(self, self._m.renderer, params, json_schema, tools, tool_choice)
        yield from _finished(self._m.turn(self, text, opts.params, **opts.turn_options()), opts)

    def send_tool_results(
        self, results: dict, params: SamplingParams | None = None, *, tools=None, tool_choice="auto"
    ) -> Reply:
        """Answer the last reply's tool calls (``{call_id: result}``, each result a str or
        JSON-serialisable) as ``role: "tool"`` messages; the model goes on from them, the
        conversation's KV reused. ``tools``: the last turn's unless given."""
        return _last(self.stream_tool_results(results, params, tools=tools, tool_choice=tool_choice))

    def stream_tool_results(
        self, results: dict, params: SamplingParams | None = None, *, tools=None, tool_choice="auto"
    ) -> Iterator[str | Reply]:
        """``send_tool_results``, streamed as ``stream`` streams a turn."""
        from chatkv.sessions.tools import TurnOptions, result_messages

        params = self._turn_checks(params)
        msgs = result_messages(results, self.pending_calls)
        opts = TurnOptions(
            self, self._m.renderer, params, None, tools if tools is not None else self.tools, tool_choice
        )
        text = json.dumps([{k: m[k] for k in ("tool_call_id", "name", "content")} for m in msgs])
        render = lambda tokens, system, content: self._m.renderer.tool_turn(msgs)  # noqa: E731
        yield from _finished(self._m.turn(self, text, opts.params, render=render, role="tool"), opts)

    def run_tools(
        self, text: str, tools, params: SamplingParams | None = None, *, tool_choice="auto", max_steps: int = 5
    ) -> Reply:
        """Ask ``text`` with ``tools`` (Python callables); run each call and send its result back
        until the model answers in text, at most ``max_steps`` replies (chatkv.sessions.tools.run_loop)."""
        from chatkv.sessions.tools import run_loop

        return run_loop(self, text, tools, params, tool_choice=tool_choice, max_steps=max_steps)

    # -- branches: edit, regenerate, switch (the conversation is a tree; nothing is deleted) --

    def regenerate(self, params: SamplingParams | None = None) -> Reply:
        """Answer the last user message of the current branch again. The new reply is a sibling
        of the old one (both stay: ``branches``, ``switch``) and becomes current; the history's
        KV is reused, so only the reply is computed."""
        return _last(self.stream_regenerate(params))

    def stream_regenerate(self, params: SamplingParams | None = None) -> Iterator[str | Reply]:
        """``regenerate``, streamed as ``stream`` streams a turn."""
        params = self._turn_checks(params)
        yield from self._m.regenerate(self, params)

    def edit(self, message_id: int, text: str, params: SamplingParams | None = None) -> Reply:
        """Ask ``text`` in place of user message ``message_id``: a sibling of it, made current and
        answered. The old message and everything after it stay on their branch. Only the tokens
        from the edited message on are computed; the shared prefix's KV is reused."""
        return _last(self.stream_edit(message_id, text, params))

    def stream_edit(self, message_id: int, text: str, params: SamplingParams | None = None) -> Iterator[str | Reply]:
        """``edit``, streamed as ``stream`` streams a turn."""
        if isinstance(message_id, bool) or not isinstance(message_id, int):
            raise InvalidRequest(f"a message id must be an int, got {type(message_id).__name__}")
        if not 0 < message_id < 2**63:  # the store's ids are positive 64-bit integers
            shown = str(message_id) if abs(message_id) < 10**30 else f"an integer of {message_id.bit_length()} bits"
            raise InvalidRequest(f"message {shown} is not a message of conversation {self.id}")
        params = self._turn_checks(params, text)
        yield from self._m.edit(self, message_id, text, params)

    def switch(self, message_id: int, *, descend: bool = True):
        """Make the branch through ``message_id`` current, down to its most recent leaf (without
        ``descend``: ending at that message, so the next turn follows it). Returns the leaf's
        ``MessageInfo`` (None: before the first message). Its KV comes back from memory, from
        disk, or is recomputed past the prefix still cached."""
        self._check_open()
        return self._m.switch(self, message_id, descend)

    def branches(self, message_id: int):
        """The siblings of ``message_id`` (the versions of that message), itself included, oldest first."""
        self._check_engine()
        return self._m.store.branches(self.id, message_id)

    def tree(self):
        """Every message of every branch, oldest first; each names its ``parent_id``."""
        self._check_engine()
        return self._m.store.message_tree(self.id)

    def _turn_checks(self, params: SamplingParams | None, text: str | None = None) -> SamplingParams:
        self._check_open()
        if text is not None:
            check_text("message", text)
            if not text.strip():
                raise InvalidRequest("message is empty")
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}")
        if self.busy:
            raise SessionError(f"session '{self.id}' is already generating a reply")
        return params or self._default_params()

    async def asend(self, text: str, params: SamplingParams | None = None, **options) -> Reply:
        """asyncio form of ``send`` (starts the engine loop if needed; options as ``send``'s)."""
        return await _alast(self.astream(text, params, **options))

    async def aregenerate(self, params: SamplingParams | None = None) -> Reply:
        """asyncio form of ``regenerate``."""
        return await _alast(self._athread(lambda: self.stream_regenerate(params)))

    async def aedit(self, message_id: int, text: str, params: SamplingParams | None = None) -> Reply:
        """asyncio form of ``edit``."""
        return await _alast(self._athread(lambda: self.stream_edit(message_id, text, params)))

    async def astream(self, text: str, params: SamplingParams | None = None, **options) -> AsyncIterator[str | Reply]:
        """asyncio form of ``stream``: the turn runs on a thread of its own (its database work
        and waits never block the event loop) while the engine loop computes it with every
        other request. Closing the iterator early interrupts the reply, as with ``stream``."""
        async for item in self._athread(lambda: self.stream(text, params, **options)):
            yield item

    async def _athread(self, make: Callable[[], Iterator[str | Reply]]) -> AsyncIterator[str | Reply]:
        """The turn ``make()`` runs on a thread of its own, its pieces handed to asyncio."""
        self._m.engine.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def work() -> None:
            try:
                for piece in make():
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                    if stop.is_set():
                        break  # closes the turn: what was produced is kept, marked interrupted
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
                loop.call_soon_threadsafe(queue.put_nowait, _Failed(e))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        worker = threading.Thread(target=work, name=f"chatkv-turn-{self.id[:8]}", daemon=True)
        worker.start()
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            await asyncio.get_running_loop().run_in_executor(None, worker.join)

    def _default_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.params) if self.params else SamplingParams(temperature=0.0)

    # -- housekeeping -------------------------------------------------------

    def messages(self):
        """The conversation's messages, oldest first (storage.MessageInfo)."""
        self._check_engine()
        return self._m.store.messages(self.id)

    def rename(self, title: str) -> None:
        self._check_open()
        check_text("title", title)
        self._m.rename(self, title)

    def update_params(self, **changes) -> dict:
        """Change this conversation's default sampling settings (e.g. ``temperature=0.7,
        max_tokens=128``; a value of None removes the field) and save them with it.
        Validated first: on an error nothing changes. Returns the new settings."""
        self._check_open()
        new = {**self.params, **changes}
        new = {k: v for k, v in new.items() if v is not None}
        SamplingParams.from_dict(new).validate()
        self._m.save_params(self, new)
        return dict(new)

    @property
    def overflow(self) -> str:
        """What happens when the history outgrows the context window: "sink", "truncate" or "error"."""
        return self.window.policy

    def set_overflow(self, policy: str) -> None:
        """Change this conversation's overflow policy (saved with it). Validated first."""
        self._check_open()
        check_overflow(policy)
        self._m.set_overflow(self, policy)

    def archive(self, archived: bool = True) -> None:
        self._check_open()
        self._m.store.set_archived(self.id, archived)

    def delete(self) -> None:
        """Delete the conversation, its messages and its snapshot; the session closes."""
        self._check_open()
        self._m.delete(self)

    def spill(self) -> bool:
        """Write the KV to disk now and release its memory. True if there was KV to spill."""
        self._check_open()
        return self._m.spill(self)

    def export(self, fmt: str = "markdown", tree: bool = False) -> str:
        """The conversation as ``markdown`` or ``json``: the current branch, or with ``tree`` every
        branch (each message names its parent; markdown lists a message's other versions after it)."""
        if fmt not in ("markdown", "json"):
            raise InvalidRequest(f"unknown export format '{fmt}'; use 'markdown' or 'json'")
        msgs = self.tree() if tree else self.messages()
        if fmt == "json":
            return json.dumps(
                {
                    "id": self.id,
                    "title": self.title,
                    "system": self.system,
                    "messages": [
                        {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in asdict(m).items()}
                        for m in msgs
                    ],
                },
                indent=2,
            )
        out = [f"# {self.title}", ""]
        if self.system:
            out += [f"> **System:** {self.system}", ""]
        for m in _depth_first(msgs) if tree else msgs:
            note = " (interrupted)" if m.status == "interrupted" else ""
            where = f" · #{m.id}" + (f" after #{m.parent_id}" if m.parent_id is not None else "") if tree else ""
            out += [f"### {m.role.capitalize()}{note}{where}", "", m.content, ""]
        return "\n".join(out)
        raise InvalidRequest(f"unknown export format '{fmt}'; use 'markdown' or 'json'")

    def close(self) -> None:
        """Spill the KV to disk (so a later resume restores it) and release every block it held."""
        if not self.closed and not self._m.closed:  # engine.close() closes every session
            self._m.close_session(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_engine(self) -> None:
        if self._m.closed:
            raise EngineClosed(f"the engine is closed; session '{self.id}' is saved: resume it with a new engine")

    def _check_open(self) -> None:
        self._check_engine()
        if self.closed:
            raise SessionError(f"session '{self.id}' is closed; resume it with engine.resume('{self.id}')")
