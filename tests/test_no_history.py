"""Comments, docstrings and docs say what the code does and why, as it stands; history is git's.

Every line of the repository's code, tests and docs is searched (case-insensitively) for the
marks of narrated history, ``PATTERNS``: a reference to an issue by number, the word for the
day the text was written (a state that is stale after the next change), who did the work in
which sitting (not what the code does), and in code and tests an ISO date (a dated figure or
story; docs may date their measurements). Each hit is listed as ``path:line: text``. A reason for a
default or a design stays, stated as a fact about the code or the model; the story of how it
came about goes to the commit message and CHANGELOG.md.

Searched: chatkv/, kernels/, retrieval/, storage/ (migrations included), tui/, tests/,
scripts/, benchmarks/*.py, benchmarks/gpu_check.sh, .ci/run and pyproject.toml as code;
docs/**/*.md, README.md and benchmarks/README.md as docs. Not searched: CHANGELOG.md (history
is its job), benchmarks/results/ (dated records of runs), binary files and the TUI's SVG
snapshots (rendered output), and this file's own pattern list. ``ALLOW`` names the few
phrases that match a pattern without narrating anything, each with its reason.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()

# -- patterns (this file's own lines from here to the end marker are not searched) --
PATTERNS = (r"\bissues? #?\d+", r"today's", r"\btoday\b", r"this session", r"the engineer")
CODE_ONLY = (r"20\d\d-\d\d-\d\d",)  # docs may date a measurement; code and tests state facts
# (path prefix, regex of the allowed phrase, why it is not history)
ALLOW = (
    (
        "",
        r"how are you today\?",
        "a sample chat prompt: test oracles, token counts and benchmark workloads depend on its exact text",
    ),
    ("benchmarks/", r"still walkable today\.", "a sentence of a benchmark's document text: the workload's tokens"),
    (
        "storage/migrations/versions/",
        r"^Create Date: 20\d\d-\d\d-\d\d",
        "Alembic's revision header, written by its template",
    ),
)
MARKS = (
    "see issue 23",
    "(Issue 19, item 5)",
    "issues #4 and 5",
    "today's path",
    "35 today, the bound",
    "used in this session",
    "as the engineer found",
)  # each must be caught
DATED = "measured 2026-12-01"  # caught in code and tests
# -- end of patterns --

CODE_DIRS = ("chatkv", "kernels", "retrieval", "storage", "tui", "tests", "scripts")
CODE_SUFFIXES = {".py", ".c", ".h", ".tcss", ".sh", ".mako", ".json", ".toml", ".md", ".txt", ".cfg", ".ini"}
CODE_FILES = ("benchmarks/gpu_check.sh", ".ci/run", "pyproject.toml")
DOC_FILES = ("README.md", "benchmarks/README.md")


def code_files() -> list[Path]:
    files = [
        f
        for d in CODE_DIRS
        for f in sorted((ROOT / d).rglob("*"))
        if f.is_file() and f.suffix in CODE_SUFFIXES and "__pycache__" not in f.parts
    ]
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    files += [ROOT / f for f in CODE_FILES if (ROOT / f).is_file()]
    return files


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md")) + [ROOT / f for f in DOC_FILES if (ROOT / f).is_file()]


def _own_pattern_lines() -> set[int]:
    lines = SELF.read_text(encoding="utf-8").splitlines()
    start = next(i for i, l in enumerate(lines, 1) if l.startswith("# -- patterns"))
    end = next(i for i, l in enumerate(lines, 1) if l.startswith("# -- end of patterns"))
    return set(range(start, end + 1))


def hits(files: list[Path], patterns: tuple[str, ...]) -> list[str]:
    """``path:line: text`` of every line of ``files`` that matches one of ``patterns`` once the
    phrases ``ALLOW`` names for its path are taken out."""
    pattern = re.compile("|".join(patterns), re.IGNORECASE)
    found = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        allowed = [re.compile(a, re.IGNORECASE) for prefix, a, _ in ALLOW if rel.startswith(prefix)]
        skip = _own_pattern_lines() if f.resolve() == SELF else set()
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not text
        for n, line in enumerate(text.splitlines(), 1):
            if n in skip:
                continue
            rest = line.strip()
            for a in allowed:
                rest = a.sub("", rest)
            if pattern.search(rest):
                found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_the_search_finds_what_it_is_for():
    """The patterns catch each mark of history, and the allowed phrases only where allowed."""
    for mark in MARKS:
        assert re.search("|".join(PATTERNS), mark, re.IGNORECASE), mark
    assert re.search("|".join(CODE_ONLY), DATED)
    assert not re.search("|".join(PATTERNS), "tissue 5, todays_x, a session's context, engineered")
    assert len(code_files()) > 100 and ROOT / "tests/test_no_history.py" in code_files()


def test_code_and_tests_narrate_no_history():
    found = hits(code_files(), PATTERNS + CODE_ONLY)
    assert not found, "history narrated in code or tests (say what the code does and why):\n" + "\n".join(found)


def test_docs_narrate_no_history():
    found = hits(doc_files(), PATTERNS)
    assert not found, "history narrated in the docs (say what the code does and why):\n" + "\n".join(found)
