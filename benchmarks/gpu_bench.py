"""GPU benchmark (prints JSON): hgraph at world size 1 against a hand-written PyTorch loop, and the
memory model against measured peaks. One script, at most ~5 minutes on one GPU.

(a) ``throughput``: the same HF Llama (TinyLlama-1.1B shapes: hidden 2048, 22 layers, 32/4 heads, ffn
    5632, vocab 32000, random weights), the same packed micro-batches of Wikipedia document lengths
    (``/work/shared/data/wikipedia_lengths.txt`` if present, else the bundled sample), bf16 compute with
    fp32 AdamW state, varlen attention in both: hgraph (``compile(compute_dtype=bf16)``, ``Trainer``)
    vs a loop over ``torch.autocast`` + ``varlen_attn`` registered as the HF attention function +
    ``torch.optim.AdamW``. Reports tokens/s ratio (goal >= 0.95) and peak-memory ratio (goal <= 1.05).
(b) ``memory_model``: one step on one long sequence per recompute mode (an 8-layer model of the same
    width); measured activation peak (peak minus the memory before the step) against
    ``MemoryRegression.token_bytes``, whose constant ``A`` is fitted on ``none`` at two shorter lengths.
(c) ``max_len``: the longest single sequence (doubling from 8K) that trains per mode against the
    predicted MaxLen (free memory after the model states / predicted bytes per token).
(d) ``attention_variants``: ``hgraph.packed_attention`` in bf16 on packed documents for every attention
    variant (causal, sliding window, soft-cap, both), forward and backward, with the kernel the dispatch
    picks (varlen for windows, flex for soft-caps) against dense fp32 attention per document written out
    here; reports the kernel, the largest errors and pass/fail.
(e) ``prediction``: the planner's ``predicted_ms`` against the Trainer's ``measured_ms`` per step, with
    ``T(l)`` profiled on this device as ``hgraph profile`` does; every time in this script is a mark
    of ``hgraph.runtime.clock`` (CUDA events on CUDA: the work, not its launch).
(f) ``flex_cp_memory``: one FlexAttention of a cp=2 rank on a 16K-token document (8K local queries
    against 16K keys), forward and backward, eager and compiled: the memory it adds and its time.

Without CUDA it runs a smoke version on CPU in about a minute (tiny HF Llama, per-sequence SDPA in
both loops, throughput; (d) on short documents with the SDPA kernel; (e) on the tiny model; (f) eager
and forward only at 1K tokens) and lists what it skipped. ``--smoke`` forces that mode.

Run: ``python benchmarks/gpu_bench.py [--smoke] [--out result.json]``. On a GPU machine whose python3
has CUDA torch and transformers but no hgraph and no network: ``sh benchmarks/run_gpu_bench.sh [DIR]``
(installs this checkout without dependencies into a temporary folder, writes DIR/gpu_bench.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import hgraph
from hgraph.models import tiny_hf_llama
from hgraph.planner.assign import Planner
from hgraph.planner.batches import read_lengths, sample_path
from hgraph.planner.memory import MemoryRegression
from hgraph.profiling.profile_single import build_table, measure
from hgraph.runtime.kernels import attention_kernels
from hgraph.runtime.kernels.packed_attention import packed_attention
from hgraph.runtime.kernels.thread_comm import ThreadComm, ThreadWorld
from hgraph.runtime.clock import DeviceClock
from hgraph.runtime.metrics import peak_memory_bytes, reset_peak_memory
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig, RunConfig

SHARED_LENGTHS = Path("/work/shared/data/wikipedia_lengths.txt")
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
           num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=262144)
SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
OPT = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def lengths_source() -> tuple[list[int], str]:
    path = SHARED_LENGTHS if SHARED_LENGTHS.exists() else sample_path()
    return read_lengths(path), str(path)


def packed_batches(lengths: list[int], steps: int, tokens: int, longest: int, vocab: int) -> list[list[torch.Tensor]]:
    """``steps`` batches of about ``tokens`` tokens: document lengths (seeded shuffle) cut to ``longest``."""
    rng = random.Random(0)
    order = lengths[:]
    rng.shuffle(order)
    gen = torch.Generator().manual_seed(0)
    batches, i = [], 0
    for _ in range(steps):
        batch, total = [], 0
        while total < tokens:
            n = max(2, min(order[i % len(order)], longest, tokens - total + 1))
            i += 1
            batch.append(torch.randint(0, vocab, (n,), generator=gen))
            total += n
        batches.append(batch)
    return batches


# ----------------------------------------------------------------------------- the hand-written loop
_POSITIONS: dict[str, torch.Tensor] = {}


def _hand_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any):
    """HF attention function: packed causal attention from the current micro-batch's position ids
    (varlen on CUDA, else one SDPA per sequence); returns ``[b, s, h, d]``."""
    positions = _POSITIONS["current"]
    if query.is_cuda:
        out = attention_kernels.varlen(query, key, value, positions, scaling, True)
    else:
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [positions.shape[1]]
        out = torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                        is_causal=True, scale=scaling, enable_gqa=True)
                         for a, b in zip(starts[:-1], starts[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _pack(batch: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """First-fit-decreasing into micro-batches of at most ``budget`` tokens (the Trainer's rule)."""
    bins: list[tuple[int, list[torch.Tensor]]] = []
    for seq in sorted(batch, key=len, reverse=True):
        for k, (used, items) in enumerate(bins):
            if used + len(seq) <= budget:
                bins[k] = (used + len(seq), items + [seq])
                break
        else:
            bins.append((len(seq), [seq]))
    return [items for _, items in bins]


def hand_loop(config: dict, batches: list, budget: int, device: torch.device) -> dict:
    from transformers import AttentionInterface

    AttentionInterface.register("hgraph_bench_packed", _hand_attention)
    model = tiny_hf_llama(attn_implementation="hgraph_bench_packed", **config).train().to(device)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses, times = [], []
    clock = DeviceClock(device)
    for batch in batches:
        start = clock.mark()
        tokens = sum(len(s) - 1 for s in batch)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for mb in _pack(batch, budget):
            ids = torch.cat(mb)[None].to(device)
            positions = torch.cat([torch.arange(len(s)) for s in mb])[None].to(device)
            targets = torch.cat([torch.cat([s[1:], s.new_tensor([-100])]) for s in mb])[None].to(device)
            _POSITIONS["current"] = positions
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=ids, position_ids=positions).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                   reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(float(total))
        times.append(clock.elapsed_ms(start, clock.mark()) / 1e3)
    return {"losses": losses, "seconds": times, "peak_bytes": _peak(device)}


def hgraph_loop(config: dict, batches: list, budget: int, device: torch.device) -> dict:
    model = tiny_hf_llama(**config).train()
    dtype = torch.bfloat16 if device.type == "cuda" else None  # the hand loop's autocast is CUDA-only here
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 100, (1, 16)),
                              options=hgraph.CompileOptions(compute_dtype=dtype))
    trainer = Trainer(compiled, comm=ThreadComm(ThreadWorld(1), 0), optimizer=AdamWConfig(**OPT),
                      run=RunConfig(micro_batch_tokens=budget, device=device))
    losses, times = [], []
    clock = DeviceClock(device)
    for batch in batches:
        start = clock.mark()
        losses.append(float(trainer.step(batch)))
        times.append(clock.elapsed_ms(start, clock.mark()) / 1e3)
    return {"losses": losses, "seconds": times, "peak_bytes": _peak(device),
            "compile_seconds": compiled.compile_seconds}


def _peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return int(peak)


def throughput(config: dict, steps: int, tokens: int, budget: int, device: torch.device) -> dict:
    lengths, source = lengths_source()
    batches = packed_batches(lengths, steps, tokens, budget, config["vocab_size"])
    _peak(device)
    hand = hand_loop(config, batches, budget, device)
    ours = hgraph_loop(config, batches, budget, device)
    warm = slice(1, None) if steps > 1 else slice(None)  # the first step warms up kernels and caches
    n_tokens = sum(sum(len(s) for s in b) for b in batches[warm])
    tps = {k: n_tokens / sum(r["seconds"][warm]) for k, r in (("hgraph", ours), ("hand", hand))}
    out = {
        "lengths_file": source, "steps": steps, "tokens_per_step": tokens, "micro_batch_tokens": budget,
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "tokens_per_s_ratio": round(tps["hgraph"] / tps["hand"], 3),
        "losses": {"hgraph": ours["losses"], "hand": hand["losses"]},
        "hgraph_compile_seconds": round(ours["compile_seconds"], 1),
    }
    if device.type == "cuda":
        out["peak_bytes"] = {"hgraph": ours["peak_bytes"], "hand": hand["peak_bytes"]}
        out["peak_memory_ratio"] = round(ours["peak_bytes"] / hand["peak_bytes"], 3)
    return out


# ----------------------------------------------------------------------------- memory model (GPU)
def _one_step_peak(compiled: Any, tokens: int, device: torch.device) -> tuple[int, int]:
    """(memory before, peak during) one training step on one sequence of ``tokens`` tokens."""
    trainer = Trainer(compiled, comm=ThreadComm(ThreadWorld(1), 0), optimizer=AdamWConfig(**OPT),
                      run=RunConfig(micro_batch_tokens=tokens, device=device))
    trainer.step([torch.randint(0, 100, (64,))])  # allocate optimizer state, warm up
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    trainer.step([torch.randint(0, 100, (tokens,))])
    torch.cuda.synchronize(device)
    return before, torch.cuda.max_memory_allocated(device)


def memory_model(config: dict, device: torch.device, budget_s: float) -> dict:
    started = time.perf_counter()
    model = tiny_hf_llama(**config).train()
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    compiled = {m: hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 100, (1, 16)),
                                  options=hgraph.CompileOptions(compute_dtype=torch.bfloat16,
                                                                recompute=hgraph.RecomputeConfig.of(m))) for m in ("none", "selective", "full")}
    short, long_ = 4096, 8192
    deltas = {}
    for n in (short, long_):
        before, peak = _one_step_peak(compiled["none"], n, device)
        deltas[n] = peak - before
    per_token = (deltas[long_] - deltas[short]) / (long_ - short)
    fixed = deltas[short] - per_token * short  # logits workspace etc., the same in every mode
    regression = MemoryRegression(activation=((1, per_token / (hidden * layers)),), bytes_per_layer_h2=0.0,
                                  alpha=0.0, gap=(("node", 0.0),), safe_bound=0.0, gpu_memory=1.0, hidden=hidden,
                                  layers=layers, vocab=config["vocab_size"], itemsize=2)
    tokens = 16384
    modes = {}
    for mode, c in compiled.items():
        before, peak = _one_step_peak(c, tokens, device)
        predicted = fixed + regression.token_bytes(1, recompute=mode) * tokens
        modes[mode] = {"measured_step_bytes": int(peak - before), "predicted_step_bytes": int(predicted),
                       "measured_vs_predicted": round((peak - before) / predicted, 3), "states_bytes": int(before)}
    result = {"model": f"HF Llama hidden {hidden}, {layers} layers, bf16", "tokens": tokens,
              "fitted_A_bytes_per_token_per_hidden_per_layer": round(per_token / (hidden * layers), 2),
              "fixed_bytes": int(fixed), "modes": modes}
    total = torch.cuda.get_device_properties(device).total_memory
    longest = {}
    for mode, c in compiled.items():
        free = total - modes[mode]["states_bytes"] - fixed
        predicted = int(free // regression.token_bytes(1, recompute=mode))
        n, trained = 8192, 0
        while n <= 262144 and time.perf_counter() - started < budget_s:
            try:
                _one_step_peak(c, n, device)
                trained = n
                n *= 2
            except torch.OutOfMemoryError:
                break
            finally:
                torch.cuda.empty_cache()
        longest[mode] = {"longest_trained": trained, "predicted_max_len": predicted,
                         "stopped_by_time": time.perf_counter() - started >= budget_s}
    result["max_len"] = longest
    return result


# ----------------------------------------------------------------------------- attention variants
VARIANTS = ({}, {"window": 256}, {"softcap": 30.0}, {"window": 256, "softcap": 30.0})


def _dense_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                        window: int | None, softcap: float | None) -> torch.Tensor:
    """fp32 attention of each document on its own: logits, soft-cap, causal and window mask, softmax."""
    q, k, v = q.float(), k.float(), v.float()
    repeat = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qd, kd, vd = (t[:, :, start : start + n] for t in (q, k, v))
        kd, vd = kd.repeat_interleave(repeat, 1), vd.repeat_interleave(repeat, 1)
        logits = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        i = torch.arange(n, device=q.device)
        visible = i[None, :] <= i[:, None]
        if window is not None:
            visible &= i[:, None] - i[None, :] < window
        outs.append(logits.masked_fill(~visible, float("-inf")).softmax(-1) @ vd)
        start += n
    return torch.cat(outs, dim=2)


def attention_variants(lengths: list[int], device: torch.device) -> dict:
    """Every variant through ``hgraph.packed_attention`` (the dispatch's kernel) vs the dense oracle."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator(device=device).manual_seed(0)
    s = sum(lengths)
    q, k, v = (torch.randn(1, h, s, 64, device=device, dtype=dtype, generator=gen).requires_grad_(True)
               for h in (8, 2, 2))
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    upstream = torch.randn(1, 8, s, 64, device=device, dtype=dtype, generator=gen)
    out: dict[str, Any] = {"document_lengths": lengths}
    clock = DeviceClock(device)
    for variant in VARIANTS:
        name = ", ".join(f"{key}={value}" for key, value in variant.items()) or "causal"
        kernel = attention_kernels.choose_kernel(device, dtype, variant=attention_kernels.AttentionVariant(**variant))
        start = clock.mark()
        got = packed_attention(q, k, v, positions, enable_gqa=True, **variant)
        grads = torch.autograd.grad(got, (q, k, v), upstream)
        seconds = clock.elapsed_ms(start, clock.mark()) / 1e3
        want = _dense_per_document(q, k, v, lengths, variant.get("window"), variant.get("softcap"))
        want_grads = torch.autograd.grad(want, (q, k, v), upstream.float())
        errors = [float((a.float() - b).abs().max()) for a, b in zip((got, *grads), (want, *want_grads))]
        out[name] = {"kernel": kernel, "max_abs_error": {"out": errors[0], "dq": errors[1], "dk": errors[2],
                                                         "dv": errors[3]},
                     "ok": errors[0] <= tolerance and max(errors[1:]) <= 5 * tolerance,
                     "seconds_forward_backward": round(seconds, 4)}
    return out


# ----------------------------------------------------------------------------- predicted vs measured
def smoke_model() -> Any:
    return tiny_hf_llama(**SMOKE, use_cache=False).train()  # no KV cache: profiling reruns a block


def big_model() -> Any:
    return tiny_hf_llama(**BIG, use_cache=False).train()


def prediction(factory: str, config: dict, lengths: list[int], steps: int, tokens: int, device: torch.device) -> dict:
    """The planner's ``predicted_ms`` against the Trainer's ``measured_ms`` (``hgraph.runtime.clock``: on
    CUDA up to the end of the optimizer's kernels) per step: ``T(l)`` profiled on this device as
    ``hgraph profile`` does (``profiling.profile_single``: one sequence per length, forward and
    backward), a ``Planner`` on it packs Wikipedia-length batches of ``tokens`` tokens."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    raw = measure(f"{__name__}:{factory}", lengths, str(device), dtype, repeats=3)
    cost, fits = build_table(raw, [1], f"gpu_bench {factory}")
    model = tiny_hf_llama(**config).train()
    compiled = hgraph.compile(model, ["tp1"], example_inputs=torch.randint(0, 100, (1, 16)),
                              options=hgraph.CompileOptions(compute_dtype=torch.bfloat16 if device.type == "cuda" else None))
    trainer = Trainer(compiled, comm=ThreadComm(ThreadWorld(1), 0), optimizer=AdamWConfig(**OPT),
                      planner=Planner(cost, ["tp1"], comm=None), run=RunConfig(device=device))
    batches = packed_batches(lengths_source()[0], steps + 1, tokens, max(lengths), config["vocab_size"])
    rows = []
    for batch in batches:
        trainer.step(batch)
        h = trainer.history[-1]
        rows.append({"predicted_ms": round(h["predicted_ms"], 2), "measured_ms": round(h["measured_ms"], 2),
                     "optimizer_ms": round(h["optimizer_ms"], 2), "micro_batches": len(h["dispatch"][0])})
    warm = rows[1:]  # the first step runs first kernels and allocations
    ratios = [r["measured_ms"] / r["predicted_ms"] for r in warm]
    return {"profiled_lengths": lengths, "fit_ms": {str(k): str(f.cost) for k, f in fits.items()},
            "steps": rows, "measured_over_predicted": {"median": round(statistics.median(ratios), 3),
                                                       "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}


# ----------------------------------------------------------------------------- flex memory under cp
def _held_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def flex_cp_memory(tokens: int, cp: int, heads: tuple[int, int], device: torch.device, modes: list[str]) -> dict:
    """One FlexAttention of context-parallel rank 0 on one ``tokens``-token document: its ``2·cp``-way
    load-balanced chunks (the first and the last) as queries against every key, eager and compiled
    (``HGRAPH_FLEX_COMPILE``), forward and backward on CUDA (forward only on CPU: no flex backward
    there): the memory the call adds at its peak and its time."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chunk = tokens // (2 * cp)
    stream = torch.cat([torch.arange(chunk), torch.arange(tokens - chunk, tokens)]).to(device)
    positions = torch.arange(tokens, device=device)[None]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads[0], len(stream), 64, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, heads[1], tokens, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
    train = device.type == "cuda"
    clock = DeviceClock(device)
    out: dict[str, Any] = {"tokens": tokens, "cp": cp, "query_tokens": len(stream), "heads": list(heads),
                           "backward": train}
    for mode in modes:
        os.environ[attention_kernels.FLEX_COMPILE_ENV] = "1" if mode == "compiled" else "0"
        try:
            row = {}
            for run in ("first_call", "measured"):  # the first call compiles
                leaves = [t.detach().requires_grad_(train) for t in (q, k, v)]
                reset_peak_memory(device)
                before = _held_bytes(device)
                start = clock.mark()
                with torch.set_grad_enabled(train):
                    got = attention_kernels.flex(*leaves, positions, stream, None, True)
                    if train:
                        torch.autograd.grad(got, leaves, torch.ones_like(got))
                row[f"{run}_ms"] = round(clock.elapsed_ms(start, clock.mark()), 2)
                del got
            row["peak_added_bytes"] = int(peak_memory_bytes(device) - before)
            out[mode] = row
        except torch.OutOfMemoryError as exc:
            out[mode] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
        finally:
            os.environ.pop(attention_kernels.FLEX_COMPILE_ENV, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["compiled_used"] = attention_kernels.FLEX.failure is None and "compiled" in modes
    return out


def _section(name: str, fn: Callable[[], dict], out: dict) -> None:
    start = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as exc:  # noqa: BLE001 - a failed section is reported, the others still run
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=3)}
    out[name]["seconds"] = round(time.perf_counter() - start, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (what runs without CUDA)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    result: dict[str, Any] = {"benchmark": "gpu", "cuda": cuda, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if cuda:
        result["attention_kernel"] = attention_kernels.choose_kernel(device, torch.bfloat16)
        result["flex_compiled"] = attention_kernels.FLEX.compiles(device)
        _section("throughput", lambda: throughput(BIG, 6, 32768, 8192, device), result)
        wide8 = dict(BIG, num_hidden_layers=8)
        _section("memory_model", lambda: memory_model(wide8, device, budget_s=120.0), result)
        _section("attention_variants", lambda: attention_variants([37, 1000, 3, 1500, 508], device), result)
        _section("prediction", lambda: prediction("big_model", BIG, [1024, 2048, 4096, 8192], 4, 32768, device),
                 result)
        _section("flex_cp_memory", lambda: flex_cp_memory(16384, 2, (32, 4), device, ["eager", "compiled"]), result)
    else:
        result["attention_kernel"] = "sdpa (per sequence; varlen_attn needs CUDA)"
        _section("throughput", lambda: throughput(SMOKE, 3, 1024, 512, device), result)
        _section("attention_variants", lambda: attention_variants([37, 300, 3, 172], device), result)
        _section("prediction", lambda: prediction("smoke_model", SMOKE, [32, 64, 128, 256], 3, 1024, device), result)
        _section("flex_cp_memory", lambda: flex_cp_memory(1024, 2, (4, 2), device, ["eager"]), result)
        result["skipped"] = [
            "HF Llama ~1.1B (smoke mode uses a 2-layer hidden-64 HF Llama)",
            "varlen_attn in both loops (CUDA only; both use per-sequence SDPA here)",
            "(d) varlen and flex attention kernels (CUDA; the CPU run checks the SDPA kernel)",
            "bf16 (both loops compute in fp32 on CPU)",
            "peak memory ratio (torch.cuda.max_memory_allocated)",
            "(b) memory model vs measured peak per recompute mode (CPU figures: benchmarks/recompute_bench.py)",
            "(c) longest trainable sequence per recompute mode vs predicted MaxLen",
            "(f) compiled FlexAttention and its backward at 16K tokens under cp=2 (CPU: eager forward at 1K;"
            " the CPU choice is measured in benchmarks/flex_bench.py)",
        ]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
