"""LNK: plan changes of layout (resharding) between any two layouts or unions (``solve``), and the
in-stage redistribution of a compiled program's values (``transform_steps``).

Pure planning: running a plan on ranks is the runtime's (``hgraph.runtime.kernels.reshard.execute``;
``hgraph.runtime.kernels.simulate.simulate`` runs one with every rank a thread).
"""

from hgraph.lnk.pieces import Piece, assemble, is_partial, local_shards, pieces_of
from hgraph.lnk.plan import AllGather, AllReduce, AllToAll, LocalCopy, ReduceScatter, ReshardPlan, Step, Transfer
from hgraph.lnk.rank_plan import RankPlan, solve_rank
from hgraph.lnk.solver import solve
from hgraph.lnk.topology import DEFAULT_TOPOLOGY, Topology
from hgraph.lnk.transform import MeshDim, TransformStep, transform_steps

__all__ = [
    "AllGather", "AllReduce", "AllToAll", "DEFAULT_TOPOLOGY", "LocalCopy", "MeshDim", "Piece", "ReduceScatter",
    "RankPlan", "ReshardPlan", "Step", "Topology", "Transfer", "TransformStep", "assemble", "is_partial",
    "local_shards", "pieces_of", "solve", "solve_rank", "transform_steps",
]
