"""Snapshots (pytest-textual-snapshot) of the app's main screens at 100x32, against a real tiny
engine and store. Volatile figures are masked (``mask_volatile``: dates, TTFT, tok/s); the replies
come from a seeded tiny model decoded greedily, so they repeat. Update with --snapshot-update."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pytest_textual_snapshot")

from chatkv.tui.app import ChatApp  # noqa: E402
from tests.support.pilot import idle  # noqa: E402
from tests.tui.test_tui_app import engine  # noqa: E402,F401  (the same fixture: tiny model, real engine)

# the same tiny model as tests/tui/test_tui_app.py (conftest's model_dir builds it): the replies repeat
pytestmark = pytest.mark.tiny_model("llama", seed=3)

SIZE = (100, 32)
FAST = dict(max_tokens=8, temperature=0.0)


def saved_chats(engine) -> str:
    """Two saved conversations; returns the id of the one with turns."""
    with engine.session(title="Packing list", params=FAST) as s:
        pass
    with engine.session(title="Trip to Paris", params=FAST) as s:
        s.send("What is the capital of France?")
        s.send("And its river?")
    return s.id


def test_new_chat_with_the_sidebar(snap_compare, engine):
    saved_chats(engine)
    app = ChatApp(engine=engine, sampling=FAST, mask_volatile=True)

    async def settle(pilot):
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=settle)


def test_resumed_chat_and_its_status_line(snap_compare, engine):
    conv = saved_chats(engine)
    app = ChatApp(engine=engine, resume=conv, sampling=FAST, mask_volatile=True)

    async def turn(pilot):
        await idle(pilot, app)
        app.send("One more thing?")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=turn)


def test_help_screen(snap_compare, engine):
    app = ChatApp(engine=engine, sampling=FAST, mask_volatile=True)

    async def help_(pilot):
        await idle(pilot, app)
        await app.run_command("/help")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=help_)


def test_settings_dialog(snap_compare, engine):
    app = ChatApp(
        engine=engine, system="You are terse.", sampling=dict(temperature=0.7, max_tokens=64), mask_volatile=True
    )

    async def settings(pilot):
        await idle(pilot, app)
        app.action_settings()
        await idle(pilot, app)
        await asyncio.sleep(0.6)  # past a cursor blink (0.5 s): the focused field's cursor stays drawn
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=settings)


def test_delete_confirmation(snap_compare, engine):
    saved_chats(engine)
    app = ChatApp(engine=engine, sampling=FAST, mask_volatile=True)

    async def delete(pilot):
        await idle(pilot, app)
        app.query_one("#conversations").focus()
        await pilot.press("down", "d")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=delete)


def test_a_regenerated_reply_and_its_branch_switcher(snap_compare, engine):
    """/regenerate in place: the reply's ◀ 2/2 ▶."""
    conv = saved_chats(engine)
    app = ChatApp(engine=engine, resume=conv, sampling=FAST, mask_volatile=True)

    async def regenerate(pilot):
        await idle(pilot, app)
        await app.run_command("/regenerate")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=regenerate)


def test_editing_the_last_message(snap_compare, engine):
    """Up on an empty input: the last user message in the input box, in marked edit mode."""
    conv = saved_chats(engine)
    app = ChatApp(engine=engine, resume=conv, sampling=FAST, mask_volatile=True)

    async def edit(pilot):
        await idle(pilot, app)
        await pilot.press("up")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=edit)


def test_search_dialog_with_its_hits(snap_compare, engine):
    saved_chats(engine)
    app = ChatApp(engine=engine, sampling=FAST, mask_volatile=True)

    async def search(pilot):
        await idle(pilot, app)
        await app.run_command("/search capital river")
        await idle(pilot, app)

    assert snap_compare(app, terminal_size=SIZE, run_before=search)
