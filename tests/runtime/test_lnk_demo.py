"""``hgraph lnk-demo`` runs and verifies every layout change."""

from hgraph.cli.command import main


def test_demo_runs_and_checks_every_transition(capsys):
    assert main(["lnk-demo"]) == 0
    out = capsys.readouterr().out
    verdicts = [line.split()[0] for line in out.splitlines() if line.startswith(("ok ", "FAILED"))]
    assert verdicts == ["ok"] * 6
    assert "all_to_all dim0->dim1 group(0,1,2,3)" in out
