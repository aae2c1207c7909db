"""Models larger than one process: per-rank peak memory of the meta path against its prediction and
against the eager path, and the scale figure of a 7B compile (prints JSON).

    python benchmarks/big_model_bench.py                      # 0.84B Llama, 4 ranks (~21 GB free needed)
    python benchmarks/big_model_bench.py --layers 4 --compare-layers 2,4    # a smaller run
    python benchmarks/big_model_bench.py --only scale         # the 7B compile alone

1. Checkpoint: an HF Llama (hidden 2048, ``--layers`` 16, vocab 32000, ffn 5632, 16 heads, 4 KV heads:
   0.84B parameters) is built on meta, initialised layer by layer (``hgraph.frontend.layerwise_init``) and
   written as bf16 HF shards of 500 MB with an index (``hgraph.core.sharded_writer``); the benchmark never
   holds the model.
2. Meta path, per strategy (``tp4``, ``tp2,pp2``): 4 gloo ranks each build the model on meta, compile,
   ``Trainer(weights=DIR)`` and run ``--steps`` steps. Per rank: peak RSS (``ru_maxrss``) and its
   prediction = baseline + ZeRO share + gradient shards + compute-layout parameters + their gradients
   + activations, where
     baseline     the rank's RSS once compiled, before any parameter value exists (measured: torch,
                  the process group, the compiled programs);
     ZeRO share   16 B per element of the rank's optimizer shards: fp32 master (4), Adam m and v (8),
                  the pushed fp32 gradient shard (4);
     compute      2 x itemsize x the elements of the rank's compute-layout parameters (its Pulls'
                  destinations): the parameters and their gradients in the compute dtype;
     activations  itemsize x tokens x (6 H + 10 H/tp + 4 F/tp) per layer of the rank's stage (what HF
                  Llama's layer saves for backward: norms and residuals at full width, q/k/v/attention
                  and the MLP's three products cut by tp), plus 4 x tokens x V/tp x 3 for the fp32
                  logits on the last stage.
3. Eager path (v0.1: every rank ``from_pretrained`` in fp32, compile, ``Trainer``) at each of
   ``--compare-layers`` and at ``--layers``, next to the meta path at that size under ``tp4``; a run
   whose rough prediction exceeds the memory available now is not started, and the row says so, with
   its predicted per-rank peak: the meta run's prediction + the fp32 model (4 B per parameter), the
   term the eager runs that fit match (the model is traced as it is, fp32: bf16 is the precision
   pass's autocast casts, no copy).
4. Scale: Llama-7B shapes (32 layers, hidden 4096, vocab 32000) built on meta and compiled for rank 0
   of world 64 (4 strategies) in a fresh process: wall and CPU seconds, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import hgraph

GiB = 2**30
HIDDEN, VOCAB, FFN, HEADS, KV_HEADS = 2048, 32000, 5632, 16, 4
SCALE_STRATEGIES = ["64x tp1", "32x tp2", "16x tp4", "8x tp4,pp2"]
MARGIN = 2 * GiB  # left to the other users of the machine


def llama_config(layers: int, hidden: int = HIDDEN, ffn: int = FFN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 vocab: int = VOCAB) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                tie_word_embeddings=False, use_cache=False)


def parameter_count(config: dict) -> int:
    h, f, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)


def rss_now() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available() -> int:
    with open("/proc/meminfo") as fh:
        info = dict(line.split(":") for line in fh)
    return int(info["MemAvailable"].split()[0]) * 1024


def sequences(lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


# ----------------------------------------------------------------------------- the checkpoint
def write_checkpoint(config: dict, path: Path) -> dict:
    """Build on meta, initialise layer by layer, write bf16 HF shards; never holds the model."""
    import transformers

    from hgraph.frontend.layerwise_init import initialize
    from hgraph.core.sharded_writer import ShardedWriter, TensorSpec

    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    specs = [TensorSpec(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    writer = ShardedWriter(path, specs, "500MB")
    initialize(model, 0, writer.write)
    files = writer.close()
    model.config.dtype = "bfloat16"
    model.config.save_pretrained(str(path))
    return {"dir": str(path), "files": len(files), "bytes": sum(f.stat().st_size for f in files),
            "seconds": round(time.perf_counter() - start, 1), "peak_rss_gib": round(rss_peak() / GiB, 2)}


# ----------------------------------------------------------------------------- the ranks
def _prediction(compiled, trainer, config: dict, itemsize: int, tokens: int) -> dict:
    rank = trainer.rank
    program = compiled.program(0, rank)
    shard = sum(s.numel() for s in trainer.optimizer.shards.values())
    compute, layers = 0, set()
    for pc in program.pulls:
        if rank in pc.pull.dst.ranks:
            compute += math.prod(pc.pull.dst.local_shape(rank))
            layer = compiled.traced.layer_of(pc.name)
            if layer is not None:
                layers.add(layer)
    tp = len(program.groups["tp"])
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    activations = itemsize * tokens * len(layers) * (6 * h + 10 * h // tp + 4 * f // tp)
    if program.is_last_stage:
        activations += 4 * tokens * (v // tp) * 3
    return {"zero": 16 * shard, "compute": 2 * itemsize * compute, "activations": activations}


def run_rank(spec: dict) -> dict:
    """One rank of either path: build, compile, set up, train ``steps`` steps; memory at each phase."""
    import transformers

    rank = torch.distributed.get_rank()
    dtype = torch.bfloat16 if spec["compute_dtype"] == "bf16" else None
    start = time.perf_counter()
    if spec["path_kind"] == "meta":
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["config"])).eval()
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(
            spec["dir"], dtype=torch.float32, attn_implementation="sdpa", use_cache=False).eval()
    built = rss_now()
    compiled = hgraph.compile(model, [spec["strategy"]], example_inputs=torch.randint(0, 8, (1, 16)),
                              options=hgraph.CompileOptions(compute_dtype=dtype))
    compiled_rss = rss_now()
    weights = spec["dir"] if spec["path_kind"] == "meta" else None
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-5),
                             run=hgraph.RunConfig(weights=weights))
    set_up_rss, set_up_s = rss_now(), time.perf_counter() - start
    batch = sequences(spec["lengths"])
    losses, step_s = [], []
    for _ in range(spec["steps"]):
        t = time.perf_counter()
        losses.append(trainer.step(batch, strategy=0))
        step_s.append(round(time.perf_counter() - t, 1))
    peak = rss_peak()
    parts = _prediction(compiled, trainer, spec["config"], 2 if dtype else 4, sum(spec["lengths"]))
    predicted = compiled_rss + sum(parts.values())
    return {"rank": rank, "peak_gib": round(peak / GiB, 3), "predicted_gib": round(predicted / GiB, 3),
            "ratio": round(peak / predicted, 3), "baseline_gib": round(compiled_rss / GiB, 3),
            **{f"{k}_gib": round(b / GiB, 3) for k, b in parts.items()},
            "after_build_gib": round(built / GiB, 3), "after_set_up_gib": round(set_up_rss / GiB, 3),
            "set_up_s": round(set_up_s, 1), "step_s": step_s, "losses": losses}


def rough_total(numel: int, world: int, itemsize: int, eager: bool) -> int:
    """A pre-launch estimate of all ranks' memory together, to decide whether a run may start: the
    prediction's terms with a 0.6 GiB baseline; the eager path adds the fp32 model."""
    per_rank = 16 * numel / world + 2 * itemsize * numel / world + 0.6 * GiB
    if eager:
        per_rank += 4 * numel
    return int(world * per_rank)


def run_path(kind: str, config: dict, strategy: str, args: argparse.Namespace, ckpt: Path) -> dict:
    numel = parameter_count(config)
    itemsize = 2 if args.compute_dtype == "bf16" else 4
    need, free = rough_total(numel, args.world, itemsize, kind == "eager"), available()
    row = {"path": kind, "layers": config["num_hidden_layers"], "params": numel, "strategy": strategy}
    if need > free - MARGIN:
        return {**row, "ran": False, "stops": f"predicted {need / GiB:.1f} GiB for {args.world} ranks, "
                f"{free / GiB:.1f} GiB available now (24 GiB machine, shared)"}
    spec = {"path_kind": kind, "config": config, "strategy": strategy, "dir": str(ckpt), "steps": args.steps,
            "lengths": args.lengths, "compute_dtype": args.compute_dtype}
    start = time.perf_counter()
    ranks = hgraph.launch(run_rank, args.world, args=(spec,), timeout=args.timeout)
    return {**row, "ran": True, "seconds": round(time.perf_counter() - start, 1), "ranks": ranks,
            "max_ratio": max(r["ratio"] for r in ranks), "max_peak_gib": max(r["peak_gib"] for r in ranks)}


# ----------------------------------------------------------------------------- scale
def scale_child() -> dict:
    import transformers

    start, cpu = time.perf_counter(), time.process_time()
    config = transformers.LlamaConfig(**llama_config(32, hidden=4096, ffn=11008, heads=32, kv_heads=32))
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    built = time.perf_counter() - start
    compiled = hgraph.compile(model, SCALE_STRATEGIES, example_inputs=torch.randint(0, 8, (1, 16)),
                              options=hgraph.CompileOptions(build=hgraph.BuildConfig(rank=0)))
    for i in range(len(SCALE_STRATEGIES)):
        compiled.program(i, 0)
    return {"model": "Llama-7B shapes (32 layers, hidden 4096, ffn 11008, vocab 32000)",
            "params": parameter_count(llama_config(32, hidden=4096, ffn=11008, heads=32, kv_heads=32)),
            "world": 64, "rank": 0, "strategies": SCALE_STRATEGIES, "build_s": round(built, 1),
            "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
            "peak_rss_gib": round(rss_peak() / GiB, 3), "parameter_storage": any(not p.is_meta for p in model.parameters())}


def run_scale() -> dict:
    out = subprocess.run([sys.executable, __file__, "--scale-child"], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    row = json.loads(out.stdout.strip().splitlines()[-1])
    row["goals"] = {"seconds <= 60": row["seconds"] <= 60, "peak RSS <= 4 GB": row["peak_rss_gib"] * GiB <= 4e9}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--compare-layers", default="", help="smaller sizes for the eager comparison, e.g. 2,4")
    parser.add_argument("--strategies", default="tp4;tp2,pp2")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 128, 96, 160])
    parser.add_argument("--compute-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--only", choices=("scale", "models"), default=None)
    parser.add_argument("--timeout", type=float, default=5400.0)
    parser.add_argument("--scale-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale_child:
        print(json.dumps(scale_child()))
        return
    result: dict = {"machine": {"cpus": os.cpu_count(), "available_gib_at_start": round(available() / GiB, 1)},
                    "compute_dtype": args.compute_dtype, "world": args.world, "steps": args.steps,
                    "tokens_per_step": sum(args.lengths)}
    if args.only != "models":
        result["scale"] = run_scale()
    if args.only != "scale":
        root = Path(args.dir or tempfile.mkdtemp(prefix="hgraph-big-"))
        sizes = sorted({int(x) for x in args.compare_layers.split(",") if x} | {args.layers})
        result["checkpoints"], result["runs"] = {}, []
        for layers in sizes:
            config = llama_config(layers)
            ckpt = root / f"llama_{layers}l"
            if not (ckpt / "config.json").is_file():
                result["checkpoints"][layers] = write_checkpoint(config, ckpt)
            strategies = args.strategies.split(";") if layers == args.layers else args.strategies.split(";")[:1]
            for strategy in strategies:
                result["runs"].append(run_path("meta", config, strategy, args, ckpt))
            result["runs"].append(run_path("eager", config, strategies[0], args, ckpt))
        for e in result["runs"]:  # an eager run that did not start: its prediction from the meta run
            meta = [m for m in result["runs"] if m["path"] == "meta" and m["ran"]
                    and (m["layers"], m["strategy"]) == (e["layers"], e["strategy"])]
            if e["path"] == "eager" and not e["ran"] and meta:
                extra = 4 * e["params"] / GiB
                e["predicted_peak_gib"] = [round(r["predicted_gib"] + extra, 3) for r in meta[0]["ranks"]]
                e["meta_measured_over_eager_predicted"] = round(
                    max(r["peak_gib"] / p for r, p in zip(meta[0]["ranks"], e["predicted_peak_gib"])), 3)
        both = [(m, e) for m in result["runs"] for e in result["runs"]
                if m["path"] == "meta" and e["path"] == "eager" and m["ran"] and e["ran"]
                and (m["layers"], m["strategy"]) == (e["layers"], e["strategy"])]
        meta_runs = [r for r in result["runs"] if r["path"] == "meta" and r["ran"]]
        result["goals"] = {"peak <= 1.25 x predicted on every rank": all(r["max_ratio"] <= 1.25 for r in meta_runs)}
        if both:
            m, e = max(both, key=lambda pair: pair[0]["layers"])
            ratio = max(a["peak_gib"] / b["peak_gib"] for a, b in zip(m["ranks"], e["ranks"]))
            result["goals"][f"meta <= 0.5 x eager per rank at {m['layers']} layers"] = ratio <= 0.5
            result["meta_over_eager"] = round(ratio, 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
