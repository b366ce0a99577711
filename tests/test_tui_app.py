"""The Textual chat app driven by Pilot against a real engine (a tiny random llama) and a real
SQLite store: streaming, Esc, conversations (new, resume with restored KV, rename, archive,
delete), export, every slash command, a knowledge-base turn with sources, and errors."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("textual")

from chatkv.config import EngineConfig  # noqa: E402
from chatkv.engine import Engine  # noqa: E402
from chatkv.tui.app import ChatApp  # noqa: E402
from chatkv.tui.screens.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SettingsScreen  # noqa: E402
from chatkv.tui.widgets.chat import ChatInput, ChatMessage, StatusLine  # noqa: E402
from chatkv.tui.widgets.sidebar import ConversationItem  # noqa: E402
from chatkv.tui.widgets.sources import SourcesPanel  # noqa: E402
from chatkv.tui.widgets.text import safe_text  # noqa: E402
from tests.tiny import make_model  # noqa: E402

pytestmark = pytest.mark.anyio
SIZE = (100, 32)
FAST = dict(max_tokens=6, temperature=0.0)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tui-model")
    make_model(d, "llama", seed=3)
    return d


@pytest.fixture
def engine(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=128))
    yield e
    e.close()


async def idle(pilot, app: ChatApp, timeout: float = 30.0) -> None:
    """Wait until no reply is generating and every worker has finished."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        await pilot.pause()
        busy = app.generating or any(w.is_running for w in app.workers)
        if not busy:
            await pilot.pause()
            return
        assert loop.time() < end, "the app stayed busy"
        await asyncio.sleep(0.02)


async def say(pilot, app: ChatApp, text: str) -> None:
    box = app.query_one(ChatInput)
    box.focus()
    box.text = text
    await pilot.press("enter")
    await idle(pilot, app)


def messages(app: ChatApp) -> list[ChatMessage]:
    return list(app.query(ChatMessage))


def status(app: ChatApp) -> str:
    return str(app.query_one(StatusLine).render())


def errors(app: ChatApp) -> list[str]:
    return [n.message for n in app._notifications if n.severity == "error"]


async def test_send_streams_a_reply_and_the_status_line_shows_the_turn(engine):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        assert "ctx 0/" in status(app) and "KV " in status(app)
        await say(pilot, app, "What is the capital of France?")
        ms = messages(app)
        assert [m.role for m in ms] == ["user", "assistant"]
        stored = app.session.messages()
        assert ms[1].text == stored[-1].content and stored[-1].status != "interrupted"
        line = status(app)
        assert "computed" in line and "TTFT" in line and "tok/s" in line
        assert app.turn_timing["first_shown"] >= app.turn_timing["first_piece"]  # streamed piece by piece
        # Up recalls the last input; Shift+Enter / Ctrl+J add a line instead of sending
        box = app.query_one(ChatInput)
        box.focus()
        await pilot.press("up")
        assert box.text == "What is the capital of France?"
        box.text = ""
        await pilot.press("a", "ctrl+j", "b")
        assert box.text == "a\nb" and len(messages(app)) == 2
        # the sidebar lists the new conversation
        items = list(app.query(ConversationItem))
        assert [i.conv_id for i in items] == [app.session.id]
        # copy a message
        ms[1].focus()
        await pilot.press("c")
        assert app.clipboard_text == ms[1].text


async def test_escape_cancels_and_keeps_the_partial_reply(engine):
    app = ChatApp(engine=engine, sampling=dict(max_tokens=900, temperature=0.0, ignore_eos=True))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        # pilot.press waits for an idle app (the end of the reply), so the message goes in directly
        app.query_one(ChatInput).post_message(ChatInput.Submitted("Tell me a long story."))
        for _ in range(500):
            await asyncio.sleep(0.01)  # not pilot.pause: it waits for an idle app, i.e. the end of the reply
            if "first_shown" in app.turn_timing:
                break
        assert app.generating
        await pilot.press("escape")
        await idle(pilot, app)
        reply = messages(app)[-1]
        assert reply.interrupted
        stored = app.session.messages()[-1]
        assert stored.status == "interrupted" and stored.content
        assert len(app.session.tokens) < 900 + 40
        # the app is still usable
        await say(pilot, app, "Shorter, please.")
        assert len(messages(app)) == 4 and not errors(app)
