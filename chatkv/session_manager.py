"""SessionManager: saved conversations and their turns.

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
  its KV released; the next turn restores it (see ``chatkv.snapshots``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterator

from chatkv import rag as rag_context
from chatkv.errors import InvalidRequest, SessionError, check_text
from chatkv.kv_manager import RetainedKV
from chatkv.outputs import Reply
from chatkv.sampling import SamplingParams
from chatkv.session import Session
from chatkv.snapshots import Snapshots
from chatkv.storage.repository import Store
from chatkv.turns import TurnRenderer

DEFAULT_TITLE = "New chat"
RAG_KEY = "knowledge"  # in a conversation's stored params: {"kb": name, "top_k": k, "documents": [...]}
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
        self.kv.on_pressure = lambda missing: self.snapshots.relieve(self.live.values(), missing)

    def held_kv(self) -> list[RetainedKV | None]:
        """The KV every open session holds (for integrity checks)."""
        return [s.kept for s in self.live.values()]

    # -- sessions -----------------------------------------------------------

    def create(
        self,
        system: str | None,
        title: str | None,
        params: dict | None,
        knowledge=None,
        top_k: int = 4,
        documents: list[str] | None = None,
    ) -> Session:
        if system is not None:
            check_text("system prompt", system)
        if title is not None:
            check_text("title", title)
        if params:
            SamplingParams.from_dict(params).validate()
        rag = _rag_settings(knowledge, top_k, documents)
        system_content = self._system_content(system, knowledge, rag["documents"]) if rag else system
        stored = dict(params or {})
        if rag:
            stored[RAG_KEY] = rag
        info = self.store.create_conversation(
            title=title or DEFAULT_TITLE,
            model=self.engine.model_dir.name,
            system_prompt=system or "",
            params=stored,
            tenant=self.tenant,
        )
        s = Session(self, info.id, info.title, system, params or {}, [])
        if rag:
            s.knowledge, s.top_k, s.documents, s.system_content = knowledge, rag["top_k"], rag["documents"], system_content
        self.live[s.id] = s
        return s

    def resume(self, conv_id: str) -> Session:
        if isinstance(conv_id, str) and conv_id in self.live:
            return self.live[conv_id]
        info = self.store.get_conversation(conv_id, tenant=self.tenant)
        params = dict(info.params)
        rag = params.pop(RAG_KEY, None)
        s = Session(self, info.id, info.title, info.system_prompt or None, params, list(info.token_ids or []))
        msgs = self.store.messages(s.id)
        if msgs and msgs[-1].role == "user" and s.tokens:
            # the process died while replying: close the turn as an interrupted, empty reply
            s.tokens = s.tokens + self.renderer.close_reply([])
            self.store.add_message(s.id, "assistant", "", status="interrupted", token_ids=s.tokens)
        if rag:
            s.knowledge = self.engine.knowledge_base(rag["kb"])
            s.top_k, s.documents = rag["top_k"], list(rag["documents"])
            try:
                s.system_content = self._system_content(s.system, s.knowledge, s.documents)
            except InvalidRequest as e:  # a pinned document was removed since: the history keeps its copy
                log.warning("conversation %s: %s; its documents are not pinned", s.id, e)
            users = [m.content for m in msgs if m.role == "user"]
            s.last_question = users[-1] if users else None
        self.live[s.id] = s
        return s

    def _system_content(self, system: str | None, knowledge, documents: list[str]) -> str | None:
        return rag_context.documents_block(system, [(d, knowledge.chunks_of(d)) for d in documents])

    def close_session(self, s: Session) -> None:
        if s.busy:
            raise SessionError(f"session '{s.id}' is generating; finish or interrupt the reply first")
        try:
            self.snapshots.spill(s)
        finally:
            self.kv.unpin(s.pinned)
            s.pinned = None
            s.closed = True
            self.live.pop(s.id, None)

    def delete(self, s: Session) -> None:
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
        if s.knowledge is not None:
            stored[RAG_KEY] = {"kb": s.knowledge.name, "top_k": s.top_k, "documents": list(s.documents)}
        self.store.set_params(s.id, stored)

    def spill(self, s: Session) -> bool:
        return self.snapshots.spill(s)

    def spill_idle(self, now: float | None = None, keep: Session | None = None) -> int:
        """Spill every session idle for longer than ``idle_spill_s``; returns how many."""
        return self.snapshots.spill_idle(self.live.values(), self.idle_spill_s, now, keep)

    def close(self) -> None:
        try:
            for s in list(self.live.values()):
                if not s.busy:
                    self.close_session(s)
        finally:
            self.kv.on_pressure = None
            self.store.close()

    # -- a turn -------------------------------------------------------------

    def turn(self, s: Session, text: str, params: SamplingParams) -> Iterator[str | Reply]:
        arrival = time.perf_counter()  # TTFT counts the restore from disk too
        self.spill_idle(keep=s)
        content, hits, query = text, [], None
        if s.knowledge is not None:
            query = rag_context.standalone_query(text, s.last_question)
            found = s.knowledge.search(query, k=s.top_k)
            room = self.engine.max_context - min(params.max_tokens, self.engine.max_context // 4)
            content, hits = rag_context.fit_sources(text, found, lambda m: len(self._prompt(s, m)) < room)
        prompt = self._prompt(s, content)
        kept, restored = (s.kept, 0) if s.kept is not None else self.snapshots.restore(s.id, prompt)
        s.kept = None
        try:
            seq = self.engine.add_request(prompt, params, retain=True, prefix=kept)  # validates before anything is saved
        except BaseException:
            s.kept = kept  # nothing happened: the session keeps its KV
            raise
        seq.num_restored = restored
        seq.arrival = arrival
        try:
            meta = {"query": query, "sources": [h.chunk_id for h in hits]} if query is not None else None
            self.store.add_message(s.id, "user", text, meta=meta, token_ids=prompt)  # committed before generation
        except BaseException:
            s.kept, seq.prefix = seq.prefix, None  # not admitted yet: take the KV back, then drop the request
            self.engine.abort(seq)
            raise
        if not s.tokens and s.title == DEFAULT_TITLE:  # name a new chat after its first message
            s.title = " ".join(text.split())[:48] or DEFAULT_TITLE
            self.store.rename(s.id, s.title)
        s.tokens = prompt
        s.last_question = text
        s.busy = True
        try:
            yield from self.engine.drive(seq)
        finally:
            self.engine.abort(seq)  # no-op when it finished
            s.busy = False
            s.kept, seq.retained = seq.retained, None
            s.tokens = seq.token_ids + self.renderer.close_reply(seq.generated_ids)
            s.last_used = time.monotonic()
            r = seq.result()
            sources = rag_context.sources_of(r.text, hits)
            msg = self.store.add_message(
                s.id,
                "assistant",
                r.text,
                status="complete" if r.finish_reason in ("stop", "length") else "interrupted",
                meta={"sources": [x.as_json() for x in sources]} if sources else None,
                token_ids=s.tokens,
                **r.usage.message_columns(),
            )
            self._pin(s)
        yield Reply(text=r.text, usage=r.usage, finish_reason=r.finish_reason, message_id=msg.id, sources=sources)

    def _prompt(self, s: Session, content: str) -> list[int]:
        """The whole prompt of a turn whose user message is ``content``."""
        if s.tokens:
            return s.tokens + self.renderer.user_turn(content)
        system = s.system_content
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return self.renderer.first(messages)

    def _pin(self, s: Session) -> None:
        """Pin the shared system prompt's blocks while this session is open."""
        if s.pinned is not None or not s.system_content:
            return
        sys_tokens = self.renderer.system_prefix(s.system_content)
        n = len(sys_tokens) // self.kv.block_size * self.kv.block_size  # only whole blocks are shared
        if n and s.tokens[:n] == sys_tokens[:n]:
            s.pinned = self.kv.pin(sys_tokens[:n])
