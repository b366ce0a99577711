"""SessionManager: saved conversations, and the one writer of their sessions' state.

(Past 400 lines: besides a session's life (create, resume, rebuild, close, delete) it holds
every write of a session's state - its turn's (``chatkv.sessions.turn`` asks for each), its lease's
sync with the stored conversation, its spills - so that one module says who changes what.)

It owns the conversation database (``storage.Store``) of one data directory and the
conversations' snapshots (``chatkv.sessions.snapshots``), holds each open session's KV between
turns through the KV manager, and runs each turn as a ``chatkv.sessions.turn.Turn`` (three engine
calls: add a request, drive it, abort it). It never imports the engine (the engine creates
it). Contracts:

- a turn's input is validated before anything is stored; its user message (and the
  history's tokens) are committed before generation, the reply before the turn reports
  done; an interrupted reply keeps what was produced, marked ``interrupted``;
- a session holds its KV as one RetainedKV (``session.kept``) between turns, handed to it
  by its request's finish on the loop thread; a shared system prompt is pinned while any
  open session uses it;
- an idle session, or any idle session when blocks run short, is spilled to disk and
  its KV released; the next turn restores it (see ``chatkv.sessions.snapshots``);
- a history longer than the context window is handled by the session's overflow policy
  before anything is stored (see ``chatkv.sessions.context_window``); messages are never deleted;
- several processes, one store: a turn, a resume's clean-up and a spill run under the
  conversation's lease (``store.leases.hold``, see ``chatkv.storage.leases``), so a process
  writes a conversation only while it holds it and never on top of a history it has not
  seen. Under the lease a session behind the stored conversation (another process stored
  turns since; told by the ``Mark`` the lease returns, else by comparing the token history)
  is reloaded, its KV for the old history dropped; a turn left without its reply (its
  process died) is closed as an interrupted empty reply, exactly once. A spill writes the
  snapshot only when the session is current. Idle and pressure spills go without a lease:
  the write-behind of the session's last turn, queued under its lease, already made its
  snapshot current, so they write nothing. ``marks`` keeps per conversation the ``Mark``
  last seen (None: unknown, compare the tokens).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from chatkv.config import OVERFLOW_POLICIES
from chatkv.engine import text_tokens
from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ConversationBusy, InvalidRequest, SessionError, check_text
from chatkv.kvcache.types import RetainedKV
from chatkv.outputs import Reply
from chatkv.rag import context as rag_context
from chatkv.sessions import context_window as cw
from chatkv.sessions.session import Session
from chatkv.sessions.snapshots import Resident, Snapshots
from chatkv.sessions.template import TurnRenderer
from chatkv.sessions.turn import Turn, TurnEnd
from chatkv.storage.models import LOCAL_USER
from chatkv.storage.records import check_owner
from chatkv.storage.repository import Store

if TYPE_CHECKING:
    from chatkv.storage.leases import Held, Mark
    from chatkv.storage.records import ConversationInfo

DEFAULT_TITLE = "New chat"
RAG_KEY = "knowledge"  # in a conversation's stored params: {"kb": name, "top_k": k, "documents": [...]}
OVERFLOW_KEY = "overflow"  # in a conversation's stored params: its overflow policy (chatkv.sessions.context_window)
log = logging.getLogger("chatkv.sessions")


def _rag_settings(knowledge, top_k: int, documents: list[str] | None) -> dict | None:
    """The RAG settings a conversation stores, validated; None without a knowledge base."""
    if knowledge is None:
        if documents:
            raise InvalidRequest("documents= pins documents of a knowledge base: pass knowledge= too")
        return None
    if not hasattr(knowledge, "search") or not hasattr(knowledge, "name"):
        raise InvalidRequest(
            f"knowledge must be a KnowledgeBase (engine.knowledge_base(name)), got {type(knowledge).__name__}"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 64:
        raise InvalidRequest(f"top_k must be an int in [1, 64], got {top_k!r}")
    docs = list(documents or [])
    for d in docs:
        check_text("pinned document", d)
    return {"kb": knowledge.name, "top_k": top_k, "documents": docs}


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
            self.kv,
            self.store,
            data_dir / "kv",
            engine.fingerprint,
            engine.kv_dtype,
            cfg.tenant,
            cfg.snapshot_budget_bytes,
        )
        self.live: dict[str, Session] = {}
        self.closed = False  # engine.close() closed it: every session of it raises EngineClosed
        self._resume_lock = threading.RLock()
        self.marks: dict[str, Mark | None] = {}  # conversation id -> the stored state last seen (its lease's)
        self.overflow = cfg.overflow
        self.sink_tokens = cfg.sink_tokens

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
            s.knowledge, s.top_k, s.documents, s.system_content = (
                knowledge,
                rag["top_k"],
                rag["documents"],
                system_content,
            )
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
            self._close_unreplied(s)
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

    def _rebuild(self, s: Session, why: str | None = None) -> None:
        """Stored text that no longer matches its hash (edited behind the store's back, even at the
        same length): the token history, and so the KV, no longer say what the messages say. The
        stored text wins: the history is recomputed from it (the system prompt, then each turn
        rendered as a turn would render it), its snapshot dropped, and the KV computed afresh on
        the next turn. (``why``: another reason the history must come from the text.)"""
        msgs = self.store.messages(s.id)
        changed = [m.id for m in msgs if not m.intact]
        if why is None:
            log.warning(
                "conversation %s: the stored text of message(s) %s no longer matches what was stored with it; "
                "recomputing the conversation's KV from the stored text",
                s.id,
                changed,
            )
        else:
            log.info("conversation %s: %s; its history is rendered from the stored text", s.id, why)
        tokens: list[int] = []
        st = cw.ContextState(policy=s.window.policy)  # the whole history, its turns where they start now
        for m in msgs:
            if m.role == "user":
                first = not tokens
                tokens += self.delta_from(tokens, s.system_content, m.content)
                st.turns.append(
                    self.first_turn_start(tokens, m.content)
                    if first
                    else len(tokens) - len(self.renderer.user_turn(m.content))
                )
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
        # backend per call, a race with every other thread tokenising (chatkv.engine.text_tokens)
        return text_tokens.encode_text(self.engine.tokenizer, text)

    def delta_from(self, tokens: list[int], system: str | None, content: str) -> list[int]:
        """The tokens a user message ``content`` adds to a history ``tokens``: its turn, or for
        an empty history the whole first prompt (``system`` prompt, if any, and the message)."""
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
            self.spill(s)  # under the lease, only if current
        finally:
            self.kv.unpin(s.pinned)
            s.pinned = None
            s.closed = True
            self.live.pop(s.id, None)

    def delete(self, s: Session) -> None:
        with self.store.leases.hold(s.id):  # ConversationBusy while another process generates it
            self._delete(s)  # (its lease row goes with the conversation)

    def _delete(self, s: Session) -> None:
        self.kv.drop(s.kept)
        s.kept = None
        self.kv.unpin(s.pinned)
        s.pinned = None
        s.closed = True
        self.live.pop(s.id, None)
        self.store.delete_conversation(s.id)  # with its snapshot row, if one was written yet
        self.snapshots.delete(s.id)  # its files either way: write-behind lists them before any row does

    def save_params(self, s: Session, params: dict) -> None:
        """Store a session's sampling settings, keeping its RAG settings beside them; then it has them."""
        self._store_settings(s, params, s.window.policy)
        s.params = dict(params)

    def set_overflow(self, s: Session, policy: str) -> None:
        """Store a session's overflow policy (validated by the caller); then it has it."""
        self._store_settings(s, s.params, policy)
        s.window.policy = policy

    def rename(self, s: Session, title: str) -> None:
        self.store.rename(s.id, title)
        s.title = title

    def _store_settings(self, s: Session, params: dict, policy: str) -> None:
        stored = dict(params)
        stored[OVERFLOW_KEY] = policy
        if s.knowledge is not None:
            stored[RAG_KEY] = {"kb": s.knowledge.name, "top_k": s.top_k, "documents": list(s.documents)}
        self.store.set_params(s.id, stored)

    def stored_settings(self, info) -> tuple[dict, str | None]:
        """A conversation's stored sampling params (without the settings kept beside them) and overflow policy."""
        params = dict(info.params)
        params.pop(RAG_KEY, None)
        return params, params.pop(OVERFLOW_KEY, None)

    def spill(self, s: Session) -> bool:
        """Release the session's KV, writing its snapshot first only under the lease and only if
        the session is current. True if it had KV in memory."""
        if s.kept is None:
            return False
        held, current = None, False
        try:
            with self.store.leases.hold(s.id) as held:
                current = self._behind(s, held.mark) is None
                if current:
                    return self.engine.on_loop(lambda: self._spill_now(s, wait=True))
                log.info("conversation %s: behind the stored conversation; KV released without a snapshot write", s.id)
                return True
        except Exception as e:  # busy elsewhere, deleted, or no database: the snapshot is not ours to write
            if held is not None:
                raise
            log.info("conversation %s: KV released without a snapshot write (%s: %s)", s.id, type(e).__name__, e)
            return True
        finally:
            if not current:
                self.engine.on_loop(lambda: self._drop_kv(s))
            if held is not None:
                self.remember(s, held, current)

    def spill_idle(self, now: float | None = None, keep: Session | None = None) -> int:
        """Release every session idle for ``idle_spill_s`` or longer (its snapshot is current, or
        queued); returns how many (loop thread)."""
        now = time.monotonic() if now is None else now
        self.snapshots.drain()
        done = 0
        for s in list(self.live.values()):
            if s is not keep and not s.busy and s.kept is not None and now - s.last_used >= self.idle_spill_s:
                done += self._spill_now(s, wait=False)
        return done

    def relieve(self, missing_blocks: int) -> bool:
        """Blocks ran short: ``missing_blocks`` more than eviction could free. Spill idle sessions,
        least recently used first, until that many more are evictable than now (what is evictable
        now is what eviction left: the request's own history, unlocked when its admission was
        given up, which it locks again). True if any was spilled (loop thread)."""
        return (
            self.snapshots.relieve(
                [
                    Resident(s.id, s.tokens, s.kept, s.last_used, functools.partial(self._forget_kv, s, s.kept))
                    for s in list(self.live.values())
                    if not s.busy and s.kept is not None
                ],
                missing_blocks + self.kv.cache.evictable_blocks,
            )
            > 0
        )

    @contextlib.contextmanager
    def relieving(self) -> Iterator[None]:
        """Around the session layer's own KV work (a turn's restore and window move, loop thread):
        blocks short there are freed by spilling idle sessions at once."""
        self.kv.on_pressure = self.relieve
        try:
            yield
        finally:
            self.kv.on_pressure = None

    def _spill_now(self, s: Session, wait: bool) -> bool:
        kept, s.kept = s.kept, None
        return self.snapshots.spill(s.id, s.tokens, kept, wait=wait)

    def _forget_kv(self, s: Session, kept: RetainedKV) -> None:
        if s.kept is kept:
            s.kept = None

    def _drop_kv(self, s: Session) -> None:
        self.kv.drop(s.kept)
        s.kept = None

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
                    log.warning(
                        "conversation %s: the interrupted reply was not stored at close (%s: %s)",
                        s.id,
                        type(e).__name__,
                        e,
                    )

    # -- a turn (chatkv.sessions.turn) and the session state it changes -------------------------

    def turn(self, s: Session, text: str, params: SamplingParams, **options) -> Iterator[str | Reply]:
        """A turn under the conversation's lease: ConversationBusy while another process generates
        it; a session behind the stored conversation is reloaded first. ``options``: Turn's
        ``render`` and ``role`` (a turn with tools, or of tool results: chatkv.sessions.tools)."""
        return Turn(self, s, text, params, **options).run()

    # -- branches: the conversation as a tree (storage.message_tree) ---------------------

    def regenerate(self, s: Session, params: SamplingParams) -> Iterator[str | Reply]:
        """Answer the current branch's last user message again: a sibling of its reply."""
        users = [x for x in self.store.messages(s.id) if x.role == "user"]
        if not users:
            raise InvalidRequest(f"nothing to regenerate: conversation '{s.id}' has no user message yet")
        return Turn(self, s, users[-1].content, params, branch=(users[-1].id, False), regenerate=True).run()

    def edit(self, s: Session, message_id: int, text: str, params: SamplingParams) -> Iterator[str | Reply]:
        """A sibling of user message ``message_id`` with ``text``, made current and answered."""
        msg = self.store.get_message(s.id, message_id)
        if msg.role != "user":
            raise InvalidRequest(
                f"message {message_id} is an {msg.role} message; only a user message can be edited "
                f"(regenerate() answers the last one again)"
            )
        return Turn(self, s, text, params, branch=(msg.parent_id, False)).run()

    def switch(self, s: Session, message_id: int, descend: bool = True):
        """Make the branch through ``message_id`` current (under the lease); its leaf's MessageInfo."""
        if s.busy:
            raise SessionError(f"session '{s.id}' is generating a reply; finish or interrupt it first")
        held, done = None, False
        try:
            with self.store.leases.hold(s.id) as held:
                self.sync(s, held.mark)
                b = self.branch(s, message_id, descend)
                done = True
        finally:
            if held is not None:
                self.remember(s, held, done)
        return b.info

    def branch(self, s: Session, message_id: int | None, descend: bool) -> "_Branched":
        """Under the lease: the conversation's current branch becomes ``message_id``'s, and the
        session follows it. Its history is that branch's, from what its messages recorded (never
        re-tokenised; only a branch stored before conversations were trees is rendered again from
        its text). Its KV in memory was the old branch's: it goes back to the prefix cache, whose
        blocks of the prefix the branches share serve the next turn."""
        before = self.store.get_conversation(s.id).current_leaf_id
        info = self.store.switch_branch(s.id, message_id, descend)
        now = self.store.get_conversation(s.id)
        if now.current_leaf_id != before or list(now.token_ids or ()) != s.tokens:
            self._reload(s, now, "switched to another branch")
            if not s.tokens and now.current_leaf_id is not None:  # a branch from before 0006: no tokens recorded
                self._rebuild(s, "its token history was not recorded (stored before conversations were trees)")
        return _Branched(before, info)

    def take_kv(self, s: Session) -> RetainedKV | None:
        """A turn takes the session's KV into its request (loop thread)."""
        kept, s.kept = s.kept, None
        return kept

    def keep_kv(self, s: Session, kept: RetainedKV | None) -> None:
        """The turn's request was refused: the session keeps its KV (loop thread)."""
        s.kept = kept

    def window_moved(self, s: Session, context: list[int], st: cw.ContextState) -> None:
        s.tokens, s.window = context, st

    def begin(self, s: Session) -> None:
        s.busy = True

    def handed(self, s: Session, tokens: list[int], kept: RetainedKV | None) -> None:
        """The turn's request finished: the session keeps its KV for the next turn, and is no longer
        busy: from here memory pressure may spill it, even before its reply is stored (loop thread)."""
        s.tokens, s.kept = tokens, kept
        s.last_used = time.monotonic()
        s.busy = False

    def name_new_chat(self, s: Session, text: str) -> None:
        """A new chat's first user message is stored: the chat is named after it."""
        if s.title == DEFAULT_TITLE:
            s.title = " ".join(text.split())[:48] or DEFAULT_TITLE
            self.store.rename(s.id, s.title)

    def committed(self, s: Session, st: cw.ContextState, text: str, tokens: list[int] | None, end: TurnEnd) -> None:
        """The user message is stored (``tokens``: the history now; None when the request finished
        first and gave the session its whole history already)."""
        if tokens is not None:
            s.tokens = tokens
        s.window, s.last_question, s.ending = st, text, end

    def taken_back(self, s: Session, kept: RetainedKV | None, tokens: list[int] | None) -> None:
        """The user message was not stored: the session keeps ``kept`` and (``tokens``) its history
        as it was, dropping the KV of a request that finished meanwhile (loop thread)."""
        if tokens is not None:
            self.kv.drop(s.kept)
            s.tokens = tokens
        s.kept = kept
        s.busy = False

    def ended(self, s: Session) -> None:
        s.ending = None

    # -- leases: several processes, one store --------------------------------------------

    def sync(self, s: Session, mark: Mark) -> None:
        """Under the lease: reload a session that is behind; close a turn left without its reply."""
        info = self._behind(s, mark)
        if info is not None:
            self._reload(s, info)
        if mark.last_role == "user" and s.tokens:
            # its process died while replying (a live one would still hold the lease)
            s.tokens = s.tokens + self.renderer.close_reply([])
            self.store.add_message(s.id, "assistant", "", status="interrupted", token_ids=s.tokens)
            log.info("conversation %s: a turn left without its reply was closed as interrupted", s.id)

    def remember(self, s: Session, held: Held, current: bool) -> None:
        """After the lease: the stored state, if the session is known to match it."""
        if not self.closed:  # engine.close() closed the store, which gave every lease back
            self.marks[s.id] = held.released if current else None

    def _behind(self, s: Session, mark: Mark) -> ConversationInfo | None:
        """Under the lease: the stored conversation if the session's history differs from it, else None."""
        if self.marks.get(s.id) == mark and len(s.tokens) == mark.token_count:
            return None
        info = self.store.get_conversation(s.id)
        if list(info.token_ids or ()) == s.tokens:
            self.marks[s.id] = mark
            return None
        return info

    def _reload(
        self, s: Session, info: ConversationInfo, why: str = "another process stored turns since this one looked"
    ) -> None:
        """Make ``s`` the stored conversation ``info``; its KV in memory (the old history's) is dropped."""
        log.info("conversation %s: %s (%d -> %d tokens); reloading", s.id, why, len(s.tokens), info.token_count)
        old_ns = self.kv_namespace(s.id, s.window) if s.window is not None else None
        self.engine.on_loop(lambda: self._drop_kv(s))
        s.params, overflow = self.stored_settings(info)
        s.tokens = list(info.token_ids or ())
        s.window = self.stored_window(s, info, overflow)
        if old_ns is not None and old_ns != self.kv_namespace(s.id, s.window):
            self.engine.on_loop(
                lambda: self.kv.drop_namespace(old_ns)
            )  # a moved sink window's re-rotated keys match nothing now
        s.title = info.title
        if s.knowledge is not None:
            users = [x.content for x in self.store.messages(s.id) if x.role == "user"]
            s.last_question = users[-1] if users else None

    def _close_unreplied(self, s: Session) -> None:
        """At resume, for a stored turn without its reply: close it as interrupted, unless a live
        process holds the conversation (it is generating that reply now)."""
        held, done = None, False
        try:
            with self.store.leases.hold(s.id) as held:
                self.sync(s, held.mark)
                done = True
        except ConversationBusy:
            if held is None:
                return
            raise
        finally:
            if held is not None:
                self.remember(s, held, done)

    # -- helpers of turns ------------------------------------------------------------------

    def kv_namespace(self, conv_id: str, st: cw.ContextState):
        """The radix namespace of a conversation's KV: the shared one, or once an attention-sink
        window has moved (keys re-rotated), one of its own per window epoch."""
        return (self.kv.namespace, "window", conv_id, st.epoch) if st.private else None

    def first_turn_start(self, prompt: list[int], content: str) -> int:
        """Where the first user turn starts in a first prompt: everything before it (the system
        prompt, pinned documents) is kept when old turns are dropped."""
        turn = self.renderer.user_turn(content)
        if len(turn) <= len(prompt) and prompt[len(prompt) - len(turn) :] == turn:
            return len(prompt) - len(turn)
        return len(prompt)  # a template whose first turn renders differently: the first turn stays

    def pin_system(self, s: Session) -> None:
        """Pin the shared system prompt's blocks while the session is open."""
        if s.pinned is not None or not s.system_content:
            return
        sys_tokens = self.renderer.system_prefix(s.system_content)
        n = len(sys_tokens) // self.kv.block_size * self.kv.block_size  # only whole blocks are shared
        if n and s.tokens[:n] == sys_tokens[:n]:
            s.pinned = self.kv.pin(sys_tokens[:n], self.kv.user_namespace(s.owner))


class _Branched:
    """What a branch switch did: the leaf it left (``leaf``) and the one it made current (``info``)."""

    def __init__(self, leaf: int | None, info):
        self.leaf, self.info = leaf, info
