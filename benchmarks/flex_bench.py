"""FlexAttention eager vs compiled (prints JSON): the price of compiling against the time it saves.

``hgraph.runtime.kernels.attention_kernels.flex`` (block mask + attention, as packed attention runs it)
forward on packed documents of Wikipedia lengths (the bundled sample, cut to fit) at several packed
lengths, 8 query / 2 key-value heads of 64, fp32 on CPU (bf16 on CUDA), in both modes
(``HGRAPH_FLEX_COMPILE=0`` eager, ``=1`` compiled through ``attention_kernels.CompiledFlex``):

* ``first_call_s``: the first call at each length (compiled: dynamo + inductor; the first length
  compiles, later ones may recompile for a new dynamic shape);
* ``step_ms``: the median of ``--repeats`` later calls, eager and compiled interleaved in every
  repeat, with the ratio eager/compiled per repeat (median, min, max);
* ``break_even_calls``: compile seconds over the time one compiled call saves;
* ``peak_rss_mb`` (CPU) / ``peak_bytes`` (CUDA): the memory one call adds at its peak (eager writes
  out the score matrix and a dense mask).

Forward only: FlexAttention has no backward on CPU in torch 2.13 (compiled or not). Times are
``hgraph.runtime.clock`` marks (CUDA events on CUDA). Run:
``python benchmarks/flex_bench.py [--lengths 1024 2048 4096] [--repeats 5] [--modes eager compiled]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

from hgraph.planner.batches import read_lengths, sample_path
from hgraph.runtime.clock import DeviceClock
from hgraph.runtime.kernels import attention_kernels as kernels
from hgraph.runtime.metrics import peak_memory_bytes, reset_peak_memory

MODES = {"eager": "0", "compiled": "1"}


def packed_documents(tokens: int) -> list[int]:
    """Document lengths (Wikipedia sample, in file order) filling ``tokens`` tokens."""
    lengths = read_lengths(sample_path())
    out: list[int] = []
    for n in lengths:
        n = min(n, tokens - sum(out))
        if n <= 0:
            break
        out.append(n)
    return out


def _inputs(tokens: int, device: torch.device, dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(tokens)
    q, k, v = (torch.randn(1, h, tokens, 64, generator=gen).to(device, dtype) for h in (8, 2, 2))
    positions = torch.cat([torch.arange(n) for n in packed_documents(tokens)])[None].to(device)
    return q, k, v, positions, torch.arange(tokens, device=device)


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _call(mode: str, inputs: tuple, clock: DeviceClock) -> float:
    os.environ[kernels.FLEX_COMPILE_ENV] = MODES[mode]
    with torch.no_grad():
        start = clock.mark()
        kernels.flex(*inputs, None, True)
        return clock.elapsed_ms(start, clock.mark())


def _peak(mode: str, inputs: tuple, clock: DeviceClock, device: torch.device) -> dict[str, float]:
    """The memory one call adds at its peak, above what was held before it."""
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_bytes()
    _call(mode, inputs, clock)
    added = peak_memory_bytes(device) - before
    return {"peak_bytes": int(added)} if device.type == "cuda" else {"peak_rss_mb": round(added / 2**20, 1)}


def run(lengths: list[int], repeats: int, modes: list[str], device: torch.device) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    clock = DeviceClock(device)
    out: dict[str, Any] = {"benchmark": "flex", "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "repeats": repeats, "lengths": {}}
    for tokens in lengths:
        inputs = _inputs(tokens, device, dtype)
        row: dict[str, Any] = {"documents": len(packed_documents(tokens)), "first_call_s": {}, "step_ms": {}}
        for mode in modes:
            row["first_call_s"][mode] = round(_call(mode, inputs, clock) / 1e3, 3)
        samples: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(repeats):
            for mode in modes:  # interleaved: a burst of load from elsewhere hits both modes alike
                samples[mode].append(_call(mode, inputs, clock))
        row["step_ms"] = {mode: round(statistics.median(s), 3) for mode, s in samples.items()}
        if set(modes) == set(MODES):
            ratios = [e / c for e, c in zip(samples["eager"], samples["compiled"])]
            row["eager_over_compiled"] = {"median": round(statistics.median(ratios), 2),
                                          "min": round(min(ratios), 2), "max": round(max(ratios), 2)}
            saved_ms = row["step_ms"]["eager"] - row["step_ms"]["compiled"]
            compile_s = row["first_call_s"]["compiled"] - row["step_ms"]["compiled"] / 1e3
            row["break_even_calls"] = round(compile_s * 1e3 / saved_ms) if saved_ms > 0 else None
        row["memory"] = {mode: _peak(mode, inputs, clock, device) for mode in modes}
        out["lengths"][str(tokens)] = row
    os.environ.pop(kernels.FLEX_COMPILE_ENV, None)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["eager", "compiled"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    result = run(args.lengths, args.repeats, args.modes, torch.device(args.device))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
