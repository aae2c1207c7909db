"""bf16 precision benchmark (prints JSON): hgraph's ``compute_dtype=torch.bfloat16`` against
``torch.autocast(bfloat16)`` on the unmodified model, and which way of running it is faster.

(a) ``errors``: relative error of the q/k-projection gradients (all layers together) against the fp32
    gradients of the unmodified model, per sequence length (one document of 40 / 512 / 1024 / 2048
    tokens), for hgraph bf16 (``compile(compute_dtype=bf16)``, ``simulate`` on ``tp2``: thread ranks)
    and ``torch.autocast`` bf16 on the unmodified model, and their ratio (goal <= 1.5); also each
    one's |loss - fp32 loss|. Models: hgraph's ``Llama``, HF Llama, HF Gemma 2 (the issue's table is
    the first). Long sequences: ``--lengths 4096 8192 16384 --strategy cp2``.
(b) ``speed``: forward + backward of one rank's program (a hidden-256 ``Llama``, tp1, 2,048 tokens)
    with autocast's casts as graph nodes (what hgraph runs: parameters pulled in bf16, fp32 islands
    explicit) against the same fp32 program run under ``torch.autocast`` (fp32 parameters, casts made
    by the dispatcher), and the unmodified model under ``torch.autocast``; interleaved repetitions,
    medians of wall and of process CPU seconds (less disturbed by other load), ratios.

Run: ``python benchmarks/precision_bench.py [--lengths 40 512 1024 2048] [--strategy tp2] [--models ...]
[--repeats 15] [--speed-only | --errors-only] [--out f.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import hgraph
from hgraph.core.batch import next_token_targets
from hgraph.models import Llama, LlamaConfig, tiny_hf_llama
from hgraph.models.zoo import zoo_config

BF16 = torch.bfloat16


def hf_gemma2(longest: int) -> nn.Module:
    import transformers

    config = zoo_config("gemma2")
    config.max_position_embeddings = max(4096, longest)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# Each takes the longest sequence it must accept (its maximum position).
MODELS: dict[str, Callable[[int], nn.Module]] = {
    "hgraph Llama": lambda longest: Llama(LlamaConfig(layers=2, kv_heads=2, max_positions=max(4096, longest))),
    "HF Llama": lambda longest: tiny_hf_llama(max_position_embeddings=max(2048, longest)),
    "HF Gemma 2": hf_gemma2,
}


# Wider than the error models, so matmuls (not per-op overhead) dominate as they do at real sizes.
SPEED_MODEL = LlamaConfig(hidden=256, heads=8, kv_heads=2, ffn=688, layers=2)


def projection_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(("q_proj.weight", "k_proj.weight"))]


def unmodified_grads(model: nn.Module, ids: torch.Tensor, autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Token-mean next-token loss and its gradients, of the model as the user runs it."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.float().flatten(0, 1), next_token_targets(ids).flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return float(loss.detach()), grads


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], names: list[str]) -> float:
    diff = torch.cat([(got[n].float() - want[n]).flatten() for n in names])
    return float(diff.norm() / torch.cat([want[n].flatten() for n in names]).norm())


def errors(name: str, lengths: list[int], strategy: str = "tp2") -> dict[str, dict[str, float]]:
    """Per length: q/k-gradient relative errors (hgraph, autocast, ratio) and |loss - fp32 loss|."""
    model = MODELS[name](max(lengths))
    names = projection_names(model)
    example = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    ours = hgraph.compile(model, [strategy], example_inputs=example,
                          options=hgraph.CompileOptions(compute_dtype=BF16))
    out = {}
    for length in lengths:
        ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
        fp32_loss, fp32 = unmodified_grads(model, ids, autocast=False)
        hgraph_loss, hgraph_grads = ours.simulate(0, ids)
        autocast_loss, autocast_grads = unmodified_grads(model, ids, autocast=True)
        hgraph_error = relative_error(hgraph_grads, fp32, names)
        autocast_error = relative_error(autocast_grads, fp32, names)
        out[str(length)] = {"hgraph bf16": round(hgraph_error, 5), "torch.autocast bf16": round(autocast_error, 5),
                            "ratio": round(hgraph_error / autocast_error, 3),
                            "loss_difference": {"hgraph bf16": float(f"{abs(float(hgraph_loss) - fp32_loss):.2e}"),
                                                "torch.autocast bf16": float(f"{abs(autocast_loss - fp32_loss):.2e}")}}
    return out


def _program_step(compiled: Any, ids: torch.Tensor, param_dtype: torch.dtype | None, autocast: bool
                  ) -> Callable[[], None]:
    """One forward + backward of the tp1 rank program (no communication at tp1)."""
    gm = compiled.local_program(1, 1)
    traced = compiled.traced
    params = [p.detach().to(param_dtype or p.dtype).requires_grad_(True) for p in traced.params().values()]
    buffers = list(traced.buffers().values())
    positions = torch.arange(ids.shape[1])[None]
    args = [*params, *buffers, ids, positions, next_token_targets(ids)]

    def step() -> None:
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            loss = gm(*args)
        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
        loss.backward()
        for p in params:
            p.grad = None

    return step


def speed(length: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(SPEED_MODEL)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    example = ids[:, :16]
    explicit = hgraph.compile(model, ["tp1"], example_inputs=example,
                              options=hgraph.CompileOptions(compute_dtype=BF16))
    plain = hgraph.compile(model, ["tp1"], example_inputs=example)
    # The runtime-autocast alternative needs the attention op registered with autocast (the explicit
    # program casts its inputs itself).
    torch.library.register_autocast("hgraph::packed_attention", "cpu", BF16)
    eager_targets = next_token_targets(ids)

    def eager() -> None:
        with torch.autocast("cpu", dtype=BF16):
            logits = model(ids)
        F.cross_entropy(logits.float().flatten(0, 1), eager_targets.flatten(), ignore_index=-100).backward()
        model.zero_grad(set_to_none=True)

    runs = {
        "explicit casts (hgraph)": _program_step(explicit, ids, BF16, autocast=False),
        "fp32 program under torch.autocast": _program_step(plain, ids, None, autocast=True),
        "unmodified model under torch.autocast": eager,
    }
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm up
    for _ in range(repeats):
        for key, fn in runs.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[key].append(time.perf_counter() - start)
            cpu[key].append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"model": str(SPEED_MODEL), "tokens": length, "repeats": repeats}
    # CPU seconds of this process (one thread) are less disturbed by other load than wall seconds.
    for label, samples in (("median_seconds", wall), ("median_cpu_seconds", cpu)):
        medians = {k: statistics.median(v) for k, v in samples.items()}
        out[label] = {k: round(v, 4) for k, v in medians.items()}
        out[f"explicit_vs_runtime_autocast ({label})"] = round(
            medians["explicit casts (hgraph)"] / medians["fp32 program under torch.autocast"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 512, 1024, 2048])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--strategy", default="tp2", help="hgraph's strategy in (a); cp2 for long sequences")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--speed-only", action="store_true", help="skip (a)")
    parser.add_argument("--errors-only", action="store_true", help="skip (b)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"benchmark": "precision", "torch": torch.__version__,
                              "metric": "relative error of q/k-projection gradients vs fp32 (unmodified model)",
                              "strategy": args.strategy,
                              "errors": {} if args.speed_only else {name: errors(name, args.lengths, args.strategy)
                                                                    for name in args.models}}
    if not args.errors_only:
        result["speed"] = speed(max(args.lengths), args.repeats)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
