"""The ``chatkv`` command: a one-shot prompt or a terminal chat on the default (or any local) model.

    chatkv                          # chat in the terminal, saved (the Textual TUI comes in a later issue)
    chatkv "What is the capital of France?"
    chatkv --list                   # saved conversations, newest first
    chatkv --resume ID              # continue one; its KV comes back from disk
    chatkv --model ./my-llama-dir --temperature 0.7 "Tell me a joke"
    chatkv --kb python-docs [--sources 4] [--pin docs/intro.md]   # chat over a knowledge base
    chatkv ingest docs/ --kb python-docs; chatkv kb list | info | search | remove   (tui/kb_cli.py)

Only the public SDK is used here.
"""

from __future__ import annotations

import argparse
import sys

from chatkv import ChatKVError, InvalidRequest
from chatkv.engine import Engine
from chatkv.outputs import GenerationResult, Reply
from chatkv.sampling import SamplingParams


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatkv", description="Local chat whose KV cache survives between turns.")
    p.add_argument("prompt", nargs="?", help="ask once and exit; without it, chat interactively")
    p.add_argument("--model", help="a local Hugging Face model directory (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--stats", action="store_true", help="print token counts and timings after each reply")
    p.add_argument("--list", action="store_true", help="list saved conversations and exit")
    p.add_argument("--resume", metavar="ID", help="continue a saved conversation")
    p.add_argument("--title", default=None, help="title of a new saved conversation")
    p.add_argument("--kb", metavar="NAME", help="answer from this knowledge base (chatkv ingest ... --kb NAME)")
    p.add_argument("--sources", type=int, default=4, help="sources retrieved per message with --kb (default 4)")
    p.add_argument("--pin", action="append", default=None, metavar="SOURCE",
                   help="with --kb: a document placed in full after the system prompt (repeatable)")
    return p


def _one_shot(engine: Engine, messages: list[dict], params: SamplingParams, show_stats: bool) -> None:
    result = None
    for piece in engine.stream(engine.encode_chat(messages), params):
        if isinstance(piece, GenerationResult):
            result = piece
        else:
            print(piece, end="", flush=True)
    print()
    if show_stats and result is not None:
        print(f"[{result.usage.summary()}]", file=sys.stderr)


def _read_line() -> str | None:
    """One line of input (None at its end). A terminal gets line editing; piped input is read
    as bytes a line at a time, so a line that is not UTF-8 raises UnicodeDecodeError alone."""
    if sys.stdin.isatty():
        try:
            return input("> ")
        except EOFError:
            return None
    print("> ", end="", flush=True)
    buf = getattr(sys.stdin, "buffer", None)
    line = buf.readline().decode("utf-8") if buf is not None else sys.stdin.readline()
    return line.removesuffix("\n") if line else None


def _chat(session, params: SamplingParams, show_stats: bool, script: list[str] | None = None) -> int:
    """Chat on stdin, or answer the messages of ``script`` and return."""
    if script is None:
        print(f"chatkv: conversation {session.id}. Type a message; /exit or Ctrl-D to leave.", file=sys.stderr)
    lines = iter(script) if script is not None else None
    while True:
        try:
            line = _read_line() if lines is None else next(lines, None)
        except UnicodeDecodeError:
            print("chatkv: that line is not valid UTF-8; nothing was sent", file=sys.stderr)
            continue
        if line is None:
            print()
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if not text:
            continue
        reply = None
        try:
            for piece in session.stream(text, params):
                if isinstance(piece, Reply):
                    reply = piece
                else:
                    print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            continue
        except InvalidRequest as e:  # this message only: the chat goes on
            print(f"chatkv: {e}", file=sys.stderr)
            continue
        print()
        if reply is not None and reply.sources:
            _print_sources(reply.sources)
        if show_stats and reply is not None:
            print(f"[{reply.usage.summary()}]", file=sys.stderr)


def _print_sources(sources) -> None:
    for src in sources:
        mark = "*" if src.cited else " "
        where = f" - {src.heading}" if src.heading else ""
        print(f"{mark}[{src.number}] {src.source.rsplit('/', 1)[-1]}{where}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("ingest", "kb"):
        try:
            from chatkv.tui.kb_cli import run

            return run(argv)
        except ChatKVError as e:
            print(f"chatkv: {e}", file=sys.stderr)
            return 2
    args = _parser().parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
        )
        params.validate()
        engine = Engine.from_pretrained(args.model, dtype=args.dtype)
        if args.list:
            for c in engine.sessions():
                print(f"{c.id}  {c.updated_at:%Y-%m-%d %H:%M}  {c.title}")
            return 0
        if args.prompt is not None and args.kb is None:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            _one_shot(engine, messages + [{"role": "user", "content": args.prompt}], params, args.stats)
            return 0
        with engine:
            if args.resume:
                session = engine.resume(args.resume)
            else:
                kb = engine.knowledge_base(args.kb) if args.kb else None
                session = engine.session(
                    system=args.system, title=args.title, knowledge=kb, top_k=args.sources, documents=args.pin
                )
            if args.prompt is not None:  # one question over a knowledge base: a saved one-turn chat
                return _chat(session, params, args.stats, [args.prompt])
            return _chat(session, params, args.stats)
    except ChatKVError as e:
        print(f"chatkv: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
