"""Ingest stays inside what it was given.

A tree holding ``passwd.txt -> /etc/passwd`` (here a tmp file outside the tree stands in
for it) and a link to a directory elsewhere: by default no link is followed; with
``follow_symlinks`` / ``--follow-symlinks`` links inside the given paths are, links
leading outside are still skipped with their reason; a path named explicitly is taken.
Real files, real symlinks, a real knowledge base and the real ``chatkv ingest`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatkv.retrieval import KnowledgeBase
from chatkv.retrieval.documents import FileError, discover
from chatkv.retrieval.embedding import Embedder

SECRET = "root:x:0:0:root:/root:/bin/bash\n"


@pytest.fixture
def tree(tmp_path) -> Path:
    """tree/ with a real file, links inside it, and links to a file and a directory outside."""
    outside = tmp_path / "outside"
    (outside / "private").mkdir(parents=True)
    (outside / "passwd").write_text(SECRET)
    (outside / "private" / "keys.md").write_text("# Keys\n\nThe vault code is 4711.\n")
    docs = tmp_path / "tree"
    (docs / "sub").mkdir(parents=True)
    (docs / "readme.md").write_text("# Readme\n\nThe kettle boils water.\n")
    (docs / "sub" / "inner.md").write_text("# Inner\n\nSourdough needs a starter.\n")
    os.symlink(outside / "passwd", docs / "passwd.txt")  # standing in for /etc/passwd
    os.symlink(outside / "private", docs / "elsewhere")  # a directory outside
    os.symlink(docs / "sub" / "inner.md", docs / "inner-link.md")  # a file inside
    os.symlink("sub", docs / "sub-link")  # a directory inside (relative)
    return docs


def _split(items):
    files = sorted(str(i) for i in items if not isinstance(i, FileError))
    errors = {os.path.basename(i.source): i.reason for i in items if isinstance(i, FileError)}
    return files, errors


def test_symlinks_are_not_followed_by_default(tree):
    files, errors = _split(list(discover(tree)))
    assert files == [str(tree / "readme.md"), str(tree / "sub" / "inner.md")]
    assert sorted(errors) == ["elsewhere", "inner-link.md", "passwd.txt", "sub-link"]
    assert all("not followed" in r and "follow_symlinks" in r for r in errors.values())


def test_followed_links_stay_inside_the_given_paths(tree):
    outside = tree.parent / "outside"
    files, errors = _split(list(discover(tree, follow_symlinks=True)))
    # the links inside are taken (each file once, resolved); the ones leading out are skipped with why
    assert files == [str(tree / "readme.md"), str(tree / "sub" / "inner.md")]
    assert sorted(errors) == ["elsewhere", "passwd.txt"]
    assert errors["passwd.txt"].startswith(f"a symbolic link to {outside / 'passwd'}, outside the given paths")
    assert "outside the given paths" in errors["elsewhere"]
    assert not any(str(outside) in f for f in files)


def test_a_link_named_explicitly_or_into_another_given_path_is_taken(tree):
    outside = tree.parent / "outside"
    # named as a root: the link itself is the opt-in
    files, errors = _split(list(discover([tree / "passwd.txt"])))
    assert files == [str(outside / "passwd")] and not errors
    # a second root makes the directory it points into "inside"
    files, errors = _split(list(discover([tree, outside / "private"], follow_symlinks=True)))
    assert str(outside / "private" / "keys.md") in files
    assert sorted(errors) == ["passwd.txt"]


def test_a_knowledge_base_never_holds_the_outside_file(tree, tmp_path):
    kb = KnowledgeBase.open("kb", data_dir=tmp_path / "data", embedder=Embedder())
    try:
        report = kb.add([tree])
        assert sorted(Path(s).name for s in report.added) == ["inner.md", "readme.md"]
        assert sorted(Path(e.source).name for e in report.skipped) == [
            "elsewhere",
            "inner-link.md",
            "passwd.txt",
            "sub-link",
        ]
        report = kb.add([tree], follow_symlinks=True)
        assert sorted(Path(e.source).name for e in report.skipped) == ["elsewhere", "passwd.txt"]
        assert not any("root:x:0:0" in h.text for h in kb.search("root bash", k=10, mode="lexical"))
        assert not any("vault" in h.text for h in kb.search("vault code", k=10, mode="lexical"))
        assert sorted(Path(d.source).name for d in kb.documents()) == ["inner.md", "readme.md"]
    finally:
        kb.close()


def _chatkv(*args, home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CHATKV_HOME=str(home))
    return subprocess.run(
        [sys.executable, "-m", "chatkv.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


def test_chatkv_ingest_skips_links_out_of_the_tree_and_follows_them_only_on_request(tree, tmp_path):
    home = tmp_path / "home"
    p = _chatkv("ingest", str(tree), "--kb", "t1", "--follow-symlinks", home=home)
    assert p.returncode == 0, p.stderr
    assert "2 added" in p.stdout
    assert f"skipped {tree / 'passwd.txt'}: a symbolic link to" in p.stderr and "outside the given paths" in p.stderr
    assert "Traceback" not in p.stderr
    p = _chatkv("kb", "search", "t1", "root bash", "--mode", "lexical", home=home)
    assert p.returncode == 0, p.stderr
    assert "root:x:0:0" not in p.stdout
    p = _chatkv("ingest", str(tree), "--kb", "t2", home=home)  # the default: no link followed
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("not followed") == 4
