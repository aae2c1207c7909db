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
from hgraph.training.config_sections import SECTIONS, TOP_SECTIONS, reference, toml_default
from hgraph.training.train_config import TABLES, TOP, DataConfig, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| `([a-z_.]+)` \| (.+?) \| (.+) \|$", re.M)
STATED = re.compile(r"`([^`]+)`\s*\(default\s+`([^`]+)`\)")


def _defaults() -> dict[str, object]:
    """Config key -> the default the code uses (None: required or unset)."""
    train = {f.name: None if f.default is MISSING else f.default for f in fields(TrainConfig)}  # MISSING: required
    data = {f.name: None if f.default is MISSING else f.default for f in fields(DataConfig)}
    out = {k: train.get(k) for k in TOP - set(TABLES) - {s.name for s in TOP_SECTIONS}}
    out.update({f"{s.name}.{k}": toml_default(s, k) for s in SECTIONS for k in s.keys()})
    out["planner"] = train["planner"]  # planner = "auto" | "none", or the [planner] table
    out.update({f"data.{k}": data.get(k, train.get(k)) for k in TABLES["data"]})
    out.update({"data.paths": None, "data.tokenizer": None, "data.tokens_per_iteration": data["tokens_per_iteration"],
                "eval.paths": [], "eval.interval": train["eval_interval"], "eval.batches": train["eval_batches"],
                "checkpoint.dir": train["checkpoint_dir"], "checkpoint.interval": train["checkpoint_interval"],
                "checkpoint.resume": train["resume"], "checkpoint.keep": train["checkpoint_keep"],
                "checkpoint.async": train["checkpoint_async"], "export.dir": train["export_dir"],
                "planner.cost_table": train["cost_table"], "planner.memory_gb": DEFAULT_MEMORY_GB})
    out.update({f"metrics.{k}": train[f"metrics_{k}"] for k in ("dir", "jsonl", "tensorboard", "console", "wandb")})
    out["metrics.peak_tflops"] = train["peak_tflops"]
    return out


def _documented(cell: str) -> object:
    if cell in ("required", "none"):
        return None
    assert cell.startswith("`") and cell.endswith("`"), cell
    return tomllib.loads(f"x = {cell[1:-1]}")["x"]


def test_every_config_key_is_documented_with_its_default():
    rows = {key: _documented(default) for key, default, _ in ROW.findall((ROOT / "docs" / "config.md").read_text())}
    code = _defaults()
    sections = {f"{s.name}.{k}" for s in SECTIONS for k in s.keys()}
    assert set(code) == (TOP - set(TABLES) - {s.name for s in TOP_SECTIONS} | {"planner"} | sections
                         | {f"{t}.{k}" for t, keys in TABLES.items() for k in keys})
    assert sorted(set(code) - set(rows)) == [], "config keys missing from docs/config.md"
    assert sorted(set(rows) - set(code)) == [], "docs/config.md documents keys the config does not take"
    wrong = {k: (rows[k], code[k]) for k in code if rows[k] != code[k]}
    assert not wrong, f"docs/config.md defaults that are not the code's (documented, code): {wrong}"


def test_the_option_tables_are_generated_from_the_field_docstrings():
    text = (ROOT / "docs" / "config.md").read_text()
    assert reference() in text, ("docs/config.md's option tables are out of date: run "
                                 "python -c 'from hgraph.training.config_sections import update_reference; "
                                 "update_reference()'")


def test_every_option_table_default_is_what_the_library_does_without_the_table():
    """hgraph train's defaults are the dataclasses' (but the clipping it switches on)."""
    for s in SECTIONS:
        base = s.cls() if s.default is None else s.default
        changed = {f.name for f in fields(s.cls) if getattr(base, f.name) != getattr(s.cls(), f.name)}
        assert changed == ({"grad_clip"} if s.name == "optimizer" else set()), s.name


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
