"""The chat face of the ``chatkv`` command: the terminal app, a one-shot prompt, or a plain line-mode chat.

    chatkv                          # the Textual app (tui/app.py) when stdin and stdout are terminals
    chatkv chat                     # the same
    echo "What is the capital of France?" | chatkv    # not a terminal: plain line mode, replies on stdout
    chatkv --plain                  # line mode in a terminal too
    chatkv "What is the capital of France?"           # one-shot
    chatkv --list                   # saved conversations, newest first
    chatkv --search "paris trip"    # messages of every saved conversation (every branch) holding those words
    chatkv --resume [ID]            # continue one (no id: the latest); its KV comes back from disk
    chatkv --model ./my-llama-dir --temperature 0.7 "Tell me a joke"
    chatkv --model ~/models/my-model.Q4_K_M.gguf "Hi"    # a GGUF file, prepared once into the data dir
    chatkv --data-dir DIR           # conversations, knowledge bases and snapshots in DIR
    chatkv --kb python-docs [--sources 4] [--pin docs/intro.md]   # chat over a knowledge base

``chatkv serve``, ``chatkv ingest`` and ``chatkv kb`` are other faces; ``chatkv/cli.py`` (the
console script) hands each to its own (``chatkv/server/cli.py``, ``tui/kb_cli.py``) and everything
else here.

Stored text reaches the terminal only through ``tui/terminal_text.py``'s ``safe_text`` (no control
sequences). Only the public SDK is used here.

No traceback reaches a person: a closed stdin is input that has ended; a stdout whose reader
left (``chatkv | head -c1``) ends the chat quietly once the reply being written is stored; a
stdout that cannot be written (``> /dev/full``) is one line on stderr and exit status 2; a
data directory that cannot be used is one line naming it, before any model loads. Line mode
opens its new conversation at the first message, so input that ends before one
(``chatkv </dev/null``) leaves nothing stored.

(Past 400 lines on purpose: one argument parser and the three modes it picks between, which
share its options and its error handling.)
"""

from __future__ import annotations

import argparse
import sys

from chatkv import ChatKVError, Conversations, Engine, InvalidRequest
from chatkv.config import HEADS, KV_DTYPES, OVERFLOW_POLICIES, WEIGHTS
from chatkv.engine.sampling import SamplingParams
from chatkv.outputs import GenerationResult, Reply
from chatkv.tui.failures import Stdout, check_data_dir, error, note
from chatkv.tui.terminal_text import SafeStream, safe_text

LATEST = "latest"  # --resume without an id
OTHER_COMMANDS = ("serve", "ingest", "kb")  # chatkv.cli's; never a prompt here
# The sampling options; None = not given. Line mode fills in DEFAULTS, the app gets only what was given.
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")
DEFAULTS = {"max_tokens": 256, "temperature": 0.0}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatkv",
        description="Local chat whose KV cache survives between turns. Without a prompt it opens the terminal "
        "app when stdin and stdout are terminals, else it chats line by line (replies on stdout).",
    )
    p.add_argument("prompt", nargs="?", help="ask once and exit; without it, chat")
    p.add_argument(
        "--model",
        help="a local Hugging Face model directory or a GGUF file, prepared once into the data directory "
        "(default: packaged SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        default=None,
        help="where conversations, snapshots and knowledge bases live (default: $CHATKV_HOME)",
    )
    p.add_argument("--system", default=None, help="system prompt of a new conversation")
    p.add_argument("--max-tokens", type=int, default=None, help=f"default {DEFAULTS['max_tokens']}")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (line mode and one-shot)")
    p.add_argument("--stats", action="store_true", help="line mode: print token counts and timings after each reply")
    p.add_argument("--list", action="store_true", help="list saved conversations and exit")
    p.add_argument(
        "--search",
        metavar="TEXT",
        default=None,
        help="print the messages of saved conversations (every branch) holding TEXT's words, one a line "
        "(conversation id, title, role, snippet), and exit: 0, or 1 when none matches",
    )
    p.add_argument(
        "--resume",
        metavar="ID",
        nargs="?",
        const=LATEST,
        default=None,
        help="continue a saved conversation; without ID, the latest",
    )
    p.add_argument("--title", default=None, help="line mode: title of a new saved conversation")
    p.add_argument("--kb", metavar="NAME", help="answer from this knowledge base (chatkv ingest ... --kb NAME)")
    p.add_argument(
        "--sources", type=int, default=4, help="line mode: sources retrieved per message with --kb (default 4)"
    )
    p.add_argument(
        "--pin",
        action="append",
        default=None,
        metavar="SOURCE",
        help="line mode, with --kb: a document placed in full after the system prompt (repeatable)",
    )
    p.add_argument("--plain", action="store_true", help="chat line by line even in a terminal (no app)")
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default=None,
        help="when a chat outgrows the context: sink (default; keep the start and a recent window), "
        "truncate (drop the oldest turns) or error",
    )
    p.add_argument(
        "--context-window",
        type=int,
        default=None,
        metavar="N",
        help="tokens a conversation's KV may hold (default: the model's context)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default=None,
        help="how the model's projections are computed: auto (default: a GGUF's own int4, else the float "
        "model), bf16, fp32, int4 or int8",
    )
    p.add_argument(
        "--head-weights",
        choices=HEADS,
        default=None,
        help="the output matrix: auto (default: int8 with a GGUF's int4, else float), float, int8 or int4",
    )
    p.add_argument(
        "--no-deterministic",
        dest="deterministic",
        action="store_false",
        default=None,
        help="compute with oneDNN's batched kernels: faster prefill of long prompts, but a reply may change "
        "with the load, the batch and the thread count (default: deterministic, the same reply whatever the load)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=None,
        help="how the KV cache is stored: auto (default: the model's dtype), bf16, fp16, fp32, int8 or fp8 "
        "(int8/fp8: about half the memory and snapshot bytes of bf16; "
        "see docs/reference/kv-dtypes.md for their quality)",
    )
    p.epilog = (
        "other commands: chatkv serve (an OpenAI-compatible HTTP server), chatkv ingest PATH... --kb NAME, "
        "chatkv kb list|info|search|remove; each takes --help"
    )
    return p


def _error(message: object) -> None:
    error(message)


def _note(text: str) -> None:
    note(text)


def _one_shot(engine: Engine, messages: list[dict], params: SamplingParams, show_stats: bool) -> int:
    result = None
    out, stdout = SafeStream(), Stdout()
    stream = engine.stream(engine.encode_chat(messages), params)
    for piece in stream:
        if isinstance(piece, GenerationResult):
            result = piece
        else:
            stdout.write(out.feed(piece))
        if stdout.failed is not None:  # nobody reads the rest (a one-shot reply is not stored)
            stream.close()
            return stdout.status()
    stdout.write(out.flush(), end="\n")
    if show_stats and result is not None:
        _note(f"[{result.usage.summary()}]")
    return stdout.status()


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _read_line() -> str | None:
    """One line of input (None at its end). A terminal gets line editing and a "> " prompt (on
    stderr when stdout is not a terminal, so replies alone reach stdout); piped input gets no
    prompt and is read as bytes a line at a time, so a line that is not UTF-8 raises
    UnicodeDecodeError alone."""
    if sys.stdin is None:  # started with stdin closed (chatkv <&-): no input at all
        return None
    if _stdin_is_terminal():
        try:
            if sys.stdout is not None and sys.stdout.isatty():
                return input("> ")
            print("> ", end="", file=sys.stderr, flush=True)
            return input()
        except EOFError:
            return None
    buf = getattr(sys.stdin, "buffer", None)
    line = buf.readline().decode("utf-8") if buf is not None else sys.stdin.readline()
    return line.removesuffix("\n").removesuffix("\r") if line else None


def _chat(
    session, params: SamplingParams, show_stats: bool, script: list[str] | None = None, open_session=None, weights=None
) -> int:
    """Chat on stdin, or answer the messages of ``script`` and return. ``session`` None: a new
    conversation, opened by ``open_session()`` at the first message (so input that ends before
    one stores nothing). A stdout that fails mid-reply: the reply is still received and stored,
    then the chat ends (``chatkv.tui.failures.Stdout``)."""
    if script is None:
        how = f" Weights: {weights.label}." if weights is not None else ""
        which = f"conversation {session.id}. " if session is not None else ""
        _note(f"chatkv: {which}Type a message; /exit or Ctrl-D to leave.{how}")
    lines = iter(script) if script is not None else None
    stdout = Stdout()
    while True:
        try:
            line = _read_line() if lines is None else next(lines, None)
        except UnicodeDecodeError:
            _error("that line is not valid UTF-8; nothing was sent")
            continue
        if line is None:
            if lines is None and _stdin_is_terminal():
                stdout.write("", end="\n")  # past the prompt the Ctrl-D left
            return stdout.status()
        text = line.strip()
        if text in ("/exit", "/quit"):
            return stdout.status()
        if not text:
            continue
        if session is None:
            session = open_session()
            if script is None:
                _note(f"chatkv: conversation {session.id}.")
        reply = None
        out = SafeStream()
        try:
            for piece in session.stream(text, params):
                if isinstance(piece, Reply):
                    reply = piece
                else:
                    stdout.write(out.feed(piece))  # on failure the rest is still received and stored
        except KeyboardInterrupt:
            stdout.write(out.flush())
            _note("\n[interrupted]")
            continue
        except InvalidRequest as e:  # this message only (too long, not valid Unicode...): the chat goes on
            _error(e)
            continue
        stdout.write(out.flush(), end="\n")
        if stdout.failed is not None:
            return stdout.status(f" (the reply is stored: chatkv --resume {session.id})")
        if reply is not None and reply.sources:
            _print_sources(reply.sources)
        if reply is not None and reply.context is not None and reply.context.dropped_tokens:
            _note(f"[{reply.context.summary()}]")
        if show_stats and reply is not None:
            _note(f"[{reply.usage.summary()}]")


def _print_sources(sources) -> None:
    for src in sources:
        mark = "*" if src.cited else " "
        where = f" - {src.heading}" if src.heading else ""
        _note(safe_text(f"{mark}[{src.number}] {src.source.rsplit('/', 1)[-1]}{where}", oneline=True))


def _check_prompt(prompt: str | None) -> str | None:
    """The one-shot prompt, or InvalidRequest: an empty prompt is refused, as the SDK refuses an empty message."""
    if prompt is not None and not prompt.strip():
        raise InvalidRequest("the prompt is empty; give a question, or no prompt at all to chat")
    return prompt


def _check_search(text: str | None) -> str | None:
    if text is not None and not text.strip():
        raise InvalidRequest("--search needs words to find")
    return text


def _search(saved: Conversations, text: str) -> int:
    """The hits of ``text``, one a line: conversation id, title, role, snippet. 1 (and one line
    on stderr) when none matches, as grep."""
    hits = saved.search(text)
    if not hits:
        _note(f"no match for {safe_text(text, oneline=True)!r}")
        return 1
    stdout = Stdout()
    for h in hits:
        stdout.write(
            f"{h.conversation_id}  {safe_text(h.title, oneline=True)}  {h.message.role}  "
            f"{safe_text(h.snippet, oneline=True)}",
            end="\n",
        )
    return stdout.status()


def _check_resume(resume: str | None) -> str | None:
    if resume is not None and not resume.strip():
        raise InvalidRequest("--resume needs a conversation id (chatkv --list), or no value at all for the latest")
    return resume


def _is_terminal() -> bool:
    """Both ends are terminals: the app can run (``echo hi | chatkv`` and ``chatkv > out`` chat line by line)."""
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def _open_app(args: argparse.Namespace, sampling: dict) -> int:
    from chatkv.tui.app import run_app  # imported only here: line mode and one-shot never load Textual

    return run_app(
        model=args.model,
        data_dir=args.data_dir,
        resume=args.resume,
        system=args.system,
        kb=args.kb,
        sampling=sampling or None,
        engine_options=_engine_options(args),
    )


def _engine_options(args: argparse.Namespace) -> dict:
    """Engine options given on the command line (the rest keep their defaults)."""
    opts = {
        "overflow": args.overflow,
        "context_window": args.context_window,
        "weights": args.weights,
        "head_weights": args.head_weights,
        "kv_dtype": args.kv_dtype,
        "deterministic": args.deterministic,
    }
    return {k: v for k, v in opts.items() if v is not None}


def _params_dict(params: SamplingParams) -> dict:
    """The sampling options saved with a new conversation (its settings when resumed)."""
    return {k: getattr(params, k) for k in SAMPLING if getattr(params, k) is not None}


def _resume(engine: Engine, conv_id: str):
    if conv_id == LATEST:
        convs = engine.sessions()
        if not convs:
            raise InvalidRequest("there is no saved conversation to resume yet; run chatkv without --resume")
        conv_id = convs[0].id
    return engine.resume(conv_id)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OTHER_COMMANDS:  # run as python -m chatkv.tui.cli: not a prompt to answer
        _error(
            f"'{argv[0]}' is a command of chatkv (chatkv {argv[0]} ..., or python -m chatkv.cli {argv[0]} ...); "
            "this module runs the chat only"
        )
        return 2
    if argv and argv[0] == "chat":  # chatkv chat [options]: the same as chatkv [options]
        argv = argv[1:]
    args = _parser().parse_args(argv)
    try:
        _check_prompt(args.prompt)
        _check_resume(args.resume)
        _check_search(args.search)
        given = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
        params = SamplingParams(**{**DEFAULTS, **given})
        params.validate()
        check_data_dir(args.data_dir)
        listing = args.list or args.search is not None
        if args.prompt is None and not listing and not args.plain and _is_terminal():
            return _open_app(args, given)
        if listing:  # the store alone: no model is loaded to list or search what is saved
            with Conversations(args.data_dir) as saved:
                if args.search is not None:
                    return _search(saved, args.search)
                stdout = Stdout()
                for c in saved.list():
                    stdout.write(f"{c.id}  {c.updated_at:%Y-%m-%d %H:%M}  {safe_text(c.title, oneline=True)}", end="\n")
                return stdout.status()
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, data_dir=args.data_dir, **_engine_options(args))
        if args.prompt is not None and args.kb is None and args.resume is None:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            return _one_shot(engine, messages + [{"role": "user", "content": args.prompt}], params, args.stats)
        with engine:
            if args.resume is not None:
                session = _resume(engine, args.resume)
                # the conversation's saved settings, then what was given now
                params = SamplingParams.from_dict({**DEFAULTS, **session.params, **given})
                params.validate()
                if args.overflow is not None:
                    session.set_overflow(args.overflow)
                opener = None
            else:
                kb = engine.knowledge_base(args.kb) if args.kb else None

                def opener():
                    return engine.session(
                        system=args.system,
                        title=args.title,
                        params=_params_dict(params),
                        knowledge=kb,
                        top_k=args.sources,
                        documents=args.pin,
                    )

                session = None  # opened at the first message: no empty conversation for input that has none
            if args.prompt is not None:  # one question in a saved chat (--kb or --resume): one turn
                return _chat(session, params, args.stats, [args.prompt], open_session=opener)
            return _chat(session, params, args.stats, open_session=opener, weights=getattr(engine, "weights", None))
    except ChatKVError as e:
        _error(e)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
