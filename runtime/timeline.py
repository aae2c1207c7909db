"""Timeline: per-rank intervals of compute and communication, as a Chrome trace, a Gantt chart, and
*exposed communication* (communication time not overlapped by compute).

The runtime records an ``Event`` for every forward/backward of a micro-batch (track ``compute``),
every Pull Parameter, Push Gradient and Communicate Activation (track ``comm``: from the moment the
operation is started to the moment its wait returns, so an asynchronous operation spans the compute
it overlaps) and every blocking wait (kind ``wait``, track ``compute``: the compute thread stands
still). Times are wall-clock seconds read from the device's clock (``hgraph.runtime.clock``: on CUDA
when the device reached the interval's ends, not when they were launched), so events of several
processes line up.

Use::

    trainer = hgraph.Trainer(compiled, timeline=True)   # on every rank
    trainer.step(batch)
    events = trainer.gather_timeline()                   # collective; rank 0 gets every rank's events
    if trainer.rank == 0:
        write_chrome_trace(events, "trace.json")         # open in ui.perfetto.dev or chrome://tracing
        plot_gantt(events, "timeline.png")
        exposed = exposed_communication(events)          # {rank: {iteration: seconds}}
"""

from __future__ import annotations

import json
import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Optional, Sequence

import torch

from hgraph.core import atomic_files
from hgraph.runtime.clock import wall_seconds
from hgraph.errors import InputError

COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("pull_parameter", "push_gradient", "communicate_activation")
KINDS = COMPUTE_KINDS + COMM_KINDS + ("wait",)
_COLORS = MappingProxyType({
    "forward": "#4c78a8",
    "backward": "#72b7b2",
    "pull_parameter": "#f58518",
    "push_gradient": "#e45756",
    "communicate_activation": "#54a24b",
    "wait": "#bab0ac",
})


@dataclass(frozen=True)
class Event:
    """One interval on one rank: ``kind`` (see ``KINDS``), a label, wall-clock seconds."""

    rank: int
    kind: str
    name: str
    start: float
    end: float
    iteration: int = 0

    @property
    def track(self) -> str:
        return "comm" if self.kind in COMM_KINDS else "compute"

    @property
    def duration(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        ms = 1e3 * self.duration
        return f"rank {self.rank} it{self.iteration} {self.kind:<22} {self.name:<40} {ms:8.3f} ms"


class Timeline:
    """The recorder of one rank: ``span`` times a block, ``add`` stores a finished interval."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.iteration = 0
        self.events: list[Event] = []

    def add(self, kind: str, name: str, start: float, end: float) -> None:
        if kind not in KINDS:
            raise InputError(f"timeline event kind {kind!r}; expected one of {', '.join(KINDS)}")
        self.events.append(Event(self.rank, kind, name, start, end, self.iteration))

    @contextmanager
    def span(self, kind: str, name: str) -> Iterator[None]:
        """Times the block on the host clock (work it issues to a CUDA device is not waited for)."""
        start = wall_seconds()
        try:
            yield
        finally:
            self.add(kind, name, start, wall_seconds())

    def clear(self) -> None:
        self.events.clear()


def gather_events(events: Sequence[Event], comm: Any, dst: int = 0) -> list[Event]:
    """Every rank's events on rank ``dst`` (others get ``[]``); call on every rank of ``comm``."""
    payload = torch.tensor(list(pickle.dumps(list(events))), dtype=torch.uint8)
    world = tuple(range(comm.world_size))
    sizes = comm.all_gather(torch.tensor([payload.numel()], dtype=torch.int64), world).reshape(-1)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    stacked = comm.all_gather(padded, world)
    if comm.rank != dst:
        return []
    out: list[Event] = []
    for r in world:
        out.extend(pickle.loads(bytes(stacked[r, : int(sizes[r])].tolist())))
    return sorted(out, key=lambda e: (e.rank, e.start))


# ----------------------------------------------------------------------------- interval arithmetic
def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of ``union(xs)`` not covered by ``union(ys)`` (both already merged)."""
    covered, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            covered += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return _length(xs) - covered


def exposed_communication(
    events: Sequence[Event], kinds: Sequence[str] = COMM_KINDS
) -> dict[int, dict[int, float]]:
    """Seconds of communication not overlapped by compute, per rank and iteration:
    ``|union(comm intervals) - union(forward/backward intervals)|``; ``kinds`` restricts the
    communication counted (e.g. ``("pull_parameter", "push_gradient")``)."""
    bad = [k for k in kinds if k not in COMM_KINDS]
    if bad:
        raise InputError(f"communication kinds {bad}; expected some of {', '.join(COMM_KINDS)}")
    out: dict[int, dict[int, float]] = {}
    for (rank, it), group in sorted(_by_rank_iteration(events).items()):
        comm = _union([(e.start, e.end) for e in group if e.kind in kinds])
        compute = _union([(e.start, e.end) for e in group if e.kind in COMPUTE_KINDS])
        out.setdefault(rank, {})[it] = _minus(comm, compute)
    return out


def summary(events: Sequence[Event]) -> dict[int, dict[int, dict[str, float]]]:
    """Per rank and iteration: span (first start to last end), compute, communication (union) and
    exposed communication seconds, and seconds per kind."""
    out: dict[int, dict[int, dict[str, float]]] = {}
    exposed = exposed_communication(events)
    for (rank, it), group in sorted(_by_rank_iteration(events).items()):
        row = {
            "span": max(e.end for e in group) - min(e.start for e in group),
            "compute": _length(_union([(e.start, e.end) for e in group if e.kind in COMPUTE_KINDS])),
            "communication": _length(_union([(e.start, e.end) for e in group if e.kind in COMM_KINDS])),
            "exposed_communication": exposed[rank][it],
        }
        for kind in KINDS:
            row[kind] = sum(e.duration for e in group if e.kind == kind)
        out.setdefault(rank, {})[it] = row
    return out


def _by_rank_iteration(events: Sequence[Event]) -> dict[tuple[int, int], list[Event]]:
    groups: dict[tuple[int, int], list[Event]] = {}
    for e in events:
        groups.setdefault((e.rank, e.iteration), []).append(e)
    return groups


# ----------------------------------------------------------------------------- outputs
def chrome_trace(events: Sequence[Event]) -> dict[str, Any]:
    """The Chrome trace / Perfetto JSON object: one process per rank, threads ``compute``/``comm``."""
    if not events:
        raise InputError("no timeline events; construct the Trainer with timeline=True and run a step")
    t0 = min(e.start for e in events)
    tids = {"compute": 0, "comm": 1}
    trace: list[dict[str, Any]] = []
    for rank in sorted({e.rank for e in events}):
        name = {"name": f"rank {rank}"}
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": name})
        for track, tid in tids.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}})
    for e in sorted(events, key=lambda e: (e.rank, e.start)):
        trace.append({
            "name": e.name,
            "cat": e.kind,
            "ph": "X",
            "ts": round(1e6 * (e.start - t0), 3),
            "dur": round(1e6 * e.duration, 3),
            "pid": e.rank,
            "tid": tids[e.track],
            "args": {"kind": e.kind, "iteration": e.iteration},
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Sequence[Event], path: str) -> str:
    """Write ``events`` as Chrome trace JSON (opens in ui.perfetto.dev and chrome://tracing)."""
    atomic_files.write_text(path, json.dumps(chrome_trace(events)))
    return path


def plot_gantt(events: Sequence[Event], path: str, title: Optional[str] = None) -> str:
    """A PNG Gantt chart: two rows per rank (compute, comm), one colour per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        raise InputError("no timeline events; construct the Trainer with timeline=True and run a step")
    t0 = min(e.start for e in events)
    ranks = sorted({e.rank for e in events})
    rows = {(r, track): i for i, (r, track) in enumerate((r, t) for r in ranks for t in ("compute", "comm"))}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.2))
    for e in events:
        y = len(rows) - 1 - rows[(e.rank, e.track)]
        left = 1e3 * (e.start - t0)
        ax.barh(y, 1e3 * e.duration, left=left, height=0.8, color=_COLORS[e.kind], linewidth=0)
    ax.set_yticks([len(rows) - 1 - i for i in rows.values()])
    ax.set_yticklabels([f"rank {r} {t}" for r, t in rows])
    ax.set_xlabel("ms")
    ax.set_title(title or "hgraph timeline")
    used = [k for k in KINDS if any(e.kind == k for e in events)]
    ax.legend(handles=[Patch(color=_COLORS[k], label=k) for k in used], loc="upper right", fontsize=7)
    fig.tight_layout()
    with atomic_files.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=Path(path).suffix.lstrip(".") or "png", dpi=100)
    plt.close(fig)
    return path
