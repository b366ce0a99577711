"""MCP tools in the chat app: the servers of ``<data dir>/mcp.json`` started with the app, their
tools offered to the model through the SDK's tools path, each call shown and confirmed (once,
always for that tool, or denied: the model reads that it was denied), its result folded under
it and sent back to the model (``session.stream_tool_results``), and ``/tools``.

``ToolsMixin`` is mixed into ``ChatApp`` (tui/app.py) and uses its state and helpers; the MCP
client is tui/mcp_tools.py. A server that fails or dies is a notification and the chat goes on
(a call of its tools is an error result the model reads).
"""

from __future__ import annotations

import json
from pathlib import Path

from textual.containers import VerticalScroll

from chatkv.errors import ChatKVError
from chatkv.sessions.tools import tagged_calls
from chatkv.tui.mcp_config import CONFIG_NAME
from chatkv.tui.mcp_tools import MCPTools, ToolResult
from chatkv.tui.screens.dialogs import ToolConfirmScreen
from chatkv.tui.widgets.chat import ChatMessage
from chatkv.tui.widgets.titles import safe_text
from chatkv.tui.widgets.tool_call import ToolCallView, arguments_text

MAX_TOOL_STEPS = 5  # tool rounds after one message of yours (the SDK's run_tools default too)
DENIED = "the user denied this tool call"


def calls_in(text: str) -> list[tuple[str, dict]]:
    """The Hermes-format calls (``<tool_call>{...}</tool_call>``) in a stored reply: (name, arguments)."""
    out = []
    for body in tagged_calls.findall(text or ""):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments")
            out.append((obj["name"], args if isinstance(args, dict) else {}))
    return out


def without_calls(text: str) -> str:
    return tagged_calls.sub("", text or "").strip()


class ToolsMixin:
    """MCP servers, tool calls and /tools (part of ``ChatApp``)."""

    mcp: MCPTools | None = None
    tools_on = True  # /tools off: the model is offered no tools
    tool_choice = "auto"  # the first step after your message ("required" or a tool's name forces a call)
    _tool_steps = 0
    _renders_tools: dict | None = None

    # -- the servers -------------------------------------------------------------------

    def _mcp_path(self) -> Path:
        from chatkv import data_dir

        where = self.data_dir or (getattr(self.engine.config, "data_dir", None) if self.engine is not None else None)
        return Path(data_dir(where)) / CONFIG_NAME

    async def _start_mcp(self) -> None:
        """Start the servers of mcp.json (none configured: nothing is loaded)."""
        try:
            path = self._mcp_path()
        except OSError as e:
            self._error(e, "MCP")
            return
        self.mcp = MCPTools(path, self._mcp_event)
        await self.mcp.start()

    def _mcp_event(self, server: str, message: str) -> None:
        self.notify(safe_text(message), title="MCP", severity="error", timeout=10)

    async def _close_mcp(self) -> None:
        if self.mcp is not None:
            mcp, self.mcp = self.mcp, None
            await mcp.close()

    # -- offering tools ----------------------------------------------------------------

    def _tool_options(self, first: bool = True) -> dict:
        """The ``tools``/``tool_choice`` of a turn: the running servers' tools that the model's chat
        template renders (a template without tool support: none, said once; a tool whose spec the
        SDK refuses, a control token's text in its description say: not that one, said once)."""
        if self.mcp is None or not self.tools_on or self.engine is None:
            return {}
        if self._renders_tools is None:
            self._renders_tools = {}
        seen = self._renders_tools.setdefault((id(self.engine), str(getattr(self.engine, "model_dir", ""))), {})
        specs = []
        for spec in self.mcp.specs():
            key = json.dumps(spec, sort_keys=True)
            if key not in seen:
                from chatkv import TurnRenderer

                name = spec["function"]["name"]
                try:
                    seen[key] = TurnRenderer(self.engine.tokenizer).renders_tools([spec])
                except ChatKVError as e:
                    seen[key] = None
                    self.notify(
                        safe_text(f"The MCP tool '{name}' is not offered: {e}"),
                        title="MCP",
                        severity="warning",
                        timeout=8,
                    )
                if seen[key] is False and not seen.get("said"):
                    seen["said"] = True
                    self.notify(
                        "This model's chat template has no tool support: the MCP tools are not offered to it.",
                        title="MCP",
                        severity="warning",
                        timeout=8,
                    )
            if seen[key]:
                specs.append(spec)
        if not specs:
            return {}
        return {"tools": specs, "tool_choice": self.tool_choice if first else "auto"}

    # -- a reply that calls tools --------------------------------------------------------

    def _calls_to_run(self, reply, interrupted: bool, error: str | None) -> list:
        if reply is None or interrupted or error or self.mcp is None or self._quitting:
            return []
        return list(getattr(reply, "tool_calls", None) or [])

    async def _tool_round(self, w: ChatMessage | None, reply) -> None:
        """Show each call, ask, run it on its server, fold its result under it; then the model goes
        on from the results (a turn streamed as any other). ``self.generating`` is held meanwhile."""
        try:
            if w is not None:  # the reply's own words stay; the call markup becomes the views below
                bare = not tagged_calls.search(reply.text or "")  # a template whose calls are one JSON object
                w.text = "" if bare else safe_text(without_calls(reply.text))
                await w.body.update(w.text)
            chat = self.query_one("#chat", VerticalScroll)
            results: dict = {}
            for call in reply.tool_calls:
                if self._cancel.is_set() or self._quitting:
                    break
                tool = self.mcp.find(call.name) if self.mcp is not None else None
                view = ToolCallView(call.name, tool.server if tool else None, call.arguments, id=self._new_id())
                await chat.mount(view)
                chat.scroll_end(animate=False)
                result = await self._run_call(view, call, tool)
                if result is None:  # the app is going
                    break
                view.set_result(result.text, result.is_error)
                chat.scroll_end(animate=False)
                results[call.id] = result.for_model()
            if self._cancel.is_set() or self._quitting or len(results) < len(reply.tool_calls):
                self.generating = False
                if not self._quitting:
                    self.notify("Stopped: the tool results were not sent to the model.", title="Tools", timeout=4)
                return
            self._tool_steps += 1
            if self._tool_steps >= MAX_TOOL_STEPS:
                self.notify(
                    f"The model called tools {MAX_TOOL_STEPS} times in a row; stopped there. Send a message to go on.",
                    title="Tools",
                    severity="warning",
                    timeout=8,
                )
                self.generating = False
                return
            opts = self._tool_options(first=False)
            await self._turn_of(lambda s, p: s.stream_tool_results(results, p, **opts), after_tools=True)
        except Exception as e:  # noqa: BLE001 - a failing round is a notification; the chat goes on
            self.generating = False
            self._error(e, "Tools")

    async def _run_call(self, view: ToolCallView, call, tool) -> ToolResult | None:
        if tool is None:
            view.set_status("no such tool")
            return ToolResult(f"no tool is named '{call.name}'", True)
        if call.name not in self.mcp.always:
            view.set_status("asking")
            answer = await self.push_screen_wait(
                ToolConfirmScreen(call.name, tool.server, arguments_text(call.arguments))
            )
            if self.mcp is None or self._quitting:
                return None
            if answer == "deny":
                view.set_status("denied")
                return ToolResult(DENIED, True)
            if answer == "always":
                self.mcp.always.add(call.name)
        view.set_status("running")
        result = await self.mcp.call(call.name, call.arguments)
        view.set_status("failed" if result.is_error else "done")
        return result

    # -- history: stored calls and results -------------------------------------------------

    def _tool_history(self, m, versions: list[int], widgets: list) -> bool:
        """Widgets for a stored message that called tools, or a stored tool result (folded under
        its call); False: an ordinary message."""
        if m.role == "tool":
            try:
                items = json.loads(m.content)
            except ValueError:
                items = []
            waiting = [v for v in widgets if isinstance(v, ToolCallView) and v.result is None]
            for item, v in zip(items if isinstance(items, list) else [], waiting):
                text = item.get("content", "") if isinstance(item, dict) else str(item)
                failed = text.startswith('{"error"')
                v.set_result(text, failed)
                v.set_status("denied" if DENIED in text else "failed" if failed else "done")
            return True
        calls = calls_in(m.content) if m.role == "assistant" else []
        if not calls:
            return False
        widgets.append(
            ChatMessage(
                m.role,
                without_calls(m.content),
                interrupted=m.status == "interrupted",
                message_id=m.id,
                versions=versions,
                id=self._new_id(),
            )
        )
        for name, args in calls:
            tool = self.mcp.find(name) if self.mcp is not None else None
            widgets.append(ToolCallView(name, tool.server if tool else None, args, status="called", id=self._new_id()))
        return True

    # -- /tools ------------------------------------------------------------------------------

    async def cmd_tools(self, arg: str) -> None:
        """``/tools``: the servers and their tools; ``/tools reload`` restarts them from mcp.json;
        ``/tools off`` / ``on``: whether the model is offered them."""
        what = arg.strip().lower()
        if what in ("off", "on"):
            self.tools_on = what == "on"
            self.notify(f"MCP tools are {'offered to the model' if self.tools_on else 'off for now'}.", timeout=3)
            return
        if what == "reload":
            if self.generating:
                self.notify("A reply is being generated; press Esc first.", severity="warning")
                return
            await self._close_mcp()
            await self._start_mcp()
        elif what:
            self.notify("Usage: /tools [reload|off|on]", severity="warning")
            return
        if self.mcp is not None and not self.generating:
            await self.mcp.check()  # a server that died while idle shows as died
        await self.note(self._tools_listing())

    def _tools_listing(self) -> str:
        path = self.mcp.path if self.mcp is not None else None
        lines = [f"**MCP servers** (`{safe_text(str(path))}`)" if path else "**MCP servers**"]
        if self.mcp is None or (not self.mcp.servers and not self.mcp.errors):
            lines.append(
                "\nNone configured. Add them to mcp.json: "
                '`{"mcpServers": {"name": {"command": "...", "args": [...]}}}` or `{"url": "http://..."}`; '
                "then `/tools reload`."
            )
            return "\n".join(lines)
        if not self.tools_on:
            lines.append("\n*Off: the model is offered no tools (`/tools on`).*")
        by_server: dict = {}
        for t in self.mcp.tools():
            by_server.setdefault(t.server, []).append(t)
        for name, s in self.mcp.servers.items():
            where = s.config.url or " ".join([s.config.command or ""] + s.config.args)
            lines.append(f"\n- **{safe_text(name)}** ({s.config.transport}, {s.state}): `{safe_text(where)[:80]}`")
            if s.error:
                lines.append(f"  - {safe_text(s.error)[:300]}")
            for t in by_server.get(name, []):
                allowed = " *(always allowed)*" if t.exposed in self.mcp.always else ""
                desc = safe_text(t.description.splitlines()[0] if t.description else "")[:100]
                lines.append(f"  - `{safe_text(t.exposed)}`{allowed}: {desc}")
        for key, why in self.mcp.skipped.items():
            lines.append(f"\n- not offered: `{safe_text(key)}`: {safe_text(why)[:200]}")
        for e in self.mcp.errors:
            lines.append(f"\n- config: {safe_text(e)}")
        return "\n".join(lines)
