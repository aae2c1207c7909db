"""The supported-models table: every ``hgraph.models.zoo`` family × strategy kind, checked against the model.

    python benchmarks/model_zoo.py [--families llama,gpt2] > zoo.jsonl
    python benchmarks/model_zoo.py --markdown zoo.jsonl      # the README table from those lines

Prints one JSON object per (family, strategy): ``equal`` (``simulate`` loss and every gradient equal
to the unmodified model, fp32, rtol 1e-5) or the HGraphError raised, then a summary with the count of
``wrong`` (silent mismatches, which must be 0).
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


def markdown(results: list[ZooResult]) -> str:
    kinds = {v: k for k, v in STRATEGY_KINDS.items()}
    lines = ["| family | " + " | ".join(f"{k} (`{v}`)" for k, v in STRATEGY_KINDS.items()) + " |",
             "|---" * (len(STRATEGY_KINDS) + 1) + "|"]
    by_family: dict[str, dict[str, ZooResult]] = {}
    for r in results:
        by_family.setdefault(r.family, {})[kinds.get(r.strategy, r.strategy)] = r
    for family, row in by_family.items():
        lines.append(f"| {FAMILIES[family].config.removesuffix('Config')} | "
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
        print(markdown([ZooResult(r["family"], r["strategy"], r["status"], r["detail"]) for r in rows
                        if "family" in r]))
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
                              "detail": r.detail, "seconds_family": seconds}), flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("equal", "error", "wrong")}
    print(json.dumps({"summary": counts}))


if __name__ == "__main__":
    main()
