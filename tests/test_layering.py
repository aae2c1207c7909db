"""The package is layered and each folder is one layer: every module's imports (module level,
function-local and TYPE_CHECKING alike, read from the source with ``ast``) go to its own folder's
layer or a lower one, never round a cycle, and never reach for another module's private (``_name``)
symbols.

The layer order is data (``FOLDERS``, one line per folder, lowest first) and is the table in
docs/architecture.md. Every module's folder must be declared, so a new folder is placed on purpose.
"""

from __future__ import annotations

import ast
import pathlib
from functools import cache

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"hgraph": ROOT / "hgraph", "hgraph.passes": ROOT / "passes", "hgraph.runtime": ROOT / "runtime"}

# Folder (relative to the repository root) -> layer, lowest first. A module's layer is its folder's;
# a package's ``__init__`` is in the package's folder.
FOLDERS: tuple[tuple[str, str], ...] = (
    ("hgraph/errors", "errors"),        # HGraphError and its subclasses (hgraph.errors)
    ("hgraph/core", "core"),            # layouts, strategies, ZeRO layout, seeding, micro-batches, model info
    ("hgraph/data", "data"),            # documents, tokenizers, token-budget batches
    ("hgraph/models", "models"),        # hgraph's Llama, tiny HF builders, the HF zoo's families
    ("hgraph/lnk", "lnk"),              # the layout-change solver (pure)
    ("hgraph/schedule", "schedule"),    # the action IR, its lowerings and dry run; pipeline time
    ("hgraph/planner", "planner"),      # cost model, proposal, dispatch, packing (pure)
    ("runtime/kernels", "kernels"),     # what programs and plans execute with; passes insert these ops
    ("hgraph/rules", "rules"),          # sharding rules per op
    ("hgraph/frontend", "frontend"),    # capture, canonicalisation, attention recognition
    ("hgraph/program", "program"),      # compile products (read by passes and the runtime)
    ("passes", "passes"),               # graph -> graph passes and the pass manager
    ("runtime", "runtime"),             # executes a RankProgram: executor, optimizer, checkpoint, launch
    ("hgraph/compiler", "compiler"),    # compile(), CompiledModel, plan cache, printing
    ("hgraph/training", "training"),    # Trainer, export, the train config
    ("hgraph/profiling", "profiling"),  # profiles on local ranks (runs the compiler and the Trainer)
    ("hgraph/cli", "cli"),              # the hgraph command, demo, plots, zoo check
    ("hgraph", "api"),                  # hgraph/__init__.py and __main__.py only
)
LAYERS = tuple(layer for _, layer in FOLDERS)

# Known exceptions to the rules below, each to be removed with the code that needs it (none now).
TEMPORARY_CYCLES: set[frozenset[str]] = set()
TEMPORARY_PRIVATE: set[tuple[str, str]] = set()


@cache
def modules() -> dict[str, pathlib.Path]:
    out = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [p for p in path.relative_to(directory).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _target(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports() -> tuple[tuple[str, str, str, int], ...]:
    return imports_of(modules())


def imports_of(known: dict[str, pathlib.Path]) -> tuple[tuple[str, str, str, int], ...]:
    """(importer, imported module, name or "", line) for every import of a package module."""
    found = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(module, a.name, "", node.lineno) for a in node.names if a.name in known]
            elif isinstance(node, ast.ImportFrom):
                target = _target(module, path, node)
                for a in node.names:
                    if f"{target}.{a.name}" in known:  # a submodule: from hgraph.runtime.kernels import comm
                        found.append((module, f"{target}.{a.name}", "", node.lineno))
                    elif target in known:
                        found.append((module, target, a.name, node.lineno))
    return tuple(found)


def folder_of(module: str) -> str:
    """The repository-relative folder of a package module (a package's own folder for its ``__init__``)."""
    path = modules().get(module)
    package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
    prefix = max((p for p in PACKAGE_DIRS if package == p or package.startswith(p + ".")), key=len)
    return PACKAGE_DIRS[prefix].joinpath(*package.split(".")[prefix.count(".") + 1:]).relative_to(ROOT).as_posix()


def layer_of(module: str) -> int:
    folder = folder_of(module)
    matches = [i for i, (f, _) in enumerate(FOLDERS) if f == folder]
    if len(matches) != 1:
        where = "no layer" if not matches else f"layers {[LAYERS[i] for i in matches]}"
        raise AssertionError(f"{module} (folder {folder}) is in {where}; declare its folder once in FOLDERS "
                             "(tests/test_layering.py)")
    return matches[0]


def test_every_module_has_one_layer():
    for module in modules():
        layer_of(module)


def test_every_declared_folder_holds_modules():
    folders = {folder_of(module) for module in modules()}
    assert not [f for f, _ in FOLDERS if f not in folders], "FOLDERS declares folders without modules"


def test_only_the_api_stays_in_the_root_folder():
    assert sorted(m for m in modules() if folder_of(m) == "hgraph") == ["hgraph", "hgraph.__main__"]


def test_no_import_cycles():
    graph = nx.DiGraph((a, b) for a, b, _, _ in imports() if a != b)
    cycles = [c for c in nx.simple_cycles(graph) if frozenset(c) not in TEMPORARY_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles)


def layer_violations(found: tuple[tuple[str, str, str, int], ...]) -> list[str]:
    names = LAYERS
    return [
        f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]}) at line {line}"
        for a, b, _, line in found
        if layer_of(b) > layer_of(a)
    ]


def test_imports_follow_the_layer_order():
    bad = layer_violations(imports())
    order = " -> ".join(LAYERS)
    assert not bad, f"imports against the layer order {order}:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    bad = [
        f"{a} imports {b}.{name} at {modules()[a].relative_to(ROOT)}:{line}"
        for a, b, name, line in imports()
        if name.startswith("_") and a != b and (a, b) not in TEMPORARY_PRIVATE
    ]
    aliases = _module_aliases()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and (module, node.value.id) in aliases):
                bad.append(f"{module} uses {aliases[module, node.value.id]}.{node.attr} at "
                           f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


MAX_LINES = 400  # a module longer than this holds a second concept: split it along that (issue 33)


def test_no_module_over_the_line_limit():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each along its second concept): {long}"


def function_local_imports(known: dict[str, pathlib.Path]) -> list[str]:
    """Imports of package modules inside a function body, outside ``if TYPE_CHECKING:`` blocks."""
    found = []
    for module, path in known.items():
        tree = ast.parse(path.read_text())
        typing_only = [(n.lineno, n.end_lineno) for n in ast.walk(tree)
                       if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any(n.split(".")[0] == "hgraph" for n in names) and \
                        not any(a <= node.lineno <= b for a, b in typing_only):
                    found.append(f"{module} line {node.lineno}")
    return sorted(set(found))


def test_no_function_local_package_imports():
    """Imports are at the top, where the layer order is read; a cycle is broken by moving code, not by
    importing inside a function."""
    local = function_local_imports(modules())
    assert not local, "function-local hgraph imports (hoist them):\n" + "\n".join(local)


def test_local_import_checker_sees_one(tmp_path):
    path = tmp_path / "layout.py"
    path.write_text(modules()["hgraph.core.layout"].read_text() + "\n\ndef f():\n    from hgraph.core import degrees\n")
    line = len(path.read_text().splitlines())
    assert function_local_imports({"hgraph.core.layout": path}) == [f"hgraph.core.layout line {line}"]


def _module_aliases() -> dict[tuple[str, str], str]:
    """(module, local name) -> package module it names (``from hgraph.runtime.kernels import comm``)."""
    known = modules()
    out = {}
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = _target(module, path, node)
                for a in node.names:
                    if f"{target}.{a.name}" in known and f"{target}.{a.name}" != module:
                        out[module, a.asname or a.name] = f"{target}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        out[module, a.asname] = a.name
    return out


def test_temporary_exceptions_are_still_needed():
    """Drop an entry of TEMPORARY_* as soon as the code no longer needs it."""
    graph = nx.DiGraph((a, b) for a, b, _, _ in imports() if a != b)
    present = {frozenset(c) for c in nx.simple_cycles(graph)}
    stale = [sorted(c) for c in TEMPORARY_CYCLES if c not in present]
    private = {(a, b) for a, b, name, _ in imports() if name.startswith("_")}
    stale += [pair for pair in TEMPORARY_PRIVATE if pair not in private]
    assert not stale, f"temporary layering exceptions no longer needed: {stale}"


@pytest.mark.parametrize("source", [
    "from hgraph.compiler.entry import compile\n",
    "def f():\n    from hgraph.training.trainer import Trainer\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hgraph.passes.partition import partition\n",
    "import hgraph.profiling.profile\n",
])
def test_checker_sees_every_kind_of_import(tmp_path, source):
    """A layer-breaking import of each kind (module level, function-local, TYPE_CHECKING, plain
    ``import``) planted in a copy of a core module is reported."""
    path = tmp_path / "layout.py"
    path.write_text(modules()["hgraph.core.layout"].read_text() + "\n" + source)
    planted = {**modules(), "hgraph.core.layout": path}
    assert not layer_violations(imports_of(modules()))
    assert [v for v in layer_violations(imports_of(planted)) if v.startswith("hgraph.core.layout (core) imports")]
