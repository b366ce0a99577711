"""Finding and loading documents: files on disk (or texts) -> Document, with one clear error per bad file.

Why past ~400 lines: the HTML-to-text parser (~150 lines at the end) lives here because it serves
only ``load_file`` and ``document_from_text``.

Contracts:

- ``discover(paths, include, exclude)`` yields, in a stable sorted order, the files under the given
  files and directories as resolved absolute ``Path`` s, each at most once, or a ``FileError`` for
  what cannot be used (missing, dangling symlink, symlink loop, not a regular file, too big,
  unlistable directory). It never reads a file and never hangs on a symlink loop.
  It stays inside what it was given: symbolic links found in a walk are not followed (one
  ``FileError`` each) unless ``follow_symlinks=True``, and even then a link that resolves
  outside every given path is skipped with its reason. A path named explicitly is always
  taken, wherever it points (naming it is the opt-in). Hard links and bind mounts look like
  ordinary files and directories to the OS and are read as such (docs/how-to/rag.md,
  "RAG: knowledge bases and cited answers").
- ``load_file(path)`` returns a ``Document`` or raises ``DocumentError`` naming the file and one
  clear reason. A file over ``max_bytes`` is refused from its size alone, before it is opened.
- ``Document.text`` is plain text with "\\n" line ends. HTML keeps visible text only, headings as
  markdown "# " lines and <pre> as ``` fences, so chunking sees the structure; PDF joins its page
  texts with "\\n\\n" (``metadata["page_starts"]`` gives each page's offset into ``text``).

Encoding detection (no extra dependency): a BOM (UTF-8, UTF-16, UTF-32) wins; a file holding NUL
bytes is UTF-16 without BOM when the NULs sit on one byte parity (ASCII-heavy UTF-16), otherwise
binary; then strict UTF-8; then cp1252 / latin-1, only when the result has under 1% control
characters. Anything else is "not a text encoding chatkv can detect" (or "binary file" for an
extension chatkv does not know).
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import io
import os
import re
import stat
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

from chatkv.errors import DocumentError  # noqa: F401 (defined in chatkv.errors; imported from here too)

DEFAULT_MAX_BYTES = 20 * 2**20
KINDS = ("text", "markdown", "rst", "html", "code", "pdf")
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules"})  # besides every name starting with "."

_PROSE = {
    ".txt": "text",
    ".text": "text",
    ".log": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".rst": "rst",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
}
_LANGUAGES = {
    ".py": "python",
    ".pyi": "python",
    ".js": "javascript",
    ".mjs": "javascript",
    ".cjs": "javascript",
    ".jsx": "javascript",
    ".ts": "typescript",
    ".tsx": "typescript",
    ".go": "go",
    ".rs": "rust",
    ".c": "c",
    ".h": "c",
    ".cpp": "cpp",
    ".cc": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".hh": "cpp",
    ".java": "java",
    ".kt": "kotlin",
    ".scala": "scala",
    ".cs": "csharp",
    ".swift": "swift",
    ".rb": "ruby",
    ".php": "php",
    ".lua": "lua",
    ".pl": "perl",
    ".r": "r",
    ".jl": "julia",
    ".sh": "shell",
    ".bash": "shell",
    ".zsh": "shell",
    ".ps1": "powershell",
    ".sql": "sql",
    ".toml": "toml",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".json": "json",
    ".ini": "ini",
    ".cfg": "ini",
    ".xml": "xml",
    ".css": "css",
    ".scss": "css",
    ".proto": "protobuf",
    ".cmake": "cmake",
}
_NAMED = {"Makefile": "make", "GNUmakefile": "make", "Dockerfile": "dockerfile", "CMakeLists.txt": "cmake"}
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG image"),
    (b"\xff\xd8\xff", "JPEG image"),
    (b"GIF8", "GIF image"),
    (b"PK\x03\x04", "zip archive"),
    (b"\x1f\x8b", "gzip archive"),
    (b"\x7fELF", "ELF executable"),
    (b"SQLite format 3\x00", "SQLite database"),
    (b"%PDF-", "PDF"),
)
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class Document:
    source: str  # resolved absolute path for files; the given name for texts
    text: str  # extracted plain text, "\n" line ends
    kind: str  # one of KINDS
    content_hash: str  # sha256 hex of the raw file bytes (of the utf-8 text for document_from_text)
    metadata: dict = field(default_factory=dict)  # {"encoding": ...}, {"language": ...}, {"pages": n, ...}


@dataclass(frozen=True)
class FileError:
    source: str
    reason: str  # one line

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}"


# ---------------------------------------------------------------------------------------- discover


def discover(
    paths,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    follow_symlinks: bool = False,
) -> Iterator[Path | FileError]:
    """Files under ``paths`` (a path or an iterable of paths: files or directories, walked recursively
    in sorted order), as resolved absolute Paths, each file once; a FileError for each thing that
    cannot be used.

    Globs (fnmatch; ``*`` also crosses "/", a leading ``**/`` also matches at the top) are tried on
    the path relative to the given directory and on the bare name. ``include`` keeps only matching
    files; ``exclude`` drops matching files and prunes matching directories. A file named explicitly
    in ``paths`` is always taken (globs filter what a directory walk finds). Inside a walk, names
    starting with "." (.git, .venv, .env ...) and __pycache__ / node_modules are skipped.
    Symlinks met in a walk are one FileError each ("not followed") unless ``follow_symlinks``;
    followed, a link resolving outside every given path (each resolved) is one FileError
    ("outside the given paths"), a link back to a directory being walked one FileError
    "symlink loop", a dangling link one FileError; a directory reached twice is walked once.
    A given path that is itself a link is followed: it was named.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    include = [include] if isinstance(include, str) else list(include or [])
    exclude = [exclude] if isinstance(exclude, str) else list(exclude or [])
    seen_files: set[str] = set()
    seen_dirs: set[tuple[int, int]] = set()
    given_paths = [Path(g).expanduser().absolute() for g in paths]
    roots = [os.path.realpath(p) for p in given_paths]  # what a followed link may resolve into
    links = _Links(follow_symlinks, roots)
    for path in given_paths:
        st = _stat(path)
        if isinstance(st, FileError):
            yield st
        elif stat.S_ISDIR(st.st_mode):
            yield from _walk(path, st, include, exclude, max_bytes, seen_files, seen_dirs, links)
        else:
            item = _file_item(path, st, max_bytes, seen_files)
            if item is not None:
                yield item


class _Links:
    """What a walk does with a symbolic link: skip it, or follow it while it stays inside ``roots``."""

    def __init__(self, follow: bool, roots: list[str]):
        self.follow = follow
        self.roots = roots

    def refuse(self, path: Path) -> FileError | None:
        """None to take the link at ``path``, else why not."""
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if not self.follow:
            return FileError(
                str(path),
                f"a symbolic link (to {target}), not followed; pass follow_symlinks=True "
                f"(chatkv ingest --follow-symlinks) to take links inside the given paths",
            )
        real = os.path.realpath(path)
        if not os.path.exists(real):
            return None  # dangling or a loop: _stat says which
        for root in self.roots:
            if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
                return None
        return FileError(
            str(path),
            f"a symbolic link to {real}, outside the given paths; not followed (name it as a path to ingest it)",
        )


def _walk(root: Path, root_st, include, exclude, max_bytes, seen_files, seen_dirs, links: _Links):
    key = (root_st.st_dev, root_st.st_ino)
    if key in seen_dirs:
        return
    seen_dirs.add(key)
    # explicit stack instead of recursion: (directory, its path relative to root, ancestor dir ids)
    stack = [(root, "", frozenset({key}))]
    while stack:
        folder, rel, ancestors = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            yield FileError(str(folder), _os_reason(e, "cannot list directory"))
            continue
        subdirs = []
        for entry in entries:
            name = entry.name
            rel_path = f"{rel}{name}"
            if name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_symlink():
                refused = links.refuse(path)
                if refused is not None:
                    yield refused
                    continue
            st = _stat(path)
            if isinstance(st, FileError):
                yield st
                continue
            if stat.S_ISDIR(st.st_mode):
                dkey = (st.st_dev, st.st_ino)
                if name in SKIPPED_DIRS or _matches(rel_path, name, exclude):
                    continue
                if dkey in ancestors:
                    target = os.readlink(path) if entry.is_symlink() else "?"
                    yield FileError(str(path), f"symlink loop (points to {target}, a directory above it)")
                    continue
                if dkey in seen_dirs:
                    continue
                seen_dirs.add(dkey)
                subdirs.append((path, rel_path + "/", ancestors | {dkey}))
                continue
            if include and not _matches(rel_path, name, include):
                continue
            if _matches(rel_path, name, exclude):
                continue
            item = _file_item(path, st, max_bytes, seen_files)
            if item is not None:
                yield item
        stack.extend(reversed(subdirs))  # files of a directory first, then its subdirectories in order


def _matches(rel: str, name: str, patterns: list[str]) -> bool:
    for pat in patterns:
        pat = pat.rstrip("/")
        if fnmatchcase(rel, pat) or fnmatchcase(name, pat):
            return True
        if pat.startswith("**/") and fnmatchcase(rel, pat[3:]):
            return True
    return False


def _stat(path: Path):
    """os.stat following links, or a FileError (dangling link, loop, permission...)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return FileError(str(path), f"dangling symlink (points to {os.readlink(path)}, which does not exist)")
        return FileError(str(path), "no such file or directory")
    except OSError as e:
        return FileError(str(path), _os_reason(e, "cannot stat"))


def _file_item(path: Path, st, max_bytes: int, seen_files: set[str]):
    if not stat.S_ISREG(st.st_mode):
        return FileError(str(path), "not a regular file (a device, socket or pipe)")
    resolved = Path(os.path.realpath(path))
    if str(resolved) in seen_files:
        return None
    seen_files.add(str(resolved))
    if st.st_size > max_bytes:
        return FileError(str(resolved), _too_big(st.st_size, max_bytes))
    return resolved


def _os_reason(e: OSError, doing: str) -> str:
    if e.errno == errno.ELOOP:
        return "symlink loop"
    if isinstance(e, PermissionError):
        return "permission denied"
    return f"{doing}: {e.strerror or e}"


def _too_big(size: int, max_bytes: int) -> str:
    limit = f"{max_bytes // 2**20} MB" if max_bytes % 2**20 == 0 else f"{max_bytes:,} bytes"
    return f"larger than {limit} ({size:,} bytes)"


# --------------------------------------------------------------------------------------- load_file


def load_file(path, max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """The Document of one file, or DocumentError(source, reason). See the module docstring."""
    path = Path(path).expanduser().absolute()
    st = _stat(path)
    if isinstance(st, FileError):
        raise DocumentError(st.source, st.reason)
    source = os.path.realpath(path)
    if stat.S_ISDIR(st.st_mode):
        raise DocumentError(source, "a directory, not a file (use discover)")
    if not stat.S_ISREG(st.st_mode):
        raise DocumentError(source, "not a regular file (a device, socket or pipe)")
    if st.st_size > max_bytes:
        raise DocumentError(source, _too_big(st.st_size, max_bytes))
    try:
        with open(source, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise DocumentError(source, _os_reason(e, "cannot read")) from None
    if len(raw) > max_bytes:
        raise DocumentError(source, _too_big(len(raw), max_bytes))
    if not raw:
        raise DocumentError(source, "empty (0 bytes)")
    content_hash = hashlib.sha256(raw).hexdigest()
    name, ext = os.path.basename(source), os.path.splitext(source)[1].lower()
    kind = _PROSE.get(ext) or ("code" if ext in _LANGUAGES or name in _NAMED else None)
    if kind is None and raw.startswith(b"%PDF-"):
        kind = "pdf"
    if kind == "pdf":
        text, metadata = _pdf_text(source, raw)
        return Document(source, text, "pdf", content_hash, metadata)
    try:
        text, encoding = _decode(raw)
    except _Undecodable as e:
        reason = e.reason if kind is not None or e.reason.startswith("binary") else "binary file"
        raise DocumentError(source, reason) from None
    metadata = {"encoding": encoding}
    if kind == "code":
        metadata["language"] = _NAMED.get(name) or _LANGUAGES[ext]
    text = _normalise(text)
    if kind == "html":
        text, title = html_to_text(text)
        if title:
            metadata["title"] = title
        if not text.strip():
            raise DocumentError(source, "empty (no visible text in the HTML)")
    elif not text.strip():
        raise DocumentError(source, "empty (whitespace only)")
    return Document(source, text, kind or "text", content_hash, metadata)


def document_from_text(text: str, source: str, kind: str = "text", metadata: dict | None = None) -> Document:
    """A Document for a text given in memory. kind "html" means ``text`` is HTML (its visible text is
    kept); "pdf" is not accepted. The hash is of ``text`` as given, encoded as UTF-8."""
    if not isinstance(text, str):
        raise DocumentError(str(source), f"text must be a str, got {type(text).__name__}")
    if kind not in KINDS or kind == "pdf":
        raise DocumentError(
            str(source), f"kind must be one of {', '.join(k for k in KINDS if k != 'pdf')}, got {kind!r}"
        )
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DocumentError(str(source), f"not valid Unicode: a lone surrogate at character {e.start}") from None
    metadata = dict(metadata or {})
    text = _normalise(text)
    if kind == "html":
        text, title = html_to_text(text)
        if title:
            metadata.setdefault("title", title)
    if not text.strip():
        raise DocumentError(str(source), "empty (whitespace only)" if text or kind == "html" else "empty")
    return Document(str(source), text, kind, hashlib.sha256(raw).hexdigest(), metadata)


def _normalise(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


class _Undecodable(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def _decode(raw: bytes) -> tuple[str, str]:
    """(text, encoding name) or _Undecodable(reason)."""
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            try:
                return raw[len(bom) :].decode(encoding.replace("-sig", "")), encoding
            except UnicodeDecodeError as e:
                raise _Undecodable(
                    f"starts with a {encoding} byte-order mark but is not valid {encoding} (byte {e.start + len(bom)})"
                ) from None
    if b"\x00" in raw:
        encoding = _utf16_guess(raw[:8192])
        if encoding:
            try:
                text = raw.decode(encoding)
                if _control_share(text) < 0.01:
                    return text, encoding
            except UnicodeDecodeError:
                pass
        for magic, what in _MAGIC:
            if raw.startswith(magic):
                raise _Undecodable(f"binary file ({what})")
        raise _Undecodable("binary file (holds NUL bytes)")
    try:
        return raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as e:
        bad_utf8 = e.start
    for encoding in ("cp1252", "latin-1"):
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            continue
        share = _control_share(text)
        if share < 0.01:
            return text, encoding
    raise _Undecodable(
        f"not a text encoding chatkv can detect: not UTF-8 (invalid byte at {bad_utf8:,}), "
        f"no UTF-16/32 byte-order mark, and as latin-1 {share:.0%} of it would be control characters"
    )


def _utf16_guess(head: bytes) -> str | None:
    """UTF-16 without a BOM: NULs (the high bytes of ASCII characters) on one byte parity only."""
    even, odd = head[0::2], head[1::2]
    if not even or not odd:
        return None
    zero_even, zero_odd = even.count(0) / len(even), odd.count(0) / len(odd)
    if zero_odd > 0.3 and zero_even < 0.05:
        return "utf-16-le"
    if zero_even > 0.3 and zero_odd < 0.05:
        return "utf-16-be"
    return None


def _control_share(text: str) -> float:
    return len(_CONTROL.findall(text)) / max(1, len(text))


def _pdf_text(source: str, raw: bytes) -> tuple[str, dict]:
    try:
        import pypdf
    except ImportError:  # pragma: no cover - pypdf is a dependency
        raise DocumentError(source, "reading PDF needs pypdf (pip install pypdf)") from None
    try:
        reader = pypdf.PdfReader(io.BytesIO(raw))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")  # an empty user password opens many "protected" PDFs
            except Exception:
                opened = 0
            if not opened:
                raise DocumentError(source, "PDF is encrypted (needs a password)")
        pages = [_normalise(page.extract_text() or "") for page in reader.pages]
    except DocumentError:
        raise
    except Exception as e:  # pypdf raises many types for damaged files
        raise DocumentError(source, f"not a readable PDF ({type(e).__name__}: {str(e)[:200]})") from None
    starts, pos = [], 0
    for page in pages:
        starts.append(pos)
        pos += len(page) + 2
    text = "\n\n".join(pages)
    if not text.strip():
        raise DocumentError(source, f"PDF has no text layer ({len(pages)} pages; scanned images need OCR first)")
    return text, {"pages": len(pages), "page_starts": starts}


# ------------------------------------------------------------------------------------ HTML to text

_SKIP = frozenset({"script", "style", "template", "noscript", "svg", "canvas", "iframe", "object"})
_PARA = frozenset(
    {
        "p",
        "blockquote",
        "table",
        "ul",
        "ol",
        "dl",
        "section",
        "article",
        "header",
        "footer",
        "main",
        "nav",
        "aside",
        "figure",
        "hr",
        "form",
        "details",
        "fieldset",
    }
)
_LINE = frozenset({"div", "li", "tr", "dt", "dd", "br", "caption", "figcaption", "summary", "address", "legend"})


def html_to_text(html: str) -> tuple[str, str]:
    """(visible text, <title>) of an HTML page: script/style/head dropped, h1-h6 as "# " lines,
    <pre> as ``` fences, block elements ending lines, paragraphs separated by a blank line."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return "".join(parser.out), parser.title


class _HTMLText(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.inline: list[str] = []
        self.pending = 0  # newlines owed before the next text
        self.bullet = False
        self.skip_tag, self.skip_depth = None, 0
        self.in_head = False
        self.title, self.title_buf = "", None
        self.heading, self.heading_buf = 0, []
        self.pre, self.pre_buf = 0, []

    def _emit(self, s: str) -> None:
        if self.out and self.pending:
            self.out.append("\n" * self.pending)
        self.pending = 0
        self.out.append(s)

    def _flush(self) -> None:
        text = " ".join("".join(self.inline).split())
        self.inline = []
        if text:
            if self.bullet:
                text, self.bullet = "- " + text, False
            self._emit(text)

    def _break(self, n: int) -> None:
        self._flush()
        self.pending = max(self.pending, n)

    def handle_starttag(self, tag, attrs):
        if self.skip_tag:
            self.skip_depth += tag == self.skip_tag
            return
        if tag in _SKIP:
            self.skip_tag, self.skip_depth = tag, 1
        elif tag == "head":
            self.in_head = True
        elif tag == "body":
            self.in_head = False
        elif tag == "title":
            self.title_buf = []
        elif self.in_head:
            return
        elif len(tag) == 2 and tag[0] == "h" and tag[1] in "123456":
            self._break(2)
            self.heading, self.heading_buf = int(tag[1]), []
        elif tag == "pre":
            if not self.pre:
                self._break(2)
                self.pre_buf = []
            self.pre += 1
        elif tag == "br":
            if self.pre:
                self.pre_buf.append("\n")
            elif self.heading:
                self.heading_buf.append(" ")
            else:
                self._break(1)
        elif tag in ("td", "th"):
            if "".join(self.inline).strip():
                self.inline.append(" | ")
        elif tag == "li":
            self._break(1)
            self.bullet = True
        elif tag in _PARA:
            self._break(2)
        elif tag in _LINE:
            self._break(1)

    def handle_endtag(self, tag):
        if self.skip_tag:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "head":
            self.in_head = False
        elif tag == "title" and self.title_buf is not None:
            self.title, self.title_buf = " ".join("".join(self.title_buf).split()), None
        elif self.heading and tag == f"h{self.heading}":
            self._end_heading()
        elif tag == "pre" and self.pre:
            self.pre -= 1
            if not self.pre:
                self._end_pre()
        elif tag in _PARA:
            self._break(2)
        elif tag in _LINE:
            self._break(1)

    def handle_data(self, data):
        if self.skip_tag:
            return
        if self.title_buf is not None:
            self.title_buf.append(data)
        elif self.in_head:
            return
        elif self.pre:
            self.pre_buf.append(data)
        elif self.heading:
            self.heading_buf.append(data)
        else:
            self.inline.append(data)

    def _end_heading(self):
        text = " ".join("".join(self.heading_buf).split())
        level, self.heading = self.heading, 0
        if text:
            self._emit("#" * level + " " + text)
        self.pending = 2

    def _end_pre(self):
        content = "".join(self.pre_buf)
        content = (content[1:] if content.startswith("\n") else content).rstrip()
        if content.strip():
            fence = "~~~~" if "```" in content else "```"
            self._emit(f"{fence}\n{content}\n{fence}")
        self.pending = 2

    def close(self):
        super().close()
        if self.heading:
            self._end_heading()
        if self.pre:
            self._end_pre()
        self._flush()
