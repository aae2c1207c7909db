"""Every sharding rule checked on PyTorch's own OpInfo samples (``op_db``), as DTensor checks its
rules: the calls each entry's samples reach (``opdb_samples``), every spec combination the rule accepts
on the 2x2 (cp, tp) mesh, forward and vjp in fp64 against the op on full tensors (``rule_harness``).

Default run: the entries of ``FAST_ENTRIES`` (together they reach every ATen op with a rule that any
entry reaches), their first sample as given and scaled, up to 6 spec combinations per call beyond
the ones always tried. Slow tier: every entry, its first 3 samples, 8 combinations.
A wrong result or any exception other than an ``HGraphError`` fails the entry; all of them are listed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("expecttest")  # op_db imports it (the test extra installs it)

from opdb_samples import calls, check_entry, entries  # noqa: E402

FAST_LIMIT = 6
SLOW_SAMPLES = 3
SLOW_LIMIT = 8

# A greedy cover, by op, of the entries whose first sample reaches an op with a rule (recomputed by
# ``test_fast_entries_reach_every_op``, slow tier, which names what is missing).
FAST_ENTRIES = (
    'T', '__getitem__', '__rand__', '__rmatmul__', '__ror__', '__rpow__', '__rsub__', 'abs', 'addcmul',
    'addmm', 'amax', 'amin', 'arange', 'argmax', 'argmin', 'baddbmm', 'bitwise_not', 'ceil', 'clamp',
    'clamp_max', 'clamp_min', 'clone', 'cos', 'cumsum', 'diff', 'div.floor_rounding', 'empty', 'empty_like',
    'eq', 'erf', 'exp', 'expand', 'expm1', 'fill', 'flatten', 'floor', 'full', 'full_like', 'gather', 'ge',
    'gt', 'histc', 'index_add', 'index_put', 'le', 'log', 'log1p', 'log_softmax', 'logical_and',
    'logical_not', 'logical_or', 'logsumexp', 'lt', 'masked.cumprod', 'masked.std', 'masked_fill',
    'max.binary', 'max.reduction_no_dim', 'max.reduction_with_dim', 'max_pool2d_with_indices_backward',
    'min.binary', 'min.reduction_no_dim', 'min.reduction_with_dim', 'minimum', 'mm', 'ne', 'new_empty',
    'new_full', 'new_ones', 'nn.functional.conv1d', 'nn.functional.cross_entropy', 'nn.functional.dropout',
    'nn.functional.embedding', 'nn.functional.gelu', 'nn.functional.layer_norm',
    'nn.functional.local_response_norm', 'nn.functional.multi_head_attention_forward',
    'nn.functional.multilabel_soft_margin_loss', 'nn.functional.normalize', 'nn.functional.relu',
    'nn.functional.rms_norm', 'nn.functional.scaled_dot_product_attention', 'nn.functional.silu',
    'nn.functional.softplus', 'nn.functional.tanhshrink', 'permute', 'polar', 'prod', 'reciprocal',
    'repeat_interleave', 'rsqrt', 'scalar_tensor', 'scatter', 'scatter_add', 'select', 'select_scatter',
    'sigmoid', 'sign', 'sin', 'slice', 'slice_scatter', 'sort', 'split', 'split.list_args', 'square',
    'squeeze', 'squeeze.multiple', 'stack', 'sum', 't', 'to', 'topk', 'unflatten', 'unravel_index',
    'view_as', 'view_as_complex', 'zeros', 'zeros_like',
) + ('byte', 'half', 'einsum', 'tril', 'triu', 'argsort', 'bincount', 'nonzero')  # casts whose rule differs by dtype; ops with rules added since


def _assert_sound(key: str, max_samples: int, limit: int) -> None:
    report = check_entry(key, max_samples, limit)
    problems = [f"wrong: {w}" for w in report.wrong] + [f"crash: {c}" for c in report.crashes]
    assert not problems, f"{key}: {len(report.wrong)} wrong, {len(report.crashes)} crashes of {report.checked} checked\n" + "\n".join(problems[:20])


@pytest.mark.parametrize("key", FAST_ENTRIES)
def test_opdb_samples_equal_single_device(key):
    _assert_sound(key, 1, FAST_LIMIT)


@pytest.mark.parametrize("key", ["nn.functional.embedding", "gather", "matmul", "__getitem__", "signal.windows.kaiser"])
def test_every_sample_of_entries_the_all_samples_run_caught(key):
    """Every sample (not only the first): embedding with ``sparse=True`` (a sparse gradient; now refused
    by name), gather of a 0-d tensor by a 2-d index (the rule indexed x's shape by the index's dim),
    matmul with a broadcast batch dim of size 1 (its operand was asked the other's batch shard),
    ``x[mask]`` with a sharded bool mask (treated as an integer index) and kaiser's sqrt of zeros
    under Partial (the harness's terms of a zero value did not cancel exactly)."""
    _assert_sound(key, None, 8)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(entries()))
def test_opdb_every_entry_equals_single_device(key):
    _assert_sound(key, SLOW_SAMPLES, SLOW_LIMIT)


@pytest.mark.slow
def test_fast_entries_reach_every_op():
    reached = {k: {str(t) for _, t, _ in calls(k, 1)} for k in sorted(entries())}
    every = set().union(*reached.values())
    fast = set().union(*(reached.get(k, set()) for k in FAST_ENTRIES))
    assert not every - fast, f"ops op_db reaches that FAST_ENTRIES do not: {sorted(every - fast)}"
