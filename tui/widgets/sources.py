"""The side panel that shows one source of a reply in full."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from chatkv.tui.widgets.titles import safe_text


class SourcesPanel(VerticalScroll):
    def compose(self):
        yield Static("Sources", id="sources-title")
        yield Markdown("", id="sources-body")

    async def show(self, sources: list[dict], focus: int | None = None) -> None:
        """Show ``sources`` (the reply's dicts: number, cited, source, heading, text); ``focus`` first."""
        ordered = sorted(sources, key=lambda s: (s.get("number") != focus, s.get("number", 0)))
        parts = []
        for s in ordered:
            head = f"### [{s.get('number')}] {safe_text(s.get('source', ''))}"
            if s.get("heading"):
                head += f" › {safe_text(s['heading'])}"
            cited = "cited in the reply" if s.get("cited") else "not cited"
            parts.append(f"{head}\n\n*{cited}*\n\n{safe_text(s.get('text', ''))}\n")
        await self.query_one("#sources-body", Markdown).update("\n".join(parts) or "*No sources.*")
        self.display = True
        self.scroll_home(animate=False)
