"""The ops compiled local programs call, in one namespace: ``hgraph.runtime.ops.<name>``.

Four modules define them (and register the ``torch.ops.hgraph.*`` custom ops on import):

* ``hgraph.runtime.collectives``: all_reduce, reduce_scatter, all_gather, split, all_to_all,
  grad_all_reduce, all_reduce_max, each with its exact adjoint (the table is in that module);
* ``hgraph.runtime.vocab_parallel``: Megatron's vocab-parallel embedding and cross entropy;
* ``hgraph.runtime.packed_attention``: causal attention over packed sequences, and ``own_kv_heads``;
* ``hgraph.runtime.linear_attention``: Gated DeltaNet's delta rule and causal convolutions over
  packed sequences.

``load_balance_indices`` (the cp token layout) lives in ``hgraph.batch``.
"""

from hgraph.batch import load_balance_indices
from hgraph.runtime.collectives import (
    active_context,
    all_gather,
    all_reduce,
    all_reduce_max,
    all_to_all,
    entered,
    grad_all_reduce,
    reduce_scatter,
    split,
)
from hgraph.runtime.linear_attention import packed_causal_conv1d, packed_gated_delta_rule
from hgraph.runtime.packed_attention import own_kv_heads, packed_attention
from hgraph.runtime.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding

__all__ = [
    "active_context",
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "all_to_all",
    "entered",
    "grad_all_reduce",
    "load_balance_indices",
    "own_kv_heads",
    "packed_attention",
    "packed_causal_conv1d",
    "packed_gated_delta_rule",
    "reduce_scatter",
    "split",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
]
