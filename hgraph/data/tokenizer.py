"""Tokenizers from local files: an HF ``tokenizers`` JSON file or an ``AutoTokenizer`` directory (local, or
a hub id in the local HF cache)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from hgraph.data.hub import local_or_cached
from hgraph.errors import InputError


class TextTokenizer:
    """Text to token ids with the tokenizer at ``path``; ``eos_id`` is appended to each document."""

    def __init__(self, path: str, backend: Any, vocab_size: int, eos_id: Optional[int]) -> None:
        self.path = path
        self._backend = backend
        self.vocab_size = vocab_size
        self.eos_id = eos_id

    def __str__(self) -> str:
        return f"tokenizer {self.path} (vocab {self.vocab_size}, eos {self.eos_id})"

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added; the loader appends ``eos_id``)."""
        if hasattr(self._backend, "encode_batch"):  # tokenizers.Tokenizer
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return self._backend(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids))

    def check_vocab(self, model_vocab: Optional[int], where: str = "tokenizer") -> None:
        """``InputError`` when the tokenizer can emit ids the model's embedding does not have."""
        if model_vocab is not None and self.vocab_size > model_vocab:
            raise InputError(f"{where}: {self.path} has {self.vocab_size} tokens but the model's vocabulary "
                             f"is {model_vocab}; use a smaller tokenizer or a model with vocab_size >= "
                             f"{self.vocab_size}")


def load_tokenizer(path: str, eos_token: Optional[str] = None) -> TextTokenizer:
    """``path``: a ``tokenizer.json`` written by ``tokenizers``, an HF tokenizer directory, or a hub id
    (``"gpt2"``) in the local HF cache."""
    p = str(local_or_cached(str(path), "tokenizer"))
    if not os.path.exists(p):
        raise InputError(f"tokenizer {path!r}: no such file or directory")
    if os.path.isfile(p):
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(p)
        except Exception as exc:  # noqa: BLE001 - the Rust error text names the problem
            raise InputError(f"tokenizer {path}: not a tokenizers JSON file ({exc})") from None
        vocab = tok.get_vocab_size(with_added_tokens=True)
        name = eos_token or next((t for t in ("<|endoftext|>", "</s>", "<eos>") if tok.token_to_id(t) is not None),
                                 None)
        eos = tok.token_to_id(name) if name else None
        return TextTokenizer(p, tok, vocab, eos)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"tokenizer {path}: cannot load it with AutoTokenizer ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]})") from None
    eos = tok.convert_tokens_to_ids(eos_token) if eos_token else tok.eos_token_id
    return TextTokenizer(p, tok, len(tok), eos)
