"""Profiling ``T(l)`` of a model on this machine: the default model and lengths, and ``profile_cost_model``.

The command is ``hgraph profile`` (``hgraph.cli.profile_cli``). In this process (no ``--world-size``):
``hgraph.profiling.profile_single`` times the model and its first block and fits the ``tp1,ppN`` schemes.

Multi-rank (``--world-size N``, and ``profile_cost_model`` for Python callers such as the demo): every
scheme, tensor-parallel ones included, is measured on N real local gloo ranks through the compiled
runtime; see ``hgraph.profiling.profile_ranks`` and ``hgraph.profiling.ranks_table`` for what
``T(l)`` and ``A_tp`` mean there.

Measurements are cached under ``$HGRAPH_CACHE`` (default ``~/.cache/hgraph``), keyed by model, lengths,
device, dtype and repeats; ``--no-cache`` measures again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hgraph.core.degrees import Degrees
from hgraph.models import Llama, LlamaConfig
from hgraph.planner.cost import CostModel
from hgraph.profiling.profile_ranks import profile_ranks

DEFAULT_MODEL = "hgraph.profiling.profile:default_model"
DEFAULT_LENGTHS = (64, 128, 256, 512, 768, 1024)
DEFAULT_RANK_LENGTHS = (64, 128, 256, 512)  # --world-size: several schemes on shared cores, keep it short


def default_model() -> Any:
    """The small Llama-style model profiled when ``--model`` is not given (~1M parameters)."""
    return Llama(
        LlamaConfig(vocab_size=1024, hidden=128, layers=4, heads=4, kv_heads=4, ffn=352, max_positions=8192)
    )


def profile_cost_model(
    model_factory: str | Callable[[], Any],
    world_size: int,
    schemes: Sequence[Degrees | str],
    lengths: Sequence[int],
    **options: Any,
) -> CostModel:
    """The cost model measured on ``world_size`` local gloo ranks (what the demo plans with).

    Arguments and options as ``hgraph.profiling.profile_ranks.profile_ranks`` (``repeats``,
    ``memory_gb``, ``use_cache``, ``name``, ``timeout``, ``measure``), which also returns the fits and
    timings.
    """
    return profile_ranks(model_factory, world_size, schemes, lengths, **options).cost_model
