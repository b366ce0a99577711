"""The Textual chat app driven by Pilot against a real engine (a tiny random llama) and a real
SQLite store: streaming, Esc, conversations (new, resume with restored KV, rename, archive,
delete), export, every slash command, a knowledge-base turn with sources, and errors."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("textual")

from chatkv.config import EngineConfig  # noqa: E402
from chatkv.engine.core import Engine  # noqa: E402
from chatkv.tui.app import ChatApp  # noqa: E402
from chatkv.tui.screens.dialogs import ConfirmScreen, HelpScreen, PromptScreen, SettingsScreen  # noqa: E402
from chatkv.tui.screens.search import SearchScreen  # noqa: E402
from chatkv.tui.widgets.chat import EDITING, ChatInput, ChatMessage, StatusLine  # noqa: E402
from chatkv.tui.widgets.sidebar import ConversationItem  # noqa: E402
from chatkv.tui.widgets.sources import SourcesPanel  # noqa: E402
from chatkv.tui.widgets.titles import safe_text  # noqa: E402
from tests.support.pilot import idle, messages  # noqa: E402
from tests.support.pilot import send as say  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.tiny_model("llama", seed=3)]
SIZE = (100, 32)
FAST = dict(max_tokens=6, temperature=0.0)


@pytest.fixture
def engine(model_dir, tmp_path):
    e = Engine(model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=128))
    yield e
    e.close()


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


async def test_new_chat_and_resume_after_a_restart_restores_the_kv(model_dir, tmp_path):
    data = tmp_path / "data"
    e1 = Engine(model_dir, EngineConfig(data_dir=str(data), num_blocks=128))
    app = ChatApp(engine=e1, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "Hello there, how are you?")
        first = app.session.id
        await pilot.press("ctrl+n")
        await idle(pilot, app)
        assert app.session is None and not messages(app)  # a new chat, saved on its first message
        await say(pilot, app, "What is the capital of France?")
        assert app.session.id != first
        assert [i.conv_id for i in app.query(ConversationItem)] == [app.session.id, first]  # newest first
    e1.close()

    e2 = Engine(model_dir, EngineConfig(data_dir=str(data), num_blocks=128))  # a restart
    try:
        app = ChatApp(engine=e2, resume=first, sampling=FAST)
        async with app.run_test(size=SIZE) as pilot:
            await idle(pilot, app)
            assert app.session.id == first
            assert [m.role for m in messages(app)] == ["user", "assistant"]
            assert messages(app)[0].text == "Hello there, how are you?"
            await say(pilot, app, "And tomorrow?")
            restored = app.last_usage.restored_tokens
            assert restored > 0 and f"{restored} restored" in status(app)
            # opening the other conversation from the sidebar shows its history
            lv = app.query_one("#conversations")
            lv.focus()
            ids = [i.conv_id for i in app.query(ConversationItem)]
            lv.index = ids.index(next(i for i in ids if i != first))
            await pilot.press("enter")
            await idle(pilot, app)
            assert app.session.id != first and messages(app)[0].text == "What is the capital of France?"
        app = ChatApp(engine=e2, resume="latest", sampling=FAST)
        async with app.run_test(size=SIZE) as pilot:
            await idle(pilot, app)
            assert app.session is not None and app.session.id == e2.sessions()[0].id
    finally:
        e2.close()


async def test_rename_archive_delete_from_the_sidebar(engine):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "first chat")
        a = app.session.id
        await pilot.press("ctrl+n")
        await idle(pilot, app)
        await say(pilot, app, "second chat")
        b = app.session.id
        lv = app.query_one("#conversations")
        lv.focus()
        ids = [i.conv_id for i in app.query(ConversationItem)]
        lv.index = ids.index(a)
        await pilot.press("r")
        await idle(pilot, app)
        assert isinstance(app.screen, PromptScreen)
        app.screen.query_one("#answer").value = "Renamed \x1b]0;evil\x07chat"
        await pilot.press("enter")
        await idle(pilot, app)
        titles = {c.id: c.title for c in engine.sessions()}
        assert titles[a] == "Renamed \x1b]0;evil\x07chat"
        shown = [i.title for i in app.query(ConversationItem)]
        assert "Renamed \x1b]0;evil\x07chat" in shown
        label = str(app.query(ConversationItem)[ids.index(a)].query_one(".title").render())
        assert "\x1b" not in label and "Renamed chat" in label  # control sequences stripped on screen

        lv.index = [i.conv_id for i in app.query(ConversationItem)].index(a)
        await pilot.press("a")
        await idle(pilot, app)
        assert a not in [c.id for c in engine.sessions()] and a in [
            c.id for c in engine.sessions(include_archived=True)
        ]
        assert a not in [i.conv_id for i in app.query(ConversationItem)]

        lv.focus()
        lv.index = [i.conv_id for i in app.query(ConversationItem)].index(b)
        await pilot.press("d")
        await idle(pilot, app)
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")  # No: nothing deleted
        await idle(pilot, app)
        assert b in [c.id for c in engine.sessions()]
        await pilot.press("d")
        await idle(pilot, app)
        await pilot.press("y")
        await idle(pilot, app)
        assert b not in [c.id for c in engine.sessions(include_archived=True)]
        assert app.session is None and not messages(app)  # it was the open chat


async def test_export_markdown_and_json(engine, tmp_path):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "Export me, please.")
        reply = messages(app)[-1].text
        await say(pilot, app, f"/export md {tmp_path / 'chat.md'}")
        await say(pilot, app, f"/export json {tmp_path / 'chat.json'}")
        md = (tmp_path / "chat.md").read_text()
        assert "### User" in md and "Export me, please." in md and reply.strip()[:10] in md
        data = json.loads((tmp_path / "chat.json").read_text())
        assert data["id"] == app.session.id
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
        assert data["messages"][0]["content"] == "Export me, please."
        await say(pilot, app, "/export pdf")
        assert not errors(app)  # a usage warning, not an error
        await say(pilot, app, f"/export md {tmp_path / 'missing-dir' / 'x.md'}")
        assert errors(app)  # the OSError is a notification


async def test_slash_commands(engine, model_dir, tmp_path):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "/help")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await idle(pilot, app)
        await say(pilot, app, "/stats")
        assert "No turns" in messages(app)[-1].text
        await say(pilot, app, "/system You are terse.")
        assert app.system == "You are terse." and app.session is None
        await say(pilot, app, "Name a prime.")
        assert app.session.system == "You are terse."
        await say(pilot, app, "/regenerate")
        users = [m.text for m in messages(app) if m.role == "user"]
        assert users == ["Name a prime."]  # answered again in place, not asked again as a new turn
        await say(pilot, app, "And another?")
        await say(pilot, app, "/stats")
        assert "| 2 |" in messages(app)[-1].text and "KV pool" in messages(app)[-1].text
        assert f"{engine.kv_dtype}, {engine.kv_bytes_per_token} bytes a token" in messages(app)[-1].text
        await say(pilot, app, "/settings")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature").value = "0.5"
        app.screen.query_one("#max_tokens").value = "3"
        await pilot.press("ctrl+s")
        await idle(pilot, app)
        assert app.params["temperature"] == 0.5 and app.params["max_tokens"] == 3
        assert app.session.params["max_tokens"] == 3  # saved with the conversation, not only in the app
        await say(pilot, app, "Short?")
        assert app.last_usage.generated_tokens <= 3
        assert (
            engine.session_manager.store.get_conversation(app.session.id).params["max_tokens"] == 3
        )  # in the database
        await say(pilot, app, "/bogus")
        assert any("Unknown command" in e for e in errors(app))
        await say(pilot, app, "/new")
        assert app.session is None
        # an error path: a bad model path is a notification, and the app goes on with the old model
        n = len(errors(app))
        await say(pilot, app, f"/model {tmp_path / 'no-such-model'}")
        assert len(errors(app)) == n + 1 and "does not exist" in errors(app)[-1]
        assert app.engine is engine
        await say(pilot, app, "Still there?")
        assert messages(app)[-1].role == "assistant" and app.session is not None
        # a good path loads it (and the app closes it on exit)
        await say(pilot, app, f"/model {model_dir}")
        assert app.engine is not engine and app.session is None
        await say(pilot, app, "Hi again")
        assert [m.role for m in messages(app)][-2:] == ["user", "assistant"]
        # the command palette lists the same actions
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for t in (
            "New chat",
            "Regenerate",
            "Sources",
            "Stats",
            "Export Markdown",
            "Export JSON",
            "Knowledge base…",
            "Ingest…",
            "Pin document…",
            "Load model…",
            "System prompt…",
            "Help",
        ):
            assert t in titles


async def test_knowledge_base_question_shows_sources(engine, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "kettles.md").write_text(
        "# Kettles\n\nThe Brewmaster kettle boils a litre of water in ninety seconds. "
        "Descale its base monthly with citric acid.\n"
    )
    (docs / "bread.md").write_text("# Bread\n\nSourdough rises with a starter of wild yeast. Proof it overnight.\n")
    (docs / "blob.bin").write_bytes(b"\x00\x01\x02binary\x00" * 50)
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "/sources")
        await say(pilot, app, "/kb manuals")
        assert app.kb_name == "manuals"
        await say(pilot, app, f"/ingest {docs}")
        note = messages(app)[-1].text
        assert "Ingested into" in note and "skipped" in note and "blob.bin" in note  # per-file errors listed
        assert any(n.severity == "warning" and "blob.bin" in n.message for n in app._notifications)
        await say(pilot, app, "How often should the kettle be descaled?")
        reply = messages(app)[-1]
        assert reply.sources and any("kettles.md" in s["source"] for s in reply.sources)
        assert "Sources:" in str(reply.sources_line.render())
        await say(pilot, app, "/sources")
        panel = app.query_one(SourcesPanel)
        assert panel.display and "kettles.md" in panel.query_one("#sources-body").source
        await app.run_action(f"app.open_source('{reply.id}', {reply.sources[0]['number']})")
        assert panel.display
        source = next(s["source"] for s in reply.sources if "kettles.md" in s["source"])
        await say(pilot, app, f"/pin {source}")
        assert app.documents == [source] and app.session is None
        await say(pilot, app, "/pin nope.md")
        assert any("not a document" in e for e in errors(app))
        await say(pilot, app, "And the bread?")
        assert app.session.documents == [source]
        # a resumed RAG chat shows its stored sources under the reply
        conv = app.session.id
        await pilot.press("ctrl+n")
        await idle(pilot, app)
        app.run_worker(app._open(conv))
        await idle(pilot, app)
        assert messages(app)[-1].sources


def test_safe_text_strips_control_sequences():
    assert safe_text("a\x1b[31mred\x1b[0m b") == "ared b"
    assert safe_text("t\x1b]0;title\x07x\x1b]8;;http://e\x1b\\y") == "txy"
    assert safe_text("keep\nnew\tlines\r\x07\x9b2J\x90dcs\x9c") == "keep\nnew\tlines"
    assert safe_text(None) == ""


async def test_quitting_mid_reply_saves_what_was_produced(engine):
    app = ChatApp(engine=engine, sampling=dict(max_tokens=900, temperature=0.0, ignore_eos=True))
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        app.query_one(ChatInput).post_message(ChatInput.Submitted("Go on and on."))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if "first_shown" in app.turn_timing:
                break
        assert app.generating
        conv = app.session.id
        await pilot.press("ctrl+q")
    last = engine.resume(conv).messages()[-1]
    assert last.role == "assistant" and last.status == "interrupted" and last.content


async def test_a_message_typed_while_the_model_loads_is_answered_once_it_is_ready(model_dir, tmp_path, monkeypatch):
    """While the model converts, a question typed at once must not land in the sidebar's filter
    box and go unasked: the input box has the focus from the first frame; what is sent before the
    model is ready waits, then is answered. The load is a real one; it is only held until the
    question has been typed."""
    import threading

    typed = threading.Event()
    real = Engine.from_pretrained.__func__

    def slow_load(cls, *a, **kw):
        assert typed.wait(60), "the test never typed"
        return real(cls, *a, **kw)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(slow_load))
    app = ChatApp(model=model_dir, data_dir=str(tmp_path / "data"), sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.engine is None and isinstance(app.focused, ChatInput)
        await pilot.press(*"Hello early")
        await pilot.press("enter")
        await pilot.pause()
        assert any("Waiting for the model to load" in m.text for m in messages(app))
        typed.set()
        loop = asyncio.get_running_loop()
        end = loop.time() + 120
        while app.session is None or app._loading or app.generating:
            assert loop.time() < end, "the early message was never answered"
            await asyncio.sleep(0.05)
        await idle(pilot, app)
        assert [(m.role, m.text) for m in messages(app)][:1] == [("user", "Hello early")]
        assert [m.role for m in messages(app)] == ["user", "assistant"]  # the waiting note is gone
        stored = app.session.messages()
        assert [(m.role, m.content) for m in stored][0] == ("user", "Hello early") and stored[1].role == "assistant"
        assert isinstance(app.focused, ChatInput)
    app.engine.close()


# -- conversations as trees: regenerate in place, edit, the branch switcher, search --


def switcher(w: ChatMessage) -> str:
    """The ``◀ i/n ▶`` line under a message ('' when it is hidden: a message with one version)."""
    if not w.switcher.display:
        return ""
    return "".join(str(part.render()) for part in (w.switcher.prev, w.switcher.label, w.switcher.next))


async def test_regenerate_streams_into_the_reply_in_place_and_the_switcher_flips_back(engine):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "Name a colour.")
        user, reply = messages(app)
        old = reply.message_id
        assert old == app.session.messages()[-1].id and switcher(reply) == ""  # one version: no switcher
        await say(pilot, app, "/regenerate")
        assert messages(app) == [user, reply]  # the same widgets: the reply was streamed into in place
        stored = app.session.messages()
        assert [m.role for m in stored] == ["user", "assistant"] and stored[-1].id != old
        assert reply.message_id == stored[-1].id and reply.text == safe_text(stored[-1].content)
        assert [m.id for m in app.session.branches(stored[-1].id)] == [old, stored[-1].id]  # the old one is kept
        assert reply.versions == [old, stored[-1].id] and switcher(reply) == "◀ 2/2 ▶"
        u = app.last_usage  # the history's KV was reused: only its last partial block is computed
        assert u.cached_tokens > 0 and u.computed_tokens <= engine.config.block_size
        # a click on ◀ shows the old reply (its branch is current), ▶ goes back
        await pilot.click(reply.switcher.prev)
        await idle(pilot, app)
        assert app.session.messages()[-1].id == old
        shown = messages(app)
        assert [m.role for m in shown] == ["user", "assistant"] and shown[-1].message_id == old
        assert switcher(shown[-1]) == "◀ 1/2 ▶" and shown[-1].text == safe_text(app.session.messages()[-1].content)
        # the keys on the focused message, and /branch
        assert app.focused is shown[-1]
        await pilot.press("right")
        await idle(pilot, app)
        assert app.session.messages()[-1].id == stored[-1].id and switcher(messages(app)[-1]) == "◀ 2/2 ▶"
        await say(pilot, app, "/branch prev")
        assert app.session.messages()[-1].id == old and switcher(messages(app)[-1]) == "◀ 1/2 ▶"
        await say(pilot, app, "/branch prev")  # no earlier version: said, nothing changes
        assert app.session.messages()[-1].id == old and not errors(app)
        await say(pilot, app, "/branch sideways")
        assert app.session.messages()[-1].id == old and not errors(app)
        # the next turn follows the branch shown
        await say(pilot, app, "And another?")
        assert [m.parent_id for m in app.session.messages()][2] == old


async def test_up_on_an_empty_input_edits_the_last_message_and_the_view_shows_the_new_branch(engine):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "First question.")
        await say(pilot, app, "Second question.")
        old = app.session.messages()
        box = app.query_one(ChatInput)
        box.focus()
        await pilot.press("up")
        assert box.text == "Second question." and box.edit_of == old[2].id
        assert box.has_class("editing") and box.border_title == EDITING  # visibly marked
        await pilot.press("escape")  # leaves edit mode
        assert box.edit_of is None and not box.has_class("editing") and box.text == ""
        await pilot.press("up")
        box.text = "Second question, edited."
        await pilot.press("enter")
        await idle(pilot, app)
        assert box.edit_of is None and not box.has_class("editing")
        stored = app.session.messages()
        assert [m.content for m in stored[:3]] == ["First question.", old[1].content, "Second question, edited."]
        assert stored[2].parent_id == old[1].id and len(stored) == 4
        shown = messages(app)
        assert [(m.role, m.message_id) for m in shown] == [(m.role, m.id) for m in stored]
        assert shown[2].text == "Second question, edited." and switcher(shown[2]) == "◀ 2/2 ▶"
        assert shown[3].text == safe_text(stored[3].content) and switcher(shown[3]) == ""
        assert [m.id for m in app.session.branches(stored[2].id)] == [old[2].id, stored[2].id]
        # e on a focused user message edits that one (here the first: a new root)
        shown[0].focus()
        await pilot.press("e")
        assert box.edit_of == stored[0].id and box.text == "First question." and app.focused is box
        box.text = "First question, edited."
        await pilot.press("enter")
        await idle(pilot, app)
        shown = messages(app)
        assert [m.text for m in shown][:1] == ["First question, edited."] and len(shown) == 2
        assert switcher(shown[0]) == "◀ 2/2 ▶"
        # ◀ on it goes back to the first branch, down to its newest leaf (the edited second question)
        await pilot.click(shown[0].switcher.prev)
        await idle(pilot, app)
        assert [m.text for m in messages(app)][::2] == ["First question.", "Second question, edited."]
        # e on a reply says only your messages can be edited
        messages(app)[1].focus()
        await pilot.press("e")
        assert box.edit_of is None and not errors(app)


async def test_search_opens_the_conversation_and_the_branch_of_the_hit(engine):
    app = ChatApp(engine=engine, sampling=FAST)
    async with app.run_test(size=SIZE) as pilot:
        await idle(pilot, app)
        await say(pilot, app, "Tell me about kettles.")
        a = app.session.id
        kettles = app.session.messages()[0].id
        box = app.query_one(ChatInput)
        await pilot.press("up")
        box.text = "Tell me about teapots."
        await pilot.press("enter")
        await idle(pilot, app)
        assert app.session.messages()[0].content == "Tell me about teapots."  # the kettle branch is not current
        await pilot.press("ctrl+n")
        await idle(pilot, app)
        await say(pilot, app, "Something else entirely.")
        b = app.session.id
        # Ctrl+F: the dialog, the words typed, Enter, the hits
        await pilot.press("ctrl+f")
        await idle(pilot, app)
        assert isinstance(app.screen, SearchScreen)
        app.screen.query_one("#query").value = "kettles"
        app.screen.query_one("#query").focus()
        await pilot.press("enter")
        await idle(pilot, app)
        hits = app.screen.hits
        assert [(h.conversation_id, h.message.id) for h in hits] == [(a, kettles)]
        assert "kettles" in hits[0].snippet and hits[0].title
        assert "1 found" in str(app.screen.query_one("#search-status").render())
        await pilot.press("enter")  # opens the highlighted hit
        await idle(pilot, app)
        assert not isinstance(app.screen, SearchScreen)
        assert app.session.id == a and app.session.messages()[0].id == kettles
        shown = messages(app)
        assert shown[0].text == "Tell me about kettles." and shown[0].message_id == kettles
        assert switcher(shown[0]) == "◀ 1/2 ▶" and app.focused is shown[0]
        # /search TEXT from the input box, on the open conversation's other branch; Esc closes it
        await say(pilot, app, "/search teapots")
        assert isinstance(app.screen, SearchScreen) and len(app.screen.hits) == 1
        await pilot.press("enter")
        await idle(pilot, app)
        assert app.session.id == a and app.session.messages()[0].content == "Tell me about teapots."
        await say(pilot, app, "/search zebra")
        assert isinstance(app.screen, SearchScreen) and app.screen.hits == []
        assert "No message holds" in str(app.screen.query_one("#search-status").render())
        await pilot.press("escape")
        await idle(pilot, app)
        assert not isinstance(app.screen, SearchScreen) and app.session.id == a and b != a and not errors(app)


async def test_the_status_line_and_the_stored_reply_carry_chunk_kv_reuse(model_dir, tmp_path):
    """With rag_kv_reuse on, a RAG turn's status line says how many source tokens were placed
    from chunk KV and how many recomputed, and the stored reply keeps both (migration 0007):
    ``Usage.from_message`` reads them back."""
    e = Engine(
        model_dir, EngineConfig(data_dir=str(tmp_path / "data"), num_blocks=128, rag_kv_reuse="edge", rag_edge_tokens=2)
    )
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "kettles.md").write_text(
        "# Kettles\n\nThe Brewmaster kettle boils a litre of water in ninety seconds. "
        "Descale its base monthly with citric acid.\n"
    )
    try:
        app = ChatApp(engine=e, sampling=FAST)
        async with app.run_test(size=SIZE) as pilot:
            await idle(pilot, app)
            await say(pilot, app, "/kb manuals")
            await say(pilot, app, f"/ingest {docs}")
            await say(pilot, app, "How often should the kettle be descaled?")
            assert app.last_usage.reused_tokens == 0  # first seen: computed as off would; its KV made when idle
            from chatkv.rag import background

            assert background.settle(e, timeout=120)
            await say(pilot, app, "And how often should the kettle be descaled, again?")
            u = app.last_usage
            assert u.reused_tokens > 0 and u.recomputed_tokens == 2 * len(messages(app)[-1].sources)
            assert f"{u.reused_tokens} reused · {u.recomputed_tokens} recomputed" in status(app)
            stored = app.session.messages()[-1]
            assert (stored.reused_tokens, stored.recomputed_tokens) == (u.reused_tokens, u.recomputed_tokens)
            from chatkv.outputs import Usage

            again = Usage.from_message(stored)  # as a resumed chat's stats read it
            assert (again.reused_tokens, again.recomputed_tokens) == (u.reused_tokens, u.recomputed_tokens)
            await pilot.press("ctrl+n")
            await idle(pilot, app)
            assert "reused" not in status(app)  # a new chat has no turn yet
    finally:
        e.close()
