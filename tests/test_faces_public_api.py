"""The faces (``chatkv/server/``, ``tui/``, ``chatkv/cli.py``) use the public SDK only.

Every face file is read with ``ast``, never imported. An import of a chatkv module (at module
level or inside a function, relative ones resolved, ``importlib.import_module`` with a literal
name too) must be of another face, of ``chatkv`` itself for a name in its ``__all__``, or of a
public module below (and then never of a ``_name``). The engine's internals
(``chatkv.engine.core``: ``from chatkv import Engine``; ``chatkv.sessions.template``,
``chatkv.sessions.context_window``, ``chatkv.engine.text_tokens``, ``chatkv.sessions.manager``,
``chatkv.storage.*``, ``chatkv.weights.*``...) are not.

Attribute access to a ``_name`` of an SDK object is refused where it can be seen simply: ``x._y``
or ``getattr(x, "_y")`` where ``x`` is a name or attribute that holds one of the SDK's objects by
this code base's naming (``engine``, ``session``, ``metrics``, ``kb``...: ``self.metrics._pending``,
``session._m``), or a name imported from the SDK (``Engine._x``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = ("chatkv.tui", "chatkv.server", "chatkv.cli")
# public modules a face may import names from (besides ``chatkv``'s own exports)
PUBLIC_MODULES = {
    "chatkv.errors",  # every error, and check_text (the text checks the SDK applies)
    "chatkv.config",  # EngineConfig and the option choices (WEIGHTS, KV_DTYPES, HEADS, OVERFLOW_POLICIES)
    "chatkv.outputs",  # Usage, GenerationResult, Reply, EngineStats
    "chatkv.engine.sampling",  # SamplingParams
    "chatkv.engine.metrics",  # EngineMetrics: one engine's Prometheus collectors
    "chatkv.retrieval",  # KnowledgeBase, Embedder (the package's exports, not its modules)
    "chatkv.sessions.tools",  # tool specs from callables or JSON, tool_choice, the parsing of calls
}
# names that hold an SDK object in the faces' code (Engine, Session, EngineMetrics, KnowledgeBase...)
SDK_HANDLES = {
    "engine",
    "session",
    "sessions",
    "metrics",
    "kb",
    "knowledge",
    "knowledge_base",
    "store",
    "seq",
    "sequence",
    "result",
    "reply",
    "usage",
    "params",
    "manager",
    "session_manager",
}


def face_files(root: Path = ROOT) -> dict[str, Path]:
    """module name -> file, for every face (tui/ is chatkv.tui per pyproject's package-dir)."""
    out = {"chatkv.cli": root / "chatkv" / "cli.py"}
    for pkg, folder in (("chatkv.server", root / "chatkv" / "server"), ("chatkv.tui", root / "tui")):
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("").parts
            if "__pycache__" in rel:
                continue
            out[".".join((pkg,) + (rel[:-1] if rel[-1] == "__init__" else rel))] = f
    return {m: f for m, f in out.items() if f.exists()}


def chatkv_exports(root: Path = ROOT) -> set[str]:
    tree = ast.parse((root / "chatkv" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("chatkv/__init__.py declares no __all__")


def _is_face(mod: str) -> bool:
    return any(mod == f or mod.startswith(f + ".") for f in FACES)


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(module: str, source: str, exports: set[str], path: str = "<src>") -> list[str]:
    """What ``source`` (the face module ``module``) does beyond the public SDK, one line each."""
    tree = ast.parse(source, filename=path)
    is_pkg = path.endswith("__init__.py")
    bad: list[str] = []
    sdk_names: set[str] = set()  # names this module imported from the SDK

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def check_module(mod: str, names: list[str], line: int) -> None:
        if not (mod == "chatkv" or mod.startswith("chatkv.")) or _is_face(mod):
            return
        if mod == "chatkv":
            for n in names:
                if n != "*" and n not in exports and not _is_face(f"chatkv.{n}"):
                    bad.append(f"{path}:{line}: from chatkv import {n} - not in chatkv.__all__")
            return
        if mod not in PUBLIC_MODULES:
            bad.append(f"{path}:{line}: imports {mod}, not a public module of the SDK")
            return
        for n in names:
            if _private(n):
                bad.append(f"{path}:{line}: from {mod} import {n} - a private name")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                check_module(a.name, [], node.lineno)
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(node)
            names = [a.name for a in node.names]
            check_module(mod, names, node.lineno)
            if mod == "chatkv" or (mod.startswith("chatkv.") and not _is_face(mod)):
                sdk_names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Call):
            f = node.func
            if (
                (
                    (isinstance(f, ast.Name) and f.id in ("__import__", "import_module"))
                    or (isinstance(f, ast.Attribute) and f.attr == "import_module")
                )
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                check_module(node.args[0].value, [], node.lineno)
    handles = SDK_HANDLES | sdk_names
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _last_name(node.value) in handles:
            bad.append(f"{path}:{node.lineno}: {ast.unparse(node)} - a private attribute of an SDK object")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and _last_name(node.args[0]) in handles
        ):
            bad.append(f"{path}:{node.lineno}: {ast.unparse(node)} - a private attribute of an SDK object")
    return bad


def test_the_faces_use_only_the_public_sdk():
    exports = chatkv_exports()
    files = face_files()
    assert "chatkv.server.app" in files and "chatkv.tui.cli" in files and "chatkv.server.ray.deployments" in files
    bad = []
    for module, f in files.items():
        bad += violations(module, f.read_text(encoding="utf-8"), exports, str(f.relative_to(ROOT)))
    assert not bad, "the faces reach past the public SDK:\n" + "\n".join(bad)


def test_the_public_names_the_faces_import_exist():
    """Every name of ``chatkv.__all__`` is really there (the lazy ones included)."""
    import chatkv

    missing = [n for n in chatkv.__all__ if not hasattr(chatkv, n)]
    assert not missing


# ---------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    "src,found",
    [
        ("from chatkv.sessions.template import TurnRenderer\n", "imports chatkv.sessions.template"),
        (
            "def f():\n    from chatkv.sessions.context_window import ContextOverflow\n",
            "imports chatkv.sessions.context_window",
        ),
        ("import chatkv.engine.core\n", "imports chatkv.engine.core"),
        ("from chatkv.sessions import text_tokens\n", "imports chatkv.sessions, not a public module of the SDK"),
        ("from chatkv.storage.models import LOCAL_USER\n", "imports chatkv.storage.models"),
        ("from chatkv.errors import _hidden\n", "from chatkv.errors import _hidden - a private name"),
        (
            "from ..sessions.template import TurnRenderer\n",
            "imports chatkv.sessions.template",
        ),  # relative, from chatkv.server.x
        ("import importlib\nimportlib.import_module('chatkv.engine.loop')\n", "imports chatkv.engine.loop"),
        ("def f(state):\n    return len(state.metrics._pending)\n", "state.metrics._pending"),
        ("def f(session):\n    return getattr(session, '_m', None)\n", "getattr(session, '_m', None)"),
        ("def f(self):\n    return self.engine._sessions\n", "self.engine._sessions"),
        ("from chatkv import Engine\nEngine._to_ids\n", "Engine._to_ids"),
    ],
)
def test_checker_finds(src, found):
    bad = violations("chatkv.server.x", src, {"Engine", "ChatKVError"}, "chatkv/server/x.py")
    assert any(found in b for b in bad), bad


def test_checker_allows_the_public_sdk_and_the_faces_own_privates():
    src = (
        "from chatkv import Engine, ChatKVError\nfrom chatkv.errors import check_text\nfrom chatkv.server import app\n"
        "from . import routes\nfrom chatkv.tui.failures import error\nimport json\n"
        "class A:\n    def f(self):\n        self._cut = 1\n        return self._stream.write, self.state._cut, "
        "getattr(self, '_kv', None), self.metrics.pending, engine.__class__\n"
    )
    assert violations("chatkv.server.x", src, {"Engine", "ChatKVError"}, "chatkv/server/x.py") == []
