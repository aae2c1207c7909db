"""The ``hgraph`` command (``command.py``: one subcommand per module) and its subcommands: demo, lnk-demo,
plan, show, train; the zoo check (``zoo_check.py``) and the demo plots."""
