"""Every error a caller can catch is defined in chatkv.errors and exported from ``chatkv``."""

from __future__ import annotations

import ast
import inspect

import chatkv
from chatkv import errors
from tests.test_import_graph import discover


def defined_errors() -> dict[str, type]:
    return {
        n: c
        for n, c in vars(errors).items()
        if inspect.isclass(c) and issubclass(c, errors.ChatKVError) and c.__module__ == errors.__name__
    }


def test_every_error_is_exported_from_chatkv():
    names = defined_errors()
    for must in ["ChatKVError", "ConversationBusy", "LeaseLost", "ContextOverflow", "EngineClosed", "DocumentError"]:
        assert must in names
    missing = sorted(set(names) - set(chatkv.__all__))
    assert not missing, f"not in chatkv.__all__: {missing}"
    for name, cls in names.items():
        assert getattr(chatkv, name) is cls


def test_no_error_is_defined_outside_chatkv_errors():
    """A subclass of one of chatkv's errors defined in any other module of the distribution."""
    ours = set(defined_errors())
    bad = []
    for name, (file, _) in discover().items():
        if name == "chatkv.errors":
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases}
                if bases & ours:
                    bad.append(f"{name}:{node.lineno} class {node.name}")
    assert not bad, "\n".join(bad)


def test_the_old_import_paths_still_work():
    from chatkv.retrieval.documents import DocumentError
    from chatkv.sessions.context_window import ContextOverflow

    assert ContextOverflow is errors.ContextOverflow and issubclass(ContextOverflow, errors.InvalidRequest)
    assert DocumentError is errors.DocumentError
    e = DocumentError("a.txt", "empty")
    assert (str(e), e.source, e.reason) == ("a.txt: empty", "a.txt", "empty")
