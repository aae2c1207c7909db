"""Interleaved shards (fused qkv / gate-up projections cut block by block): layout regions, Pull from
and Push to the ZeRO layout through LNK, golden plans and exact values."""

import pytest
import torch
from hgraph.runtime.kernels.simulate import simulate

from hgraph.errors import LayoutError
from hgraph.core.placement import InterleavedShard, parse_placement
from hgraph.core.layout import Layout, LayoutUnion
from hgraph.lnk import solve
from hgraph.lnk.pieces import assemble, local_shards

W = (0, 1, 2, 3)
ZERO = Layout((16, 2), W, (4,), ("S(0)",))
QKV_TP2 = Layout((16, 2), (0, 1), (2,), ("S(0:8+4+4)",))  # q: 8 rows, k and v: 4 rows each
VALUE = torch.arange(32.0).reshape(16, 2)


def test_placement_round_trips_and_validates():
    p = InterleavedShard(0, (8, 4, 4))
    assert str(p) == "S(0:8+4+4)" and parse_placement(str(p)) == p
    with pytest.raises(LayoutError, match="blocks summing to 12"):
        Layout((16, 2), (0, 1), (2,), (InterleavedShard(0, (4, 4, 4)),))
    with pytest.raises(LayoutError, match="two or more"):
        InterleavedShard(0, (16,))


def test_each_rank_holds_its_chunk_of_every_block():
    assert QKV_TP2.regions(1) == (((4, 8), (0, 2)), ((10, 12), (0, 2)), ((14, 16), (0, 2)))
    assert QKV_TP2.local_shape(1) == (8, 2)
    assert local_shards(QKV_TP2, VALUE)[1][:, 0].tolist() == [8, 10, 12, 14, 20, 22, 28, 30]
    with pytest.raises(LayoutError, match="use regions"):
        QKV_TP2.region(0)
    one = Layout((16, 2), (0,), (1,), ("S(0:8+4+4)",))  # a mesh of one: the blocks touch
    assert one.regions(0) == (((0, 16), (0, 2)),)


PULL = """\
reshard [16x2 S(0) mesh 4 ranks 0,1,2,3] -> [16x2 S(0:8+4+4) mesh 2 ranks 0,1]: 64 bytes (lower bound 64), busiest rank 32
  copy 0 [0:4, 0:2]
  copy 1 [4:8, 0:2]
  send 2->0 [8:10, 0:2] phaseA
  send 2->1 [10:12, 0:2] phaseA
  send 3->0 [12:14, 0:2] phaseA
  send 3->1 [14:16, 0:2] phaseA"""

PUSH = """\
reshard Union.partial([16x2 S(0:8+4+4) mesh 2 ranks 0,1] + [16x2 R mesh 2 ranks 2,3]) -> [16x2 S(0) mesh 4 ranks 0,1,2,3]: 128 bytes (lower bound 128), busiest rank 64
  copy 0 [0:4, 0:2] add
  copy 1 [4:8, 0:2] add
  copy 2 [8:12, 0:2] add
  copy 3 [12:16, 0:2] add
  send 0->2 [8:10, 0:2] phaseA add
  send 0->3 [12:14, 0:2] phaseA add
  send 1->2 [10:12, 0:2] phaseA add
  send 1->3 [14:16, 0:2] phaseA add
  send 2->0 [0:4, 0:2] phaseA add
  send 3->1 [4:8, 0:2] phaseA add"""


def test_pull_from_zero_golden_plan_and_values():
    plan = solve(ZERO, QKV_TP2)
    assert str(plan) == PULL
    assert plan.bytes_moved == plan.lower_bound_bytes == 8 * 2 * 4  # rows 8..15 live on ranks 2, 3
    out = simulate(plan, local_shards(ZERO, VALUE))
    expected = local_shards(QKV_TP2, VALUE)
    for rank in (0, 1):
        torch.testing.assert_close(out[rank], expected[rank], rtol=0, atol=0)


def test_push_to_zero_golden_plan_and_values():
    """Gradients of a tp2 pipeline (interleaved, ranks 0,1) and of another pipeline (ranks 2,3) are
    summed into the ZeRO shards."""
    dp = Layout((16, 2), (2, 3), (2,), ("R",))
    grads = LayoutUnion((QKV_TP2, dp), "partial")
    plan = solve(grads, ZERO)
    assert str(plan) == PUSH
    g_tp, g_dp = torch.randn(16, 2, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    shards = {**local_shards(QKV_TP2, g_tp), 2: g_dp.clone(), 3: g_dp.clone()}
    out = simulate(plan, shards)
    torch.testing.assert_close(assemble(ZERO, out), g_tp + g_dp, rtol=0, atol=1e-15)
