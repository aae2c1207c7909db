"""Length files and the batches drawn from them.

A length file holds one positive integer per line (blank lines are skipped). Batches are drawn in
file order after a seeded shuffle, each filled until it holds ``tokens_per_iteration`` tokens, every
sequence truncated to ``max_len``; the file is reshuffled (next seed) when it runs out.
"""

from __future__ import annotations

import random
from importlib import resources
from pathlib import Path
from typing import Sequence, Union

from hgraph.errors import InputError, PlanError

SAMPLE = "wikipedia_lengths_sample.txt"


def sample_path() -> Path:
    """The bundled sample: 20,000 tokenized Wikipedia document lengths."""
    return Path(str(resources.files("hgraph.data").joinpath(SAMPLE)))


def read_lengths(path: Union[str, Path]) -> list[int]:
    """The lengths of a length file; a malformed line raises ``InputError`` naming it."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start}); a length file holds one positive integer per line") from None
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            raise InputError(f"{path}:{number}: {text!r} is not an integer; a length file holds one positive integer per line") from None
        if value < 1:
            raise InputError(f"{path}:{number}: length {value} is not positive; lengths must be >= 1")
        out.append(value)
    if not out:
        raise InputError(f"{path}: the length file is empty; it needs one positive integer per line")
    return out


def make_batches(
    lengths: Sequence[int], tokens_per_iteration: int, max_len: int, iterations: int, seed: int = 0
) -> list[list[int]]:
    """``iterations`` batches of about ``tokens_per_iteration`` tokens (see the module docstring)."""
    for name, value in (("tokens_per_iteration", tokens_per_iteration), ("max_len", max_len), ("iterations", iterations)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r}; it must be a positive integer")
    if not lengths:
        raise PlanError("no sequence lengths to draw batches from")
    batches: list[list[int]] = []
    epoch = 0
    order: list[int] = []
    pos = 0
    while len(batches) < iterations:
        batch, tokens = [], 0
        while tokens < tokens_per_iteration:
            if pos == len(order):
                order = list(lengths)
                random.Random(seed + epoch).shuffle(order)
                epoch += 1
                pos = 0
            l = min(order[pos], max_len)
            pos += 1
            batch.append(l)
            tokens += l
        batches.append(batch)
    return batches
