"""A rank's optimizer shards as ``torch.distributed.checkpoint`` (DCP) chunks; DCP's save over any communicator.

DCP stores a global tensor as chunks (a box each: global offsets and sizes) and reads back, for each
box a rank asks for, only the stored chunks that overlap it. hgraph's ZeRO layouts
(``hgraph.core.zero``) give a rank one box of each parameter, or one per block of a fused projection
(``InterleavedShard``: its local tensor concatenates its slice of every block), which neither a
DTensor nor the default planner expresses. ``ShardBoxes`` does: the boxes of ``Layout.regions(rank)``,
each with the view of the local tensor that holds it (``Layout.local_index``), written as one chunk
each and read into in place. A rank at another world size asks for its new boxes, so it reads only
the overlapping chunks of the files that hold them.

``save`` drives DCP's save protocol (local plans, global plan and metadata on the coordinator, writes,
``.metadata``) over an hgraph ``Communicator``, so that simulated ranks (threads, no process group)
write the same checkpoints as processes; ``torch.distributed.checkpoint.async_save`` runs the same
planner and writer on a process group. ``read_metadata`` reads ``.metadata`` (a pickle) with an
unpickler that builds DCP's metadata types and nothing else; tensors are read with
``torch.load(weights_only=True)`` by DCP itself. ``load`` runs DCP's load protocol on one rank: a
load needs no coordination (DCP's global load plan is each rank's own).
"""

from __future__ import annotations

import io
import math
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType

from hgraph.core.layout import Layout
from hgraph.core.progress import progress
from hgraph.errors import CheckpointError
from hgraph.runtime.kernels.comm import Communicator

METADATA = ".metadata"  # DCP's own file: chunk -> (file, byte range), pickled


@dataclass(frozen=True)
class ShardBoxes:
    """A rank's part of a global tensor of ``shape``: ``boxes`` as (global offsets, local view) pairs,
    each one DCP chunk (what DTensor and ShardedTensor give DCP, for several boxes per rank)."""

    shape: tuple[int, ...]
    boxes: tuple[tuple[tuple[int, ...], torch.Tensor], ...]

    @classmethod
    def of(cls, layout: Layout, rank: int, local: torch.Tensor) -> "ShardBoxes":
        """``rank``'s boxes of ``layout`` as views of its local tensor ``local`` (empty boxes left out)."""
        boxes = tuple((tuple(lo for lo, _ in box), local[layout.local_index(rank, box)])
                      for box in layout.regions(rank) if all(hi > lo for lo, hi in box))
        return cls(layout.shape, boxes)

    def __str__(self) -> str:
        boxes = ", ".join(f"{list(offsets)}+{list(view.shape)}" for offsets, view in self.boxes)
        return f"ShardBoxes({list(self.shape)}: {boxes or 'none'})"

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), view.shape) for offsets, view in self.boxes]

    def view_at(self, index: MetadataIndex) -> torch.Tensor:
        """The local view of the box that starts at ``index.offset``."""
        for offsets, view in self.boxes:
            if torch.Size(offsets) == index.offset:
                return view
        raise CheckpointError(f"{index.fqn}: no box of {self} starts at {list(index.offset or ())}")

    # DCP's checkpointable protocol (planner_helpers: write items and chunk lists of an object)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(view), self.size()))
                for chunk, (_, view) in zip(self.chunks(), self.boxes)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks()


class BoxSavePlanner(DefaultSavePlanner):
    """DCP's default save planner for a flat state dict whose sharded values are ``ShardBoxes``;
    ``bar`` (a progress bar of bytes) advances as the writer takes each tensor."""

    def __init__(self, bar: Any = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.bar = bar

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        return value.view_at(index) if isinstance(value, ShardBoxes) else super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if self.bar is not None and isinstance(data, torch.Tensor):
            self.bar.update(data.numel() * data.element_size())
        return data


class BoxLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for ``ShardBoxes`` destinations (read into their views in place); it
    refuses pickled objects, which hgraph never saves and whose loading would run arbitrary code."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        # the default's first step (materialising meta tensors) would replace every value it does not
        # know, ShardBoxes included, by None; a flat state dict of real tensors needs none of it
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.view_at(index) if isinstance(value, ShardBoxes) else super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as a pickled object; "
                              "hgraph checkpoints hold tensors only and never unpickle objects")


def files_read(metadata: Metadata, state: dict[str, Any]) -> list[str]:
    """The data files a load of ``state`` reads from (those holding a chunk that overlaps one of its boxes)."""
    planner = BoxLoadPlanner()
    planner.set_up_planner(state, metadata)
    try:
        plan = planner.create_local_plan()
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint does not hold what this rank needs: {exc}") from None
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})


# ----------------------------------------------------------------------------- reading .metadata safely
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                     "torch.distributed.checkpoint.planner")
_SAFE_BUILTINS = frozenset(
    [("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset", "int", "str", "bytes")]
    + [("collections", "OrderedDict"), ("torch", "Size"), ("pathlib", "PosixPath"),
       ("torch.serialization", "_get_layout")])  # _get_layout: a layout by its name (a table lookup)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, ``torch.Size``, torch's dtypes and layouts and the checkpoint's path;
    refuses every other global (a crafted ``.metadata`` cannot call a function)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _METADATA_MODULES or (module, name) in _SAFE_BUILTINS:
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP's metadata")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint ``path``, unpickled without running code (``CheckpointError``)."""
    file = Path(path) / METADATA
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise CheckpointError(f"{file} cannot be read safely ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class FreshWriter(FileSystemWriter):
    """DCP's file writer, one file per rank, that empties its directory on the coordinator before any
    rank writes (leftovers of a save that crashed) and lets the checkpoint's own staging stand (the
    snapshot is already a host copy)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=True)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        shutil.rmtree(self.path, ignore_errors=True)
        Path(self.path).mkdir(parents=True)
        return super().prepare_global_plan(plans)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


# ----------------------------------------------------------------------------- save over a Communicator
def _all_gather_objects(obj: Any, comm: Communicator, world: tuple[int, ...]) -> list[Any]:
    """Every rank's ``obj`` (pickled among this job's own ranks), in ``world`` order."""
    payload = pickle.dumps(obj)
    sizes = comm.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=comm.device), world)
    sizes = [int(n) for n in sizes.reshape(-1).tolist()]
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = comm.all_gather(buf.to(comm.device), world).cpu()
    return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


def save(state: dict[str, Any], directory: Path, comm: Communicator, world: tuple[int, ...],
         rank: int) -> None:
    """DCP's save protocol (``state_dict_saver._save_state_dict``) over ``comm``: every rank plans, the
    first rank of ``world`` builds the global plan and the metadata, every rank writes its file, the
    first writes ``.metadata`` once all have written."""
    coordinator = rank == world[0]
    writer, planner = FreshWriter(directory), BoxSavePlanner()
    planner.set_up_planner(state, writer.storage_meta(), coordinator)
    writer.set_up_storage_writer(coordinator, rank=world.index(rank), use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = _all_gather_objects(local, comm, world)
    central: Optional[tuple[list[Any], Metadata]] = None
    if coordinator:
        plans, metadata = planner.create_global_plan(plans)
        central = (writer.prepare_global_plan(plans), metadata)
    plans, metadata = _all_gather_objects(central, comm, world)[0]  # after the coordinator emptied the directory
    mine = planner.finish_plan(plans[world.index(rank)])
    total = sum(math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
                for item in mine.items if item.tensor_data is not None)
    with progress(desc=f"writing checkpoint {directory.name.strip('.').removesuffix('.partial')}", total=total,
                  unit="B", show=coordinator) as planner.bar:
        results = writer.write_data(mine, planner)
        results.wait()
    everyone = _all_gather_objects(results.value(), comm, world)
    if coordinator:
        writer.finish(metadata, everyone)


def load(state: dict[str, Any], directory: Path, metadata: Metadata) -> None:
    """Read ``state`` (its ``ShardBoxes`` in place, its plain tensors too) from checkpoint ``directory``,
    whose ``metadata`` was read and checked: only the stored chunks that overlap its boxes are read."""
    reader, planner = FileSystemReader(directory), BoxLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()


__all__ = ["BoxLoadPlanner", "BoxSavePlanner", "FreshWriter", "METADATA", "ShardBoxes", "files_read",
           "load", "read_metadata", "save"]
