"""Modal screens of the chat app: confirm, ask for a line, settings, help."""
