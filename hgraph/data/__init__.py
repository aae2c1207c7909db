"""``hgraph.data``: local documents, tokenized and batched to a token budget, resumable exactly.

``DocumentSource`` (text / lines / JSON Lines / Parquet files, streamed through HF ``datasets``),
``load_tokenizer`` (a ``tokenizers`` JSON file, an ``AutoTokenizer`` directory or a cached hub id),
``TokenLoader`` (seeded global batches filled to a token budget; ``state_dict`` for resume) and the
embedded corpus ``stdlib_corpus`` (the running interpreter's standard library, with a locally
trained byte-level BPE). Package data: the bundled Wikipedia length sample.
"""

from hgraph.data.documents import DocumentSource, expand_paths
from hgraph.data.loader import DataPosition, TokenLoader
from hgraph.data.stdlib import stdlib_corpus, stdlib_tokenizer
from hgraph.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["DataPosition", "DocumentSource", "TextTokenizer", "TokenLoader", "expand_paths", "load_tokenizer",
           "stdlib_corpus", "stdlib_tokenizer"]
