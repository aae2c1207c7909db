"""Golden in-stage redistributions: the exact steps ``transform_steps`` plans (their string form is the
contract ``hgraph.passes.localize`` emits from), the refusals, and every plan of plain placements on
cp2 x tp2 run by the collectives' definitions (the kernels themselves run them in tests/rules)."""

import itertools

import pytest
import torch

from hgraph.core.batch import load_balance_indices
from hgraph.errors import LayoutError
from hgraph.core.placement import InterleavedShard, Partial, Replicate, Shard, StridedShard
from hgraph.lnk import MeshDim, TransformStep, transform_steps

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


@pytest.mark.parametrize("src, dst", [
    ((Shard(1), R), (Shard(2), InterleavedShard(1, (2, 2)))),  # tp's blocks taken from a dim cp has cut
    ((P, InterleavedShard(1, (2, 2))), (Shard(1), InterleavedShard(1, (2, 2)))),  # tp's blocks kept under a cp cut
    ((Shard(1), R), (Shard(2), StridedShard(1, 2))),
])
def test_blocks_on_a_dim_another_mesh_dim_cuts_are_refused(src, dst):
    """Blocks and strides are counted on the whole dim: cutting them from a piece that the other mesh
    dim holds would split the wrong sizes (the rule suite's every-spec cases found this), so it is refused."""
    with pytest.raises(LayoutError, match=r"needs it whole, but (cp|tp) cuts it"):
        transform_steps(src, dst, STAGE)


def test_nothing_makes_a_partial_value():
    with pytest.raises(LayoutError, match=r"from \(R,R\) into \(R,P\) by any communication"):
        transform_steps((R, R), (R, P), STAGE)


# ----------------------------------------------------------------------------- every step list, run
SHAPE = (8, 8, 8)  # each dim cut into 2·cp chunks by cp and again by tp
COORDS = [(c, t) for c in range(STAGE[0].size) for t in range(STAGE[1].size)]
PLACEMENTS = [R, Shard(0), Shard(1), Shard(2)]


def _cut(full: torch.Tensor, spec, coord) -> torch.Tensor:
    """The piece of ``full`` at ``coord``: cp takes its load-balanced chunks, then tp its chunk of them."""
    out = full
    for m, p in enumerate(spec):
        if isinstance(p, Shard):
            n = STAGE[m].size
            if STAGE[m].order == "balanced":
                out = out.index_select(p.dim, load_balance_indices(out.shape[p.dim], n, coord[m]))
            else:
                out = out.chunk(n, p.dim)[coord[m]]
    return out


def _group(coord, m):
    """The coords that differ from ``coord`` only on mesh dim ``m``, in mesh order."""
    return [c for c in COORDS if all(c[k] == coord[k] for k in range(len(coord)) if k != m)]


def _permuted(x: torch.Tensor, dim: int, n: int, to_balanced: bool) -> torch.Tensor:
    chunks = x.chunk(2 * n, dim)
    balanced = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
    order = balanced if to_balanced else [balanced.index(c) for c in range(2 * n)]
    return torch.cat([chunks[i] for i in order], dim)


def _run(step: TransformStep, pieces: dict) -> dict:
    """Every rank's piece after ``step``: the collectives' definitions, on the ranks' pieces."""
    m = [d.name for d in STAGE].index(step.mesh_dim)
    n = STAGE[m].size
    out = {}
    for coord, x in pieces.items():
        group = [pieces[c] for c in _group(coord, m)]
        own = coord[m]
        if step.kind == "all_gather":
            out[coord] = torch.cat(group, step.dims[0])
        elif step.kind == "all_reduce":
            out[coord] = sum(group)
        elif step.kind == "reduce_scatter":
            out[coord] = sum(group).chunk(n, step.dims[0])[own]
        elif step.kind == "local_chunk":
            out[coord] = x.chunk(n, step.dims[0])[own]
        elif step.kind == "all_to_all":
            split_dim, cat_dim = step.dims
            out[coord] = torch.cat([g.chunk(n, split_dim)[own] for g in group], cat_dim)
        elif step.kind == "grad_all_reduce":
            out[coord] = x
        else:
            out[coord] = _permuted(x, step.dims[0], n, step.kind == "balanced_order")
    return out


@pytest.mark.parametrize("src_cp", PLACEMENTS + [P])
@pytest.mark.parametrize("src_tp", PLACEMENTS + [P])
def test_every_plan_delivers_the_destination(src_cp, src_tp):
    """Every (src, dst) of plain placements on cp2 x tp2, the steps run by their definitions on
    each rank's piece: each rank ends with its cut of the value (Partial sources as random terms)."""
    src = (src_cp, src_tp)
    full = torch.arange(float(torch.Size(SHAPE).numel())).reshape(SHAPE)
    partial = [m for m, p in enumerate(src) if isinstance(p, Partial)]
    gen = torch.Generator().manual_seed(0)
    noise = {c: torch.randn(SHAPE, generator=gen) for c in COORDS}
    for dst in itertools.product(PLACEMENTS, PLACEMENTS):
        pieces = {}
        for c in COORDS:  # terms: the value split unevenly over the Partial mesh dims
            terms = [k for k in COORDS if all(k[m] == c[m] for m in range(2) if m not in partial)]
            share = full / len(terms) + noise[c] - sum(noise[k] for k in terms) / len(terms)
            pieces[c] = _cut(share, src, c)
        for step in transform_steps(src, dst, STAGE):
            pieces = _run(step, pieces)
        for c in COORDS:
            torch.testing.assert_close(pieces[c], _cut(full, dst, c), msg=lambda s: f"{src} -> {dst} at {c}: {s}")
