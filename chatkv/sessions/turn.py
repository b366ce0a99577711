"""One turn of a session: its phases as methods, its state as fields.

(A few lines past 400 on purpose: the phases are read in their order in one class; split, the
state they hand each other would become parameters between files.)

``SessionManager.turn`` makes a ``Turn`` and runs it; the phases, in order:

- **plan** (the caller's thread): validate, retrieve sources (with a knowledge base), render
  the new tokens, plan the KV window (``chatkv.sessions.context_window``);
- **admit** (one call on the loop thread): spill idle sessions, take the session's KV (restored
  from disk when it is not in memory), move the window, place the sources' chunk KV (chatkv.rag.placement),
  add the request. Its ``on_finish`` is this turn's: when the request finishes, on the loop thread,
  the session takes its history and retained KV at once (``_handed``), so no KV is ever between owners;
- **commit_user**: the user message is stored before generation (with the window it was
  computed in); if that fails the request is taken back and the session keeps what it had;
- **drive**: the reply's pieces as the engine produces them;
- **finish** (once, by the turn or by ``engine.close()`` while the caller holds the turn
  suspended): end the request if it has not ended, **commit_reply** (stored before the turn
  reports done; an interrupted reply is kept, marked so), then **settle** on the loop thread:
  pin the shared system prompt, queue the new KV for disk (write-behind).

The whole turn runs under the conversation's lease (``store.leases.hold``). The Turn writes a
Session only through the manager's methods: the manager is the one writer of session state.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, ContextManager, Hashable, Iterator, Protocol

from chatkv.errors import EngineClosed, OutOfBlocks
from chatkv.outputs import Reply
from chatkv.sessions import context_window as cw

if TYPE_CHECKING:
    from chatkv.engine.sampling import SamplingParams
    from chatkv.engine.sequence import Sequence
    from chatkv.kvcache.manager import KVManager
    from chatkv.kvcache.types import RetainedKV
    from chatkv.sessions.session import Session
    from chatkv.sessions.snapshots import Snapshots
    from chatkv.sessions.template import TurnRenderer
    from chatkv.storage.leases import Held, Mark
    from chatkv.storage.repository import Store

log = logging.getLogger("chatkv.sessions")


class Manager(Protocol):
    """What a turn uses of the session manager (``chatkv.sessions.manager.SessionManager`` is
    one); this module names it, never the class, so the two modules do not import each other."""

    engine: object  # add_request, drive, abort, on_loop, context_window, shift_keys, turn_in_flight, turn_suspended
    kv: KVManager
    store: Store
    snapshots: Snapshots
    renderer: TurnRenderer
    sink_tokens: int

    def sync(self, s: Session, mark: Mark) -> None: ...

    def branch(self, s: Session, message_id: int | None, descend: bool) -> Branched: ...

    def remember(self, s: Session, held: Held, current: bool) -> None: ...

    def spill_idle(self, now: float | None = None, keep: Session | None = None) -> int: ...

    def relieving(self) -> ContextManager[None]: ...

    def kv_namespace(self, conv_id: str, st: cw.ContextState) -> Hashable | None: ...

    def delta_from(self, tokens: list[int], system: str | None, content: str) -> list[int]: ...

    def first_turn_start(self, prompt: list[int], content: str) -> int: ...

    def pin_system(self, s: Session) -> None: ...

    # the session's state, written by the manager alone
    def take_kv(self, s: Session) -> RetainedKV | None: ...

    def keep_kv(self, s: Session, kept: RetainedKV | None) -> None: ...

    def window_moved(self, s: Session, context: list[int], st: cw.ContextState) -> None: ...

    def begin(self, s: Session) -> None: ...

    def handed(self, s: Session, tokens: list[int], kept: RetainedKV | None) -> None: ...

    def name_new_chat(self, s: Session, text: str) -> None: ...

    def committed(self, s: Session, st: cw.ContextState, text: str, tokens: list[int] | None, end: TurnEnd) -> None: ...

    def taken_back(self, s: Session, kept: RetainedKV | None, tokens: list[int] | None) -> None: ...

    def ended(self, s: Session) -> None: ...


class Branched(Protocol):
    leaf: int | None  # the leaf the conversation was on before the switch


class TurnEnd:
    """A turn's end (settle its request, store its reply), run once by whichever comes first:
    the turn's own generator or ``engine.close()``; the other gets the same Reply (or error)."""

    def __init__(self, fn: Callable[[], Reply]):
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


class Turn:
    def __init__(
        self,
        m: Manager,
        s: Session,
        text: str,
        params: SamplingParams,
        *,
        branch: tuple[int | None, bool] | None = None,
        regenerate: bool = False,
        render: Callable[[list[int], str | None, str], list[int]] | None = None,
        role: str = "user",
    ):
        self.m, self.s, self.text, self.params = m, s, text, params
        # the new message's tokens from (history, system content, content); None: a plain user
        # message (a turn with tools or of tool results renders its own: chatkv.sessions.tools)
        self.render = render
        self.role = role  # the stored role of the new message: "user", or "tool" (tool results)
        # where in the conversation's tree the turn starts: (message id or None for before the first
        # one, descend) made current under the lease first; None: after the current leaf
        self.branch = branch
        self.regenerate = regenerate  # answer the last user message again: no new user message
        self.stored = False  # a message of this turn is stored (else a failed branch turn goes back)
        self.engine = m.engine
        self.arrival = 0.0  # when the turn began under its lease (TTFT counts the restore from disk too)
        self.window = 0  # the engine's context window, in tokens
        self.content = text  # the user message as the model reads it (with retrieved sources)
        self.hits: list = []  # the retrieved chunks it holds
        self.placed = None  # what chatkv.rag.placement did with their KV (None: nothing)
        self.query: str | None = None  # what was searched (None: no knowledge base)
        self.delta: list[int] = []  # the tokens the user message adds
        self.st: cw.ContextState | None = None  # the window after this turn (a copy until committed)
        self.window_plan: cw.Plan | None = None
        self.user_ns: Hashable | None = None
        self.seq: Sequence | None = None
        self.context: list[int] = []  # the history the request continues (after any window move)
        self.prompt: list[int] = []
        self.first_turn = False
        self.info: cw.ContextInfo | None = None
        self.end = TurnEnd(self.finish)
        self._lock = threading.Lock()  # its request's finish (loop thread) against the user commit
        self.handed = False  # the request finished and the session took its KV
        self.committed = False  # the user message is stored

    # -- the whole turn ------------------------------------------------------------------

    def run(self) -> Iterator[str | Reply]:
        """The turn under the conversation's lease: ConversationBusy while another process
        generates it; a session behind the stored conversation is reloaded first."""
        m, s = self.m, self.s
        with self.engine.turn_in_flight():  # counted in flight for engine.close() (EngineClosed once it began)
            held, done = None, False
            try:
                with m.store.leases.hold(s.id) as held:
                    m.sync(s, held.mark)
                    back = m.branch(s, *self.branch) if self.branch is not None else None
                    try:
                        yield from self._phases()
                    except BaseException:
                        if back is not None and not self.stored:  # nothing of it stored: the branch it left
                            try:
                                m.branch(s, back.leaf, False)
                            except Exception:  # noqa: BLE001 - the turn's own error is the one to raise
                                log.exception("conversation %s: could not go back to the branch it was on", s.id)
                        raise
                    done = True
            finally:
                if held is not None:
                    m.remember(s, held, done)

    def _phases(self) -> Iterator[str | Reply]:
        self.plan()
        self.admit()
        self.commit_user()
        suspended = self.engine.turn_suspended  # while the caller holds a piece, close() does not wait for it
        cut = None
        pieces = self.drive()
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
                reply = self.end.run()
            finally:
                self.m.ended(self.s)
        if cut is not None:
            raise EngineClosed(
                "the engine was closed during this turn; the reply so far is stored, marked interrupted", reply=reply
            ) from None
        with suspended():
            yield reply

    # -- plan ----------------------------------------------------------------------------

    def plan(self) -> None:
        m, s = self.m, self.s
        self.arrival = time.perf_counter()
        self.params.validate()
        self.window = self.engine.context_window
        reserve = cw.reply_room(self.params.max_tokens, self.window)
        if (
            s.knowledge is not None and not self.regenerate and self.role == "user"
        ):  # a regenerated answer reads the same sources
            self._retrieve(reserve)
        self.delta = [] if self.regenerate else (self.render or m.delta_from)(s.tokens, s.system_content, self.content)
        self.st = copy.deepcopy(s.window)
        self.window_plan = cw.plan(
            self.st, len(s.tokens), len(self.delta), reserve, self.window, m.kv.block_size, m.sink_tokens
        )
        self.user_ns = m.kv.user_namespace(s.owner)  # a server user's KV is never another's (None: the local user)

    def _retrieve(self, reserve: int) -> None:
        from chatkv.rag import context as rag  # only a session with a knowledge base retrieves

        s, m, room = self.s, self.m, self.window - reserve
        self.query = rag.standalone_query(self.text, s.last_question)
        found = s.knowledge.search(self.query, k=s.top_k)
        if s.window.policy == "error":
            fits = lambda c: len(s.tokens) + len(m.delta_from(s.tokens, s.system_content, c)) < room  # noqa: E731
        else:  # the history makes way for the sources
            fits = lambda c: (s.window.prefix or 0) + len(m.delta_from(s.tokens, s.system_content, c)) < room  # noqa: E731
        self.content, self.hits = rag.fit_sources(self.text, found, fits)

    # -- admit ---------------------------------------------------------------------------

    def admit(self) -> None:
        """Restore, move the window and add the request: one call where the engine's state lives."""
        self.seq, self.context = self.engine.on_loop(self._admit)
        self.first_turn = not self.context
        self.prompt = self.context + self.delta
        st = self.st
        if self.regenerate:  # the user message's turn is in the window already
            return
        st.turns.append(self.m.first_turn_start(self.prompt, self.content) if self.first_turn else len(self.context))
        if self.first_turn:
            st.prefix = st.turns[0]

    def _admit(self) -> tuple[Sequence, list[int]]:
        m, s, st, plan = self.m, self.s, self.st, self.window_plan
        m.spill_idle(keep=s)
        kept, restored = m.take_kv(s), 0
        old_ns = m.kv_namespace(s.id, st)
        context = s.tokens
        with m.relieving():  # blocks short for the restore or the move: idle sessions are spilled
            if kept is None and s.tokens and plan.kind != "truncate":
                kept, restored = m.snapshots.restore(s.id, s.tokens + self.delta, namespace=old_ns or self.user_ns)
            if plan.kind != "none":
                context = cw.apply(st, plan, s.tokens)
                kept, restored = self._move_window(kept, restored, old_ns, context)
                m.window_moved(s, context, st)  # the KV in memory is the new window's now
        if self.hits and self.engine.config.rag_kv_reuse != "off":  # the sources' chunk KV, placed
            from chatkv.rag.placement import for_turn

            kept = for_turn(self, kept, context)
        try:
            seq = self.engine.add_request(
                context + self.delta,
                self.params,
                retain=True,
                prefix=kept,
                namespace=m.kv_namespace(s.id, st) or self.user_ns,
                max_context=self.window,
                admitted=True,  # the turn was admitted (close() waits for it)
                on_finish=self._handed,
            )
        except BaseException:
            m.keep_kv(s, kept)  # nothing happened: the session keeps its KV
            raise
        seq.num_restored, seq.arrival, seq.placed = restored, self.arrival, self.placed
        m.begin(s)
        return seq, context

    def _move_window(self, kept, restored: int, old_ns, context: list[int]):
        """Make the KV in memory match the new window: dropped turns drop it (recomputed once);
        a sink move keeps the sink and the recent blocks, keys re-rotated."""
        m, plan, kv = self.m, self.window_plan, self.m.kv
        if plan.kind == "truncate":
            kv.drop(kept)
            if old_ns is not None:
                kv.drop_namespace(old_ns)
            return None, 0
        if kept is None:
            return None, 0
        try:
            kept = kv.slide(
                kept,
                context,
                plan.sink,
                plan.drop,
                m.kv_namespace(self.s.id, self.st),
                self.engine.shift_keys,
                old_namespace=old_ns,
            )
        except OutOfBlocks as e:  # kept is ended: the window is recomputed instead
            log.warning("conversation %s: no room to move its KV window (%s); recomputing it", self.s.id, e)
            return None, 0
        return kept, min(restored, kept.kv_len if kept is not None else 0)

    def _handed(self, seq: Sequence) -> None:
        """The request finished (the scheduler calls this on the thread that steps): the session
        takes its history and retained KV now; from here memory pressure may spill it."""
        tokens = seq.token_ids + self.m.renderer.close_reply(seq.generated_ids)
        with self._lock:
            kept, seq.retained = seq.retained, None
            self.m.handed(self.s, tokens, kept)
            self.handed = True

    # -- commit the user message ----------------------------------------------------------

    def commit_user(self) -> None:
        m, s, st = self.m, self.s, self.st
        try:
            meta = {"query": self.query, "sources": [h.chunk_id for h in self.hits]} if self.query is not None else None
            # committed before generation, with the window it was computed in (a regenerated
            # answer follows the stored user message: nothing to store yet)
            if not self.regenerate:
                m.store.add_message(s.id, self.role, self.text, meta=meta, token_ids=self.prompt, context=st.to_json())
                self.stored = True
        except BaseException:
            st.turns.pop()
            self.engine.on_loop(self._take_back)
            raise
        if self.first_turn:
            m.name_new_chat(s, self.text)
        with self._lock:  # a request that already finished has given the session its whole history
            m.committed(s, st, self.text, None if self.handed else self.prompt, self.end)
            self.committed = True
        plan = self.window_plan
        self.info = cw.ContextInfo(
            policy=st.policy,
            window=self.window,
            context_tokens=len(self.prompt),
            dropped_tokens=plan.drop,
            dropped_turns=plan.turns,
            total_dropped_tokens=st.dropped_tokens,
            total_dropped_turns=st.dropped_turns,
            sink_tokens=st.sink if st.private else 0,
            recomputed=plan.kind == "truncate",
        )

    def _take_back(self) -> None:
        """The user message was not stored: the request goes; the session keeps its KV if the
        request was not admitted yet, and its history as it was (loop thread)."""
        seq, kv = self.seq, self.m.kv
        seq.on_finish = None
        kept, seq.prefix = seq.prefix, None
        self.engine.abort(seq)
        kv.drop(seq.retained)
        seq.retained = None
        with self._lock:
            self.m.taken_back(self.s, kept, self.context if self.handed else None)

    # -- drive ---------------------------------------------------------------------------

    def drive(self) -> Iterator[str]:
        return self.engine.drive(self.seq)

    # -- the end: commit the reply, settle -------------------------------------------------

    def finish(self) -> Reply:
        """The turn's end, once: by this turn, or by engine.close() while its caller holds it."""
        if not self.handed:  # stopped early: its request ends now and hands its KV over
            self.engine.on_loop(self._end_request)
        return self.commit_reply()

    def _end_request(self) -> None:
        self.engine.abort(self.seq)  # no-op when it finished
        if not self.handed:  # its finish callback failed: the session takes the KV here
            self._handed(self.seq)

    def commit_reply(self) -> Reply:
        m, s, st, plan = self.m, self.s, self.st, self.window_plan
        r = self.seq.result()
        sources = []
        if self.hits:
            from chatkv.rag import context as rag

            sources = rag.sources_of(r.text, self.hits)
        msg_meta = {"sources": [x.as_json() for x in sources]} if sources else {}
        if plan.drop:
            msg_meta["context"] = {"dropped_tokens": plan.drop, "dropped_turns": plan.turns, "policy": st.policy}
        msg = m.store.add_message(
            s.id,
            "assistant",
            r.text,
            status="complete" if r.finish_reason in ("stop", "length") else "interrupted",
            meta=msg_meta or None,
            token_ids=s.tokens,
            context=st.to_json(),
            **r.usage.message_columns(),
        )
        self.stored = True
        self.engine.on_loop(lambda: self.settle(msg.id))
        return Reply(
            text=r.text,
            usage=r.usage,
            finish_reason=r.finish_reason,
            message_id=msg.id,
            sources=sources,
            context=self.info,
        )

    def settle(self, message_id: int) -> None:
        """Pin the shared prefix; the new KV reaches the disk in the background (loop thread)."""
        s = self.s
        self.m.pin_system(s)
        if s.kept is not None:  # else a spill (memory pressure) already queued it
            self.m.snapshots.write_behind(s.id, s.tokens, s.kept, fence=message_id)
