"""Conversation management of the chat app: new chat, open (resume), rename, archive, delete.

``ConversationsMixin`` is mixed into ``ChatApp`` (tui/app.py) and uses its state and helpers;
the sidebar's messages are routed here by the app.
"""

from __future__ import annotations

from chatkv.tui.screens.dialogs import ConfirmScreen, PromptScreen
from chatkv.tui.widgets.chat import ChatInput
from chatkv.tui.widgets.titles import one_line


class ConversationsMixin:
    """Saved conversations (part of ``ChatApp``)."""

    async def _close_session(self) -> None:
        if self.session is not None:
            s, self.session = self.session, None
            await self._call(s.close, what="Close")

    async def new_chat(self, note: str | None = None) -> None:
        if not self._can_act("starting a new chat"):
            return
        await self._close_session()
        self.last_usage = None
        await self._clear_chat()
        if note:
            await self.note(note)
        await self._refresh_sidebar()
        await self._refresh_status()
        self.query_one(ChatInput).focus()

    async def open_message(self, conv_id: str, message_id: int) -> None:
        """Open conversation ``conv_id`` (a search hit's) on the branch through ``message_id``, that
        message in view."""
        if not self._can_act("opening a search result"):
            return
        if self.session is None or self.session.id != conv_id:
            await self._open(conv_id, message_id)
        else:
            session = self.session

            def switch() -> bool:
                session.switch(message_id)
                return True

            if await self._call(switch, what="Open"):
                self.last_usage = None
                await self._show_history()
                await self._refresh_status()
        for w in self._branch_widgets():
            if w.message_id == message_id:
                w.focus()
                w.scroll_visible(animate=False)
                break

    async def _open(self, conv_id: str, message_id: int | None = None) -> None:
        """Resume conversation ``conv_id`` (``message_id``: on the branch through that message)."""
        if not self._can_act("opening another conversation"):
            return
        if self.session is not None and self.session.id == conv_id:
            return
        if conv_id == "latest":
            convs = await self._call(self.engine.sessions, what="Conversations") or []
            if not convs:
                self.notify("There is no saved conversation yet; this is a new chat.", severity="information")
                await self._refresh_sidebar()
                return
            conv_id = convs[0].id
        await self._close_session()
        s = await self._call(self.engine.resume, conv_id, what="Open")
        if s is None:
            await self._refresh_sidebar()
            return
        if message_id is not None:

            def switch() -> bool:
                s.switch(message_id)
                return True

            await self._call(switch, what="Open")  # a failure is said; the conversation opens as it was
        self.session = s
        self.system = s.system
        self.params = dict(s.params)
        self.kb_name = s.knowledge.name if getattr(s, "knowledge", None) is not None else None
        self.documents = list(getattr(s, "documents", []) or [])
        self.last_usage = None
        await self._show_history()
        await self._refresh_sidebar()
        await self._refresh_status()
        self.query_one(ChatInput).focus()

    async def manage(self, what: str, conv_id: str, title: str | None = None, new_title: str | None = None) -> None:
        """Rename, archive or delete a saved conversation (delete asks first)."""
        if not self._can_act(f"{what}"):
            return
        if what == "rename" and new_title is None:
            new_title = await self.push_screen_wait(PromptScreen("New title:", title or ""))
            if not new_title or not new_title.strip():
                return
        if what == "delete":
            ok = await self.push_screen_wait(ConfirmScreen(f"Delete “{one_line(title, 40)}” and its messages?"))
            if not ok:
                return
        current = self.session is not None and self.session.id == conv_id

        def run():
            s = self.session if current else self.engine.resume(conv_id)
            if what == "rename":
                s.rename(new_title.strip())
            elif what == "archive":
                s.archive(True)
            elif what == "delete":
                s.delete()
                return True
            if not current:
                s.close()
            return True

        if not await self._call(run, what=what.capitalize()):
            await self._refresh_sidebar()
            return
        if current and what == "delete":
            self.session = None
            self.last_usage = None
            await self._clear_chat()
        elif current and what == "archive":
            await self._close_session()
            await self._clear_chat()
        self.notify({"rename": "Renamed.", "archive": "Archived.", "delete": "Deleted."}[what], timeout=2)
        await self._refresh_sidebar()

    def _manage_current(self, what: str) -> None:
        if self.session is None:
            self.notify("This chat is not saved yet.", severity="warning")
            return
        self.run_worker(self.manage(what, self.session.id, self.session.title))
