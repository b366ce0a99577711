"""The chat view's widgets: one message (Markdown, its sources), the input box, the status line."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea

from chatkv.tui.widgets.titles import one_line, safe_text


class ChatMessage(Vertical, can_focus=True):
    """One message: a header (who, and whether it was interrupted), its Markdown, and its sources."""

    BINDINGS = [Binding("c", "copy", "Copy message")]

    def __init__(self, role: str, text: str = "", *, interrupted: bool = False, sources: list | None = None, **kw):
        super().__init__(classes=f"message {role}", **kw)
        self.role = role
        self.text = safe_text(text)
        self.interrupted = interrupted
        self.sources: list[dict] = list(sources or [])
        self.body = Markdown(self.text, classes="body")
        self.header = Static(self._header_text(), classes="header")
        self.sources_line = Static("", classes="sources")

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

    def on_mount(self) -> None:
        self.show_sources(self.sources)

    def mark_interrupted(self) -> None:
        self.interrupted = True
        self.header.update(self._header_text())

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
            parts.append(f"[@click=app.open_source('{self.id}',{int(s.get('number', 0))})]\\[{int(s.get('number', 0))}] {label}[/]")
        self.sources_line.update("  ".join(parts))

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("Message copied to the clipboard.", timeout=2)


class ChatInput(TextArea):
    """The message box: Enter sends, Shift+Enter or Ctrl+J adds a line, Up/Down recall earlier inputs."""

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.inputs: list[str] = []
        self._recall: int | None = None  # index into history while recalling

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                if not self.inputs or self.inputs[-1] != text:
                    self.inputs.append(text)
                self._recall = None
                self.clear()
                self.post_message(self.Submitted(text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.inputs:
            event.stop()
            event.prevent_default()
            self._recall = len(self.inputs) - 1 if self._recall is None else max(0, self._recall - 1)
            self._show(self.inputs[self._recall])
            return
        if event.key == "down" and self._recall is not None and self.cursor_location[0] == self.document.line_count - 1:
            event.stop()
            event.prevent_default()
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
