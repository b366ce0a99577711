"""The import graph of the chatkv distribution: no cycles, and the layers of DESIGN.md.

Every module of the distribution (chatkv/, and kernels/ retrieval/ storage/ tui/ as
chatkv.kernels ... per pyproject's package-dir) is read with ``ast``, never imported.
An edge is every import of a chatkv module, at module level, inside a function (a lazy
import still ties the two modules together) or under ``if TYPE_CHECKING:`` (a type one module
needs from the other is a tie too: put it in a leaf module both import, or name a protocol).
Relative imports are resolved. ``from P import x`` is an edge to ``P.x`` when that is a
module, otherwise to ``P``; ``import P.Q`` and ``from P.Q import y`` are edges to ``P.Q``
only (not to the parent packages Python also runs: ``from chatkv.errors import X`` is an
edge to chatkv.errors, not to chatkv/__init__). ``importlib.import_module("chatkv...")``
and ``__import__("chatkv...")`` with a literal name count too.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
TOP = "chatkv"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    path: str
    line: int
    lazy: bool  # inside a function, not at module level
    typing: bool = False  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        notes = [n for n, on in (("inside a function", self.lazy), ("under TYPE_CHECKING", self.typing)) if on]
        return f"{self.path}:{self.line}" + "".join(f" ({n})" for n in notes)


def package_dirs() -> dict[str, Path]:
    """Package name -> folder, from pyproject's [tool.setuptools] package-dir."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / folder for name, folder in conf.get("package-dir", {}).items()}
    assert TOP in dirs or (ROOT / TOP).is_dir()
    dirs.setdefault(TOP, ROOT / TOP)
    return dirs


def discover() -> dict[str, tuple[Path, bool]]:
    """Every module of the distribution: name -> (file, is a package's __init__)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in package_dirs().items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("").parts
            if any(part == "__pycache__" or part.startswith(".") for part in rel):
                continue
            is_pkg = rel[-1] == "__init__"
            name = ".".join((pkg,) + (rel[:-1] if is_pkg else rel))
            modules.setdefault(name, (f, is_pkg))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _literal_dynamic_import(node: ast.Call) -> str | None:
    f = node.func
    named = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module"
    )
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports_of(name: str, file: Path, is_pkg: bool, modules) -> tuple[list[Edge], list[str]]:
    """The edges out of one module, and the chatkv names it imports that do not exist."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    package = name if is_pkg else name.rpartition(".")[0]
    rel_path = str(file.relative_to(ROOT)) if file.is_relative_to(ROOT) else str(file)
    edges: list[Edge] = []
    missing: list[str] = []

    def ours(mod: str) -> bool:
        return mod == TOP or mod.startswith(TOP + ".")

    def add(dst: str, node: ast.AST, lazy: bool, typing: bool) -> None:
        if dst in modules:
            edges.append(Edge(name, dst, rel_path, node.lineno, lazy, typing))
        else:
            missing.append(f"{rel_path}:{node.lineno} imports {dst}, which the distribution does not have")

    def visit(node: ast.AST, lazy: bool, typing: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, lazy, True)
            for child in node.orelse:
                visit(child, lazy, typing)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    add(alias.name, node, lazy, typing)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if ours(base):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if alias.name != "*" and sub in modules else base, node, lazy, typing)
        elif isinstance(node, ast.Call):
            target = _literal_dynamic_import(node)
            if target and ours(target):
                add(target, node, lazy, typing)
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner, typing)

    visit(tree, False, False)
    return edges, missing


@pytest.fixture(scope="module")
def graph():
    modules = discover()
    edges: list[Edge] = []
    missing: list[str] = []
    for name, (file, is_pkg) in modules.items():
        e, m = imports_of(name, file, is_pkg, modules)
        edges += e
        missing += m
    return modules, edges, missing


def find_cycles(nodes, edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle through each strongly connected group of modules (Tarjan, then BFS)."""
    out: dict[str, dict[str, Edge]] = {n: {} for n in nodes}
    for e in edges:
        prev = out[e.src].get(e.dst)
        if prev is None or (prev.lazy, prev.typing) > (
            e.lazy,
            e.typing,
        ):  # show a module-level import when there is one
            out[e.src][e.dst] = e
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strongconnect(v: str) -> None:  # iterative: no recursion limit
        work = [(v, iter(sorted(out[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(out[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1 or node in out[node]:
                    groups.append(sorted(group))

    for n in sorted(nodes):
        if n not in index:
            strongconnect(n)

    cycles = []
    for group in sorted(groups):
        members, start = set(group), group[0]
        prev: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            nxt = []
            for u in frontier:
                for w in sorted(out[u]):
                    if w not in members:
                        continue
                    if w == start:
                        found = u
                        break
                    if w not in prev:
                        prev[w] = u
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        path.reverse()  # start ... found, then back to start
        cycles.append([out[a][b] for a, b in zip(path, path[1:] + [start])])
    return cycles


def describe(cycle: list[Edge]) -> str:
    names = " -> ".join([cycle[0].src] + [e.dst for e in cycle])
    return names + "\n" + "\n".join(f"    {e.src} imports {e.dst} at {e.where()}" for e in cycle)


# ---------------------------------------------------------------- the tests


def test_the_distribution_is_found(graph):
    modules, edges, _ = graph
    for name in [
        "chatkv",
        "chatkv.errors",
        "chatkv.engine.sampling",
        "chatkv.kernels",
        "chatkv.kernels.attention",
        "chatkv.storage",
        "chatkv.retrieval",
        "chatkv.tui",
        "chatkv.storage.migrations.env",
    ]:
        assert name in modules, name
    assert "kernels" not in modules and "storage.kv_store" not in modules  # no bare top-level names
    assert any(e.src == "chatkv.kernels" and e.dst == "chatkv.kernels.attention" for e in edges)


def test_every_chatkv_import_names_a_module_that_exists(graph):
    _, _, missing = graph
    assert not missing, "\n".join(missing)


def test_no_import_cycles(graph):
    modules, edges, _ = graph
    cycles = find_cycles(modules, edges)
    assert not cycles, f"{len(cycles)} import cycle(s) among chatkv modules:\n" + "\n".join(map(describe, cycles))


# Who may import whom: each package of the distribution, and what it may import from chatkv
# besides itself (docs/architecture.md, "The tree"). Read bottom-up: a package imports only
# packages further down, so the layers have no circles even where modules could.
LAYERS = {  # package: the packages it imports directly; PACKAGES adds what those import in turn
    "chatkv.errors": set(),
    "chatkv.config": {"chatkv.errors"},
    "chatkv.outputs": {"chatkv.errors"},
    "chatkv.kernels": {"chatkv.errors"},
    "chatkv.storage": {"chatkv.errors"},
    "chatkv.retrieval": {"chatkv.storage"},
    "chatkv.weights": {"chatkv.config", "chatkv.kernels", "chatkv.storage"},
    "chatkv.kvcache": {"chatkv.config", "chatkv.kernels", "chatkv.storage"},
    "chatkv.model": {"chatkv.weights", "chatkv.kvcache"},
    "chatkv.engine": {"chatkv.model", "chatkv.retrieval", "chatkv.outputs"},
    "chatkv.rag": {"chatkv.engine"},
    "chatkv.sessions": {"chatkv.rag"},
    "chatkv.conversations": {"chatkv.storage"},
}


def _below(package: str) -> set[str]:
    out: set[str] = set()
    for dep in LAYERS[package]:
        out |= {dep} | _below(dep)
    return out


PACKAGES = {package: _below(package) for package in LAYERS}
# The imports that point up a layer, each inside a function or under TYPE_CHECKING, and why.
UPWARD = {
    ("chatkv.engine.core", "chatkv.sessions.manager"): "Engine.sessions builds the session layer on first use",
    (
        "chatkv.engine.core",
        "chatkv.rag.placement",
    ): "a knowledge base's precompute_kv computes chunk KV with the engine",
    ("chatkv.engine.closing", "chatkv.sessions.manager"): "the type of the sessions close() spills (TYPE_CHECKING)",
    ("chatkv.model.self_check", "chatkv.engine.model_runner"): "a weight mode checks itself through the real runner",
}


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _package(mod: str) -> str | None:
    return next((p for p in PACKAGES if _inside(mod, p)), None)


def test_every_module_belongs_to_a_package(graph):
    """Every module below the faces is in one of PACKAGES: a new package must say what it may import."""
    modules, _, _ = graph
    faces = ("chatkv.tui", "chatkv.server", "chatkv.cli")
    loose = [m for m in modules if m != TOP and not any(_inside(m, f) for f in faces) and _package(m) is None]
    assert not loose, f"modules in no package of PACKAGES: {sorted(loose)}"
    assert len([m for m in modules if m.count(".") == 1 and not modules[m][1]]) <= 12  # at most 12 modules in chatkv/


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_what_they_may(graph, package):
    _, edges, _ = graph
    allowed = PACKAGES[package] | {package}
    bad = [
        f"{e.src} imports {e.dst} at {e.where()}"
        for e in edges
        if _inside(e.src, package)
        and not any(_inside(e.dst, ok) for ok in allowed)
        and not ((e.src, e.dst) in UPWARD and (e.lazy or e.typing))
    ]
    assert not bad, f"{package} may import only {sorted(allowed)} from chatkv:\n" + "\n".join(bad)


def test_every_upward_import_is_still_there(graph):
    """UPWARD lists only imports that exist (one that is gone leaves the list)."""
    _, edges, _ = graph
    present = {(e.src, e.dst) for e in edges}
    assert not set(UPWARD) - present, sorted(set(UPWARD) - present)


def test_nothing_imports_the_faces(graph):
    """DESIGN.md: the faces (tui/, chatkv/server/, and chatkv/cli.py that picks one) call the SDK; the
    SDK never calls them."""
    _, edges, _ = graph
    faces = ["chatkv.tui", "chatkv.server", "chatkv.cli"]
    bad = [
        f"{e.src} imports {e.dst} at {e.where()}"
        for e in edges
        for face in faces
        if _inside(e.dst, face) and not any(_inside(e.src, f) for f in faces)  # a face may dispatch to another
    ]
    assert not bad, "\n".join(bad)


# ray (the chatkv[ray] extra) is imported by these modules only; the rest of chatkv runs without it
RAY_MODULES = {"chatkv.server.ray.deployments", "chatkv.server.ray.request_routers"}


def imports_of_package(file: Path, package: str) -> list[int]:
    """Lines of ``file`` that import ``package`` or a module under it (lazy imports included)."""
    lines = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), filename=str(file))):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if any(n == package or n.startswith(package + ".") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_ray_modules_import_ray(graph):
    modules, edges, _ = graph
    importers = {name for name, (file, _) in modules.items() if imports_of_package(file, "ray")}
    assert importers == RAY_MODULES, f"modules importing ray: {sorted(importers)}; only {sorted(RAY_MODULES)} may"
    # and only the server's --ray entry point (lazily) and the ray modules themselves reach them
    bad = [
        f"{e.src} imports {e.dst} at {e.where()}"
        for e in edges
        if e.dst in RAY_MODULES and e.src not in RAY_MODULES and not (e.src == "chatkv.server.ray.options" and e.lazy)
    ]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- the checker itself


def _fake_tree(tmp_path: Path, files: dict[str, str]):
    modules = {}
    for name, src in files.items():
        is_pkg = name.endswith("/__init__")
        mod = name.replace("/__init__", "").replace("/", ".")
        f = tmp_path / (name + ".py")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(src)
        modules[mod] = (f, is_pkg)
    return modules


def test_checker_finds_lazy_relative_and_type_checking_imports(tmp_path):
    modules = _fake_tree(
        tmp_path,
        {
            "chatkv/__init__": "from chatkv.errors import E\n",
            "chatkv/errors": "class E(Exception): pass\n",
            "chatkv/a": (
                "from . import b\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from chatkv.c import C\n"
            ),
            "chatkv/b": "import os\ndef f():\n    from .sub.d import g\n    return g\n",
            "chatkv/c": "import chatkv.a\n",
            "chatkv/sub/__init__": "from .. import errors\nfrom chatkv import nothing_here\n",
            "chatkv/sub/d": (
                "from chatkv import a\nfrom ..errors import E\n"
                "import importlib\nm = importlib.import_module('chatkv.c')\n"
            ),
        },
    )
    edges, missing = [], []
    for name, (f, is_pkg) in modules.items():
        e, m = imports_of(name, f, is_pkg, modules)
        edges += e
        missing += m
    got = {(e.src, e.dst, e.lazy) for e in edges}
    assert got == {
        ("chatkv", "chatkv.errors", False),
        ("chatkv.a", "chatkv.b", False),
        ("chatkv.a", "chatkv.c", False),  # under TYPE_CHECKING: an edge too
        ("chatkv.b", "chatkv.sub.d", True),
        ("chatkv.c", "chatkv.a", False),
        ("chatkv.sub", "chatkv.errors", False),
        ("chatkv.sub", "chatkv", False),  # a name of chatkv/__init__, not a module
        ("chatkv.sub.d", "chatkv.a", False),
        ("chatkv.sub.d", "chatkv.errors", False),
        ("chatkv.sub.d", "chatkv.c", False),
    }
    assert {(e.src, e.dst) for e in edges if e.typing} == {("chatkv.a", "chatkv.c")}
    assert missing == []
    # without the TYPE_CHECKING edge (what this checker saw before it counted them)
    cycles = find_cycles(modules, [e for e in edges if not e.typing])
    assert len(cycles) == 1  # a -> b -> sub.d -> a, and c -> a -> b -> sub.d -> c: one group
    text = describe(cycles[0])
    assert text.startswith("chatkv.a -> chatkv.b -> chatkv.sub.d -> chatkv.a"), text
    assert "(inside a function)" in text
    # with it: still one group, and its shortest cycle is now a -> c -> a
    cycles = find_cycles(modules, edges)
    assert len(cycles) == 1
    text = describe(cycles[0])
    assert text.startswith("chatkv.a -> chatkv.c -> chatkv.a"), text
    assert "(under TYPE_CHECKING)" in text
