"""Look inside a compiled program: the three kinds of communication subgraphs and the stage code.

    python examples/inspect_graph.py
"""

from __future__ import annotations

from collections import defaultdict

import torch

import hgraph
from hgraph.models import Llama, LlamaConfig
from hgraph.schedule.actions import format_actions


def main() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(layers=2))
    compiled = hgraph.compile(model, ["tp2,pp2", "tp2 + 2x tp1"], example_inputs=torch.randint(0, 256, (1, 16)))
    for strategy, rank in ((0, 0), (0, 2), (1, 3)):
        records = compiled.subgraphs(strategy, rank)
        by_kind = defaultdict(list)
        for r in records:
            by_kind[r.kind].append(r)
        print(f"\n=== strategy {compiled.strategies[strategy]}, rank {rank}")
        for kind in ("pull_parameter", "communicate_activation", "push_gradient"):
            items = by_kind.get(kind, [])
            print(f"{kind}: {len(items)} subgraphs, {sum(r.bytes for r in items)} bytes")
            for r in items[:3]:
                print("   ", r)
    program = compiled.program(0, 0)
    print("\nstage 0 program of rank 0 (first lines):")
    print("\n".join(program.stage_graph.gm.code.strip().splitlines()[:12]))
    print("\n1F1B schedule of rank 0 with 4 micro-batches (hgraph.schedule.lowerings; program.actions(4) adds pulls and pushes):")
    print(format_actions(program.pipeline_actions(4)))
    print("pull plan of the embedding:\n" + str(program.pulls[0].pull.plan))


if __name__ == "__main__":
    main()
