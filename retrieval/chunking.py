"""Structure-following chunking, sized in tokens of the embedding tokenizer, with overlap.

Why past ~400 lines: the policy below is the contract and is written out in full here; the three
structure parsers share one ``_Builder`` and the packer, so they stay in one file.

Contract of ``chunk_document(doc, count_tokens, max_tokens, overlap_tokens)``:

- every chunk's ``text == doc.text[start:end]`` exactly, is not whitespace-only, and
  ``count_tokens(text) <= max_tokens``; ordinals run 0, 1, 2 ... in document order; starts and ends
  both strictly increase; together the chunks cover every non-whitespace character of the text.
- ``heading`` is the heading path of the chunk's section ("Guide > Decorators > Arguments"), or ""
  before the first heading and for kinds without headings (text, pdf, code).

Policy:

1. Sections. Markdown: ATX "#" headings and setext underlines (=, -); fenced ``` / ~~~ blocks are
   opaque; a leading "---" front matter is one block. HTML (already turned into text by
   documents.py): its "# " heading lines and ``` fences; no setext. reStructuredText: underlined
   and over+underlined titles, levels in the order their styles first appear; a paragraph ending in
   "::" (or a ``.. code-block::`` directive) stays with its indented literal block. Plain text and
   PDF: no headings. Code: no headings.
2. Blocks inside a section: blank-line paragraphs, whole fences / literal blocks; for code, a block
   starts at each top-level definition (a per-language regex, pulling in the comments, decorators and
   attributes right above it) and at each column-0 line after a blank line.
3. A chunk never spans two sections. The heading line is glued to the first block of its section so
   the heading text is embedded with its content; a section with no body of its own (a heading
   directly followed by another heading) is glued to the next section instead of becoming a
   heading-only chunk. Small sections are not merged with their neighbours: a short section is
   exactly the unit a precise question wants.
4. Consecutive blocks of a section are packed greedily up to ``max_tokens``. A block bigger than
   that is split at paragraphs, then sentences, then lines, then words, then (a single huge "word")
   characters; fences and code skip the sentence level, so code is split at lines. A fence that
   fits stays whole in one chunk.
5. Overlap: the next chunk of the same section starts with about the last ``overlap_tokens`` of the
   previous one, at a sentence or line start when that keeps at least half of it, else at a word
   start. It is shortened (or dropped) when the next block would not fit beside it.

``count_tokens`` may be slow: it is called on blocks and pieces (cached by text), once per chunk to
check the packed total, and ~log2(words) times per chunk to place the overlap; never per character
except to cut a single word longer than ``max_tokens``. Its constant overhead (special tokens, the
count of "") is measured once, so ``count_tokens`` may include [CLS]/[SEP].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from chatkv.errors import InvalidRequest
from chatkv.retrieval.documents import Document


@dataclass(frozen=True)
class Chunk:
    text: str
    ordinal: int  # 0.. in document order
    start: int  # text == doc.text[start:end]
    end: int
    heading: str  # heading path, "" if none


@dataclass
class _Block:
    start: int
    end: int
    code: bool  # split by lines, never by sentences


@dataclass
class _Section:
    heading: str
    blocks: list


# ------------------------------------------------------------------------------------ structure

_ATX = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)$")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*$")
_LIST_ITEM = re.compile(r"\s*([-*+]|\d+[.)])\s")
_RST_ADORN = re.compile(r"""([!-/:-@\[-`{-~])\1+[ \t]*$""")
_RST_CODE = re.compile(r"\s*\.\. (code-block|code|sourcecode)::")
_DEFS = {
    "python": r"(async\s+def|def|class)\s",
    "javascript": r"(export\s+)?(default\s+)?(async\s+)?(function|class|const|let|var)\b",
    "typescript": (
        r"(export\s+)?(default\s+)?(declare\s+)?(async\s+)?"
        r"(function|class|const|let|var|interface|type|enum|namespace)\b"
    ),
    "go": r"(func|type|var|const)\b",
    "rust": (
        r"(pub(\([^)]*\))?\s+)?(async\s+|unsafe\s+|const\s+)?"
        r"(fn|struct|enum|impl|trait|mod|static|type|union|macro_rules!)\W"
    ),
    "ruby": r"(def|class|module)\b",
    "shell": r"(function\s+\w+|[\w-]+\s*\(\)\s*\{?)",
    "sql": r"(?i:create|alter|drop|insert|select|with|update|delete)\b",
}
_LEAD_IN = re.compile(r"(@|#\[|#|//|/\*|\*|--|;)")  # comments, decorators, attributes just above a def
_CLOSER = re.compile(r"[})\]]|end\b|fi\b|done\b|esac\b")


class _Builder:
    """Collects sections and blocks while a parser walks the lines; glues heading lines forward."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.split("\n")
        self.starts = [0]
        for line in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)
        self.sections: list[_Section] = []
        self.current = _Section("", [])
        self.stack: list[tuple[int, str]] = []
        self.glue: int | None = None  # start of heading lines waiting for their section's first block
        self.glue_end = 0
        self.para: int | None = None  # first line of the open paragraph

    def line_end(self, i: int) -> int:
        return self.starts[i] + len(self.lines[i])

    def block(self, first: int, last: int, code: bool = False) -> None:
        start, end = self.starts[first], self.line_end(last)
        if not self.text[start:end].strip():
            return
        end = start + len(self.text[start:end].rstrip())
        if self.glue is not None:
            start, self.glue = self.glue, None
        self.current.blocks.append(_Block(start, end, code))

    def close_para(self, upto: int) -> None:
        if self.para is not None and upto > self.para:
            self.block(self.para, upto - 1)
        self.para = None

    def heading(self, level: int, title: str, first: int, last: int) -> None:
        self.close_para(first)
        while self.stack and self.stack[-1][0] >= level:
            self.stack.pop()
        self.stack.append((level, title.strip()))
        if self.current.blocks:
            self.sections.append(self.current)
        self.current = _Section(" > ".join(t for _, t in self.stack if t), [])
        if self.glue is None:
            self.glue = self.starts[first]
        self.glue_end = self.line_end(last)

    def finish(self) -> list[_Section]:
        self.close_para(len(self.lines))
        if self.glue is not None:  # trailing headings with no body: a block of their own
            self.current.blocks.append(_Block(self.glue, self.glue_end, False))
        if self.current.blocks:
            self.sections.append(self.current)
        return self.sections


def _fence_end(lines: list[str], i: int, m: re.Match) -> int:
    """Index of the closing fence line of the fence opened at line i (the last line if unclosed)."""
    mark = m.group(1)
    close = re.compile(r" {0,3}" + re.escape(mark[0]) + "{" + str(len(mark)) + r",}[ \t]*$")
    for j in range(i + 1, len(lines)):
        if close.match(lines[j]):
            return j
    return len(lines) - 1


def _markdown(text: str, setext: bool = True, atx: bool = True, front_matter: bool = True) -> list[_Section]:
    b = _Builder(text)
    lines, i, n = b.lines, 0, len(b.lines)
    if front_matter and n > 1 and lines[0].rstrip() == "---":
        end = next((j for j in range(1, n) if lines[j].rstrip() in ("---", "...")), None)
        if end is not None:
            b.block(0, end, code=True)
            i = end + 1
    while i < n:
        line = lines[i]
        m = _FENCE.match(line)
        if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
            b.close_para(i)
            j = _fence_end(lines, i, m)
            b.block(i, j, code=True)
            i = j + 1
            continue
        m = _ATX.match(line) if atx else None
        if m:
            b.heading(len(m.group(1)), m.group(2) or "", i, i)
            i += 1
            continue
        if (
            setext
            and line.strip()
            and i + 1 < n
            and _SETEXT.match(lines[i + 1])
            and not line.startswith("    ")
            and not (lines[i + 1].strip()[0] == "-" and _LIST_ITEM.match(line))
        ):
            b.heading(1 if lines[i + 1].strip()[0] == "=" else 2, line, i, i + 1)
            i += 2
            continue
        if not line.strip():
            b.close_para(i)
        elif b.para is None:
            b.para = i
        i += 1
    return b.finish()


def _rst(text: str) -> list[_Section]:
    b = _Builder(text)
    lines, i, n = b.lines, 0, len(b.lines)
    styles: list[tuple[str, bool]] = []

    def adornment(k: int) -> str | None:
        return lines[k].strip()[0] if 0 <= k < n and lines[k] and _RST_ADORN.match(lines[k]) else None

    def level(style) -> int:
        if style not in styles:
            styles.append(style)
        return styles.index(style) + 1

    def indent(s: str) -> int:
        return len(s) - len(s.lstrip())

    while i < n:
        line = lines[i]
        mark = adornment(i)
        title_ok = lambda k: lines[k].strip() and not lines[k][0].isspace() and adornment(k) is None  # noqa: E731
        if mark and i + 2 < n and title_ok(i + 1) and adornment(i + 2) == mark:
            b.heading(level((mark, True)), lines[i + 1], i, i + 2)
            i += 3
            continue
        under = adornment(i + 1)
        if (title_ok(i) if i < n else False) and under and (len(lines[i + 1].strip()) >= min(3, len(line.strip()))):
            b.heading(level((under, False)), line, i, i + 1)
            i += 2
            continue
        if line.strip() and (line.rstrip().endswith("::") or _RST_CODE.match(line)):
            j, last = i + 1, i
            while j < n and (not lines[j].strip() or indent(lines[j]) > indent(line)):
                if lines[j].strip():
                    last = j
                j += 1
            if last > i:
                first = b.para if b.para is not None else i
                b.para = None
                b.block(first, last, code=True)
                i = last + 1
                continue
        if not line.strip():
            b.close_para(i)
        elif b.para is None:
            b.para = i
        i += 1
    return b.finish()


def _code(text: str, language: str) -> list[_Section]:
    b = _Builder(text)
    lines = b.lines
    define = re.compile(_DEFS[language]) if language in _DEFS else None
    starts = []
    for i, line in enumerate(lines):
        if not line.strip() or line[0].isspace() or _CLOSER.match(line):
            continue
        after_blank = i == 0 or not lines[i - 1].strip()
        if define and define.match(line):
            k = i
            while k > 0 and lines[k - 1].strip() and not lines[k - 1][0].isspace() and _LEAD_IN.match(lines[k - 1]):
                k -= 1
            starts.append(k)
        elif after_blank:
            starts.append(i)
    starts = sorted(set([0] + starts))
    for first, nxt in zip(starts, starts[1:] + [len(lines)]):
        b.block(first, nxt - 1, code=True)
    return b.finish()


def _sections(doc: Document) -> list[_Section]:
    if doc.kind == "markdown":
        return _markdown(doc.text)
    if doc.kind == "html":
        return _markdown(doc.text, setext=False, front_matter=False)
    if doc.kind == "rst":
        return _rst(doc.text)
    if doc.kind == "code":
        return _code(doc.text, doc.metadata.get("language", ""))
    return _markdown(doc.text, setext=False, atx=False, front_matter=False)  # text, pdf: paragraphs, fences


# ------------------------------------------------------------------------------------ splitting

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")  # ends at a line start: code keeps its indent
_SENTENCE_END = re.compile(r"[.!?…]['\"”’)\]]*\s+|[。！？]")
_LINE_BREAK = re.compile(r"\n")
_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"\S+")
_RESTART = re.compile(r"\n\s*|[.!?…。！？]['\"”’)\]]*\s+")  # what a sentence or line start follows


class _Counter:
    """count_tokens minus its constant overhead, cached by text."""

    def __init__(self, count_tokens: Callable[[str], int]):
        self.count_tokens = count_tokens
        self.base = count_tokens("")
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        n = self.cache.get(text)
        if n is None:
            n = self.count_tokens(text) - self.base
            if len(text) <= 20_000:
                self.cache[text] = n
        return n


def _trim(text: str, s: int, e: int, keep_indent: bool) -> tuple[int, int] | None:
    piece = text[s:e]
    stripped = piece.strip()
    if not stripped:
        return None
    lead = len(piece) - len(piece.lstrip())
    if keep_indent:  # back to the start of the first non-blank line
        line_start = piece.rfind("\n", 0, lead) + 1
        lead = line_start
    return s + lead, s + len(piece.rstrip())


def _cut(text: str, s: int, e: int, pattern: re.Pattern, keep_indent: bool) -> list[tuple[int, int]]:
    """The span split after each match of pattern, each piece trimmed (pieces cover its non-space)."""
    cuts = [s] + [m.end() for m in pattern.finditer(text, s, e) if s < m.end() < e] + [e]
    pieces = [_trim(text, a, z, keep_indent) for a, z in zip(cuts, cuts[1:])]
    return [p for p in pieces if p]


def _atoms(text: str, s: int, e: int, cap: int, count: _Counter, code: bool) -> list[tuple[int, int, int]]:
    """(start, end, tokens) pieces of text[s:e], each within cap tokens, splitting as coarsely as possible."""
    levels = [_PARAGRAPH_BREAK] + ([] if code else [_SENTENCE_END]) + [_LINE_BREAK, _SPACE]
    out: list[tuple[int, int, int]] = []

    def split(a: int, z: int, depth: int) -> None:
        n = count(text[a:z])
        if n <= cap:
            out.append((a, z, n))
            return
        while depth < len(levels):
            pieces = _cut(text, a, z, levels[depth], keep_indent=code and levels[depth] is not _SPACE)
            depth += 1
            if len(pieces) > 1:
                for pa, pz in pieces:
                    split(pa, pz, depth)
                return
        out.extend(_by_chars(text, a, z, cap, count))

    split(s, e, 0)
    return out


def _by_chars(text: str, s: int, e: int, cap: int, count: _Counter) -> list[tuple[int, int, int]]:
    """A single unbreakable run over cap tokens, cut into the longest prefixes that fit."""
    out = []
    while s < e:
        lo, hi = s + 1, e  # largest z in [lo, hi] with count(text[s:z]) <= cap
        if count(text[s:lo]) > cap:
            raise InvalidRequest(f"max_tokens is too small: one character {text[s]!r} is over it")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(text[s:mid]) <= cap:
                lo = mid
            else:
                hi = mid - 1
        out.append((s, lo, count(text[s:lo])))
        s = lo
    return out


# --------------------------------------------------------------------------------------- packing


def chunk_document(
    doc: Document, count_tokens: Callable[[str], int], max_tokens: int = 256, overlap_tokens: int = 32
) -> list[Chunk]:
    """The chunks of ``doc``; see the module docstring for the contract and the policy."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be a positive int, got {max_tokens!r}")
    if not isinstance(overlap_tokens, int) or not 0 <= overlap_tokens < max_tokens:
        raise InvalidRequest(f"overlap_tokens must be an int in [0, max_tokens), got {overlap_tokens!r}")
    count = _Counter(count_tokens)
    cap = max_tokens - count.base
    if cap < 1:
        raise InvalidRequest(
            f"max_tokens={max_tokens} leaves no room: the tokenizer adds {count.base} tokens to any text"
        )
    text, chunks = doc.text, []
    for section in _sections(doc):
        atoms = [a for block in section.blocks for a in _atoms(text, block.start, block.end, cap, count, block.code)]
        for start, end in _pack(text, atoms, cap, min(overlap_tokens, cap - 1), count):
            chunks.append(Chunk(text[start:end], len(chunks), start, end, section.heading))
    return chunks


def _pack(text: str, atoms: list[tuple[int, int, int]], cap: int, overlap: int, count: _Counter):
    """Greedy packing of one section's atoms into (start, end) spans of at most cap tokens, with overlap."""
    i, prev = 0, None
    while i < len(atoms):
        start, used = atoms[i][0], atoms[i][2]
        if prev is not None and overlap > 0:
            room = min(overlap, cap - atoms[i][2])
            found = _overlap_start(text, prev[0], prev[1], room, count)
            if found is not None:
                start, used = found[0], found[1] + atoms[i][2]
        j = i + 1
        while j < len(atoms) and used + atoms[j][2] <= cap:
            used += atoms[j][2]
            j += 1
        while count(text[start : atoms[j - 1][1]]) > cap:  # the estimate was low: give back atoms, then overlap
            if j - 1 > i:
                j -= 1
            else:
                assert start != atoms[i][0], "an atom over the cap"
                start = atoms[i][0]
        prev = (start, atoms[j - 1][1])
        yield prev
        i = j


def _overlap_start(text: str, ps: int, pe: int, budget: int, count: _Counter) -> tuple[int, int] | None:
    """(position, tokens): the earliest word start after ps whose tail text[pos:pe] fits budget,
    moved to a sentence or line start when that keeps at least half the budget."""
    if budget <= 0:
        return None
    words = [m.start() for m in _WORD.finditer(text, ps, pe)][1:]
    lo, hi = 0, len(words)
    while lo < hi:  # first k whose tail fits (tails shrink as k grows)
        mid = (lo + hi) // 2
        if count(text[words[mid] : pe]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(words):
        return None
    best = words[lo]
    for m in _RESTART.finditer(text, ps, pe):
        if best <= m.end() < pe:
            n = count(text[m.end() : pe])
            if 2 * n >= budget:
                return m.end(), n
            break
    return best, count(text[best:pe])
