"""Conversations as trees in the chat app: the branch shown, its messages' versions (the
``◀ 2/3 ▶`` switcher), switching between them, and editing a user message.

``BranchesMixin`` is mixed into ``ChatApp`` (tui/app.py) and uses its state and helpers. The
view shows the conversation's current branch (``session.messages()``); each message widget
knows its stored id and its siblings' (from one ``session.tree()``). A regenerate or an edit
streams into the view in place (tui/chat_turns.py); when the turn ends the view takes the stored
ids and versions, and is redrawn if what it shows is not the branch stored.
"""

from __future__ import annotations

from textual.containers import VerticalScroll

from chatkv.tui.widgets.chat import ChatInput, ChatMessage

SHOWN = ("user", "assistant")


def branch_view(session) -> list[tuple[object, list[int]]]:
    """On the engine thread: the current branch's user and assistant messages (and tool results),
    each with the ids of its versions (the messages sharing its parent, itself included, oldest first)."""
    versions: dict = {}
    for m in session.tree():
        versions.setdefault(m.parent_id, []).append(m.id)
    return [(m, sorted(versions.get(m.parent_id, [m.id]))) for m in session.messages() if m.role in SHOWN + ("tool",)]


class BranchesMixin:
    """The branch shown and its versions (part of ``ChatApp``)."""

    def _branch_widgets(self) -> list[ChatMessage]:
        """The messages of the branch in the view (not the app's notes), top to bottom."""
        return [
            w
            for w in self.query_one("#chat", VerticalScroll).children
            if isinstance(w, ChatMessage) and w.role in SHOWN
        ]

    async def _show_history(self) -> None:
        """Draw the conversation's current branch."""
        view = await self._call(branch_view, self.session, what="Messages") or []
        await self._draw(view)

    async def _draw(self, view) -> None:
        await self._clear_chat()
        widgets = []
        for m, versions in view:
            if self._tool_history(m, versions, widgets):  # tool calls and their results (tui/tool_turns.py)
                continue
            sources = (m.meta or {}).get("sources") or [] if m.role == "assistant" else []
            widgets.append(
                ChatMessage(
                    m.role,
                    m.content,
                    interrupted=m.status == "interrupted",
                    sources=sources,
                    message_id=m.id,
                    versions=versions,
                    id=self._new_id(),
                )
            )
        chat = self.query_one("#chat", VerticalScroll)
        if widgets:
            await chat.mount_all(widgets)
        chat.scroll_end(animate=False)

    async def _sync_branch_view(self) -> None:
        """After a turn: the messages shown take their stored ids and versions; a view that is not
        the stored branch (a turn that failed half way, an edit of a message not shown) is redrawn."""
        if self.session is None or self._quitting:
            return
        view = await self._call(branch_view, self.session, what="Messages")
        if view is None:
            return
        messages = [(m, v) for m, v in view if m.role in SHOWN]  # tool results are not messages of the view
        shown = self._branch_widgets()
        if [w.role for w in shown] != [m.role for m, _ in messages]:
            await self._draw(view)
            return
        for w, (m, versions) in zip(shown, messages):
            w.set_versions(m.id, versions)

    # -- editing a user message ---------------------------------------------------------

    def _editable(self) -> tuple[int, str] | None:
        """What Up on an empty input box edits: the branch's last user message (None: none yet,
        or a reply is being generated)."""
        if self.session is None or self.generating:
            return None
        users = [w for w in self._branch_widgets() if w.role == "user" and w.message_id is not None]
        return (users[-1].message_id, users[-1].text) if users else None

    def on_chat_message_edit(self, msg: ChatMessage.Edit) -> None:
        """``e`` on a message: a user message goes into the input box in edit mode."""
        w = msg.message
        if w.role != "user":
            self.notify(
                "Only your messages can be edited; /regenerate answers the last one again.", severity="information"
            )
        elif w.message_id is None or self.generating:
            self.notify("Wait for the reply to finish before editing.", severity="warning")
        else:
            self.query_one(ChatInput).start_edit(w.message_id, w.text)

    async def cmd_edit(self, arg: str) -> None:
        """``/edit``: the branch's last user message into the input box, in edit mode."""
        last = self._editable()
        if last is None:
            self.notify("There is no message of yours to edit yet.", severity="warning")
            return
        self.query_one(ChatInput).start_edit(*last)

    def edit(self, message_id: int, text: str) -> None:
        if not self._can_act("editing a message"):
            return
        self.run_worker(self._edit(message_id, text), exclusive=False)

    # -- switching versions -------------------------------------------------------------

    def on_chat_message_branch(self, msg: ChatMessage.Branch) -> None:
        self.run_worker(self._step_branch(msg.message, msg.step))

    async def cmd_branch(self, arg: str) -> None:
        """``/branch prev|next``: the focused message's other version, else that of the last message
        shown that has versions."""
        step = {"prev": -1, "previous": -1, "next": 1}.get(arg.lower())
        if step is None:
            self.notify("Usage: /branch prev|next", severity="warning")
            return
        focused = self.focused if isinstance(self.focused, ChatMessage) else None
        if focused is None or len(focused.versions) < 2:
            focused = next((w for w in reversed(self._branch_widgets()) if len(w.versions) > 1), None)
        if focused is None:
            self.notify("No message shown has another version (edit one, or /regenerate).", severity="information")
            return
        await self._step_branch(focused, step)

    async def _step_branch(self, w: ChatMessage, step: int) -> None:
        """Make the version ``step`` away from ``w``'s current (``session.switch``) and draw its branch."""
        if not self._can_act("switching to another version"):
            return
        if w.message_id is None or w.message_id not in w.versions or len(w.versions) < 2:
            self.notify("This message has no other version.", severity="information")
            return
        j = w.versions.index(w.message_id) + step
        if not 0 <= j < len(w.versions):
            self.notify("No earlier version." if step < 0 else "No later version.", severity="information")
            return
        position = self._branch_widgets().index(w) if w in self._branch_widgets() else None
        session, target = self.session, w.versions[j]

        def switch() -> bool:
            session.switch(target)
            return True

        if not await self._call(switch, what="Branch"):
            return
        self.last_usage = None
        await self._show_history()
        await self._refresh_status()
        shown = self._branch_widgets()
        if position is not None and position < len(shown):
            shown[position].focus()  # the arrows keep working on the version now shown
            shown[position].scroll_visible(animate=False)
