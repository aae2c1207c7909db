"""The model a ``hgraph train`` config names (``model = ...``): a factory, an HF config or an HF checkpoint
(a local folder or a hub id in the local HF cache)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hgraph.core.model_info import model_dims
from hgraph.data.hub import local_or_cached
from hgraph.errors import InputError
from hgraph.models import load_factory

__all__ = ["ModelSpec", "model_vocab"]


@dataclass(frozen=True)
class ModelSpec:
    """The config's ``model``: ``module:factory``, an HF ``config.json`` (random init with ``seed``)
    or an HF checkpoint directory: a local one or a hub id (``"gpt2"``, ``"org/name"``) in the local HF
    cache (``hgraph.data.hub``). Picklable, for the ranks.

    ``meta=True`` (what ``hgraph train`` uses): an HF config or a checkpoint directory with
    safetensors weights is built on the meta device (no storage); the Trainer then reads the
    checkpoint by slices (``weights``) or initialises the model layer by layer from ``seed``. With
    ``meta=False`` (profiling) HF models are built eagerly: ``from_pretrained`` or ``from_config``
    after ``torch.manual_seed(seed)``."""

    spec: str
    seed: int = 0
    meta: bool = False

    @property
    def path(self) -> Path:
        """The local file or folder: the spec itself, or a hub id's snapshot in the HF cache."""
        if ":" in self.spec:  # module:factory (or a local path with a colon)
            return Path(os.path.expanduser(self.spec))
        return local_or_cached(self.spec, "model")

    @property
    def weights(self) -> Optional[str]:
        """The checkpoint directory the Trainer reads by slices (a directory with safetensors weights)."""
        p = self.path
        return str(p) if p.is_dir() and any(p.glob("*.safetensors")) else None

    def __call__(self) -> torch.nn.Module:
        p = self.path
        if ":" in self.spec and not p.exists():
            return load_factory(self.spec)()
        import transformers

        if p.is_dir():
            if not (p / "config.json").is_file():
                raise InputError(f"model {self.spec}: the directory has no config.json")
            if self.weights is not None and self.meta:
                config = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
                return self._from_config(transformers, config)
            if self.weights is not None or any(p.glob("pytorch_model*.bin")):
                return transformers.AutoModelForCausalLM.from_pretrained(
                    str(p), local_files_only=True, attn_implementation="sdpa", use_cache=False).eval()
            p = p / "config.json"
        if not p.is_file():
            raise InputError(f"model {self.spec!r}: not 'module:factory', an HF config.json, a checkpoint directory "
                             "or a hub id")
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
            config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
        except (KeyError, ValueError) as exc:
            raise InputError(f"model {self.spec}: not an HF model config ({exc})") from None
        return self._from_config(transformers, config)

    def _from_config(self, transformers: Any, config: Any) -> torch.nn.Module:
        config.use_cache = False
        if self.meta:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def model_vocab(model: torch.nn.Module) -> Optional[int]:
    return model_dims(model).get("vocab")

