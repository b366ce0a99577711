"""Widgets of the chat app: messages, the input box, the sidebar, the status line, the sources panel."""
