"""``hgraph profile``: measure ``T(l)`` of a model on this machine, fit ``a, b, c``, write a cost table.

Measurement (one process, scheme tp1): for each length ``l`` one sequence of ``l`` tokens runs forward
and backward (cross-entropy on random targets) ``--repeats`` times after a warm-up; the median is
``T_tp1,pp1(l)``. For ``pp > 1`` the first decoder block is timed alone on the activations it sees in
the full model, and the stage time is approximated as ``ceil(L/pp) * T_block(l) + T_rest(l)`` where
``T_rest = T_model - L * T_block`` is the embedding, final norm, LM head and loss (on the slowest,
last stage); inter-stage sends are not included.

Multi-rank (``--world-size N``, and ``profile_cost_model`` for Python callers such as the demo): every
scheme, tensor-parallel ones included, is measured on N real local gloo ranks through the compiled
runtime; see ``hgraph.profiling.profile_ranks`` for what ``T(l)`` and ``A_tp`` mean there.

Memory: MaxLen constants come from the model itself: ``B`` from the parameters of one block,
``A_tp1`` from the bytes the block saves for backward (counted with ``saved_tensors_hooks``),
``gpu_memory_bound`` from ``--memory-gb`` or the device (CUDA total memory, or physical RAM on CPU).

Measurements are cached under ``$HGRAPH_CACHE`` (default ``~/.cache/hgraph``), keyed by model, lengths,
device, dtype and repeats; ``--no-cache`` measures again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


from hgraph.errors import CostModelError
from hgraph.core.model_info import decoder_blocks, embedding_of
from hgraph.models import load_factory
from hgraph.core.degrees import Degrees
from hgraph.planner.cost import CostModel
from hgraph.planner.fit import Fit as Fit
from hgraph.planner.fit import fit_stage_cost as fit_stage_cost
from hgraph.planner.machine import machine as machine
from hgraph.planner.memory import MemoryRegression

DEFAULT_MODEL = "hgraph.profiling.profile:default_model"
DEFAULT_LENGTHS = (64, 128, 256, 512, 768, 1024)
DEFAULT_RANK_LENGTHS = (64, 128, 256, 512)  # --world-size: several schemes on shared cores, keep it short


def default_model() -> Any:
    """The small Llama-style model profiled when ``--model`` is not given (~1M parameters)."""
    from hgraph.models import Llama, LlamaConfig

    return Llama(
        LlamaConfig(vocab_size=1024, hidden=128, layers=4, heads=4, kv_heads=4, ffn=352, max_positions=8192)
    )


# -- measuring -------------------------------------------------------------------------------------


class _Profiler:
    """Times one model's forward+backward and its first block's, and counts the block's saved bytes."""

    def __init__(self, model: Any, device: str, dtype: Any, repeats: int) -> None:
        import torch

        self.torch = torch
        self.model = model.to(device=device, dtype=dtype)
        self.device, self.repeats = device, repeats
        self.blocks = decoder_blocks(self.model)
        embedding = embedding_of(self.model)
        self.vocab, self.hidden = embedding.num_embeddings, embedding.embedding_dim
        self._captured: tuple[tuple, dict] | None = None

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def _median_ms(self, step: Callable[[], None]) -> float:
        step()  # warm-up
        times = []
        for _ in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            step()
            self._sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def model_ms(self, length: int) -> float:
        """Median forward+backward time of the whole model on one sequence; captures block inputs."""
        torch = self.torch
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, self.vocab, (1, length), generator=gen).to(self.device)
        targets = torch.randint(0, self.vocab, (1, length), generator=gen).to(self.device)

        def capture(_module: Any, args: tuple, kwargs: dict) -> None:
            self._captured = (
                tuple(a.detach() if torch.is_tensor(a) else a for a in args),
                {k: v.detach() if torch.is_tensor(v) else v for k, v in kwargs.items()},
            )

        handle = self.blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:

            def step() -> None:
                self.model.zero_grad(set_to_none=True)
                out = self.model(ids)
                logits = out.logits if hasattr(out, "logits") else out
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
                loss.backward()

            return self._median_ms(step)
        finally:
            handle.remove()

    def _block_step(self) -> tuple[Callable[[], Any], Any]:
        torch = self.torch
        assert self._captured is not None, "run model_ms first"
        args, kwargs = self._captured
        hidden = args[0].clone().requires_grad_(True)
        block = self.blocks[0]

        def forward() -> Any:
            out = block(hidden, *args[1:], **kwargs)
            return out[0] if isinstance(out, tuple) else out

        def step() -> None:
            block.zero_grad(set_to_none=True)
            out = forward()
            out.backward(torch.ones_like(out))

        return step, forward

    def block_ms(self) -> float:
        """Median forward+backward time of the first block on the captured input."""
        step, _ = self._block_step()
        return self._median_ms(step)

    def block_saved_bytes(self) -> int:
        """Bytes of distinct tensors the first block saves for backward (activation memory)."""
        torch = self.torch
        _, forward = self._block_step()
        params = {p.data_ptr() for p in self.blocks[0].parameters()}
        seen: dict[int, int] = {}

        def pack(t: Any) -> Any:
            if t.data_ptr() not in params:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
        return sum(seen.values())


def measure(
    model_spec: str, lengths: Sequence[int], device: str, dtype_name: str, repeats: int
) -> dict[str, Any]:
    """Raw measurements: per length the model and block times, plus the model's memory facts."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    model = load_factory(model_spec)()
    profiler = _Profiler(model, device, dtype, repeats)
    profiler.model_ms(min(lengths))  # warm up allocator and kernels before anything is kept
    model_ms, block_ms = [], []
    saved = 0
    for length in lengths:
        model_ms.append(profiler.model_ms(length))
        block_ms.append(profiler.block_ms())
        if length == max(lengths):
            saved = profiler.block_saved_bytes()
    block_params = sum(p.numel() for p in profiler.blocks[0].parameters())
    if device.startswith("cuda"):
        memory = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "lengths": list(lengths),
        "model_ms": model_ms,
        "block_ms": block_ms,
        "layers": len(profiler.blocks),
        "hidden": profiler.hidden,
        "vocab": profiler.vocab,
        "block_params": block_params,
        "block_saved_bytes_per_token": saved / max(lengths),
        "device_memory": memory,
        "device": device,
        "dtype": dtype_name,
    }


def build_table(raw: dict[str, Any], pps: Sequence[int], name: str) -> tuple[CostModel, dict[Degrees, Fit]]:
    """Fit every ``tp1,ppN`` scheme from raw measurements and assemble the cost model."""
    lengths = raw["lengths"]
    layers, hidden = raw["layers"], raw["hidden"]
    fits: dict[Degrees, Fit] = {}
    for pp in pps:
        if pp > layers:
            raise CostModelError(f"pp={pp} exceeds the model's {layers} layers")
        times = (
            [
                math.ceil(layers / pp) * block + max(0.0, whole - layers * block)
                for whole, block in zip(raw["model_ms"], raw["block_ms"])
            ]
            if pp > 1
            else list(raw["model_ms"])
        )
        fits[Degrees(1, pp)] = fit_stage_cost(lengths, times)
    memory = MemoryRegression(
        activation=((1, raw["block_saved_bytes_per_token"] / hidden),),
        bytes_per_layer_h2=16.0 * raw["block_params"] / hidden**2,
        alpha=0.75,
        gap=(("node", 0.0),),
        safe_bound=0.1 * raw["device_memory"],
        gpu_memory=float(raw["device_memory"]),
        hidden=hidden,
        layers=layers,
        vocab=raw["vocab"],
    )
    about = (
        f"Profiled by hgraph profile on {raw['device']} ({raw['dtype']}), lengths {lengths}; "
        "pp>1 from per-block times (see hgraph.profiling.profile)."
    )
    model = CostModel(
        name, {s: f.cost for s, f in fits.items()}, memory, gpus_per_node=1, extra={"_about": about}
    )
    return model, fits


def profile_cost_model(
    model_factory: str | Callable[[], Any],
    world_size: int,
    schemes: Sequence[Degrees | str],
    lengths: Sequence[int],
    **options: Any,
) -> CostModel:
    """The cost model measured on ``world_size`` local gloo ranks (what the demo plans with).

    Arguments and options as ``hgraph.profiling.profile_ranks.profile_ranks`` (``repeats``,
    ``memory_gb``, ``use_cache``, ``name``, ``timeout``, ``measure``), which also returns the fits and
    timings.
    """
    from hgraph.profiling.profile_ranks import profile_ranks

    return profile_ranks(model_factory, world_size, schemes, lengths, **options).cost_model


# -- command line ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="module:factory returning an nn.Module "
        "(forward(input_ids) -> logits); default: a small built-in Llama",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help=f"comma-separated sequence lengths to time (default {','.join(map(str, DEFAULT_LENGTHS))}; "
        f"{','.join(map(str, DEFAULT_RANK_LENGTHS))} with --world-size)",
    )
    parser.add_argument(
        "--schemes",
        default="tp1; tp1,pp2",
        help="';'-separated schemes (pipeline shapes) to measure, e.g. 'tp1; tp2; tp1,pp2' (default: %(default)s); "
        "tp > 1 needs --world-size",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="measure every scheme on this many local gloo ranks (CPU, float32); "
        "default: tp1 schemes in this process",
    )
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="device memory for MaxLen (default: the device's; 0.25 with --world-size)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the ranks are stopped")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--repeats", type=int, default=None,
        help="timed runs per length, median (default 5; 3 with --world-size)",
    )
    parser.add_argument(
        "--strategies", default=None,
        help="';'-separated strategies (e.g. '4x tp1; tp2 + 2x tp1'): also measure their iteration terms "
        "(Pull/Push with and without overlap, activation sends, optimizer, fixed cost) through the runtime; "
        "needs --world-size",
    )
    parser.add_argument("--out", default=None, help="write the cost table (JSON) here")
    parser.add_argument("--name", default="profiled", help="cost model name")
    parser.add_argument("--no-cache", action="store_true", help="measure again even if cached")


def _parse_schemes(text: str) -> list[int]:
    from hgraph.profiling.profile_ranks import parse_schemes

    pps = []
    for scheme in parse_schemes(text):
        if scheme.tp > 1 or scheme.cp > 1:
            raise CostModelError(
                f"scheme {scheme}: profiling tp>1 or cp>1 needs one process per rank; "
                "add --world-size N to measure it on N local gloo ranks"
            )
        pps.append(scheme.pp)
    return sorted(set(pps))


def _cache_path(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("HGRAPH_CACHE", Path.home() / ".cache" / "hgraph"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "profile" / f"{digest}.json"


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None:
        return _run_ranks(args)
    if args.strategies:
        raise CostModelError("--strategies measures iteration terms on local ranks; add --world-size N")
    import torch

    args.lengths = args.lengths or ",".join(map(str, DEFAULT_LENGTHS))

    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        raise CostModelError(
            f"--lengths {args.lengths!r}: give comma-separated integers, e.g. 64,128,256"
        ) from None
    if len(lengths) < 3 or lengths[0] < 1:
        raise CostModelError(f"--lengths {args.lengths!r}: need at least 3 distinct positive lengths")
    repeats = 5 if args.repeats is None else args.repeats
    if repeats < 1:
        raise CostModelError(f"--repeats {repeats}: need at least 1")
    pps = _parse_schemes(args.schemes)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    key = {
        "model": args.model,
        "lengths": lengths,
        "device": device,
        "dtype": dtype,
        "repeats": repeats,
        "torch": torch.__version__,
    }
    cache = _cache_path(key)
    if cache.exists() and not args.no_cache:
        raw = json.loads(cache.read_text())
        print(f"using cached measurements {cache}")
    else:
        start = time.perf_counter()
        raw = measure(args.model, lengths, device, dtype, repeats)
        print(f"measured {len(lengths)} lengths on {device} in {time.perf_counter() - start:.1f} s")
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(raw))
    if args.memory_gb is not None:
        raw = {**raw, "device_memory": args.memory_gb * 1e9}
    model, fits = build_table(raw, pps, args.name)
    for scheme, fit in fits.items():
        print(f"{scheme}: {fit}  MaxLen {model.max_len(scheme)}")
    if args.out:
        model.save(args.out)
        print(f"wrote {args.out}")
    return 0


def _run_ranks(args: argparse.Namespace) -> int:
    """``--world-size N``: every scheme on N local gloo ranks (``hgraph.profiling.profile_ranks``)."""
    from hgraph.profiling.profile_ranks import DEFAULT_MEMORY_GB, parse_schemes, profile_ranks

    given = [f"--{k} {v}" for k, v, ok in (("device", args.device, "cpu"), ("dtype", args.dtype, "float32"))
             if v not in (None, ok)]
    if given:
        raise CostModelError(
            f"--world-size profiles local gloo ranks on cpu in float32; drop {' '.join(given)}"
        )
    args.lengths = args.lengths or ",".join(map(str, DEFAULT_RANK_LENGTHS))
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise CostModelError(
            f"--lengths {args.lengths!r}: give comma-separated integers, e.g. 64,128,256"
        ) from None
    profile = profile_ranks(
        args.model, args.world_size, parse_schemes(args.schemes), lengths,
        repeats=3 if args.repeats is None else args.repeats,
        memory_gb=DEFAULT_MEMORY_GB if args.memory_gb is None else args.memory_gb,
        use_cache=not args.no_cache, name=args.name, timeout=args.timeout,
    )
    print(profile)
    cost_model = profile.cost_model
    if args.strategies:
        from hgraph.profiling.profile_iteration import profile_iteration
        from hgraph.planner.terms import with_terms

        strategies = [s.strip() for s in args.strategies.split(";") if s.strip()]
        found = profile_iteration(args.model, args.world_size, strategies, cost_model, lengths,
                                  repeats=3 if args.repeats is None else args.repeats,
                                  use_cache=not args.no_cache, timeout=args.timeout)
        print(found)
        cost_model = with_terms(cost_model, found.terms)
    if args.out:
        cost_model.save(args.out)
        print(f"wrote {args.out}")
    return 0
