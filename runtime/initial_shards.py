"""The Trainer's starting point: this rank's fp32 master shards, taken without a full copy of the model.

Three sources, in this order of precedence:

* ``weights=PATH`` (``hgraph.core.checkpoint_files.SafetensorsCheckpoint``): every rank checks the
  checkpoint's headers against the model (names, shapes, dtypes, file sizes), then reads only the
  boxes of its own shards (and of its witness shards, below), upcast exactly to fp32. Persistent
  buffers the checkpoint holds are loaded too. The model's own values, if it has any, are not used.
* a model built on meta, without ``weights``: the model's own initialisation run one module at a
  time (``hgraph.frontend.layerwise_init``, from ``seed``); each parameter is cut into shards and dropped as
  soon as it is final.
* an eagerly built model: its tensors, cut (the model's own copy is the only full one).

Every rank also takes from its source the shards of the next rank and fingerprints them, for the
agreement check (``hgraph.runtime.agreement.check_same_shards``). A ``CheckpointError`` (or
``InputError``) on any rank is shared before anything else runs: every rank raises one, naming the
failing rank and its message, so no rank trains on, waits forever or keeps half a model.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import torch

from hgraph.core.checkpoint_files import SafetensorsCheckpoint
from hgraph.errors import CheckpointError, HGraphError, InputError
from hgraph.frontend.layerwise_init import initialize
from hgraph.core.layout import Layout
from hgraph.frontend.meta import is_meta_model
from hgraph.runtime.agreement import check_same_shards, fingerprints, first_failure
from hgraph.runtime.kernels.comm import Communicator

PathLike = Union[str, "os.PathLike[str]"]


def checkpoint_names(fqn: str, aliases: list[str], prefix: str) -> list[str]:
    """Names parameter ``fqn`` may have in a checkpoint: its own, its tied aliases', and each of those
    with the HF base-model prefix (``model.``) removed or added (a base model's checkpoint, or the reverse)."""
    names = [fqn, *aliases]
    if prefix:
        names += [n.removeprefix(prefix + ".") for n in names if n.startswith(prefix + ".")]
        names += [f"{prefix}.{n}" for n in names[: 1 + len(aliases)] if not n.startswith(prefix + ".")]
    return list(dict.fromkeys(names))


def _read_local(checkpoint: SafetensorsCheckpoint, name: str, layout: Layout, rank: int) -> torch.Tensor:
    """``rank``'s local tensor of ``layout`` read from tensor ``name``, box by box, as fp32."""
    out = torch.empty(layout.local_shape(rank), dtype=torch.float32)
    for box in layout.regions(rank):
        out[layout.local_index(rank, box)] = checkpoint.read(name, box)
    return out


def _fingerprint_of(tensor: torch.Tensor) -> torch.Tensor:
    return fingerprints({"": tensor})[0]


class _Shards:
    """What a source hands over: own fp32 shards and witness fingerprints, in layout order."""

    def __init__(self, layouts: Mapping[str, Layout], rank: int, witness: int) -> None:
        self.layouts, self.rank, self.witness = layouts, rank, witness
        self.own: dict[str, torch.Tensor] = {}
        self.seen: dict[str, torch.Tensor] = {}

    def take(self, fqn: str, full: torch.Tensor) -> None:
        """Cut this rank's shard and fingerprint the witness's from the full tensor ``full``."""
        layout = self.layouts[fqn]
        self.own[fqn] = layout.local_of(full, self.rank).to(torch.float32)
        if self.witness != self.rank:
            self.seen[fqn] = _fingerprint_of(layout.local_of(full, self.witness).to(torch.float32))

    def ordered(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        names = list(self.layouts)
        own = {n: self.own[n] for n in names}
        seen = [self.seen[n] for n in names if n in self.seen]
        return own, fingerprints(own), torch.stack(seen) if seen else torch.zeros(0, 3, dtype=torch.float64)


def _from_checkpoint(compiled: Any, path: PathLike, shards: _Shards) -> None:
    model = compiled.model
    checkpoint = SafetensorsCheckpoint(path)
    aliases: dict[str, list[str]] = {}
    for alias, canonical in compiled.traced.tied.items():
        aliases.setdefault(canonical, []).append(alias)
    prefix = getattr(model, "base_model_prefix", "") or ""
    expected = {fqn: (layout.shape, checkpoint_names(fqn, aliases.get(fqn, []), prefix))
                for fqn, layout in shards.layouts.items()}
    names = checkpoint.check(expected)
    buffers = _persistent_buffers(compiled)
    stored_buffers = {fqn: checkpoint.find(checkpoint_names(fqn, [], prefix)) for fqn in buffers}
    for fqn, name in stored_buffers.items():
        if name is not None and checkpoint.tensors[name].shape != tuple(buffers[fqn][0].shape):
            stored = checkpoint.tensors[name]
            raise CheckpointError(f"checkpoint {stored.file}: tensor '{name}' has shape {list(stored.shape)}, the "
                                  f"model's buffer '{fqn}' has {list(buffers[fqn][0].shape)}")
    with checkpoint.open():
        for fqn, layout in shards.layouts.items():
            shards.own[fqn] = _read_local(checkpoint, names[fqn], layout, shards.rank)
            if shards.witness != shards.rank:
                shards.seen[fqn] = _fingerprint_of(_read_local(checkpoint, names[fqn], layout, shards.witness))
        values = {fqn: checkpoint.read(name, ()) for fqn, name in stored_buffers.items() if name is not None}
    with torch.no_grad():  # only once every read succeeded: nothing is half-loaded
        for fqn, value in values.items():
            for buffer in buffers[fqn]:
                buffer.copy_(value)


def _persistent_buffers(compiled: Any) -> dict[str, list[torch.Tensor]]:
    """Persistent buffer FQN -> the tensors holding it (the user's model and the traced copy)."""
    state = compiled.model.state_dict(keep_vars=True)
    params = {name for name, _ in compiled.model.named_parameters(remove_duplicate=False)}
    traced = compiled.traced.buffers()
    out: dict[str, list[torch.Tensor]] = {}
    for name, value in state.items():
        if name not in params:
            out[name] = [value] + ([traced[name]] if name in traced and traced[name] is not value else [])
    return out


def _shared_failure(error: Optional[HGraphError], comm: Communicator, world: tuple[int, ...],
                    device: torch.device) -> None:
    """Raise on every rank if ``error`` happened on any: the first failing rank's message."""
    failure = first_failure(None if error is None else str(error), comm, world, device)
    if failure is None:
        return
    first, message = failure
    if error is not None and comm.rank == first:
        raise error
    kind = type(error) if error is not None else CheckpointError
    raise kind(f"rank {first} failed to load the initial parameters: {message}")


def initial_shards(
    compiled: Any, rank: int, comm: Communicator, world: tuple[int, ...], device: torch.device,
    weights: Optional[PathLike] = None, seed: int = 0,
) -> dict[str, torch.Tensor]:
    """This rank's fp32 master shard of every parameter (see the module docstring), checked to agree
    with every other rank's; call on every rank."""
    layouts = compiled.optimizer_layouts
    shards = _Shards(layouts, rank, world[(world.index(rank) + 1) % len(world)])
    error: Optional[HGraphError] = None
    try:
        if weights is not None:
            _from_checkpoint(compiled, weights, shards)
        elif is_meta_model(compiled.model):
            initialize(compiled.model, seed, shards.take, names=list(layouts))
        else:
            params = dict(compiled.model.named_parameters())
            for fqn in layouts:
                shards.take(fqn, params[fqn].detach())
    except (CheckpointError, InputError) as exc:
        error = exc
    _shared_failure(error, comm, world, device)
    own, own_prints, seen_prints = shards.ordered()
    check_same_shards(own_prints, seen_prints, list(layouts), compiled.traced.buffers(), comm, world, device)
    return {fqn: shard.to(device) for fqn, shard in own.items()}


__all__ = ["checkpoint_names", "initial_shards"]
