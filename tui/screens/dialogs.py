"""Modal dialogs: a yes/no confirmation, a tool call's confirmation, a one-line prompt,
per-conversation settings, help."""

from __future__ import annotations

from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, TextArea

from chatkv.tui.widgets.titles import safe_text


class ConfirmScreen(ModalScreen[bool]):
    """Dismissed with True (Yes) or False (No, Escape)."""

    BINDINGS = [Binding("escape", "dismiss(False)", "Cancel"), Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__(classes="dialog-screen")
        self.question = question

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(safe_text(self.question), markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Yes", variant="error", id="yes")
                yield Button("No", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ToolConfirmScreen(ModalScreen[str]):
    """May the model call this tool? Dismissed with "once" (y), "always" (a: this tool, until
    the app quits) or "deny" (n, Escape)."""

    BINDINGS = [
        Binding("escape,n", "dismiss('deny')", "Deny"),
        Binding("y", "dismiss('once')", "Allow once"),
        Binding("a", "dismiss('always')", "Always allow"),
    ]

    def __init__(self, tool: str, server: str | None, arguments: str):
        super().__init__(classes="dialog-screen")
        self.tool, self.server, self.arguments = tool, server, arguments

    def compose(self):
        where = f" of MCP server '{self.server}'" if self.server else ""
        with Vertical(classes="dialog tool-confirm"):
            yield Label(safe_text(f"The model calls the tool '{self.tool}'{where} with:"), markup=False)
            yield Label(safe_text(self.arguments), markup=False, classes="tool-args")
            with Horizontal(classes="buttons"):
                yield Button("Allow once (y)", variant="primary", id="once")
                yield Button("Always (a)", id="always")
                yield Button("Deny (n)", variant="error", id="deny")

    def on_mount(self) -> None:
        self.query_one("#deny", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)


class PromptScreen(ModalScreen[str | None]):
    """Ask for one line; dismissed with the text, or None on Escape."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = "", placeholder: str = ""):
        super().__init__(classes="dialog-screen")
        self.question, self.value, self.placeholder = question, value, placeholder

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.question, markup=False)
            yield Input(safe_text(self.value), placeholder=self.placeholder, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class SettingsScreen(ModalScreen[dict | None]):
    """Temperature, max tokens and system prompt of this conversation; dismissed with a dict or None."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, temperature, max_tokens, system: str | None):
        super().__init__(classes="dialog-screen")
        self.values = (temperature, max_tokens, system)

    def compose(self):
        temperature, max_tokens, system = self.values
        with Vertical(classes="dialog settings"):
            yield Label("Conversation settings", classes="dialog-title")
            yield Label("Temperature")
            yield Input("" if temperature is None else str(temperature), id="temperature", placeholder="0.0 (greedy)")
            yield Label("Max tokens")
            yield Input("" if max_tokens is None else str(max_tokens), id="max_tokens", placeholder="model default")
            yield Label("System prompt (a change starts a new chat)")
            yield TextArea(safe_text(system or ""), id="system")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        out: dict = {}
        for key, kind in (("temperature", float), ("max_tokens", int)):
            raw = self.query_one(f"#{key}", Input).value.strip()
            if raw:
                try:
                    out[key] = kind(raw)
                except ValueError:
                    self.notify(f"{key.replace('_', ' ')} must be a number, got '{raw}'", severity="error")
                    return
        out["system"] = self.query_one("#system", TextArea).text.strip() or None
        self.dismiss(out)


HELP = """\
# chatkv

**Keys**: Enter sends · Shift+Enter or Ctrl+J adds a line · Up on an empty box edits your
last message (Enter sends it as a new version, Esc leaves) · Up/Down recall earlier inputs ·
Esc stops a reply (what was produced is kept) · Ctrl+N new chat · Ctrl+B sidebar ·
Ctrl+F search every chat · Ctrl+S settings · Ctrl+P command palette · Ctrl+Q quit.
In the sidebar: Enter opens · n new · r rename · a archive · d delete.
On a message (Tab/click to focus it): c copies it · e edits it (yours) ·
Left/Right (or a click on ◀ ▶) shows its other versions.

| command | what it does |
|---|---|
| `/new` | a new chat |
| `/system TEXT` | a new chat with this system prompt |
| `/model PATH` | load another model (a local Hugging Face directory) |
| `/kb NAME` | a new chat over knowledge base NAME (sources under each reply) |
| `/ingest PATH` | add files or a directory to the attached knowledge base |
| `/sources` | open the last reply's sources in the side panel |
| `/pin SOURCE` | a new chat with a document of the knowledge base pinned |
| `/regenerate` | answer the last question again in place (the old reply stays a version) |
| `/edit` | your last message into the input box, to send as a new version |
| `/branch prev\\|next` | the previous or next version of the focused (or last) message with versions |
| `/search TEXT` | search every conversation; the chosen hit opens its chat and branch |
| `/export md\\|json [PATH]` | write the conversation to a file |
| `/stats` | token counts and timings of every turn, and the KV pool |
| `/tools` | MCP servers (`mcp.json`) and their tools; `/tools reload`, `off`, `on`; each call asks first |
| `/settings` | temperature, max tokens, system prompt |
| `/help` | this help |

The status line shows the context used, the KV pool, and for the last turn how many
prompt tokens came from memory (cached), from disk (restored) or were computed.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q", "dismiss(None)", "Close")]

    def __init__(self):
        super().__init__(classes="dialog-screen")

    def compose(self):
        with VerticalScroll(classes="dialog help"):
            yield Markdown(HELP)
