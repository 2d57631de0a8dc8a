"""The layers of docs/architecture.md, enforced: every .py under backend_src/<package>/, model_repository/, client/,
scripts/ and docker/ is parsed (ast, nothing is imported) and may import only the project packages its row of
ALLOWED names. The benchmarks (perf/) and the tests (tests/) are importable by no one of them."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "backend_src"

# layer -> the project packages it may import (besides itself). docs/architecture.md mirrors this table.
ALLOWED: dict[str, set[str]] = {
    "inflight": set(),
    "serving": {"inflight"},
    "dynamic_arm": {"inflight", "serving"},
    "iterative_arm": {"inflight", "serving"},
    "openai_frontend": {"inflight"},
    "server_harness": set(),
    "tuner": {"inflight", "serving", "server_harness"},
    "model_repository": {"inflight", "serving", "dynamic_arm", "iterative_arm"},
    "client": set(),
    "scripts": {"inflight", "serving", "server_harness"},
    "docker": set(),
}
OUTSIDE = ("model_repository", "client", "scripts", "docker")  # layers that are folders of the checkout, not packages


def layer_dir(layer: str) -> Path:
    return ROOT / layer if layer in OUTSIDE else SRC / layer


def top_level_names(folder: Path) -> set[str]:
    """What `folder` puts on sys.path (pyproject's pytest pythonpath does so for perf/ and tests/): its modules
    and packages, less stdlib names, which an import of the standard library must not be mistaken for."""
    if not folder.is_dir():
        return set()
    names = {p.stem for p in folder.iterdir()
             if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith((".", "_"))}
    return names - set(sys.stdlib_module_names)


PACKAGES = set(ALLOWED) - set(OUTSIDE) | {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
NEVER = {"perf": top_level_names(ROOT / "perf") | {"perf"}, "tests": top_level_names(ROOT / "tests") | {"tests"}}


def imports(path: Path, package: str | None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved against `package`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = [package, *path.relative_to(SRC / package).parent.parts] if package else []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom):
            if node.level > len(here):
                found.append((node.lineno, "." * node.level + (node.module or "")))  # escapes its package
            else:
                base = here[:len(here) - node.level + 1]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
    return sorted(found)


def violations(layer: str) -> list[str]:
    folder = layer_dir(layer)
    if not folder.is_dir():  # a package still to come (the tuner, while it moves out of perf/)
        return []
    problems = []
    for path in sorted(folder.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        where = path.relative_to(folder.parent if layer in OUTSIDE else folder.parent.parent)
        for line, module in imports(path, None if layer in OUTSIDE else layer):
            top = module.split(".")[0]
            if not top:
                problems.append(f"{where}:{line}: `{module}` climbs out of the package {layer}")
            elif top in NEVER["perf"] or top in NEVER["tests"]:
                kind = "the benchmarks (perf/)" if top in NEVER["perf"] else "the tests (tests/)"
                problems.append(f"{where}:{line}: imports {module}, one of {kind}: no product or glue code may")
            elif top in PACKAGES and top != layer and top not in ALLOWED[layer]:
                allowed = ", ".join(sorted(ALLOWED[layer])) or "none of the project's packages"
                problems.append(f"{where}:{line}: {layer} may not import {top} ({module}): allowed {allowed}")
    return problems


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_it_may(layer):
    problems = violations(layer)
    assert not problems, "import rule broken (docs/architecture.md, Layers):\n" + "\n".join(problems)


def test_every_package_has_a_rule():
    """A new package under backend_src/ needs its row in ALLOWED (and in docs/architecture.md)."""
    assert PACKAGES <= set(ALLOWED), f"packages without a rule: {sorted(PACKAGES - set(ALLOWED))}"


def test_the_docs_mirror_the_table():
    """docs/architecture.md's layer table (rows `| `layer` | `a`, `b` |` or `none`) says what ALLOWED says."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|$", text, flags=re.M)
    table = {layer: set(re.findall(r"`(\w+)`", cell)) for layer, cell in rows}
    assert table == ALLOWED, f"docs/architecture.md's layer table {table} differs from ALLOWED {ALLOWED}"


def test_the_scan_catches_a_bad_import(tmp_path, monkeypatch):
    """The scan itself: a file importing upward, one importing a benchmark, one climbing out, are each named."""
    fake = tmp_path / "backend_src"
    (fake / "inflight" / "sub").mkdir(parents=True)
    (fake / "inflight" / "__init__.py").write_text("")
    (fake / "inflight" / "sub" / "bad.py").write_text(
        "import os\nfrom serving.frontend import InflightFrontend\n\ndef f():\n    import ab_harness\n"
        "from ... import serving\nfrom ..engine import LLMEngine\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    monkeypatch.setitem(NEVER, "perf", {"ab_harness", "perf"})
    problems = violations("inflight")
    assert len(problems) == 3, problems
    assert problems[0].startswith("backend_src/inflight/sub/bad.py:2: inflight may not import serving "
                                  "(serving.frontend): allowed none"), problems
    assert "bad.py:5: imports ab_harness, one of the benchmarks (perf/)" in problems[1]
    assert "bad.py:6: `...` climbs out of the package inflight" in problems[2]


def module_graph(package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports}, every import counted: at module level, inside a function, under
    TYPE_CHECKING. `from a import b` names the module a.b where there is one, else a (a package: its __init__)."""
    root = SRC / package
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: every strongly connected set of more than one module (Tarjan's algorithm), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_engine_has_no_import_circle():
    """No module of inflight imports, through any chain, one that imports it back (docs/architecture.md, Layers):
    what two modules share moves down into one below both, not into an import inside a function."""
    circles = cycles(module_graph("inflight"))
    assert not circles, "import circles in backend_src/inflight:\n" + "\n".join(f"circle: {', '.join(c)}"
                                                                               for c in circles)


def test_the_circle_scan_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
