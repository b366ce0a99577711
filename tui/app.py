"""The chatkv terminal app (Textual): saved conversations, streaming Markdown replies,
knowledge bases, and live cache figures.

Threads: the SDK is synchronous and single-threaded, so every engine call runs on one
thread, ``EngineThread`` (a one-worker executor). The UI awaits its futures from async
workers (never blocking the message loop); a streaming turn posts its pieces back with
``post_message`` (thread-safe, non-blocking) and stops when Esc sets the cancel flag
(closing the SDK's stream keeps what was produced, marked interrupted).
The app calls only the public SDK.

This module holds the app's layout, state, start-up, shared helpers, event routing and
quitting; the rest is mixed in: turns (tui/chat_turns.py), conversations (tui/conversations.py),
branches (the versions of a message, edit, switch: tui/branches.py), slash commands, actions and
the command palette (tui/commands.py); the engine thread is tui/engine_thread.py.

(Past 400 lines on purpose: what is left is the one App class the mixins share, its layout,
start-up and event routing; splitting it further would spread one object's state over files.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import App
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar

from chatkv.errors import ChatKVError
from chatkv.outputs import Usage
from chatkv.tui.branches import BranchesMixin
from chatkv.tui.chat_turns import TurnsMixin
from chatkv.tui.commands import CommandsMixin
from chatkv.tui.conversations import ConversationsMixin
from chatkv.tui.engine_thread import EngineThread
from chatkv.tui.screens.dialogs import ToolConfirmScreen
from chatkv.tui.tool_turns import ToolsMixin
from chatkv.tui.widgets.chat import ChatInput, ChatMessage, StatusLine
from chatkv.tui.widgets.sidebar import Sidebar
from chatkv.tui.widgets.sources import SourcesPanel
from chatkv.tui.widgets.titles import safe_text, status_text


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


class _ChatScreen(Screen):
    """The app's main screen. Its first focus is the message box, not the first focusable widget
    (the sidebar's filter): keys typed before the app has drawn, read from the terminal once it
    starts, land there. Dialogs keep Textual's own first focus."""

    AUTO_FOCUS = "#input"


class ChatApp(TurnsMixin, ToolsMixin, BranchesMixin, ConversationsMixin, CommandsMixin, App):
    """The chat app. Pass ``engine=`` (already loaded; the app never closes it) or ``model=``/``data_dir=``
    (loaded on start with a progress indicator, closed on exit). ``tool_choice``: the first step
    after each message with MCP tools ("auto"; "required" or a tool's name forces a call)."""

    CSS_PATH = str(Path(__file__).with_name("chatkv.tcss"))  # absolute: subclasses elsewhere keep it
    TITLE = "chatkv"
    BINDINGS = [
        Binding("escape", "cancel", "Stop reply", priority=True),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+b", "toggle_sidebar", "Sidebar"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+f", "search", "Search"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        *,
        engine=None,
        model: str | None = None,
        data_dir: str | None = None,
        resume: str | None = None,
        system: str | None = None,
        kb: str | None = None,
        sampling: dict | None = None,
        mask_volatile: bool = False,
        engine_options: dict | None = None,
        tool_choice="auto",
    ):
        super().__init__()
        self.tool_choice = tool_choice
        self.engine = engine
        self._owns_engine = engine is None
        self.model_path, self.data_dir, self.resume_id = model, data_dir, resume
        self.system = system
        self.kb_name = kb
        self.documents: list[str] = []
        self.params: dict = dict(sampling or {})
        self.engine_options: dict = dict(
            engine_options or {}
        )  # Engine.from_pretrained options (overflow, context_window)
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
        self._early: list[str] = []  # messages sent while the model loads: answered once it has
        self._loading = False

    # -- layout ---------------------------------------------------------------

    def get_default_screen(self) -> Screen:
        return _ChatScreen(id="_default")

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
                yield ChatInput(editable=self._editable, id="input")
            yield SourcesPanel(id="sources")
        yield StatusLine("", id="status")
        yield Footer()

    async def on_mount(self) -> None:
        logging.getLogger("chatkv").addHandler(self._log_handler)
        self.query_one("#sources").display = False
        self.query_one("#ingest").display = False
        self.query_one(ChatInput).focus()
        self._loading = self.engine is None  # from the first frame: what is typed waits for the model
        self.run_worker(self._start(), exclusive=False)
        self.run_worker(self._start_mcp(), exclusive=False)  # mcp.json's servers, beside the model's loading

    def on_descendant_focus(self, event) -> None:
        # steady screens for snapshots: a focused box (the chat input, a dialog's fields) whose
        # cursor blinks is drawn with or without it depending on how long the screenshot took
        if self.mask_volatile and hasattr(event.widget, "cursor_blink"):
            event.widget.cursor_blink = False

    async def _start(self) -> None:
        if self.engine is None:
            # the input box keeps the focus and takes messages while the model loads (a first run
            # converts it for up to a minute): they wait, and are answered once it is ready
            self._loading = True
            label = self.model_path or "the default model (converted on first use)"
            self.query_one("#loading-label", Label).update(f"Loading {safe_text(str(label))}…")
            kw = {"data_dir": self.data_dir} if self.data_dir else {}
            kw.update(self.engine_options)
            try:
                from chatkv import Engine

                self.engine = await self.worker_thread.call(
                    Engine.from_pretrained, self.model_path, progress=self._loading_progress, **kw
                )
            except Exception as e:  # noqa: BLE001 - any load failure is a message, never a traceback
                self.query_one("#loading-label", Label).update(f"The model could not be loaded: {safe_text(str(e))}")
                self.query_one("#loading-bar").display = False
                self.notify(safe_text(str(e)), title="Model", severity="error", timeout=10)
                self.exit_code = 1
                self._loading = False
                if self._early:  # nothing typed is lost: it goes back into the input box
                    box = self.query_one(ChatInput)
                    box.text = "\n\n".join(self._early + ([box.text] if box.text else []))
                    self._early.clear()
                return
        self.query_one("#loading").display = False
        if self.resume_id:
            await self._open(self.resume_id)
        else:
            await self._refresh_sidebar()
        await self._refresh_status()
        await self._send_early()

    def _loading_progress(self, done: int, total: int) -> None:
        """A first run's conversion, tensor by tensor (on the loading thread): the bar's percentage."""
        self.call_from_thread(self.query_one("#loading-bar", ProgressBar).update, total=total, progress=done)

    async def _send_early(self) -> None:
        """Answer, in order, the messages sent while the model loaded (and any sent meanwhile);
        then the input box sends as usual."""
        try:
            while self._early and not self._quitting:
                for note in list(self.query(".early-note")):
                    await note.remove()
                await self._dispatch(self._early.pop(0), wait=True)
        finally:
            self._loading = False

    async def _dispatch(self, text: str, wait: bool = False, edit_of: int | None = None) -> None:
        """A line from the input box: a slash command, a message, or (``edit_of``) the new text of
        that user message (``wait``: until it is answered)."""
        if text.strip().startswith("/"):
            await self.run_command(text.strip())
        elif edit_of is not None:
            self.edit(edit_of, text)
        elif wait:
            await self._send(text)
            while self.generating and not self._quitting:
                await asyncio.sleep(0.02)
        else:
            self.send(text)

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
        self.query_one(StatusLine).update(
            status_text(ctx, self.engine.context_window, kv, self.last_usage, self.mask_volatile)
        )

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

    # -- events (message handlers stay here: @on only registers on the App class itself) --

    @on(ChatInput.Submitted)
    async def _submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text
        if self._loading:
            self._early.append(text)
            note = await self.note(f"Waiting for the model to load; this will be sent then: {safe_text(text)[:80]}")
            note.add_class("early-note")
            return
        await self._dispatch(text, edit_of=event.edit_of)

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

    def on_notice(self, msg: Notice) -> None:
        self.notify(msg.text, severity=msg.severity, timeout=6)

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "cancel":  # otherwise Esc goes on to the focused widget or dialog (a tool call's: deny)
            return self.generating and not isinstance(self.screen, ToolConfirmScreen)
        return True

    def copy_to_clipboard(self, text: str) -> None:
        self.clipboard_text = text
        super().copy_to_clipboard(text)

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
        await self._close_mcp()
        await self.shutdown_engine()
        self.exit(self.exit_code)

    async def shutdown_engine(self) -> None:
        await self._close_session()
        if self._owns_engine and self.engine is not None:
            engine, self.engine = self.engine, None
            await self._call(engine.close, what="Close")

    async def on_unmount(self) -> None:
        logging.getLogger("chatkv").removeHandler(self._log_handler)
        self._cancel.set()
        await self._close_mcp()  # each MCP server's process is stopped (quitting did it already)

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


def run_app(
    *,
    model: str | None = None,
    data_dir: str | None = None,
    resume: str | None = None,
    system: str | None = None,
    kb: str | None = None,
    sampling: dict | None = None,
    engine_options: dict | None = None,
) -> int:
    """Open the chat app. resume: a conversation id, "latest", or None (new chat). Returns the exit code."""
    app = ChatApp(
        model=model,
        data_dir=data_dir,
        resume=resume or None,
        system=system,
        kb=kb,
        sampling=sampling,
        engine_options=engine_options,
    )
    result = app.run()
    return result if isinstance(result, int) else app.exit_code
