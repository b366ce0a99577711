"""Private reads across objects in chatkv's own code: one owner per object.

A *private read across objects* is, in the distribution's source (``chatkv/``, ``kernels/``,
``retrieval/``, ``storage/``, ``tui/``; tests are not counted):

- an attribute access ``X._name`` (one leading underscore, not a dunder), or
- a call ``getattr/hasattr/setattr/delattr(X, "_name", ...)`` with such a literal name,

where ``X`` is not the object's own: not ``self``, not ``cls``, not ``super()``; and not a library
object: ``X``'s leftmost name is not bound in its file by an import of a module outside the
distribution (``torch.ops.aten._x``, ``sys._getframe``, ``os._exit``: library internals). The
namedtuple API (``_replace``, ``_asdict``, ``_fields``, ``_make``) is public despite its
underscore. A read of one of the distribution's own modules' private names through the module
(``closing._helper``) does count.

The count may not exceed ``BOUND``; every site left says why on its line or just above.
Self-contained: ``ast`` only, nothing of chatkv is imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("chatkv", "kernels", "retrieval", "storage", "tui")
OWN = set(FOLDERS)  # top-level packages of the distribution: their modules' privates count
BOUND = 18
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
OWN_OBJECTS = {"self", "cls"}
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _library_names(tree: ast.AST) -> set[str]:
    """Names the file binds by importing a module from outside the distribution."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in OWN:
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] not in OWN:
                for a in node.names:
                    out.add(a.asname or a.name)
    return out


def _root(expr: ast.expr) -> ast.expr:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr


def _foreign(expr: ast.expr, library: set[str]) -> bool:
    """Whether ``expr`` is another object than the code's own, and not a library's."""
    if isinstance(expr, ast.Name) and expr.id in OWN_OBJECTS:
        return False
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super":
        return False
    root = _root(expr)
    if isinstance(root, ast.Name) and root.id in library:
        return False
    return True


def sites_in(source: str, where: str) -> list[str]:
    """``path:line: expression`` for every private read across objects in ``source``."""
    tree = ast.parse(source)
    library = _library_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _foreign(node.value, library):
            out.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTR_FUNCS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and _foreign(node.args[0], library)
        ):
            out.append((node.lineno, ast.unparse(node)))
    return [f"{where}:{line}: {text}" for line, text in sorted(out)]


def sites(root: Path = ROOT) -> list[str]:
    out = []
    for folder in FOLDERS:
        for f in sorted((root / folder).rglob("*.py")):
            out += sites_in(f.read_text(encoding="utf-8"), str(f.relative_to(root)))
    return out


def test_private_reads_across_objects_stay_within_the_bound():
    found = sites()
    assert len(found) <= BOUND, (
        f"{len(found)} private reads across objects (at most {BOUND}); each one "
        "reaches into another object's state - give its owner a public method:\n" + "\n".join(found)
    )


# ---------------------------------------------------------------- the counter itself


def test_counter_finds_reads_of_another_objects_privates():
    src = (
        "import torch\nfrom chatkv.engine import closing\n"
        "def f(engine, kb):\n"
        "    engine._gate.check('x')\n"
        "    getattr(kb, '_store', None)\n"
        "    closing._helper()\n"
        "    self.engine._loop\n"
    )
    found = sites_in(src, "x.py")
    assert [s.split(": ", 1)[1] for s in found] == [
        "engine._gate",
        "getattr(kb, '_store', None)",
        "closing._helper",
        "self.engine._loop",
    ], found


def test_counter_skips_own_library_and_namedtuple_reads():
    src = (
        "import sys\nimport torch\nimport numpy as np\nfrom os import path\n"
        "class A(B):\n"
        "    def f(self):\n"
        "        self._x = 1\n"
        "        super()._y()\n"
        "        torch.ops.aten._weight_int8pack_mm\n"
        "        sys._getframe(0)\n"
        "        np._core\n"
        "        path._joinrealpath\n"
        "        getattr(self, '_z', None)\n"
        "        row._replace(a=1)._asdict()\n"
        "        self.__class__\n"
        "    @classmethod\n"
        "    def g(cls):\n"
        "        return cls._made\n"
    )
    assert sites_in(src, "x.py") == []


if __name__ == "__main__":  # python tests/test_private_reads.py [ROOT]: every site, and the count
    found = sites(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(found))
    print(len(found))
