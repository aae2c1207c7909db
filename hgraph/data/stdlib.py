"""The embedded corpus: the Python standard library of the running interpreter, and its BPE.

Documents: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``
excluded; the few test files that are deliberately not UTF-8 are left out) — about 1,800 files,
31 MB of real code with a heavy-tailed length distribution. No download. Held out: the files whose
path hash falls in the last ``1/HELD_OUT`` (about 5%), so the split is the same on every machine
with the same interpreter. Tokenizer: a byte-level BPE (``tokenizers``) with ``vocab_size`` tokens
(512 by default, ``<|endoftext|>`` included), trained on about ``TRAIN_BYTES`` (4 MB) of training
files on first use and cached under ``$HGRAPH_CACHE`` (default ``~/.cache/hgraph``); training takes a
few seconds on one core.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import sysconfig
from pathlib import Path

from hgraph.core import atomic_files
from hgraph.data.documents import DocumentSource
from hgraph.data.tokenizer import TextTokenizer, load_tokenizer

HELD_OUT = 20
TRAIN_BYTES = 4 << 20
EOS = "<|endoftext|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def cache_dir() -> Path:
    return Path(os.environ.get("HGRAPH_CACHE", Path.home() / ".cache" / "hgraph"))


def _is_held_out(root: Path, path: Path) -> bool:
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return digest[0] % HELD_OUT == HELD_OUT - 1


def stdlib_files() -> tuple[list[str], list[str]]:
    """(training files, held-out files) of the standard library, sorted."""
    root = stdlib_root()
    train, held = [], []
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts or not f.is_file():
            continue
        try:
            f.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue  # test data in other encodings (e.g. test/encoded_modules)
        (held if _is_held_out(root, f) else train).append(str(f))
    return train, held


def stdlib_corpus() -> tuple[DocumentSource, DocumentSource]:
    """The training and held-out documents (one per file)."""
    train, held = stdlib_files()
    return DocumentSource(tuple(train), "text"), DocumentSource(tuple(held), "text")


def stdlib_tokenizer(vocab_size: int = 512) -> TextTokenizer:
    """The byte-level BPE of the standard library (trained and cached on first use)."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    path = cache_dir() / f"stdlib-bpe-{version}-{vocab_size}.json"
    if not path.is_file():
        train_bpe(stdlib_files()[0], vocab_size, path)
    return load_tokenizer(str(path), EOS)


def train_bpe(files: list[str], vocab_size: int, path: Path, budget: int = TRAIN_BYTES, seed: int = 0) -> Path:
    """Train a byte-level BPE on a seeded sample of ``files`` (about ``budget`` bytes); write it
    atomically to ``path`` (ranks starting together may race; the last rename wins, same content)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    order = list(files)
    random.Random(seed).shuffle(order)
    sample, size = [], 0
    for f in order:
        if size >= budget:
            break
        sample.append(f)
        size += os.path.getsize(f)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(sample, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_files.atomic_path(path) as tmp:
        tok.save(str(tmp))
    return path
