"""``chatkv ingest`` and ``chatkv kb``: knowledge bases from the command line (no chat model loaded).

    chatkv ingest docs/ notes.md --kb python-docs [--include '*.md'] [--exclude 'drafts/*'] [--follow-symlinks]
    chatkv kb list
    chatkv kb info python-docs
    chatkv kb search python-docs "how do decorators work?" [-k 5] [--mode hybrid|dense|lexical]
    chatkv kb remove python-docs docs/old.md
    (each takes --data-dir DIR; stored names, sources and text are printed through tui/text.py's safe_text)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chatkv.retrieval import KnowledgeBase
from chatkv.tui.text import safe_text


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
    ing.add_argument("--follow-symlinks", action="store_true",
                     help="follow symbolic links found in the directories, as long as they stay inside the given paths")
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


def run(argv: list[str]) -> int:
    """Run ``ingest`` / ``kb`` (errors propagate as ChatKVError to the caller)."""
    args = parser().parse_args(argv)
    if args.command == "ingest":
        kb = KnowledgeBase.open(args.kb, data_dir=args.data_dir)
        try:
            report = kb.add(args.paths, include=args.include, exclude=args.exclude, progress=sys.stderr.isatty(),
                            follow_symlinks=args.follow_symlinks)
        finally:
            kb.close()
        for f in report.skipped:
            print(safe_text(f"skipped {f.source}: {f.reason}", oneline=True), file=sys.stderr)
        t = report.seconds
        print(
            f"{args.kb}: {len(report.added)} added, {len(report.updated)} updated, {len(report.unchanged)} unchanged, "
            f"{len(report.skipped)} skipped; {report.chunks} chunks "
            f"(parse {t.get('parse', 0):.1f} s, embed {t.get('embed', 0):.1f} s, index {t.get('index', 0):.1f} s)"
        )
        return 1 if report.skipped and not (report.added or report.updated or report.unchanged) else 0
    if args.action == "list":
        for name in KnowledgeBase.names(data_dir=args.data_dir):
            print(safe_text(name, oneline=True))
        return 0
    kb = KnowledgeBase.open(args.name, data_dir=args.data_dir, create=False)  # info/search/remove never create one
    try:
        if args.action == "info":
            st = kb.stats()
            print(", ".join(f"{k} {v}" for k, v in st.items()))
            for d in kb.documents():
                print(safe_text(f"  {d.source}  ({d.kind}, {d.chunks} chunks)", oneline=True))
        elif args.action == "search":
            for i, h in enumerate(kb.search(args.query, k=args.k, mode=args.mode), 1):
                where = f" - {h.heading}" if h.heading else ""
                print(safe_text(f"[{i}] {h.score:.3f}  {Path(h.source).name}{where}  ({h.start}-{h.end})", oneline=True))
                print("    " + safe_text(" ".join(h.text.split()), oneline=True)[:200])
        elif args.action == "remove":
            if not (kb.remove(args.source) or kb.remove(str(Path(args.source).resolve()))):
                print(safe_text(f"chatkv: '{args.source}' is not in knowledge base '{args.name}'", oneline=True), file=sys.stderr)
                return 1
            print(safe_text(f"removed {args.source}", oneline=True))
    finally:
        kb.close()
    return 0
