"""The package is layered: every module's imports (module level, function-local and TYPE_CHECKING
alike, read from the source with ``ast``) go to its own layer or a lower one, never round a cycle,
and never reach for another module's private (``_name``) symbols.

The layer order is data (``LAYERS``, lowest first) and is the table in docs/architecture.md. Every
module of the package must be placed in exactly one layer, so a new module is placed on purpose.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
from functools import cache

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"hgraph": ROOT / "hgraph", "hgraph.passes": ROOT / "passes", "hgraph.runtime": ROOT / "runtime"}

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("hgraph.errors", "hgraph.layout", "hgraph.strategy", "hgraph.zero", "hgraph.seeding",
              "hgraph.batch", "hgraph.models", "hgraph.model_info", "hgraph.data", "hgraph.data.*",
              "hgraph.train_config", "hgraph.compile_cache", "hgraph.actions")),
    ("lnk", ("hgraph.lnk.plan", "hgraph.lnk.pieces", "hgraph.lnk.collectives", "hgraph.lnk.solver",
             "hgraph.lnk.rank_plan", "hgraph.lnk.topology")),
    ("planner", ("hgraph.planner.analytic", "hgraph.planner.assign", "hgraph.planner.baselines",
                 "hgraph.planner.batches", "hgraph.planner.bound", "hgraph.planner.context",
                 "hgraph.planner.cost", "hgraph.planner.dispatch", "hgraph.planner.exact",
                 "hgraph.planner.fit", "hgraph.planner.memory", "hgraph.planner.packing",
                 "hgraph.planner.plan", "hgraph.planner.proposal", "hgraph.planner.timing",
                 "hgraph.planner.terms", "hgraph.planner.correction", "hgraph.planner.machine",
                 "hgraph.planner.bubble")),
    # What compiled programs and plans execute with: communicators, the custom ops, the reshard
    # interpreter, recompute regions. Passes insert calls to these ops.
    ("kernels", ("hgraph.runtime.failures", "hgraph.runtime.comm", "hgraph.runtime.context",
                 "hgraph.runtime.attention_kernels", "hgraph.runtime.collectives",
                 "hgraph.runtime.vocab_parallel", "hgraph.runtime.packed_attention", "hgraph.runtime.ops",
                 "hgraph.runtime.recompute", "hgraph.runtime.reshard", "hgraph.runtime.coalesce",
                 "hgraph.lnk.simulate", "hgraph.lnk")),
    ("rules", ("hgraph.rules", "hgraph.rules.*")),
    ("frontend", ("hgraph.eager_attention", "hgraph.mask_probe", "hgraph.canonicalize", "hgraph.frontend")),
    ("products", ("hgraph.products", "hgraph.plan_codec")),
    ("passes", ("hgraph.passes", "hgraph.passes.*")),
    # Executes a RankProgram (products only): below the compiler, whose ``simulate`` runs it.
    ("runtime", ("hgraph.runtime.stage", "hgraph.runtime.executor", "hgraph.runtime.evaluate",
                 "hgraph.runtime.feed", "hgraph.runtime.optimizer", "hgraph.runtime.checkpoint",
                 "hgraph.runtime.agreement", "hgraph.runtime.timeline", "hgraph.runtime.launch",
                 "hgraph.runtime", "hgraph.thread_oracle")),
    ("show", ("hgraph.show",)),
    ("compiler", ("hgraph.compiler",)),
    ("app", ("hgraph.runtime.trainer", "hgraph.planner", "hgraph.planner.profile", "hgraph.planner.profile_ranks", "hgraph.planner.profile_iteration",
             "hgraph.planner.cli", "hgraph.cli", "hgraph.show_cli", "hgraph.train_planning", "hgraph.train_cli", "hgraph.demo", "hgraph.plots",
             "hgraph.lnk_demo", "hgraph.zoo", "hgraph.export", "hgraph", "hgraph.__main__")),
)

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
                    if f"{target}.{a.name}" in known:  # a submodule: from hgraph.runtime import ops
                        found.append((module, f"{target}.{a.name}", "", node.lineno))
                    elif target in known:
                        found.append((module, target, a.name, node.lineno))
    return tuple(found)


def layer_of(module: str) -> int:
    matches = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in patterns)]
    if len(matches) != 1:
        where = "no layer" if not matches else f"layers {[LAYERS[i][0] for i in matches]}"
        raise AssertionError(f"{module} is in {where}; place it in exactly one entry of LAYERS (tests/test_layering.py)")
    return matches[0]


def test_every_module_has_one_layer():
    for module in modules():
        layer_of(module)


def test_no_import_cycles():
    graph = nx.DiGraph((a, b) for a, b, _, _ in imports() if a != b)
    cycles = [c for c in nx.simple_cycles(graph) if frozenset(c) not in TEMPORARY_CYCLES]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles)


def layer_violations(found: tuple[tuple[str, str, str, int], ...]) -> list[str]:
    names = [name for name, _ in LAYERS]
    return [
        f"{a} ({names[layer_of(a)]}) imports {b} ({names[layer_of(b)]}) at line {line}"
        for a, b, _, line in found
        if layer_of(b) > layer_of(a)
    ]


def test_imports_follow_the_layer_order():
    bad = layer_violations(imports())
    order = " -> ".join(name for name, _ in LAYERS)
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


def _module_aliases() -> dict[tuple[str, str], str]:
    """(module, local name) -> package module it names (``from hgraph.runtime import ops``)."""
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
    "from hgraph.compiler import compile\n",
    "def f():\n    from hgraph.runtime.trainer import Trainer\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hgraph.passes.partition import partition\n",
    "import hgraph.planner.profile\n",
])
def test_checker_sees_every_kind_of_import(tmp_path, source):
    """A layer-breaking import of each kind (module level, function-local, TYPE_CHECKING, plain
    ``import``) planted in a copy of a core module is reported."""
    path = tmp_path / "layout.py"
    path.write_text(modules()["hgraph.layout"].read_text() + "\n" + source)
    planted = {**modules(), "hgraph.layout": path}
    assert not layer_violations(imports_of(modules()))
    assert [v for v in layer_violations(imports_of(planted)) if v.startswith("hgraph.layout (core) imports")]
