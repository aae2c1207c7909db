"""Which Transformer layer a module path or parameter name belongs to: the one parser of layer names
(tracing, stage partition and the coalescing of Pull / Push by layer all read it)."""

from __future__ import annotations

import re
from typing import Optional, Sequence

# ``model.layers.3.``, ``transformer.h.3.``, ``blocks.3.``, ``model.decoder_layers.3.`` ...
LAYER_PATTERN = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block|decoder_layers)\.(\d+)(?:\.|$)")


def layer_index(path: str) -> Optional[int]:
    """Layer index named in a module path or parameter name, e.g. ``model.layers.3.mlp`` -> 3; None
    outside the layers (embeddings, final norm, head)."""
    m = LAYER_PATTERN.search(path)
    return int(m.group(1)) if m else None


def layer_runs(names: Sequence[str]) -> list[int]:
    """Run index of each parameter (in order): consecutive parameters sharing the prefix up to the
    first numeric path component (``layers.3.``) are one run; any other parameter is a run of its own.
    Pull / Push coalesce by these runs, whatever the model calls its layer list."""
    out, key_prev, run = [], None, -1
    for name in names:
        m = re.match(r"^(.*?\.\d+)\.", name)
        key = m.group(1) if m else name
        if key != key_prev:
            run += 1
            key_prev = key
        out.append(run)
    return out
