"""One tool call in the chat view: which tool of which server, its arguments, what became of it
(waiting for your answer, allowed, denied, running, done, failed) and its result, folded."""

from __future__ import annotations

import json

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Collapsible, Static

from chatkv.tui.widgets.titles import one_line, safe_text

RESULT_SHOWN = 4000  # characters of a result shown in the view (the model gets all of it)


def arguments_text(arguments: dict) -> str:
    return safe_text(json.dumps(arguments, indent=2, ensure_ascii=False))


class ToolCallView(Vertical):
    """A call of ``tool`` (the model's name for it) on ``server``; ``status`` one word."""

    def __init__(self, tool: str, server: str | None, arguments: dict, status: str = "asking", **kw):
        super().__init__(classes="tool-call", **kw)
        self.tool, self.server, self.arguments = tool, server, dict(arguments)
        self.status = status
        self.result: str | None = None
        self.is_error = False
        self.header = Static(self._header(), classes="header")
        self.args = Static(Text(arguments_text(self.arguments)), classes="tool-args")
        self.result_text = Static("", classes="tool-result-text")
        self.folder = Collapsible(self.result_text, title="Result", collapsed=True, classes="tool-result")

    def _header(self) -> Text:
        t = Text("Tool call: ", style="bold")
        t.append(one_line(self.tool, 64), style="bold")
        if self.server:
            t.append(f"  ({one_line(self.server, 40)})")
        t.append(f"  · {self.status}", style="italic")
        return t

    def compose(self):
        yield self.header
        yield self.args
        yield self.folder

    def on_mount(self) -> None:
        self.folder.display = self.result is not None

    def set_status(self, status: str) -> None:
        self.status = status
        self.header.update(self._header())

    def set_result(self, text: str, is_error: bool = False) -> None:
        """The result, folded under the call (expand it to read)."""
        self.result, self.is_error = text, is_error
        shown = safe_text(text)
        if len(shown) > RESULT_SHOWN:
            shown = shown[:RESULT_SHOWN] + f"\n… ({len(text) - RESULT_SHOWN} more characters)"
        self.folder.title = ("Error" if is_error else "Result") + f" ({len(text)} characters)"
        self.result_text.update(Text(shown))
        self.folder.display = True
        if is_error:
            self.add_class("failed")
