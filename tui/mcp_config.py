"""The app's MCP config: ``<data dir>/mcp.json``, shaped as Claude Desktop's and oterm's::

    {"mcpServers": {"files": {"command": "uvx", "args": ["mcp-server-filesystem", "/tmp"], "env": {}},
                    "web":   {"url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer X"}}}}

A server has ``command`` (stdio: ``args``, ``env``, ``cwd``) or ``url`` (streamable HTTP:
``headers``), and optionally ``timeout`` (seconds a call may take, default 60), ``disabled`` and
``alwaysAllow`` (tool names that need no confirmation). A bad entry is one error naming its field
(that server is not started, the others are); a bad file is one error and no servers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_NAME = "mcp.json"
CALL_TIMEOUT_S = 60.0
_FIELDS = {"command", "args", "env", "cwd", "url", "headers", "timeout", "disabled", "alwaysAllow", "type"}
_TYPES = {
    "stdio": "command",
    "http": "url",
    "streamable-http": "url",
    "streamable_http": "url",
    "streamableHttp": "url",
}


class MCPConfigError(ValueError):
    """A bad mcp.json, or a bad entry of it: the message names the field."""


@dataclass
class ServerConfig:
    name: str
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = CALL_TIMEOUT_S
    always_allow: list[str] = field(default_factory=list)

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise MCPConfigError(f"{where}: must be a list of strings")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise MCPConfigError(f"{where}[{i}]: must be a string, got {type(v).__name__}")
    return list(value)


def _string_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise MCPConfigError(f"{where}: must be an object of strings")
    for k, v in value.items():
        if not isinstance(v, str):
            raise MCPConfigError(f"{where}.{k}: must be a string, got {type(v).__name__}")
    return dict(value)


def parse_server(name: str, entry: Any, where: str) -> ServerConfig | None:
    """One ``mcpServers`` entry (None: it is disabled); MCPConfigError names what is wrong."""
    if not isinstance(entry, dict):
        raise MCPConfigError(f'{where}: must be an object with "command" (stdio) or "url" (streamable HTTP)')
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise MCPConfigError(f"{where}.{unknown[0]}: unknown field (the fields are {', '.join(sorted(_FIELDS))})")
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise MCPConfigError(f"{where}.disabled: must be true or false")
    if "command" in entry and "url" in entry:
        raise MCPConfigError(f'{where}: give "command" (stdio) or "url" (streamable HTTP), not both')
    if "command" not in entry and "url" not in entry:
        raise MCPConfigError(f'{where}: needs "command" (stdio) or "url" (streamable HTTP)')
    kind = entry.get("type")
    if kind is not None and (kind not in _TYPES or _TYPES[kind] not in entry):
        raise MCPConfigError(
            f'{where}.type: {kind!r} does not match the entry ("stdio" with "command", "http" with "url")'
        )
    c = ServerConfig(name=name)
    if "command" in entry:
        if not isinstance(entry["command"], str) or not entry["command"].strip():
            raise MCPConfigError(f"{where}.command: must be a non-empty string")
        c.command = entry["command"]
        c.args = _strings(entry.get("args", []), f"{where}.args")
        c.env = _string_map(entry.get("env", {}), f"{where}.env")
        if entry.get("cwd") is not None and not isinstance(entry["cwd"], str):
            raise MCPConfigError(f"{where}.cwd: must be a string")
        c.cwd = entry.get("cwd")
        for key in ("headers",):
            if key in entry:
                raise MCPConfigError(f'{where}.{key}: only for a "url" server')
    else:
        url = entry["url"]
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
            raise MCPConfigError(f"{where}.url: must be an http:// or https:// URL, got {url!r}")
        c.url = url
        c.headers = _string_map(entry.get("headers", {}), f"{where}.headers")
        for key in ("args", "env", "cwd"):
            if key in entry:
                raise MCPConfigError(f'{where}.{key}: only for a "command" server')
    timeout = entry.get("timeout", CALL_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise MCPConfigError(f"{where}.timeout: must be a number of seconds > 0, got {timeout!r}")
    c.timeout = float(timeout)
    c.always_allow = _strings(entry.get("alwaysAllow", []), f"{where}.alwaysAllow")
    return None if disabled else c


def load_config(path: Path) -> tuple[list[ServerConfig], list[str]]:
    """The servers of ``path`` (none when it does not exist) and an error line per bad entry."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return [], []
    except (OSError, UnicodeDecodeError) as e:
        return [], [f"{path}: cannot be read: {e}"]
    try:
        doc = json.loads(text)
    except ValueError as e:
        return [], [f"{path}: not valid JSON: {e}"]
    if not isinstance(doc, dict) or not isinstance(doc.get("mcpServers", {}), dict):
        return [], [f'{path}: mcpServers: must be an object of servers by name: {{"mcpServers": {{"name": {{...}}}}}}']
    servers, errors = [], []
    for name, entry in doc.get("mcpServers", {}).items():
        where = f"{path.name}: mcpServers.{name}"
        try:
            if not name.strip():
                raise MCPConfigError(f"{path.name}: mcpServers: a server's name must not be empty")
            c = parse_server(name, entry, where)
        except MCPConfigError as e:
            errors.append(str(e))
            continue
        if c is not None:
            servers.append(c)
    return servers, errors
