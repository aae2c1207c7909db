"""Golden plans: the exact steps of the canonical transitions (str(plan) is the contract)."""

import pytest

from hgraph.core.layout import Layout, LayoutUnion
from hgraph.lnk import solve


def L(shape, ranks, mesh, placements):
    return Layout(shape, ranks, mesh, placements)


W = (0, 1, 2, 3)
TP2_1_1 = ((L((8, 4), (0, 1), (2,), ("S(0)",)), L((8, 4), (2,), (1,), ("R",)), L((8, 4), (3,), (1,), ("R",))))
ZERO = L((8, 4), W, (4,), ("S(0)",))

CASES = {
    "s_to_r": (
        L((8, 8), W, (4, ), ("S(0)", )), L((8, 8), W, (4, ), ("R", )),
        """\
reshard [8x8 S(0) mesh 4 ranks 0,1,2,3] -> [8x8 R mesh 4 ranks 0,1,2,3]: 768 bytes (lower bound 768), busiest rank 384
  all_gather dim0 group(0,1,2,3)""",
    ),
    "p_to_s": (
        L((8, 8), W, (4, ), ("P", )), L((8, 8), W, (4, ), ("S(0)", )),
        """\
reshard [8x8 P mesh 4 ranks 0,1,2,3] -> [8x8 S(0) mesh 4 ranks 0,1,2,3]: 768 bytes (lower bound 768), busiest rank 384
  reduce_scatter dim0 group(0,1,2,3)""",
    ),
    "p_to_r": (
        L((8, 8), W, (4, ), ("P", )), L((8, 8), W, (4, ), ("R", )),
        """\
reshard [8x8 P mesh 4 ranks 0,1,2,3] -> [8x8 R mesh 4 ranks 0,1,2,3]: 1536 bytes (lower bound 1536), busiest rank 768
  all_reduce group(0,1,2,3)""",
    ),
    "s0_to_s1": (
        L((8, 8), W, (4, ), ("S(0)", )), L((8, 8), W, (4, ), ("S(1)", )),
        """\
reshard [8x8 S(0) mesh 4 ranks 0,1,2,3] -> [8x8 S(1) mesh 4 ranks 0,1,2,3]: 192 bytes (lower bound 192), busiest rank 96
  all_to_all dim0->dim1 group(0,1,2,3)""",
    ),
    "r_to_s": (
        L((8, 8), W, (4, ), ("R", )), L((8, 8), W, (4, ), ("S(1)", )),
        """\
reshard [8x8 R mesh 4 ranks 0,1,2,3] -> [8x8 S(1) mesh 4 ranks 0,1,2,3]: 0 bytes (lower bound 0), busiest rank 0
  copy 0 [0:8, 0:2]
  copy 1 [0:8, 2:4]
  copy 2 [0:8, 4:6]
  copy 3 [0:8, 6:8]""",
    ),
    "same": (
        L((8, 8), W, (2, 2), ("S(0)", "R")), L((8, 8), W, (2, 2), ("S(0)", "R")),
        """\
reshard [8x8 S(0),R mesh 2x2 ranks 0,1,2,3] -> [8x8 S(0),R mesh 2x2 ranks 0,1,2,3]: 0 bytes (lower bound 0), busiest rank 0
  no-op""",
    ),
    "groups_2_to_4": (
        L((8, 8), (0, 1), (2, ), ("S(0)", )), L((8, 8), W, (4, ), ("S(0)", )),
        """\
reshard [8x8 S(0) mesh 2 ranks 0,1] -> [8x8 S(0) mesh 4 ranks 0,1,2,3]: 192 bytes (lower bound 192), busiest rank 192
  copy 0 [0:2, 0:8]
  send 0->1 [2:4, 0:8] phaseA
  send 1->2 [4:6, 0:8] phaseA
  send 1->3 [6:8, 0:8] phaseA""",
    ),
    "groups_4_to_2": (
        L((8, 8), W, (4, ), ("S(0)", )), L((8, 8), (0, 1), (2, ), ("S(1)", )),
        """\
reshard [8x8 S(0) mesh 4 ranks 0,1,2,3] -> [8x8 S(1) mesh 2 ranks 0,1]: 192 bytes (lower bound 192), busiest rank 128
  copy 0 [0:2, 0:4]
  copy 1 [2:4, 4:8]
  send 0->1 [0:2, 4:8] phaseA
  send 1->0 [2:4, 0:4] phaseA
  send 2->0 [4:6, 0:4] phaseA
  send 2->1 [4:6, 4:8] phaseA
  send 3->0 [6:8, 0:4] phaseA
  send 3->1 [6:8, 4:8] phaseA""",
    ),
    "groups_3_to_2": (
        L((6, 4), (0, 1, 2), (3, ), ("S(0)", )), L((6, 4), (3, 4), (2, ), ("S(0)", )),
        """\
reshard [6x4 S(0) mesh 3 ranks 0,1,2] -> [6x4 S(0) mesh 2 ranks 3,4]: 96 bytes (lower bound 96), busiest rank 48
  send 0->3 [0:2, 0:4] phaseA
  send 1->3 [2:3, 0:4] phaseA
  send 1->4 [3:4, 0:4] phaseA
  send 2->4 [4:6, 0:4] phaseA""",
    ),
    "disjoint": (
        L((8, 8), (0, 1), (2, ), ("S(0)", )), L((8, 8), (2, 3), (2, ), ("R", )),
        """\
reshard [8x8 S(0) mesh 2 ranks 0,1] -> [8x8 R mesh 2 ranks 2,3]: 512 bytes (lower bound 512), busiest rank 256
  send 0->2 [0:4, 0:8] phaseA
  send 0->3 [0:4, 0:8] phaseA
  send 1->2 [4:8, 0:8] phaseA
  send 1->3 [4:8, 0:8] phaseA""",
    ),
    "overlapping": (
        L((6, 4), (0, 1, 2), (3, ), ("P", )), L((6, 4), (1, 2, 3), (3, ), ("S(0)", )),
        """\
reshard [6x4 P mesh 3 ranks 0,1,2] -> [6x4 S(0) mesh 3 ranks 1,2,3]: 224 bytes (lower bound 224), busiest rank 128
  copy 1 [0:2, 0:4] add
  copy 2 [2:4, 0:4] add
  send 0->1 [0:2, 0:4] phaseA add
  send 0->2 [2:4, 0:4] phaseA add
  send 0->3 [4:6, 0:4] phaseA add
  send 1->2 [2:4, 0:4] phaseA add
  send 1->3 [4:6, 0:4] phaseA add
  send 2->1 [0:2, 0:4] phaseA add
  send 2->3 [4:6, 0:4] phaseA add""",
    ),
    "union_to_zero": (
        LayoutUnion(TP2_1_1, "duplicate"), ZERO,
        """\
reshard Union.duplicate([8x4 S(0) mesh 2 ranks 0,1] + [8x4 R mesh 1 ranks 2] + [8x4 R mesh 1 ranks 3]) -> [8x4 S(0) mesh 4 ranks 0,1,2,3]: 32 bytes (lower bound 32), busiest rank 32
  copy 0 [0:2, 0:4]
  copy 2 [4:6, 0:4]
  copy 3 [6:8, 0:4]
  send 0->1 [2:4, 0:4] phaseA""",
    ),
    "zero_to_union": (
        ZERO, LayoutUnion(TP2_1_1, "duplicate"),
        """\
reshard [8x4 S(0) mesh 4 ranks 0,1,2,3] -> Union.duplicate([8x4 S(0) mesh 2 ranks 0,1] + [8x4 R mesh 1 ranks 2] + [8x4 R mesh 1 ranks 3]): 288 bytes (lower bound 288), busiest rank 160
  copy 0 [0:2, 0:4]
  copy 2 [4:6, 0:4]
  copy 3 [6:8, 0:4]
  send 0->2 [0:2, 0:4] phaseA
  send 0->3 [0:2, 0:4] phaseA
  send 1->0 [2:4, 0:4] phaseA
  send 1->2 [2:4, 0:4] phaseA
  send 1->3 [2:4, 0:4] phaseA
  send 2->1 [4:6, 0:4] phaseA
  send 2->3 [4:6, 0:4] phaseA
  send 3->1 [6:8, 0:4] phaseA
  send 3->2 [6:8, 0:4] phaseA""",
    ),
    "partial_union_to_zero": (
        LayoutUnion(TP2_1_1, "partial"), ZERO,
        """\
reshard Union.partial([8x4 S(0) mesh 2 ranks 0,1] + [8x4 R mesh 1 ranks 2] + [8x4 R mesh 1 ranks 3]) -> [8x4 S(0) mesh 4 ranks 0,1,2,3]: 288 bytes (lower bound 288), busiest rank 160
  copy 0 [0:2, 0:4] add
  copy 2 [4:6, 0:4] add
  copy 3 [6:8, 0:4] add
  send 0->1 [2:4, 0:4] phaseA add
  send 1->2 [4:6, 0:4] phaseA add
  send 1->3 [6:8, 0:4] phaseA add
  send 2->0 [0:2, 0:4] phaseA add
  send 2->1 [2:4, 0:4] phaseA add
  send 2->3 [6:8, 0:4] phaseA add
  send 3->0 [0:2, 0:4] phaseA add
  send 3->1 [2:4, 0:4] phaseA add
  send 3->2 [4:6, 0:4] phaseA add""",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan(name):
    src, dst, expected = CASES[name]
    assert str(solve(src, dst)) == expected
