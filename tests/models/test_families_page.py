"""docs/families_2026.md lists every zoo family with what it is checked on, and says what the zoo test
expects: a family added to ``hgraph.models.zoo`` without a row, or a refusal the page does not show
(or shows where the zoo test expects equality), fails here. Reads files only; no model is built."""

from __future__ import annotations

from pathlib import Path

from hgraph.cli.zoo_check import STRATEGY_KINDS
from hgraph.models.zoo import FAMILIES
from test_zoo import EXPECTED  # tests/models is on sys.path (pytest's rootdir-relative import)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "families_2026.md"


def family_rows(recent_only: bool = False) -> dict[str, list[str]]:
    """The page's family tables (``recent_only``: the 2025-2026 table, whose header has 'what is new in
    it'): family -> its cells, one per strategy kind (in ``STRATEGY_KINDS`` order)."""
    rows: dict[str, list[str]] = {}
    header: list[str] = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("|"):
            header = []
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "family":
            header = cells
        elif header and cells[0] in FAMILIES and (not recent_only or "what is new in it" in header):
            rows[cells[0]] = [cells[header.index(kind)] for kind in STRATEGY_KINDS]
    return rows


def test_every_zoo_family_has_a_row():
    rows = family_rows()
    assert set(FAMILIES) <= set(rows), f"families without a row: {sorted(set(FAMILIES) - set(rows))}"


def test_the_page_shows_what_the_zoo_test_expects():
    """On the 2025-2026 families (the older ones' refusals change with the packing issue's oracle)."""
    rows = family_rows(recent_only=True)
    assert len(rows) >= 30
    for family, cells in rows.items():
        for strategy, cell in zip(STRATEGY_KINDS.values(), cells):
            if cell == "—":  # not measured in the run the page reports
                continue
            refused = strategy in EXPECTED[family]
            assert cell.startswith("refused") == refused, (
                f"{family} on {strategy}: the page says {cell!r}, test_zoo.EXPECTED says "
                f"{'a refusal' if refused else 'equal'}")
