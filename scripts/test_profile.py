"""Where the test suite's time goes: seconds per test file and per fixture set-up.

    python scripts/test_profile.py [pytest arguments]      # e.g. `-m slow`, `tests/models`

runs pytest with this module as a plugin, prints the slowest files (set-up + call + teardown of
their tests) and the slowest fixtures (summed over their set-ups, with the count), and writes the
whole table as JSON to ``$HGRAPH_TEST_PROFILE`` (default ``test-profile.json``). Run it without
pytest-xdist: fixture set-ups are timed in the process that runs them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

import pytest

TOP = 25

_file_seconds: dict[str, float] = defaultdict(float)
_file_tests: dict[str, int] = defaultdict(int)
_fixture_seconds: dict[str, float] = defaultdict(float)
_fixture_setups: dict[str, int] = defaultdict(int)
_started = time.perf_counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] += report.duration
    if report.when == "call":
        _file_tests[path] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    yield
    name = f"{fixturedef.argname} ({fixturedef.scope})"
    _fixture_seconds[name] += time.perf_counter() - start
    _fixture_setups[name] += 1


def _table() -> dict:
    return {
        "wall_s": round(time.perf_counter() - _started, 1),
        "files": [
            {"file": path, "seconds": round(seconds, 1), "tests": _file_tests[path]}
            for path, seconds in sorted(_file_seconds.items(), key=lambda kv: -kv[1])
        ],
        "fixtures": [
            {"fixture": name, "seconds": round(seconds, 1), "setups": _fixture_setups[name]}
            for name, seconds in sorted(_fixture_seconds.items(), key=lambda kv: -kv[1])
        ],
    }


def pytest_terminal_summary(terminalreporter) -> None:
    table = _table()
    write = terminalreporter.write_line
    write(f"\n== time per test file (top {TOP} of {len(table['files'])}; wall {table['wall_s']} s) ==")
    for row in table["files"][:TOP]:
        write(f"{row['seconds']:8.1f} s  {row['tests']:4d} tests  {row['file']}")
    write(f"== time per fixture set-up (top {TOP}) ==")
    for row in table["fixtures"][:TOP]:
        write(f"{row['seconds']:8.1f} s  {row['setups']:4d} set-ups  {row['fixture']}")
    out = os.environ.get("HGRAPH_TEST_PROFILE", "test-profile.json")
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(table, handle, indent=1)
    write(f"(whole table: {out})")


if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[1:], plugins=[sys.modules[__name__]]))
