"""Slash commands, key actions and the command palette of the chat app.

``CommandsMixin`` is mixed into ``ChatApp`` (tui/app.py) and uses its state and helpers.
``/name ARG`` runs ``cmd_name(arg)``; an unknown name or a failure is a notification.
It must come before ``App`` in ChatApp's bases (``get_system_commands`` extends App's).
"""

from __future__ import annotations

from pathlib import Path

from textual.app import SystemCommand
from textual.widgets import Label, ProgressBar

from chatkv.engine.sampling import SamplingParams
from chatkv.errors import ChatKVError
from chatkv.outputs import Usage
from chatkv.tui.screens.dialogs import HelpScreen, PromptScreen, SettingsScreen
from chatkv.tui.screens.search import SearchScreen
from chatkv.tui.widgets.chat import ChatMessage
from chatkv.tui.widgets.sidebar import Sidebar
from chatkv.tui.widgets.sources import SourcesPanel
from chatkv.tui.widgets.titles import safe_text

EXPORT_FORMATS = {"md": ("markdown", "md"), "markdown": ("markdown", "md"), "json": ("json", "json")}


class CommandsMixin:
    """Slash commands and actions (part of ``ChatApp``)."""

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
        from chatkv import Engine

        data_dir = self.data_dir or (getattr(self.engine.config, "data_dir", None) if self.engine else None)
        kw = {"data_dir": data_dir} if data_dir else {}
        kw.update(self.engine_options)
        self.query_one("#loading").display = True
        self.query_one("#loading-label", Label).update(f"Loading {safe_text(arg)}…")
        self.query_one("#loading-bar", ProgressBar).update(total=None, progress=0)  # until a conversion reports
        try:
            engine = await self._call(Engine.from_pretrained, arg, what="Model", progress=self._loading_progress, **kw)
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
            self.notify(
                f"{safe_text(str(err.source))}: {safe_text(str(err.reason))}", title="Skipped", severity="warning"
            )
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
        if not any(w.role == "user" for w in self._branch_widgets()):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        # answered again in place: the new reply is a sibling of the old one, which the switcher keeps
        self.run_worker(self._regenerate(), exclusive=False)

    async def cmd_search(self, arg: str) -> None:
        """``/search TEXT``: the search dialog, with TEXT's hits."""
        self.action_search(arg)

    def action_search(self, query: str = "") -> None:
        """Ctrl+F: search every saved conversation; the hit chosen opens its conversation and branch."""
        if self.engine is None:
            self.notify("No model is loaded yet.", severity="warning")
            return
        self.run_worker(self._search(query))

    async def _search(self, query: str) -> None:
        engine = self.engine

        async def find(q: str):
            return await self._call(engine.search, q, what="Search")

        hit = await self.push_screen_wait(SearchScreen(find, query))
        if hit is not None:
            await self.open_message(hit.conversation_id, hit.message.id)

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
        rows = [
            "| turn | prompt | cached | restored | computed | generated | drafted / accepted | TTFT ms | tok/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        n = 0
        for m in msgs or []:
            u = Usage.from_message(m) if m.role == "assistant" else None
            if u is None:
                continue
            n += 1
            ttft, tps = ("--", "--") if self.mask_volatile else (f"{u.ttft_s * 1000:.0f}", f"{u.tokens_per_s:.1f}")
            spec = f"{u.proposed_tokens} / {u.accepted_tokens}" if u.proposed_tokens else "-"  # speculative decoding
            rows.append(
                f"| {n} | {u.prompt_tokens} | {u.cached_tokens} | {u.restored_tokens} | {u.computed_tokens} "
                f"| {u.generated_tokens} | {spec} | {ttft} | {tps} |"
            )
        if n == 0:
            rows = ["*No turns in this conversation yet.*"]
        kv_line = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in kv.items())
        kv_line = f"{self.engine.kv_dtype}, {self.engine.kv_bytes_per_token} bytes a token; " + kv_line
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
        out = await self.push_screen_wait(
            SettingsScreen(self.params.get("temperature"), self.params.get("max_tokens"), self.system)
        )
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

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        yield SystemCommand("New chat", "Start a new conversation (/new)", self.action_new_chat)
        yield SystemCommand(
            "Regenerate",
            "Answer the last question again; the old reply is kept (/regenerate)",
            lambda: self._run("/regenerate"),
        )
        yield SystemCommand(
            "Edit last message", "Your last message into the input box to edit (/edit, Up)", lambda: self._run("/edit")
        )
        yield SystemCommand("Search…", "Search every conversation (/search TEXT, Ctrl+F)", self.action_search)
        yield SystemCommand("Sources", "Open the last reply's sources (/sources)", lambda: self._run("/sources"))
        yield SystemCommand("Stats", "Token counts and timings of each turn (/stats)", lambda: self._run("/stats"))
        yield SystemCommand(
            "MCP tools", "The MCP servers of mcp.json and their tools (/tools)", lambda: self._run("/tools")
        )
        yield SystemCommand(
            "Export Markdown", "Write the chat to a .md file (/export md)", lambda: self._run("/export md")
        )
        yield SystemCommand(
            "Export JSON", "Write the chat to a .json file (/export json)", lambda: self._run("/export json")
        )
        yield SystemCommand("Settings", "Temperature, max tokens, system prompt", self.action_settings)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard", self.action_copy_last)
        yield SystemCommand(
            "System prompt…",
            "A new chat with a system prompt (/system TEXT)",
            lambda: self._ask_then("System prompt:", "system"),
        )
        yield SystemCommand(
            "Load model…",
            "Load a local model directory (/model PATH)",
            lambda: self._ask_then("Model directory:", "model"),
        )
        yield SystemCommand(
            "Knowledge base…",
            "Chat over a knowledge base (/kb NAME)",
            lambda: self._ask_then("Knowledge base name:", "kb"),
        )
        yield SystemCommand(
            "Ingest…",
            "Add files to the knowledge base (/ingest PATH)",
            lambda: self._ask_then("File or directory:", "ingest"),
        )
        yield SystemCommand(
            "Pin document…",
            "Pin a document of the knowledge base (/pin SOURCE)",
            lambda: self._ask_then("Document source:", "pin"),
        )
        yield SystemCommand("Rename chat", "Rename this conversation", lambda: self._manage_current("rename"))
        yield SystemCommand("Archive chat", "Archive this conversation", lambda: self._manage_current("archive"))
        yield SystemCommand("Delete chat", "Delete this conversation", lambda: self._manage_current("delete"))
        yield SystemCommand("Help", "Keys and slash commands (/help)", self.action_help)
