"""What the packing fallback costs: tokens/s packed vs one document per micro-batch, same model, same data.

    python benchmarks/packing_bench.py [--family llama] [--world 1] [--strategy tp1] [--steps 4]

A model whose packing hgraph cannot prove exact trains one document per micro-batch
(``hgraph.compiler.packing_proof``); ``compile(packing="off")`` forces that path on a model that packs, so both
run here side by side: the same zoo family (its default config, sizes ``--hidden``/``--layers``/
``--vocab``), the same batches of ``--documents`` documents whose lengths are drawn from the Wikipedia
sample (``hgraph/data/wikipedia_lengths_sample.txt``, capped at ``--max-len``), ``Trainer.step`` on
``--world`` gloo ranks (``hgraph.launch``; one rank runs in this process), lr 0 so every step sees the
same weights. Steps alternate packed / one document (drift of the machine's load cancels); a step is
timed on every rank and the slowest rank counts; tokens/s = target tokens / median step time.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from pathlib import Path

import torch

import hgraph
from hgraph.runtime.kernels.thread_comm import run_threads
from hgraph.training.trainer import Trainer
from hgraph.training.configs import AdamWConfig

LENGTHS = Path(hgraph.__file__).parent / "data" / "wikipedia_lengths_sample.txt"


def documents(args: argparse.Namespace, vocab: int) -> list[list[torch.Tensor]]:
    lengths = [min(int(x), args.max_len) for x in LENGTHS.read_text().split() if int(x) >= 2]
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(0, vocab, (rng.choice(lengths),), generator=g) for _ in range(args.documents)]
            for _ in range(args.warmup + args.steps)]


def model_for(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    from hgraph.core.seeding import seeded_model
    from hgraph.models.zoo import FAMILIES

    family = FAMILIES[args.family]
    sizes = {**family.sizes, "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
             "num_hidden_layers": args.layers, "vocab_size": args.vocab, "max_position_embeddings": 4 * args.max_len}
    config = getattr(transformers, family.config)(**sizes)
    return seeded_model(("packing_bench", args.family), 0,
                        lambda: transformers.AutoModelForCausalLM.from_config(config)).eval()


def run(args: argparse.Namespace, comm=None) -> dict:
    """Every rank: time the alternating steps; returns per mode the step seconds and tokens."""
    model = model_for(args)
    example = torch.randint(0, args.vocab, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = hgraph.compile(model, [args.strategy], example_inputs=example)
        alone = hgraph.compile(model, [args.strategy], example_inputs=example,
                               options=hgraph.CompileOptions(packing="off"))
    trainers = {"packed": Trainer(packed, optimizer=AdamWConfig(lr=0.0), comm=comm), "one document per micro-batch": Trainer(alone,
                                                                                                      optimizer=AdamWConfig(lr=0.0), comm=comm)}
    seconds: dict[str, list[float]] = {k: [] for k in trainers}
    micro_batches: dict[str, int] = {}
    batches = documents(args, args.vocab)
    for i, batch in enumerate(batches):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(batch)
            if i >= args.warmup:
                seconds[mode].append(time.perf_counter() - start)
            micro_batches[mode] = sum(len(p) for p in trainer.history[-1]["dispatch"])
    tokens = sum(len(d) - 1 for d in batches[-1])
    return {"seconds": seconds, "tokens": [sum(len(d) - 1 for d in b) for b in batches[args.warmup:]],
            "micro_batches": micro_batches, "last_tokens": tokens, "proof": str(packed.packing)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama")
    parser.add_argument("--strategy", default="tp1")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.world == 1:
        results = run_threads(lambda comm: run(args, comm), 1)
    else:
        results = hgraph.launch(run, args.world, args=(args,), timeout=3600)
    out = {"family": args.family, "strategy": args.strategy, "world": args.world, "hidden": args.hidden,
           "layers": args.layers, "documents": args.documents, "proof": results[0]["proof"]}
    tokens = results[0]["tokens"]
    for mode in results[0]["seconds"]:
        slowest = [max(r["seconds"][mode][i] for r in results) for i in range(len(tokens))]
        out[mode] = {"median_step_s": round(statistics.median(slowest), 4),
                     "tokens_per_s": round(statistics.median(t / s for t, s in zip(tokens, slowest)), 1),
                     "micro_batches_per_step": results[0]["micro_batches"][mode]}
    out["packed_over_one_document"] = round(out["packed"]["tokens_per_s"]
                                            / out["one document per micro-batch"]["tokens_per_s"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
