"""chatkv.retrieval.documents: every kind loads from a real file; each bad file gives one clear error;
discover walks directories with globs, skips hidden ones and never hangs on a symlink loop."""

from __future__ import annotations

import builtins
import hashlib
import io
import os
import random

import pytest

from chatkv.errors import ChatKVError
from chatkv.retrieval import documents
from chatkv.retrieval.documents import (
    Document,
    DocumentError,
    FileError,
    discover,
    document_from_text,
    load_file,
)

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f\x15\xc4\x89"


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one Helvetica text line per line of each page (offsets computed, real xref)."""

    def esc(s: str) -> str:
        return s.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    n = len(pages)
    objs = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{' '.join(f'{4 + 2 * i} 0 R' for i in range(n))}] /Count {n} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(pages):
        ops = (
            ""
            if not text
            else "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({esc(l)}) Tj T*" for l in text.split("\n")) + " ET"
        )
        stream = ops.encode("latin-1")
        objs.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            f"/Contents {5 + 2 * i} 0 R >>".encode()
        )
        objs.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for k, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % k + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    return bytes(out)


def write(path, data: bytes | str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def reason_of(path, **kw) -> str:
    with pytest.raises(DocumentError) as e:
        load_file(path, **kw)
    assert isinstance(e.value, ChatKVError)
    assert e.value.source and "\n" not in e.value.reason
    assert str(e.value) == f"{e.value.source}: {e.value.reason}"
    return e.value.reason


# ------------------------------------------------------------------------------------------ kinds


def test_markdown_rst_code_text_load_with_kind_hash_and_metadata(tmp_path):
    md = write(tmp_path / "guide.md", "# Guide\r\n\r\nSome *text*.\r\n")
    doc = load_file(md)
    assert doc == Document(
        md,
        "# Guide\n\nSome *text*.\n",
        "markdown",
        hashlib.sha256((tmp_path / "guide.md").read_bytes()).hexdigest(),
        {"encoding": "utf-8"},
    )
    assert load_file(write(tmp_path / "a.rst", "Title\n=====\n\nBody.\n")).kind == "rst"
    py = load_file(write(tmp_path / "m.py", "def f():\n    return 1\n"))
    assert (py.kind, py.metadata) == ("code", {"encoding": "utf-8", "language": "python"})
    assert load_file(write(tmp_path / "cfg.yml", "a: 1\n")).metadata["language"] == "yaml"
    assert load_file(write(tmp_path / "Makefile", "all:\n\techo hi\n")).metadata["language"] == "make"
    assert load_file(write(tmp_path / "run.log", "started\n")).kind == "text"
    unknown = load_file(write(tmp_path / "notes.xyz", "plain words\n"))  # unknown extension: sniffed as text
    assert (unknown.kind, unknown.text) == ("text", "plain words\n")
    old_mac = load_file(write(tmp_path / "mac.txt", b"one\rtwo\r"))
    assert old_mac.text == "one\ntwo\n"


def test_symlinked_file_source_is_the_resolved_path(tmp_path):
    real = write(tmp_path / "real.md", "hello")
    os.symlink(real, tmp_path / "link.md")
    assert load_file(tmp_path / "link.md").source == real


@pytest.mark.parametrize(
    "encoded,encoding",
    [
        ("\ufeffcafé naïve".encode("utf-8"), "utf-8-sig"),
        ("café naïve ☕".encode("utf-16"), "utf-16-le"),  # BOM
        (b"\xfe\xff" + "café naïve".encode("utf-16-be"), "utf-16-be"),
        ("café naïve ☕".encode("utf-32"), "utf-32-le"),
        ("café naïve, plain ASCII mostly".encode("utf-16-le"), "utf-16-le"),  # no BOM: NULs on odd bytes
        ("café naïve, plain ASCII mostly".encode("utf-16-be"), "utf-16-be"),
        ("café naïve – “quoted” €5".encode("cp1252"), "cp1252"),
        (("café naïve" + " plain words" * 20 + " \x81").encode("latin-1"), "latin-1"),  # 0x81: not cp1252
    ],
)
def test_text_encodings_are_detected(tmp_path, encoded, encoding):
    doc = load_file(write(tmp_path / "t.txt", encoded))
    assert doc.metadata["encoding"] == encoding
    assert doc.text.startswith("café naïve") and "\ufeff" not in doc.text


def test_html_keeps_visible_text_headings_as_markdown_and_pre_as_fence(tmp_path):
    page = write(
        tmp_path / "p.html",
        """<!doctype html><html><head><title>The  Page</title>
      <style>body { color: red }</style><script>var hidden = "secret";</script></head>
      <body><nav>Home</nav><h1>Guide</h1><p>Decorators &amp; <b>wrappers</b>
      wrap functions.</p><script>alert("x")</script><h2>Arguments</h2><ul><li>one</li><li>two</li></ul>
      <pre>def f(x):
    return x</pre><table><tr><td>a</td><td>b</td></tr></table></body></html>""",
    )
    doc = load_file(page)
    assert doc.kind == "html" and doc.metadata["title"] == "The Page"
    assert "secret" not in doc.text and "color" not in doc.text and "alert" not in doc.text
    assert "The Page" not in doc.text  # <head> is dropped (the title is in metadata)
    lines = doc.text.split("\n")
    assert "# Guide" in lines and "## Arguments" in lines
    assert "Decorators & wrappers wrap functions." in lines
    assert "- one" in lines and "- two" in lines and "a | b" in lines
    assert "```\ndef f(x):\n    return x\n```" in doc.text


def test_pdf_pages_joined_with_page_offsets(tmp_path):
    pytest.importorskip("pypdf")
    pdf = write(tmp_path / "doc.pdf", make_pdf(["First page about decorators.", "", "Third page (closures)."]))
    doc = load_file(pdf)
    assert doc.kind == "pdf" and doc.metadata["pages"] == 3
    assert "First page about decorators." in doc.text and "Third page (closures)." in doc.text
    starts = doc.metadata["page_starts"]
    assert doc.text[starts[2] :].startswith("Third page")
    # a PDF without the .pdf extension is recognised by its magic bytes
    assert load_file(write(tmp_path / "doc.bin", make_pdf(["Magic."]))).kind == "pdf"


def test_bad_pdfs_give_one_clear_reason(tmp_path):
    pypdf = pytest.importorskip("pypdf")
    assert "no text layer" in reason_of(write(tmp_path / "scan.pdf", make_pdf(["", ""])))
    assert reason_of(write(tmp_path / "broken.pdf", b"%PDF-1.4\n1 0 obj garbage")).startswith("not a readable PDF")
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(make_pdf(["Secret text."])))
    writer.encrypt("password", algorithm="RC4-128")
    buf = io.BytesIO()
    writer.write(buf)
    assert reason_of(write(tmp_path / "locked.pdf", buf.getvalue())) == "PDF is encrypted (needs a password)"
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(make_pdf(["Owner-only lock."])))
    writer.encrypt("", owner_password="owner", algorithm="RC4-128")  # opens with the empty user password
    buf = io.BytesIO()
    writer.write(buf)
    assert load_file(write(tmp_path / "owner.pdf", buf.getvalue())).text.strip() == "Owner-only lock."


def test_document_from_text():
    doc = document_from_text("a\r\nb", "note-1", metadata={"tag": "x"})
    assert doc == Document("note-1", "a\nb", "text", hashlib.sha256(b"a\r\nb").hexdigest(), {"tag": "x"})
    html = document_from_text("<title>T</title><h1>Hi</h1><p>there</p>", "web", kind="html")
    assert (html.text, html.metadata) == ("# Hi\n\nthere", {"title": "T"})
    for text, kind, needle in [
        ("", "text", "empty"),
        (" \n\t", "markdown", "empty"),
        ("x", "pdf", "kind"),
        ("x", "word", "kind"),
        ("bad \ud800", "text", "surrogate"),
        (b"x", "text", "str"),
    ]:
        with pytest.raises(DocumentError) as e:
            document_from_text(text, "src", kind=kind)
        assert needle in e.value.reason and e.value.source == "src"


# ------------------------------------------------------------------------------------- bad files


def test_each_bad_file_gives_one_clear_reason(tmp_path):
    assert reason_of(write(tmp_path / "img.png", PNG)) == "binary file (PNG image)"
    assert reason_of(write(tmp_path / "nul.txt", b"text\x00\x01\x02\x03 with NULs" * 10)).startswith("binary file")
    assert reason_of(write(tmp_path / "empty.md", b"")) == "empty (0 bytes)"
    assert reason_of(write(tmp_path / "blank.txt", " \n\t\r\n  ")) == "empty (whitespace only)"
    assert reason_of(write(tmp_path / "blank.html", "<html><script>x()</script></html>")).startswith("empty")
    assert reason_of(tmp_path / "missing.txt") == "no such file or directory"
    assert reason_of(tmp_path).startswith("a directory")


def test_wrong_encoding_is_refused_not_garbled(tmp_path):
    """Random bytes without NULs that are not UTF-8: as latin-1 ~23% would be control characters, so
    a known text extension says the encoding is undetectable, and an unknown one says binary."""
    rng = random.Random(7)
    noise = bytes(rng.randrange(1, 256) for _ in range(4000))
    with pytest.raises(UnicodeDecodeError):
        noise.decode("utf-8")
    reason = reason_of(write(tmp_path / "noise.txt", noise))
    assert reason.startswith("not a text encoding chatkv can detect") and "control characters" in reason
    assert reason_of(write(tmp_path / "noise.dat", noise)) == "binary file"
    bad_bom = reason_of(write(tmp_path / "bom.txt", b"\xef\xbb\xbfok \xff\xfe\xfd"))
    assert "byte-order mark" in bad_bom


def test_fifty_megabytes_is_refused_without_reading(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(50 * 2**20)  # sparse: instant
    monkeypatch.setattr(documents, "open", lambda *a, **k: pytest.fail("the big file was opened"), raising=False)
    assert reason_of(big) == "larger than 20 MB (52,428,800 bytes)"
    assert (
        reason_of(write(tmp_path / "small.txt", "x" * 2000), max_bytes=1000) == "larger than 1,000 bytes (2,000 bytes)"
    )
    assert list(discover(big)) == [FileError(str(big), "larger than 20 MB (52,428,800 bytes)")]


def test_unreadable_file(tmp_path, monkeypatch):
    secret = write(tmp_path / "secret.md", "# private")

    def no_permission(file, *args, **kwargs):
        if str(file) == secret:
            raise PermissionError(13, "Permission denied", str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(documents, "open", no_permission, raising=False)
    assert reason_of(secret) == "permission denied"


# -------------------------------------------------------------------------------------- discover


def rel(items, root) -> list[str]:
    return [
        os.path.relpath(i, root) if isinstance(i, os.PathLike) else f"ERR {os.path.relpath(i.source, root)}: {i.reason}"
        for i in items
    ]


def test_discover_sorted_recursive_skips_hidden_and_filters_globs(tmp_path):
    for name in [
        "b.md",
        "a.txt",
        "docs/z.md",
        "docs/api/y.py",
        "docs/api/x.md",
        "build/out.md",
        ".git/config",
        ".venv/lib/site.py",
        "docs/__pycache__/m.pyc",
        "node_modules/p/i.js",
        "docs/.hidden.md",
    ]:
        write(tmp_path / name, "content")
    assert rel(discover(tmp_path), tmp_path) == [
        "a.txt",
        "b.md",
        "build/out.md",
        "docs/z.md",
        "docs/api/x.md",
        "docs/api/y.py",
    ]
    assert rel(discover([tmp_path], include=["*.md"]), tmp_path) == [
        "b.md",
        "build/out.md",
        "docs/z.md",
        "docs/api/x.md",
    ]
    assert rel(discover(tmp_path, include=["docs/*"], exclude=["*.py"]), tmp_path) == ["docs/z.md", "docs/api/x.md"]
    assert rel(discover(tmp_path, exclude=["build", "docs/api"]), tmp_path) == ["a.txt", "b.md", "docs/z.md"]
    assert rel(discover(tmp_path, include=["**/*.py"]), tmp_path) == ["docs/api/y.py"]
    # an explicitly named file is always taken, hidden dirs too when named; each file once
    named = discover([tmp_path / ".git" / "config", tmp_path / "docs" / "z.md", tmp_path / "docs"], include=["*.txt"])
    assert rel(named, tmp_path) == [".git/config", "docs/z.md"]
    assert all(p.is_absolute() for p in discover(os.path.relpath(tmp_path)))
    assert rel(discover(tmp_path / "nope"), tmp_path) == ["ERR nope: no such file or directory"]


def test_symlink_loop_is_one_error_and_terminates(tmp_path):
    write(tmp_path / "docs" / "a.md", "a")
    write(tmp_path / "docs" / "sub" / "b.md", "b")
    os.symlink(tmp_path / "docs", tmp_path / "docs" / "sub" / "loop")  # dir -> its parent
    os.symlink("self", tmp_path / "docs" / "self")  # a link to itself
    items = list(discover(tmp_path / "docs", follow_symlinks=True))
    errors = [i for i in items if isinstance(i, FileError)]
    assert rel([i for i in items if not isinstance(i, FileError)], tmp_path) == ["docs/a.md", "docs/sub/b.md"]
    assert [e.reason.split(" (")[0] for e in errors] == ["symlink loop", "symlink loop"]
    assert {os.path.basename(e.source) for e in errors} == {"loop", "self"}


def test_dangling_symlink_fifo_and_links_followed_once(tmp_path):
    write(tmp_path / "shared" / "s.md", "s")
    write(tmp_path / "docs" / "a.md", "a")
    os.symlink(tmp_path / "shared", tmp_path / "docs" / "link1")
    os.symlink(tmp_path / "shared", tmp_path / "docs" / "link2")
    os.symlink(tmp_path / "shared" / "s.md", tmp_path / "docs" / "s-link.md")
    os.symlink(tmp_path / "gone.md", tmp_path / "docs" / "dangling.md")
    os.mkfifo(tmp_path / "docs" / "pipe")
    # followed links must stay inside the given paths: shared/ is given too (walked once)
    items = rel(discover([tmp_path / "docs", tmp_path / "shared"], follow_symlinks=True), tmp_path)
    assert items == [
        "docs/a.md",
        f"ERR docs/dangling.md: dangling symlink (points to {tmp_path / 'gone.md'}, which does not exist)",
        "ERR docs/pipe: not a regular file (a device, socket or pipe)",
        "shared/s.md",
    ]  # once, resolved (via s-link.md), not again via link1 or link2
    assert reason_of(tmp_path / "docs" / "dangling.md").startswith("dangling symlink")


def test_an_ingest_loop_reports_each_bad_file_once_and_loads_the_rest(tmp_path, monkeypatch):
    good = {"a.md": "# A\n\ntext", "b.py": "x = 1\n", "c.html": "<p>c</p>", "d.txt": "café".encode("cp1252")}
    bad = {"e.png": PNG, "f.txt": b"", "g.md": "   \n", "h.txt": bytes(range(128, 256)) * 20}
    for name, data in {**good, **bad}.items():
        write(tmp_path / name, data)
    with open(tmp_path / "i.txt", "wb") as f:
        f.truncate(50 * 2**20)
    os.symlink(tmp_path, tmp_path / "loop")
    loaded, skipped = [], {}
    for item in discover(tmp_path):
        if isinstance(item, FileError):
            skipped[os.path.basename(item.source)] = item.reason
            continue
        try:
            loaded.append(os.path.basename(load_file(item).source))
        except DocumentError as e:
            skipped[os.path.basename(e.source)] = e.reason
    assert loaded == sorted(good)
    assert sorted(skipped) == ["e.png", "f.txt", "g.md", "h.txt", "i.txt", "loop"]
