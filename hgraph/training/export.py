"""Export a trained run as the user's own model: ``export_pretrained`` writes what HF
``from_pretrained`` loads (``config.json`` + ``model.safetensors``), from ``Trainer.state_dict``
(the unmodified model's names, full tensors gathered from the optimizer shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

from hgraph.core.errors import InputError


def export_pretrained(trainer: Any, model: Any, path: Union[str, Path], dtype: Optional[torch.dtype] = None) -> Path:
    """Write ``model``'s config and the trained parameters to ``path``; call on every rank (the
    parameters are gathered on every rank, rank 0 writes). ``dtype``: cast (default: the model's)."""
    if not hasattr(model, "save_pretrained"):
        raise InputError(f"{type(model).__name__} has no save_pretrained (not a HuggingFace model); "
                         "save trainer.state_dict() with torch.save or safetensors instead")
    state = trainer.state_dict(dtype)
    expected = set(model.state_dict())
    if set(state) != expected:
        missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
        raise InputError(f"export_pretrained: the trained model's state does not match {type(model).__name__} "
                         f"(missing {missing[:5]}, unknown {unknown[:5]}); pass the model you compiled")
    out = Path(path)
    if trainer.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    trainer.comm.barrier(trainer.world)
    return out
