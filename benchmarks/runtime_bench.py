"""Step time of hgraph strategies on local gloo ranks vs PyTorch's DTensor TP + FSDP2 and one process.

    python benchmarks/runtime_bench.py [--steps 5] [--warmup 2] [--tiny]

``--tiny`` is the smoke configuration (2 ranks, a 2-layer 64-wide model, strategies ``2x tp1`` and
``tp2``) that ``tests/runtime/test_runtime_bench.py`` runs.

Every side trains the same ``hgraph.models.Llama`` (same seed, so the same initial weights) on the
same global batch (``batch`` random sequences of ``seq`` tokens, every rank holds all of it), with
AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, no weight decay) and the token-mean next-token cross
entropy over the whole batch (each sequence's last token predicts nothing: ``batch * (seq - 1)``
targets), all in fp32:

* hgraph: ``hgraph.compile`` for all strategies at once, ``Trainer.step(sequences, strategy=i)``;
  each pipeline packs its sequences into ``[1, tokens]`` micro-batches (the default dispatch: one
  micro-batch per pipeline here, two for ``tp2,pp2``) and attends per sequence (one SDPA call each).
* torch: ``parallelize_module`` on the ``tp`` dim of a ``(dp, tp)`` CPU DeviceMesh (Colwise q/k/v/
  gate/up, Rowwise o/down, vocab-parallel embedding, lm_head sharded on the vocab with
  ``loss_parallel``, head counts set to their local values as torchtitan does), then FSDP2
  ``fully_shard`` over ``dp`` (per block and the root; skipped when dp = 1); each dp rank runs its
  ``batch / dp`` sequences as a dense ``[batch / dp, seq]`` tensor. Same math as hgraph's default
  options (no sequence parallelism, vocab-parallel embedding and cross entropy).
* single: the unmodified model and ``torch.optim.AdamW`` on rank 0 alone (the others wait in a
  barrier), one thread like every rank, the whole batch as ``[batch, seq]``.

A step is timed from a barrier to a barrier on every rank (the median of ``steps`` after ``warmup``).
hgraph rows also give ``optimizer_ms``: the median over those steps of the reporting rank's global
gradient norm + ``ShardedAdamW.apply`` (``Trainer.history``'s ``optimizer_ms``).
The first losses of all sides are reported: they must agree, which shows they compute the same thing.
Strategy switching: after every strategy has run, ``switch_strategies`` run as A A B B A A ...; the
first step of each pair follows a switch, the second repeats the strategy; the difference of their
medians is what a switch adds (pairs interleave, so slow drift of the machine's load cancels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

import hgraph
from hgraph.models import Llama, LlamaConfig

OPTIMIZER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@dataclass(frozen=True)
class BenchConfig:
    """Model, batch and what to run; ``baselines`` are ``(label, dp, tp)`` DTensor meshes."""

    vocab: int = 1024
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    ffn: int = 512
    batch: int = 8
    seq: int = 256
    warmup: int = 2
    steps: int = 5
    world: int = 4
    strategies: tuple[str, ...] = ("2x tp2", "tp4", "4x tp1", "tp2,pp2")
    baselines: tuple[tuple[str, int, int], ...] = (("2x tp2", 2, 2), ("tp4", 1, 4), ("4x tp1", 4, 1))
    switch_strategies: tuple[str, str] = ("2x tp2", "tp4")
    single: bool = True
    timeout: float = 600.0

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab, hidden=self.hidden, layers=self.layers, heads=self.heads,
                           kv_heads=self.kv_heads, ffn=self.ffn)


def make_batch(cfg: BenchConfig) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, cfg.vocab, (cfg.seq,), generator=generator) for _ in range(cfg.batch)]


def dense_targets(ids: torch.Tensor) -> torch.Tensor:
    """Next-token targets of ``[b, s]`` ids; the last position predicts nothing (-100), as in hgraph."""
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    return targets


def _timed_steps(step: Callable[[], float], n: int) -> tuple[list[float], list[float]]:
    """Run ``step`` ``n`` times between barriers; returns (seconds, losses)."""
    import torch.distributed as dist

    seconds, losses = [], []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step())
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return seconds, losses


def _summary(seconds: list[float], losses: list[float], warmup: int) -> dict:
    timed = seconds[warmup:]
    return {"step_s": round(statistics.median(timed), 4), "min_s": round(min(timed), 4),
            "max_s": round(max(timed), 4), "first_step_s": round(seconds[0], 4), "first_loss": losses[0]}


# ----------------------------------------------------------------------------- hgraph
def _hgraph(cfg: BenchConfig, batch: list[torch.Tensor]) -> dict:
    start = time.perf_counter()
    model = Llama(cfg.model_config())
    compiled = hgraph.compile(model, list(cfg.strategies), example_inputs=torch.randint(0, cfg.vocab, (1, 16)))
    compile_s = time.perf_counter() - start
    trainer = hgraph.Trainer(compiled,
                             optimizer=hgraph.AdamWConfig(lr=OPTIMIZER["lr"], betas=OPTIMIZER["betas"],
                                                          eps=OPTIMIZER["eps"],
                                                          weight_decay=OPTIMIZER["weight_decay"]))
    out: dict = {"compile_s": round(compile_s, 3), "strategies": {}}
    first_loss = None
    for index, label in enumerate(cfg.strategies):
        seconds, losses = _timed_steps(lambda: trainer.step(batch, strategy=index), cfg.warmup + cfg.steps)
        out["strategies"][label] = _summary(seconds, losses, cfg.warmup)
        timed = trainer.history[-cfg.steps:]  # this rank's grad norm + AdamW apply, as Trainer records it
        out["strategies"][label]["optimizer_ms"] = round(statistics.median(r["optimizer_ms"] for r in timed), 3)
        first_loss = losses[0] if first_loss is None else first_loss
    out["first_loss"] = first_loss
    a, b = (compiled.strategy_index(s) for s in cfg.switch_strategies)
    switched: dict[int, list[float]] = {a: [], b: []}
    repeated: dict[int, list[float]] = {a: [], b: []}
    for _ in range(cfg.steps):
        for index in (a, b):
            seconds, _ = _timed_steps(lambda: trainer.step(batch, strategy=index), 2)
            switched[index].append(seconds[0])
            repeated[index].append(seconds[1])
    out["switch"] = {
        label: {
            "after_switch_s": round(statistics.median(switched[i]), 4),
            "repeat_s": round(statistics.median(repeated[i]), 4),
            "switch_adds_s": round(statistics.median(switched[i]) - statistics.median(repeated[i]), 4),
        }
        for label, i in zip(cfg.switch_strategies, (a, b))
    }
    return out


# ----------------------------------------------------------------------------- PyTorch DTensor + FSDP2
def _parallelize(model: Llama, dp: int, tp: int) -> None:
    """Megatron-style TP on the ``tp`` mesh dim, then FSDP2 over ``dp`` (torchtitan's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        plan = {name: ColwiseParallel() for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj",
                                                     "mlp.gate_proj", "mlp.up_proj")}
        plan.update({"attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for block in model.layers:
            parallelize_module(block, mesh["tp"], plan)
            block.attn.heads //= tp  # each rank holds heads / tp query and kv heads
            block.attn.kv_heads //= tp
    if dp > 1:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def _torch_dtensor(cfg: BenchConfig, batch: list[torch.Tensor], dp: int, tp: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    model = Llama(cfg.model_config())
    _parallelize(model, dp, tp)
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    per = cfg.batch // dp
    dp_rank = dist.get_rank() // tp
    ids = torch.stack(batch)[dp_rank * per : (dp_rank + 1) * per]
    targets = dense_targets(ids)

    def step() -> float:
        logits = model(ids)
        if tp > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
                loss.backward()
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        value = value.detach().reshape(1).to(torch.float64)
        dist.all_reduce(value)  # equal tokens per dp rank: the mean of dp means is the global mean
        return float(value) / dist.get_world_size()

    seconds, losses = _timed_steps(step, cfg.warmup + cfg.steps)
    return _summary(seconds, losses, cfg.warmup)


# ----------------------------------------------------------------------------- one process
def _single(cfg: BenchConfig, batch: list[torch.Tensor]) -> dict:
    model = Llama(cfg.model_config())
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER)
    ids = torch.stack(batch)
    targets = dense_targets(ids)
    seconds, losses = [], []
    for _ in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().item())
        seconds.append(time.perf_counter() - start)
    return _summary(seconds, losses, cfg.warmup)


def _rank_main(cfg: BenchConfig) -> dict:
    """What every rank runs inside ``hgraph.launch``."""
    import torch.distributed as dist

    batch = make_batch(cfg)
    out = {"hgraph": _hgraph(cfg, batch), "torch": {}}
    for label, dp, tp in cfg.baselines:
        out["torch"][label] = _torch_dtensor(cfg, batch, dp, tp)
    if cfg.single:
        out["single"] = _single(cfg, batch) if dist.get_rank() == 0 else None
        dist.barrier()
    return out


def run(cfg: BenchConfig) -> dict:
    """Launch ``cfg.world`` gloo ranks, run everything, return the report (rank 0's timings)."""
    for label, dp, tp in cfg.baselines:
        if dp * tp != cfg.world or cfg.batch % dp:
            raise hgraph.errors.InputError(
                f"baseline {label!r}: dp={dp} x tp={tp} must equal world={cfg.world} and dp must divide "
                f"batch={cfg.batch}"
            )
    start = time.perf_counter()
    result = hgraph.launch(_rank_main, cfg.world, (cfg,), timeout=cfg.timeout)[0]
    hg, th = result["hgraph"], result["torch"]
    report: dict = {"config": asdict(cfg), "model": str(cfg.model_config()),
                    "tokens_per_step": cfg.batch * cfg.seq, "hgraph": hg, "torch_dtensor_fsdp2": th}
    report["hgraph_over_torch"] = {
        label: round(hg["strategies"][label]["step_s"] / th[label]["step_s"], 3)
        for label in th if label in hg["strategies"]
    }
    losses = {"hgraph": hg["first_loss"], **{f"torch {k}": v["first_loss"] for k, v in th.items()}}
    if cfg.single:
        single = result["single"]
        report["single_process"] = single
        report["scaling_single_over_hgraph"] = {
            label: round(single["step_s"] / s["step_s"], 3) for label, s in hg["strategies"].items()
        }
        report["scaling_single_over_torch"] = {
            label: round(single["step_s"] / s["step_s"], 3) for label, s in th.items()
        }
        losses["single"] = single["first_loss"]
    report["first_losses"] = losses
    report["first_losses_agree"] = max(losses.values()) - min(losses.values()) < 1e-4
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


TINY = BenchConfig(
    vocab=128, hidden=64, layers=2, heads=4, kv_heads=4, ffn=128, batch=4, seq=32, warmup=1, steps=2,
    world=2, strategies=("2x tp1", "tp2"), baselines=(("2x tp1", 2, 1), ("tp2", 1, 2)),
    switch_strategies=("2x tp1", "tp2"), timeout=120.0,
)


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv``, run, print the report as one JSON object and return it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2-rank smoke configuration")
    for name in ("steps", "warmup", "batch", "seq"):
        parser.add_argument(f"--{name}", type=int, help=f"override {name}")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else BenchConfig()
    cfg = replace(cfg, **{k: v for k, v in vars(args).items() if k != "tiny" and v is not None})
    report = run(cfg)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
