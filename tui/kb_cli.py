"""``chatkv ingest`` and ``chatkv kb``: knowledge bases from the command line (no chat model loaded).

chatkv ingest docs/ notes.md --kb python-docs [--include '*.md'] [--exclude 'drafts/*'] [--follow-symlinks]
              [--kv [--model DIR|FILE.gguf]]
chatkv kb list
chatkv kb info python-docs
chatkv kb search python-docs "how do decorators work?" [-k 5] [--mode hybrid|dense|lexical]
chatkv kb remove python-docs docs/old.md
(each takes --data-dir DIR; stored names, sources and text are printed through tui/terminal_text.py's safe_text)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chatkv import ChatKVError
from chatkv.retrieval import KnowledgeBase
from chatkv.tui.failures import Stdout, check_data_dir, error, note
from chatkv.tui.terminal_text import safe_text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatkv", description="Knowledge bases for RAG chats.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", metavar="DIR", default=None, help="the data directory (default: $CHATKV_HOME)")
    sub = p.add_subparsers(dest="command", required=True)
    ing = sub.add_parser("ingest", parents=[common], help="add files and directories to a knowledge base")
    ing.add_argument("paths", nargs="+")
    ing.add_argument("--kb", required=True, help="knowledge base name (created if new)")
    ing.add_argument("--include", action="append", default=None, metavar="GLOB")
    ing.add_argument("--exclude", action="append", default=None, metavar="GLOB")
    ing.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="follow symbolic links found in the directories, as long as they stay inside the given paths",
    )
    ing.add_argument(
        "--kv",
        action="store_true",
        help="also compute the chat model's KV of every chunk and document now (rag_kv_reuse reads it)",
    )
    ing.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="with --kv: the chat model to compute it with, a local Hugging Face directory or a GGUF file (default: "
        "the packaged default model); chunk KV is kept per model and KV dtype, so name the model "
        "you chat with",
    )
    kb = sub.add_parser("kb", parents=[common], help="list, inspect, search or edit knowledge bases")
    kbs = kb.add_subparsers(dest="action", required=True)
    kbs.add_parser("list", parents=[common], help="the knowledge bases in the data directory")
    info = kbs.add_parser("info", parents=[common], help="documents and counts of one knowledge base")
    info.add_argument("name")
    search = kbs.add_parser("search", parents=[common], help="search one knowledge base")
    search.add_argument("name")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5)
    search.add_argument("--mode", default="hybrid", choices=["hybrid", "dense", "lexical"])
    rm = kbs.add_parser("remove", parents=[common], help="remove a document (by its source) from a knowledge base")
    rm.add_argument("name")
    rm.add_argument("source")
    return p


def main(argv: list[str]) -> int:
    """``chatkv ingest ...`` / ``chatkv kb ...`` (``argv`` starts with the command): its exit status;
    a ChatKVError is one line on stderr and status 2, never a traceback."""
    try:
        return run(argv)
    except ChatKVError as e:
        error(e)
        return 2


def run(argv: list[str]) -> int:
    """Run ``ingest`` / ``kb`` (errors propagate as ChatKVError to the caller). Output that
    cannot be written ends the command as ``chatkv.tui.failures.Stdout`` says."""
    args = parser().parse_args(argv)
    check_data_dir(args.data_dir)
    out = Stdout()
    code = _run(args, out.write)
    return out.status() or code


def _run(args, say) -> int:
    if args.command == "ingest":
        engine = None
        if args.kv:  # the chat model computes each chunk's KV (chatkv.rag.placement)
            from chatkv import Engine

            engine = Engine.from_pretrained(args.model, data_dir=args.data_dir)
        elif args.model is not None:
            error("--model only matters with --kv (ingest loads no chat model without it)")
            return 2
        kb = (
            engine.knowledge_base(args.kb)
            if engine is not None
            else KnowledgeBase.open(args.kb, data_dir=args.data_dir)
        )
        try:
            report = kb.add(
                args.paths,
                include=args.include,
                exclude=args.exclude,
                progress=_stderr_is_terminal(),
                follow_symlinks=args.follow_symlinks,
                precompute_kv=args.kv,
            )
        finally:
            kb.close()
            if engine is not None:
                engine.close()
        if args.kv:
            say(f"chunk KV: {report.kv_chunks} chunks computed ahead of time", end="\n")
        for f in report.skipped:
            note(safe_text(f"skipped {f.source}: {f.reason}", oneline=True))
        t = report.seconds
        say(
            f"{safe_text(args.kb, oneline=True)}: {len(report.added)} added, {len(report.updated)} updated, "
            f"{len(report.unchanged)} unchanged, {len(report.skipped)} skipped; {report.chunks} chunks "
            f"(parse {t.get('parse', 0):.1f} s, embed {t.get('embed', 0):.1f} s, index {t.get('index', 0):.1f} s)",
            end="\n",
        )
        return 1 if report.skipped and not (report.added or report.updated or report.unchanged) else 0
    if args.action == "list":
        for name in KnowledgeBase.names(data_dir=args.data_dir):
            say(safe_text(name, oneline=True), end="\n")
        return 0
    kb = KnowledgeBase.open(args.name, data_dir=args.data_dir, create=False)  # info/search/remove never create one
    try:
        if args.action == "info":
            st = kb.stats()
            say(", ".join(f"{k} {v}" for k, v in st.items()), end="\n")
            for d in kb.documents():
                say(safe_text(f"  {d.source}  ({d.kind}, {d.chunks} chunks)", oneline=True), end="\n")
        elif args.action == "search":
            for i, h in enumerate(kb.search(args.query, k=args.k, mode=args.mode), 1):
                where = f" - {h.heading}" if h.heading else ""
                say(
                    safe_text(f"[{i}] {h.score:.3f}  {Path(h.source).name}{where}  ({h.start}-{h.end})", oneline=True),
                    end="\n",
                )
                say("    " + safe_text(" ".join(h.text.split()), oneline=True)[:200], end="\n")
        elif args.action == "remove":
            if not (kb.remove(args.source) or kb.remove(str(Path(args.source).resolve()))):
                note(safe_text(f"chatkv: '{args.source}' is not in knowledge base '{args.name}'", oneline=True))
                return 1
            say(safe_text(f"removed {args.source}", oneline=True), end="\n")
    finally:
        kb.close()
    return 0


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
