"""Train the hand-written Llama-style model with hgraph, switching strategies every iteration.

    python examples/train_llama.py                 # spawns 4 local gloo ranks itself
    torchrun --nproc-per-node 4 examples/train_llama.py   # one process per rank (NCCL on GPUs)
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_llama.py --checkpoint-dir ckpt
                                                   # a lost rank costs a restart, not the run

Every rank builds the same model (same seed), compiles it for a few strategies, and trains on the
same synthetic batches; each iteration runs on the next strategy in the list. With
``--checkpoint-dir`` it writes a checkpoint every ``--checkpoint-interval`` iterations (in the
background) and, when started again (by hand, or by torchrun after a rank died), continues from the
newest one exactly; SIGTERM makes every rank finish its iteration, checkpoint and exit 0.
``--out DIR`` writes the trained weights to ``DIR/model.safetensors``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.runtime import preemption
from hgraph.runtime.checkpoint_manager import CheckpointManager

STRATEGIES = ["tp2 + 2x tp1", "4x tp1", "tp2,pp2", "2x tp1,pp2", "tp4"]


def batches(iterations: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(iterations):
        lengths = torch.randint(8, 64, (8,), generator=g)
        out.append([torch.randint(0, 256, (int(n),), generator=g) for n in lengths])
    return out


def train(iterations: int = 5, strategies: tuple[str, ...] = tuple(STRATEGIES), checkpoint_dir: Optional[str] = None,
          checkpoint_interval: int = 2, out: Optional[str] = None) -> list[float]:
    """Runs on every rank; returns the losses of the iterations it trained."""
    preemption.install()  # SIGTERM: finish the iteration, checkpoint, return
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2, kv_heads=4))  # tp4 needs 4 key/value heads
    compiled = hgraph.compile(model, list(strategies), example_inputs=torch.randint(0, 256, (1, 16)))
    trainer = hgraph.Trainer(compiled,
                             optimizer=hgraph.AdamWConfig(lr=3e-3, weight_decay=0.01, grad_clip=1.0))
    checkpoints = CheckpointManager(checkpoint_dir, interval=checkpoint_interval) if checkpoint_dir else None
    if checkpoints is not None and checkpoints.resume(trainer) is not None and trainer.rank == 0:
        print(f"resumed at iteration {trainer.iteration}", flush=True)
    data, losses = batches(iterations), []
    for i in range(trainer.iteration, iterations):  # a resumed run skips the batches it trained on
        loss = trainer.step(data[i], strategy=i % len(compiled.strategies))
        losses.append(loss)
        if trainer.rank == 0:
            print(f"iter {i} loss {loss:.4f} strategy {compiled.strategies[i % len(compiled.strategies)]}", flush=True)
        if checkpoints is not None:
            checkpoints.step(trainer)
        if trainer.stop_requested:  # some rank got SIGTERM: all stop after this iteration
            if checkpoints is not None and trainer.iteration % checkpoint_interval:
                checkpoints.save(trainer)
            break
    if checkpoints is not None:
        checkpoints.close()  # the last write is complete
    if out is not None and not trainer.stop_requested:
        state = trainer.state_dict()
        if trainer.rank == 0:
            from safetensors.torch import save_file

            Path(out).mkdir(parents=True, exist_ok=True)
            save_file(state, str(Path(out) / "model.safetensors"))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=4, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, help="e.g. 'tp2' '2x tp1'")
    parser.add_argument("--checkpoint-dir", help="checkpoint here, and resume from the newest checkpoint in it")
    parser.add_argument("--checkpoint-interval", type=int, default=2)
    parser.add_argument("--out", help="write the trained weights to OUT/model.safetensors")
    args = parser.parse_args()
    run = (args.iterations, tuple(args.strategies), args.checkpoint_dir, args.checkpoint_interval, args.out)
    if "RANK" in os.environ:  # started by torchrun
        hgraph.init_from_env()  # NCCL when CUDA is available, else gloo
        train(*run)
    else:
        hgraph.launch(train, args.world_size, args=run, timeout=600, preemptible=True)


if __name__ == "__main__":
    main()
