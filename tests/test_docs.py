"""The documentation says what the code does: every ``hgraph train`` config key is in docs/config.md
with the default the code has; every default the README (and docs/distributed.md) states in the form
"`name` (default `value`)" is the code's; the README stays short and free of development notes."""

import inspect
import re
import tomllib
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

import hgraph
from hgraph.cli.command import build_parser
from hgraph.profiling.profile_ranks import DEFAULT_MEMORY_GB
from hgraph.runtime.kernels.failures import DEFAULT_COMM_TIMEOUT
from hgraph.training.config_reference import reference, update_reference
from hgraph.training.config_sections import config_tables, toml_value, walk
from hgraph.training.train_config import TrainConfig, train_keys

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([a-z_.]+)` \| (.+?) \| (.+) \|$", re.M)
STATED = re.compile(r"`([^`]+)`\s*\(default\s+`([^`]+)`\)")


def _defaults() -> dict[str, object]:
    """Config key -> its default as TOML holds it (None: required or unset), from the dataclasses' fields."""
    return {k.name: None if k.required else toml_value(k, k.default) for k in train_keys()}


def _documented(cell: str) -> object:
    if cell in ("required", "none"):
        return None
    assert cell.startswith("`") and cell.endswith("`"), cell
    return tomllib.loads(f"x = {cell[1:-1]}")["x"]  # read by TOML's reader, not the code that wrote it


def test_every_config_key_is_documented_with_its_default():
    rows = {key: _documented(default) for key, default, _ in ROW.findall((ROOT / "docs" / "config.md").read_text())}
    code = _defaults()
    assert len(code) > 60
    assert f"(none: {DEFAULT_MEMORY_GB:g})" in next(k.doc for k in train_keys() if k.name == "planner.memory_gb")
    assert sorted(set(code) - set(rows)) == [], "config keys missing from docs/config.md"
    assert sorted(set(rows) - set(code)) == [], "docs/config.md documents keys the config does not take"
    wrong = {k: (rows[k], code[k]) for k in code if rows[k] != code[k]}
    assert not wrong, f"docs/config.md defaults that are not the code's (documented, code): {wrong}"


def test_docs_config_md_is_generated_from_the_types_and_not_stale():
    text = (ROOT / "docs" / "config.md").read_text()
    assert reference() in text, "docs/config.md is stale: run python -m hgraph.training.config_reference"


def test_a_stale_page_fails_the_check(tmp_path):
    """The check above sees a changed docstring: a copy of the page with one row edited is not current."""
    page = tmp_path / "config.md"
    text = (ROOT / "docs" / "config.md").read_text()
    page.write_text(text.replace("Learning rate.", "The learning rate."))
    assert reference() not in page.read_text()
    update_reference(page)
    assert page.read_text() == text


def test_every_option_table_default_is_what_the_library_does_without_the_table():
    """hgraph train's defaults are the library option types' own (but the clipping it switches on)."""
    for table in walk(config_tables(TrainConfig)):
        if table.cls.__module__ == TrainConfig.__module__ or table.default is MISSING:
            continue  # the train config's own tables define their defaults
        base = table.cls() if table.default is None else table.default
        changed = {f.name for f in fields(table.cls) if getattr(base, f.name) != getattr(table.cls(), f.name)}
        assert changed == ({"grad_clip"} if table.name == "optimizer" else set()), table.name


def _code_defaults() -> dict[str, object]:
    """Every default the README or docs/distributed.md may state, read from the code."""
    launch = inspect.signature(hgraph.launch).parameters
    train = {a.dest: a.default for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    return {
        "timeout": launch["timeout"].default, "comm_timeout": DEFAULT_COMM_TIMEOUT,  # launch's None means this
        "backend": launch["backend"].default, "--comm-timeout": train["comm_timeout"],
        "$HGRAPH_CACHE": "~/.cache/hgraph",
    }


@pytest.mark.parametrize("page", ["README.md", "docs/distributed.md"])
def test_stated_defaults_are_the_codes(page):
    text = (ROOT / page).read_text()
    stated = STATED.findall(text)
    assert stated, f"{page} states no defaults in the checked form"
    code = _code_defaults()
    for name, value in stated:
        assert name in code, f"{page} states a default for {name!r}, which this test does not know"
        expected = code[name]
        if name == "$HGRAPH_CACHE":
            from hgraph.data.stdlib import cache_dir

            assert str(cache_dir()) == str(Path(value).expanduser()) or "HGRAPH_CACHE" in __import__("os").environ
            continue
        assert _same(value, expected), (page, name, value, expected)


def _same(stated: str, code: object) -> bool:
    if isinstance(code, (int, float)) and not isinstance(code, bool):
        try:
            return float(stated) == float(code)
        except ValueError:
            return False
    return stated == repr(code) or stated.strip('"') == str(code)


def test_readme_is_short_and_has_no_development_notes():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for pattern in (r"\bissue \d+", r"\b[0-9a-f]{7,40}\b(?<!\d{7})", r"\bgoal\b", r"engineers?'"):
        assert not re.search(pattern, text, re.I), pattern


# Pages, tests and benchmarks the README names that land with work not merged yet; each entry goes
# when its file is on this branch (none now).
PENDING: set[str] = set()


def test_every_path_the_readme_names_exists():
    """Each claim names its test or benchmark: those files, and every page the README links, exist."""
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    named = re.findall(r"`((?:tests|benchmarks|examples|docs)/[A-Za-z0-9_./-]*)", text)
    paths = {p.rstrip("/") for p in links + named if not p.startswith(("http://", "https://"))}
    assert len(paths) > 30, paths
    missing = sorted(p for p in paths - PENDING if not (ROOT / p).exists())
    assert not missing, f"the README names files that do not exist: {missing}"
