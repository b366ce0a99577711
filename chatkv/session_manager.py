"""SessionManager: saved conversations and their turns.

(Past 400 lines: a turn's phases (plan, restore, store, drive, settle, write-behind) share the
session's state and run in order; split across modules they would hand that state around.)

It owns the conversation database (``storage.Store``) of one data directory and the
conversations' snapshots (``chatkv.snapshots``), holds each open session's KV between
turns through the KV manager, and runs a turn with three engine calls: add a request,
drive it, abort it. It never imports the engine (the engine creates it). Contracts:

- a turn's input is validated before anything is stored; its user message (and the
  history's tokens) are committed before generation, the reply before the turn reports
  done; an interrupted reply keeps what was produced, marked ``interrupted``;
- a session holds its KV as one RetainedKV (``session.kept``) between turns; a shared
  system prompt is pinned while any open session uses it;
- an idle session, or any idle session when blocks run short, is spilled to disk and
  its KV released; the next turn restores it (see ``chatkv.snapshots``);
- a history longer than the context window is handled by the session's overflow policy
  before anything is stored (see ``chatkv.context_window``); messages are never deleted;
- a turn runs under the conversation's lease, so processes sharing the store never
  interleave a conversation (see ``chatkv.session_leases``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Iterator

import copy

from chatkv import context_window as cw
from chatkv import rag as rag_context
from chatkv import session_leases as leased
from chatkv import text_tokens
from chatkv.config import OVERFLOW_POLICIES
from chatkv.errors import EngineClosed, InvalidRequest, OutOfBlocks, SessionError, check_text
from chatkv.kv_manager import RetainedKV
from chatkv.outputs import Reply
from chatkv.sampling import SamplingParams
from chatkv.session import Session
from chatkv.snapshots import Snapshots
from chatkv.storage.models import LOCAL_USER
from chatkv.storage.records import check_owner
from chatkv.storage.repository import Store
from chatkv.turns import TurnRenderer

DEFAULT_TITLE = "New chat"
RAG_KEY = "knowledge"  # in a conversation's stored params: {"kb": name, "top_k": k, "documents": [...]}
OVERFLOW_KEY = "overflow"  # in a conversation's stored params: its overflow policy (chatkv.context_window)
log = logging.getLogger("chatkv.sessions")


def _rag_settings(knowledge, top_k: int, documents: list[str] | None) -> dict | None:
    """The RAG settings a conversation stores, validated; None without a knowledge base."""
    if knowledge is None:
        if documents:
            raise InvalidRequest("documents= pins documents of a knowledge base: pass knowledge= too")
        return None
    if not hasattr(knowledge, "search") or not hasattr(knowledge, "name"):
        raise InvalidRequest(f"knowledge must be a KnowledgeBase (engine.knowledge_base(name)), got {type(knowledge).__name__}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 64:
        raise InvalidRequest(f"top_k must be an int in [1, 64], got {top_k!r}")
    docs = list(documents or [])
    for d in docs:
        check_text("pinned document", d)
    return {"kb": knowledge.name, "top_k": top_k, "documents": docs}


class _TurnEnd:
    """A turn's end (settle its request, store its reply), run once by whichever comes first:
    the turn's own generator or ``engine.close()``; the other gets the same Reply (or error)."""

    def __init__(self, fn):
        self._fn = fn
        self._lock = threading.Lock()
        self._ran = False
        self._out: Reply | None = None
        self._error: BaseException | None = None

    def run(self, blocking: bool = True) -> Reply | None:
        """The Reply; None without ``blocking`` while the other side is running it."""
        if not self._lock.acquire(blocking):
            return None
        try:
            if not self._ran:
                self._ran = True
                try:
                    self._out = self._fn()
                except BaseException as e:
                    self._error = e
                    raise
            elif self._error is not None:
                raise self._error
            return self._out
        finally:
            self._lock.release()


class SessionManager:
    def __init__(self, engine, data_dir: Path):
        """``engine``: used for ``add_request``, ``drive``, ``abort``, its ``kv`` manager,
        ``tokenizer``, ``config``, ``fingerprint``, ``kv_dtype`` and ``model_dir``."""
        cfg = engine.config
        self.engine = engine
        self.kv = engine.kv
        self.tenant = cfg.tenant
        self.idle_spill_s = cfg.idle_spill_s
        self.renderer = TurnRenderer(engine.tokenizer)
        self.store = Store.open(cfg.db_url, data_dir)
        self.snapshots = Snapshots(
            self.kv, self.store, data_dir / "kv", engine.fingerprint, engine.kv_dtype, cfg.tenant, cfg.snapshot_budget_bytes
        )
        self.live: dict[str, Session] = {}
        self.closed = False  # engine.close() closed it: every session of it raises EngineClosed
        self._resume_lock = threading.RLock()
        self.marks: dict = {}  # conversation id -> the stored state last seen (chatkv.session_leases)
        self.overflow = cfg.overflow
        self.sink_tokens = cfg.sink_tokens
        self.kv.on_pressure = lambda missing: self.snapshots.relieve(self.live.values(), missing)

    def held_kv(self) -> list[RetainedKV | None]:
        """The KV every open session holds (for integrity checks)."""
        return [s.kept for s in self.live.values()]

    def in_memory(self) -> list[str]:
        """Ids of the open sessions whose KV is in memory now: kept between turns, or in a turn
        (read-only; any thread: a snapshot of the dict, so one opening meanwhile may be missed)."""
        return [sid for sid, s in list(self.live.items()) if s.kept is not None or s.busy]

    # -- sessions -----------------------------------------------------------

    def create(
        self,
        system: str | None,
        title: str | None,
        params: dict | None,
        knowledge=None,
        top_k: int = 4,
        documents: list[str] | None = None,
        overflow: str | None = None,
        owner: str | None = None,
    ) -> Session:
        owner = LOCAL_USER if owner is None else check_owner(owner)
        overflow = cw.check_overflow(overflow) if overflow is not None else self.overflow
        if system is not None:
            check_text("system prompt", system)
        if title is not None:
            check_text("title", title)
        if params:
            SamplingParams.from_dict(params).validate()
        rag = _rag_settings(knowledge, top_k, documents)
        system_content = self._system_content(system, knowledge, rag["documents"]) if rag else system
        stored = dict(params or {})
        stored[OVERFLOW_KEY] = overflow
        if rag:
            stored[RAG_KEY] = rag
        info = self.store.create_conversation(
            title=title or DEFAULT_TITLE,
            model=self.engine.model_dir.name,
            system_prompt=system or "",
            params=stored,
            tenant=self.tenant,
            owner=owner,
        )
        s = Session(self, info.id, info.title, system, params or {}, [])
        s.owner = owner
        s.window = cw.ContextState(policy=overflow)
        if rag:
            s.knowledge, s.top_k, s.documents, s.system_content = knowledge, rag["top_k"], rag["documents"], system_content
        self.live[s.id] = s
        return s

    def resume(self, conv_id: str, owner: str | None = None) -> Session:
        """The open session of ``conv_id``, or the stored conversation reopened. One of another
        user than ``owner`` (None: the local user) is unknown, exactly as an id never used."""
        owner = LOCAL_USER if owner is None else owner
        with self._resume_lock:  # two threads resuming one conversation get one Session (and one KV)
            if isinstance(conv_id, str) and conv_id in self.live:
                s = self.live[conv_id]
                if s.owner != owner:
                    raise SessionError(f"unknown conversation id '{conv_id}'")  # the store's words for an unknown id
                return s
            return self._resume(conv_id, owner)

    def _resume(self, conv_id: str, owner: str = LOCAL_USER) -> Session:
        info = self.store.get_conversation(conv_id, tenant=self.tenant, owner=owner)
        params = dict(info.params)
        rag = params.pop(RAG_KEY, None)
        overflow = params.pop(OVERFLOW_KEY, None)
        s = Session(self, info.id, info.title, info.system_prompt or None, params, list(info.token_ids or []))
        s.owner = info.owner
        s.window = self.stored_window(s, info, overflow)
        msgs = self.store.messages(s.id)
        if msgs and msgs[-1].role == "user" and s.tokens:
            # a turn without its reply: closed as interrupted unless another process is generating it now
            leased.settle(self, s)
        if rag:
            s.knowledge = self.engine.knowledge_base(rag["kb"])
            s.top_k, s.documents = rag["top_k"], list(rag["documents"])
            try:
                s.system_content = self._system_content(s.system, s.knowledge, s.documents)
            except InvalidRequest as e:  # a pinned document was removed since: the history keeps its copy
                log.warning("conversation %s: %s; its documents are not pinned", s.id, e)
            users = [m.content for m in msgs if m.role == "user"]
            s.last_question = users[-1] if users else None
        if any(not m.intact for m in msgs):
            self._rebuild(s)
        self.live[s.id] = s
        return s

    def _rebuild(self, s: Session) -> None:
        """Stored text that no longer matches its hash (edited behind the store's back, even at the
        same length): the token history, and so the KV, no longer say what the messages say. The
        stored text wins: the history is recomputed from it (the system prompt, then each turn
        rendered as a turn would render it), its snapshot dropped, and the KV computed afresh on
        the next turn."""
        msgs = self.store.messages(s.id)
        changed = [m.id for m in msgs if not m.intact]
        log.warning("conversation %s: the stored text of message(s) %s no longer matches what was stored with it; "
                    "recomputing the conversation's KV from the stored text", s.id, changed)
        tokens: list[int] = []
        st = cw.ContextState(policy=s.window.policy)  # the whole history, its turns where they start now
        for m in msgs:
            if m.role == "user":
                first = not tokens
                tokens += self._delta_from(tokens, s.system_content, m.content)
                st.turns.append(self._first_turn_start(tokens, m.content) if first else len(tokens) - len(
                    self.renderer.user_turn(m.content)))
                if first:
                    st.prefix = st.turns[0]
            elif m.role == "assistant" and tokens:
                reply = self._text_ids(m.content)  # the reply as data: its text, never control tokens
                tokens += reply + self.renderer.close_reply(reply)
        s.tokens, s.window = tokens, st
        self.store.rebuild_history(s.id, tokens, st.to_json())
        self.snapshots.delete(s.id)

    def _text_ids(self, text: str) -> list[int]:
        # not the tokenizer's split_special_tokens=True: transformers flips a flag on the shared
        # backend per call, a race with every other thread tokenising (chatkv.text_tokens)
        return text_tokens.encode_text(self.engine.tokenizer, text)

    def _delta_from(self, tokens: list[int], system: str | None, content: str) -> list[int]:
        if tokens:
            return self.renderer.user_turn(content)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return self.renderer.first(messages)

    def stored_window(self, s: Session, info, overflow: str | None) -> cw.ContextState:
        """The KV window's state stored with ``info`` (``s.tokens`` already its token ids), under
        the conversation's saved overflow policy (``overflow``; None: the engine's)."""
        window = cw.ContextState.from_json(info.context, self.overflow)
        if info.context is None and s.tokens:  # saved before turn boundaries were recorded
            window.prefix = self._known_prefix(s)
        if overflow in OVERFLOW_POLICIES:
            window.policy = overflow
        return window

    def _known_prefix(self, s: Session) -> int | None:
        """The length of the system prefix at the start of ``s.tokens``, if it can be told."""
        sys_tokens = self.renderer.system_prefix(s.system)
        return len(sys_tokens) if sys_tokens and s.tokens[: len(sys_tokens)] == sys_tokens else None

    def _system_content(self, system: str | None, knowledge, documents: list[str]) -> str | None:
        return rag_context.documents_block(system, [(d, knowledge.chunks_of(d)) for d in documents])

    def close_session(self, s: Session) -> None:
        if s.busy:
            raise SessionError(f"session '{s.id}' is generating; finish or interrupt the reply first")
        try:
            leased.spill(self, s)  # under the lease, only if current
        finally:
            self.kv.unpin(s.pinned)
            s.pinned = None
            s.closed = True
            self.live.pop(s.id, None)

    def delete(self, s: Session) -> None:
        self.store.leases.acquire(s.id)  # ConversationBusy while another process generates it
        try:
            self._delete(s)
        finally:
            self.store.leases.release(s.id)  # its row went with the conversation

    def _delete(self, s: Session) -> None:
        self.kv.drop(s.kept)
        s.kept = None
        self.kv.unpin(s.pinned)
        s.pinned = None
        s.closed = True
        self.live.pop(s.id, None)
        if self.store.delete_conversation(s.id) is not None:
            self.snapshots.delete(s.id)

    def save_params(self, s: Session, params: dict) -> None:
        """Store a session's sampling settings, keeping its RAG settings beside them."""
        stored = dict(params)
        stored[OVERFLOW_KEY] = s.window.policy
        if s.knowledge is not None:
            stored[RAG_KEY] = {"kb": s.knowledge.name, "top_k": s.top_k, "documents": list(s.documents)}
        self.store.set_params(s.id, stored)

    def stored_settings(self, info) -> tuple[dict, str | None]:
        """A conversation's stored sampling params (without the settings kept beside them) and overflow policy."""
        params = dict(info.params)
        params.pop(RAG_KEY, None)
        return params, params.pop(OVERFLOW_KEY, None)

    def spill(self, s: Session) -> bool:
        return leased.spill(self, s)

    def spill_idle(self, now: float | None = None, keep: Session | None = None) -> int:
        """Spill every session idle for longer than ``idle_spill_s``; returns how many."""
        return self.snapshots.spill_idle(self.live.values(), self.idle_spill_s, now, keep)

    def close(self) -> None:
        self.closed = True
        try:
            for s in list(self.live.values()):
                if not s.busy:
                    self.close_session(s)
        finally:
            self.close_files()

    def close_files(self) -> None:
        """The snapshots (what is queued is written) and the database."""
        self.closed = True
        self.kv.on_pressure = None
        try:
            self.snapshots.close()  # writes what is queued, records its rows
        finally:
            self.store.close()

    def end_turns(self) -> None:
        """engine.close(): store the end of every turn whose caller holds it suspended (a stream
        not read to its end): its reply as produced, its KV kept for the session's spill."""
        for s in list(self.live.values()):
            end = s.ending
            if end is not None:
                try:
                    end.run(blocking=False)
                except Exception as e:  # noqa: BLE001 - the turn's caller gets it too when it resumes
                    log.warning("conversation %s: the interrupted reply was not stored at close (%s: %s)",
                                s.id, type(e).__name__, e)

    # -- a turn -------------------------------------------------------------

    def turn(self, s: Session, text: str, params: SamplingParams) -> Iterator[str | Reply]:
        """A turn under the conversation's lease: ConversationBusy while another process generates
        it; a session behind the stored conversation is reloaded first (chatkv.session_leases)."""
        return self._in_flight(leased.turn(self, s, self._turn(s, text, params)))

    def _in_flight(self, turn: Iterator[str | Reply]) -> Iterator[str | Reply]:
        """The turn counted as in flight for engine.close() (EngineClosed once it began)."""
        with self.engine._gate.turn():
            yield from turn

    def _turn(self, s: Session, text: str, params: SamplingParams) -> Iterator[str | Reply]:
        arrival = time.perf_counter()  # TTFT counts the restore from disk too
        params.validate()
        on_loop = self.engine.on_loop  # KV work runs where the engine's state lives (the loop thread once started)
        on_loop(lambda: self.spill_idle(keep=s))
        window = self.engine.context_window
        reserve = cw.reply_room(params.max_tokens, window)
        content, hits, query = text, [], None
        if s.knowledge is not None:
            query = rag_context.standalone_query(text, s.last_question)
            found = s.knowledge.search(query, k=s.top_k)
            if s.window.policy == "error":
                fits = lambda m: len(self._prompt(s, m)) < window - reserve  # noqa: E731
            else:  # the history makes way for the sources
                fits = lambda m: (s.window.prefix or 0) + len(self._delta(s, m)) < window - reserve  # noqa: E731
            content, hits = rag_context.fit_sources(text, found, fits)
        delta = self._delta(s, content)
        st = copy.deepcopy(s.window)
        plan = cw.plan(st, len(s.tokens), len(delta), reserve, window, self.kv.block_size, self.sink_tokens)

        user_ns = self.kv.user_namespace(s.owner)  # a server user's KV is never another's (None: the local user)

        def admit():
            kept, restored = s.kept, 0
            s.kept = None
            old_ns = self._namespace(s.id, st)
            if kept is None and s.tokens and plan.kind != "truncate":
                kept, restored = self.snapshots.restore(s.id, s.tokens + delta, namespace=old_ns or user_ns)
            context = s.tokens
            if plan.kind != "none":
                context = cw.apply(st, plan, s.tokens)
                kept, restored = self._move_window(s, plan, st, kept, restored, old_ns, context)
                s.tokens, s.window = context, st  # the KV in memory is the new window's now
            try:
                seq = self.engine.add_request(context + delta, params, retain=True, prefix=kept,
                                              namespace=self._namespace(s.id, st) or user_ns, max_context=window,
                                              admitted=True)  # the turn was admitted (close() waits for it)
            except BaseException:
                s.kept = kept  # nothing happened: the session keeps its KV
                raise
            return seq, context, restored

        seq, context, restored = on_loop(admit)
        first_turn = not context
        prompt = context + delta
        seq.num_restored = restored
        seq.arrival = arrival
        st.turns.append(self._first_turn_start(prompt, content) if first_turn else len(context))
        if first_turn:
            st.prefix = st.turns[0]
        try:
            meta = {"query": query, "sources": [h.chunk_id for h in hits]} if query is not None else None
            # committed before generation, with the window it was computed in
            self.store.add_message(s.id, "user", text, meta=meta, token_ids=prompt, context=st.to_json())
        except BaseException:
            st.turns.pop()
            on_loop(lambda: self._take_back(s, seq))
            raise
        if not s.tokens and s.title == DEFAULT_TITLE:  # name a new chat after its first message
            s.title = " ".join(text.split())[:48] or DEFAULT_TITLE
            self.store.rename(s.id, s.title)
        s.tokens, s.window = prompt, st
        s.last_question = text
        s.busy = True
        info = cw.ContextInfo(
            policy=st.policy, window=window, context_tokens=len(prompt), dropped_tokens=plan.drop,
            dropped_turns=plan.turns, total_dropped_tokens=st.dropped_tokens, total_dropped_turns=st.dropped_turns,
            sink_tokens=st.sink if st.private else 0, recomputed=plan.kind == "truncate",
        )
        def finish() -> Reply:
            """The turn's end, once: by this generator, or by engine.close() while its caller holds it."""
            on_loop(lambda: self._settle(s, seq))
            r = seq.result()
            sources = rag_context.sources_of(r.text, hits)
            msg_meta = {"sources": [x.as_json() for x in sources]} if sources else {}
            if plan.drop:
                msg_meta["context"] = {"dropped_tokens": plan.drop, "dropped_turns": plan.turns, "policy": st.policy}
            msg = self.store.add_message(
                s.id,
                "assistant",
                r.text,
                status="complete" if r.finish_reason in ("stop", "length") else "interrupted",
                meta=msg_meta or None,
                token_ids=s.tokens,
                context=st.to_json(),
                **r.usage.message_columns(),
            )
            on_loop(lambda: self._after_turn(s, msg.id))
            return Reply(text=r.text, usage=r.usage, finish_reason=r.finish_reason, message_id=msg.id, sources=sources,
                         context=info)

        s.ending = _TurnEnd(finish)
        suspended = self.engine._gate.suspended  # while the caller holds a piece, close() does not wait for it
        cut = None
        pieces = self.engine.drive(seq)
        try:
            try:
                for piece in pieces:
                    with suspended():
                        yield piece
            except EngineClosed as e:  # close() ended the request: its reply is stored below, interrupted
                cut = e
        finally:
            pieces.close()
            try:
                reply = s.ending.run()
            finally:
                s.ending = None
        if cut is not None:
            raise EngineClosed("the engine was closed during this turn; the reply so far is stored, marked interrupted",
                               reply=reply) from None
        with suspended():
            yield reply

    def _take_back(self, s: Session, seq) -> None:
        """The user message was not stored: the request goes, the session keeps its KV if the
        request was not admitted yet (loop thread)."""
        kept, seq.prefix = seq.prefix, None
        self.engine.abort(seq)
        self.kv.drop(seq.retained)
        seq.retained = None
        s.kept = kept

    def _settle(self, s: Session, seq) -> None:
        """End the turn's request; the session keeps its KV for the next turn, and is no longer
        busy: from here memory pressure may spill it, even before its reply is stored (loop thread)."""
        self.engine.abort(seq)  # no-op when it finished
        s.tokens = seq.token_ids + self.renderer.close_reply(seq.generated_ids)
        s.kept, seq.retained = seq.retained, None
        s.last_used = time.monotonic()
        s.busy = False

    def _after_turn(self, s: Session, message_id: int) -> None:
        """Pin the shared prefix; the new KV reaches the disk in the background (loop thread)."""
        self._pin(s)
        if s.kept is not None:  # else a spill (memory pressure) already queued it
            self.snapshots.write_behind(s.id, s.tokens, s.kept, fence=message_id)

    def _namespace(self, conv_id: str, st: cw.ContextState):
        """The radix namespace of a conversation's KV: the shared one, or once an attention-sink
        window has moved (keys re-rotated), one of its own per window epoch."""
        return (self.kv.namespace, "window", conv_id, st.epoch) if st.private else None

    def _move_window(self, s: Session, plan: cw.Plan, st: cw.ContextState, kept, restored: int, old_ns, context):
        """Make the KV in memory match the new window: dropped turns drop it (recomputed once);
        a sink move keeps the sink and the recent blocks, keys re-rotated."""
        if plan.kind == "truncate":
            self.kv.drop(kept)
            if old_ns is not None:
                self.kv.drop_namespace(old_ns)
            return None, 0
        if kept is None:
            return None, 0
        try:
            kept = self.kv.slide(kept, context, plan.sink, plan.drop, self._namespace(s.id, st),
                                 self.engine.shift_keys, old_namespace=old_ns)
        except OutOfBlocks as e:  # kept is ended: the window is recomputed instead
            log.warning("conversation %s: no room to move its KV window (%s); recomputing it", s.id, e)
            return None, 0
        return kept, min(restored, kept.kv_len if kept is not None else 0)

    def _delta(self, s: Session, content: str) -> list[int]:
        """The tokens a turn whose user message is ``content`` adds to the context."""
        if s.tokens:
            return self.renderer.user_turn(content)
        system = s.system_content
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return self.renderer.first(messages)

    def _first_turn_start(self, prompt: list[int], content: str) -> int:
        """Where the first user turn starts in a first prompt: everything before it (the system
        prompt, pinned documents) is kept when old turns are dropped."""
        turn = self.renderer.user_turn(content)
        if len(turn) <= len(prompt) and prompt[len(prompt) - len(turn):] == turn:
            return len(prompt) - len(turn)
        return len(prompt)  # a template whose first turn renders differently: the first turn stays

    def _prompt(self, s: Session, content: str) -> list[int]:
        """The whole prompt of a turn whose user message is ``content`` (before any window move)."""
        return s.tokens + self._delta(s, content)

    def _pin(self, s: Session) -> None:
        """Pin the shared system prompt's blocks while this session is open."""
        if s.pinned is not None or not s.system_content:
            return
        sys_tokens = self.renderer.system_prefix(s.system_content)
        n = len(sys_tokens) // self.kv.block_size * self.kv.block_size  # only whole blocks are shared
        if n and s.tokens[:n] == sys_tokens[:n]:
            s.pinned = self.kv.pin(sys_tokens[:n], self.kv.user_namespace(s.owner))
