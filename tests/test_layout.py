"""The package's layout rules, read from the source with ``ast``: no import circles, no
private imports between the scheme modules, the core apart from the command line and the
experiment, and docs that point only at files and names that exist.

An import is an edge from the importing module to the posenc module it names, wherever it
sits (a function-level import is a circle too, only deferred), except under
``if TYPE_CHECKING:``. ``from . import x`` names the module ``x``; ``from .m import name``
names ``m``.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: the modules of the five places (README's table), where each scheme lives
SCHEME_MODULES = (
    "absolute",
    "rotary",
    "rotary_nd",
    "rotary_research",
    "bias",
    "bias_research",
    "bias_continuous",
    "embedding",
    "embedding_research",
    "shaw",
)


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of posenc: dotted name -> (file, is a package)."""
    found = {}
    for path in sorted((SRC / "posenc").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for sub in ast.walk(node))
    return skip


def imports(name: str, path: Path, package: bool, known: set[str]) -> list[tuple[str, str, int]]:
    """``(module imported, name imported or "", line)`` for each posenc import of a module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    found.append((f"{target}.{alias.name}", "", node.lineno))
                elif target in known:
                    found.append((target, alias.name, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}."""
    mods = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, (path, package) in mods.items():
        graph[name] = {}
        for target, _, line in imports(name, path, package, set(mods)):
            graph[name].setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a circle (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_and_deferred_imports():
    graph = import_graph()
    assert "posenc.registry" in graph["posenc.cli.bench"]
    assert "posenc.experiments.models" in graph["posenc.experiments.training"]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    lines = [
        f"{a} -> {b} (line {graph[a][b]})" for c in found for a in c for b in graph[a] if b in c
    ]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_the_core_does_not_import_the_command_line_or_the_experiment():
    """``posenc.cli`` and ``posenc.experiments`` sit on the library; nothing below them (the
    registry included) imports them but ``python -m posenc``, and ``import posenc`` loads
    neither, nor the registry."""
    apart = ("posenc.cli", "posenc.experiments")
    graph = import_graph()
    wrong = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        if not a.startswith(apart) and a != "posenc.__main__"  # python -m posenc: the CLI
        for b in targets
        if b.startswith(apart)
    ]
    assert not wrong
    assert not any(b.startswith((*apart, "posenc.registry")) for b in graph["posenc"])


def test_no_private_imports_between_scheme_modules():
    """A scheme module uses another's public names only: shared private helpers belong in a
    shared module (indices.py, families/), not in the module of one place."""
    mods = modules()
    schemes = {f"posenc.{m}" for m in SCHEME_MODULES}
    wrong = [
        f"{name}:{line} imports {target}.{imported}"
        for name in sorted(schemes)
        for target, imported, line in imports(name, *mods[name], set(mods))
        if target in schemes and target != name and imported.startswith("_")
    ]
    assert not wrong, "\n".join(wrong)


# ----- docs point at what exists -------------------------------------------------------------

#: files whose text is read: README, docs and every module's source (docstrings, comments)
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(SRC.rglob("*.py"))]
#: a path in the repository: docs/x.md, tests/x.py, tools/x.py, src/posenc/...
PATH = re.compile(r"(?<![\w/.-])((?:docs|tests|tools|src)/[\w/.-]*\w\.(?:py|md))\b")
#: a dotted name under posenc: a module, or a name in one
DOTTED = re.compile(r"(?<![\w.])(posenc(?:\.\w+)+)")
#: placeholders in the docs (``posenc.engine.tuning.NAME = ...``)
PLACEHOLDERS = {"NAME"}


def _resolves(dotted: str) -> bool:
    parts = [p for p in dotted.split(".") if p not in PLACEHOLDERS]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_point_only_at_files_and_names_that_exist(path):
    text = path.read_text()
    missing = [m for m in PATH.findall(text) if not (ROOT / m).exists()]
    missing += [m for m in DOTTED.findall(text) if not _resolves(m)]
    # the design notes are not in the checkout: nothing may send a reader there
    missing += ["DESIGN.md"] * ("DESIGN.md" in text)
    assert not missing, f"{path.relative_to(ROOT)} points at what does not exist: {missing}"
