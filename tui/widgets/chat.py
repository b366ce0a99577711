"""The chat view's widgets: one message (Markdown, its sources, its branch switcher), the input box
(with its edit mode), the status line."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from chatkv.tui.widgets.titles import one_line, safe_text


class BranchSwitcher(Horizontal):
    """``◀ 2/3 ▶`` under a message that has other versions: the arrows ask for the previous or
    next version (``ChatMessage.Branch``), the app switches to it."""

    def __init__(self, **kw):
        super().__init__(classes="branches", **kw)
        self.prev = Static("◀", classes="branch-prev")
        self.label = Static("", classes="branch-label")
        self.next = Static("▶", classes="branch-next")

    def compose(self):
        yield self.prev
        yield self.label
        yield self.next

    def show(self, position: int, count: int) -> None:
        """``position`` (0-based) of ``count`` versions; hidden when there is only one."""
        self.display = count > 1
        self.label.update(f" {position + 1}/{count} ")
        self.prev.set_class(position == 0, "disabled")
        self.next.set_class(position >= count - 1, "disabled")

    def on_click(self, event: events.Click) -> None:
        step = -1 if event.widget is self.prev else 1 if event.widget is self.next else 0
        if step:
            event.stop()
            msg = self.parent
            if isinstance(msg, ChatMessage):
                self.post_message(ChatMessage.Branch(msg, step))


class ChatMessage(Vertical, can_focus=True):
    """One message: a header (who, and whether it was interrupted), its Markdown, its sources, and
    (when it has other versions) a branch switcher. ``message_id`` is its stored id (None: not
    stored yet); ``versions`` the ids of its siblings, itself included, oldest first."""

    BINDINGS = [
        Binding("c", "copy", "Copy message"),
        Binding("e", "edit", "Edit message"),
        Binding("left", "branch(-1)", "Previous version"),
        Binding("right", "branch(1)", "Next version"),
    ]

    @dataclass
    class Branch(Message):
        """Show the version ``step`` (-1, 1) away from this message's."""

        message: "ChatMessage"
        step: int

    @dataclass
    class Edit(Message):
        """Edit this (user) message in the input box."""

        message: "ChatMessage"

    def __init__(
        self,
        role: str,
        text: str = "",
        *,
        interrupted: bool = False,
        sources: list | None = None,
        message_id: int | None = None,
        versions: list[int] | None = None,
        **kw,
    ):
        super().__init__(classes=f"message {role}", **kw)
        self.role = role
        self.text = safe_text(text)
        self.interrupted = interrupted
        self.sources: list[dict] = list(sources or [])
        self.message_id = message_id
        self.versions: list[int] = list(versions or [])
        self.body = Markdown(self.text, classes="body")
        self.header = Static(self._header_text(), classes="header")
        self.sources_line = Static("", classes="sources")
        self.switcher = BranchSwitcher()

    def _header_text(self) -> Text:
        names = {"user": "You", "assistant": "Assistant", "note": "chatkv"}
        t = Text(names.get(self.role, self.role), style="bold")
        if self.interrupted:
            t.append("  (interrupted)", style="italic")
        return t

    def compose(self):
        yield self.header
        yield self.body
        yield self.sources_line
        yield self.switcher

    def on_mount(self) -> None:
        self.show_sources(self.sources)
        self.set_versions(self.message_id, self.versions)

    def mark_interrupted(self) -> None:
        self.interrupted = True
        self.header.update(self._header_text())

    async def restart(self, text: str = "") -> None:
        """Empty the message for a reply streamed into it again (regenerate) or new text (edit)."""
        self.text, self.interrupted, self.message_id, self.versions = safe_text(text), False, None, []
        self.header.update(self._header_text())
        self.show_sources([])
        self.switcher.display = False
        await self.body.update(self.text)

    def set_versions(self, message_id: int | None, versions: list[int]) -> None:
        """Its stored id and its versions' ids; the switcher shows where it is among them."""
        self.message_id, self.versions = message_id, list(versions)
        if message_id in self.versions:
            self.switcher.show(self.versions.index(message_id), len(self.versions))
        else:
            self.switcher.display = False
        if self.is_mounted:
            self.refresh_bindings()  # the footer's Left/Right follow the versions

    def check_action(self, action: str, parameters) -> bool | None:
        if action == "branch":  # Left/Right only where there is another version (and only then in the footer)
            return len(self.versions) > 1
        return True

    def action_edit(self) -> None:
        self.post_message(self.Edit(self))

    def action_branch(self, step: int) -> None:
        self.post_message(self.Branch(self, step))

    def show_sources(self, sources: list[dict]) -> None:
        """List the reply's sources under it; each opens in the sources panel when clicked."""
        self.sources = list(sources)
        self.sources_line.display = bool(self.sources)
        if not self.sources:
            return
        parts = ["[b]Sources:[/b]"]
        for s in self.sources:
            label = one_line(s.get("source", "?"), 40)
            if s.get("heading"):
                label += " › " + one_line(s["heading"], 30)
            label = label.replace("[", r"\[")
            parts.append(
                f"[@click=app.open_source('{self.id}',{int(s.get('number', 0))})]"
                f"\\[{int(s.get('number', 0))}] {label}[/]"
            )
        self.sources_line.update("  ".join(parts))

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("Message copied to the clipboard.", timeout=2)


EDITING = "Editing your message · Enter sends a new version · Esc leaves"


class ChatInput(TextArea):
    """The message box: Enter sends, Shift+Enter or Ctrl+J adds a line, Up/Down recall earlier inputs.

    Edit mode: Up on an empty box asks ``editable()`` (the app's last user message of the branch
    shown: its stored id and text, or None) and puts that message into the box, marked; Enter then
    sends it as an edit of that message (``Submitted.edit_of``), Esc leaves edit mode."""

    @dataclass
    class Submitted(Message):
        text: str
        edit_of: int | None = None  # the stored id of the user message this edits (None: a new message)

    def __init__(self, editable=None, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.inputs: list[str] = []
        self._recall: int | None = None  # index into history while recalling
        self.editable = editable  # () -> (message_id, text) | None
        self.edit_of: int | None = None

    def start_edit(self, message_id: int, text: str) -> None:
        """Edit mode on the stored user message ``message_id``, its ``text`` in the box."""
        self.edit_of = message_id
        self.add_class("editing")
        self.border_title = EDITING
        self._show(text)
        self.focus()

    def stop_edit(self, clear: bool = True) -> None:
        if self.edit_of is None:
            return
        self.edit_of = None
        self.remove_class("editing")
        self.border_title = None
        if clear:
            self.clear()

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                if not self.inputs or self.inputs[-1] != text:
                    self.inputs.append(text)
                self._recall = None
                edit_of = self.edit_of
                self.stop_edit(clear=False)
                self.clear()
                self.post_message(self.Submitted(text, edit_of))
            return
        if event.key == "escape" and self.edit_of is not None:
            event.stop()
            event.prevent_default()
            self.stop_edit()
            return
        if event.key == "up" and not self.text and self.edit_of is None and self.editable is not None:
            last = self.editable()
            if last is not None:
                event.stop()
                event.prevent_default()
                self._recall = len(self.inputs)  # Up again recalls the inputs before it
                self.start_edit(*last)
                return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.inputs:
            event.stop()
            event.prevent_default()
            self.stop_edit(clear=False)  # an earlier input is a new message, not an edit
            self._recall = len(self.inputs) - 1 if self._recall is None else max(0, self._recall - 1)
            self._show(self.inputs[self._recall])
            return
        if event.key == "down" and self._recall is not None and self.cursor_location[0] == self.document.line_count - 1:
            event.stop()
            event.prevent_default()
            self.stop_edit(clear=False)
            self._recall += 1
            if self._recall >= len(self.inputs):
                self._recall = None
                self._show("")
            else:
                self._show(self.inputs[self._recall])
            return
        await super()._on_key(event)

    def _show(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)


class StatusLine(Static):
    """Context used, KV pool usage, and this turn's cache figures."""
