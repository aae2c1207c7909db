"""The schedule vocabulary: the action IR of a rank's iteration (``actions.py``: kinds, actions,
parse, peers), the one registry of lowerings and the placement of pulls and pushes
(``lowerings.py``), the one replay and the dry run on it (``replay.py``), and the one pipeline time
(``bubble.py``). Pure data; no torch.distributed."""
