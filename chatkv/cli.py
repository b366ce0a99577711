"""The ``chatkv`` command (the console script): which face answers it.

    chatkv [chat] [options] [PROMPT]           the terminal app, line mode or a one-shot: chatkv.tui.cli
    chatkv serve [options]                     the OpenAI-compatible HTTP server: chatkv.server.cli
                                               (with --ray, replicas on Ray Serve: chatkv.server.ray)
    chatkv ingest PATH... --kb NAME            documents into a knowledge base: chatkv.tui.kb_cli
    chatkv kb list | info | search | remove    knowledge bases: chatkv.tui.kb_cli

Each face is imported only for its own subcommand, and each parses its own options. Nothing here
loads Textual or the server stack (Starlette, uvicorn, prometheus_client, ray): ``chatkv --help``,
a one-shot and line mode never import them (the Textual app is imported by ``chatkv.tui.cli``
only when it opens; ``tests/test_cli_entry.py`` checks), and ``chatkv serve`` never loads the app.

    python -m chatkv.cli ...                   # the same command without the console script
"""

from __future__ import annotations

import sys

SERVE = "serve"
KNOWLEDGE = ("ingest", "kb")


def main(argv: list[str] | None = None) -> int:
    """Run ``chatkv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    if command == SERVE:
        from chatkv.server.cli import main as serve

        return serve(argv[1:])
    if command in KNOWLEDGE:
        from chatkv.tui.kb_cli import main as knowledge

        return knowledge(argv)
    from chatkv.tui.cli import main as chat  # `chatkv chat ...` too: the chat's own alias

    return chat(argv)


if __name__ == "__main__":
    sys.exit(main())
