"""The architecture, checked: no import cycles among dtrain's modules, and every package imports only packages on
the layers below it (the table under "## Layers" in docs/architecture.md, read by the test).

Imports are read from the source with `ast` (module-level and inside functions; `if TYPE_CHECKING:` blocks are
left out, as they never run), so a test names the file and line of each offending import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"
# Where each package's source lives (models/ and parallelize/ install as dtrain.models and dtrain.parallelize).
PACKAGE_ROOTS = {
    "dtrain": REPO / "dtrain",
    "dtrain.models": REPO / "models",
    "dtrain.parallelize": REPO / "parallelize",
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a dtrain module, or torch.distributed...)
    where: str  # file:line, relative to the repo

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


def module_files() -> dict[str, Path]:
    """Every module of dtrain (packages by their __init__.py) -> its file."""
    modules = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at module level and in functions, outside `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """What `module` imports: dtrain modules (`from pkg import submodule` counts as the submodule, relative imports
    resolved) and anything else by its full dotted name (torch.distributed.tensor, ...)."""
    is_package = path.name == "__init__.py"
    found = []
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
        if isinstance(node, ast.Import):
            found.extend(Import(module, alias.name, where) for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.append(Import(module, submodule if submodule in known else base, where))
    return found


def import_graph() -> dict[str, list[Import]]:
    """Module -> its imports, over every module of dtrain (dtrain.models and dtrain.parallelize included)."""
    files = module_files()
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph (node -> nodes it imports): its strongly connected components of more than one
    node, or of one node that imports itself; each sorted, the list sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(source_packages: tuple[str, ...], forbidden, graph=None) -> list[str]:
    """The imports made by modules of `source_packages` whose target `forbidden(target)` refuses, as file:line."""
    graph = import_graph() if graph is None else graph
    found = (
        str(imp)
        for module, imports in graph.items()
        if _under(module, source_packages)
        for imp in imports
        if forbidden(imp.target)
    )
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def test_no_import_cycles():
    graph = import_graph()
    edges = {module: {imp.target for imp in imports if imp.target in graph} for module, imports in graph.items()}
    report = []
    for component in cycles(edges):
        inside = set(component)
        lines = dict.fromkeys(str(imp) for m in component for imp in graph[m] if imp.target in inside)
        report.append(f"cycle among {', '.join(component)}:\n    " + "\n    ".join(lines))
    assert not report, "import cycles:\n" + "\n".join(report)


def test_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}, "g": {"h"}, "h": {"g"}}
    assert cycles(graph) == [["a", "b", "c"], ["f"], ["g", "h"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_import_reader_resolves_relative_and_submodule_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from .sibling import thing\n"
        "from dtrain.pkg import other, name\n"
        "import torch.distributed as dist\n"
        "if TYPE_CHECKING:\n"
        "    from dtrain.hidden import Hidden\n"
        "def f():\n"
        "    from ..top import x\n"
    )
    known = {"dtrain.pkg.sibling", "dtrain.pkg.other", "dtrain.top"}
    targets = [imp.target for imp in imports_of("dtrain.pkg.mod", path, known)]
    assert sorted(targets) == sorted(
        ["typing", "dtrain.pkg.sibling", "dtrain.pkg.sibling", "dtrain.pkg.other", "dtrain.pkg", "torch.distributed",
         "dtrain.top"]
    )


def package_of(module: str) -> str | None:
    """The layered unit a dtrain module belongs to: dtrain.models, dtrain.parallelize, a package of dtrain/
    (dtrain.run, ...) or a top-level module (dtrain.main, ...); None for the root package and non-dtrain modules."""
    parts = module.split(".")
    if parts[0] != "dtrain" or len(parts) == 1:
        return None
    return ".".join(parts[:2])


def layers(text: str | None = None) -> dict[str, int]:
    """Package -> its layer (1 = bottom), read from the table under "## Layers" in docs/architecture.md: each row
    `| N | `name`, `name` | ... |` (names without the `dtrain.` prefix)."""
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8") if text is None else text
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([a-z_]+)`", cells[1]):
                found[f"dtrain.{name}"] = int(cells[0])
    return found


def layer_violations(graph=None, order=None) -> list[str]:
    """An unlisted package, and every import of a package on its own layer or above it, one line each."""
    graph = import_graph() if graph is None else graph
    order = layers() if order is None else order
    packages = {package_of(module) for module in graph} - {None}
    found = [f"{package} is in no layer of {ARCHITECTURE_DOC.name}: add it to the table under ## Layers"
             for package in sorted(packages - set(order))]
    for module, imports in graph.items():
        source = package_of(module)
        for imp in imports:
            target = package_of(imp.target)
            if source in order and target in order and target != source and order[target] >= order[source]:
                found.append(f"{imp} (layer {order[source]} imports layer {order[target]})")
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def test_every_package_imports_only_packages_below_it():
    bad = layer_violations()
    assert not bad, "against the layer order of docs/architecture.md:\n" + "\n".join(bad)


def test_layer_check_names_unlisted_packages_and_upward_imports():
    graph = {
        "dtrain.low.a": [Import("dtrain.low.a", "dtrain.high.b", "low/a.py:3")],
        "dtrain.high.b": [Import("dtrain.high.b", "dtrain.low.a", "high/b.py:1")],
        "dtrain.side": [Import("dtrain.side", "dtrain.low", "side.py:2")],
        "dtrain.new.c": [],
    }
    order = layers("\n## Layers\n\n| layer | packages |\n|---|---|\n| 2 | `high`, `side` |\n| 1 | `low` |\n")
    assert order == {"dtrain.high": 2, "dtrain.side": 2, "dtrain.low": 1}
    assert layer_violations(graph, order) == [
        "dtrain.new is in no layer of architecture.md: add it to the table under ## Layers",
        "low/a.py:3: dtrain.low.a imports dtrain.high.b (layer 1 imports layer 2)",
    ]


def test_the_packages_being_written_have_their_layer():
    order = layers()
    assert order["dtrain.eval"] > order["dtrain.run"] and order["dtrain.preference"] > order["dtrain.run"]


def test_models_never_import_torch_distributed():
    bad = violations(("dtrain.models",), lambda t: _under(t, ("torch.distributed",)))
    assert not bad, "dtrain.models imports torch.distributed:\n" + "\n".join(bad)


def test_step_takes_no_job_config():
    # The step's components receive plain values; of the config they may share only its plain data.
    bad = violations(("dtrain.step",), lambda t: _under(t, ("dtrain.config",)) and t != "dtrain.config.low_bit_optim")
    assert not bad, "dtrain.step imports the config beyond its plain data:\n" + "\n".join(bad)


def test_importing_the_config_loads_no_model_and_no_torch_distributed():
    # What actually runs on `import dtrain.config` (package __init__ files included), in a fresh interpreter.
    code = (
        "import sys, dtrain.config\n"
        "print(' '.join(m for m in sys.modules if m == 'torch.distributed' or "
        "m.startswith(('dtrain.models', 'dtrain.parallelize', 'dtrain.run', 'dtrain.step'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"import dtrain.config loads {', '.join(loaded)}"
