"""runtime/ keeps no run-time state at module level: no thread-locals, no mutable registries.

State a run needs (the communicator, the rank's groups, plan call lists) is passed in or owned by
an object; module-level constants are immutable (tuple, frozenset, ``MappingProxyType``).
"""

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "local",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


def _module_state(path: Path, root: Path = RUNTIME) -> list[str]:
    found = []
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"]
        if _mutable(value):
            found += [f"{path.relative_to(root)}:{stmt.lineno} {n}" for n in names]
    return found


def test_runtime_modules_define_no_mutable_module_state():
    found = [f for path in sorted(RUNTIME.rglob("*.py")) for f in _module_state(path)]
    assert not found, "module-level mutable state in runtime/ (pass it in, or wrap constants immutable): " + ", ".join(found)


def test_the_check_sees_mutable_state(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import threading\nA = {}\nB: list = []\nC = threading.local()\nD = (1, 2)\n__all__ = []\n")
    assert [f.split()[1] for f in _module_state(module, tmp_path)] == ["A", "B", "C"]
