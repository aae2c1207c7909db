"""Step time of a checkpointing iteration, synchronous vs asynchronous, side by side (JSON).

    python benchmarks/checkpoint_bench.py [--world-size 2] [--hidden 384] [--layers 6] [--rounds 4]

On local gloo ranks an ``hgraph.models.Llama`` trains (``2x tp1`` and ``tp2`` in turn) on random
sequences; its sharded checkpoint (fp32 master shards + Adam moments: 12 bytes per parameter over
all ranks) is written by ``hgraph.CheckpointManager`` into a temporary directory. Each round runs

    [sync save] step  step  step   [async save] step  step  step

where a checkpointing iteration is timed from the start of its ``trainer.step`` to the return of its
``save`` (synchronous: the files are written, checksummed, committed; asynchronous: the shards were
copied to host memory and the write continues in a background thread). The three iterations after
each save are timed too: after an asynchronous save they run while the write is in flight (on a
CPU-only machine the writer competes with training for the cores), and the round waits for the write
before the next synchronous save. Reported: medians over the rounds on rank 0, the overhead of each
kind of save over a plain step, ``sync_over_async`` (the ratio of the checkpointing iterations'
times), ``after_async_over_plain`` (what the write in flight costs the steps it overlaps) and how long
a write takes from snapshot to commit (``CheckpointManager.write_seconds``). Noisy machines: compare
within one run only.

    python benchmarks/checkpoint_bench.py --resume-rss [--layers 6] [--baseline 506502d] [--baseline-layers 2]

Peak RSS per rank of a resume at another world size, 4 ranks to 2 and 2 to 4, with the HF Llama of
docs/big_models.md (hidden 2048, 16 heads / 4 KV heads, ffn 5632, vocab 32000; 6 layers: 0.40 B
parameters). For each direction, a child process launches the saving world (meta model, compile
``Wx tp1``, a Trainer initialised layer by layer from a seed as ``hgraph train`` builds one for a config
model, ``trainer.save``) and then the loading world, whose ranks report the peak RSS of the
whole process and of the load alone (``VmHWM`` before, and after ``/proc/self/clear_refs``), next to
the rank's share of parameters and optimizer state (12 bytes per element of its ZeRO shards) + 1 GiB.
The same children run the code of ``--baseline`` (a commit of this repository, extracted with
``git archive`` and put first on ``PYTHONPATH``: the per-rank ``torch.load`` reader), interleaved with
today's, at ``--baseline-layers`` too where the old reader would not fit in memory at ``--layers``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime.checkpoint_manager import CheckpointManager

AFTER = 3  # plain iterations after each save


def batch(seed: int, vocab: int, tokens: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 16:
        n = int(torch.randint(16, min(512, left) + 1, (1,), generator=g))
        lengths.append(n)
        left -= n
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _rank(args: argparse.Namespace, directory: str) -> dict:
    config = LlamaConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.heads, ffn=4 * args.hidden)
    model = Llama(config, seed=0)
    strategies = ["2x tp1", "tp2"] if args.world_size == 2 else [f"{args.world_size}x tp1"]
    compiled = hgraph.compile(model, strategies, example_inputs=torch.randint(0, 8, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-4))
    manager = CheckpointManager(directory, keep=1)
    times: dict[str, list[float]] = {"plain": [], "sync_checkpoint": [], "async_checkpoint": [],
                                     "after_sync": [], "after_async": []}
    step = 0

    def timed(save: str = "") -> float:
        nonlocal step
        dist.barrier()
        start = time.perf_counter()
        trainer.step(batch(step, args.vocab, args.tokens), strategy=step % len(strategies))
        step += 1
        if save:
            manager.async_write = save == "async"
            manager.save(trainer)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        times["plain"].append(timed())
    times["plain"].clear()
    for _ in range(args.rounds):
        times["sync_checkpoint"].append(timed("sync"))
        times["after_sync"] += [timed() for _ in range(AFTER)]
        times["async_checkpoint"].append(timed("async"))
        times["after_async"] += [timed() for _ in range(AFTER)]
        manager.wait()
        times["plain"].append(timed())
    manager.close()
    size = sum(f.stat().st_size for f in Path(directory).rglob("*.pt"))
    params = sum(p.numel() for p in model.parameters())
    writes = manager.write_seconds  # alternating: synchronous, asynchronous (snapshot to commit)
    return {"times": times, "checkpoint_bytes": size, "parameters": params,
            "write_s": {"sync": writes[0::2], "async": writes[1::2]}}


# ----------------------------------------------------------------------------- resume memory
GiB = 2**30


def _hwm() -> int:
    """This process's peak RSS since the last ``_reset_hwm`` (bytes)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _resume_rank(spec: dict) -> dict:
    """One rank: build on meta, compile, initialise its shards; then save, or load and measure."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["config"])).eval()
    world = dist.get_world_size()
    compiled = hgraph.compile(model, [f"{world}x tp1"], example_inputs=torch.randint(0, 8, (1, 16)))
    trainer = hgraph.Trainer(compiled, optimizer=hgraph.AdamWConfig(lr=1e-5))  # initialised layer by layer
    share = 12 * sum(s.numel() for s in trainer.optimizer.shards.values())
    if spec["save"]:
        trainer.save(spec["checkpoint"])
        return {}
    before = _hwm()
    _reset_hwm()
    start = time.perf_counter()
    trainer.load(spec["checkpoint"])
    seconds = time.perf_counter() - start
    in_load = _hwm()
    peak = max(before, in_load)  # clear_refs resets ru_maxrss as well: the whole run's peak is the larger
    return {"rank": dist.get_rank(), "share_gib": round(share / GiB, 3), "limit_gib": round((share + GiB) / GiB, 3),
            "peak_gib": round(peak / GiB, 3), "peak_before_load_gib": round(before / GiB, 3),
            "peak_in_load_gib": round(in_load / GiB, 3), "load_s": round(seconds, 1),
            "within_limit": peak <= share + GiB}


def _resume_child(spec: dict) -> None:
    """Save at ``spec['from']`` ranks, load at ``spec['to']``; print the loading ranks' figures (JSON)."""
    with tempfile.TemporaryDirectory(prefix="hgraph-resume-rss-") as directory:
        spec = dict(spec, checkpoint=str(Path(directory) / "ck"))
        hgraph.launch(_resume_rank, spec["from"], args=(dict(spec, save=True),), timeout=3000)
        ranks = hgraph.launch(_resume_rank, spec["to"], args=(dict(spec, save=False),), timeout=3000)
    print(json.dumps(ranks))


def _code_tree(commit: str, into: Path) -> Path:
    """The package of ``commit`` laid out as installed (hgraph/, with runtime/ and passes/ inside)."""
    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, "hgraph", "runtime", "passes"],
                             check=True, capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "runtime").rename(into / "hgraph" / "runtime")
    (into / "passes").rename(into / "hgraph" / "passes")
    return into


def resume_rss(args: argparse.Namespace) -> dict:
    """The ``--resume-rss`` report: per size, direction and code, each loading rank's figures."""
    sys.path.insert(0, str(Path(__file__).parent))
    from big_model_bench import llama_config, parameter_count

    report: dict = {"baseline": args.baseline, "runs": []}
    with tempfile.TemporaryDirectory(prefix="hgraph-resume-rss-") as scratch:
        old = _code_tree(args.baseline, Path(scratch) / "old") if args.baseline else None
        for layers in dict.fromkeys([args.layers, args.baseline_layers]):
            config = llama_config(layers)
            codes = [("today", None)] + ([("baseline", old)] if old and layers in (args.baseline_layers,
                                                                                  args.layers_for_baseline) else [])
            for source, target in ((4, 2), (2, 4)):
                for code, tree in codes:
                    env = dict(os.environ, PYTHONPATH=str(tree)) if tree else dict(os.environ)
                    spec = {"config": config, "from": source, "to": target}
                    child = subprocess.run([sys.executable, __file__, "--resume-child", json.dumps(spec)],
                                           env=env, capture_output=True, text=True)
                    run = {"layers": layers, "parameters": parameter_count(config), "from": source, "to": target,
                           "code": code}
                    if child.returncode:
                        run["error"] = child.stderr.strip().splitlines()[-3:]
                    else:
                        ranks = json.loads(child.stdout.strip().splitlines()[-1])
                        run["ranks"] = ranks
                        run["max_peak_over_limit"] = round(max(r["peak_gib"] / r["limit_gib"] for r in ranks), 3)
                    report["runs"].append(run)
                    print(json.dumps(run), file=sys.stderr, flush=True)
    return report


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--resume-child":
        _resume_child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per iteration")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--resume-rss", action="store_true", help="peak RSS per rank of resumes 4->2 and 2->4")
    parser.add_argument("--baseline", default="506502d", help="commit whose reader is measured too ('' for none)")
    parser.add_argument("--baseline-layers", type=int, default=2, help="a size at which the baseline fits in memory")
    parser.add_argument("--layers-for-baseline", type=int, default=-1,
                        help="also run the baseline at this many layers (default: only at --baseline-layers)")
    args = parser.parse_args()
    if args.resume_rss:
        if "--layers" not in sys.argv:
            args.layers = 6
        print(json.dumps(resume_rss(args), indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="hgraph-ckpt-bench-") as directory:
        out = hgraph.launch(_rank, args.world_size, args=(args, directory), timeout=args.timeout)[0]
    t = out["times"]
    med = {k: statistics.median(v) for k, v in t.items() if v}
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "parameters": out["parameters"]},
        "world_size": args.world_size, "tokens_per_iteration": args.tokens, "rounds": args.rounds,
        "checkpoint_bytes": out["checkpoint_bytes"],
        "median_step_s": med,
        "sync_overhead_s": med["sync_checkpoint"] - med["plain"],
        "async_overhead_s": med["async_checkpoint"] - med["plain"],
        "sync_over_async": med["sync_checkpoint"] / med["async_checkpoint"],
        "after_async_over_plain": med["after_async"] / med["plain"],
        "median_write_s": {k: statistics.median(v) for k, v in out["write_s"].items()},
        "samples": {k: [round(x, 4) for x in v] for k, v in t.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
