"""Plan a few iterations without training: load a cost table and a length file, print the plans.

    python examples/plan_only.py --cost-table llama7b_a800 --gpus 64 --iterations 3
"""

import argparse

from hgraph.planner import Planner, load_cost_model, make_batches, propose, read_lengths, sample_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-table", default="llama7b_a800")
    parser.add_argument("--lengths", default=str(sample_path()))
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--max-len", type=int, default=32_768)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()

    cost_model = load_cost_model(args.cost_table)
    lengths = read_lengths(args.lengths)
    candidates = propose(cost_model, args.gpus, lengths, max_len=args.max_len, tokens_per_iteration=args.tokens)
    planner = Planner(cost_model, candidates)
    for batch in make_batches(lengths, args.tokens, args.max_len, args.iterations):
        print(planner.plan(batch))


if __name__ == "__main__":
    main()
