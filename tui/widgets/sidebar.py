"""The sidebar: saved conversations, newest activity first, with a filter box."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Input, Label, ListItem, ListView

from chatkv.tui.widgets.titles import one_line


class ConversationItem(ListItem):
    def __init__(self, info, mask: bool = False):
        super().__init__()
        self.conv_id = info.id
        self.title = info.title
        when = "--:--" if mask else info.updated_at.strftime("%d %b %H:%M")
        label = Text(one_line(info.title, 28))
        if info.archived:
            label.append(" (archived)", style="italic")
        self._label, self._when = label, when

    def compose(self):
        yield Label(self._label, classes="title")
        yield Label(self._when, classes="when")


class Sidebar(Vertical):
    """Emits Open/Action messages; the app does the engine work."""

    BINDINGS = [
        Binding("n", "act('new')", "New"),
        Binding("r", "act('rename')", "Rename"),
        Binding("a", "act('archive')", "Archive"),
        Binding("d,delete", "act('delete')", "Delete"),
    ]

    class Open(Message):
        def __init__(self, conv_id: str):
            super().__init__()
            self.conv_id = conv_id

    class Act(Message):
        def __init__(self, what: str, conv_id: str | None, title: str | None):
            super().__init__()
            self.what, self.conv_id, self.title = what, conv_id, title

    def __init__(self, mask: bool = False, **kw):
        super().__init__(**kw)
        self.mask = mask
        self.conversations: list = []

    def compose(self):
        yield Input(placeholder="Filter conversations", id="filter")
        yield ListView(id="conversations")

    async def show(self, conversations: list, current: str | None = None) -> None:
        self.conversations = list(conversations)
        await self._fill(current)

    async def _fill(self, current: str | None = None) -> None:
        needle = self.query_one("#filter", Input).value.strip().lower()
        lv = self.query_one("#conversations", ListView)
        await lv.clear()
        items = [ConversationItem(c, self.mask) for c in self.conversations if needle in (c.title or "").lower()]
        await lv.extend(items)
        for i, item in enumerate(items):
            if item.conv_id == current:
                lv.index = i

    async def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            await self._fill()

    def on_list_view_selected(self, event: ListView.Selected) -> None:
        event.stop()
        if isinstance(event.item, ConversationItem):
            self.post_message(self.Open(event.item.conv_id))

    def highlighted(self) -> ConversationItem | None:
        item = self.query_one("#conversations", ListView).highlighted_child
        return item if isinstance(item, ConversationItem) else None

    def action_act(self, what: str) -> None:
        item = self.highlighted()
        self.post_message(self.Act(what, item.conv_id if item else None, item.title if item else None))
