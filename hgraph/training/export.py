"""Export a trained run as the user's own model, tensor by tensor.

``export_pretrained`` writes what HF ``from_pretrained`` loads: ``config.json`` (+
``generation_config.json``) and the weights in HF's safetensors format, sharded with an index when
they exceed ``max_shard_size``. ``save_safetensors`` writes the same weights for a model that is not
an HF model. Both stream: every rank takes part in gathering one parameter at a time
(``Trainer.state_items``) onto the writing rank, which appends it to its file at once
(``hgraph.core.sharded_writer``), so the writer holds one tensor at a time, never the model. Tied
parameters are written once, under their first name, as ``save_pretrained`` does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hgraph.core import atomic_files
from hgraph.errors import InputError
from hgraph.core.sharded_writer import DEFAULT_SHARD_SIZE, ShardedWriter, TensorSpec

WRITER = 0  # the rank that writes the files


def state_specs(model: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> list[TensorSpec]:
    """Name, dtype and shape of each tensor of ``model.state_dict()`` as exported: tied parameters
    once, floating tensors in ``dtype`` when given (the order of ``Trainer.state_items``)."""
    seen: set[int] = set()
    params = {id(p) for p in model.parameters()}
    specs = []
    for name, ref in model.state_dict(keep_vars=True).items():
        if id(ref) in params:
            if id(ref) in seen:
                continue
            seen.add(id(ref))
        cast = dtype if dtype is not None and ref.is_floating_point() else ref.dtype
        specs.append(TensorSpec(name, cast, tuple(ref.shape)))
    return specs


def save_safetensors(trainer: Any, path: Union[str, Path], dtype: Optional[torch.dtype] = None,
                     max_shard_size: Union[int, str] = DEFAULT_SHARD_SIZE) -> list[Path]:
    """Write the trained model's state (``trainer.compiled.model``'s names) into directory ``path``
    as ``model.safetensors``, or HF shards with an index when larger than ``max_shard_size``; call on
    every rank (rank 0 writes). Returns the files written (empty on other ranks)."""
    specs = state_specs(trainer.compiled.model, dtype)
    writer = ShardedWriter(path, specs, max_shard_size) if trainer.rank == WRITER else None
    try:
        for name, value in trainer.state_items(dtype, dst=WRITER, aliases=False):
            if writer is not None:
                assert value is not None
                writer.write(name, value)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    files = writer.close() if writer is not None else []
    trainer.comm.barrier(trainer.world)
    return files


def export_pretrained(trainer: Any, model: Any, path: Union[str, Path], dtype: Optional[torch.dtype] = None,
                      max_shard_size: Union[int, str] = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``model``'s config and the trained parameters to ``path`` in HF's format; call on every
    rank (rank 0 writes, one tensor at a time). ``dtype``: cast floating tensors (default: each
    tensor's dtype in the model). ``max_shard_size`` (bytes, or ``"5GB"``): larger weights are
    split into HF shards with ``model.safetensors.index.json``."""
    if not hasattr(model, "save_pretrained"):
        raise InputError(f"{type(model).__name__} has no save_pretrained (not a HuggingFace model); "
                         "use hgraph.training.export.save_safetensors(trainer, path) instead")
    expected = set(model.state_dict())
    trained = set(trainer.compiled.model.state_dict())
    if trained != expected:
        missing, unknown = sorted(expected - trained), sorted(trained - expected)
        raise InputError(f"export_pretrained: the trained model's state does not match {type(model).__name__} "
                         f"(missing {missing[:5]}, unknown {unknown[:5]}); pass the model you compiled")
    out = Path(path)
    save_safetensors(trainer, out, dtype, max_shard_size)
    if trainer.rank == WRITER:
        config = copy.deepcopy(model.config)
        floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
        written = dtype or (floating[0] if floating else torch.float32)
        config.dtype = str(written).split(".")[1]
        config.architectures = [type(model).__name__]
        atomic_files.write_text(out / "config.json", config.to_json_string(use_diff=True))
        can_generate = getattr(model, "can_generate", None)
        if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
            atomic_files.write_text(out / "generation_config.json",
                                    model.generation_config.to_json_string(use_diff=True))
    trainer.comm.barrier(trainer.world)
    return out


__all__ = ["export_pretrained", "save_safetensors", "state_specs"]
