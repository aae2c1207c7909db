"""The planted-bug list stays applicable (fast) and the fast tier catches every planted bug (slow:
``run_mutations.py`` applies each in a temporary copy)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from mutations import MUTATIONS

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_every_planted_bug_still_applies_exactly_once():
    assert len(MUTATIONS) >= 10
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    for m in MUTATIONS:
        text = (ROOT / m.path).read_text()
        assert text.count(m.find) == 1, f"{m.name}: {m.path} holds its find text {text.count(m.find)} times"
        assert m.replace != m.find and m.tests and m.why, m.name
        for t in m.tests:
            assert (ROOT / t.split("::")[0]).is_file(), f"{m.name}: {t} names no test file"


def test_the_testing_page_lists_every_planted_bug():
    page = (ROOT / "docs" / "testing.md").read_text()
    for m in MUTATIONS:
        row = f"| `{m.name}` | `{m.path}` | {', '.join(f'`{t}`' for t in m.tests)} |"
        assert row in page, f"docs/testing.md's planted-bug table lacks {row}"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~6 min alone; the other xdist worker shares the two cores
def test_the_fast_tier_catches_every_planted_bug():
    # the control only checks that the listed tests are in the fast tier: `make test`, which runs them
    # unmutated, passes before the slow tier runs (.ci/run)
    done = subprocess.run([sys.executable, str(HERE / "run_mutations.py"), "--control", "collect"], cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=1400)
    assert done.stdout.strip(), done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip().endswith("}") else None
    assert report is not None, done.stdout[-4000:] + done.stderr[-4000:]
    assert not report["survived"], done.stdout[-6000:]
    assert report["caught"] == len(MUTATIONS) and done.returncode == 0, done.stdout[-6000:]
