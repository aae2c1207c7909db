"""The action IR of a rank's iteration (``actions.py``: lowerings and the dry run) and pipeline time
per schedule (``bubble.py``). Pure data; no torch.distributed."""
