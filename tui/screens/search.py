"""The search dialog (Ctrl+F, ``/search TEXT``): messages of every saved conversation, every
branch, that hold the words typed; choosing one dismisses the dialog with that hit, which the app
opens (its conversation, then the branch through that message)."""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from chatkv.tui.widgets.titles import one_line

ROLES = {"user": "you", "assistant": "assistant", "system": "system"}


def hit_line(hit) -> Text:
    """Two lines of the list: the conversation's title and who wrote it, then the snippet."""
    t = Text(one_line(hit.title, 50), style="bold")
    t.append(f"  · {ROLES.get(hit.message.role, one_line(hit.message.role, 12))}", style="italic")
    t.append("\n" + one_line(hit.snippet, 80))
    return t


class SearchScreen(ModalScreen[object | None]):
    """``find(query)`` is awaited for the hits (None: it failed, and said so); dismissed with the
    hit chosen, or None on Escape."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, find, query: str = ""):
        super().__init__(classes="dialog-screen")
        self.find, self.query_text = find, query
        self.hits: list = []

    def compose(self):
        with Vertical(classes="dialog search"):
            yield Label("Search all conversations", classes="dialog-title")
            yield Input(self.query_text, placeholder="words to find (Enter searches)", id="query")
            yield Label("", id="search-status")
            yield OptionList(id="hits")

    def on_mount(self) -> None:
        self.query_one("#hits").display = False
        self.query_one("#query", Input).focus()
        if self.query_text.strip():
            self.run_worker(self.search(self.query_text), exclusive=True)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.run_worker(self.search(event.value), exclusive=True)

    async def search(self, query: str) -> None:
        status = self.query_one("#search-status", Label)
        status.update("Searching…")
        hits = await self.find(query.strip())
        hits = list(hits or [])
        self.hits = hits
        options = self.query_one("#hits", OptionList)
        options.clear_options()
        options.add_options([Option(hit_line(h), id=str(i)) for i, h in enumerate(hits)])
        options.display = bool(hits)
        status.update(f"{len(hits)} found; Enter opens one" if hits else f"No message holds “{one_line(query, 40)}”.")
        if hits:
            options.highlighted = 0
            options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.hits[int(event.option.id)])
