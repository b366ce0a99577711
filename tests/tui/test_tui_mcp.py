"""MCP tools in the chat app, driven by Pilot: a real MCP server process
(tests/support/mcp_test_server.py, on the mcp package's server API, over stdio and streamable HTTP)
started from ``<data dir>/mcp.json``, the real app, and the SDK's tools path on the tiny
Qwen2-style model with a tool template (tests.support.tiny.make_tool_model). The model's call is made
deterministic by the app's ``tool_choice`` (a named tool: the SDK constrains the reply to a call
of it), so each test knows which call comes: /tools lists, a call is confirmed once / always /
denied, its result is folded under it and reaches the model, a server that fails to start or dies
is a notification and the chat goes on, and a bad config names its field."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("textual")

from textual.screen import ModalScreen  # noqa: E402

from chatkv.tui.app import ChatApp  # noqa: E402
from chatkv.tui.mcp_config import load_config  # noqa: E402
from chatkv.tui.screens.dialogs import ToolConfirmScreen  # noqa: E402
from chatkv.tui.tool_turns import DENIED  # noqa: E402
from chatkv.tui.widgets.chat import ChatMessage  # noqa: E402
from chatkv.tui.widgets.tool_call import ToolCallView  # noqa: E402
from tests.support.pilot import idle as pilot_idle  # noqa: E402
from tests.support.pilot import send  # noqa: E402

pytestmark = [pytest.mark.anyio]
SERVER = str(Path(__file__).resolve().parents[1] / "support" / "mcp_test_server.py")
SIZE = (110, 40)
FAST = dict(max_tokens=80, temperature=0.0)  # a forced call is ~70 tokens of the tiny vocabulary


@pytest.fixture(scope="module")
def engine(tool_engine):
    return tool_engine  # conftest: the tiny tool-template model's engine, this module's own


@pytest.fixture
def config(engine, tmp_path):
    """Write mcp.json into the engine's data directory (removed after the test)."""
    path = Path(engine.config.data_dir) / "mcp.json"

    def write(servers: dict | str) -> Path:
        path.write_text(servers if isinstance(servers, str) else json.dumps({"mcpServers": servers}))
        return path

    yield write
    path.unlink(missing_ok=True)


def stdio(tmp_path: Path, name: str = "calc", *args: str) -> dict:
    return {
        "command": sys.executable,
        "args": [SERVER, *args],
        "env": {"MCP_TEST_CALLLOG": str(tmp_path / f"{name}.calls"), "MCP_TEST_PIDFILE": str(tmp_path / f"{name}.pid")},
    }


def calls(tmp_path: Path, name: str = "calc") -> list[str]:
    f = tmp_path / f"{name}.calls"
    return f.read_text().splitlines() if f.exists() else []


def mcp_starting(app: ChatApp) -> bool:
    return app.mcp is None or any(s.state == "starting" for s in app.mcp.servers.values())


async def idle(pilot, app: ChatApp) -> None:
    """tests.support.pilot.idle, and until the MCP servers have started."""
    await pilot_idle(pilot, app, timeout=90.0, starting=mcp_starting)


async def ask(pilot, app: ChatApp, text: str) -> None:
    await send(pilot, app, text, timeout=90.0, starting=mcp_starting)


async def answer(pilot, app: ChatApp, key: str) -> None:
    assert isinstance(app.screen, ToolConfirmScreen), app.screen
    await pilot.press(key)
    await idle(pilot, app)


def views(app: ChatApp) -> list[ToolCallView]:
    return list(app.query(ToolCallView))


def recording(app: ChatApp) -> ChatApp:
    """Every notification the app makes is kept in ``app.said`` (the screen drops them after their
    timeout, which a loaded machine can outlast)."""
    app.said = []
    notify = app.notify

    def keep(message, *a, **kw):
        app.said.append((str(message), kw.get("severity", "information")))
        return notify(message, *a, **kw)

    app.notify = keep
    return app


def notes(app: ChatApp, severity: str = "error") -> list[str]:
    return [m for m, sev in app.said if sev == severity]


def last_note(app: ChatApp) -> str:
    return [m for m in app.query(ChatMessage) if m.role == "note"][-1].text


def tool_messages(app: ChatApp) -> list[dict]:
    return [item for m in app.session.messages() if m.role == "tool" for item in json.loads(m.content)]


# -- the config (no app) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, says",
    [
        ({"command": 3}, "mcpServers.x.command: must be a non-empty string"),
        ({"command": "a", "args": "b"}, "mcpServers.x.args: must be a list of strings"),
        ({"command": "a", "args": ["b", 2]}, "mcpServers.x.args[1]: must be a string"),
        ({"command": "a", "env": {"K": 1}}, "mcpServers.x.env.K: must be a string"),
        ({"url": "ftp://h/mcp"}, "mcpServers.x.url: must be an http:// or https:// URL"),
        ({"url": "http://h/mcp", "args": []}, 'mcpServers.x.args: only for a "command" server'),
        ({"command": "a", "url": "http://h"}, 'mcpServers.x: give "command" (stdio) or "url"'),
        ({}, 'mcpServers.x: needs "command" (stdio) or "url"'),
        ({"command": "a", "timeout": 0}, "mcpServers.x.timeout: must be a number of seconds > 0"),
        ({"command": "a", "comand": "b"}, "mcpServers.x.comand: unknown field"),
        ({"command": "a", "type": "http"}, "mcpServers.x.type: 'http' does not match"),
        ({"command": "a", "alwaysAllow": "add"}, "mcpServers.x.alwaysAllow: must be a list of strings"),
        ("npx", "mcpServers.x: must be an object"),
    ],
)
def test_a_bad_entry_is_named_and_the_others_still_load(tmp_path, entry, says):
    f = tmp_path / "mcp.json"
    f.write_text(json.dumps({"mcpServers": {"x": entry, "ok": {"url": "http://127.0.0.1:1/mcp"}}}))
    servers, errors = load_config(f)
    assert [s.name for s in servers] == ["ok"]
    assert len(errors) == 1 and says in errors[0], errors


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "not valid JSON"),
        ('{"mcpServers": []}', "mcpServers: must be an object of servers by name"),
        ("[1]", "mcpServers: must be an object"),
    ],
)
def test_a_bad_file_is_one_error(tmp_path, text, says):
    f = tmp_path / "mcp.json"
    f.write_text(text)
    servers, errors = load_config(f)
    assert servers == [] and len(errors) == 1 and says in errors[0], errors
    assert load_config(tmp_path / "absent.json") == ([], [])


# -- the app ---------------------------------------------------------------------------------------


async def test_tools_lists_servers_a_bad_entry_and_one_that_fails_to_start(engine, config, tmp_path):
    calc = stdio(tmp_path)
    calc["env"]["MCP_TEST_FORGE"] = "1"
    config({"calc": calc, "broken": stdio(tmp_path, "broken", "--crash"), "bad": {"command": "x", "env": []}})
    app = recording(ChatApp(engine=engine, sampling=dict(max_tokens=4, temperature=0.0)))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        errs = notes(app)
        assert any("mcpServers.bad.env: must be an object of strings" in e for e in errs), errs
        assert any("MCP server 'broken' failed to start" in e and "asked to crash at start" in e for e in errs), errs
        await app.run_command("/tools")
        await idle(pilot, app)
        listing = last_note(app)
        assert "**calc** (stdio, running)" in listing and "**broken** (stdio, failed)" in listing
        for tool in ("add", "fail", "die", "shout"):
            assert f"`{tool}`" in listing
        assert "mcpServers.bad.env" in listing
        # the chat goes on: the model is offered calc's tools and answers (tool_choice auto: in text),
        # but not the tool whose description holds control tokens (the SDK refuses it; said once)
        await ask(pilot, app, "Hello")
        assert [m.role for m in app.query(ChatMessage) if m.role != "note"] == ["user", "assistant"]
        assert app.session.messages()[-1].role == "assistant"
        assert sorted(t.name for t in app.session.tools) == ["add", "die", "fail", "shout"]  # they went with the turn
        warned = [n for n in notes(app, "warning") if "'forged' is not offered" in n]
        assert len(warned) == 1 and "control token" in warned[0], notes(app, "warning")
        assert not isinstance(app.screen, ModalScreen)


async def test_a_call_confirmed_once_runs_its_result_folded_and_read_by_the_model_and_a_denied_one_does_not(
    engine, config, tmp_path
):
    config({"calc": stdio(tmp_path)})
    app = recording(ChatApp(engine=engine, sampling=FAST, tool_choice="add"))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await ask(pilot, app, "What is 2 + 3?")
        assert isinstance(app.screen, ToolConfirmScreen)  # asked before anything ran
        assert calls(tmp_path) == [] and views(app)[0].status == "asking"
        await answer(pilot, app, "y")
        [v] = views(app)
        a, b = v.arguments["a"], v.arguments["b"]
        assert calls(tmp_path) == [f"add {json.dumps({'a': a, 'b': b})}"]
        assert v.status == "done" and v.result == str(a + b) and v.folder.collapsed  # shown folded
        [result] = tool_messages(app)
        assert result["name"] == "add" and result["content"] == str(a + b)  # the model read it
        roles = [m.role for m in app.session.messages()]
        assert roles == ["user", "assistant", "tool", "assistant"]
        shown = [m for m in app.query(ChatMessage) if m.role != "note"]
        assert [m.role for m in shown] == ["user", "assistant", "assistant"]
        assert "<tool_call>" not in shown[1].text  # the call's markup is the view, not text
        # the next message asks again (allowed once only); denied, it does not run and the model is told
        await ask(pilot, app, "And 4 + 4?")
        assert isinstance(app.screen, ToolConfirmScreen)
        await answer(pilot, app, "n")
        assert views(app)[1].status == "denied" and views(app)[1].is_error
        assert len(calls(tmp_path)) == 1  # the server never saw it
        denied = tool_messages(app)[1]
        assert denied["name"] == "add" and json.loads(denied["content"]) == {"error": DENIED}
        assert app.session.messages()[-1].role == "assistant"  # the model went on from the denial
        # Esc on the question denies too (it does not stop the round half way)
        await ask(pilot, app, "Again")
        await answer(pilot, app, "escape")
        assert [v.status for v in views(app)] == ["done", "denied", "denied"] and len(calls(tmp_path)) == 1
        conv = app.session.id
        # /tools off: the model is offered none (so no call, no question); /tools reload restarts the servers
        await app.run_command("/tools off")
        await ask(pilot, app, "No tools now")
        assert not isinstance(app.screen, ModalScreen) and len(views(app)) == 3
        assert (
            app.session.messages()[-1].role == "assistant" and "<tool_call>" not in app.session.messages()[-1].content
        )
        await app.run_command("/tools on")
        await app.run_command("/tools reload")
        await idle(pilot, app)
        assert "**calc** (stdio, running)" in last_note(app)
    # reopened, the stored calls and results are drawn as calls with their results folded
    app = recording(ChatApp(engine=engine, sampling=FAST, resume=conv))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        vs = views(app)
        assert [v.tool for v in vs] == ["add"] * 3 and all(v.result is not None and v.folder.collapsed for v in vs)
        assert vs[0].result == str(vs[0].arguments["a"] + vs[0].arguments["b"])
        assert [v.status for v in vs] == ["done", "denied", "denied"]


async def test_always_allow_asks_once_for_that_tool_over_streamable_http(engine, config, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MCP_TEST_CALLLOG=str(tmp_path / "web.calls"))
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], env=env, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):  # up to a minute on a loaded machine
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, "the test MCP server exited"
                await asyncio.sleep(0.05)
        config({"web": {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"X-Test": "1"}}})
        app = recording(ChatApp(engine=engine, sampling=FAST, tool_choice="add"))
        async with app.run_test(size=SIZE) as pilot:
            await idle(pilot, app)
            await app.run_command("/tools")
            await idle(pilot, app)
            assert "**web** (http, running)" in last_note(app)
            await ask(pilot, app, "2 + 2?")
            await answer(pilot, app, "a")
            await ask(pilot, app, "3 + 3?")  # no question this time
            assert not isinstance(app.screen, ModalScreen)
            assert [v.status for v in views(app)] == ["done", "done"]
            assert len(calls(tmp_path, "web")) == 2
            await app.run_command("/tools")
            await idle(pilot, app)
            assert "`add` *(always allowed)*" in last_note(app) and "`shout`: " in last_note(app)
    finally:
        proc.kill()
        proc.wait()


async def test_a_server_that_dies_is_a_notification_and_the_chat_goes_on(engine, config, tmp_path):
    # two servers with the same tools: each is offered as server_tool
    config({"a": stdio(tmp_path, "a"), "b": stdio(tmp_path, "b")})
    app = recording(ChatApp(engine=engine, sampling=FAST, tool_choice="a_die"))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        assert {t.exposed for t in app.mcp.tools()} >= {"a_die", "b_add"}
        await ask(pilot, app, "Die, please")
        await answer(pilot, app, "y")
        [v] = views(app)
        assert v.status == "failed" and "MCP server 'a' is not running" in v.result
        assert any("MCP server 'a' died" in e for e in notes(app)), notes(app)
        assert app.session.messages()[-1].role == "assistant"  # the model went on from the error
        assert "a_die" not in {t.exposed for t in app.mcp.tools()} and "b_add" in {t.exposed for t in app.mcp.tools()}
        # b is killed while idle: /tools finds it, says so, and the chat still answers (no tools left)
        os.kill(int((tmp_path / "b.pid").read_text()), signal.SIGKILL)
        await app.run_command("/tools")
        await idle(pilot, app)
        assert "**a** (stdio, died)" in last_note(app) and "**b** (stdio, died)" in last_note(app)
        assert any("MCP server 'b' died" in e for e in notes(app))
        app.tool_choice = "auto"
        await ask(pilot, app, "Still there?")
        assert app.session.messages()[-1].role == "assistant" and not isinstance(app.screen, ModalScreen)
