"""Every file hgraph writes appears whole or not at all (``hgraph.core.atomic_files``), and no module
writes a final name any other way."""

import ast
import os
import pathlib

import pytest

from hgraph.core import atomic_files

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "hgraph", ROOT / "passes", ROOT / "runtime"]
HELPER = ROOT / "hgraph" / "core" / "atomic_files.py"

# Writes that are not files of hgraph's data, each with its reason.
ALLOWED = {
    ("runtime/metrics.py", '"/proc/self/clear_refs"'),  # a kernel control file, not data
    ("runtime/metrics.py", '"a"'),  # metrics.jsonl, an append log: a torn last line is dropped on read
    ("hgraph/planner/exact.py", "os.devnull"),  # silences a solver
}
_WRITE_MODES = set("wax+")
_WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _mode(call: ast.Call) -> str:
    args = call.args[1:2] + [k.value for k in call.keywords if k.arg == "mode"]
    return next((a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)), "r")


def direct_writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of each call in ``source`` that writes a file without the atomic helper."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if name in ("write_text", "write_bytes") and owner != "atomic_files":
            found.append((node.lineno, name))
        elif name == "open" and owner in ("", "io") and _WRITE_MODES & set(_mode(node)):
            found.append((node.lineno, f"open(mode={_mode(node)!r})"))
        elif name == "open" and owner == "os" and _WRITE_FLAGS & {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}:
            found.append((node.lineno, "os.open for writing"))
        elif name in ("replace", "rename") and owner == "os":
            found.append((node.lineno, f"os.{name} by hand"))
        elif name == "savefig" and not (node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "fh"):
            found.append((node.lineno, "savefig to a path"))
    return found


def _violations() -> list[str]:
    out = []
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            if path == HELPER:
                continue
            rel = path.relative_to(ROOT).as_posix()
            lines = path.read_text(encoding="utf-8").splitlines()
            for line, call in direct_writes(path.read_text(encoding="utf-8")):
                if not any(rel == f and mark in lines[line - 1] for f, mark in ALLOWED):
                    out.append(f"{rel}:{line}: {call}")
    return out


def test_no_module_writes_a_final_name_by_hand():
    assert _violations() == [], "write through hgraph.core.atomic_files instead"


@pytest.mark.parametrize("planted", [
    'Path(p).write_text("x")',
    'open(p, "w").write("x")',
    'open(p, mode="wb")',
    "os.open(p, os.O_WRONLY | os.O_CREAT)",
    "os.replace(tmp, p)",
    "fig.savefig(p)",
])
def test_a_planted_direct_writer_is_found(planted):
    assert direct_writes(f"import os\n{planted}\n"), planted
    assert not direct_writes("atomic_files.write_text(p, 'x')\nopen(p).read()\nopen(p, 'rb')\n")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    atomic_files.write_text(path, "old")
    with pytest.raises(RuntimeError):
        with atomic_files.atomic_open(path) as fh:
            fh.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]
    atomic_files.write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_permissions_are_those_asked(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_files.atomic_open(tmp_path / "entry", "wb", permissions=0o644) as fh:
            fh.write(b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "entry").stat().st_mode & 0o777 == 0o644
