"""The supported-models table: every ``hgraph.models.zoo`` family × strategy kind, packed, checked against the model.

    python benchmarks/model_zoo.py [--families llama,gpt2] > zoo.jsonl
    python benchmarks/model_zoo.py --markdown zoo.jsonl      # the README table from those lines

Prints one JSON object per (family, strategy): ``equal`` (``simulate`` of documents of different
lengths, dispatched and packed as ``Trainer.step`` packs them, gives the loss and every gradient of the
unmodified model run on each document alone, fp32, rtol 1e-5) or the HGraphError raised, and
``packing``: what the packing proof decided (``packed (graph)``, ``packed (probe)``, ``one document
per micro-batch``, ``refused``); then a summary with the count of ``wrong`` (silent mismatches, which
must be 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
import warnings

from hgraph.cli.zoo_check import STRATEGY_KINDS, ZooResult, check_family
from hgraph.models.zoo import FAMILIES


def cell(result: ZooResult) -> str:
    if result.status == "equal":
        return "equal"
    if result.status == "wrong":
        return f"**WRONG** ({result.detail})"
    op = re.search(r"(aten\.\w+\.\w+|hgraph\.[\w.]+)", result.detail)
    reason = "no rule" if "no sharding rule" in result.detail else "refused"
    if "context parallelism" in result.detail or "sharded tokens" in result.detail:
        reason = "needs the whole sequence"
    return f"error: {op.group(1) if op else result.detail[:40]} ({reason})"


PACKING = {"packed (graph)": "exact (proved from the graph)", "packed (probe)": "exact (proved by probing)",
           "one document per micro-batch": "one document per micro-batch", "refused": "refused"}


def packing_cell(row: dict[str, ZooResult]) -> str:
    """What training does with the family's documents: the proof's verdict, the same on every strategy."""
    labels = [r.packing for r in row.values() if r.packing]
    return PACKING.get(labels[0], labels[0]) if labels else "-"


def markdown(results: list[ZooResult]) -> str:
    kinds = {v: k for k, v in STRATEGY_KINDS.items()}
    lines = ["| family | packing | " + " | ".join(f"{k} (`{v}`)" for k, v in STRATEGY_KINDS.items()) + " |",
             "|---" * (len(STRATEGY_KINDS) + 2) + "|"]
    by_family: dict[str, dict[str, ZooResult]] = {}
    for r in results:
        by_family.setdefault(r.family, {})[kinds.get(r.strategy, r.strategy)] = r
    for family, row in by_family.items():
        lines.append(f"| {FAMILIES[family].config.removesuffix('Config')} | {packing_cell(row)} | "
                     + " | ".join(cell(row[k]) for k in STRATEGY_KINDS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--markdown", metavar="JSONL", help="print the README table from a previous run")
    args = parser.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(markdown([ZooResult(r["family"], r["strategy"], r["status"], r["detail"], r.get("packing", ""))
                        for r in rows if "family" in r]))
        return
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    results: list[ZooResult] = []
    for family in args.families.split(","):
        start = time.perf_counter()
        rows = check_family(family)
        results += rows
        seconds = round(time.perf_counter() - start, 1)
        for r in rows:
            print(json.dumps({"family": r.family, "strategy": r.strategy, "status": r.status,
                              "detail": r.detail, "packing": r.packing, "seconds_family": seconds}), flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("equal", "error", "wrong")}
    print(json.dumps({"summary": counts}))


if __name__ == "__main__":
    main()
