"""Hugging Face hub ids (``"gpt2"``, ``"org/name"``) as local folders: the snapshot in the local HF cache.

hgraph never downloads: ranks read models and tokenizers from disk, and a missing id is an
``InputError`` that says how to fetch it (``hf download ID``) or where the cache is looked for
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from hgraph.errors import InputError

__all__ = ["hub_cache_dir", "is_hub_id", "local_or_cached"]


def hub_cache_dir() -> str:
    """The HF hub cache, from the environment as it is now (``huggingface_hub`` reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def is_hub_id(text: str) -> bool:
    """Whether ``text`` reads as a hub repo id (``name`` or ``org/name``) rather than a file name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if text.endswith(".json") or text.startswith(("~", ".")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def local_or_cached(spec: str, what: str, revision: Optional[str] = None) -> Path:
    """``spec`` as a local path when it exists or is no hub id; a hub id as its snapshot folder in the HF
    cache. ``InputError`` naming the id and the fetch command when the cache lacks it."""
    path = Path(os.path.expanduser(spec))
    if path.exists() or not is_hub_id(spec):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(spec, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise InputError(f"{what} {spec!r}: no such file or directory, nor a hub id in the HF cache {cache}; "
                         f"fetch it with `hf download {spec}` (or set HF_HOME / HF_HUB_CACHE to a cache "
                         f"that has it)") from None
