"""``hgraph profile``: measure ``T(l)`` of a model on this machine, fit ``a, b, c``, write a cost table.

What is measured and how: ``hgraph.profiling.profile`` (in this process: ``profile_single``; with
``--world-size N`` on N local gloo ranks: ``profile_ranks``, and ``profile_iteration`` for
``--strategies``). Progress bars on stderr while measuring (``hgraph.core.progress``); the fits and
the path written on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from hgraph.core.cache_entry import load_entry, store_entry
from hgraph.errors import CostModelError
from hgraph.planner.terms import with_terms
from hgraph.profiling.profile import DEFAULT_LENGTHS, DEFAULT_MODEL, DEFAULT_RANK_LENGTHS
from hgraph.profiling.profile_iteration import profile_iteration
from hgraph.profiling.profile_ranks import DEFAULT_MEMORY_GB, parse_schemes, profile_ranks
from hgraph.profiling.profile_single import build_table, measure


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
    pps = []
    for scheme in parse_schemes(text):
        if scheme.tp > 1 or scheme.cp > 1:
            raise CostModelError(
                f"scheme {scheme}: profiling tp>1 or cp>1 needs one process per rank; "
                "add --world-size N to measure it on N local gloo ranks"
            )
        pps.append(scheme.pp)
    return sorted(set(pps))


_SINGLE_FIELDS = ("lengths", "layers", "hidden", "model_ms", "block_params", "block_saved_bytes_per_token", "device_memory", "vocab", "device", "dtype")  # what build_table reads


def _cache_path(key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("HGRAPH_CACHE", Path.home() / ".cache" / "hgraph"))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return root / "profile" / f"{digest}.json"


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--memory-gb", args.memory_gb), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CostModelError(f"{flag} {value}: expected a finite number > 0")
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
    raw = None if args.no_cache else load_entry(cache, "profile", key, _SINGLE_FIELDS)
    if raw is not None:
        print(f"using cached measurements {cache}")
    else:
        start = time.perf_counter()
        raw = measure(args.model, lengths, device, dtype, repeats)
        print(f"measured {len(lengths)} lengths on {device} in {time.perf_counter() - start:.1f} s")
        store_entry(cache, "profile", key, raw)
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
