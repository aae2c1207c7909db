"""Global batches of token sequences, filled to a token budget in a seeded order, resumable exactly.

Order: each epoch streams the documents (files in a seeded order, see ``documents.py``) in windows
of ``window`` documents; a window is tokenized, documents longer than ``context`` are split into
``context``-token pieces (or cut to one, ``long_documents="cut"``), and the pieces are shuffled with
a seed derived from ``(seed, epoch, window)``. Batches take pieces in that order until the next one
would pass ``tokens_per_batch``. So the data position is three integers — epoch, window, pieces of
the window already used — and a loader restored from ``state_dict()`` re-reads its window and
yields exactly the batches an uninterrupted loader yields. Memory: one window of tokens.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch

from hgraph.errors import InputError
from hgraph.data.documents import DocumentSource
from hgraph.data.tokenizer import TextTokenizer

LONG_DOCUMENTS = ("split", "cut")


@dataclass(frozen=True)
class DataPosition:
    """Where the next batch starts: ``position`` pieces into ``window`` of ``epoch``."""

    epoch: int = 0
    window: int = 0
    position: int = 0

    def __str__(self) -> str:
        return f"epoch {self.epoch}, window {self.window}, piece {self.position}"


class TokenLoader:
    """Batches (lists of 1-D LongTensors) of the documents of ``source``; see the module docstring."""

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: TextTokenizer,
        context: int,
        tokens_per_batch: int,
        seed: int = 0,
        long_documents: str = "split",
        window: int = 256,
        append_eos: bool = True,
        max_epochs: Optional[int] = None,
    ) -> None:
        if context < 2:
            raise InputError(f"context={context}: a sequence needs at least 2 tokens")
        if tokens_per_batch < context:
            raise InputError(f"tokens_per_batch={tokens_per_batch} is below context={context}; "
                             "a batch must hold at least one full-length sequence")
        if long_documents not in LONG_DOCUMENTS:
            raise InputError(f"long_documents={long_documents!r}; use one of {LONG_DOCUMENTS}")
        if window < 1:
            raise InputError(f"window={window} must be >= 1 document")
        self.source = source
        self.tokenizer = tokenizer
        self.context = context
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.long_documents = long_documents
        self.window = window
        self.append_eos = append_eos
        self.max_epochs = max_epochs
        self.position = DataPosition()
        self._cached: Optional[tuple[tuple[int, int], Optional[list[list[int]]]]] = None
        self._live: Optional[tuple[int, int, Iterator[str]]] = None  # epoch, next document, stream

    def __str__(self) -> str:
        return (f"TokenLoader({self.source}, {self.tokenizer}, context {self.context}, "
                f"{self.tokens_per_batch} tokens/batch, seed {self.seed}, at {self.position})")

    # ------------------------------------------------------------------ pieces
    def pieces_of(self, ids: list[int]) -> list[list[int]]:
        """A document's token ids as sequences of 2..``context`` tokens."""
        if self.append_eos and self.tokenizer.eos_id is not None:
            ids = ids + [self.tokenizer.eos_id]
        if self.long_documents == "cut":
            ids = ids[: self.context]
        parts = [ids[i : i + self.context] for i in range(0, len(ids), self.context)]
        return [p for p in parts if len(p) >= 2]

    def _documents(self, epoch: int, start: int, count: int) -> list[str]:
        """Documents ``start .. start+count`` of ``epoch`` (fewer at the end of the corpus)."""
        if self._live is None or self._live[:2] != (epoch, start):
            self._live = (epoch, start, self.source.documents(epoch, self.seed, skip=start))
        stream = self._live[2]
        docs = []
        for text in stream:
            docs.append(text)
            if len(docs) == count:
                break
        self._live = (epoch, start + len(docs), stream)
        return docs

    def _window_pieces(self, epoch: int, window: int) -> Optional[list[list[int]]]:
        """The shuffled pieces of one window; ``None`` past the end of the corpus."""
        key = (epoch, window)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        docs = self._documents(epoch, window * self.window, self.window)
        pieces: Optional[list[list[int]]] = None
        if docs:
            pieces = [p for ids in self.tokenizer.encode_batch(docs) for p in self.pieces_of(ids)]
            random.Random(f"{self.seed}:{epoch}:{window}").shuffle(pieces)
        self._cached = (key, pieces)
        return pieces

    # ------------------------------------------------------------------ batches
    def next_batch(self) -> list[torch.Tensor]:
        """The next global batch; ``StopIteration`` after ``max_epochs`` epochs."""
        pos = self.position
        epoch, window, used = pos.epoch, pos.window, pos.position
        batch: list[list[int]] = []
        tokens = 0
        while True:
            if self.max_epochs is not None and epoch >= self.max_epochs:
                break
            pieces = self._window_pieces(epoch, window)
            if pieces is None:
                if window == 0:
                    raise InputError(f"{self.source}: the corpus is empty (no document of 2 or more tokens "
                                     f"with {self.tokenizer})")
                epoch, window, used = epoch + 1, 0, 0
                continue
            while used < len(pieces):
                n = len(pieces[used])
                if batch and tokens + n > self.tokens_per_batch:
                    self.position = DataPosition(epoch, window, used)
                    return [torch.tensor(p, dtype=torch.long) for p in batch]
                batch.append(pieces[used])
                tokens += n
                used += 1
            window, used = window + 1, 0
        self.position = DataPosition(epoch, window, used)
        if not batch:
            raise StopIteration
        return [torch.tensor(p, dtype=torch.long) for p in batch]

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return

    def first_batches(self, limit: int) -> list[list[torch.Tensor]]:
        """Up to ``limit`` batches of the first epoch from the start (a fixed held-out set); the
        loader's own position is left alone."""
        other = TokenLoader(self.source, self.tokenizer, self.context, self.tokens_per_batch, self.seed,
                            self.long_documents, self.window, self.append_eos, max_epochs=1)
        out = []
        for batch in other:
            out.append(batch)
            if len(out) == limit:
                break
        return out

    # ------------------------------------------------------------------ resume
    def _identity(self) -> dict[str, Any]:
        return {"files": len(self.source.files), "first_file": self.source.files[0], "format": self.source.format,
                "tokenizer_vocab": self.tokenizer.vocab_size, "context": self.context,
                "tokens_per_batch": self.tokens_per_batch, "seed": self.seed,
                "long_documents": self.long_documents, "window": self.window, "append_eos": self.append_eos}

    def state_dict(self) -> dict[str, Any]:
        """The data position and what it is a position in (JSON-serialisable)."""
        return {"position": asdict(self.position), "loader": self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ``InputError`` if it was saved by a loader over other data or order."""
        saved = state.get("loader", {})
        mine = self._identity()
        diff = sorted(k for k in mine if saved.get(k) != mine[k])
        if diff:
            detail = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}" for k in diff)
            raise InputError(f"the data state was saved for another corpus or order ({detail}); "
                             "resume with the same data settings")
        self.position = DataPosition(**state["position"])
