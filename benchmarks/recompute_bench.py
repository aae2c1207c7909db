"""Activation recomputation benchmark (prints JSON): peak memory and time of one training step per mode.

One forward + backward of a 4-layer Llama (hidden 64, ffn 256, vocab 256) on one 16K-token sequence,
compiled for one rank (``tp1``) with ``recompute="none" | "selective" | "full"``. Each mode runs in a
fresh process (``--child MODE``), so the peak resident set size (``ru_maxrss``) of the step is that mode's
alone (large blocks are mmapped, ``MALLOC_MMAP_THRESHOLD_``, so freed memory leaves the resident set); ``step_peak_mb`` is that peak minus the resident size just before the step (tracemalloc does not
see torch's allocations). The memory model (``MemoryRegression.token_bytes``) predicts the layers'
activations per mode from one constant, ``A`` (bytes per token per hidden unit per layer), which is
measured independently here: the bytes autograd saves inside each layer of the *unmodified* model
(saved-tensor hooks, storages counted once). What the step needs besides the layers (logits, loss,
backward temporaries) is the same in every mode, so the check is on differences:
``saved_vs_none_mb`` (measured, none minus mode) against ``predicted_saved_vs_none_mb``.
``grads_equal_none`` compares every mode's gradient norms with ``none``'s.

Run: ``OMP_NUM_THREADS=1 python benchmarks/recompute_bench.py [--tokens 16384]`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODES = ("none", "selective", "full")


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measured_activation_constant(tokens: int, layers: int) -> float:
    """``A``: bytes autograd saves per token per hidden unit per layer in the unmodified model."""
    import torch

    from hgraph.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=layers, hidden=64, heads=4, kv_heads=4, ffn=256, max_positions=tokens))
    inside: list[int] = []
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def enter(*_):
        inside.append(1)

    def leave(*_):
        inside.pop()

    for block in model.layers:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)

    def pack(t):
        storage = t.untyped_storage()
        if inside and storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 256, (1, tokens)))
    return sum(storages.values()) / (tokens * 64 * layers)


def child(mode: str, tokens: int, layers: int) -> dict:
    import torch

    import hgraph
    from hgraph.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=layers, hidden=64, heads=4, kv_heads=4, ffn=256, max_positions=tokens))
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 256, (1, 16)),
                              options=hgraph.CompileOptions(recompute=hgraph.RecomputeConfig.of(mode)))
    ids = torch.randint(0, 256, (1, tokens))
    before = _rss_mb()
    start = time.perf_counter()
    loss, grads = compiled.simulate(0, ids)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    checksum = {n: float(g.double().norm()) for n, g in grads.items()}
    return {"mode": mode, "step_peak_mb": round(peak - before, 1), "rss_before_mb": round(before, 1),
            "seconds": round(seconds, 2), "loss": float(loss), "grad_norms": checksum}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.layers)))
        return
    runs = {}
    # Large blocks through mmap, so freed activations leave the resident set at once; glibc's heap
    # otherwise keeps fragments of recomputed layers resident and the peak overstates live memory.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), MALLOC_MMAP_THRESHOLD_="65536")
    for mode in MODES:
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens), "--layers", str(args.layers)],
            check=True, capture_output=True, text=True, env=env,
        ).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    base = runs["none"]
    from hgraph.planner.memory import MemoryRegression

    constant = measured_activation_constant(1024, args.layers)
    model = MemoryRegression(activation=((1, constant),), bytes_per_layer_h2=0.0, alpha=0.0, gap=(("node", 0.0),),
                             safe_bound=0.0, gpu_memory=1.0, hidden=64, layers=args.layers, vocab=256, itemsize=4)
    predicted = {m: model.token_bytes(1, recompute=m) * args.tokens / 2**20 for m in MODES}
    result = {
        "benchmark": "recompute",
        "model": f"Llama hidden 64, ffn 256, {args.layers} layers, fp32, tp1",
        "tokens": args.tokens,
        "activation_constant_A": round(constant, 2),
        "modes": {},
    }
    for mode, run in runs.items():
        equal = all(abs(run["grad_norms"][n] - v) <= 1e-5 * max(1.0, abs(v)) for n, v in base["grad_norms"].items())
        result["modes"][mode] = {
            "step_peak_mb": run["step_peak_mb"],
            "predicted_activation_mb": round(predicted[mode], 1),
            "saved_vs_none_mb": round(base["step_peak_mb"] - run["step_peak_mb"], 1),
            "predicted_saved_vs_none_mb": round(predicted["none"] - predicted[mode], 1),
            "seconds": run["seconds"],
            "time_vs_none": round(run["seconds"] / base["seconds"], 2),
            "peak_vs_none": round(run["step_peak_mb"] / base["step_peak_mb"], 3) if base["step_peak_mb"] else None,
            "loss": run["loss"],
            "grads_equal_none": equal,
        }
    result["full_below_none"] = runs["full"]["step_peak_mb"] < base["step_peak_mb"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
