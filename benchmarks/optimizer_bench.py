"""Time of one ``ShardedAdamW.apply``: the foreach implementation vs the per-parameter loop it replaced.

    python benchmarks/optimizer_bench.py [--repeats 5] [--steps 5]

Shards are the whole parameters of an ``hgraph.models.Llama`` (``tiny``: the default config;
``small``: hidden 256, 4 layers, vocab 4096), gradients random. Old and new run interleaved
(old, new, old, new, ...) ``repeats`` times, each the median of ``steps`` applies, so the machine's
load drifts over both alike. Prints JSON: per model the medians in ms, ``ratio`` = old / new (median
of the per-repeat ratios) with its min and max, and whether both left bitwise equal shards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.optimizer import ShardedAdamW

CONFIGS = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(vocab_size=4096, hidden=256, layers=4, heads=8, kv_heads=4, ffn=688),
}


@torch.no_grad()
def loop_apply(opt: ShardedAdamW, grads: dict, scale: float = 1.0) -> None:
    """The per-parameter AdamW loop that ``apply`` used before the foreach version (the baseline)."""
    group = opt.param_groups[0]
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    for name, p in zip(opt.names, group["params"]):
        g = grads.get(name)
        if g is None:
            continue
        g = g.to(torch.float32)
        if scale != 1.0:
            g = g * scale
        state = opt.state[p]
        state["step"] += 1
        step = state["step"]
        p.mul_(1 - lr * wd)
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt().div_((1 - beta2**step) ** 0.5).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def _median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(config: LlamaConfig, repeats: int, steps: int) -> dict:
    torch.manual_seed(0)
    shards = {n: p.detach() for n, p in Llama(config).named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in shards.items()}
    old, new = ShardedAdamW(shards, lr=1e-3), ShardedAdamW(shards, lr=1e-3)
    old_ms, new_ms = [], []
    for _ in range(repeats):
        old_ms.append(_median_ms(lambda: loop_apply(old, grads, 0.5), steps))
        new_ms.append(_median_ms(lambda: new.apply(grads, 0.5), steps))
    ratios = [a / b for a, b in zip(old_ms, new_ms)]
    return {
        "parameters": sum(p.numel() for p in shards.values()),
        "tensors": len(shards),
        "old_ms": round(statistics.median(old_ms), 3),
        "new_ms": round(statistics.median(new_ms), 3),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "bitwise_equal": all(torch.equal(old.shards[n], new.shards[n]) for n in shards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    result = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "steps": args.steps,
        "models": {m: bench(CONFIGS[m], args.repeats, args.steps) for m in args.models},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
