"""Streaming a generated 1 GB JSON Lines corpus through ``hgraph.data`` with flat resident memory
(prints JSON).

    python benchmarks/data_stream_bench.py [--gb 1.0] [--tokens 20000000] [--quick]

Generates ``--gb`` GB of JSON Lines documents (code-like text, log-normal lengths with a heavy
tail) under /tmp, then (1) streams every document of it through ``DocumentSource`` (HF
``datasets`` streaming) and (2) reads batches through ``TokenLoader`` (the stdlib BPE, context
1024, 64K-token batches) until ``--tokens`` tokens, sampling this process's resident set size
(VmRSS) as it goes; the file is deleted at the end. Tokenizing is the slow part (a byte-level BPE
runs at ~1-2 MB/s per core here), so (2) covers a prefix by default; ``--tokens 0`` tokenizes the
whole corpus. Flat memory: the RSS at the end minus the RSS after the first tenth stays small next
to the corpus size.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "value", "items",
         "result", "path", "name", "args", "kwargs", "print", "len", "range", "data", "index", "0", "1", "=", "+")


def generate(path: Path, size: int, seed: int = 0) -> int:
    """Write about ``size`` bytes of JSON Lines documents; returns the number of documents."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(4096)]
    written = docs = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < size:
            n = max(1, int(rng.lognormvariate(4.0, 1.2)))  # lines per document: median ~55, heavy tail
            text = "\n".join(lines[rng.randrange(4096)] for _ in range(min(n, 20000)))
            row = json.dumps({"id": docs, "text": text}) + "\n"
            fh.write(row)
            written += len(row)
            docs += 1
    return docs


def sampled(items, every: int, count) -> tuple[list[dict], float]:
    """Consume ``items``, sampling RSS every ``every`` items; ``count(item)`` adds to the total."""
    samples, total, n, t0 = [], 0, 0, time.perf_counter()
    for item in items:
        total += count(item)
        n += 1
        if n % every == 0:
            samples.append({"items": n, "total": total, "rss_mb": round(rss_mb(), 1),
                            "s": round(time.perf_counter() - t0, 1)})
    return samples, time.perf_counter() - t0


def summary(samples: list[dict], seconds: float, rss_before: float) -> dict:
    end = rss_mb()
    settled = samples[len(samples) // 10]["rss_mb"] if samples else rss_before
    return {"seconds": round(seconds, 1), "items": samples[-1]["items"] if samples else 0,
            "rss_mb": {"before": round(rss_before, 1), "after_first_tenth": settled,
                       "peak": max([s["rss_mb"] for s in samples] + [round(end, 1)]), "end": round(end, 1),
                       "growth_after_first_tenth": round(end - settled, 1)},
            "samples": samples[:: max(1, len(samples) // 10)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokenize this many (0: all)")
    parser.add_argument("--quick", action="store_true", help="a 50 MB corpus, 2M tokens")
    args = parser.parse_args()
    size = int((0.05 if args.quick else args.gb) * 1e9)
    limit = 2_000_000 if args.quick else args.tokens
    from hgraph.data import DocumentSource, TokenLoader, stdlib_tokenizer

    tok = stdlib_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="hgraph-stream-bench-"))
    path = tmp / "corpus.jsonl"
    try:
        t0 = time.perf_counter()
        docs = generate(path, size)
        gen_s = time.perf_counter() - t0
        source = DocumentSource.from_paths([str(path)], "jsonl")
        before = rss_mb()
        samples, seconds = sampled(source.documents(), 2000, len)
        documents = summary(samples, seconds, before)
        documents["chars"] = samples[-1]["total"] if samples else 0
        documents["mb_per_s"] = round(path.stat().st_size / 1e6 / seconds, 1)
        loader = TokenLoader(source, tok, context=1024, tokens_per_batch=65536, window=512, max_epochs=1)

        def batches():
            tokens = 0
            for batch in loader:
                yield batch
                tokens += sum(len(s) for s in batch)
                if limit and tokens >= limit:
                    return

        before = rss_mb()
        samples, seconds = sampled(batches(), 10, lambda b: sum(len(s) for s in b))
        tokenized = summary(samples, seconds, before)
        tokenized["tokens"] = samples[-1]["total"] if samples else 0
        tokenized["tokens_per_s"] = round(tokenized["tokens"] / seconds)
        print(json.dumps({"benchmark": "data_stream", "corpus_bytes": path.stat().st_size, "documents": docs,
                          "generate_s": round(gen_s, 1), "stream_documents": documents,
                          "token_batches": tokenized}, indent=1))
    finally:
        path.unlink(missing_ok=True)
        tmp.rmdir()


if __name__ == "__main__":
    main()
