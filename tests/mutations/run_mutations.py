"""Planted-bug runner (issue 37): apply each mutation of ``mutations.py`` in a temporary copy of the
tree and show the fast tier failing.

    .venv/bin/python tests/mutations/run_mutations.py            # every mutation
    .venv/bin/python tests/mutations/run_mutations.py --only NAME

First a control run: the union of the mutations' tests must pass on the unmutated copy, and every listed
test must be collected under ``-m "not slow"`` (the fast tier). Then each mutation runs its tests in its
own copy; it is caught only when pytest's return code is 1 (tests failed), not 2-5 (interrupted, internal
or usage error, nothing collected). Prints a table, then one JSON object; exits nonzero when a mutation
survives or the control fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks")]

from mutations import MUTATIONS, Mutation  # noqa: E402
from tree_compare import importable_view  # noqa: E402 - the copy's hgraph, laid out as the tree comparison does

SKIP = {".git", ".venv", "build", "runs", ".whl"}  # not read by the tests
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", ".ruff_cache",
                                ".mypy_cache")
TEST_TIMEOUT_S = 240  # per test (pytest-timeout): a planted deadlock fails instead of hanging the run


def copy_tree(into: pathlib.Path) -> pathlib.Path:
    """The checkout as it is now (package folders, tests, docs, examples, benchmarks, top-level files)."""
    tree = into / "tree"
    tree.mkdir(parents=True)
    for entry in ROOT.iterdir():
        if entry.name in SKIP or IGNORE(str(ROOT), [entry.name]):
            continue
        if entry.is_dir():
            shutil.copytree(entry, tree / entry.name, ignore=IGNORE, symlinks=True)
        else:
            shutil.copy2(entry, tree / entry.name)
    return tree


def apply(tree: pathlib.Path, m: Mutation) -> None:
    """Apply ``m`` to ``tree``; its ``find`` must occur exactly once."""
    path = tree / m.path
    text = path.read_text()
    count = text.count(m.find)
    if count != 1:
        raise SystemExit(f"mutation {m.name}: {m.path} holds its find text {count} times (need exactly 1)")
    path.write_text(text.replace(m.find, m.replace))


def _env(view: pathlib.Path) -> dict:
    """The copy's environment: the view first on PYTHONPATH (spawned ranks inherit it), then the copy
    itself for its top-level folders; PYTHONSAFEPATH keeps ``python -m``/``-c`` from putting the working
    directory (the copy, whose ``hgraph`` lacks passes/ and runtime/) in front of the view."""
    tree = view.parent / "tree"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(view), str(tree)]), PYTHONSAFEPATH="1",
               OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def pytest(tree: pathlib.Path, view: pathlib.Path, tests: Sequence[str], extra: Sequence[str] = ()) -> tuple[int, str, float]:
    """Run ``tests`` in ``tree`` (fast tier: pyproject's addopts); return code, output, seconds."""
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree),
           "-c", str(tree / "pyproject.toml"), f"--timeout={TEST_TIMEOUT_S}", *extra]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=tree, env=_env(view), capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr, time.time() - t0


def prepared(into: pathlib.Path, m: Optional[Mutation]) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of the tree (with ``m`` applied) and its importable view, checked to be what imports."""
    tree = copy_tree(into)
    if m is not None:
        apply(tree, m)
    view = importable_view(tree, into / "view")
    probe = subprocess.run([sys.executable, "-c", "import hgraph.runtime, hgraph.passes, hgraph; "
                            "print(hgraph.__file__); print(hgraph.runtime.__file__); print(hgraph.passes.__file__)"],
                           cwd=tree, env=_env(view), capture_output=True, text=True, check=False)
    files = probe.stdout.split()
    if probe.returncode != 0 or len(files) != 3 or not all(f.startswith(str(view)) for f in files):
        raise SystemExit(f"the copy in {into} is not what imports as hgraph:\n{probe.stdout}{probe.stderr}")
    return tree, view


def _union(mutations: Sequence[Mutation]) -> list[str]:
    return list(dict.fromkeys(t for m in mutations for t in m.tests))


def control(mutations: Sequence[Mutation], run: bool = True) -> dict:
    """Every listed test is in the fast tier, and (``run``) they all pass on the unmutated copy."""
    tests = _union(mutations)
    with tempfile.TemporaryDirectory(prefix="hgraph-mutations-") as tmp:
        tree, view = prepared(pathlib.Path(tmp), None)
        rc, out, _ = pytest(tree, view, tests, ["--collect-only"])  # one collection for all entries
        if rc != 0:
            raise SystemExit(f"control: collecting the mutations' tests failed (rc {rc}):\n{out[-3000:]}")
        collected = [line.strip() for line in out.splitlines() if line.startswith("tests/")]
        for t in tests:  # each entry must collect something under -m "not slow"
            if not any(c == t or c.startswith((t + "::", t + "[")) for c in collected):
                raise SystemExit(f"control: {t} collects nothing in the fast tier (-m 'not slow')")
        if not run:
            return {"rc": 0, "seconds": 0.0, "tests": len(tests), "ran": False}
        rc, out, seconds = pytest(tree, view, tests)
        if rc != 0:
            raise SystemExit(f"control: the mutations' tests fail on the unmutated tree (rc {rc}); "
                             f"nothing can be shown caught:\n{out[-4000:]}")
    return {"rc": rc, "seconds": round(seconds, 1), "tests": len(tests)}


def run_one(m: Mutation) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"hgraph-mutation-{m.name}-") as tmp:
        tree, view = prepared(pathlib.Path(tmp), m)
        rc, out, seconds = pytest(tree, view, list(m.tests))
    caught = rc == 1
    result = {"caught": caught, "rc": rc, "seconds": round(seconds, 1), "path": m.path, "tests": list(m.tests)}
    if not caught:
        result["output_tail"] = out[-2000:]
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--control", choices=("run", "collect", "none"), default="run",
                        help="run: the listed tests are collected in the fast tier and pass unmutated (default); "
                             "collect: collected only (where the fast tier has just passed, as in CI); "
                             "none: skip (debugging only)")
    args = parser.parse_args(argv)
    chosen = list(MUTATIONS)
    if args.only:
        names = {m.name for m in MUTATIONS}
        unknown = sorted(set(args.only) - names)
        if unknown:
            parser.error(f"unknown mutation {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    t0 = time.time()
    ctl = None if args.control == "none" else control(chosen, run=args.control == "run")
    if ctl is not None:
        passed = f"pass unmutated in {ctl['seconds']} s" if args.control == "run" else "are in the fast tier"
        print(f"control: {ctl['tests']} test entries {passed}", flush=True)
    results = {}
    print(f"{'mutation':<46} {'caught':<6} {'rc':>3} {'s':>6}  tests", flush=True)
    for m in chosen:
        r = results[m.name] = run_one(m)
        print(f"{m.name:<46} {'yes' if r['caught'] else 'NO':<6} {r['rc']:>3} {r['seconds']:>6}  {' '.join(m.tests)}",
              flush=True)
        if not r["caught"]:
            print(r["output_tail"], flush=True)
    survived = [n for n, r in results.items() if not r["caught"]]
    report = {"mutations": results, "control": ctl, "total": len(results), "caught": len(results) - len(survived),
              "survived": survived, "wall_seconds": round(time.time() - t0, 1)}
    print(json.dumps(report))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
