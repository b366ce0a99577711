"""MCP servers for the chat app: their connections, their tools as the SDK's tool specs, and
calls of them (the ``mcp`` package's client; no Textual here). The config file is read by
tui/mcp_config.py.

Each server lives in one asyncio task (``ServerConn.run``) that holds its ``mcp.Client`` open and
makes its calls, so a server that dies ends only that task: its pending call fails with the
reason and ``on_event`` says so. The tools of the servers that run are offered to the model
under names the SDK accepts (``exposed``: the tool's own name, or ``server_tool`` when two
servers share one or it has other characters).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from chatkv.errors import ChatKVError
from chatkv.sessions.tools import TOOL_NAME, Tool, tools_of
from chatkv.tui.mcp_config import ServerConfig, load_config

START_TIMEOUT_S = 30.0


# -- tools and results ------------------------------------------------------------------------


@dataclass
class MCPTool:
    server: str
    name: str  # the server's name for it
    exposed: str  # the name the model calls it by
    description: str
    schema: dict

    def spec(self) -> dict:
        """The SDK's tool spec, under the name the model calls it by (chatkv.sessions.tools.Tool's own)."""
        return Tool(self.exposed, self.description, self.schema).spec()


@dataclass
class ToolResult:
    text: str
    is_error: bool = False

    def for_model(self) -> Any:
        """What the model reads: the text, or ``{"error": text}`` (as the SDK's run_tools reports a failure)."""
        return {"error": self.text} if self.is_error else self.text


def result_text(result: Any) -> ToolResult:
    """An MCP CallToolResult as text: its text parts, other parts named with their type."""
    parts = []
    for c in getattr(result, "content", None) or []:
        kind = getattr(c, "type", "?")
        if kind == "text":
            parts.append(c.text)
        elif kind == "resource" and hasattr(getattr(c, "resource", None), "text"):
            parts.append(c.resource.text)
        else:
            mime = getattr(c, "mime_type", None) or getattr(c, "mimeType", None) or ""
            parts.append(f"[{kind}{' ' + mime if mime else ''} content]")
    structured = getattr(result, "structured_content", None)
    if not parts and structured is not None:
        parts.append(json.dumps(structured))
    is_error = bool(getattr(result, "is_error", False) or getattr(result, "isError", False))
    return ToolResult("\n".join(parts), is_error)


def reason(e: BaseException) -> str:
    """The innermost failures of ``e`` (task groups wrap them) as one line."""
    leaves: list[BaseException] = []

    def walk(x: BaseException) -> None:
        subs = getattr(x, "exceptions", None)
        if subs:
            for s in subs:
                walk(s)
        else:
            leaves.append(x)

    walk(e)
    out = []
    for x in leaves:
        text = f"{type(x).__name__}: {x}" if str(x) else type(x).__name__
        if text not in out:
            out.append(text)
    return "; ".join(out)


def _tightened(schema: Any) -> dict:
    """The arguments' schema as offered to the model: an object, and only its declared properties
    (a server's schema usually leaves ``additionalProperties`` open; a forced call would fill it)."""
    s = dict(schema) if isinstance(schema, dict) else {}
    s.setdefault("type", "object")
    s.setdefault("properties", {})
    if s.get("type") == "object":
        s.setdefault("additionalProperties", False)
    s.pop("$schema", None)
    return s


# -- one server ----------------------------------------------------------------------------------


class ServerConn:
    """One MCP server's connection, held by ``run`` (an asyncio task): ``state`` is starting,
    running, failed (never started) or died (stopped answering); ``error`` says why."""

    def __init__(self, config: ServerConfig, log_dir: Path | None, on_event: Callable[[str, str], None]):
        self.config = config
        self.log_dir = log_dir
        self.on_event = on_event
        self.state = "starting"
        self.error: str | None = None
        self.tools: list[Any] = []  # the server's mcp Tool objects
        self.ready = asyncio.Event()
        self._requests: asyncio.Queue = asyncio.Queue()
        self._stop = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._log = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run(), name=f"mcp:{self.config.name}")

    def _client(self):
        from mcp import Client, StdioServerParameters  # the mcp package loads only when a server is configured
        from mcp.client.stdio import stdio_client

        c = self.config
        if c.command is not None:
            self._log = self._open_log()
            params = StdioServerParameters(command=c.command, args=c.args, env=c.env or None, cwd=c.cwd)
            return Client(stdio_client(params, errlog=self._log))
        if c.headers:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(headers=c.headers, timeout=httpx2.Timeout(30.0, read=300.0))
            return Client(streamable_http_client(c.url, http_client=http))
        return Client(c.url)

    def _open_log(self):
        """The server's stderr goes to ``<data dir>/mcp-logs/<name>.log`` (never over the screen)."""
        import os

        if self.log_dir is None:
            return open(os.devnull, "w")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.config.name)[:64] or "server"
        return open(self.log_dir / f"{safe}.log", "w", encoding="utf-8", errors="replace")

    def _last_stderr(self) -> str:
        if self._log is None or getattr(self._log, "name", "") in ("", "/dev/null"):
            return ""
        try:
            self._log.flush()
            lines = [ln.strip() for ln in Path(self._log.name).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return f" (its stderr: {lines[-1][:200]})" if lines else ""

    async def run(self) -> None:
        pending: asyncio.Future | None = None
        try:
            from mcp import MCPError  # a missing mcp package is this server failing to start, said so
            from mcp_types import CONNECTION_CLOSED

            async with self._client() as client:
                tools, cursor = [], None
                while True:
                    page = await asyncio.wait_for(client.list_tools(cursor=cursor), START_TIMEOUT_S)
                    tools += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.tools, self.state = tools, "running"
                self.ready.set()
                while not self._stop.is_set():
                    get = asyncio.ensure_future(self._requests.get())
                    stop = asyncio.ensure_future(self._stop.wait())
                    await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                    if not get.done():
                        get.cancel()
                        break
                    what, args, pending = get.result()
                    try:
                        if what == "ping":  # (MCP's own ping is gone from its 2026 protocol): list the tools again
                            page = await asyncio.wait_for(client.list_tools(cache_mode="bypass"), 10.0)
                            out: Any = page.tools if not page.next_cursor else None  # None: keep the full listing
                        else:
                            out = result_text(await asyncio.wait_for(client.call_tool(what, args), self.config.timeout))
                    except asyncio.TimeoutError:
                        out = ToolResult(f"the tool '{what}' gave no answer in {self.config.timeout:g} s", True)
                    except MCPError as e:  # the server refused the call (unknown tool, bad arguments)
                        if e.code == CONNECTION_CLOSED:
                            raise
                        out = ToolResult(f"the server refused the call: {e.message}", True)
                    if not pending.done():
                        pending.set_result(out)
                    pending = None
        except asyncio.CancelledError:
            self.state = "stopped"
            raise
        except BaseException as e:  # noqa: BLE001 - a server failing is a notification, never the app's end
            started = self.state == "running"
            self.state = "died" if started else "failed"
            self.error = reason(e) + ("" if started else self._last_stderr())
            if pending is not None and not pending.done():
                pending.set_exception(ServerGone(self.config.name, self.error))
            self.on_event(
                self.config.name,
                f"MCP server '{self.config.name}' {'died' if started else 'failed to start'}: {self.error}",
            )
        finally:
            self.ready.set()
            if self.state in ("running", "starting"):
                self.state = "stopped"
            while not self._requests.empty():  # calls queued behind the one that failed
                _, _, f = self._requests.get_nowait()
                if not f.done():
                    f.set_exception(ServerGone(self.config.name, self.error or "it was stopped"))
            if self._log is not None:
                self._log.close()

    async def request(self, what: str, args: dict | None = None) -> Any:
        if self.state != "running":
            raise ServerGone(self.config.name, self.error or f"it is {self.state}")
        f = asyncio.get_running_loop().create_future()
        await self._requests.put((what, args, f))
        return await f

    async def stop(self) -> None:
        self._stop.set()
        if self.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 10.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                self.task.cancel()


class ServerGone(Exception):
    """Internal to the app: a call to a server that stopped. It never leaves this module (each
    catch turns it into an error result the model reads), so it is not one of chatkv.errors'."""

    def __init__(self, server: str, why: str):
        super().__init__(f"MCP server '{server}' is not running: {why}")
        self.server = server


def _load_mcp() -> None:
    import importlib

    try:
        for name in ("mcp", "mcp.client.stdio", "mcp.client.streamable_http"):
            importlib.import_module(name)
    except ImportError:  # each server's task says so, as its failure to start
        pass


# -- all of them -----------------------------------------------------------------------------------


class MCPTools:
    """The app's MCP servers: started from ``<data dir>/mcp.json``, their tools offered to the
    model, their calls made. ``on_event(server, message)`` hears of a server failing or dying."""

    def __init__(self, config_path: Path, on_event: Callable[[str, str], None]):
        self.path = config_path
        self.on_event = on_event
        self.servers: dict[str, ServerConn] = {}
        self.errors: list[str] = []  # the config's, one line each
        self.skipped: dict[str, str] = {}  # tools not offered: exposed-or-raw name -> why
        self.always: set[str] = set()  # exposed names allowed without asking
        self._tools: dict[str, MCPTool] = {}

    async def start(self) -> None:
        """Read the config and start every server in it; return once each has started or failed."""
        configs, self.errors = load_config(self.path)
        for e in self.errors:
            self.on_event("", e)
        if configs:  # the mcp package (~1.4 s of imports: pydantic, starlette...) loads off the UI's loop
            await asyncio.to_thread(_load_mcp)
        log_dir = self.path.parent / "mcp-logs"
        for c in configs:
            conn = ServerConn(c, log_dir, self._event)
            self.servers[c.name] = conn
            conn.start()
        await asyncio.gather(
            *(asyncio.wait_for(s.ready.wait(), START_TIMEOUT_S + 5) for s in self.servers.values()),
            return_exceptions=True,
        )
        for s in self.servers.values():
            if s.state == "starting":  # no answer in time: as failed
                s.error, s.state = f"no answer in {START_TIMEOUT_S:g} s", "failed"
                if s.task is not None:
                    s.task.cancel()
                self.on_event(s.config.name, f"MCP server '{s.config.name}' failed to start: {s.error}")
        self._index()

    def _event(self, server: str, message: str) -> None:
        self._index()
        self.on_event(server, message)

    def _index(self) -> None:
        """The tools offered: those of running servers, each with a name the SDK accepts and a
        schema it can enforce (a tool that has neither is skipped, and said why)."""
        listed = [(s, t) for s in self.servers.values() for t in s.tools]  # a dead server's too: names stay put
        counts: dict[str, int] = {}
        for _, t in listed:
            counts[t.name] = counts.get(t.name, 0) + 1
        tools: dict[str, MCPTool] = {}
        self.skipped = {}
        for s, t in listed:
            if s.state != "running":
                continue
            name = (
                t.name
                if counts[t.name] == 1 and TOOL_NAME.match(t.name)
                else re.sub(r"[^A-Za-z0-9_-]", "_", f"{s.config.name}_{t.name}")[:64]
            )
            tool = MCPTool(
                s.config.name,
                t.name,
                name,
                getattr(t, "description", None) or "",
                _tightened(getattr(t, "input_schema", None) or getattr(t, "inputSchema", None)),
            )
            try:
                if name in tools:
                    raise ChatKVError(f"its name '{name}' is another tool's too")
                tools_of([tool.spec()])
            except ChatKVError as e:
                self.skipped[f"{s.config.name}/{t.name}"] = str(e)
                continue
            tools[name] = tool
            if t.name in s.config.always_allow:
                self.always.add(name)
        self._tools = tools

    def tools(self) -> list[MCPTool]:
        return list(self._tools.values())

    def specs(self) -> list[dict]:
        return [t.spec() for t in self._tools.values()]

    def find(self, exposed: str) -> MCPTool | None:
        return self._tools.get(exposed)

    async def call(self, exposed: str, arguments: dict) -> ToolResult:
        """Call a tool; a server that is gone, or a tool that fails, is an error result."""
        tool = self._tools.get(exposed)
        if tool is None:
            return ToolResult(f"no tool is named '{exposed}' (its server may have stopped)", True)
        try:
            return await self.servers[tool.server].request(tool.name, arguments)
        except ServerGone as e:
            return ToolResult(str(e), True)

    async def check(self) -> None:
        """Ask the running servers for their tools again (a dead one is found, and said, now)."""

        async def ping(s: ServerConn) -> None:
            try:
                tools = await s.request("ping")
            except ServerGone:
                return
            if isinstance(tools, list):
                s.tools = tools  # a server may change its tools

        await asyncio.gather(*(ping(s) for s in self.servers.values() if s.state == "running"))
        self._index()

    async def close(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()), return_exceptions=True)
        self.servers.clear()
        self._tools = {}

    def cancel(self) -> None:
        """Without waiting (the app is going): each server's task ends, stopping its process."""
        for s in self.servers.values():
            if s.task is not None and not s.task.done():
                s.task.cancel()
