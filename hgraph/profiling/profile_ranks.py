"""Multi-rank profiling: measure ``T(l)`` of every scheme on real local gloo ranks, fit, build a table.

``profile_ranks(model_factory, world_size, schemes, lengths)`` launches ``world_size`` processes
once (``hgraph.launch``); every rank compiles the model for the homogeneous strategy of each scheme
(``world_size / (tp*pp*cp)`` replicas; under cp each rank gets its load-balanced chunks of every
micro-batch, as in training, so ``--schemes tp1,cp2`` measures context parallelism itself, and
``--schemes tp2ep2`` expert parallelism: its all-to-alls and the load imbalance of the model's own
router on the profiled tokens are in the measured ``T(l)``). Per scheme, each iteration is one
``run_iteration`` (the rank's action list ``RankProgram.actions``, the very list a training step
runs: Pull, 1F1B, Push) in which every pipeline runs one micro-batch per length (one sequence of
``l`` tokens each, in a seeded shuffled order that all ranks share): one warm-up iteration per scheme, then ``repeats``
rounds of one timed iteration per scheme (rounds outermost, so that load from other programs on
the machine falls on every scheme alike).

What ``T(l)`` means: the per-stage forward+backward time of one micro-batch of ``l`` tokens, the
quantity the planner's 1F1B formula ``Σ T + (pp−1)·max T`` adds up. Each rank times its own F and B
steps of each micro-batch (the ``on_step`` hook of ``run_iteration``): the stage computation with the
tensor-parallel collectives inside it, under the contention of all ranks running at once as in
training. Not included: Pull/Push and the inter-stage sends/receives (separate steps of the schedule;
the simulator adds Pull/Push from the LNK model). The warm-up iteration also counts the bytes each
micro-batch's forward saves for backward. ``hgraph.profiling.ranks_table`` fits ``T(l)``, ``a, b, c``
and the memory constants (MaxLen) from these measurements.

Raw measurements are cached in ``$HGRAPH_CACHE/profile`` (default ``~/.cache/hgraph``) keyed by model
(factory name, sizes and parameter count), schemes, lengths, world size, ranks per node, device kind,
repeats, machine and torch version (``profile_key``); the table is rebuilt from them each time (so
``memory_gb`` can change without measuring again). ``hgraph.profiling.profile_job`` runs the same
measurement (``measure_on_rank``) on the ranks of a running job instead, under the same key.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from hgraph.compiler.entry import compile as compile_model
from hgraph.core.cache_entry import load_entry, store_entry
from hgraph.core.batch import local_micro_batches, micro_batch_align, pack_micro_batch
from hgraph.core.degrees import Degrees
from hgraph.core.model_info import decoder_blocks, embedding_of, model_dims
from hgraph.core.progress import progress
from hgraph.core.strategy import homogeneous
from hgraph.errors import CostModelError, StrategyError
from hgraph.models import load_factory
from hgraph.planner.cost import CostModel
from hgraph.planner.fit import Fit
from hgraph.planner.machine import machine
from hgraph.profiling.ranks_table import build_ranks_table, by_scheme
from hgraph.runtime.clock import DeviceClock, Mark
from hgraph.runtime.executor import run_iteration
from hgraph.runtime.kernels.process_group_comm import ProcessGroupComm
from hgraph.runtime.launch import launch
from hgraph.runtime.stage import shards_device

ModelFactory = Union[str, Callable[[], Any]]
DEFAULT_MEMORY_GB = 0.25  # MaxLen of a few thousand tokens for the demo-sized models
# Part of the cache key: change it whenever the measurement method changes.
_METHOD = "per-micro-batch F+B steps, lengths in one iteration, repeats outermost, v4"


@dataclass(frozen=True)
class Profile:
    """A profiled cost model with its fits, the measured points and how long profiling took."""

    cost_model: CostModel
    fits: dict[Degrees, Fit]
    times_ms: dict[Degrees, tuple[float, ...]]  # T(l) per scheme, in the order of ``lengths``
    lengths: tuple[int, ...]
    seconds: float
    cache_path: Path
    cached: bool

    def __str__(self) -> str:
        source = f"measured in {self.seconds:.1f} s"
        source += f", cached in {self.cache_path}" if self.cached else ""
        lines = [f"{self.cost_model.name}: {len(self.fits)} schemes, lengths {list(self.lengths)} ({source})"]
        noise = self.cost_model.extra.get("_fit", {})
        for scheme, fit in self.fits.items():
            spread = by_scheme(noise, scheme, {}).get("noise")
            extra = "" if spread is None else f", noise {spread:.1%}"
            lines.append(f"  {scheme!s:<10} {fit}  MaxLen {self.cost_model.max_len(scheme)}{extra}")
        return "\n".join(lines)


def parse_schemes(text: str) -> list[Degrees]:
    """Schemes (pipeline shapes) in the strategy syntax, ``;``-separated: ``"tp1; tp2; tp1,pp2"``. The
    older forms ``"tp1,tp2,tp1pp2"`` (compact) and ``"tp1,pp1 tp2,pp2"`` (spaces) are read too."""
    if ";" in text:
        schemes = [_scheme(part) for part in text.split(";") if part.strip()]
        if not schemes:
            raise CostModelError(f"--schemes {text!r} is empty; give e.g. 'tp1; tp2; tp1,pp2'")
        return list(dict.fromkeys(schemes))
    tokens = text.split()
    if len(tokens) == 1 and all(p.strip().startswith("tp") for p in tokens[0].split(",") if p.strip()):
        tokens = [p.strip() for p in tokens[0].split(",") if p.strip()]
    schemes = [_scheme(token) for token in tokens]
    if not schemes:
        raise CostModelError(f"--schemes {text!r} is empty; give e.g. 'tp1; tp2; tp1,pp2'")
    return list(dict.fromkeys(schemes))


def _scheme(text: str) -> Degrees:
    """One scheme to profile (``Degrees.parse``; the compact ``"tp2pp2"`` reads too)."""
    try:
        return Degrees.parse(",".join(p for p in _split_degrees(text) if p))
    except StrategyError as exc:
        raise CostModelError(f"cannot parse scheme {text!r}: {exc}") from None


def _split_degrees(token: str) -> list[str]:
    """``"tp2pp2"`` -> ``["tp2", "pp2"]``; other spellings pass through to ``Degrees.parse``."""
    out, current = [], ""
    for ch in token:
        if ch.isalpha() and current and current[-1].isdigit():
            out.append(current)
            current = ""
        current += ch
    return out + [current]


def factory_name(model_factory: ModelFactory) -> str:
    """``"module:factory"`` naming a factory (the cache key); it must be picklable for the ranks."""
    if isinstance(model_factory, str):
        return model_factory
    if not callable(model_factory):
        raise CostModelError(
            f"model factory {model_factory!r} is not callable; pass a function returning the model"
        )
    name = getattr(model_factory, "__qualname__", None)
    if name is None or "<" in name:
        try:
            pickle.dumps(model_factory)
        except Exception:  # noqa: BLE001 - any pickling failure means the same thing here
            name = None
        else:
            name = repr(model_factory)  # a picklable callable object, e.g. a frozen dataclass
    if name is None or "<lambda>" in name or "<locals>" in name:
        raise CostModelError(
            f"model factory {model_factory!r} cannot be sent to other processes; "
            "pass a module-level function, a picklable callable object or a 'package.module:factory' string"
        )
    return f"{getattr(model_factory, '__module__', '?')}:{name}"


def resolve_factory(model_factory: ModelFactory) -> Callable[[], Any]:
    return load_factory(model_factory) if isinstance(model_factory, str) else model_factory


# -- on every rank ---------------------------------------------------------------------------------


def measure_on_rank(
    factory: ModelFactory, schemes: list[tuple[int, ...]], lengths: list[int], repeats: int,
    on_repeat: Optional[Callable[[int, int], None]] = None,
) -> dict[str, Any]:
    """Runs on each rank of an initialised process group, on the rank's device (its GPU under NCCL):
    per scheme, the saved bytes of each length's micro-batch (warm-up) and, per repeat, the
    forward+backward milliseconds of each length's micro-batch on this rank's stage.
    ``on_repeat(done, repeats)`` is called after each timed round."""
    comm = ProcessGroupComm()
    rank = comm.rank
    torch.manual_seed(0)
    model = resolve_factory(factory)()
    vocab = embedding_of(model).num_embeddings
    start = time.perf_counter()
    schemes = [tuple(s) + (1,) * (4 - len(s)) for s in schemes]  # (tp, pp, cp, ep)
    strategies = [homogeneous(comm.world_size, tp=tp, pp=pp, cp=cp, ep=ep) for tp, pp, cp, ep in schemes]
    compiled = compile_model(model, strategies, example_inputs=torch.randint(0, vocab, (1, 16)))
    params = compiled.traced.params()
    shards = {
        fqn: layout.local_of(params[fqn].detach().to(torch.float32), rank).to(comm.device)
        for fqn, layout in compiled.optimizer_layouts.items()
    }
    buffers = {ph: compiled.traced.buffers()[fqn] for ph, fqn in compiled.traced.buffer_names.items()}
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab, (length,), generator=gen) for length in lengths]
    out: dict[str, Any] = {"saved_bytes": {}, "compute_ms": {}, "compile_s": time.perf_counter() - start}
    programs = {str(Degrees(tp, pp, cp, ep=ep)): compiled.program(i, rank)
                for i, (tp, pp, cp, ep) in enumerate(schemes)}
    inputs = {}
    for key, program in programs.items():  # this rank's micro-batches (its chunks under cp)
        inputs[key] = [_local_batch(program, rank, s, buffers, comm.device) for s in sequences]
    for key, program in programs.items():  # warm-up, counting saved bytes
        out["saved_bytes"][key] = saved_bytes(program, shards, inputs[key], comm)
        out["compute_ms"][key] = []
    # Repeats outermost: a burst of load from elsewhere on the machine hits every scheme alike.
    bar = progress(desc=f"profiling {len(programs)} schemes", total=repeats * len(programs), unit="run",
                   show=rank == 0)
    for repeat in range(repeats):
        order = list(range(len(lengths)))
        random.Random(repeat).shuffle(order)  # the same order on every rank
        for key, program in programs.items():
            ms = compute_ms(program, shards, [inputs[key][i] for i in order], comm)
            out["compute_ms"][key].append([ms[order.index(i)] for i in range(len(lengths))])
            bar.update()
        if on_repeat is not None:
            on_repeat(repeat + 1, repeats)
    bar.close()
    out["total_s"] = time.perf_counter() - start
    return out


def _local_batch(program: Any, rank: int, sequence: Any, buffers: dict, device: torch.device) -> dict:
    """One sequence as this rank's micro-batch on ``device``: under cp, its load-balanced chunks of the
    packed tokens (padded to ``2·cp``), as ``Trainer`` feeds them."""
    packed = pack_micro_batch([sequence], micro_batch_align(program.groups))
    return local_micro_batches([packed], program.groups, rank, buffers, device)[0]


def compute_ms(program: Any, shards: dict, batches: list, comm: Any) -> list[float]:
    """One iteration (``run_iteration``: the rank's action list, the one training runs, overlap
    included); the milliseconds of the F and B steps of each micro-batch on this rank, as the device
    ran them (``hgraph.runtime.clock``)."""
    clock = DeviceClock(shards_device(shards))
    steps: list[tuple[int, Mark, Mark]] = []
    begun: list[Mark] = []

    def on_step(when: str, action: Any) -> None:
        if action.kind.value in ("F", "B"):
            if when == "begin":
                begun[:] = [clock.mark()]
            else:
                steps.append((action.mb, begun[0], clock.mark()))

    run_iteration(program, shards, batches, 1.0 / sum(b["input_ids"].shape[-1] for b in batches), on_step,
                  comm=comm, clock=clock)
    ms = [0.0] * len(batches)
    for mb, start, end in steps:
        ms[mb] += clock.elapsed_ms(start, end)
    return ms


def saved_bytes(program: Any, shards: dict, batches: list, comm: Any) -> list[int]:
    """One iteration; per micro-batch, the bytes of the distinct storages autograd saves for backward
    in its forward step (kept per micro-batch: a storage freed by one micro-batch's backward may be
    reused by a later one, but not within one forward)."""
    seen: list[dict[int, int]] = [{} for _ in batches]
    current: list[Optional[int]] = [None]

    def on_step(when: str, action: Any) -> None:
        if action.kind.value == "F":
            current[0] = action.mb if when == "begin" else None

    def pack(t: Any) -> Any:
        if current[0] is not None:  # not what a backward step saves while it recomputes
            storage = t.untyped_storage()
            seen[current[0]][storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_iteration(program, shards, batches, 1.0, on_step, comm=comm)
    return [sum(s.values()) for s in seen]


# -- in the parent ---------------------------------------------------------------------------------


def cache_path(key: dict[str, Any]) -> Path:
    """Where the raw measurements of ``key`` (``profile_key``) are cached under ``$HGRAPH_CACHE``."""
    root = Path(os.environ.get("HGRAPH_CACHE", Path.home() / ".cache" / "hgraph"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "profile" / f"ranks-{digest}.json"


def load_cached(key: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The cached raw measurements of ``key``, or ``None``."""
    return load_entry(cache_path(key), "profile-ranks", key, ("per_rank", "seconds", *key))


def profile_key(
    model_factory: ModelFactory, world_size: int, schemes: Sequence[Degrees], lengths: Sequence[int],
    repeats: int, device: str = "cpu", ranks_per_node: Optional[int] = None,
) -> dict[str, Any]:
    """What a profile's measurements depend on, its cache key: the model (factory name, sizes,
    parameter count), schemes, lengths, repeats, world size, ranks per node (default: all on this
    one), device kind, this machine and the method; ``CostModelError`` when they cannot be profiled."""
    name = factory_name(model_factory)
    model = resolve_factory(model_factory)()
    _check(world_size, schemes, lengths, repeats, model)
    return {
        "model": name, **model_facts(model),
        "parameters": sum(p.numel() for p in model.parameters()), "world_size": world_size,
        "ranks_per_node": world_size if ranks_per_node is None else ranks_per_node, "device": device,
        "schemes": [str(s) for s in schemes], "lengths": list(lengths), "repeats": repeats,
        "torch": torch.__version__, "method": _METHOD, "machine": machine(),
    }


def model_facts(model: Any) -> dict[str, int]:
    embedding, blocks = embedding_of(model), decoder_blocks(model)
    return {
        "hidden": embedding.embedding_dim,
        "vocab": embedding.num_embeddings,
        "layers": len(blocks),
        "block_params": sum(p.numel() for p in blocks[0].parameters()),
    }


def _check(
    world_size: int, schemes: Sequence[Degrees], lengths: Sequence[int], repeats: int, model: Any
) -> None:
    if world_size < 1:
        raise CostModelError(f"world_size={world_size}; profiling needs at least 1 rank")
    if len(set(lengths)) < 3 or min(lengths) < 2:
        raise CostModelError(f"lengths {list(lengths)}: need at least 3 distinct lengths >= 2 to fit a, b, c")
    if repeats < 1:
        raise CostModelError(f"repeats={repeats}; need at least 1")
    for s in schemes:
        if world_size % s.size:
            raise CostModelError(
                f"scheme {s} needs {s.size} ranks per pipeline, which does not divide world size {world_size}"
            )
    dims = model_dims(model)
    for s in schemes:
        homogeneous(world_size, s.tp, s.pp, s.cp, s.ep).check(world_size, dims)
    short = [l for l in lengths if any(l < 2 * s.cp for s in schemes)]
    if short:
        raise CostModelError(f"lengths {short}: a cp scheme splits each sequence into 2·cp chunks; use longer lengths")


def measure_ranks(
    model_factory: ModelFactory, world_size: int, schemes: Sequence[Degrees], lengths: Sequence[int],
    repeats: int = 3, use_cache: bool = True, timeout: float = 600.0, measure: bool = True,
) -> tuple[dict[str, Any], Path, bool]:
    """Raw multi-rank measurements (from the cache when present): ``(raw, cache_path, cached)``;
    ``measure=False``: the cached ones only (``CostModelError`` when there are none)."""
    lengths = sorted(set(int(l) for l in lengths))
    key = profile_key(model_factory, world_size, schemes, lengths, repeats)
    path = cache_path(key)
    cached = load_cached(key) if use_cache else None
    if cached is not None:
        return cached, path, True
    if not measure:
        raise CostModelError(f"no profile of {key['model']} on {world_size} ranks of this machine is cached "
                             f"(looked for {path})")
    start = time.perf_counter()
    per_rank = launch(
        measure_on_rank, world_size,
        args=(model_factory, [(s.tp, s.pp, s.cp, s.ep) for s in schemes], lengths, repeats), timeout=timeout,
    )
    raw = {**key, "per_rank": per_rank, "seconds": time.perf_counter() - start}
    store_entry(path, "profile-ranks", key, raw)
    return raw, path, False


def profile_ranks(
    model_factory: ModelFactory,
    world_size: int,
    schemes: Sequence[Union[Degrees, str]],
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    memory_gb: float = DEFAULT_MEMORY_GB,
    use_cache: bool = True,
    name: str = "profiled",
    timeout: float = 600.0,
    measure: bool = True,
) -> Profile:
    """Measure ``schemes`` on ``world_size`` local ranks (or read the cache) and fit the cost model.

    ``model_factory``: a module-level callable returning the model, or ``"package.module:factory"``.
    """
    parsed = [s if isinstance(s, Degrees) else _scheme(s) for s in schemes]
    if not parsed:
        raise CostModelError("no schemes to profile; give e.g. ['tp1', 'tp2', 'tp1,pp2']")
    start = time.perf_counter()
    raw, path, cached = measure_ranks(model_factory, world_size, parsed, lengths, repeats, use_cache, timeout, measure)
    return fitted_profile(raw, memory_gb, name, path, None if cached else time.perf_counter() - start)


def fitted_profile(raw: dict[str, Any], memory_gb: float, name: str, path: Path, seconds: Optional[float]) -> Profile:
    """The ``Profile`` of raw measurements (``hgraph.profiling.ranks_table``); ``seconds``: how long
    measuring took, ``None`` for measurements read from the cache."""
    model, fits, times = build_ranks_table(raw, memory_gb, name)
    return Profile(model, fits, {s: tuple(t) for s, t in times.items()}, tuple(raw["lengths"]),
                   raw["seconds"] if seconds is None else seconds, path, seconds is None)

