"""Driving the Textual chat app with Pilot, for the app's tests (test_tui_app, test_tui_mcp):
waiting until it is idle, typing a message and sending it. The ``anyio_backend`` fixture these
tests need is in tests/conftest.py."""

from __future__ import annotations

import asyncio
from typing import Callable

from textual.screen import ModalScreen

from chatkv.tui.app import ChatApp
from chatkv.tui.widgets.chat import ChatInput, ChatMessage


async def idle(pilot, app: ChatApp, timeout: float = 30.0, starting: Callable[[ChatApp], bool] | None = None) -> None:
    """Until no reply is generating and no worker runs, ``starting(app)`` (something still
    getting ready, such as the MCP servers) is false, or a dialog is on screen: a worker (or a
    tool round's reply) that waits on a dialog waits for the user's answer, not for time."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        await pilot.pause()
        dialog = isinstance(app.screen, ModalScreen)
        busy = (app.generating or any(w.is_running for w in app.workers)) and not dialog
        if not busy and not (starting is not None and starting(app)):
            await pilot.pause()
            return
        assert loop.time() < end, "the app stayed busy"
        await asyncio.sleep(0.02)


async def send(pilot, app: ChatApp, text: str, **wait) -> None:
    """Type ``text`` into the input, press Enter and wait until the app is idle (``wait``: idle's)."""
    box = app.query_one(ChatInput)
    box.focus()
    box.text = text
    await pilot.press("enter")
    await idle(pilot, app, **wait)


def messages(app: ChatApp) -> list[ChatMessage]:
    return list(app.query(ChatMessage))
