"""Run benchmarks of this checkout and of an earlier commit side by side, interleaved (prints JSON).

    python benchmarks/tree_compare.py --ref 4af1a81 [--repeats 3] runtime_bench overlap_bench

Each repetition runs every named benchmark once on each tree, alternating which tree goes first, so a
change of machine load between them hits both alike. Each run is that tree's own
``benchmarks/<name>.py`` in a fresh process importing that tree's ``hgraph`` (a link farm in a
temporary folder put first on ``PYTHONPATH``). Both trees are copied first, so editing the checkout
while it runs changes nothing: the reference is ``git archive`` of ``--ref``, this tree a copy of the
working tree's package folders and benchmarks.
Every numeric field whose key ends in ``step_s`` is compared: the report gives, per benchmark and
field, this tree's value over the reference's, as the median and min–max over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from typing import Any, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"passes": "passes", "runtime": "runtime"}  # pyproject's package-dir: hgraph.passes, hgraph.runtime


def importable_view(tree: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A folder whose ``hgraph`` package is ``tree``'s, laid out as pyproject's package-dir maps it."""
    package = into / "hgraph"
    package.mkdir(parents=True)
    for entry in (tree / "hgraph").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (package / name).symlink_to(tree / folder)
    return into


def reference_tree(ref: str, into: pathlib.Path) -> pathlib.Path:
    """The files of commit ``ref`` of this repository, unpacked into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "ref.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref], check=True)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def working_tree_copy(into: pathlib.Path) -> pathlib.Path:
    """The package folders and benchmarks of this checkout as they are now, copied into ``into``."""
    for folder in ("hgraph", *PACKAGE_DIRS.values(), "benchmarks"):
        shutil.copytree(ROOT / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def run_benchmark(tree: pathlib.Path, view: pathlib.Path, name: str, args: list[str]) -> dict:
    """``tree``'s ``benchmarks/<name>.py`` in a fresh process; its last printed JSON object."""
    env = dict(os.environ, PYTHONPATH=str(view), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / f"{name}.py"), *args], cwd=tree, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} on {tree} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    start = done.stdout.find("{")
    return json.loads(done.stdout[start:])


def step_times(report: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every ``(dotted.path, value)`` of ``report`` whose key ends in ``step_s``."""
    if isinstance(report, dict):
        for key, value in report.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(value, (int, float)) and str(key).endswith("step_s"):
                yield where, float(value)
            else:
                yield from step_times(value, where)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the commit to compare against (e.g. 4af1a81)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--args", default="", help="arguments passed to every benchmark (e.g. '--tiny')")
    parser.add_argument("benchmarks", nargs="+", help="benchmark names under benchmarks/ (without .py)")
    args = parser.parse_args(argv)
    extra = args.args.split()
    with tempfile.TemporaryDirectory(prefix="hgraph-compare-") as tmp:
        base = pathlib.Path(tmp)
        trees = {"ref": reference_tree(args.ref, base / "ref"), "this": working_tree_copy(base / "this")}
        views = {side: importable_view(tree, base / f"view-{side}") for side, tree in trees.items()}
        runs: dict[str, dict[str, list[dict[str, float]]]] = {b: {"ref": [], "this": []} for b in args.benchmarks}
        for repeat in range(args.repeats):
            order = ("ref", "this") if repeat % 2 == 0 else ("this", "ref")
            for name in args.benchmarks:
                for side in order:
                    report = run_benchmark(trees[side], views[side], name, extra)
                    runs[name][side].append(dict(step_times(report)))
    out: dict = {"ref": args.ref, "repeats": args.repeats, "args": extra, "benchmarks": {}}
    for name, sides in runs.items():
        fields = sorted(set.intersection(*(set(r) for r in sides["ref"] + sides["this"])))
        rows = {}
        for field in fields:
            ratios = [t[field] / r[field] for t, r in zip(sides["this"], sides["ref"]) if r[field] > 0]
            rows[field] = {
                "this_s": round(statistics.median(t[field] for t in sides["this"]), 4),
                "ref_s": round(statistics.median(r[field] for r in sides["ref"]), 4),
                "ratio_median": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            }
        out["benchmarks"][name] = rows
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
