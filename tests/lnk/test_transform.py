"""Golden in-stage redistributions: the exact steps ``transform_steps`` plans (their string form is the
contract ``hgraph.passes.localize`` emits from), and the refusals."""

import pytest

from hgraph.core.errors import LayoutError
from hgraph.core.layout import InterleavedShard, Partial, Replicate, Shard, StridedShard
from hgraph.lnk import MeshDim, transform_steps

R, P = Replicate(), Partial()
STAGE = (MeshDim("cp", 2, "balanced"), MeshDim("tp", 2))
EXPERTS = (MeshDim("ep", 2, "fixed"), MeshDim("etp", 2))

CASES = {
    # tp: one collective per transition (Megatron's patterns)
    "row_parallel_sum": ((R, P), (R, R), (), "tp: all_reduce() (R,P) -> (R,R)"),
    "sequence_parallel_sum": ((R, P), (R, Shard(1)), (), "tp: reduce_scatter(1) (R,P) -> (R,S(1))"),
    "sequence_parallel_gather": (
        (R, Shard(1)), (R, R), (1,), "tp: all_gather(1, grad partial) (R,S(1)) -> (R,R)"),
    "column_parallel_input": ((R, R), (R, R), (1,), "tp: grad_all_reduce() (R,R) -> (R,R)"),
    "cut_replicated": ((R, R), (R, Shard(2)), (), "tp: local_chunk(2) (R,R) -> (R,S(2))"),
    "heads_to_tokens": ((R, Shard(2)), (R, Shard(1)), (), "tp: all_to_all(1, 2) (R,S(2)) -> (R,S(1))"),
    # blocked shards: whole in order first, or cut from the whole
    "fused_qkv_gathered": ((R, InterleavedShard(2, (8, 4, 4))), (R, R), (), """\
tp: all_gather(2) (R,S(2:8+4+4)) -> (R,R)
tp: block_order(2, 8+4+4) (R,R) -> (R,R)"""),
    "fused_qkv_cut": ((R, Shard(2)), (R, InterleavedShard(2, (8, 4, 4))), (), """\
tp: all_gather(2) (R,S(2)) -> (R,R)
tp: own_blocks(2, 8+4+4) (R,R) -> (R,S(2:8+4+4))"""),
    "head_rows_gathered": ((R, StridedShard(0, 16)), (R, R), (1,), """\
tp: all_gather(0, grad partial) (R,S(0/16)) -> (R,R)
tp: unstride(0, 16) (R,R) -> (R,R)"""),
    "head_rows_cut": ((R, R), (R, StridedShard(0, 16)), (), "tp: own_strided(0, 16) (R,R) -> (R,S(0/16))"),
    # cp: the load-balanced chunks r and 2n-1-r, permuted around the same collectives
    "cp_loss_sum": ((P, R), (R, R), (), "cp: all_reduce() (P,R) -> (R,R)"),
    "cp_tokens_gathered": ((Shard(1), R), (R, R), (), """\
cp: all_gather(1) (S(1),R) -> (R,R)
cp: natural_order(1) (R,R) -> (R,R)"""),
    "cp_tokens_cut": ((R, R), (Shard(1), R), (), """\
cp: balanced_order(1) (R,R) -> (R,R)
cp: local_chunk(1) (R,R) -> (S(1),R)"""),
    "cp_partial_scattered": ((P, R), (Shard(1), R), (), """\
cp: balanced_order(1) (P,R) -> (P,R)
cp: reduce_scatter(1) (P,R) -> (S(1),R)"""),
    "cp_tokens_to_heads": ((Shard(1), R), (Shard(2), R), (), """\
cp: balanced_order(2) (S(1),R) -> (S(1),R)
cp: all_to_all(2, 1) (S(1),R) -> (S(2),R)
cp: natural_order(1) (S(2),R) -> (S(2),R)"""),
    "tp_then_cp": ((P, Shard(2)), (R, R), (0, 1), """\
tp: all_gather(2, grad partial) (P,S(2)) -> (P,R)
cp: all_reduce() (P,R) -> (R,R)
cp: grad_all_reduce() (R,R) -> (R,R)"""),
    # tp cuts the dim cp changes: whole on tp around the cp step
    "cp_gather_under_tp_cut": ((Shard(1), Shard(1)), (R, Shard(1)), (), """\
tp: all_gather(1) (S(1),S(1)) -> (S(1),R)
cp: all_gather(1) (S(1),R) -> (R,R)
cp: natural_order(1) (R,R) -> (R,R)
tp: local_chunk(1) (R,R) -> (R,S(1))"""),
    "unchanged": ((Shard(1), Shard(2)), (Shard(1), Shard(2)), (), ""),
}


@pytest.mark.parametrize("name", list(CASES))
def test_golden_steps(name):
    src, dst, partial_grad, expected = CASES[name]
    steps = transform_steps(src, dst, STAGE, frozenset(partial_grad))
    assert "\n".join(map(str, steps)) == expected
    if steps:
        assert steps[0].src == src and steps[-1].dst == dst
        assert all(a.dst == b.src for a, b in zip(steps, steps[1:]))


def test_plans_are_cached_by_spec():
    assert transform_steps((Shard(1), R), (R, R), STAGE) is transform_steps((Shard(1), R), (R, R), STAGE)


def test_expert_rows_never_move():
    with pytest.raises(LayoutError, match=r"would need \(S\(0\),R\) -> \(R,R\) on ep; rows and weights split by expert"):
        transform_steps((Shard(0), R), (R, R), EXPERTS)
    assert [str(s) for s in transform_steps((Shard(0), P), (Shard(0), R), EXPERTS)] == ["etp: all_reduce() (S(0),P) -> (S(0),R)"]


def test_rows_merged_from_cp_tokens_are_refused():
    with pytest.raises(LayoutError, match=r"on cp; rows merged from cp-split tokens \(S\(d/k\)\) cannot be put back"):
        transform_steps((StridedShard(0, 2), R), (R, R), STAGE)


def test_nothing_makes_a_partial_value():
    with pytest.raises(LayoutError, match=r"from \(R,R\) into \(R,P\) by any communication"):
        transform_steps((R, R), (R, P), STAGE)
