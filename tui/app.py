"""The chatkv terminal app (Textual): saved conversations, streaming Markdown replies,
knowledge bases, and live cache figures.

Threads: the SDK is synchronous and single-threaded, so every engine call runs on one
thread, ``EngineThread`` (a one-worker executor). The UI awaits its futures from async
workers (never blocking the message loop); a streaming turn posts its pieces back with
``post_message`` (thread-safe, non-blocking) and stops when Esc sets the cancel flag
(closing the SDK's stream keeps what was produced, marked interrupted).
The app calls only the public SDK.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Label, Markdown, ProgressBar

from chatkv.errors import ChatKVError
from chatkv.outputs import Reply, Usage
from chatkv.sampling import SamplingParams
from chatkv.tui.screens.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SettingsScreen
from chatkv.tui.widgets.chat import ChatInput, ChatMessage, StatusLine
from chatkv.tui.widgets.sidebar import Sidebar
from chatkv.tui.widgets.sources import SourcesPanel
from chatkv.tui.widgets.text import one_line, safe_text, status_text

EXPORT_FORMATS = {"md": ("markdown", "md"), "markdown": ("markdown", "md"), "json": ("json", "json")}


class EngineThread:
    """The one thread that calls the engine: every call is serialised through it."""

    def __init__(self):
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatkv-engine")

    def submit(self, fn, *args, **kw) -> Future:
        return self._ex.submit(fn, *args, **kw)

    async def call(self, fn, *args, **kw):
        return await asyncio.wrap_future(self._ex.submit(fn, *args, **kw))

    closed = False

    def shutdown(self) -> None:
        self.closed = True
        self._ex.shutdown(wait=True)


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


@dataclass
class Notice(Message):
    text: str
    severity: str


class _NotifyHandler(logging.Handler):
    """chatkv's warnings become notifications instead of lines written over the screen."""

    def __init__(self, app: "ChatApp"):
        super().__init__(logging.WARNING)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.app.post_message(Notice(safe_text(record.getMessage()), "warning"))
        except Exception:  # never let logging break a turn
            pass


class ChatApp(App):
    """The chat app. Pass ``engine=`` (already loaded; the app never closes it) or ``model=``/``data_dir=``
    (loaded on start with a progress indicator, closed on exit)."""

    CSS_PATH = str(Path(__file__).with_name("chatkv.tcss"))  # absolute: subclasses elsewhere keep it
    TITLE = "chatkv"
    BINDINGS = [
        Binding("escape", "cancel", "Stop reply", priority=True),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, *, engine=None, model: str | None = None, data_dir: str | None = None,
                 resume: str | None = None, system: str | None = None, kb: str | None = None,
                 sampling: dict | None = None, mask_volatile: bool = False):
        super().__init__()
        self.engine = engine
        self._owns_engine = engine is None
        self.model_path, self.data_dir, self.resume_id = model, data_dir, resume
        self.system = system
        self.kb_name = kb
        self.documents: list[str] = []
        self.params: dict = dict(sampling or {})
        self.mask_volatile = mask_volatile
        self.session = None
        self.worker_thread = EngineThread()
        self.generating = False
        self._cancel = threading.Event()
        self._turn = 0
        self._turn_future: Future | None = None
        self._reply_widget: ChatMessage | None = None
        self._stream = None
        self._pieces: list[str] = []
        self._pieces_lock = threading.Lock()
        self._piece_posted = False
        self.last_usage: Usage | None = None
        self.turn_timing: dict = {}
        self.clipboard_text = ""
        self._msg_ids = 0
        self._log_handler = _NotifyHandler(self)
        self.exit_code = 0
        self._quitting = False

    # -- layout ---------------------------------------------------------------

    def compose(self):
        with Horizontal(id="body"):
            yield Sidebar(mask=self.mask_volatile, id="sidebar")
            with Vertical(id="main"):
                with Vertical(id="loading"):
                    yield Label("Loading the model…", id="loading-label")
                    yield ProgressBar(total=None, show_eta=False, id="loading-bar")
                yield VerticalScroll(id="chat")
                with Vertical(id="ingest"):
                    yield Label("", id="ingest-label")
                    yield ProgressBar(total=None, show_eta=False, id="ingest-bar")
                yield ChatInput(id="input")
            yield SourcesPanel(id="sources")
        yield StatusLine("", id="status")
        yield Footer()

    async def on_mount(self) -> None:
        logging.getLogger("chatkv").addHandler(self._log_handler)
        self.query_one("#sources").display = False
        self.query_one("#ingest").display = False
        box = self.query_one(ChatInput)
        if self.mask_volatile:
            box.cursor_blink = False  # steady screens for snapshots
        box.focus()
        self.run_worker(self._start(), exclusive=False)

    async def _start(self) -> None:
        if self.engine is None:
            self.query_one("#input").disabled = True
            label = self.model_path or "the default model (converted on first use)"
            self.query_one("#loading-label", Label).update(f"Loading {safe_text(str(label))}…")
            kw = {"data_dir": self.data_dir} if self.data_dir else {}
            try:
                from chatkv.engine import Engine

                self.engine = await self.worker_thread.call(Engine.from_pretrained, self.model_path, **kw)
            except Exception as e:  # noqa: BLE001 - any load failure is a message, never a traceback
                self.query_one("#loading-label", Label).update(f"The model could not be loaded: {safe_text(str(e))}")
                self.query_one("#loading-bar").display = False
                self.notify(safe_text(str(e)), title="Model", severity="error", timeout=10)
                self.exit_code = 1
                return
            self.query_one("#input").disabled = False
            self.query_one(ChatInput).focus()
        self.query_one("#loading").display = False
        if self.resume_id:
            await self._open(self.resume_id)
        else:
            await self._refresh_sidebar()
        await self._refresh_status()

    # -- engine calls ---------------------------------------------------------

    async def _call(self, fn, *args, what: str = "", **kw):
        """Run ``fn`` on the engine thread; a failure becomes an error notification and returns None."""
        try:
            return await self.worker_thread.call(fn, *args, **kw)
        except Exception as e:  # noqa: BLE001 - errors are notifications, never tracebacks
            self._error(e, what)
            return None

    def _error(self, e: BaseException | str, what: str = "") -> None:
        text = safe_text(str(e)) or type(e).__name__
        if not isinstance(e, (ChatKVError, OSError, str)):
            text = f"{type(e).__name__}: {text}"
        self.notify(text, title=what or "Error", severity="error", timeout=8)

    def _can_act(self, action: str = "that") -> bool:
        if self.engine is None:
            self.notify("No model is loaded yet.", severity="warning")
            return False
        if self.generating:
            self.notify(f"A reply is being generated; press Esc to stop it before {action}.", severity="warning")
            return False
        return True

    async def _refresh_sidebar(self) -> None:
        if self.engine is None or self._quitting:
            return
        convs = await self._call(self.engine.sessions, what="Conversations")
        if convs is not None:
            await self.query_one(Sidebar).show(convs, self.session.id if self.session else None)

    def _update_status(self) -> None:
        if self.engine is None:
            return
        # kv_stats reads a few counters; it runs on the UI thread only while no engine call is
        # in flight, otherwise the figures come from the engine thread with the turn's end.
        ctx = len(self.session.tokens) if self.session is not None else 0
        kv = self._kv if hasattr(self, "_kv") else None
        self.query_one(StatusLine).update(status_text(ctx, self.engine.max_context, kv, self.last_usage, self.mask_volatile))

    async def _refresh_status(self) -> None:
        if self.engine is not None:
            kv = await self._call(self.engine.kv_stats, what="KV stats")
            if kv is not None:
                self._kv = kv
        self._update_status()

    # -- chat view --------------------------------------------------------------

    def _new_id(self) -> str:
        self._msg_ids += 1
        return f"msg-{self._msg_ids}"

    async def _add_message(self, role: str, text: str, **kw) -> ChatMessage:
        w = ChatMessage(role, text, id=self._new_id(), **kw)
        chat = self.query_one("#chat", VerticalScroll)
        await chat.mount(w)
        chat.scroll_end(animate=False)
        return w

    async def note(self, text: str) -> ChatMessage:
        """A line from the app itself in the chat view (not saved with the conversation)."""
        return await self._add_message("note", text)

    async def _clear_chat(self) -> None:
        await self.query_one("#chat", VerticalScroll).remove_children()
        self.query_one("#sources").display = False

    async def _show_history(self) -> None:
        msgs = await self._call(self.session.messages, what="Messages") or []
        await self._clear_chat()
        widgets = []
        for m in msgs:
            if m.role not in ("user", "assistant"):
                continue
            sources = (m.meta or {}).get("sources") or [] if m.role == "assistant" else []
            widgets.append(ChatMessage(m.role, m.content, interrupted=m.status == "interrupted",
                                       sources=sources, id=self._new_id()))
        chat = self.query_one("#chat", VerticalScroll)
        if widgets:
            await chat.mount_all(widgets)
        chat.scroll_end(animate=False)

    # -- turns ----------------------------------------------------------------

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text
        if text.strip().startswith("/"):
            await self.run_command(text.strip())
        else:
            self.send(text)

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
            await self._add_message("user", text)
            self._reply_widget = await self._add_message("assistant", "")
            self._stream = Markdown.get_stream(self._reply_widget.body)
            self._turn += 1
            self._cancel.clear()
            self.turn_timing = {"sent": t_sent}
            self.query_one(StatusLine).update("generating…  (Esc stops)")
            self._turn_future = self.worker_thread.submit(self._run_turn, self.session, text, params, self._turn)
        except Exception as e:  # noqa: BLE001
            self.generating = False
            self._error(e, "Send")

    def _run_turn(self, session, text: str, params, turn: int) -> None:
        """On the engine thread: stream the turn, posting pieces; Esc (the cancel flag) closes the stream."""
        reply = usage = error = None
        interrupted = False
        gen = None
        try:
            gen = session.stream(text, params)
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
        self.generating = False
        self._turn_future = None
        if msg.error:
            self._error(msg.error, "Reply")
        self._update_status()
        await self._refresh_sidebar()

    def on_notice(self, msg: Notice) -> None:
        self.notify(msg.text, severity=msg.severity, timeout=6)

    def action_cancel(self) -> None:
        self._cancel.set()

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "cancel":
            return self.generating  # otherwise Esc goes on to the focused widget or dialog
        return True

    async def _wait_turn(self) -> None:
        fut = self._turn_future
        if fut is not None:
            await asyncio.wrap_future(fut)

    # -- conversations ------------------------------------------------------------

    async def _close_session(self) -> None:
        if self.session is not None:
            s, self.session = self.session, None
            await self._call(s.close, what="Close")

    async def new_chat(self, note: str | None = None) -> None:
        if not self._can_act("starting a new chat"):
            return
        await self._close_session()
        self.last_usage = None
        await self._clear_chat()
        if note:
            await self.note(note)
        await self._refresh_sidebar()
        await self._refresh_status()
        self.query_one(ChatInput).focus()

    async def _open(self, conv_id: str) -> None:
        if not self._can_act("opening another conversation"):
            return
        if self.session is not None and self.session.id == conv_id:
            return
        if conv_id == "latest":
            convs = await self._call(self.engine.sessions, what="Conversations") or []
            if not convs:
                self.notify("There is no saved conversation yet; this is a new chat.", severity="information")
                await self._refresh_sidebar()
                return
            conv_id = convs[0].id
        await self._close_session()
        s = await self._call(self.engine.resume, conv_id, what="Open")
        if s is None:
            await self._refresh_sidebar()
            return
        self.session = s
        self.system = s.system
        self.params = dict(s.params)
        self.kb_name = s.knowledge.name if getattr(s, "knowledge", None) is not None else None
        self.documents = list(getattr(s, "documents", []) or [])
        self.last_usage = None
        await self._show_history()
        await self._refresh_sidebar()
        await self._refresh_status()
        self.query_one(ChatInput).focus()

    @on(Sidebar.Open)
    def _sidebar_open(self, msg: Sidebar.Open) -> None:
        self.run_worker(self._open(msg.conv_id))

    @on(Sidebar.Act)
    def _sidebar_act(self, msg: Sidebar.Act) -> None:
        if msg.what == "new":
            self.run_worker(self.new_chat())
        elif msg.conv_id is None:
            self.notify("Select a conversation first.", severity="warning")
        else:
            self.run_worker(self.manage(msg.what, msg.conv_id, msg.title))

    async def manage(self, what: str, conv_id: str, title: str | None = None, new_title: str | None = None) -> None:
        """Rename, archive or delete a saved conversation (delete asks first)."""
        if not self._can_act(f"{what}"):
            return
        if what == "rename" and new_title is None:
            new_title = await self.push_screen_wait(PromptScreen("New title:", title or ""))
            if not new_title or not new_title.strip():
                return
        if what == "delete":
            ok = await self.push_screen_wait(ConfirmScreen(f"Delete “{one_line(title, 40)}” and its messages?"))
            if not ok:
                return
        current = self.session is not None and self.session.id == conv_id

        def run():
            s = self.session if current else self.engine.resume(conv_id)
            if what == "rename":
                s.rename(new_title.strip())
            elif what == "archive":
                s.archive(True)
            elif what == "delete":
                s.delete()
                return True
            if not current:
                s.close()
            return True

        if not await self._call(run, what=what.capitalize()):
            await self._refresh_sidebar()
            return
        if current and what == "delete":
            self.session = None
            self.last_usage = None
            await self._clear_chat()
        elif current and what == "archive":
            await self._close_session()
            await self._clear_chat()
        self.notify({"rename": "Renamed.", "archive": "Archived.", "delete": "Deleted."}[what], timeout=2)
        await self._refresh_sidebar()

    # -- slash commands -----------------------------------------------------------

    async def run_command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        handler = getattr(self, f"cmd_{name.lower()}", None)
        if handler is None:
            self.notify(f"Unknown command '/{safe_text(name)}'; /help lists them.", severity="error")
            return
        try:
            await handler(arg)
        except Exception as e:  # noqa: BLE001 - never a traceback on screen
            self._error(e, f"/{name}")

    async def cmd_help(self, arg: str) -> None:
        self.push_screen(HelpScreen())

    async def cmd_new(self, arg: str) -> None:
        await self.new_chat()

    async def cmd_system(self, arg: str) -> None:
        if not self._can_act("changing the system prompt"):
            return
        self.system = arg or None
        await self.new_chat(f"New chat with system prompt: {arg}" if arg else "New chat without a system prompt.")

    async def cmd_settings(self, arg: str) -> None:
        self.action_settings()

    async def cmd_model(self, arg: str) -> None:
        if not arg:
            self.notify("Usage: /model PATH (a local Hugging Face model directory)", severity="warning")
            return
        if self.generating:
            self.notify("A reply is being generated; press Esc first.", severity="warning")
            return
        from chatkv.engine import Engine

        data_dir = self.data_dir or (getattr(self.engine.config, "data_dir", None) if self.engine else None)
        kw = {"data_dir": data_dir} if data_dir else {}
        self.query_one("#loading").display = True
        self.query_one("#loading-label", Label).update(f"Loading {safe_text(arg)}…")
        try:
            engine = await self._call(Engine.from_pretrained, arg, what="Model", **kw)
        finally:
            self.query_one("#loading").display = False
        if engine is None:
            return
        await self._close_session()
        old, self.engine = self.engine, engine
        if old is not None and self._owns_engine:
            await self._call(old.close, what="Model")
        self._owns_engine = True
        self.model_path = arg
        await self.new_chat(f"Loaded model {arg}.")

    async def cmd_kb(self, arg: str) -> None:
        if not arg:
            self.notify(f"Knowledge base: {self.kb_name or 'none'}. Usage: /kb NAME", severity="information")
            return
        if not self._can_act("attaching a knowledge base"):
            return
        kb = await self._call(self.engine.knowledge_base, arg, what="Knowledge base")
        if kb is None:
            return
        docs = await self._call(kb.documents, what="Knowledge base") or []
        self.kb_name, self.documents = arg, []
        await self.new_chat(f"New chat over knowledge base **{arg}** ({len(docs)} documents).")

    async def cmd_ingest(self, arg: str) -> None:
        if not arg:
            self.notify("Usage: /ingest PATH (files or a directory)", severity="warning")
            return
        if not self._can_act("ingesting"):
            return
        name = self.kb_name or "default"
        kb = await self._call(self.engine.knowledge_base, name, what="Knowledge base")
        if kb is None:
            return
        box = self.query_one("#ingest")
        self.query_one("#ingest-label", Label).update(f"Ingesting {safe_text(arg)} into {name}…")
        box.display = True
        try:
            report = await self._call(kb.add, [arg], progress=False, what="Ingest")
        finally:
            box.display = False
        if report is None:
            return
        lines = [f"Ingested into **{name}**: {safe_text(report.summary())}"]
        for err in report.skipped:
            lines.append(f"- skipped `{safe_text(str(err.source))}`: {safe_text(str(err.reason))}")
            self.notify(f"{safe_text(str(err.source))}: {safe_text(str(err.reason))}", title="Skipped", severity="warning")
        if self.kb_name is None:
            lines.append("Use `/kb default` to chat over it.")
        await self.note("\n".join(lines))

    async def cmd_pin(self, arg: str) -> None:
        if not arg:
            pinned = ", ".join(self.documents) or "none"
            self.notify(f"Pinned documents: {safe_text(pinned)}. Usage: /pin SOURCE", severity="information")
            return
        if not self.kb_name:
            self.notify("Attach a knowledge base first: /kb NAME", severity="warning")
            return
        if not self._can_act("pinning"):
            return
        kb = await self._call(self.engine.knowledge_base, self.kb_name, what="Knowledge base")
        docs = await self._call(kb.documents, what="Knowledge base") if kb is not None else None
        if docs is None:
            return
        sources = [d.source for d in docs]
        if arg not in sources:
            self.notify(f"'{safe_text(arg)}' is not a document of {self.kb_name}.", severity="error")
            return
        if arg not in self.documents:
            self.documents.append(arg)
        await self.new_chat(f"New chat over **{self.kb_name}** with pinned: {', '.join(self.documents)}.")

    async def cmd_sources(self, arg: str) -> None:
        for w in reversed(list(self.query(ChatMessage))):
            if w.role == "assistant" and w.sources:
                await self.query_one(SourcesPanel).show(w.sources)
                return
        self.notify("The last replies have no sources (attach a knowledge base with /kb NAME).", severity="information")

    async def cmd_regenerate(self, arg: str) -> None:
        if not self._can_act("regenerating") or self.session is None:
            if self.session is None:
                self.notify("Nothing to regenerate yet.", severity="warning")
            return
        msgs = await self._call(self.session.messages, what="Regenerate") or []
        users = [m.content for m in msgs if m.role == "user"]
        if not users:
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        # TODO(SDK): the SDK's history is append-only, so this asks the last question again as a new
        # turn; replacing the last reply in place needs e.g. session.regenerate() / truncate(message_id).
        self.send(users[-1])

    async def cmd_export(self, arg: str) -> None:
        fmt, _, path = arg.partition(" ")
        if fmt.lower() not in EXPORT_FORMATS:
            self.notify("Usage: /export md|json [PATH]", severity="warning")
            return
        if self.session is None:
            self.notify("Nothing to export yet: send a message first.", severity="warning")
            return
        sdk_fmt, ext = EXPORT_FORMATS[fmt.lower()]
        text = await self._call(self.session.export, sdk_fmt, what="Export")
        if text is None:
            return
        target = Path(path.strip()).expanduser() if path.strip() else Path.cwd() / f"chatkv-{self.session.id[:8]}.{ext}"
        try:
            target.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        except OSError as e:
            self._error(e, "Export")
            return
        self.notify(f"Exported to {target}", title="Export", timeout=4)

    async def cmd_stats(self, arg: str) -> None:
        if self.engine is None:
            return
        kv = await self._call(self.engine.kv_stats, what="Stats") or {}
        msgs = await self._call(self.session.messages, what="Stats") if self.session else []
        rows = ["| turn | prompt | cached | restored | computed | generated | TTFT ms | tok/s |", "|---|---|---|---|---|---|---|---|"]
        n = 0
        for m in msgs or []:
            u = Usage.from_message(m) if m.role == "assistant" else None
            if u is None:
                continue
            n += 1
            ttft, tps = ("--", "--") if self.mask_volatile else (f"{u.ttft_s * 1000:.0f}", f"{u.tokens_per_s:.1f}")
            rows.append(f"| {n} | {u.prompt_tokens} | {u.cached_tokens} | {u.restored_tokens} | {u.computed_tokens} "
                        f"| {u.generated_tokens} | {ttft} | {tps} |")
        if n == 0:
            rows = ["*No turns in this conversation yet.*"]
        kv_line = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in kv.items())
        await self.note("**Turns**\n\n" + "\n".join(rows) + f"\n\n**KV pool**: {kv_line}")
        self._kv = kv or getattr(self, "_kv", None)
        self._update_status()

    # -- actions (keys and the command palette) ---------------------------------------

    def action_new_chat(self) -> None:
        self.run_worker(self.new_chat())

    def action_toggle_sidebar(self) -> None:
        sb = self.query_one(Sidebar)
        sb.display = not sb.display

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_settings(self) -> None:
        self.run_worker(self._settings())

    async def _settings(self) -> None:
        out = await self.push_screen_wait(SettingsScreen(self.params.get("temperature"), self.params.get("max_tokens"), self.system))
        if out is None:
            return
        params = dict(self.params)
        for key in ("temperature", "max_tokens"):
            if key in out:
                params[key] = out[key]
            else:
                params.pop(key, None)
        try:
            SamplingParams.from_dict(params).validate()
        except (ChatKVError, TypeError, ValueError) as e:
            self._error(e, "Settings")
            return
        self.params = params
        if self.session is not None:  # saved with the conversation: a resume gets them back
            changes = {key: params.get(key) for key in ("temperature", "max_tokens")}  # None removes one
            await self._call(self.session.update_params, what="Settings", **changes)
        if out.get("system") != self.system:
            self.system = out.get("system")
            await self.new_chat("System prompt changed: a new chat started with it.")
        else:
            self.notify("Settings saved for this chat.", timeout=2)

    def action_copy_last(self) -> None:
        for w in reversed(list(self.query(ChatMessage))):
            if w.role == "assistant":
                w.action_copy()
                return
        self.notify("No reply to copy yet.", severity="warning")

    def copy_to_clipboard(self, text: str) -> None:
        self.clipboard_text = text
        super().copy_to_clipboard(text)

    async def action_open_source(self, widget_id: str, number: int) -> None:
        try:
            w = self.query_one(f"#{widget_id}", ChatMessage)
        except Exception:  # noqa: BLE001
            return
        await self.query_one(SourcesPanel).show(w.sources, focus=number)

    def _ask_then(self, question: str, command: str) -> None:
        async def flow():
            answer = await self.push_screen_wait(PromptScreen(question))
            if answer is not None and answer.strip():
                await self.run_command(f"/{command} {answer.strip()}")
        self.run_worker(flow())

    def _run(self, line: str) -> None:
        self.run_worker(self.run_command(line))

    def _manage_current(self, what: str) -> None:
        if self.session is None:
            self.notify("This chat is not saved yet.", severity="warning")
            return
        self.run_worker(self.manage(what, self.session.id, self.session.title))

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation (/new)", self.action_new_chat)
        yield SystemCommand("Regenerate", "Ask the last question again (/regenerate)", lambda: self._run("/regenerate"))
        yield SystemCommand("Sources", "Open the last reply's sources (/sources)", lambda: self._run("/sources"))
        yield SystemCommand("Stats", "Token counts and timings of each turn (/stats)", lambda: self._run("/stats"))
        yield SystemCommand("Export Markdown", "Write the chat to a .md file (/export md)", lambda: self._run("/export md"))
        yield SystemCommand("Export JSON", "Write the chat to a .json file (/export json)", lambda: self._run("/export json"))
        yield SystemCommand("Settings", "Temperature, max tokens, system prompt", self.action_settings)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard", self.action_copy_last)
        yield SystemCommand("System prompt…", "A new chat with a system prompt (/system TEXT)", lambda: self._ask_then("System prompt:", "system"))
        yield SystemCommand("Load model…", "Load a local model directory (/model PATH)", lambda: self._ask_then("Model directory:", "model"))
        yield SystemCommand("Knowledge base…", "Chat over a knowledge base (/kb NAME)", lambda: self._ask_then("Knowledge base name:", "kb"))
        yield SystemCommand("Ingest…", "Add files to the knowledge base (/ingest PATH)", lambda: self._ask_then("File or directory:", "ingest"))
        yield SystemCommand("Pin document…", "Pin a document of the knowledge base (/pin SOURCE)", lambda: self._ask_then("Document source:", "pin"))
        yield SystemCommand("Rename chat", "Rename this conversation", lambda: self._manage_current("rename"))
        yield SystemCommand("Archive chat", "Archive this conversation", lambda: self._manage_current("archive"))
        yield SystemCommand("Delete chat", "Delete this conversation", lambda: self._manage_current("delete"))
        yield SystemCommand("Help", "Keys and slash commands (/help)", self.action_help)

    # -- quitting -----------------------------------------------------------------

    def action_quit(self) -> None:
        """Stop a reply in progress (what was produced is saved), close the chat, then exit."""
        if not self._quitting:
            self.run_worker(self.quit_app(), group="quit")

    async def quit_app(self) -> None:
        self._quitting = True
        self._cancel.set()
        try:
            await self._wait_turn()
        except Exception:  # noqa: BLE001
            pass
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.generating = False
        await self.shutdown_engine()
        self.exit(self.exit_code)

    async def shutdown_engine(self) -> None:
        await self._close_session()
        if self._owns_engine and self.engine is not None:
            engine, self.engine = self.engine, None
            await self._call(engine.close, what="Close")

    def on_unmount(self) -> None:
        logging.getLogger("chatkv").removeHandler(self._log_handler)
        self._cancel.set()
        # any turn still running stops at its next piece; its partial reply is saved by the SDK
        def finish():
            if self.session is not None:
                try:
                    self.session.close()
                except Exception:  # noqa: BLE001
                    pass
            if self._owns_engine and self.engine is not None:
                try:
                    self.engine.close()
                except Exception:  # noqa: BLE001
                    pass
        if not self.worker_thread.closed:
            self.worker_thread.submit(finish)
            self.worker_thread.shutdown()


def run_app(*, model: str | None = None, data_dir: str | None = None, resume: str | None = None,
            system: str | None = None, kb: str | None = None, sampling: dict | None = None) -> int:
    """Open the chat app. resume: a conversation id, "latest", or None (new chat). Returns the exit code."""
    app = ChatApp(model=model, data_dir=data_dir, resume=resume or None, system=system, kb=kb, sampling=sampling)
    result = app.run()
    return result if isinstance(result, int) else app.exit_code
