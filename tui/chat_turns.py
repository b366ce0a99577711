"""Turns of the chat app: send a message, stream the reply on the engine thread, show it.

``TurnsMixin`` is mixed into ``ChatApp`` (tui/app.py) and uses its state and helpers. The
engine thread posts ``Piece`` messages (buffered, at most one in flight) and one ``TurnDone``;
Esc sets the cancel flag, and closing the SDK's stream keeps what was produced, marked interrupted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Markdown

from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ChatKVError
from chatkv.outputs import Reply, Usage
from chatkv.tui.widgets.chat import ChatMessage, StatusLine
from chatkv.tui.widgets.titles import safe_text


@dataclass
class Piece(Message):
    turn: int
    text: str
    at: float  # perf_counter when the SDK yielded it


@dataclass
class TurnDone(Message):
    turn: int
    reply: Reply | None
    usage: Usage | None
    interrupted: bool
    error: str | None


class TurnsMixin:
    """Sending a message and streaming its reply (part of ``ChatApp``)."""

    def send(self, text: str) -> None:
        if not self._can_act("sending another message"):
            return
        self.run_worker(self._send(text), exclusive=False)

    def _sampling(self) -> SamplingParams | None:
        return SamplingParams.from_dict(self.params) if self.params else None

    async def _ensure_session(self) -> bool:
        if self.session is not None:
            return True
        knowledge = None
        if self.kb_name:
            knowledge = await self._call(self.engine.knowledge_base, self.kb_name, what="Knowledge base")
            if knowledge is None:
                return False
        kw = dict(system=self.system, params=dict(self.params) or None)
        if knowledge is not None:
            kw.update(knowledge=knowledge, documents=list(self.documents) or None)
        self.session = await self._call(self.engine.session, what="New chat", **kw)
        return self.session is not None

    async def _send(self, text: str) -> None:
        """A new message at the end of the branch shown, and its reply."""
        opts = self._tool_options()  # the MCP servers' tools (tui/tool_turns.py), if any run
        self._tool_steps = 0
        await self._turn_of(lambda s, p: s.stream(text, p, **opts), user_text=text)

    async def _regenerate(self) -> None:
        """The branch's last user message answered again, streamed into its reply's widget in place
        (the old reply stays, a sibling of the new one: the switcher shows both)."""
        await self._turn_of(lambda s, p: s.stream_regenerate(p), regenerate=True)

    async def _edit(self, message_id: int, text: str) -> None:
        """User message ``message_id`` asked again as ``text``: a new version of it, answered; the view
        drops what followed it on the old branch (kept there: the switcher goes back to it)."""
        await self._turn_of(lambda s, p: s.stream_edit(message_id, text, p), user_text=text, edit_of=message_id)

    async def _turn_of(
        self,
        make,
        user_text: str | None = None,
        regenerate: bool = False,
        edit_of: int | None = None,
        after_tools: bool = False,
    ) -> None:
        """Start the turn ``make(session, params)`` (an SDK stream) and stream it into its reply's widget
        (``after_tools``: the model going on from tool results, a new reply with no message of yours)."""
        self.generating = True  # set before any await: a second Enter is refused
        try:
            t_sent = time.perf_counter()
            if not await self._ensure_session():
                self.generating = False
                return
            try:
                params = self._sampling()
            except ChatKVError as e:
                self._error(e, "Settings")
                self.generating = False
                return
            if regenerate:
                self._reply_widget = await self._reply_to_regenerate()
            elif edit_of is not None:
                self._reply_widget = await self._reply_to_edit(edit_of, user_text)
            elif after_tools:
                self._reply_widget = await self._add_message("assistant", "")
            else:
                await self._add_message("user", user_text)
                self._reply_widget = await self._add_message("assistant", "")
            self._stream = Markdown.get_stream(self._reply_widget.body)
            self._turn += 1
            self._cancel.clear()
            self.turn_timing = {"sent": t_sent}
            self.query_one(StatusLine).update("generating…  (Esc stops)")
            session = self.session
            self._turn_future = self.worker_thread.submit(
                self._run_turn, session, lambda: make(session, params), self._turn
            )
        except Exception as e:  # noqa: BLE001
            self.generating = False
            self._error(e, "Send")

    async def _reply_to_regenerate(self) -> ChatMessage:
        """The widget the regenerated reply streams into: the last reply, emptied (a new one after a
        last user message that has none)."""
        shown = self._branch_widgets()
        if shown and shown[-1].role == "assistant":
            await shown[-1].restart()
            return shown[-1]
        return await self._add_message("assistant", "")

    async def _reply_to_edit(self, message_id: int, text: str) -> ChatMessage:
        """The edited message shows its new text, what followed it goes, and its reply streams below."""
        shown = self._branch_widgets()
        at = next((i for i, w in enumerate(shown) if w.message_id == message_id), None)
        if at is None:  # not shown (an id of another branch): the view is redrawn when the turn ends
            await self._add_message("user", text)
        else:
            children = list(self.query_one("#chat", VerticalScroll).children)
            for w in children[children.index(shown[at]) + 1 :]:  # everything after it, notes included
                await w.remove()
            await shown[at].restart(text)
        return await self._add_message("assistant", "")

    def _run_turn(self, session, make, turn: int) -> None:
        """On the engine thread: stream the turn ``make()``, posting pieces; Esc (the cancel flag) closes the stream."""
        reply = usage = error = None
        interrupted = False
        gen = None
        try:
            gen = make()
            for piece in gen:
                if isinstance(piece, Reply):
                    reply = piece
                    break
                if piece:
                    self._push_piece(turn, piece)
                if self._cancel.is_set():
                    interrupted = True
                    break
        except Exception as e:  # noqa: BLE001 - reported as a notification by TurnDone
            error = str(e) if isinstance(e, ChatKVError) else f"{type(e).__name__}: {e}"
        finally:
            if gen is not None:
                try:
                    gen.close()  # the SDK keeps what was produced, marked interrupted
                except Exception as e:  # noqa: BLE001
                    error = error or f"{type(e).__name__}: {e}"
        if reply is not None:
            usage = reply.usage
            interrupted = interrupted or reply.finish_reason == "aborted"
        else:
            try:
                msgs = session.messages()
                if msgs and msgs[-1].role == "assistant":
                    usage = Usage.from_message(msgs[-1])
                    interrupted = interrupted or msgs[-1].status == "interrupted"
            except Exception:  # noqa: BLE001
                pass
        try:
            self._kv = self.engine.kv_stats()
        except Exception:  # noqa: BLE001
            pass
        self.post_message(TurnDone(turn, reply, usage, interrupted, error))

    def _push_piece(self, turn: int, piece: str) -> None:
        """On the engine thread: buffer the piece; post a message only if the UI took the last one,
        so a fast model never floods the message queue (the UI takes everything buffered at once)."""
        with self._pieces_lock:
            self._pieces.append(piece)
            if self._piece_posted:
                return
            self._piece_posted = True
        self.post_message(Piece(turn, "", time.perf_counter()))

    def _take_pieces(self) -> str:
        with self._pieces_lock:
            text = "".join(self._pieces)
            self._pieces.clear()
            self._piece_posted = False
        return text

    async def on_piece(self, msg: Piece) -> None:
        text = safe_text(self._take_pieces())
        if msg.turn != self._turn or self._stream is None or self._reply_widget is None or not text:
            return
        self._reply_widget.text += text
        await self._stream.write(text)
        if "first_piece" not in self.turn_timing:
            self.turn_timing["first_piece"] = msg.at
            self.turn_timing["first_shown"] = time.perf_counter()
        self.query_one("#chat", VerticalScroll).scroll_end(animate=False)

    async def on_turn_done(self, msg: TurnDone) -> None:
        if msg.turn != self._turn:
            return
        if self._quitting:
            if self._stream is not None:
                await self._stream.stop()
                self._stream = None
            self.generating = False
            return
        rest = safe_text(self._take_pieces())
        if rest and self._stream is not None and self._reply_widget is not None:
            self._reply_widget.text += rest
            await self._stream.write(rest)
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        w = self._reply_widget
        self._reply_widget = None
        self.turn_timing["done"] = time.perf_counter()
        if msg.usage is not None:
            self.last_usage = msg.usage
            self.turn_timing["sdk_ttft"] = msg.usage.ttft_s
        if w is not None:
            if msg.interrupted:
                w.mark_interrupted()
            if msg.reply is not None and msg.reply.sources:
                w.show_sources([s.as_json() if hasattr(s, "as_json") else dict(s) for s in msg.reply.sources])
        ctx = getattr(msg.reply, "context", None)
        if ctx is not None and ctx.dropped_tokens:  # the conversation outgrew the context: say what moved
            self.notify(safe_text(ctx.summary()), title="Context", timeout=6)
        calls = self._calls_to_run(msg.reply, msg.interrupted, msg.error)  # MCP tools: tui/tool_turns.py
        self.generating = bool(calls)  # held through the tool round that follows
        self._turn_future = None
        if msg.error:
            self._error(msg.error, "Reply")
        await self._sync_branch_view()  # the stored ids and versions of what is shown (redrawn if it differs)
        self._update_status()
        await self._refresh_sidebar()
        if calls:
            self.run_worker(self._tool_round(w, msg.reply), exclusive=False)

    def action_cancel(self) -> None:
        self._cancel.set()

    async def _wait_turn(self) -> None:
        fut = self._turn_future
        if fut is not None:
            await asyncio.wrap_future(fut)
