"""The layout algebra: torch.chunk split rule, regions, terms, unions, and LayoutError on bad input."""

import pytest
import torch

from hgraph.errors import LayoutError
from hgraph.core.layout import chunk_bounds, Layout, LayoutUnion, sharded
from hgraph.core.placement import parse_placement, Partial, Replicate, Shard


def test_chunk_bounds_follow_torch_chunk():
    for size in range(0, 12):
        for parts in range(1, 6):
            pieces = torch.arange(size).chunk(parts)
            got = [chunk_bounds(size, parts, i) for i in range(parts)]
            want = [(int(p[0]), int(p[-1]) + 1) for p in pieces if len(p)]
            assert [g for g in got if g[0] < g[1]] == want


def test_regions_of_a_2d_mesh_cutting_one_dim_twice():
    lay = Layout((7, 4), (3, 1, 2, 0), (2, 2), ("S(0)", "S(0)"))
    regions = [lay.region(r) for r in lay.ranks]
    assert regions == [((0, 2), (0, 4)), ((2, 4), (0, 4)), ((4, 6), (0, 4)), ((6, 7), (0, 4))]
    assert lay.local_shape(0) == (1, 4)


def test_terms_and_placements_print_short():
    lay = Layout((4,), (0, 1, 2, 3), (2, 2), (Partial(), Replicate()))
    assert [lay.term(r) for r in lay.ranks] == [(0,), (0,), (1,), (1,)]
    assert str(lay) == "[4 P,R mesh 2x2 ranks 0,1,2,3]"
    assert parse_placement("S(1)") == Shard(1)


def test_split_union_offsets_regions():
    union = LayoutUnion((sharded((3, 2), (0, 1)), sharded((5, 2), (2,))), "split")
    assert union.shape == (8, 2)
    assert union.region(1) == ((2, 3), (0, 2)) and union.region(2) == ((3, 8), (0, 2))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Layout((4,), (0, 1, 2), (2,), ("S(0)",)), "mesh product must equal the number of ranks"),
        (lambda: Layout((4,), (0, 1), (2,), ("S(1)",)), r"shards dim 1 .*\(valid: 0\.\.0\)"),
        (lambda: Layout((4,), (0, 0), (2,), ("R",)), "contain duplicates"),
        (lambda: Layout((4,), (0, 1), (2,), ("R", "R")), "one placement per mesh dim"),
        (lambda: Layout((4,), (0, 1), (2,), ("Q",)), "cannot parse placement 'Q'"),
        (lambda: Partial("max"), "only Partial"),
        (lambda: LayoutUnion((sharded((4,), (0,)), sharded((4,), (0,))), "duplicate"), "disjoint ranks"),
        (lambda: LayoutUnion((sharded((4,), (0,)), sharded((5,), (1,))), "partial"), "same shape"),
        (lambda: LayoutUnion((sharded((4, 2), (0,)), sharded((4, 3), (1,))), "split"), "every dim but 0"),
        (lambda: LayoutUnion((sharded((4,), (0,)),), "mirror"), "hetero='mirror'"),
    ],
)
def test_bad_layouts_raise_layout_error(make, message):
    with pytest.raises(LayoutError, match=message):
        make()
